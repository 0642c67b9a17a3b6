"""Tokenizers read from GGUF files (text/tokenizer_gguf.py) against the reference tokenizers of their families.

Each kind is trained small here (sentencepiece for SentencePiece BPE; the tokenizers library, with the family's
own pre-tokenizer, for byte-level BPE), its GGUF written as llama.cpp's converter writes it
(tests/models/gguf_tokenizer_files.py), and our ids compared with the reference's over a few thousand varied
texts (tests/models/text_corpus.py); decode(encode(x)) must give x back. A SentencePiece vocabulary is compared
twice: as cadence encodes it (text/spm.py, decoding from a byte table) and as the `tokenizers` pipeline of
text/tokenizer_gguf.py (`spm_tokenizer`) does, which tests/models/test_spm.py holds the two to, id for id.
The real Gemma 3 270M file is compared with transformers' and llama.cpp's own GGUF tokenizers where it has
been pulled.
"""

from __future__ import annotations

import dataclasses
import io
import json
import random
import re

import pytest

from common import paths
from common.errors import CadenceError
from text.tokenizer import TextTokenizer, TokenizerInfo
from text.tokenizer_gguf import GEMMA_CHAT_TEMPLATE, info_from_gguf, spm_tokenizer
from tests.models.gguf_tokenizer_files import bpe_vocab, spm_vocab, write_tokenizer_gguf
from tests.models.text_corpus import corpus

CORPUS = corpus()
TRAIN = [line for text in CORPUS[::2] for line in text.split("\n") if line.strip()]
SPACE = "\u2581"  # a literal ▁ in a text is a space to SentencePiece's decoder: such texts cannot round trip
SPM_OPTIONS = dict(
    model_type="bpe",
    vocab_size=4000,
    byte_fallback=True,
    character_coverage=0.99,
    split_digits=True,
    allow_whitespace_only_pieces=True,
    remove_extra_whitespaces=False,
    normalization_rule_name="identity",
    max_sentence_length=1 << 20,
    minloglevel=2,
    num_threads=1,
)
# Llama 2 / Mistral: a dummy prefix; Mistral v0.3's [INST] controls. Gemma: no prefix, its controls, and its
# user-defined runs of spaces (written with real spaces in the GGUF), newlines, tabs and HTML tags.
SPM_MODELS = {
    "llama": dict(
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, control_symbols=["[INST]", "[/INST]"], add_dummy_prefix=True
    ),
    "gemma": dict(
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        control_symbols=["<mask>", "<start_of_turn>", "<end_of_turn>"],
        user_defined_symbols=[SPACE * k for k in range(2, 9)] + ["\n", "\n\n", "\t", "<b>", "</b>"],
        add_dummy_prefix=False,
    ),
}


def ids_of(ours: TextTokenizer, texts: list[str]) -> list[list[int]]:
    """The ids of each text, no BOS, as `ours` encodes them (its SentencePiece or byte-level BPE encoder, or its
    `tokenizers` object, which encodes a batch on all cores)."""
    if ours.spm is not None:
        return [ours.spm.encode(t) for t in texts]
    if ours.bpe is not None:
        return [ours.bpe.encode(t) for t in texts]
    return [e.ids for e in ours.tok.encode_batch(texts, add_special_tokens=False)]


def _mismatches(ours: TextTokenizer, reference, texts: list[str]) -> list[str]:
    return [t for t, a, b in zip(texts, ids_of(ours, texts), reference(texts)) if a != b]


def pipeline_of(info: TokenizerInfo) -> TokenizerInfo:
    """A SentencePiece vocabulary's tokenizer as the `tokenizers` pipeline (`spm_tokenizer`) rather than
    text/spm.py's encoder: the same ids, BOS, stop tokens and chat template."""
    v = info.spm
    tok = spm_tokenizer(
        [t.decode() for t in v.tokens],
        list(v.scores),
        list(v.types),
        add_space_prefix=v.add_space_prefix,
        unk_id=v.unk_id,
    )
    return dataclasses.replace(info, tokenizer_json=tok.to_str(), spm=None)


def _spm_case(name: str, folder):
    """(name, sentencepiece processor, transformers' fast tokenizer from its .model, ours from the GGUF, the
    `tokenizers` pipeline of the same vocabulary)."""
    import sentencepiece
    from transformers import GemmaTokenizerFast, LlamaTokenizerFast

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAIN), model_writer=model, **SPM_OPTIONS, **SPM_MODELS[name]
    )
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    sp = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    hf = (GemmaTokenizerFast if name == "gemma" else LlamaTokenizerFast).from_pretrained(folder)
    hf.save_pretrained(folder)  # its added tokens, which llama.cpp's converter reads
    tokens, scores, types = spm_vocab(folder / "tokenizer.model", folder)
    arch, prefix = ("gemma3", False) if name == "gemma" else ("llama", None)
    fields = write_tokenizer_gguf(
        folder / "t.gguf", folder, arch, "llama", tokens, types, scores=scores, space_prefix=prefix
    )
    info = info_from_gguf(fields, "t.gguf", arch)
    return name, sp, hf, TextTokenizer(info), TextTokenizer(pipeline_of(info))


@pytest.fixture(scope="module")
def spm_llama(tmp_path_factory):
    return _spm_case("llama", tmp_path_factory.mktemp("spm-llama"))


@pytest.fixture(scope="module")
def spm_gemma(tmp_path_factory):
    return _spm_case("gemma", tmp_path_factory.mktemp("spm-gemma"))


ENCODERS = ("spm", "tokenizers")  # cadence's SentencePiece encoder (text/spm.py), the `tokenizers` pipeline


@pytest.fixture(params=[(m, e) for m in sorted(SPM_MODELS) for e in ENCODERS], ids="-".join)
def spm_case(request):
    """(name, sentencepiece, transformers, the encoder under test: cadence's or the `tokenizers` pipeline)."""
    model, encoder = request.param
    name, sp, hf, ours, pipeline = request.getfixturevalue(f"spm_{model}")
    return name, sp, hf, ours if encoder == "spm" else pipeline


def _control_pieces(sp) -> list[str]:
    return [sp.IdToPiece(i) for i in range(sp.vocab_size()) if sp.IsControl(i) or sp.IsUnknown(i)]


def _controls(sp) -> re.Pattern:
    """A pattern finding the spelling of any control token (and the unknown one) in a text."""
    return re.compile("|".join(map(re.escape, _control_pieces(sp))))


def test_sentencepiece_ids_are_sentencepieces(spm_case):
    """Every text without a control token's spelling in it (sentencepiece does not read those) encodes as
    sentencepiece encodes it. Gemma's user-defined runs of spaces are matched in the text as llama.cpp matches
    them, so a literal ▁ next to a space is no run to us (sentencepiece sees one): those texts are left out."""
    name, sp, _, ours = spm_case
    control = _controls(sp)
    texts = [t for t in CORPUS if not control.search(t) and not (name == "gemma" and SPACE in t)]
    assert len(texts) > 2 * len(CORPUS) // 3
    assert _mismatches(ours, sp.encode, texts) == []


def test_sentencepiece_ids_are_transformers(spm_case):
    """The same ids as transformers' fast tokenizer made from the .model, but where it departs from
    sentencepiece: its LlamaTokenizer (`Metaspace(prepend_scheme="first")`) adds no ▁ before a text that starts
    with a space or after a control token (so those texts are compared without their leading whitespace), and
    its GemmaTokenizer reaches a run of spaces longer than the longest whitespace token by merges rather than
    longest first; a literal ▁ is a space to both."""
    name, sp, hf, ours = spm_case
    if name == "llama":
        control = _controls(sp)
        texts = [t.lstrip() for t in CORPUS if t.strip() and SPACE not in t and not control.search(t)]
    else:
        longest = max(len(t) for t in hf.get_vocab() if set(t) == {SPACE})
        texts = [t for t in CORPUS if SPACE not in t and not re.search(f" {{{longest + 1},}}", t)]
    assert len(texts) > 2 * len(CORPUS) // 3
    assert _mismatches(ours, lambda b: hf(b, add_special_tokens=False)["input_ids"], texts) == []


@pytest.mark.parametrize("encoder", ENCODERS)
def test_llama_sentencepiece_is_transformers_own_sentencepiece_pipeline(spm_llama, encoder):
    """transformers' pipeline that "encodes like SentencePieceProcessor.encode" (its legacy dummy prefix, the
    one Llama 2's and Phi-3's tokenizer.json have), with the control tokens added as they add them, agrees on
    every text, leading spaces and control tokens included."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    _, sp, _, ours, pipeline = spm_llama
    ours = ours if encoder == "spm" else pipeline
    if not hasattr(SpmConverter, "build_tokenizer_from_spm_proto"):
        pytest.skip("this transformers has no SentencePiece-faithful builder")
    proto = import_protobuf().ModelProto()
    proto.ParseFromString(sp.serialized_model_proto())
    ref = SpmConverter.build_tokenizer_from_spm_proto(proto, {p.piece: i for i, p in enumerate(proto.pieces)})
    ref.add_special_tokens([AddedToken(c, normalized=False, special=True) for c in _control_pieces(sp)])
    assert _mismatches(ours, lambda b: [e.ids for e in ref.encode_batch(b, add_special_tokens=False)], CORPUS) == []


def test_sentencepiece_round_trips(spm_case):
    """decode(encode(x)) == x, the BOS first where the file says so. A text after a control token gets its
    own dummy prefix with Llama (as sentencepiece and llama.cpp give it), which decodes as a space."""
    name, sp, _, ours = spm_case
    control = _controls(sp)
    texts = [t for t in CORPUS if SPACE not in t and (name == "gemma" or not control.search(t))]
    assert all(ours.encode(t)[:1] == [ours.bos_id] for t in texts[:50]) and ours.bos_id is not None
    assert [t for t in texts if ours.decode(ours.encode(t)[1:]) != t] == []


def test_sentencepiece_control_tokens_stay_whole(spm_case):
    """Each control token (`[INST]`, `<start_of_turn>`, `<unk>`) written in a text is that one token."""
    _, sp, _, ours = spm_case
    for piece in _control_pieces(sp):
        assert sp.PieceToId(piece) in ours.encode(f"x{piece} y")[1:], piece


def test_sentencepiece_streams_and_bounds(spm_case):
    """Streamed token by token, a text's pieces (characters cut across `<0xNN>` bytes held back) join into what
    decoding it whole gives; and the length bound never refuses a text that fits."""
    from text.tokenizer import StreamDecoder

    _, _, _, ours = spm_case
    for text in CORPUS[::5]:
        ids, stream = ours.encode(text), StreamDecoder(ours)
        pieces = [stream.push([i]) for i in ids]
        assert "".join(pieces) == ours.decode(ids) and ("\ufffd" in text or all("\ufffd" not in p for p in pieces))
        assert 0 < ours.min_tokens(len(text.encode()), text.isascii()) <= len(ids)


@pytest.mark.parametrize("model", sorted(SPM_MODELS))
def test_sentencepiece_byte_table_decodes_as_the_tokenizer(model, request):
    """Every token, and random runs of them (lone bytes of a character included), decode from the byte table as
    the `tokenizers` pipeline's decoder decodes them, special tokens kept or skipped, the leading space stripped
    or not: the table cadence decodes a SentencePiece vocabulary with, and the one a run that let the pipeline
    go would make of it."""
    *_, ours, pipeline = request.getfixturevalue(f"spm_{model}")
    lean = TextTokenizer(pipeline.info)
    assert lean.release_encoder() and lean.tok is None and lean.table.fallback
    assert ours.tok is None and ours.table.fallback and ours.vocab_size == pipeline.vocab_size
    for table in (ours, lean):
        assert [i for i in range(ours.vocab_size) if table.decode([i]) != pipeline.decode([i])] == []
        rng = random.Random(0)
        for _ in range(2000):
            ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 24))]
            assert table.decode(ids) == pipeline.decode(ids) and table.decode(ids, True) == pipeline.decode(ids, True)
        for text in CORPUS[::7]:
            assert table.decode(ours.encode(text)) == pipeline.decode(ours.encode(text))


@pytest.mark.parametrize("model", sorted(SPM_MODELS))
def test_sentencepiece_encoder_is_the_tokenizers_pipeline(model, request):
    """cadence's encoder gives the `tokenizers` pipeline's ids on every text, control tokens read as such or as
    text (the pipeline's `encode_special_tokens`), and the same stop ids, vocabulary size and length bound."""
    from text.textcheck import token_bound

    *_, ours, pipeline = request.getfixturevalue(f"spm_{model}")
    assert ours.tok is None and ids_of(ours, CORPUS) == ids_of(pipeline, CORPUS)
    pipeline.tok.encode_special_tokens = True
    try:
        assert [ours.spm.encode(t, special=False) for t in CORPUS] == ids_of(pipeline, CORPUS)
    finally:
        pipeline.tok.encode_special_tokens = False
    assert (ours.stop_ids, ours.vocab_size, ours.bos_id) == (pipeline.stop_ids, pipeline.vocab_size, pipeline.bos_id)
    assert (ours.spm.bound(), 1) == token_bound(pipeline.tok)


def test_gemma_gets_its_chat_template_and_stops_at_the_end_of_a_turn(spm_gemma, spm_llama):
    """A Gemma GGUF without a chat template gets Gemma's (a system message folded into the first user turn),
    the rendered text encodes with one BOS, and `<end_of_turn>` stops generation; a file's own template wins."""
    ours = spm_gemma[3]
    assert ours.info.chat_template == GEMMA_CHAT_TEMPLATE and spm_llama[3].info.chat_template is None
    text = ours.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": " Hi! "},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "text", "text": "Bye"}]},
        ]
    )
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = ours.encode(text)
    assert ids[:2] == [ours.bos_id, ours.token_id("<start_of_turn>")] and ids.count(ours.bos_id) == 1
    assert ours.token_id("<end_of_turn>") in ours.stop_ids and ours.stop_ids == spm_gemma[4].stop_ids
    with pytest.raises(CadenceError, match="roles must alternate"):
        ours.apply_chat_template([{"role": "assistant", "content": "x"}])
    fields = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<start_of_turn>", "<end_of_turn>"]}
    assert info_from_gguf(fields, "g.gguf", "gemma2").chat_template == GEMMA_CHAT_TEMPLATE
    assert info_from_gguf({**fields, "tokenizer.chat_template": "X"}, "g.gguf", "gemma2").chat_template == "X"
    assert info_from_gguf(fields, "g.gguf", "llama").chat_template is None
    # that template is the family's, not the model's (a base model, as Gemma 3 270M's base GGUF is): `--chat auto`
    # leaves an instruction as raw text to complete; `--chat on` and a conversation's messages take it
    from engine.prompts import Prompt, encode_prompt, own_template

    ask = Prompt("q", "open", "Name three colours.")
    assert not own_template(ours) and encode_prompt(ours, ask, "auto") == (ours.encode(ask.text), False)
    assert (
        encode_prompt(ours, ask, "on")[1]
        and encode_prompt(ours, Prompt("c", "chat", "", messages=({"role": "user", "content": "hi"},)), "auto")[1]
    )


# Each family's pre-tokenizer and normalizer as its HF tokenizer.json has them (the split regexes as llama.cpp's
# llama-vocab.cpp quotes them, "original regex from tokenizer.json"), whether its BPE skips the merges of a
# word that is a token whole, and some of its added tokens (special ones, and one that is not).
LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT2 = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
DIGITS = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, GPT2]}


def _split(regex: str) -> dict:
    isolated = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [isolated, {**GPT2, "use_regex": False}]}


CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|end_of_text|>", "<|begin_of_text|>", "<|eot_id|>", "<|eom_id|>"]
# llama.cpp's pre-tokenizer name: (pre_tokenizer, normalizer, ignore_merges, special tokens (the EOS first), the
# token its chat template ends a turn with)
FAMILIES = {
    "llama-bpe": (_split(LLAMA3), None, True, LLAMA3_SPECIALS, "<|eot_id|>"),
    "qwen2": (_split(QWEN2), {"type": "NFC"}, False, CHATML, "<|im_end|>"),  # Qwen2, Qwen2.5
    "smollm": (DIGITS, None, False, CHATML, "<|im_end|>"),
    "refact": (DIGITS, None, False, ["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"], "<|end_of_text|>"),
    "dbrx": (_split(LLAMA3), None, False, [*CHATML, "<|im_sep|>"], "<|im_end|>"),  # OLMo 2, Phi-4, Granite 4
    "tekken": (_split(TEKKEN), None, True, ["</s>", "<unk>", "<s>", "[INST]", "[/INST]"], "</s>"),  # Mistral Nemo
    "gpt-4o": (_split(O200K), None, False, ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"], "<|end|>"),
    "olmo": (GPT2, None, False, ["<|endoftext|>", "<|padding|>"], "<|endoftext|>"),  # GPT-2's own regex
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(pre-tokenizer name, transformers' PreTrainedTokenizerFast over the family's tokenizer.json, ours from
    the GGUF llama.cpp's converter would write for it)."""
    from tokenizers import AddedToken, Tokenizer, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    pre, (pre_tokenizer, normalizer, ignore_merges, specials, _) = request.param, FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(f"bpe-{pre}")
    spec = {"version": "1.0", "added_tokens": [], "normalizer": normalizer, "pre_tokenizer": pre_tokenizer}
    spec |= {"post_processor": None, "decoder": {**GPT2, "add_prefix_space": True}, "truncation": None}
    spec |= {"padding": None, "model": {"type": "BPE", "vocab": {}, "merges": []}}
    tok = Tokenizer.from_str(json.dumps(spec))
    trainer = trainers.BpeTrainer(
        vocab_size=3000,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN, trainer)
    tok.add_tokens([AddedToken("<think>", normalized=False, special=False)])
    trained = json.loads(tok.to_str())
    trained["model"]["ignore_merges"] = ignore_merges
    (folder / "tokenizer.json").write_text(json.dumps(trained))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token=specials[0])
    hf.save_pretrained(folder)
    tokens, types = bpe_vocab(hf)
    fields = write_tokenizer_gguf(folder / "t.gguf", folder, "llama", "gpt2", tokens, types, pre=pre)
    return pre, hf, TextTokenizer(info_from_gguf(fields, "t.gguf", "llama"))


def test_byte_level_ids_are_the_familys(family):
    """Every text encodes as the family's HF tokenizer encodes it, and decodes back (NFC-composed where the family
    normalizes so); its special tokens stay whole."""
    import unicodedata

    pre, hf, ours = family
    spec, theirs = json.loads(ours.info.tokenizer_json), json.loads(hf.backend_tokenizer.to_str())
    # the same pipeline: a BPE trained here rarely meets a word the merges do not rebuild, where ignore_merges shows
    assert [spec[k] for k in ("normalizer", "pre_tokenizer")] == [theirs[k] for k in ("normalizer", "pre_tokenizer")]
    assert spec["model"]["ignore_merges"] == theirs["model"]["ignore_merges"]
    assert _mismatches(ours, lambda b: hf(b, add_special_tokens=False)["input_ids"], CORPUS) == []
    nfc = FAMILIES[pre][1] is not None
    assert [t for t in CORPUS if ours.decode(ours.encode(t)) != (unicodedata.normalize("NFC", t) if nfc else t)] == []
    for special in [*FAMILIES[pre][3], "<think>"]:
        assert ours.encode(f"a{special}b")[1:-1] == [hf.convert_tokens_to_ids(special)]
    served = TextTokenizer(ours.info)  # what a server keeps: text/bytebpe.py in the `tokenizers` object's place
    assert served.compact_encoder() and served.tok is None
    assert _mismatches(served, lambda b: hf(b, add_special_tokens=False)["input_ids"], CORPUS) == []


def test_an_unknown_tokenizer_is_one_sentence_naming_the_file(tmp_path):
    """A tokenizer kind cadence does not read, a byte-level split it does not know, and a file with no
    tokenizer are each refused in one sentence naming the file."""
    fields = {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["<pad>", "</s>", "<unk>"]}
    with pytest.raises(CadenceError) as e:
        info_from_gguf(fields, "flan-t5.gguf", "t5")
    assert str(e.value) == (
        "flan-t5.gguf has a 't5' tokenizer, which cadence does not read (it reads SentencePiece 'llama', byte-level "
        "BPE 'gpt2' and Gemma 4's 'gemma4' ones); use the model's HF directory, whose tokenizer.json it reads"
    )
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "chatglm-bpe", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(CadenceError, match=r"^glm\.gguf splits text with the 'chatglm-bpe' pre-tokenizer, which "):
        info_from_gguf(fields, "glm.gguf", "chatglm")
    with pytest.raises(CadenceError, match=r"^bare\.gguf carries no tokenizer"):
        info_from_gguf({}, "bare.gguf", "llama")


def test_end_of_turn_tokens_stop_generation(family):
    """Each family's end of turn (what its chat template closes a turn with) is a stop token, its EOS too."""
    pre, hf, ours = family
    assert {hf.convert_tokens_to_ids(FAMILIES[pre][4]), hf.eos_token_id} <= ours.stop_ids


@pytest.fixture(scope="module")
def gemma3():
    """The real Gemma 3 270M GGUF (which carries no chat template) where `launch models pull gemma-3-270m` puts it;
    its tests are skipped where it is not (and left out by `-m "not gemma"`)."""
    from formats.gguf_file import GGUFFile

    path = paths.models_dir() / "gemma-3-270m-q4_k_m.gguf"
    if not path.exists():
        pytest.skip(f"{path} is not there: launch models pull gemma-3-270m")
    fields = GGUFFile(path).fields
    return path, TextTokenizer(info_from_gguf(fields, path.name, fields["general.architecture"]))


@pytest.fixture(scope="module")
def gemma3_pipeline(gemma3):
    """Gemma 3's vocabulary as the `tokenizers` pipeline (513k merges: ~500 MiB and seconds to build)."""
    return TextTokenizer(pipeline_of(gemma3[1].info))


@pytest.fixture(params=ENCODERS)
def gemma3_encoder(request, gemma3):
    """(the GGUF's path, Gemma 3's tokenizer: cadence's encoder, or the `tokenizers` pipeline)."""
    return gemma3[0], gemma3[1] if request.param == "spm" else request.getfixturevalue("gemma3_pipeline")


@pytest.fixture(scope="module")
def gemma3_hf(gemma3):
    """transformers' own tokenizer of the GGUF (its build kept: tests/models/hf_cache.py)."""
    from tests.models.hf_cache import hf_tokenizer

    return hf_tokenizer(gemma3[0])


@pytest.mark.real
@pytest.mark.gemma
def test_real_gemma3_ids_are_transformers(gemma3_encoder, gemma3_hf):
    """Our ids are transformers' own GGUF tokenizer's, and decode back, except where transformers departs from
    SentencePiece and llama.cpp: it spells Gemma's whitespace tokens `▁▁...` and reaches them by merges, so a
    literal ▁ is a space to it, and a run of more than 31 spaces (the longest such token) comes out as 16 + 16
    where they match the longest first (31 + 1); those texts are llama.cpp's below."""
    _, ours = gemma3_encoder
    hf = gemma3_hf
    texts = [t for t in CORPUS if SPACE not in t and not re.search(" {32,}", t)]
    assert len(texts) > 2 * len(CORPUS) // 3
    assert _mismatches(ours, lambda b: hf(b, add_special_tokens=False)["input_ids"], texts) == []
    assert [t for t in texts if ours.decode(ours.encode(t)[1:]) != t] == []
    assert [ours.decode([i]) for i in ours.encode(" " * 40 + "x")] == ["<bos>", " " * 31, " " * 9, "x"]
    assert ours.info.chat_template == GEMMA_CHAT_TEMPLATE and ours.token_id("<end_of_turn>") in ours.stop_ids


@pytest.mark.real
@pytest.mark.gemma
def test_real_gemma3_ids_are_llama_cpps(gemma3_encoder):
    """Every text, whitespace runs and literal ▁ included, encodes as llama.cpp's tokenizer encodes it (control
    tokens read as such, as a chat template's must be)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path, ours = gemma3_encoder
    ll = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    bad = [t for t in CORPUS if ours.encode(t)[1:] != ll.tokenize(t.encode(), add_bos=False, special=True)]
    assert bad == []


@pytest.mark.real
@pytest.mark.gemma
def test_real_gemma3_encoder_is_the_tokenizers_pipeline(gemma3, gemma3_pipeline):
    """cadence's encoder gives the `tokenizers` pipeline's ids on every text, control tokens read as such or as
    text (the pipeline's `encode_special_tokens`), and the same stop ids, vocabulary size and length bound."""
    from text.textcheck import token_bound

    _, ours = gemma3
    ref = gemma3_pipeline.tok
    assert ids_of(ours, CORPUS) == ids_of(gemma3_pipeline, CORPUS)
    ref.encode_special_tokens = True
    try:
        assert [ours.spm.encode(t, special=False) for t in CORPUS] == ids_of(gemma3_pipeline, CORPUS)
    finally:
        ref.encode_special_tokens = False
    assert (ours.stop_ids, ours.vocab_size) == (gemma3_pipeline.stop_ids, gemma3_pipeline.vocab_size)
    assert (ours.spm.bound(), 1) == token_bound(ref)


@pytest.mark.real
@pytest.mark.gemma
def test_real_gemma3_byte_table_decodes_as_the_tokenizer(gemma3, gemma3_pipeline):
    """All 262k tokens, and random runs of them, decode from the byte table (cadence's, and the one the pipeline
    leaves behind it) as the `tokenizers` pipeline decodes them."""
    _, ours = gemma3
    lean = TextTokenizer(gemma3_pipeline.info)
    assert lean.release_encoder() and ours.tok is None
    for table in (ours, lean):
        assert [i for i in range(ours.vocab_size) if table.decode([i]) != gemma3_pipeline.decode([i])] == []
        rng = random.Random(0)
        for _ in range(2000):
            ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 24))]
            assert table.decode(ids) == gemma3_pipeline.decode(ids)
            assert table.decode(ids, True) == gemma3_pipeline.decode(ids, True)
