"""The SentencePiece encoder (text/spm.py): id for id the `tokenizers` pipeline of the same vocabulary on random
vocabularies (score ties, two splits of one piece, missing byte tokens, no unknown token, duplicates), its
whole-token matcher, the weight store's `tokenizer.spm` (a GGUF converted, read back, damaged), letting it go,
and, for the real Gemma 3 270M, its memory. The trained and real vocabularies' comparisons with sentencepiece,
transformers, llama.cpp and the pipeline are tests/models/test_gguf_tokenizers.py's."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from common import paths
from common.errors import CadenceError
from text.spm import BYTE, CONTROL, FILE, NORMAL, UNKNOWN, USER_DEFINED, SpmEncoder, SpmVocab, whole_matcher
from text.tokenizer import TextTokenizer, TokenizerInfo
from text.tokenizer_gguf import info_from_gguf, spm_tokenizer

SPACE = "\u2581"
REPO = Path(__file__).resolve().parents[2]


def _random_vocab(rng: random.Random) -> dict:
    """A small SentencePiece vocabulary as a GGUF would hold it, made to meet the corner cases: scores from a
    handful of values (ties between pieces), pieces of one letter pair reachable by two splits, some byte
    tokens missing, sometimes no unknown token, a normal piece twice, control and user-defined tokens (one with
    a real space, as llama.cpp's converter writes Gemma's)."""
    tokens, types = (
        ["<unk>", "<s>", "</s>", "[INST]", "<b>", "  ", "a b"],
        [UNKNOWN] + [CONTROL] * 3 + [USER_DEFINED] * 3,
    )
    missing = rng.random() < 0.4
    for b in range(256):
        if not (missing and b >= 0x80 and rng.random() < 0.5):
            tokens.append(f"<0x{b:02X}>")
            types.append(BYTE)
    letters = ["a", "b", "c", SPACE, "é", "<"]
    pieces = set()
    while len(pieces) < 60:
        pieces.add("".join(rng.choice(letters) for _ in range(rng.randint(2, 5))))
    normal = letters + sorted(pieces)
    rng.shuffle(normal)
    normal.append(normal[len(letters)])  # a piece twice: its first id is the one
    tokens += normal
    types += [NORMAL] * len(normal)
    scores = [float(-rng.randint(0, 6)) for _ in tokens]
    return dict(tokens=tokens, scores=scores, types=types, unk_id=None if rng.random() < 0.3 else 0)


def _random_text(rng: random.Random) -> str:
    parts = ["a", "b", "c", "é", "ab", " ", "  ", "   ", SPACE, "<", "<b>", "[INST]", "<s>", "a b", "😀", "\n", "ü"]
    return "".join(rng.choice(parts) for _ in range(rng.randint(0, 30)))


@pytest.mark.parametrize("prefix", [False, True])
def test_random_vocabularies_encode_as_the_tokenizers_pipeline(prefix):
    """On random vocabularies and texts, the encoder's ids are the `tokenizers` pipeline's (`spm_tokenizer`),
    control tokens read as such or as text (the pipeline's `encode_special_tokens`)."""
    rng = random.Random(int(prefix))
    for _ in range(40):
        v = _random_vocab(rng)
        ours = SpmEncoder(SpmVocab.of(v["tokens"], v["scores"], v["types"], prefix, v["unk_id"]))
        ref = spm_tokenizer(v["tokens"], v["scores"], v["types"], add_space_prefix=prefix, unk_id=v["unk_id"])
        texts = [_random_text(rng) for _ in range(150)]
        for special in (True, False):
            ref.encode_special_tokens = not special
            want = [e.ids for e in ref.encode_batch(texts, add_special_tokens=False)]
            assert [ours.encode(t, special) for t in texts] == want, v


def test_ties_go_as_the_merges_rank_them():
    """Pieces of one score merge in id order, not left to right; two splits of one piece, the longer left part
    first; one pair at two places, the leftmost first (`spm_merges`' order, which the pipeline follows)."""
    tokens = ["a", "b", "c", "bc", "ab", "abc"]
    v = SpmVocab.of(tokens, [0.0] * 6, [NORMAL] * 6, add_space_prefix=False, unk_id=None)
    e = SpmEncoder(v)
    assert e.encode("abc") == [5]  # "bc" (id 3) before "ab" (id 4), then a + bc
    assert e.encode("abca") == [5, 0]
    ref = spm_tokenizer(tokens, [0.0] * 6, [NORMAL] * 6, add_space_prefix=False, unk_id=None)
    for text in ("abc", "abcabc", "ababab", "cbabcab", "aabbcc"):
        assert e.encode(text) == ref.encode(text, add_special_tokens=False).ids, text


def _leftmost_longest(words: list[str], text: str) -> list[tuple[int, int]]:
    out, i = [], 0
    while i < len(text):
        n = max((len(w) for w in words if w and text.startswith(w, i)), default=0)
        if n:
            out.append((i, i + n))
        i += n or 1
    return out


def test_the_whole_token_matcher_takes_the_leftmost_then_the_longest():
    rng = random.Random(0)
    for _ in range(200):
        words = ["".join(rng.choice("ab<>") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 12))]
        m = whole_matcher(words)
        for _ in range(20):
            text = "".join(rng.choice("ab<>x") for _ in range(rng.randint(0, 40)))
            assert [x.span() for x in m.finditer(text)] == _leftmost_longest(words, text), (words, text)
    deep = ["a" * k for k in range(1, 800)]  # nested deeper than `re` parses: the plain alternation instead
    m = whole_matcher(deep)
    assert [x.span() for x in m.finditer("a" * 1700)] == [(0, 799), (799, 1598), (1598, 1700)]
    assert whole_matcher([]) is None and whole_matcher([""]) is None


def _add_spm_tokenizer(w, vocab_size: int) -> None:
    """A SentencePiece tokenizer's fields as llama.cpp's converter writes Gemma's (no space prefix)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n", "  "]
    types = [CONTROL, CONTROL, CONTROL, UNKNOWN, CONTROL, CONTROL, USER_DEFINED, USER_DEFINED]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    normal = [SPACE, "h", "e", "l", "o", "he", "ll", "llo", "hello", f"{SPACE}hello", "u", "s", "r", "us", "er", "user"]
    tokens += (normal + [f"x{i}" for i in range(vocab_size)])[: vocab_size - len(tokens)]
    types += [NORMAL] * (vocab_size - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(vocab_size)])
    w.add_token_types(types)
    w.add_add_space_prefix(False)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)


@pytest.fixture(scope="module")
def spm_store(tmp_path_factory):
    """(the GGUF, a weight store converted from it): a tiny Llama with a SentencePiece tokenizer."""
    from formats.convert import convert
    from formats.source import GGUFSource
    from formats.weights import random_tensors
    from tests.conftest import TINY
    from tests.models.tiny_files import write_gguf

    tmp, args = tmp_path_factory.mktemp("spm-store"), TINY["llama"]
    gguf = write_gguf(tmp / "s.gguf", args, random_tensors(args, seed=4), tokenizer=_add_spm_tokenizer)
    source = GGUFSource(gguf)
    assert source.tokenizer.spm is not None and source.tokenizer.tokenizer_json == ""  # no `tokenizers` object
    return gguf, convert(source, tmp / "store", "fp32")


def _copy(store: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(store, tmp_path / "store"))


def test_a_store_keeps_the_vocabulary_and_not_a_tokenizer_json(spm_store):
    """The converted store holds tokenizer.spm (named in its manifest), no tokenizer.json; the tokenizer read
    back encodes and decodes as the GGUF's, with no `tokenizers` object, and the vocabulary's fingerprint is
    the GGUF's."""
    from formats import vocab
    from formats.gguf_file import GGUFFile
    from formats.store import WeightStore

    gguf, path = spm_store
    st = WeightStore(path)
    assert (path / FILE).is_file() and not (path / "tokenizer.json").exists()
    assert st.manifest["tokenizer"]["file"] == FILE == st.tokenizer_file.name
    info = st.tokenizer_info
    fields = GGUFFile(gguf).fields
    direct = info_from_gguf(fields, gguf.name, "llama")
    assert (info.spm.tokens, info.spm.scores, info.spm.types) == (
        direct.spm.tokens,
        direct.spm.scores,
        direct.spm.types,
    )
    assert (info.spm.add_space_prefix, info.spm.unk_id) == (False, 3)
    tok = TextTokenizer(info)
    assert tok.tok is None and tok.bos_id == 2 and tok.stop_ids == {1, 5}
    text = "<start_of_turn>user\nhello  hello, wörld<end_of_turn>\n"
    ids = tok.encode(text)
    assert ids[:3] == [2, 4, fields["tokenizer.ggml.tokens"].index("user")] and 5 in ids
    assert tok.decode(ids) == "<bos>" + text and tok.decode(ids, skip_special=True) == "user\nhello  hello, wörld\n"
    assert vocab.read("store", path).same_ids(vocab.read("gguf", gguf))


@pytest.mark.parametrize(
    "data,says",
    [
        (b"{}", "is not a SentencePiece vocabulary (it does not start as one)"),
        (None, "is not a SentencePiece vocabulary (4"),  # cut short
        (b"cadence sentencepiece 1\n{}\n", "is not a SentencePiece vocabulary (no 'tokens' entry)"),
    ],
    ids=["not-one", "cut-short", "no-count"],
)
def test_a_damaged_vocabulary_is_one_sentence(spm_store, tmp_path, data, says):
    from formats.store import WeightStore

    path = _copy(spm_store[1], tmp_path)
    f = path / FILE
    f.write_bytes(data if data is not None else f.read_bytes()[:-3])
    with pytest.raises(CadenceError) as e:
        WeightStore(path).tokenizer_info
    assert str(e.value).startswith(f"{f} {says}") and str(e.value).endswith(f"; delete {path} and convert again")


def test_a_manifest_naming_no_tokenizer_file_is_one_sentence(spm_store, tmp_path):
    from formats.store import WeightStore

    path = _copy(spm_store[1], tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["tokenizer"]["file"] = "../elsewhere"
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        CadenceError, match=r"manifest\.json is damaged \(its tokenizer entry names no tokenizer file\)"
    ):
        WeightStore(path).tokenizer_info


def test_the_file_round_trips_every_field():
    v = SpmVocab.of(["a", "▁b", "é", "<0x00>", ""], [0.5, -1.25, 3.0e-8, -1000.0, 0.0], [1, 1, 4, 6, 5], True, 2)
    w = SpmVocab.loads(v.dumps(), "f", "x")
    assert (w.tokens, w.scores, w.types, w.add_space_prefix, w.unk_id) == (
        [b"a", "▁b".encode(), "é".encode(), b"<0x00>", b""],
        v.scores,
        bytes([1, 1, 4, 6, 5]),
        True,
        2,
    )
    assert SpmVocab.of(["a"], [0.0], [1], False, 7).unk_id is None  # an unknown id outside the vocabulary


def test_letting_the_encoder_go_keeps_decoding_and_refuses_to_encode(spm_store):
    from formats.store import WeightStore

    tok = TextTokenizer(WeightStore(spm_store[1]).tokenizer_info)
    ids = tok.encode("hello  hello")
    assert tok.release_encoder() and tok.spm is None and tok.info.spm is None and tok.release_encoder()
    assert tok.decode(ids) == "<bos>hello  hello"
    for call in (lambda: tok.encode("more"), lambda: tok.token_id("<eos>")):
        with pytest.raises(CadenceError, match="encoded its prompts up front"):
            call()


def test_no_bound_where_a_character_may_come_to_no_token():
    """Without an unknown token and with a byte token missing, a character can vanish: no length bound holds,
    and the count decides; with every byte a token, the bound is the longest token's bytes."""
    tokens = ["a", "b", "ab"] + [f"<0x{b:02X}>" for b in range(256) if b != 0x80]
    kinds = [NORMAL] * 3 + [BYTE] * 255
    v = SpmVocab.of(tokens, [0.0] * len(tokens), kinds, add_space_prefix=False, unk_id=None)
    t = TextTokenizer(TokenizerInfo("", None, [], spm=v))
    assert t.encode("À" * 100 + "ab") == [2]  # U+00C0 is C3 80
    assert t.spm.bound() == 0 and t.min_tokens(10**9) == 0 and t.encode("ab" * 50, limit=50) == [2] * 50
    full = SpmVocab.of([*tokens, "<0x80>"], [0.0] * (len(tokens) + 1), [*kinds, BYTE], False, None)
    assert SpmEncoder(full).bound() == 6


_MEASURE = """
import json, resource, sys, time
from pathlib import Path
from text.tokenizer import TextTokenizer, read_info
import text.tokenizer_gguf  # everything a run imports first
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
tok = TextTokenizer(read_info(Path(sys.argv[1]), {"file": "tokenizer.spm", "eos_ids": [1], "bos_id": 2}, "x"))
load = time.perf_counter() - t
text = Path(sys.argv[2]).read_text()[:4000]
t = time.perf_counter()
ids = tok.encode(text)
encode = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"above": (peak - before) / 1024, "load": load, "encode": encode, "ids": len(ids), "lib": tok.tok is None}))
"""


@pytest.mark.real
@pytest.mark.gemma
def test_real_gemma3_tokenizer_fits_in_a_small_budget(tmp_path):
    """Gemma 3's 262k vocabulary, read from a store's tokenizer.spm and encoding a 4,000-character prompt,
    peaks at ~43 MiB above the imports (the `tokenizers` pipeline: ~415 MiB), loads in a fraction of a second
    and encodes in milliseconds."""
    from formats.gguf_file import GGUFFile

    path = paths.models_dir() / "gemma-3-270m-q4_k_m.gguf"
    if not path.exists():
        pytest.skip(f"{path} is not there: launch models pull gemma-3-270m")
    info = info_from_gguf(GGUFFile(path).fields, path.name, "gemma3")
    (tmp_path / FILE).write_bytes(info.dumps())
    p = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path / FILE), str(REPO / "README.md")],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["lib"] and got["ids"] > 500
    assert got["above"] < 70 and got["load"] < 2 and got["encode"] < 0.1, got
