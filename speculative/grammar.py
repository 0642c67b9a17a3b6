"""Output held to a grammar: a JSON schema, a Lark or a GBNF grammar, compiled and matched by llguidance.

Why llguidance (over xgrammar, the other engine vLLM and SGLang use): abi3 CPU wheels for Linux x86-64 and
aarch64, macOS and Windows (no torch or CUDA pulled in), MIT, a mask in 20-200 us for a 152k vocabulary with
no compile step a schema waits for (xgrammar compiles each schema ahead, 0.1-1 s for a large vocabulary), and a
matcher that rolls back, which a token tree's rows need: each row's mask is the state after its own path.

A grammar is a generation's sampling control like the others (`SamplingConfig.grammar`, the llguidance grammar
`grammar_of` makes): the token after a text is chosen among the tokens the grammar allows there
(models/sampling.py `choose`), by the target alone and by a tree's rows alike, so greedy output under a grammar is
the target's own. The draft proposes under the same mask, the trie's candidates it forbids are dropped before
verification, and where it allows one run of tokens only, the draft plants it without a forward of its own.

Torch-free at import (the scheduler filters the trie's candidates); `allowed` imports torch. A process that matches
grammars holds a view of the vocabulary (24 MiB for Qwen's 152k tokens): a memory plan that expects grammars counts it
(`vocabulary_bytes`), once for the actors, which fork after the zygote made it (`PRELOAD`), and once more for a
scheduler whose trie drafts alone.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import llguidance

from common.errors import CadenceError
from common.heap import trim_heap

ADVICE = "give a JSON schema (an object, or a .json file), a Lark grammar (.lark) or a GBNF grammar (.gbnf)"


def json_grammar(schema: dict | None) -> str:
    """The grammar of JSON text valid under `schema` (None: any JSON object, OpenAI's `json_object`)."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"})
    except (ValueError, TypeError) as e:
        raise CadenceError(f"the JSON schema is not one llguidance reads ({e}); {ADVICE}") from None


def grammar_of(spec: str | dict | None, files: bool = True) -> str:
    """The llguidance grammar of a JSON schema (a dict, its JSON text or a .json file), a Lark grammar (its text or
    a .lark file), a GBNF grammar (llama.cpp's: a .gbnf file, or text with `::=`), or a grammar made here already;
    "" for none. Checked: one sentence where it does not compile. `files` False: a text is never read as a path (a
    server's client names no file of the server's)."""
    if not spec:
        return ""
    if isinstance(spec, dict):
        return checked(json_grammar(spec))
    text, path = spec, Path(spec) if files and len(spec) < 4096 and "\n" not in spec else None
    if path is not None and path.suffix in (".json", ".lark", ".gbnf") and path.is_file():
        text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise CadenceError(f"the grammar reads as JSON but does not parse ({e}); {ADVICE}") from None
        is_grammar = isinstance(value, dict) and "grammars" in value  # what json_grammar made
        return checked(text if is_grammar else json_grammar(value))
    if "::=" in text:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # noqa: BLE001 - the converter's own errors are of several kinds
            raise CadenceError(f"the GBNF grammar does not convert ({e}); {ADVICE}") from None
    return checked(llguidance.LLMatcher.grammar_from_lark(text))


def checked(grammar: str) -> str:
    """`grammar`, or one sentence naming what is wrong with it."""
    bad, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if bad:
        first = messages[0].strip().splitlines()[0] if messages else "no reason given"
        raise CadenceError(f"the grammar does not compile: {first}")
    return grammar


def _stop_ids(info) -> list[int]:
    """The ids a generation stops at (text/tokenizer.py `TextTokenizer.stop_ids`), which the grammar allows where
    it may end."""
    from text.tokenizer import END_OF_TURN

    ids = set(info.eos_ids or [])
    if info.spm is not None:
        names = {t.decode(errors="replace"): i for i, t in enumerate(info.spm.tokens)}
    else:
        spec = json.loads(info.tokenizer_json)
        names = {a["content"]: a["id"] for a in spec.get("added_tokens", [])}
        names.update({k: v for k, v in (spec["model"].get("vocab") or {}).items() if k in END_OF_TURN})
    ids.update(names[n] for n in END_OF_TURN if n in names)
    return sorted(ids)


def vocabulary(store_dir: str, rows: int) -> "llguidance.LLTokenizer":
    """llguidance's view of a weight store's vocabulary, `rows` the model's output rows: made once a process for
    each vocabulary (a draft and its target share theirs), the first time a grammar arrives (24 MiB for Qwen's 152k
    tokens), or before the actors fork where a memory plan counts it (`PRELOAD`: then they share it)."""
    key = (_digest(store_dir), rows)
    if key not in _VOCABULARIES:
        _VOCABULARIES[key] = _vocabulary(store_dir, rows)
    return _VOCABULARIES[key]


_VOCABULARIES: dict[tuple[str, int], "llguidance.LLTokenizer"] = {}  # by the tokenizer file's digest and the rows


@lru_cache(maxsize=8)
def _digest(store_dir: str) -> str:
    from formats.store import WeightStore

    return hashlib.sha256(WeightStore(store_dir).tokenizer_file.read_bytes()).hexdigest()[:16]


def _vocabulary(store_dir: str, rows: int) -> "llguidance.LLTokenizer":
    from formats.store import WeightStore

    info = WeightStore(store_dir).tokenizer_info
    stops = _stop_ids(info)
    source = _SpmTokens(info, stops) if info.spm is not None else _ByteLevelTokens.of(info.tokenizer_json, stops, rows)
    # no slices (llguidance's precomputed token sets for common lexemes): 45 MiB less, masks ~25% slower
    made = llguidance.LLTokenizer(source or info.tokenizer_json, n_vocab=rows, eos_token=stops, slices=[])
    if isinstance(source, _ByteLevelTokens):
        source.view, source.tokens = made, []  # it encodes with the view; its bytes were copied into it
    del info, source
    trim_heap()  # the tokenizer's JSON, read and parsed, left its heap behind
    return made


VIEW = "bytes"  # how `_vocabulary` makes a view (a byte-level vocabulary's from its bytes): part of what is measured
PRELOAD = "vocabulary:"  # a zygote's preload entry (actors/zygote.py): PRELOAD + store directory + ":" + rows


def preload(entry: str) -> None:
    """Make a vocabulary before the actors fork (`PRELOAD` entry)."""
    store_dir, rows = entry[len(PRELOAD) :].rsplit(":", 1)
    vocabulary(store_dir, int(rows))


_MEASURE = """
import sys
from scheduler.generation.footprint import own_anon_bytes
from speculative.grammar import vocabulary
import gc
before = own_anon_bytes()
v = vocabulary(sys.argv[1], int(sys.argv[2]))
gc.collect()
print('{"bytes": %d}' % (own_anon_bytes() - before))
"""


def vocabulary_bytes(store_dir: str, rows: int) -> int:
    """What a process holds for `vocabulary(store_dir, rows)`: measured once in a child (anonymous memory, what a
    cgroup charges), kept under $CADENCE_HOME/calibration for this vocabulary and llguidance's version."""
    import sys

    from common.calibration import cached, child_json

    version = llguidance.get_version().split()[0].replace("@", "")
    key = f"{_digest(store_dir)}-{rows}-{version}-{VIEW}"
    return cached(
        "grammar-vocabulary",
        key,
        lambda: child_json(
            [sys.executable, "-c", _MEASURE, store_dir, str(rows)], "measuring a grammar's view of the vocabulary"
        ),
        lambda d: int(d["bytes"]),
    )


class _SpmTokens:
    """A SentencePiece vocabulary (text/spm.py) as llguidance's `TokenizerWrapper` reads one: each token's bytes
    (a control token's behind 0xFF, llguidance's mark of a special one) and its encoder."""

    def __init__(self, info, stops: list[int]):
        from text.bytetable import SPACE, fallback_byte
        from text.spm import CONTROL, UNKNOWN, SpmEncoder

        vocab, space = info.spm, SPACE.encode()
        self.eos_token_id, self.bos_token_id = stops[0] if stops else 0, info.bos_id
        self.tokens, self.special_token_ids = [], []
        for i, (t, kind) in enumerate(zip(vocab.tokens, vocab.types)):
            b = fallback_byte(t.decode(errors="replace")) if len(t) == 6 else None
            if kind in (CONTROL, UNKNOWN):
                self.tokens.append(b"\xff" + t)
                self.special_token_ids.append(i)
            else:
                self.tokens.append(bytes([b]) if b is not None else t.replace(space, b" "))
        self._encoder, self.is_tokenizer_wrapper = SpmEncoder(vocab), True

    def __call__(self, text: str | bytes) -> list[int]:
        return self._encoder.encode(text.decode() if isinstance(text, bytes) else text, special=False)


class _ByteLevelTokens:
    """A byte-level BPE vocabulary (GPT-2's alphabet: Qwen, Llama 3, SmolLM) as llguidance's `TokenizerWrapper` reads
    one, its tokens' bytes read from the tokenizer's JSON with no `tokenizers` object behind them: a view of 152k
    tokens in 24 MiB where one made from the JSON holds a whole tokenizer (61-68 MiB). Added tokens are special to it
    (behind 0xFF), as they are to a view made from the JSON, so its masks are that view's, bit for bit. A text is
    encoded by the view's own longest-match tokenizer (the tokens a grammar forces, which the target verifies)."""

    is_tokenizer_wrapper = True

    def __init__(self, tokens: list[bytes], special: list[int], stops: list[int]):
        self.tokens, self.special_token_ids = tokens, special
        self.eos_token_id, self.bos_token_id = stops[0] if stops else 0, None
        self.view: "llguidance.LLTokenizer | None" = None  # set once made

    @classmethod
    def of(cls, tokenizer_json: str, stops: list[int], rows: int) -> "_ByteLevelTokens | None":
        """The vocabulary of a byte-level BPE tokenizer's JSON, as many tokens as the model's `rows` at least (a view
        made from tokens is as long as they are; the rows past the tokenizer's, an HF Qwen's 271, are tokens of no
        bytes, as a view made from the JSON pads them); None for any other kind (its view is made from the JSON)."""
        from text.bytetable import byte_level_bytes

        spec = json.loads(tokenizer_json)
        model, decoder = spec.get("model") or {}, spec.get("decoder") or {}
        if model.get("type") != "BPE" or decoder.get("type") != "ByteLevel" or not model.get("vocab"):
            return None
        added = spec.get("added_tokens", [])
        tokens = [b""] * max(rows, max([*model["vocab"].values(), *(a["id"] for a in added)]) + 1)
        try:
            for piece, i in model["vocab"].items():
                tokens[i] = byte_level_bytes(piece)
        except KeyError:  # a token outside the byte alphabet: read from the JSON instead
            return None
        for a in added:
            tokens[a["id"]] = b"\xff" + a["content"].encode()
        return cls(tokens, [a["id"] for a in added], stops)

    def __call__(self, text: str | bytes) -> list[int]:
        if self.view is None:
            raise CadenceError("a grammar's vocabulary was asked to encode a text before it was made")
        return self.view.greedy_tokenize(text.decode(errors="replace") if isinstance(text, bytes) else text)


def source_of(model) -> str | None:
    """The weight store directory a model's vocabulary is read from (None: a model built in memory)."""
    store = getattr(getattr(model, "weights", None), "store", None)
    return str(store.dir) if store is not None else None


class Constraint:
    """One generation's grammar, matched against its text: the tokens it allows after any text that extends the
    prompt (a row of a tree, the committed text), found by rolling the matcher back to what the two share."""

    def __init__(self, vocab: "llguidance.LLTokenizer", grammar: str, start: int, rows: int):
        self.matcher = llguidance.LLMatcher(vocab, grammar, log_level=0)
        if self.matcher.is_error():
            raise CadenceError(f"the grammar does not compile: {self.matcher.get_error()}")
        self.start, self.rows = start, rows  # the prompt's length (the grammar holds what follows it); the mask's
        self.fed: list[int] = []  # what the matcher has consumed

    @classmethod
    def of(cls, sampling, store_dir: str | None, rows: int, start: int) -> "Constraint | None":
        """A generation's constraint (None: its sampling has no grammar); one sentence where the model's vocabulary
        cannot be read."""
        if not sampling.grammar:
            return None
        if store_dir is None:
            raise CadenceError("a grammar needs the model's tokenizer, and this model has no weight store")
        return cls(vocabulary(store_dir, rows), sampling.grammar, start, rows)

    def _seek(self, text: Sequence[int]) -> bool:
        """The matcher at the end of `text`; False where the grammar does not allow it."""
        new, fed = text[self.start :], self.fed
        if new[: len(fed)] == fed:  # the text goes on from where the matcher is (compared in C: every row asks)
            keep = len(fed)
        else:
            keep = next((i for i, (a, b) in enumerate(zip(fed, new)) if a != b), min(len(fed), len(new)))
        if keep < len(fed):
            self.matcher.rollback(len(fed) - keep)
            del fed[keep:]
        rest = list(new[keep:])
        n = self.matcher.try_consume_tokens(rest) if rest else 0
        fed.extend(rest[:n])
        return n == len(rest) and not self.matcher.is_error()

    def allowed(self, text: Sequence[int]):
        """A bool tensor [rows]: the tokens the grammar allows after `text`; None where `text` itself breaks it (a
        row no choice is read from)."""
        import torch

        if not self._seek(text):
            return None
        bits = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        mask = ((bits.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten().bool()
        return mask[: self.rows]

    def forced(self, text: Sequence[int]) -> list[int]:
        """The tokens the grammar allows alone after `text`, in a run (llguidance's fast-forward tokens)."""
        return self.matcher.compute_ff_tokens() if self._seek(text) else []

    def keeps(self, text: Sequence[int], paths: list[list[int]]) -> list[bool]:
        """Which of the paths (each a run of tokens after `text`) the grammar allows whole."""
        if not self._seek(text):
            return [False] * len(paths)
        return [self.matcher.validate_tokens(p) == len(p) for p in paths]
