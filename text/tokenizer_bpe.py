"""A GGUF's byte-level BPE vocabulary (tokens, types, merges) as a `tokenizers` Tokenizer, split before merging as the
llama.cpp pre-tokenizer its `tokenizer.ggml.pre` names does it (each regex as the family's HF tokenizer.json has it)."""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from common.errors import CadenceError
from text.spm import CONTROL, USER_DEFINED

# Split regexes by llama.cpp pre-tokenizer name (`tokenizer.ggml.pre`), each as the family's HF tokenizer.json has it.
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Llama 3's, which is tiktoken's cl100k: DBRX's, OLMo 2's, Phi-4's and Granite 4's (all written `dbrx`).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen 3.5's: Qwen 2's with combining marks kept in words
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral Nemo's tekken: a word is its capitals and then its small letters, digits one by one.
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tiktoken's o200k (`gpt-4o`): Phi-4-mini's.
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "lfm2": _LLAMA3,
    "qwen35": _QWEN35,
    "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3,
    "tekken": _TEKKEN,
    "gpt-4o": _GPT4O,
}
# Where llama.cpp skips the merges for a word that is a token whole, as these families' tokenizer.json do.
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "tekken", "lfm2"}
_NFC = {"qwen2", "deepseek-r1-qwen", "qwen35"}
# GPT-2's byte-level regex, with digits split one by one first: StarCoder's, SmolLM's, Granite 3's (`refact`).
_GPT2_DIGITS = {"smollm", "starcoder", "refact"}
_GPT2 = {"gpt2", "gpt-2", "phi-2", "default", "olmo"}
GGUF_PRE_TOKENIZERS = frozenset(_SPLITS) | _GPT2_DIGITS | _GPT2  # the `tokenizer.ggml.pre` names read here


def _pre_tokenizer(pre: str):
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in _GPT2_DIGITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raise CadenceError(
        f"the GGUF's tokenizer pre-tokenizer '{pre}' is not supported; convert from an HF directory with tokenizer.json instead"
    )


def tokenizer_from_gguf_fields(tokens: list[str], token_types: list[int], merges: list[str], pre: str) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=pairs,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre in _IGNORE_MERGES,
        )
    )
    if pre in _NFC:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    types = list(token_types) if token_types else [1] * len(tokens)
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty == CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    )
    return tok
