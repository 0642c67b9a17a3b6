"""SentencePiece BPE without the `tokenizers` library: a GGUF's `llama` vocabulary encoded from its tokens, scores
and types alone, in a few tens of MiB where the `tokenizers` pipeline of Gemma's 262k vocabulary takes ~400.

The algorithm is SentencePiece's BPE, as llama.cpp runs it (`llm_tokenizer_spm_session`): the text's characters
are the symbols, and the adjacent pair whose concatenation is a normal piece of the vocabulary with the best
score is merged, again and again, from a heap. It gives the ids of the `tokenizers` pipeline that
text/tokenizer_gguf.py builds from the same fields (`spm_tokenizer`, whose merges rank each pair by its
piece's score) to the id, ties included: pieces of one score go in id order, two splits of one piece the longer
left part first, one pair at two places the leftmost first. Before that, as that pipeline does:

- the control tokens (and the unknown one), where the caller asks for special tokens, and the user-defined ones
  (Gemma's runs of spaces, tabs and newlines, HTML tags), are matched whole in the text first, the leftmost and
  then the longest, and the text between them is encoded on its own;
- there spaces are `▁`, with one `▁` before it where `add_space_prefix` (SentencePiece's dummy prefix);
- a character that is not a token is its UTF-8 bytes' `<0xNN>` tokens (the unknown token where one is missing).

A Gemma 4 GGUF (`tokenizer.ggml.model` = `gemma4`) holds the same kind of vocabulary with its merges, and llama.cpp
runs it as BPE (its `gemma4` pre-tokenizer): `MergesEncoder` merges the adjacent pair of best rank in the merges
instead, the lowest rank and then the leftmost, as `tokenizers`' BPE does, after splitting the text into runs of
newlines and runs of anything else; a run of newlines that is one token is that token. Everything else is the
above (whole-matched tokens, `▁` for spaces and no prefix, `<0xNN>` byte fallback).

A weight store keeps the vocabulary in `tokenizer.spm` (`SpmVocab.dumps`): the tokens, their scores and types,
the two settings, 5 MB for Gemma (and a Gemma 4 vocabulary's merges after them, 7 MB more), read in a fraction of
a second. Decoding is text/bytetable.py's (`ByteTable.of_spm`).
"""

from __future__ import annotations

import heapq
import json
import re
import sys
from array import array
from dataclasses import dataclass

from common.errors import CadenceError
from text.bytetable import SPACE

# SentencePiece token types, as llama.cpp's converter writes them in `tokenizer.ggml.token_type`.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
FILE = "tokenizer.spm"  # a weight store's SentencePiece vocabulary (`SpmVocab.dumps`)


MAGIC = b"cadence sentencepiece 1\n"  # FILE's first line; then a JSON line, the arrays and the tokens (`dumps`)


@dataclass
class SpmVocab:
    """A SentencePiece BPE vocabulary, what `SpmEncoder` needs: each id's token (UTF-8: bytes cost half what
    Python's strings of `▁` do), score and type, whether a text gets a `▁` before it, the unknown token's id; and
    for a `gemma4` one its merges, each `left right` as the GGUF writes it, best first (`MergesEncoder`)."""

    tokens: list[bytes]
    scores: array  # float32, as the GGUF holds them
    types: bytes
    add_space_prefix: bool
    unk_id: int | None
    merges: list[bytes] | None = None

    @classmethod
    def of(cls, tokens: list[str], scores, types, add_space_prefix: bool, unk_id: int | None, merges=None) -> SpmVocab:
        """From a GGUF's fields (tokens and merges as strings, scores and types as lists)."""
        n = len(tokens)
        if len(scores) != n or len(types) != n:
            raise ValueError(f"{n} tokens but {len(scores)} scores and {len(types)} token types")
        unk = int(unk_id) if unk_id is not None and 0 <= int(unk_id) < n else None
        pairs = None if merges is None else [m.encode() for m in merges]
        return cls([t.encode() for t in tokens], array("f", scores), bytes(types), bool(add_space_prefix), unk, pairs)

    def dumps(self) -> bytes:
        """FILE's bytes: MAGIC; a JSON line of the settings and the counts; then, little-endian, each token's end
        (uint32, from a leading 0), the scores (float32) and the types (uint8); then the tokens end to end; then,
        where there are merges (the JSON line counts them), each merge's end and the merges end to end."""
        head = {"tokens": len(self.tokens), "add_space_prefix": self.add_space_prefix, "unk_id": self.unk_id}
        tail = []
        if self.merges is not None:
            head["merges"] = len(self.merges)
            tail = [_little(_ends(self.merges)).tobytes(), *self.merges]
        arrays = [_little(_ends(self.tokens)).tobytes(), _little(self.scores).tobytes(), self.types]
        return b"".join([MAGIC, json.dumps(head).encode(), b"\n", *arrays, *self.tokens, *tail])

    @classmethod
    def loads(cls, data: bytes, origin: str, advice: str) -> SpmVocab:
        """What `dumps` wrote; one sentence naming `origin` where it is not that."""
        try:
            if not data.startswith(MAGIC):
                raise ValueError("it does not start as one")
            at = data.index(b"\n", len(MAGIC)) + 1
            head = json.loads(data[len(MAGIC) : at])
            n = head["tokens"]
            ends = _little(array("I", data[at : at + 4 * (n + 1)]))
            scores = _little(array("f", data[at + 4 * (n + 1) : at + 8 * n + 4]))
            types, at = data[at + 8 * n + 4 : at + 9 * n + 4], at + 9 * n + 4
            fits = len(ends) == n + 1 == len(scores) + 1 == len(types) + 1 and at + ends[-1] <= len(data)
            if not fits or ("merges" not in head and at + ends[-1] != len(data)):
                raise ValueError(f"{len(data)} bytes are not what its {n} tokens take")
            unk = head["unk_id"]
            if unk is not None and not (isinstance(unk, int) and 0 <= unk < n):
                raise ValueError(f"its unknown token {unk} is none of its {n}")
            tokens = [data[at + ends[i] : at + ends[i + 1]] for i in range(n)]
            merges, at = None, at + ends[-1]
            if "merges" in head:
                m = head["merges"]
                if not isinstance(m, int) or m < 0:
                    raise ValueError(f"its count of merges {m!r} is none")
                ends = _little(array("I", data[at : at + 4 * (m + 1)]))
                if len(ends) != m + 1 or at + 4 * (m + 1) + ends[-1] != len(data):
                    raise ValueError(f"{len(data)} bytes are not what its {n} tokens and {m} merges take")
                at += 4 * (m + 1)
                merges = [data[at + ends[i] : at + ends[i + 1]] for i in range(m)]
            return cls(tokens, scores, types, bool(head["add_space_prefix"]), unk, merges)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            what = f"no {e} entry" if isinstance(e, KeyError) else str(e)
            raise CadenceError(f"{origin} is not a SentencePiece vocabulary ({what}); {advice}") from None


def _ends(strings: list[bytes]) -> array:
    """Where each of `strings` ends when they are written end to end (uint32), from a leading 0."""
    ends, at = array("I", [0]), 0
    for t in strings:
        at += len(t)
        ends.append(at)
    return ends


def _little(a: array) -> array:
    """`a` in little-endian order (a copy where the machine is big-endian)."""
    if sys.byteorder == "little":
        return a
    b = array(a.typecode, a)
    b.byteswap()
    return b


def _alternation(words: list[str]) -> str:
    """A regex matching the longest of `words` at a place: their trie, written out (a group a branching, each
    end an optional tail), which `re` runs in a few microseconds where an alternation of thousands of words
    tries each in turn."""
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def walk(node: dict) -> str:
        branches = [re.escape(ch) + walk(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        if len(branches) == 1 and "" not in node:
            return branches[0]
        return "(?:" + "|".join(branches) + ")" + ("?" if "" in node else "")

    return walk(trie)


def whole_matcher(words: list[str]) -> re.Pattern | None:
    """A pattern finding `words` in a text, the leftmost first and there the longest (what the `tokenizers`
    library's added tokens and llama.cpp's special tokens do); None for no words."""
    words = sorted({w for w in words if w})
    if not words:
        return None
    try:
        return re.compile(_alternation(words))
    except (RecursionError, re.error):  # words nested deeper than `re` parses: longest first, tried in turn
        return re.compile("|".join(map(re.escape, sorted(words, key=len, reverse=True))))


_CHARS = re.compile(rb"[\x00-\x7f]|[\xc0-\xff][\x80-\xbf]*")  # a UTF-8 text's characters


class SpmEncoder:
    """Encodes text with a `SpmVocab`: a dict of each token's first id, the scores and types, two matchers."""

    def __init__(self, vocab: SpmVocab):
        tokens, n, kinds = vocab.tokens, len(vocab.tokens), vocab.types
        self.ids: dict[bytes, int] = dict(zip(reversed(tokens), range(n - 1, -1, -1)))  # a token's first id
        self.scores, self.types, self.prefix = vocab.scores, kinds, vocab.add_space_prefix
        self.unk = None if vocab.unk_id is None else tokens[vocab.unk_id]
        self.byte_tokens = [t if (t := b"<0x%02X>" % b) in self.ids else None for b in range(256)]
        self.user = [t.decode() for t, k in zip(tokens, kinds) if k == USER_DEFINED]
        self.control = [t.decode() for t, k in zip(tokens, kinds) if k in (CONTROL, UNKNOWN)]
        self.matchers = {True: whole_matcher(self.user + self.control)}  # special tokens or not: the other on use

    def encode(self, text: str, special: bool = True) -> list[int]:
        """The ids of `text`; `special`: control tokens written in it are those tokens (a chat template's
        `<start_of_turn>`), else they are text like any other. User-defined tokens are matched either way."""
        if special not in self.matchers:
            self.matchers[special] = whole_matcher(self.user + (self.control if special else []))
        matcher, ids, at = self.matchers[special], [], 0
        for m in matcher.finditer(text) if matcher is not None else ():
            if m.start() > at:
                ids += self.encode_piece(text[at : m.start()])
            ids.append(self.ids[m.group().encode()])
            at = m.end()
        if at < len(text):
            ids += self.encode_piece(text[at:])
        return ids

    def symbols(self, text: str) -> list[bytes]:
        """A text's characters as tokens: each one a token, or its bytes' `<0xNN>` tokens (the unknown token
        where a byte has none; dropped where there is none either), as `tokenizers`' BPE starts from them.
        That BPE writes an unknown token only when the next character that is a token comes (or the text
        ends), after the byte tokens of the characters between: so do we, to give its ids exactly. No real
        vocabulary meets it: SentencePiece's byte fallback has all 256 bytes (and llama.cpp fails without)."""
        data = ((SPACE + text) if self.prefix else text).replace(" ", SPACE).encode()
        out: list[bytes] = []
        ids, byte_tokens, unknown = self.ids, self.byte_tokens, 0
        for ch in _CHARS.findall(data):
            if ch in ids:
                out += [self.unk] * unknown
                out.append(ch)
                unknown = 0
                continue
            fallback = [byte_tokens[b] for b in ch]
            if None not in fallback:
                out += fallback
            elif self.unk is not None:
                out += [self.unk] * unknown
                unknown = 1
        return out + [self.unk] * unknown

    def encode_piece(self, text: str) -> list[int]:
        """The ids of a text with no whole-matched token in it: its symbols merged, the best pair first."""
        syms: list = self.symbols(text)
        n = len(syms)
        if n < 2:
            return [self.ids[s] for s in syms]
        nexts = list(range(1, n + 1))
        nexts[-1] = -1
        prevs = list(range(-1, n - 1))
        heap = [k for i in range(n - 1) if (k := self._pair(syms[i], syms[i + 1], i)) is not None]
        heapq.heapify(heap)
        while heap:
            _, _, _, pos, piece = heapq.heappop(heap)
            left, nxt = syms[pos], nexts[pos]
            if left is None or nxt < 0 or left + syms[nxt] != piece:  # merged away since: a stale pair
                continue
            syms[pos], syms[nxt] = piece, None
            nexts[pos] = after = nexts[nxt]
            if after >= 0:
                prevs[after] = pos
                if (k := self._pair(piece, syms[after], pos)) is not None:
                    heapq.heappush(heap, k)
            before = prevs[pos]
            if before >= 0 and (k := self._pair(syms[before], piece, before)) is not None:
                heapq.heappush(heap, k)
        ids = self.ids
        return [ids[s] for s in syms if s is not None]

    def _pair(self, left: bytes, right: bytes, pos: int) -> tuple | None:
        """The heap entry of merging `left` and `right` at `pos`, None where their concatenation is no normal
        piece. The order is `spm_merges`' rank (the piece's score, best first; its id; the longer left part
        first), then the place."""
        i = self.ids.get(left + right)
        if i is None or self.types[i] != NORMAL:
            return None
        return (-self.scores[i], i, len(right), pos, left + right)

    def token_id(self, token: str) -> int | None:
        return self.ids.get(token.encode())

    def bound(self) -> int:
        """The most bytes of text one token covers (a `<0xNN>` token's six overstate its one byte, the `▁` for a
        space's three its one: a lower bound of the token count stays one), for `TextTokenizer.min_tokens`; 0
        where a character may come to no token at all (no unknown token, and not every byte a token)."""
        if self.unk is None and None in self.byte_tokens:
            return 0
        longest = max(map(len, self.ids), default=1)
        return max(longest, 4 if self.unk is not None else 1)  # an unknown character, up to 4 bytes, is one token


_RUNS = re.compile(r"\n+|[^\n]+")  # llama.cpp's `gemma4` pre-tokenizer: runs of newlines, runs of anything else


class MergesEncoder(SpmEncoder):
    """Encodes text with a `gemma4` vocabulary (`SpmVocab.merges`), as llama.cpp's BPE session does with the
    `gemma4` pre-tokenizer: each run of newlines and each run of anything else on its own, a run of newlines
    that is one token that token, and the rest merged by rank, the adjacent pair earliest in the merges first
    (the leftmost of equals). The ranks are a dict keyed by the merges as the file writes them: the text's
    spaces are `▁` by then, so `left right` names the pair as llama.cpp's reading of the line does."""

    def __init__(self, vocab: SpmVocab):
        super().__init__(vocab)
        self.ranks: dict[bytes, int] = {}
        for rank, merge in enumerate(vocab.merges or ()):
            self.ranks.setdefault(merge, rank)  # a merge listed twice keeps its first rank, as llama.cpp's does

    def encode_piece(self, text: str) -> list[int]:
        ids: list[int] = []
        for run in _RUNS.findall(text):
            whole = self.ids.get(run.encode()) if run[0] == "\n" else None
            ids += super().encode_piece(run) if whole is None else [whole]
        return ids

    def _pair(self, left: bytes, right: bytes, pos: int) -> tuple | None:
        """The heap entry of merging `left` and `right` at `pos` (its rank, then the place), None where they
        are no merge, or one making no token (llama.cpp would spell that one in bytes; no real file has one)."""
        rank = self.ranks.get(left + b" " + right)
        if rank is None or left + right not in self.ids:
            return None
        return (rank, 0, 0, pos, left + right)


def encoder(vocab: SpmVocab) -> SpmEncoder:
    """The encoder of a vocabulary: by its merges where it has them (`gemma4`), else by its scores."""
    return MergesEncoder(vocab) if vocab.merges is not None else SpmEncoder(vocab)
