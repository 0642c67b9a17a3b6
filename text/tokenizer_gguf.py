"""Tokenizers read from a GGUF file's metadata, for the model families users hold.

A GGUF file carries no tokenizer.json: `tokenizer.ggml.model` names the kind, and the vocabulary, the token
types and the kind's own fields describe it. We rebuild the `tokenizers` pipeline that the family's HF
tokenizer.json has, so that ids match HF's, from `tokenizers` building blocks:

- `gpt2`, byte-level BPE (Llama 3, Qwen2, SmolLM, Granite, OLMo 2, Mistral Nemo, Phi-4): the merges are in the
  file, the split regex is the one `tokenizer.ggml.pre` names (text/tokenizer.py, `tokenizer_from_gguf_fields`).
- `llama`, SentencePiece BPE (Gemma 2/3, Mistral v0.1-v0.3, Llama 2, Phi-3): kept as its tokens, scores and
  types (text/spm.py's `SpmVocab`) and encoded by text/spm.py as SentencePiece and llama.cpp encode, with
  no `tokenizers` object: the one below takes ~400 MiB for Gemma's 262k vocabulary (513k merges) while it is
  built or parsed, more than a run under a small budget has. That pipeline, `spm_tokenizer`, stays as the
  reference the encoder is tested against (tests/models/test_gguf_tokenizers.py): a `tokenizers` BPE with
  byte fallback (`<0xNN>` tokens), spaces written `▁`, and merges derived from the scores as transformers'
  converters do (`spm_merges`); control tokens (`<start_of_turn>`, `[INST]`) and user-defined ones (Gemma's
  runs of spaces, tabs and newlines, which llama.cpp's converter writes with real spaces) are matched whole
  in the text first, as llama.cpp does. `tokenizer.ggml.add_space_prefix` (absent: True, llama.cpp's
  default; Gemma's converter writes False) is SentencePiece's dummy prefix: a `▁` before each text between
  special tokens, as sentencepiece and llama.cpp encode and as the Llama 2 and Phi-3 tokenizer.json files do
  (a `Prepend` normalizer), with the decoder dropping that one space again. transformers' own
  `LlamaTokenizer` uses `Metaspace(prepend_scheme="first")` instead, which adds no `▁` to a text that starts
  with a space: " hi" encodes as "hi" would with its prefix, and decodes to "hi". We keep SentencePiece's.
- `gemma4`, Gemma 4's: llama.cpp's converter writes its tokenizer.json's vocabulary and merges (the special tokens
  control, a few visible ones user-defined, the rest normal), a BPE with byte fallback, spaces `▁` and no prefix,
  which llama.cpp runs with its `gemma4` pre-tokenizer. Kept as a `SpmVocab` with the merges and encoded by
  text/spm.py's `MergesEncoder` as llama.cpp encodes it: control and user-defined tokens matched whole, the text
  cut into runs of newlines (a run that is one token is that token: llama.cpp's fix for Gemma 4,
  ggml-org/llama.cpp#21343) and runs of anything else, each merged by rank. A `tokenizers` BPE over the merges
  behind `Replace(" ", "▁")` gives these ids but for that rule (it has no way to take a run whole only where the run
  is one token), and costs the ~400 MiB above. Where the model's tokenizer.json departs from llama.cpp (a run of
  newlines longer than its longest newline token; an added token the converter typed normal, `<unused0>`), the ids
  are llama.cpp's. The BOS is always added, as llama.cpp forces it.

We do not depend on transformers at run time, though it converts both kinds (integrations/gguf): it is a large
dependency (a test one only, today), importing its GGUF tokenizer code costs a second and ~55 MiB in every
process that opens a GGUF, and where its pipelines depart from SentencePiece they depart from llama.cpp, which
these files are made for (the Llama prefix above; Gemma's runs of more than 31 spaces, which it reaches by
merges as 16 + 16 where SentencePiece and llama.cpp match the longest token first, 31 + 1). What we would take
from it is a twenty-line merge derivation and a pipeline of five `tokenizers` parts. It stays the tests'
reference: tests/models/test_gguf_tokenizers.py compares these tokenizers with it, with sentencepiece itself
and, where installed, with llama.cpp's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

from common.errors import CadenceError
from text.bytetable import SPACE
from text.spm import CONTROL, NORMAL, UNKNOWN, USER_DEFINED, SpmVocab
from text.tokenizer import GGUF_PRE_TOKENIZERS, TokenizerInfo, tokenizer_from_gguf_fields

# Gemma's chat format, for a Gemma GGUF that carries no `tokenizer.chat_template` (the Gemma 3 270M one on the
# hub has none). It writes what the chat_template of google/gemma-3-*-it's tokenizer_config.json writes: a
# system message folded into the first user turn, `assistant` called `model`, each turn's text trimmed.
GEMMA_CHAT_TEMPLATE = (
    "{%- macro text(c) -%}{%- if c is string -%}{{ c | trim }}{%- else -%}{%- for p in c -%}"
    "{%- if p['type'] == 'text' -%}{{ p['text'] | trim }}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first = text(messages[0]['content']) + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set first = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{{ (first if loop.first else '') + text(m['content']) + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def info_from_gguf(fields: Mapping[str, Any], name: str, arch: str) -> TokenizerInfo:
    """The tokenizer a GGUF file's fields describe: `name` is the file's, for the error sentences; `arch` its
    `general.architecture`. A tokenizer kind other than `llama`, `gpt2` and `gemma4`, a `gemma4` one without
    its merges, or a byte-level split regex not known here, is one CadenceError naming the file.
    `tokenizer.ggml.add_eos_token` is not read: a prompt is continued by the model, never ended by the tokenizer
    (the chat families here all write False)."""
    kind = fields.get("tokenizer.ggml.model")
    tokens = fields.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise CadenceError(f"{name} carries no tokenizer (no tokenizer.ggml fields); use a GGUF file that has one")
    tok = spm = None
    if kind == "llama":
        spm = spm_vocab(fields)
        add_bos = fields.get("tokenizer.ggml.add_bos_token", True)  # llama.cpp's default for SentencePiece
    elif kind == "gpt2":
        pre = fields.get("tokenizer.ggml.pre", "default")
        if pre not in GGUF_PRE_TOKENIZERS:
            raise CadenceError(
                f"{name} splits text with the '{pre}' pre-tokenizer, which cadence does not know "
                f"(it knows {', '.join(sorted(GGUF_PRE_TOKENIZERS))}); use the model's HF directory instead"
            )
        types = list(fields.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
        tok = tokenizer_from_gguf_fields(tokens, types, fields.get("tokenizer.ggml.merges") or [], pre)
        add_bos = fields.get("tokenizer.ggml.add_bos_token", False)
    elif kind == "gemma4":
        if not fields.get("tokenizer.ggml.merges"):
            raise CadenceError(
                f"{name} has a 'gemma4' tokenizer without its merges (tokenizer.ggml.merges); convert the model "
                "again with llama.cpp's convert_hf_to_gguf.py, or use its HF directory"
            )
        spm, add_bos = spm_vocab(fields, merges=True), True  # llama.cpp adds Gemma 4's BOS whatever the file says
    else:
        raise CadenceError(
            f"{name} has a '{kind}' tokenizer, which cadence does not read (it reads SentencePiece 'llama', "
            "byte-level BPE 'gpt2' and Gemma 4's 'gemma4' ones); use the model's HF directory, whose tokenizer.json "
            "it reads"
        )
    bos, eos = _token_id(fields, "bos", tokens), _token_id(fields, "eos", tokens)
    eot = _token_id(fields, "eot", tokens)  # Gemma 1 and CodeGemma files name their end of turn
    return TokenizerInfo(
        tokenizer_json=tok.to_str() if tok is not None else "",
        spm=spm,
        bos_id=bos,
        eos_ids=[i for i in dict.fromkeys((eos, eot)) if i is not None],
        add_bos=bool(add_bos),
        chat_template=fields.get("tokenizer.chat_template") or default_chat_template(arch, tokens),
        special={"bos": tokens[bos] if bos is not None else "", "eos": tokens[eos] if eos is not None else ""},
    )


def spm_vocab(fields: Mapping[str, Any], merges: bool = False) -> SpmVocab:
    """A `llama` GGUF's SentencePiece vocabulary (scores absent: all 0; types absent: all normal), or with
    `merges` a `gemma4` one's, its merges with it and no dummy prefix whatever `add_space_prefix` says (llama.cpp's
    BPE adds none)."""
    tokens = fields["tokenizer.ggml.tokens"]
    return SpmVocab.of(
        tokens,
        fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens),
        fields.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens),
        add_space_prefix=not merges and bool(fields.get("tokenizer.ggml.add_space_prefix", True)),
        unk_id=fields.get("tokenizer.ggml.unknown_token_id"),
        merges=list(fields["tokenizer.ggml.merges"]) if merges else None,
    )


def _token_id(fields: Mapping[str, Any], what: str, tokens: list[str]) -> int | None:
    tid = fields.get(f"tokenizer.ggml.{what}_token_id")
    return int(tid) if tid is not None and 0 <= int(tid) < len(tokens) else None


FAMILY_TEMPLATES = (GEMMA_CHAT_TEMPLATE,)  # the defaults below: no model's own (engine/prompts.py `own_template`)


def default_chat_template(arch: str, tokens: list[str]) -> str | None:
    """The family's well-known chat template, for a GGUF that carries none: Gemma's, where its turn tokens
    are in the vocabulary; else None (the model is run without one)."""
    if arch.startswith("gemma") and "<start_of_turn>" in tokens and "<end_of_turn>" in tokens:
        return GEMMA_CHAT_TEMPLATE
    return None


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: every split of a normal piece into two pieces of the vocabulary, best
    score first. SentencePiece (and llama.cpp's `llm_tokenizer_spm`) merges, at each step, the adjacent pair
    whose concatenation is the piece of best score; ranking each pair by that piece's score makes a merges
    BPE do the same. Ties (splits of one piece, pieces of one score) go in the order transformers'
    `generate_merges` gives them: the vocabulary's order, the longer left part first. Only normal pieces are
    made by merging: control, user-defined and byte tokens never are (SentencePiece keeps them apart)."""
    index: dict[str, int] = {}
    for i, t in enumerate(tokens):
        index.setdefault(t, i)
    found = []
    for i, (piece, kind) in enumerate(zip(tokens, types)):
        if kind != NORMAL or len(piece) < 2 or index[piece] != i:
            continue
        for k in range(len(piece) - 1, 0, -1):
            if piece[:k] in index and piece[k:] in index:
                found.append((-scores[i], i, len(piece) - k, piece[:k], piece[k:]))
    found.sort()  # (score, piece, split) is unique: the strings are never compared
    return [(left, right) for *_, left, right in found]


def spm_tokenizer(
    tokens: list[str], scores: list[float], types: list[int], *, add_space_prefix: bool, unk_id: int | None
) -> Tokenizer:
    """A SentencePiece BPE vocabulary as a `tokenizers` pipeline: `▁` for spaces (one before each text between
    special tokens where `add_space_prefix`), BPE over the scores' merges with `<0xNN>` byte fallback, control
    and user-defined tokens kept whole, and the decoder back. The reference text/spm.py's encoder is tested
    against; cadence itself encodes with that encoder."""
    index: dict[str, int] = {}
    for i, t in enumerate(tokens):
        index.setdefault(t, i)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    # fuse_unk False: with every byte a token nothing is unknown, and a run of unknowns stays countable
    # (text/textcheck.py bounds a text's tokens only where no run collapses into one)
    model = models.BPE(
        vocab=index, merges=spm_merges(tokens, scores, types), unk_token=unk, fuse_unk=False, byte_fallback=True
    )
    tok = Tokenizer(model)
    space = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), space]) if add_space_prefix else space
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)]
    )
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
    return tok
