"""Gemma 4's GGUF tokenizer (`tokenizer.ggml.model` = `gemma4`; text/spm.py's `MergesEncoder`) against the
model's own tokenizer.json and against llama.cpp.

Gemma 4's tokenizer.json is a BPE with byte fallback behind `Replace(" ", "▁")`, decoded by `Replace("▁", " ")`,
`ByteFallback` and `Fuse`; llama.cpp's converter writes its vocabulary and merges (`Gemma4Model.set_vocab`:
gguf-py's `LlamaHfVocab` and `SpecialVocab`, tests/models/gguf_tokenizer_files.py). No Gemma 4 checkpoint is at
hand, so tokenizer.json files of that shape are made here, then converted as that converter does: a small BPE
trained on the text corpus, and Gemma 3 270M's 262k vocabulary (from the real GGUF, where it has been pulled;
Gemma 4's ordinary tokens have Gemma 3's ids) with the merges transformers derives for a Gemma vocabulary, its
spaces `▁` as in its tokenizer.json and its turn and tool tokens renamed to Gemma 4's. Runs of newlines are added
tokens there, and no merge rebuilds them, as llama.cpp's Gemma 4 fix (a run of newlines that is one token is
taken whole, ggml-org/llama.cpp#21343) suggests of the real file. Each GGUF must encode every text as its
tokenizer.json does (but where llama.cpp departs from it: a run of newlines longer than the longest such token,
an added token the converter types normal), decode back, and encode exactly as llama.cpp does where it is
installed.
"""

from __future__ import annotations

import json
from pathlib import Path
import random
import re

import pytest

from common import paths
from common.errors import CadenceError
from text.spm import MergesEncoder, SpmVocab
from text.tokenizer import StreamDecoder, TextTokenizer, read_info
from text.tokenizer_gguf import info_from_gguf
from tests.models.gguf_tokenizer_files import GEMMA4_VISIBLE, gemma4_vocab, write_tokenizer_gguf
from tests.models.text_corpus import corpus

SPACE = "\u2581"
# Gemma 4's named special tokens (its tokenizer_config.json's: the converter makes them control), then its visible ones
NAMED = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|think|>", "<|tool>", "<tool|>"]
SPECIALS = NAMED + list(GEMMA4_VISIBLE)
NEWLINES = 4  # the small vocabulary's longest run of newlines (Gemma's is 31)
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def _texts() -> list[str]:
    """The corpus, the development prompts, and what a Gemma 4 conversation and odd inputs hold."""
    from engine.prompts import DEFAULT_PROMPTS, load_prompts

    chat = "<bos><|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n<|channel>thought\nadd<channel|>4<turn|>\n"
    tools = '<|tool_call>call:add{a:<|"|>1<|"|>}<tool_call|><|tool_response>response:add{value:2}<tool_response|>'
    odd = ["", " ", "  ", "\n", "\n\n\n", " \n \n\n ", "\t\t\tx", "\n" * 40 + "x", " " * 40 + "x", "  lead", "trail  "]
    odd += ["\u00a0\u3000\u200b", "\U0010fffd\ue000\U000e0001", "a\x00b\x7f", "😶‍🌫️🦙" * 3, "<unk>x<mask>", "<|think|>"]
    return corpus() + [p.text for p in load_prompts(DEFAULT_PROMPTS)] + [chat, tools] + odd


TEXTS = _texts()


def write_folder(folder, vocab: dict[str, int], merges: list, specials: list[str], added: list[str]) -> None:
    """A Gemma 4 shaped tokenizer.json and tokenizer_config.json in `folder`: `specials` (in `vocab`) added special,
    `added` (in `vocab`) added not special, and Gemma 4's named special tokens and a chat template in the config."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in added])
    tok.save(str(folder / "tokenizer.json"))
    named = dict(zip(("pad_token", "eos_token", "bos_token", "unk_token", "mask_token"), NAMED))
    config = {"tokenizer_class": "GemmaTokenizer", **named, "extra_special_tokens": SPECIALS[5:]}
    config |= {"add_bos_token": True, "add_eos_token": False, "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _small(folder) -> None:
    """A BPE trained on half the corpus (Gemma 4's special tokens first, the 256 byte tokens and runs of newlines
    after the trained ones): its 400 commonest characters, the others byte fallback. `<|` and `<0x` are kept
    apart in the training text: llama.cpp makes a token spelled `<|im_end|>` (and a few other end-of-turn names)
    control whatever the file says, every decoder reads one spelled `<0x41>` as a byte, and a Gemma 4 vocabulary
    holds no such ordinary token."""
    from tokenizers import Tokenizer, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    lines = [line for text in corpus()[::2] for line in text.split("\n") if line.strip()]
    train = [line.replace("<|", "< |").replace("<0x", "< 0x") for line in lines]
    trainer = trainers.BpeTrainer(vocab_size=3000, limit_alphabet=400, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(train, trainer)
    model = json.loads(tok.to_str())["model"]
    assert len(model["merges"]) > 2000
    vocab = model["vocab"]
    newlines = ["\n" * k for k in range(1, NEWLINES + 1)]
    for t in [f"<0x{b:02X}>" for b in range(256)] + newlines:
        vocab.setdefault(t, len(vocab))
    write_folder(folder, vocab, [tuple(m) for m in model["merges"]], SPECIALS, newlines)


def _gemma3(folder) -> None:
    """Gemma 3 270M's vocabulary made Gemma 4's shape (see the module's docstring)."""
    import shutil

    from transformers.tokenization_utils_base import generate_merges

    from formats.gguf_file import GGUFFile
    from tests.models.hf_cache import kept, sources

    path = paths.models_dir() / "gemma-3-270m-q4_k_m.gguf"
    if not path.exists():
        pytest.skip(f"{path} is not there (launch models pull gemma-3-270m): its vocabulary stands in for Gemma 4's")

    def build(into) -> None:  # the folder and the GGUF the converter writes for 262k tokens: most of a minute,
        # built once (tests/models/hf_cache.py)
        fields = GGUFFile(path).fields
        tokens, types = list(fields["tokenizer.ggml.tokens"]), fields["tokenizer.ggml.token_type"]
        renamed = dict(zip((105, 106, 98, 46, 47, 100, 101, 48, 49, 50, 51, 52), SPECIALS[5:]))
        tokens = [renamed.get(i, SPACE * len(t) if t and not t.strip(" ") else t) for i, t in enumerate(tokens)]
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = generate_merges(vocab, {t: -i for i, t in enumerate(tokens)})  # as transformers' Gemma GGUF reader
        merges = [(a, b) for a, b in merges if "\n" not in a + b]
        controls = [t for t, k in zip(tokens, types) if k == 3 and t not in SPECIALS]  # `<unused0>`...: not named
        write_folder(into, vocab, merges, SPECIALS + controls, [t for t in tokens if t and not t.strip("\n")])
        _write_gguf(into)

    depends = sources(__file__, Path(__file__).with_name("gguf_tokenizer_files.py"))  # the code that writes it
    done = kept(path, "gemma4-shape", build, depends)
    shutil.copytree(done, folder, dirs_exist_ok=True, ignore=shutil.ignore_patterns("done"))


def _write_gguf(folder) -> None:
    """The GGUF llama.cpp's converter writes for the folder's tokenizer (t.gguf beside it)."""
    tokens, scores, types = gemma4_vocab(folder)
    write_tokenizer_gguf(
        folder / "t.gguf", folder, "gemma4", "gemma4", tokens, types, scores=scores, space_prefix=False
    )


@pytest.fixture(scope="module", params=["small", pytest.param("gemma3", marks=[pytest.mark.real, pytest.mark.gemma])])
def case(request, tmp_path_factory):
    """(the tokenizer.json's `tokenizers` Tokenizer, ours from the GGUF the converter writes for it, the GGUF)."""
    from tokenizers import Tokenizer

    from formats.gguf_file import GGUFFile

    folder = tmp_path_factory.mktemp(f"gemma4-{request.param}")
    if request.param == "small":
        _small(folder)
        _write_gguf(folder)
    else:
        _gemma3(folder)
    ours = TextTokenizer(info_from_gguf(GGUFFile(folder / "t.gguf").fields, "t.gguf", "gemma4"))
    return Tokenizer.from_file(str(folder / "tokenizer.json")), ours, folder / "t.gguf"


def departs(ref):
    """Whether llama.cpp (and so cadence) departs from the tokenizer.json `ref` on a text: where it holds a run of
    newlines longer than the longest newline token (added tokens to `ref`, cut longest first; merges to llama.cpp,
    and there are none), or the spelling of an added token the converter typed normal (only the tokenizer's
    named specials are control: `<unused0>`... are text to llama.cpp)."""
    added = ref.get_added_tokens_decoder().values()
    longest = max(len(t.content) for t in added if not t.content.strip("\n"))
    typed_normal = [re.escape(t.content) for t in added if t.special and t.content not in SPECIALS]
    return re.compile("|".join([f"\n{{{longest + 1},}}", *typed_normal])).search


def test_gemma4_ids_are_the_tokenizer_json(case):
    """Every text encodes as the model's tokenizer.json encodes it, but where llama.cpp departs from it."""
    ref, ours, _ = case
    assert isinstance(ours.spm, MergesEncoder) and ours.vocab_size == ref.get_vocab_size()
    skip = departs(ref)
    texts = [t for t in TEXTS if not skip(t)]
    assert len(texts) > 0.95 * len(TEXTS)
    expected = [e.ids for e in ref.encode_batch(texts, add_special_tokens=False)]
    assert [t for t, e in zip(texts, expected) if ours.spm.encode(t) != e] == []
    for token in SPECIALS:  # each special token, the visible ones too, is one token written in a text
        assert ours.encode(f"a{token}b")[2:-1] == [ref.token_to_id(token)]


def test_gemma4_ids_are_llama_cpps(case):
    """Every text, those departing from the tokenizer.json too, encodes as llama.cpp's own tokenizer of the GGUF
    encodes it (special tokens read as such, as a chat template's must be), and gets the BOS it adds (one only:
    a text the chat template began with `<bos>` gets no second, where llama.cpp warns and adds one)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    _, ours, path = case
    ll = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    assert [t for t in TEXTS if ours.spm.encode(t) != ll.tokenize(t.encode(), add_bos=False, special=True)] == []
    assert ours.encode("Hi") == ll.tokenize(b"Hi", add_bos=True, special=True)
    assert [ours.decode([i]) for i in ours.encode("\n" * 40)[1:]] == ["\n"] * 40  # no merge of newlines


def test_gemma4_decodes_as_the_tokenizer_json(case):
    """decode(encode(x)) == x (a literal ▁ is a space to the decoder), and any ids decode as the tokenizer.json's
    decoder decodes them. Skipping special tokens skips the file's control ones, Gemma 4's named specials: not
    the visible ones, which the converter made user-defined to be always written (as llama.cpp writes them),
    nor those it typed normal; streamed, the pieces add up to the whole."""
    ref, ours, _ = case
    texts = [t for t in TEXTS if SPACE not in t]
    assert [t for t in texts if ours.decode(ours.spm.encode(t)) != t] == []
    assert ours.table.special == {ref.token_to_id(t) for t in NAMED}
    rng = random.Random(0)
    for _ in range(2000):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 24))]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False)
        kept = [i for i in ids if i not in ours.table.special]
        assert ours.decode(ids, True) == ref.decode(kept, skip_special_tokens=False)
    for text in TEXTS[::9]:
        ids, stream = ours.encode(text), StreamDecoder(ours)
        assert "".join(stream.push([i]) for i in ids) + stream.finish() == ours.decode(ids)
        assert 0 < ours.min_tokens(len(text.encode()), text.isascii()) <= len(ids)


def test_gemma4_chat_turns_and_store(case, tmp_path):
    """The file's chat template renders with one BOS, `<turn|>` (and `<|tool_response>`, which a tool call waits
    for) stops generation, the BOS is added as llama.cpp forces it; a weight store's copy (tokenizer.spm, the merges
    after the vocabulary) reads back as the same vocabulary and encoder."""
    _, ours, _ = case
    text = ours.apply_chat_template([{"role": "user", "content": " Hi! "}])
    assert text == "<bos><|turn>user\nHi!<turn|>\n<|turn>model\n"
    ids = ours.encode(text)
    assert ids[:2] == [ours.bos_id, ours.token_id("<|turn>")] and ids.count(ours.bos_id) == 1
    assert {ours.token_id(t) for t in ("<eos>", "<turn|>", "<|tool_response>")} <= ours.stop_ids
    assert ours.add_bos and ours.encode("x")[0] == ours.bos_id and not ours.info.spm.add_space_prefix
    (tmp_path / "tokenizer.spm").write_bytes(ours.info.dumps())
    back = read_info(tmp_path / "tokenizer.spm", ours.info.to_dict(), "convert again")
    assert back.spm == ours.info.spm and TextTokenizer(back).encode(TEXTS[-20]) == ours.encode(TEXTS[-20])


def test_gemma4_refusals():
    """A `gemma4` file without its merges, and a damaged store copy of the merges, are one sentence each."""
    fields = {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": ["<pad>", "a"]}
    with pytest.raises(CadenceError, match=r"^g4\.gguf has a 'gemma4' tokenizer without its merges \("):
        info_from_gguf(fields, "g4.gguf", "gemma4")
    vocab = SpmVocab.of(["a", "b", "ab"], [0.0] * 3, [1] * 3, add_space_prefix=False, unk_id=None, merges=["a b"])
    data = vocab.dumps()
    assert SpmVocab.loads(data, "t", "x") == vocab and MergesEncoder(vocab).encode("aba") == [2, 0]
    for bad in (data[:-1], data + b"x", data.replace(b'"merges": 1', b'"merges": -1')):
        with pytest.raises(CadenceError, match=r"^t is not a SentencePiece vocabulary \(.*\); x$"):
            SpmVocab.loads(bad, "t", "x")
