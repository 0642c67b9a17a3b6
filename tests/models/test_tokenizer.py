"""Tokenizers rebuilt from the real GGUF files: exact round trips, whole special tokens, chat templates."""

import pytest

from common.errors import CadenceError
from formats.convert import resolve
from formats.source import GGUFSource
from text.textcheck import NFC_SHRINK, TooLong
from text.tokenizer import StreamDecoder, TextTokenizer, TokenizerInfo, tokenizer_from_gguf_fields
from tests.conftest import dev_prompts
from tests.models.tiny_files import tokenizer_fields

TEXTS = [p["prompt"] for p in dev_prompts()] + [
    "Hello  world!\n\n\t12345 ünïcödé 😀 ∑ 中文 <|im_start|>user\nhi<|im_end|>",
    "   leading spaces and trailing   ",
    "x" * 300 + "\r\n\r\n  ",
    "",
]


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def tok(request):
    _, path, sha = resolve(request.param)
    return request.param, TextTokenizer(GGUFSource(path, sha).tokenizer)


def test_round_trip_is_exact(tok):
    _, t = tok
    for text in TEXTS:
        assert t.decode(t.encode(text)) == text


def test_control_tokens_stay_whole(tok):
    _, t = tok
    ids = t.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == t.tok.token_to_id("<|im_start|>") and ids[-1] == t.tok.token_to_id("<|im_end|>")
    assert t.tok.token_to_id("<|im_end|>") in t.stop_ids


def test_stream_decoder_reassembles_multibyte_characters(tok):
    _, t = tok
    text = "naïve 😀 中文 done"
    stream = StreamDecoder(t)
    pieces = [stream.push([i]) for i in t.encode(text)]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


def test_qwen_matches_transformers_gguf_tokenizer():
    from tests.models.hf_cache import hf_tokenizer

    _, path, sha = resolve("qwen2.5-coder-0.5b")
    ours = TextTokenizer(GGUFSource(path, sha).tokenizer)
    hf = hf_tokenizer(path)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False)


def test_qwen_models_share_one_tokenizer():
    a = TextTokenizer(GGUFSource(*resolve("qwen2.5-coder-0.5b")[1:]).tokenizer)
    b = TextTokenizer(GGUFSource(*resolve("qwen2.5-coder-1.5b")[1:]).tokenizer)
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)


def test_smollm_splits_digits_one_by_one():
    t = TextTokenizer(GGUFSource(*resolve("smollm2-135m")[1:]).tokenizer)
    assert [t.decode([i]) for i in t.encode("x = 12345")][-5:] == list("12345")


def test_chat_template_renders():
    t = TextTokenizer(GGUFSource(*resolve("qwen2.5-coder-0.5b")[1:]).tokenizer)
    text = t.apply_chat_template([{"role": "user", "content": "Write hello world."}])
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>user\nWrite hello world.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_byte_table_decodes_exactly_as_the_tokenizer(tok):
    """Under a budget the scheduler keeps only each token's bytes: every token, and random runs of
    them (cut characters included), decode as the tokenizer decodes them, specials kept or skipped."""
    import random

    _, t = tok
    lean = TextTokenizer(t.info)
    assert lean.release_encoder() and lean.tok is None
    assert all(lean.decode([i]) == t.decode([i]) for i in range(t.vocab_size))
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(t.vocab_size) for _ in range(rng.randrange(1, 24))]
        assert lean.decode(ids) == t.decode(ids) and lean.decode(ids, True) == t.decode(ids, True)
    for text in TEXTS:
        assert lean.decode(t.encode(text)) == text
    with pytest.raises(Exception, match="encoded its prompts up front"):
        lean.encode("more")


# Issue 24: text that is not UTF-8 is one sentence naming it, and a text too long for the context is refused
# before the tokenizer reads it (a byte bound), never a text that would fit.


@pytest.fixture(scope="module")
def tiny():
    toks, types, merges = tokenizer_fields(300)
    tj = tokenizer_from_gguf_fields(toks, types, merges, "qwen2").to_str()  # NFC, as Qwen's
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return TextTokenizer(TokenizerInfo(tj, None, [], chat_template=template))


@pytest.mark.parametrize(
    "text,why",
    [
        (
            "ab\udcffcd",
            "character 2 is the byte 0xff, which does not decode as UTF-8",
        ),  # stdin read with surrogateescape
        ("x\ud800", "character 1 is U+D800, half of a UTF-16 surrogate pair without its other half"),  # JSON "\ud800"
        (b"ab\xff", "byte 2 is 0xff: invalid start byte"),
        (b"ok \xe2\x82", "byte 3 is 0xe2: unexpected end of data"),
    ],
)
def test_text_that_is_not_utf8_is_one_sentence_naming_it(tiny, text, why):
    with pytest.raises(CadenceError) as e:
        tiny.encode(text, name="prompts.jsonl:3")
    assert str(e.value) == f"prompts.jsonl:3 is not valid UTF-8 ({why}); give it as UTF-8 text"
    with pytest.raises(CadenceError, match="the prompt is not valid UTF-8"):
        tiny.encode(text, limit=1000)
    assert tiny.encode(b"ab") == tiny.encode("ab")


def test_a_chat_names_the_field_that_is_not_utf8(tiny):
    chat = [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "a\ud800"}]}]
    with pytest.raises(CadenceError, match=r"^messages\[1\]\.content\[0\]\.text is not valid UTF-8 \(character 1 is "):
        tiny.apply_chat_template(chat)
    with pytest.raises(CadenceError, match=r"^body\.messages\[0\]\.role is not valid UTF-8"):
        tiny.apply_chat_template([{"role": "us\udc80er", "content": "hi"}], name="body.messages")
    with pytest.raises(CadenceError, match="^the prompt is not valid UTF-8"):  # `launch run -` with the chat template
        tiny.apply_chat_template([{"role": "user", "content": "bad \udcff"}])


def test_the_byte_bound_refuses_before_the_text_is_read(tiny):
    """A lone surrogate at the end of 10 MB: the length alone refuses it, before the text is scanned (which would
    refuse it as not UTF-8) or tokenized."""
    with pytest.raises(TooLong) as e:
        tiny.encode("x" * 10_000_000 + "\ud800", limit=1000)
    assert not e.value.exact and e.value.tokens == tiny.min_tokens(10_000_001) > 1000  # not ASCII: NFC may shrink it
    assert str(e.value) == f"the prompt has at least {e.value.tokens} tokens, more than the context's 1000; shorten it"
    with pytest.raises(TooLong, match="^the prompt has 12 tokens, more than the context's 11"):  # counted, not bounded
        tiny.encode("x" * 12, limit=11)
    assert tiny.encode("x" * 12, limit=12) == tiny.encode("x" * 12)


def _texts(t: TextTokenizer, rng) -> list[str]:
    """The texts nearest the bound: the longest token over and over, and runs of what NFC shrinks most
    (a 3-byte iota and the mark that decomposes to two marks: 7 bytes composed into ΐ, 2 bytes)."""
    longest = max((t.decode([i]) for i in range(t.vocab_size)), key=lambda s: len(s.encode()))
    pieces = [
        longest,
        "\u1fbe\u0344",
        "\u1fbe\u0308\u0301",
        "\u212a",
        "\u1100\u1161\u11a8",
        "é",
        " ",
        "\n",
        "😀",
        "ab",
        "<|im_end|>",
        "1234",
    ]
    return [longest * 50, "\u1fbe\u0344" * 300] + [
        "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 200))) for _ in range(40)
    ]


def test_the_bound_never_refuses_a_text_that_fits(tok, tiny):
    import random

    for t in (tok[1], tiny):
        for text in _texts(t, random.Random(1)):
            n = len(t.encode(text))
            assert t.min_tokens(len(text.encode()), text.isascii()) <= n
            assert t.encode(text, limit=n) == t.encode(text)
            with pytest.raises(TooLong):
                t.encode(text, limit=n - 1)


def test_the_longest_token_makes_the_bound_tight():
    t = TextTokenizer(GGUFSource(*resolve("qwen2.5-coder-0.5b")[1:]).tokenizer)
    spaces = " " * 128  # Qwen's longest token: 128 spaces
    assert len(t.encode(spaces * 100)) == 100 == t.min_tokens(12800, ascii=True)
    with pytest.raises(TooLong, match="at least 100 tokens"):
        t.encode(spaces * 100, limit=99)


def test_nfc_shrinks_no_text_more_than_the_bound_allows():
    """NFC maps each output character to the input characters whose decomposition starts in it: at most the
    sum, over its own decomposition's pieces, of the longest character whose decomposition starts with that
    piece. The largest ratio of that to its bytes, over all of Unicode, bounds how much NFC shrinks a text."""
    import unicodedata

    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    nfd = {c: unicodedata.normalize("NFD", c) for c in chars}
    longest_from: dict[str, int] = {}
    for c, d in nfd.items():
        longest_from[d[0]] = max(longest_from.get(d[0], 0), len(c.encode()))
    worst = max(sum(longest_from.get(p, len(p.encode())) for p in nfd[c]) / len(c.encode()) for c in chars)
    assert worst == 3.5 and worst <= NFC_SHRINK


def test_a_normalizer_that_drops_text_gets_no_bound_and_the_count_decides(tiny):
    from tokenizers import Tokenizer, normalizers

    tok = Tokenizer.from_str(tiny.info.tokenizer_json)
    tok.normalizer = normalizers.Strip()  # "   x   " is one token
    t = TextTokenizer(TokenizerInfo(tok.to_str(), None, []))
    assert t.min_tokens(10**9) == 0 and t.encode(" " * 10_000 + "x", limit=1) == t.encode("x")


def test_non_utf8_piped_to_launch_run_is_one_sentence(tmp_path):
    """Issue 24: `launch run -` with bytes that are not UTF-8 ended in `TypeError: TextInputSequence must be str`."""
    import os
    import subprocess
    import sys

    from common import paths
    from formats.weights import random_tensors
    from tests.conftest import TINY
    from tests.models.tiny_files import write_gguf

    gguf = write_gguf(tmp_path / "tiny.gguf", TINY["qwen"], random_tensors(TINY["qwen"], seed=5))
    env = dict(os.environ, CADENCE_HOME=str(tmp_path / "home"), CADENCE_KERNELS_DIR=str(paths.kernels_dir()))
    for chat in ("on", "off"):
        argv = ["run", "--mode", "target", "--target", str(gguf), "--chat", chat, "--no-monitor", "-"]
        p = subprocess.run(
            [sys.executable, "-m", "launch.cli", *argv],
            input=b"say \xff\xfe hi",
            capture_output=True,
            env=env,
            timeout=300,
            check=False,
        )
        err = p.stderr.decode()
        assert p.returncode == 1 and "Traceback" not in err, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("launch: the prompt") and "not UTF-8" in last and "0xff" in last, err
