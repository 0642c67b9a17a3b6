"""A byte-level BPE encoder in a few MiB, for a process that keeps encoding while a model streams beside it
(`launch serve`, `launch chat`, cadence.LLM): the same ids as `tokenizers`, without its object.

`tokenizers` holds Qwen's 152k vocabulary in ~46 MiB (three hash maps of strings, the merges, the added
vocabulary's automata). Under a memory budget those are a resident layer's pages. BPE needs less: a piece of
text starts as one id per byte, and a merge turns a pair of ids into one. This encoder keeps each merge as a
pair's key, its rank and the id it makes in sorted numpy arrays (16 bytes a merge, 2.4 MiB for Qwen's 151k),
and merges every piece of a text at once: a round finds, in each piece, its pairs' lowest rank and merges
that pair's occurrences left to right (what `tokenizers`' queue of merges does for merges in the order
training made them).

It reads the pipelines of the byte-level vocabularies models ship (Qwen, Llama 3, SmolLM, GPT-2 and their
kin) and returns None from `of` for anything else, which then keeps its `tokenizers` object:
- normalizer: none, or NFC;
- pre-tokenizer: `Split` by a regex or a string (isolated, not inverted) and `Digits`, then `ByteLevel` last
  (GPT-2's split or none, no prefix space), alone or in a `Sequence`;
- model: BPE without dropout, unknown token, word prefix or suffix, or byte fallback, its merges in the order
  training made them (a merge after those that make its parts; a pair listed twice merges at its last rank); with
  `ignore_merges` (Llama 3) a piece that is a token is that token;
- added tokens, found in the raw text (or the normalized text, for a normalized one), the longest at the
  leftmost place first, none stripping spaces or matching single words only, none a model token of another id;
- no truncation or padding.
`tests/models/test_bytebpe.py` checks the ids against `tokenizers` on real vocabularies and on random text.
"""

from __future__ import annotations

import json
import unicodedata

import numpy as np
import regex

from text.bytetable import byte_alphabet

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_NONE = np.iinfo(np.int64).max  # a pair no merge makes


def _splits(spec: dict | None) -> list[regex.Pattern] | None:
    """The pre-tokenizer as regexes whose matches, and the text between them, are its pieces; None where a step
    is not one read here."""
    if spec is None:
        return []
    steps = spec["pretokenizers"] if spec.get("type") == "Sequence" else [spec]
    out = []
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            if step.get("add_prefix_space"):
                return None
            if step.get("use_regex", True):
                out.append(regex.compile(GPT2_SPLIT))
        elif kind == "Digits":
            out.append(regex.compile(r"\p{N}" if step.get("individual_digits") else r"\p{N}+"))
        elif kind == "Split" and step.get("behavior") == "Isolated" and not step.get("invert"):
            pattern = step.get("pattern") or {}
            if "Regex" in pattern:
                out.append(regex.compile(pattern["Regex"]))
            elif "String" in pattern:
                out.append(regex.compile(regex.escape(pattern["String"])))
            else:
                return None
        else:
            return None
    if steps[-1].get("type") != "ByteLevel" or sum(s.get("type") == "ByteLevel" for s in steps) != 1:
        return None  # not byte-level, or a step after it (which would read the byte-level characters, not the text)
    return out


def _split(text: str, rx: regex.Pattern) -> list[str]:
    out, at = [], 0
    for m in rx.finditer(text):
        if m.start() > at:
            out.append(text[at : m.start()])
        if m.end() > m.start():
            out.append(m.group())
        at = m.end()
    if at < len(text):
        out.append(text[at:])
    return out


def _alternation(tokens: dict[str, int]) -> regex.Pattern | None:
    """One regex that finds the added tokens, the longest first where two start at one place."""
    if not tokens:
        return None
    return regex.compile("|".join(regex.escape(t) for t in sorted(tokens, key=len, reverse=True)))


class ByteBpe:
    def __init__(self, spec: dict, splits: list[regex.Pattern]):
        model = spec["model"]
        vocab: dict[str, int] = model["vocab"]
        self.rows = max(vocab.values(), default=0) + 1
        self.nfc = spec.get("normalizer") is not None
        self.splits = splits
        # a byte whose character is not a token is dropped, as `tokenizers` does without an unknown token
        self.byte_ids = np.array([vocab.get(ch, -1) for _, ch in sorted(byte_alphabet())], np.int64)
        merges = [m.split(" ", 1) if isinstance(m, str) else m for m in model["merges"]]
        keys = np.fromiter((vocab[a] * self.rows + vocab[b] for a, b in merges), np.int64, len(merges))
        made = np.fromiter((vocab[a + b] for a, b in merges), np.int64, len(merges))
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        last = np.ones(len(keys), bool)  # a pair listed twice merges at its last rank, as `tokenizers`' map keeps it
        last[:-1] = keys[1:] != keys[:-1]
        self.keys, self.ranks, self.made = keys[last], order[last].astype(np.int64), made[order][last]
        # merges in the order training made them: a merge ranks after every merge that makes one of its parts. Then
        # a pair that a merge forms never outranks it, and merging a rank's every occurrence in a round is what
        # `tokenizers`' queue does (a file where this does not hold keeps `tokenizers`)
        newest = np.full(self.rows, -1, np.int64)
        np.maximum.at(newest, self.made, self.ranks)
        parts = self.keys // self.rows, self.keys % self.rows
        if not all((newest[p] < self.ranks).all() for p in parts):
            raise ValueError("merges out of training order")
        self.whole = None  # ignore_merges: (hashes of the tokens' bytes, sorted; their ids)
        if model.get("ignore_merges"):
            to_byte = {ch: b for b, ch in byte_alphabet()}
            spelled = sorted(
                (hash(bytes(to_byte[c] for c in t)), i) for t, i in vocab.items() if all(c in to_byte for c in t)
            )
            self.whole = (np.array([h for h, _ in spelled], np.int64), np.array([i for _, i in spelled], np.int64))
        added = [a for a in spec.get("added_tokens") or [] if a["content"]]
        raw = {a["content"]: a["id"] for a in added if not a.get("normalized")}
        norm = {self._normal(a["content"]): a["id"] for a in added if a.get("normalized")}
        self.raw, self.norm = raw, norm
        self.raw_rx, self.norm_rx = _alternation(raw), _alternation(norm)

    @classmethod
    def of(cls, tokenizer_json: str | dict) -> "ByteBpe | None":
        """The encoder of a tokenizer.json's pipeline, or None where it is not one read here."""
        spec = json.loads(tokenizer_json) if isinstance(tokenizer_json, str) else tokenizer_json
        model, norm = spec.get("model") or {}, spec.get("normalizer")
        if model.get("type") != "BPE" or model.get("dropout") or model.get("unk_token") or model.get("byte_fallback"):
            return None
        if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            return None
        if norm is not None and norm.get("type") != "NFC" or spec.get("truncation") or spec.get("padding"):
            return None
        if any(a.get(k) for a in spec.get("added_tokens") or [] for k in ("lstrip", "rstrip", "single_word")):
            return None
        splits = _splits(spec.get("pre_tokenizer"))
        if splits is None:
            return None
        vocab = model.get("vocab") or {}
        if any(vocab.get(a["content"], a["id"]) != a["id"] for a in spec.get("added_tokens") or []):
            return None  # an added token that is also a token of the model's under another id
        try:
            return cls(spec, splits)
        except (KeyError, ValueError):  # a merge whose parts or product are not tokens, or out of training order
            return None

    def _normal(self, text: str) -> str:
        return unicodedata.normalize("NFC", text) if self.nfc else text

    def encode(self, text: str) -> list[int]:
        """The ids of `text` (no BOS: the tokenizer adds it), as `tokenizers`' `encode(text, add_special_tokens=False)`."""
        pieces: list[str | int] = []  # a piece of text to merge, or an added token's id
        for part in self._added(text, self.raw_rx, self.raw):
            if isinstance(part, int):
                pieces.append(part)
                continue
            for sub in self._added(self._normal(part), self.norm_rx, self.norm):
                if isinstance(sub, int):
                    pieces.append(sub)
                    continue
                words = [sub]
                for rx in self.splits:
                    words = [w for word in words for w in _split(word, rx)]
                pieces.extend(words)
        return self._merge(pieces)

    @staticmethod
    def _added(text: str, rx: regex.Pattern | None, ids: dict[str, int]) -> list[str | int]:
        if rx is None:
            return [text] if text else []
        out: list[str | int] = []
        at = 0
        for m in rx.finditer(text):
            if m.start() > at:
                out.append(text[at : m.start()])
            out.append(ids[m.group()])
            at = m.end()
        if at < len(text):
            out.append(text[at:])
        return out

    def _merge(self, pieces: list[str | int]) -> list[int]:
        """Every piece merged at once: ids of their bytes, then rounds of each piece's best merge."""
        done_ids, done_owner = [], []  # finished pieces' ids and their piece's index, in any order
        words = [(i, p.encode()) for i, p in enumerate(pieces) if not isinstance(p, int)]
        fixed = [(i, p) for i, p in enumerate(pieces) if isinstance(p, int)]
        if self.whole is not None and words:  # ignore_merges: a piece that is a token is that token
            hashes, wids = self.whole
            h = np.fromiter((hash(b) for _, b in words), np.int64, len(words))
            at = np.minimum(np.searchsorted(hashes, h), len(hashes) - 1)
            hit = hashes[at] == h
            fixed += [(words[k][0], int(wids[at[k]])) for k in np.nonzero(hit)[0]]
            words = [w for w, found in zip(words, hit) if not found]
        if fixed:
            done_owner.append(np.array([i for i, _ in fixed], np.int64))
            done_ids.append(np.array([t for _, t in fixed], np.int64))
        if words:
            lens = np.fromiter((len(b) for _, b in words), np.int64, len(words))
            ids = self.byte_ids[np.frombuffer(b"".join(b for _, b in words), np.uint8)]
            owner = np.repeat(np.array([i for i, _ in words], np.int64), lens)
            if (ids < 0).any():
                ids, owner = ids[ids >= 0], owner[ids >= 0]
            self._rounds(ids, owner, len(pieces), done_ids, done_owner)
        if not done_ids:
            return []
        ids, owner = np.concatenate(done_ids), np.concatenate(done_owner)
        return ids[np.argsort(owner, kind="stable")].tolist()

    def _rounds(self, ids, owner, n: int, done_ids: list, done_owner: list) -> None:
        keys = self.keys
        while len(ids):
            same = owner[1:] == owner[:-1]
            key = ids[:-1] * self.rows + ids[1:]
            at = np.minimum(np.searchsorted(keys, key), len(keys) - 1)
            hit = same & (keys[at] == key) if len(keys) else np.zeros(len(key), bool)
            rank = np.where(hit, self.ranks[at] if len(keys) else 0, _NONE)
            best = np.full(n, _NONE, np.int64)
            np.minimum.at(best, owner[:-1], rank)
            finished = best[owner] == _NONE  # pieces with nothing left to merge leave the rounds
            cand = hit & (rank == best[owner[:-1]])
            idx = np.arange(len(cand))
            start = np.maximum.accumulate(np.where(cand, -1, idx))  # the pair before a run of candidates
            take = np.nonzero(cand & ((idx - start) % 2 == 1))[0]  # a run of one pair (x x x): left to right
            ids[take] = self.made[at[take]]
            keep = ~finished
            keep[take + 1] = False
            if finished.any():
                done_ids.append(ids[finished])
                done_owner.append(owner[finished])
            ids, owner = ids[keep], owner[keep]
