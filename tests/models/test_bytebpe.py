"""The byte-level BPE encoder a serving process keeps (text/bytebpe.py): the ids of `tokenizers` on the real
vocabularies and every GGUF pre-tokenizer, on real prompts and random text, in a fifth of the memory."""

import json
import random
import subprocess
import sys

import pytest
from tokenizers import Tokenizer

from formats.convert import resolve
from formats.source import GGUFSource
from text.bytebpe import ByteBpe
from text.tokenizer import TextTokenizer, TokenizerInfo
from text.tokenizer_bpe import GGUF_PRE_TOKENIZERS, tokenizer_from_gguf_fields
from tests.conftest import dev_prompts

# what a byte-level pipeline treats apart: contractions in both cases, digits, spaces before newlines, whitespace
# that `\s` and Oniguruma may read differently, combining marks, NFC's compositions, added tokens inside words
ALPHABET = list("abcABC xyz019 \n\t\r  '’s'LL'll.,;:!?-_=+*/\\\"()[]{}<>|") + [
    "\u00e9",
    "e\u0301",
    "\u0301",
    "\u4e2d\u6587",
    "\U0001f600",
    "\x1c",
    "\x1f",
    "\x85",
    "\xa0",
    "\u2028",
    "\u3000",
    "\u0660",
    "\xb2",
    "\u0915\u093f",
    "\u01c4\u01c5\u00df\u0130",
    "1234567",
    "\u200b\ufeff",
    "Ġ",
    "<|im_start|>",
    "<|endoftext|>",
    "<|im_end|>x",
]


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    made = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 40))) for _ in range(n)]
    return [p["prompt"] for p in dev_prompts()] + made + ["", " ", "x" * 3000, " " * 300 + "\n", "ab" * 500]


def mismatches(tok: Tokenizer, bpe: ByteBpe, corpus: list[str]) -> list[str]:
    return [t for t in corpus if tok.encode(t, add_special_tokens=False).ids != bpe.encode(t)]


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b", "smollm2-135m"])
def real(request):
    info = GGUFSource(*resolve(request.param)[1:]).tokenizer
    return info, Tokenizer.from_str(info.tokenizer_json)


def test_the_ids_are_tokenizers_on_real_vocabularies(real):
    info, tok = real
    bpe = ByteBpe.of(info.tokenizer_json)
    assert bpe is not None and mismatches(tok, bpe, texts(2000)) == []
    long = "\n".join(p["prompt"] for p in dev_prompts()) * 4  # one call, many pieces merged together
    assert bpe.encode(long) == tok.encode(long, add_special_tokens=False).ids


def test_every_gguf_pre_tokenizer_reads_as_tokenizers_does():
    """Each `tokenizer.ggml.pre` the GGUF reader rebuilds (its regex, digits, NFC, ignore_merges), over a real
    vocabulary with control and user-defined tokens (SmolLM's 49k: Qwen's reads the same, in three times as long)."""
    info = GGUFSource(*resolve("smollm2-135m")[1:]).tokenizer
    spec = json.loads(info.tokenizer_json)
    tokens = [""] * (max(spec["model"]["vocab"].values()) + 1)
    for t, i in spec["model"]["vocab"].items():
        tokens[i] = t
    types = [1] * len(tokens)
    for a in spec["added_tokens"]:
        tokens += [""] * (a["id"] + 1 - len(tokens))
        types += [1] * (len(tokens) - len(types))
        tokens[a["id"]], types[a["id"]] = a["content"], 3 if a["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    corpus = texts(300, seed=1)
    for pre in sorted(GGUF_PRE_TOKENIZERS):
        tok = tokenizer_from_gguf_fields(tokens, types, merges, pre)
        bpe = ByteBpe.of(tok.to_str())
        assert bpe is not None, pre
        assert mismatches(tok, bpe, corpus) == [], pre


def _tiny(ignore_merges: bool, **pre) -> str:
    """A six-token vocabulary whose merges never make "abc" from "a b c" (only "bc"), though "abc" is a token."""
    from tokenizers import models, pre_tokenizers

    from text.bytetable import byte_alphabet

    vocab = {ch: b for b, ch in byte_alphabet()} | {"bc": 256, "abc": 257, "ab": 258}
    tok = Tokenizer(models.BPE(vocab, [("b", "c"), ("a", "b")], ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, **pre)
    return tok.to_str()


def test_ignore_merges_takes_a_whole_word_and_merges_otherwise():
    for ignore in (False, True):
        js = _tiny(ignore)
        tok, bpe = Tokenizer.from_str(js), ByteBpe.of(js)
        for text in ("abc", "abc abc", "xabc", "ab", "abcabc", "bcab"):
            assert bpe.encode(text) == tok.encode(text, add_special_tokens=False).ids, (ignore, text)
    assert ByteBpe.of(_tiny(True)).encode("abc") == [257] and ByteBpe.of(_tiny(False)).encode("abc") == [97, 256]


def test_what_it_does_not_read_keeps_its_tokenizer(real):
    """A pipeline step not read here returns None (the tokenizer then keeps `tokenizers`), never other ids."""
    info, _ = real
    spec = json.loads(info.tokenizer_json)
    for change in (
        {"normalizer": {"type": "Lowercase"}},
        {"pre_tokenizer": {"type": "Whitespace"}},
        {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}},
        {"model": {**spec["model"], "dropout": 0.1}},
        {"added_tokens": [{**spec["added_tokens"][0], "lstrip": True}]},
    ):
        assert ByteBpe.of({**spec, **change}) is None, change


def test_a_serving_tokenizer_encodes_the_same_in_a_fifth_of_the_memory():
    """`compact_encoder` (what serve, chat and cadence.LLM hold): the same ids, decodes, stop ids and length bound;
    measured in a fresh interpreter, the process gives back at least 35 MiB of Qwen's 152k vocabulary's ~60."""
    info = GGUFSource(*resolve("qwen2.5-coder-0.5b")[1:]).tokenizer
    full, lean = TextTokenizer(info), TextTokenizer(info)
    assert lean.compact_encoder() and lean.tok is None and lean.bpe is not None and lean.compact_encoder()
    for text in texts(200, seed=2):
        ids = full.encode(text)
        assert lean.encode(text) == ids and lean.decode(ids) == full.decode(ids)
    assert lean.stop_ids == full.stop_ids and lean.min_tokens(10**6) == full.min_tokens(10**6) > 0
    assert lean.release_encoder() and lean.bpe is None
    probe = (
        "import sys; from formats.source import GGUFSource; from formats.convert import resolve; "
        "from text.tokenizer import TextTokenizer; "
        "from scheduler.generation.footprint import own_anon_bytes; import numpy, regex; "
        "t = TextTokenizer(GGUFSource(*resolve('qwen2.5-coder-0.5b')[1:]).tokenizer); t.encode('warm'); "
        "a = own_anon_bytes(); t.compact_encoder(); t.encode('warm'); print(a, own_anon_bytes())"
    )
    before, after = map(int, subprocess.check_output([sys.executable, "-c", probe], text=True).split())
    assert before - after > 35 << 20, (before >> 20, after >> 20)


def test_a_tokenizer_it_does_not_read_stays_as_it_is():
    js = json.loads(_tiny(False))
    js["normalizer"] = {"type": "Lowercase"}
    t = TextTokenizer(TokenizerInfo(json.dumps(js), None, []))
    assert not t.compact_encoder() and t.tok is not None and t.encode("ABC") == [97, 256]


def _spec(merges, pre=None, **top) -> dict:
    """A tokenizer.json of the byte alphabet and `merges`' products (each a new id, in order)."""
    from text.bytetable import byte_alphabet

    vocab = {ch: i for i, (_, ch) in enumerate(sorted(byte_alphabet()))}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None}
    model |= {"end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False}
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None}
    spec |= {"pre_tokenizer": pre or byte_level, "post_processor": None, "decoder": None}
    return spec | {"model": model | {"vocab": vocab, "merges": [list(m) for m in merges]}} | top


def test_a_pair_listed_twice_merges_at_its_last_rank_and_merges_out_of_order_keep_tokenizers():
    """Found in review: `tokenizers` keeps a pair's last rank; a merge that ranks before the merge making one of
    its parts (a file converted from tiktoken may have one) is merged by its queue at once, which rounds of one
    rank cannot follow: that file keeps `tokenizers`. A step after `ByteLevel`, truncation and an added token
    that is a model token of another id are not read either."""
    twice = _spec([("a", "b"), ("b", "c"), ("x", "y"), ("a", "b")])
    assert ByteBpe.of(twice).encode("abc") == Tokenizer.from_str(json.dumps(twice)).encode("abc").ids
    assert ByteBpe.of(_spec([("x", "y"), ("ab", "a"), ("a", "b")])) is None
    split = {"type": "Split", "pattern": {"String": " "}, "behavior": "Isolated", "invert": False}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    assert ByteBpe.of(_spec([("a", "Ġ")], {"type": "Sequence", "pretokenizers": [byte_level, split]})) is None
    assert ByteBpe.of(_spec([("a", "b")], {"type": "Sequence", "pretokenizers": [split, byte_level]})) is not None
    truncated = {"max_length": 2, "stride": 0, "strategy": "LongestFirst", "direction": "Right"}
    assert ByteBpe.of(_spec([("a", "b")], truncation=truncated)) is None
    other = {"id": 999, "content": "ab", "single_word": False, "lstrip": False, "rstrip": False}
    assert ByteBpe.of(_spec([("a", "b")], added_tokens=[other | {"normalized": False, "special": True}])) is None
