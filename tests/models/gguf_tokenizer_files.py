"""Tokenizer-only GGUF files, written as llama.cpp's converter writes them, from an HF tokenizer saved in a folder.

The vocabulary as convert_hf_to_gguf.py builds it (`_create_vocab_sentencepiece` in conversion/base.py for a
SentencePiece model, `get_vocab_base` for byte-level BPE, `Gemma4Model.set_vocab` in conversion/gemma.py for Gemma
4's BPE with byte fallback), and the rest through gguf-py's own `SpecialVocab` (the BOS/EOS/UNK/PAD ids, the
add-BOS/EOS flags, the merges, the chat template), with `gguf.GGUFWriter`.
"""

from __future__ import annotations

import json
from pathlib import Path

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def looks_special(token: str) -> bool:
    """llama.cpp's `does_token_look_special`: added tokens it makes control ones whatever HF says."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def spm_vocab(model_file: Path, folder: Path) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types) of a SentencePiece model as `_create_vocab_sentencepiece` writes them: the model's
    pieces and types, then the HF tokenizer's added tokens (saved in `folder`) over them (special ones control,
    the others user-defined with `▁` written as a space), each scored -1000."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        kind = NORMAL
        if sp.IsUnknown(i):
            kind = UNKNOWN
        elif sp.IsControl(i):
            kind = CONTROL
        elif sp.IsUnused(i):
            kind = UNUSED
        elif sp.IsByte(i):
            kind = BYTE
        tokens.append(sp.IdToPiece(i))
        scores.append(sp.GetScore(i))
        types.append(kind)
    for i, data in _added_tokens(folder).items():
        token = data["content"]
        if i >= len(tokens):
            continue
        if data.get("special") or looks_special(token):
            types[i] = CONTROL
        else:
            token, types[i] = token.replace("\u2581", " "), USER_DEFINED
        scores[i], tokens[i] = -1000.0, token
    return tokens, scores, types


def _added_tokens(folder: Path) -> dict[int, dict]:
    """tokenizer_config.json's `added_tokens_decoder`, which the converter reads; transformers 5 writes the same
    entries in tokenizer.json's `added_tokens` instead."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if "added_tokens_decoder" in config:
        return {int(k): v for k, v in config["added_tokens_decoder"].items()}
    return {a["id"]: a for a in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]}


def bpe_vocab(hf) -> tuple[list[str], list[int]]:
    """(tokens, types) of an HF byte-level tokenizer as `get_vocab_base` writes them: added tokens control where
    special (or looking so), else user-defined."""
    reverse = {i: t for t, i in hf.get_vocab().items()}
    added, decoder = hf.get_added_vocab(), hf.added_tokens_decoder
    tokens, types = [], []
    for i in range(len(reverse)):
        token = reverse[i]
        if token in added:
            if not decoder[i].normalized:
                token = hf.decode(hf.encode(token, add_special_tokens=False))
            types.append(CONTROL if decoder[i].special or looks_special(token) else USER_DEFINED)
        else:
            types.append(NORMAL)
        tokens.append(token)
    return tokens, types


# Tokens Gemma 4's converter makes user-defined so that they are always written out (its chat parser reads them).
GEMMA4_VISIBLE = (
    "<|channel>",
    "<channel|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    '<|"|>',
)


def gemma4_vocab(folder: Path) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types) of the HF tokenizer saved in `folder` (a BPE with byte fallback) as
    `Gemma4Model.set_vocab` writes them: gguf-py's `LlamaHfVocab` (`<0xNN>` tokens byte ones, the tokenizer's
    special tokens control, every other token normal, each scored -1000), `GEMMA4_VISIBLE` user-defined."""
    import gguf

    vocab = gguf.LlamaHfVocab(folder)
    tokens, scores, types = [], [], []
    for text, score, kind in vocab.all_tokens():
        tokens.append(text.decode())
        scores.append(score)
        types.append(USER_DEFINED if text.decode() in GEMMA4_VISIBLE else int(kind))
    assert len(tokens) == vocab.vocab_size
    return tokens, scores, types


def write_tokenizer_gguf(
    path: Path,
    folder: Path,
    arch: str,
    kind: str,
    tokens: list[str],
    types: list[int],
    *,
    scores: list[float] | None = None,
    pre: str = "default",
    space_prefix: bool | None = None,
) -> dict:
    """A GGUF holding only the tokenizer (and the architecture's name); its fields as formats/gguf_file.py reads
    them. `space_prefix`: `tokenizer.ggml.add_space_prefix`, written only where not None (Gemma's converter
    writes False; Llama's writes nothing). A `gemma4` one gets its merges and the add-BOS flag set, as
    `Gemma4Model.set_vocab` writes them after `SpecialVocab`'s."""
    import gguf

    from formats.gguf_file import GGUFFile

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model(kind)
    if kind != "gemma4":  # Gemma 4's converter writes none: llama.cpp gives it its own
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_token_types(types)
    if space_prefix is not None:
        w.add_add_space_prefix(space_prefix)
    gguf.SpecialVocab(folder, load_merges=kind in ("gpt2", "gemma4"), n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
    if kind == "gemma4":
        w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path).fields
