"""What the tokenizer checks before it reads a text: that it is UTF-8 (in one sentence naming the text where
it is not), and how few tokens it can hold at least, from its length alone (`TooLong` in O(1) for a text
that cannot fit)."""

from __future__ import annotations

import json
import math
from collections import deque

from tokenizers import Tokenizer, models

from common.errors import CadenceError


class TooLong(CadenceError):
    """A text with more tokens than its caller can take: `tokens` (a lower bound unless `exact`) over `limit`."""

    def __init__(self, name: str, tokens: int, limit: int, exact: bool):
        self.name, self.tokens, self.limit, self.exact = name, tokens, limit, exact
        super().__init__(
            f"{name} has {'' if exact else 'at least '}{tokens} tokens, more than the context's {limit}; shorten it"
        )


def checked_text(text: str | bytes, name: str) -> tuple[str, int]:
    """(`text` as the str the tokenizer takes, its UTF-8 bytes), or one CadenceError calling it `name` where it
    is not UTF-8: bytes that do not decode, or a str with a lone surrogate (see `TextTokenizer.encode`)."""
    if isinstance(text, (bytes, bytearray)):
        try:
            return text.decode("utf-8"), len(text)
        except UnicodeDecodeError as e:
            raise CadenceError(
                f"{name} is not valid UTF-8 (byte {e.start} is 0x{text[e.start]:02x}: {e.reason}); "
                "give it as UTF-8 text"
            ) from None
    if not isinstance(text, str):
        raise CadenceError(f"{name} is {type(text).__name__}, not text")
    if text.isascii():  # O(1): CPython knows it
        return text, len(text)
    try:
        return text, len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        cp = ord(text[e.start])
        what = (
            f"the byte 0x{cp - 0xDC00:02x}, which does not decode as UTF-8"
            if 0xDC80 <= cp <= 0xDCFF
            else f"U+{cp:04X}, half of a UTF-16 surrogate pair without its other half"
        )  # (surrogateescape's)
        raise CadenceError(
            f"{name} is not valid UTF-8 (character {e.start} is {what}); give it as UTF-8 text"
        ) from None


def check_strings(pairs: list[tuple[object, str]]) -> None:
    """`checked_text` on every string in (value, name) pairs and inside them (content parts), named by path;
    the first bad one in order is named."""
    queue = deque(pairs)
    while queue:  # no recursion: a client's nesting depth is not ours to overflow on
        v, path = queue.popleft()
        if isinstance(v, str):
            checked_text(v, path)
        elif isinstance(v, dict):
            queue.extend((x, f"{path}.{k}") for k, x in v.items())
        elif isinstance(v, (list, tuple)):
            queue.extend((x, f"{path}[{j}]") for j, x in enumerate(v))


# How many times a normalizer may shrink a text's UTF-8 bytes. NFC composes at most 3.5 bytes into one
# (U+0390: a 3-byte iota, then U+0344 that decomposes to the two marks; tests/models/test_tokenizer.py
# recomputes it); 4 leaves room for compositions a later Unicode than Python's may add.
NFC_SHRINK = 4


def token_bound(tok: Tokenizer) -> tuple[int, int]:
    """(the most bytes one token covers, how many times the normalizer may shrink a text): what `min_tokens`
    divides by; (0, 0) where the pipeline may drop text (then no bound holds). Byte-level BPE spells each
    byte as one character; other BPE vocabularies are measured in UTF-8, which can only overstate."""
    norms = _flat(json.loads(tok.normalizer.__getstate__()), "normalizers") if tok.normalizer is not None else []
    shrink = math.prod(_shrink(n) or 0 for n in norms) or None
    pre = _flat(json.loads(tok.pre_tokenizer.__getstate__()), "pretokenizers") if tok.pre_tokenizer is not None else []
    model = tok.model
    fused = isinstance(model, models.BPE) and model.unk_token and model.fuse_unk  # unknown characters: one token a run
    if shrink is None or not all(map(_keeps_text, pre)) or not isinstance(model, models.BPE) or fused:
        return 0, 0  # a normalizer or a split that may drop text, or a model not known here
    byte_level = any(p["type"] == "ByteLevel" for p in pre)
    vocab = tok.get_vocab(with_added_tokens=False)
    longest = max((len(t) if byte_level else len(t.encode()) for t in vocab), default=1)
    for added in tok.get_added_tokens_decoder().values():
        text = tok.normalizer.normalize_str(added.content) if added.normalized and tok.normalizer else added.content
        longest = max(longest, len(text.encode()))
    return max(longest, 4 if model.unk_token else 1), shrink  # an unknown character (up to 4 bytes) is one token


def _flat(spec: dict, key: str) -> list[dict]:
    """The steps of a normalizer or pre-tokenizer, Sequences opened."""
    return [x for part in spec[key] for x in _flat(part, key)] if spec.get("type") == "Sequence" else [spec]


def _shrink(spec: dict) -> int | None:
    """How many times a normalizer step may shrink a text; None: not known here."""
    kind = spec.get("type")
    if kind == "Replace":  # a string for one no shorter (SentencePiece's space to U+2581) only grows a text
        pattern = spec["pattern"].get("String")
        return 1 if pattern is not None and len(spec["content"].encode()) >= len(pattern.encode()) else None
    return {"NFC": NFC_SHRINK, "Prepend": 1}.get(kind)


def _keeps_text(spec: dict) -> bool:
    """Whether a pre-tokenizer step keeps every byte (it splits, or maps bytes to characters, but drops nothing)."""
    if spec["type"] in ("Split", "Punctuation"):
        return spec.get("behavior") != "Removed"
    return spec["type"] in ("ByteLevel", "Digits", "Metaspace")
