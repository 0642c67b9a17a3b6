"""Tokenizer: byte-level BPE rebuilt from GGUF metadata (or an HF tokenizer.json), chat template.

A GGUF file carries no tokenizer.json: it stores the vocabulary, the merges, the token types
and the name of the pre-tokenizer (`tokenizer.ggml.pre`). We rebuild the same `tokenizers`
pipeline HF ships for these models: the model's split regex, byte-level mapping, BPE, and the
control tokens added whole so that `<|im_start|>` stays one token. SentencePiece GGUFs, and the
choice between the kinds, are text/tokenizer_gguf.py's (`info_from_gguf`): a SentencePiece vocabulary (and Gemma
4's, which adds its merges) is kept as its tokens, scores and types (text/spm.py's `SpmVocab`) and encoded by
text/spm.py, with no `tokenizers` object (Gemma's 262k vocabulary makes one of ~400 MiB while it is parsed).

What users and clients send is checked at the entry points (`encode`, `apply_chat_template`): text that is
not UTF-8 is one sentence naming it, and a text far longer than the context is refused from its length
before the tokenizer reads it (`min_tokens`).
"""

from __future__ import annotations

import json

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from common.errors import CadenceError
from common.heap import trim_heap
from text.bytetable import ByteTable
from text.tokenizer_bpe import GGUF_PRE_TOKENIZERS, tokenizer_from_gguf_fields  # noqa: F401 - re-exported
from common.files import read_bytes, read_text
from text.spm import CONTROL, FILE as SPM_FILE, UNKNOWN, SpmEncoder, SpmVocab, encoder
from text.textcheck import TooLong, check_strings, checked_text, token_bound

if TYPE_CHECKING:
    from text.bytebpe import ByteBpe

# End-of-turn tokens by name: ChatML's (Qwen, SmolLM, Phi-4), Llama 3's (and its tool call's end), Granite's and
# OLMo 2's end of text, Gemma's, Phi-3's and Phi-4-mini's, Gemma 4's (and the tool response it waits for after a
# tool call, as llama.cpp and its generation_config.json stop there). Mistral's turns end with `</s>`, the GGUF's EOS.
END_OF_TURN = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
    "<turn|>",
    "<|tool_response>",
)


@dataclass
class TokenizerInfo:
    """What a weight store keeps of the tokenizer: the tokenizers JSON (or, for a SentencePiece vocabulary, the
    vocabulary itself: `spm`, and no JSON) plus the ids that matter."""

    tokenizer_json: str
    bos_id: int | None
    eos_ids: list[int]
    add_bos: bool = False
    chat_template: str | None = None
    special: dict[str, str] = field(default_factory=dict)
    origin: str = ""  # the file it was read from, for a sentence if it does not parse
    spm: SpmVocab | None = None

    @property
    def file(self) -> str:
        """The name of the file a weight store keeps it in, beside its manifest."""
        return SPM_FILE if self.spm is not None else "tokenizer.json"

    def dumps(self) -> bytes:
        """That file's bytes."""
        return self.spm.dumps() if self.spm is not None else self.tokenizer_json.encode()

    def to_dict(self) -> dict:
        return {
            "bos_id": self.bos_id,
            "eos_ids": self.eos_ids,
            "add_bos": self.add_bos,
            "chat_template": self.chat_template,
            "special": self.special,
            "file": self.file,
        }


class TextTokenizer:
    """Encode/decode, streaming decode, stop ids, and the model's chat template."""

    def __init__(self, info: TokenizerInfo):
        self.info = info
        self.tok: Tokenizer | None = None
        self.spm: SpmEncoder | None = None  # a SentencePiece vocabulary's encoder, which decodes from `table`
        self.bpe: ByteBpe | None = None  # a byte-level BPE vocabulary's encoder (in `tok`'s place), `table` decodes
        self.table: ByteTable | None = None
        if info.spm is not None:
            self.spm, kinds = encoder(info.spm), info.spm.types
            special = {i for i, k in enumerate(kinds) if k in (CONTROL, UNKNOWN)}  # what skip_special drops
            self.table = ByteTable.of_spm(info.spm.tokens, special, info.spm.add_space_prefix)
            self.vocab_size = len(info.spm.tokens)
        else:  # a store's tokenizer.json (what a GGUF or HF source builds has been parsed already)
            origin = Path(info.origin) if info.origin else None
            self.tok = parse_tokenizer(
                info.tokenizer_json,
                str(origin or "the tokenizer"),
                f"delete {origin.parent} and convert again" if origin else "convert the model again",
            )
            self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.add_bos = info.bos_id, info.add_bos
        self.stop_ids = set(info.eos_ids)
        # Chat models also stop at their end-of-turn token (what their chat templates close a turn with).
        for name in END_OF_TURN:
            tid = self.token_id(name)
            if tid is not None:
                self.stop_ids.add(tid)
        self._bound: tuple[int, int] | None = None  # (longest token's bytes, the normalizer's shrink): see min_tokens
        trim_heap()  # parsing the JSON left ~90 MiB of freed heap behind

    def compact_encoder(self) -> bool:
        """Where the vocabulary is byte-level BPE that text/bytebpe.py reads (Qwen's, Llama 3's, SmolLM's...), encode
        with it (the same ids from 2.4 MiB of merges for Qwen's 152k tokens) and decode from a table of the tokens'
        bytes: the `tokenizers` object (~46 MiB) and the JSON text (~9 MiB) go. What a process that keeps encoding
        does (`launch serve`, chat, cadence.LLM: under a budget its pages are the target's); a run whose prompts are
        all encoded lets the encoder go instead (`release_encoder`). False where the tokenizer stays as it is."""
        if self.tok is None:
            return self.bpe is not None
        from text.bytebpe import ByteBpe  # numpy and regex: only in a process that keeps encoding

        spec = json.loads(self.info.tokenizer_json)
        bpe = ByteBpe.of(spec)
        table = ByteTable.of(self.tok, spec, self.vocab_size) if bpe is not None else None
        if table is None:
            return False
        self._bound = token_bound(self.tok)
        self.tok, self.bpe, self.table, self.info = None, bpe, table, replace(self.info, tokenizer_json="")
        del spec
        trim_heap()
        return True

    def token_id(self, token: str) -> int | None:
        """The id of a token (the first, where the vocabulary spells two alike), None where it is none."""
        if self.spm is not None:
            return self.spm.token_id(token)
        if self.tok is None:
            raise CadenceError(_RELEASED if self.bpe is None else f"{token!r} cannot be looked up by name here")
        return self.tok.token_to_id(token)

    def release_encoder(self) -> bool:
        """Drop the encoder (a `tokenizers` object, ~46 MiB for a 152k vocabulary; a compacted byte-level BPE's merges,
        2-3 MiB; the SentencePiece encoder, ~35 MiB for Gemma's 262k) and decode from a table of each token's bytes (a
        few MiB) instead. A run whose prompts are all encoded already (`launch run`, `launch bench` under a memory
        budget) gives those pages to the target.
        Byte-level and SentencePiece BPE decode this way (text/bytetable.py); anything else keeps its
        tokenizer (returns False). `encode` then refuses."""
        if self.tok is None and self.spm is None and self.bpe is None:
            return True
        table = (
            self.table if self.table is not None else ByteTable.of(self.tok, self.info.tokenizer_json, self.vocab_size)
        )
        if table is None:
            return False
        self.tok, self.spm, self.bpe, self.table, self.info = (
            None,
            None,
            None,
            table,
            TokenizerInfo(
                "", self.info.bos_id, self.info.eos_ids, self.info.add_bos, self.info.chat_template, self.info.special
            ),
        )
        trim_heap()
        return True

    def encode(self, text: str | bytes, *, name: str = "the prompt", limit: int | None = None) -> list[int]:
        """Token ids of `text` (the BOS first where the model adds one).

        text: a str, or bytes read as UTF-8. Text that is not UTF-8 (undecodable bytes; a str holding a lone
          surrogate, which is what Python makes of an undecodable byte read with errors="surrogateescape" and
          what a JSON "\\ud800" escape decodes to) is refused in one CadenceError sentence that calls it `name`
          ("the prompt", "messages[2].content", a file path).
        limit: the most ids the caller can take (the context's room for a prompt). A text with more raises
          `TooLong`, a CadenceError. Before the tokenizer sees the text, `min_tokens` bounds its count from its
          length in O(1) (and from its UTF-8 bytes, which the check above computes anyway): a 50 MB string is
          refused at once, and never a text that would fit. What passes the bound is counted exactly.
        """
        if self.tok is None and self.spm is None and self.bpe is None:
            raise CadenceError(_RELEASED)
        if limit is not None:  # O(1): a str's length in characters is a lower bound of its bytes
            self.check_length(len(text), limit, name, ascii=isinstance(text, str) and text.isascii())
        text, n_bytes = checked_text(text, name)
        if limit is not None and n_bytes > len(text):
            self.check_length(n_bytes, limit, name)
        if self.spm is not None:
            ids = self.spm.encode(text)
        elif self.bpe is not None:
            ids = self.bpe.encode(text)
        else:
            ids = self.tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            # a chat template that writes `{{ bos_token }}` (Gemma's, Llama 3's) has given the text its BOS already
            ids = [self.bos_id] + ids
        if limit is not None and len(ids) > limit:
            raise TooLong(name, len(ids), limit, exact=True)
        return ids

    def min_tokens(self, n_bytes: int, ascii: bool = False) -> int:
        """The fewest ids a text of `n_bytes` UTF-8 bytes (or more: its length in characters is a lower bound)
        can encode to, in O(1); `ascii`: the text is ASCII. Each token covers at most `longest` bytes of the
        normalized text, and the normalizer shrinks a text at most `shrink` times (NFC composes up to 3.5
        bytes into one, checked over all of Unicode in tests/models/test_tokenizer.py; it keeps ASCII as
        it is). 0 where the pipeline may drop text (a normalizer not known here, fused unknown tokens). The
        BOS counts only as the one id an empty text has: a text that starts with it gets no second one."""
        if self._bound is None:
            if self.spm is not None:  # spaces become `▁`, a text a `▁` longer: a normalizer that never shrinks
                self._bound = (self.spm.bound(), 1)
            else:
                self._bound = token_bound(self.tok) if self.tok is not None else (0, 0)
        longest, shrink = self._bound
        if not longest:
            return 0
        return max(-(-n_bytes // (longest * (1 if ascii else shrink))), int(self.add_bos and self.bos_id is not None))

    def check_length(self, n_bytes: int, limit: int, name: str = "the prompt", ascii: bool = False) -> None:
        """Raise `TooLong` if a text of `n_bytes` bytes (or more) has more than `limit` ids whatever it holds, in
        O(1): what `encode(limit=...)` does before the tokenizer sees the text."""
        at_least = self.min_tokens(n_bytes, ascii)
        if at_least > limit:
            raise TooLong(name, at_least, limit, exact=False)

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        if self.tok is None:
            return self.table.decode(ids, skip_special)
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, *, name: str | None = None, tools=None
    ) -> str:
        """The conversation as the model's chat template writes it. Every string in `messages` is checked to be
        UTF-8 first (see `encode`) and named by its place, `{name}[2].content` (name None: "messages", and
        a lone message's content "the prompt")."""
        lone = name is None and len(messages) == 1
        check_strings(
            [
                (v, "the prompt" if lone and k == "content" else f"{name or 'messages'}[{i}].{k}")
                for i, m in enumerate(messages)
                for k, v in (m.items() if isinstance(m, dict) else ())
            ]
        )
        if not self.info.chat_template:
            raise CadenceError("this model has no chat template; run without --chat")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise CadenceError(f"chat template: {msg}")

        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = _tojson
        tmpl = env.from_string(self.info.chat_template)
        return tmpl.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.info.special.get("bos", ""),
            eos_token=self.info.special.get("eos", ""),
        )


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """Templates' `tojson` as transformers defines it (plain JSON; jinja's own escapes <, > and & for HTML)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class StreamDecoder:
    """Turns a growing list of token ids into text pieces, holding back incomplete UTF-8.

    Each push decodes only the tokens since the last piece, after a few tokens of context (a decoder may
    treat a text's first token differently, a leading space say): a long generation costs linear time."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] were decoded into the last piece: the context of the next
        self.sent = 0  # characters given out in pieces

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if len(text) <= len(before) or text.endswith("\ufffd"):  # nothing new, or a character not finished yet
            return ""
        self.prefix, self.read, self.sent = self.read, len(self.ids), self.sent + len(text) - len(before)
        return text[len(before) :]

    def text(self) -> str:
        """Everything pushed, decoded whole."""
        return self.tokenizer.decode(self.ids)

    def finish(self) -> str:
        """At the end: what the pieces held back (an unfinished character as U+FFFD), so they add up to `text`."""
        return self.text()[self.sent :]


_RELEASED = (
    "this run encoded its prompts up front and let its tokenizer go (to save memory); "
    "a new prompt needs a run that keeps it (launch chat, launch serve, the Python API)"
)


def parse_tokenizer(tokenizer_json: str, origin: str, advice: str) -> Tokenizer:
    """A `tokenizers` Tokenizer from its JSON; one sentence naming `origin` where the JSON is not one."""
    try:
        return Tokenizer.from_str(tokenizer_json)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
        raise CadenceError(f"{origin} is not a tokenizer the tokenizers library reads ({e}); {advice}") from None


def info_from_hf(
    tokenizer_json: str, tokenizer_config: dict, config: dict, origin: str = "tokenizer.json"
) -> TokenizerInfo:
    tok = parse_tokenizer(tokenizer_json, origin, "re-download it")

    def tid(x):
        if isinstance(x, dict):
            x = x.get("content")
        return tok.token_to_id(x) if isinstance(x, str) else None

    bos = tid(tokenizer_config.get("bos_token")) if tokenizer_config.get("bos_token") else config.get("bos_token_id")
    eos = config.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if tokenizer_config.get("eos_token"):
        e = tid(tokenizer_config["eos_token"])
        if e is not None and e not in eos_ids:
            eos_ids.append(e)
    special = {
        k: (v["content"] if isinstance(v, dict) else v)
        for k in ("bos_token", "eos_token")
        if isinstance(v := tokenizer_config.get(k), (str, dict))
    }
    return TokenizerInfo(
        tokenizer_json=tokenizer_json,
        bos_id=bos,
        eos_ids=eos_ids,
        add_bos=bool(tokenizer_config.get("add_bos_token", False)),
        chat_template=tokenizer_config.get("chat_template"),
        special={"bos": special.get("bos_token", ""), "eos": special.get("eos_token", "")},
        origin=origin,
    )


def read_info(path: Path, meta: dict, advice: str) -> TokenizerInfo:
    """A weight store's tokenizer: `path` its file (`TokenizerInfo.file`: tokenizer.json, or tokenizer.spm for a
    SentencePiece vocabulary), `meta` its manifest's entry; a sentence ending in `advice` where it is damaged."""
    spm, text = None, ""
    if path.name == SPM_FILE:
        spm = SpmVocab.loads(read_bytes(path, advice), str(path), advice)
    else:
        text = read_text(path, advice)
    return TokenizerInfo(
        tokenizer_json=text,
        **{k: meta.get(k) for k in ("bos_id", "eos_ids", "add_bos", "chat_template")},
        special=meta.get("special") or {},
        origin=str(path),
        spm=spm,
    )
