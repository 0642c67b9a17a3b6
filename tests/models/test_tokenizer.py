"""Tokenizers rebuilt from the real GGUF files: exact round trips, whole special tokens, chat templates."""
import pytest

from models.convert import resolve
from models.source import GGUFSource
from models.tokenizer import StreamDecoder, TextTokenizer
from tests.conftest import dev_prompts

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
    from transformers import AutoTokenizer

    _, path, sha = resolve("qwen2.5-coder-0.5b")
    ours = TextTokenizer(GGUFSource(path, sha).tokenizer)
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
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
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\nWrite hello world.<|im_end|>\n<|im_start|>assistant\n")


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
