"""Decoding from a table of each token's bytes, so that a run can let its `tokenizers` object go (and a
SentencePiece vocabulary, encoded by text/spm.py, never needs one).

A 152k byte-level vocabulary's tokenizer holds ~45 MiB and Gemma's 262k SentencePiece one far more; the
table holds each token's bytes in one blob (a few MiB). It decodes exactly as the tokenizer's decoder does
for the two decoders the GGUF tokenizers are built with (text/tokenizer.py, text/tokenizer_gguf.py):

- byte-level BPE (`decoders.ByteLevel`): each character of a token stands for one byte;
- SentencePiece (`Replace("▁", " ")`, `ByteFallback`, `Fuse`, optionally `Strip(" ", 1, 0)`): `▁` is a space,
  a `<0xNN>` token is that byte, a run of such bytes that is not UTF-8 is one U+FFFD per byte (what
  `ByteFallback` writes, where Python's decoder would write one per broken sequence), and `Strip` drops one
  leading space of the whole text (the space the encoder's dummy prefix added).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterable

from tokenizers import Tokenizer

SPACE = "\u2581"  # SentencePiece's ▁
_SPACE = SPACE.encode()


def byte_alphabet() -> list[tuple[int, str]]:
    """GPT-2's byte-level alphabet: (byte, the printable character it is written as), printable bytes first."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [(b, chr(c)) for b, c in zip(bs, cs)]


_TO_BYTE = {ch: b for b, ch in byte_alphabet()}  # a byte-level BPE spelling's character -> its byte


def fallback_byte(piece: str) -> int | None:
    """The byte a `<0xNN>` token stands for (what `decoders.ByteFallback` reads), else None."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return int(piece[3:5], 16)
        except ValueError:
            return None
    return None


def _spm_decoder(spec: dict) -> bool | None:
    """Whether a SentencePiece decoder strips the leading space (True/False); None if it is not one."""
    steps = spec.get("decoders") if spec.get("type") == "Sequence" else None
    if not steps:
        return None
    kinds = [s.get("type") for s in steps]
    replace = steps[0]
    if kinds[:3] != ["Replace", "ByteFallback", "Fuse"] or replace.get("pattern", {}).get("String") != SPACE:
        return None
    if replace.get("content") != " ":
        return None
    if kinds[3:] == []:
        return False
    strip = steps[3]
    if kinds[3:] == ["Strip"] and (strip.get("content"), strip.get("start"), strip.get("stop")) == (" ", 1, 0):
        return True
    return None


class ByteTable:
    """Each token's bytes in one blob, and what the decoder does with them, for a few MiB."""

    def __init__(self, blob: bytes, offsets, special: set[int], fallback: dict[int, int] | None, strip: bool):
        self.blob, self.offsets, self.special = blob, offsets, special
        self.fallback = fallback  # SentencePiece: id of a `<0xNN>` token -> its byte; None for byte-level BPE
        self.strip = strip

    @classmethod
    def of(cls, tok: Tokenizer, tokenizer_json: str | dict, vocab: int) -> "ByteTable | None":
        """The table of a byte-level BPE or SentencePiece BPE tokenizer (its JSON, or that parsed); None for any other
        (it keeps its tokenizer)."""
        spec = json.loads(tokenizer_json) if isinstance(tokenizer_json, str) else tokenizer_json
        if spec["model"].get("type") != "BPE":
            return None
        decoder = spec.get("decoder") or {}
        added = {a["id"]: a for a in spec.get("added_tokens", [])}
        special = {i for i, a in added.items() if a.get("special")}
        if decoder.get("type") == "ByteLevel":
            pieces = _byte_level(tok, added, vocab)
            return None if pieces is None else cls(*_packed(pieces), special, None, False)
        strip = _spm_decoder(decoder)
        if strip is None:
            return None
        pieces = (added[i]["content"] if i in added else tok.id_to_token(i) or "" for i in range(vocab))
        return cls.of_spm((p.encode() for p in pieces), special, strip)

    @classmethod
    def of_spm(cls, tokens: Iterable[bytes], special: set[int], strip: bool) -> "ByteTable":
        """The table of a SentencePiece vocabulary, each id's token in order as UTF-8 (text/spm.py's, or a
        `tokenizers` pipeline's): `special` the ids that `skip_special` drops, `strip` whether a text's first
        space goes."""
        blob, offsets, fallback = bytearray(), array("I", [0]), {}
        for i, token in enumerate(tokens):
            b = fallback_byte(token.decode()) if len(token) == 6 else None
            if b is not None:  # any token spelled so is a byte to the decoder, an added one too
                fallback[i] = b
            else:
                blob += token.replace(_SPACE, b" ")
            offsets.append(len(blob))
        return cls(bytes(blob), offsets, special, fallback, strip)

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        o, blob = self.offsets, self.blob
        ids = [i for i in ids if not (skip_special and i in self.special)]
        if self.fallback is None:
            return b"".join(blob[o[i] : o[i + 1]] for i in ids).decode("utf-8", errors="replace")
        out, run = [], bytearray()
        for i in ids:
            b = self.fallback.get(i)
            if b is not None:
                run.append(b)
                continue
            if run:
                out.append(_fallback_text(run))
                run = bytearray()
            out.append(blob[o[i] : o[i + 1]].decode("utf-8", errors="replace"))
        if run:
            out.append(_fallback_text(run))
        text = "".join(out)
        return text[1:] if self.strip and text.startswith(" ") else text


def _fallback_text(run: bytearray) -> str:
    """A run of `<0xNN>` bytes as `decoders.ByteFallback` writes it: its text, or one U+FFFD a byte."""
    try:
        return run.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


def byte_level_bytes(piece: str) -> bytes:
    """A byte-level BPE token's bytes from its spelling in GPT-2's alphabet; KeyError for a character outside it."""
    return bytes(_TO_BYTE[c] for c in piece)


def _byte_level(tok: Tokenizer, added: dict, vocab: int) -> list[bytes] | None:
    pieces = []
    for i in range(vocab):
        if i in added:  # added tokens decode to their text as it is
            pieces.append(added[i]["content"].encode())
            continue
        try:
            pieces.append(byte_level_bytes(tok.id_to_token(i) or ""))
        except KeyError:  # a token outside the byte alphabet: this table cannot stand in
            return None
    return pieces


def _packed(pieces: list[bytes]) -> tuple[bytes, array]:
    offsets, pos = array("I", [0]), 0
    for b in pieces:
        pos += len(b)
        offsets.append(pos)
    return b"".join(pieces), offsets
