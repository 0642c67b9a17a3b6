"""Text to tokens and back: the tokenizers (a `tokenizers` JSON, a GGUF's BPE or SentencePiece vocabulary),
decoding from a byte table, and the checks a text passes before it is read."""
