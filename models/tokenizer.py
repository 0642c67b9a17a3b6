"""Tokenizer: byte-level BPE rebuilt from GGUF metadata (or an HF tokenizer.json), chat template.

A GGUF file carries no tokenizer.json: it stores the vocabulary, the merges, the token types
and the name of the pre-tokenizer (`tokenizer.ggml.pre`). We rebuild the same `tokenizers`
pipeline HF ships for these models: the model's split regex, byte-level mapping, BPE, and the
control tokens added whole so that `<|im_start|>` stays one token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from cadence.errors import CadenceError
from cadence.heap import trim_heap

# Split regexes by llama.cpp pre-tokenizer name (the same ones HF's tokenizer.json files use).
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "llama3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3}
# Pre-tokenizers that are GPT-2's byte-level regex, with digits split one by one first.
_GPT2_DIGITS = {"smollm", "starcoder", "refact"}
_GPT2 = {"gpt2", "default", "olmo"}

CONTROL, USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str):
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre in _GPT2_DIGITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raise CadenceError(f"the GGUF's tokenizer pre-tokenizer '{pre}' is not supported; convert from an HF directory with tokenizer.json instead")


def tokenizer_from_gguf_fields(tokens: list[str], token_types: list[int], merges: list[str], pre: str) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False, ignore_merges=pre in _SPLITS and pre.startswith("llama")))
    if pre in ("qwen2", "deepseek-r1-qwen"):
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    types = list(token_types) if token_types else [1] * len(tokens)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    return tok


@dataclass
class TokenizerInfo:
    """What a weight store keeps of the tokenizer: the tokenizers JSON plus the ids that matter."""
    tokenizer_json: str
    bos_id: int | None
    eos_ids: list[int]
    add_bos: bool = False
    chat_template: str | None = None
    special: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"bos_id": self.bos_id, "eos_ids": self.eos_ids, "add_bos": self.add_bos,
                "chat_template": self.chat_template, "special": self.special}


class TextTokenizer:
    """Encode/decode, streaming decode, stop ids, and the model's chat template."""

    def __init__(self, info: TokenizerInfo):
        self.info = info
        self.tok = Tokenizer.from_str(info.tokenizer_json)
        self.bos_id, self.add_bos = info.bos_id, info.add_bos
        self.stop_ids = set(info.eos_ids)
        # Chat models also stop at their end-of-turn token.
        for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>"):
            tid = self.tok.token_to_id(name)
            if tid is not None:
                self.stop_ids.add(tid)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        trim_heap()  # parsing the JSON left ~90 MiB of freed heap behind

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.info.chat_template:
            raise CadenceError("this model has no chat template; run without --chat")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise CadenceError(f"chat template: {msg}")

        env.globals["raise_exception"] = raise_exception
        tmpl = env.from_string(self.info.chat_template)
        return tmpl.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           bos_token=self.info.special.get("bos", ""), eos_token=self.info.special.get("eos", ""))


class StreamDecoder:
    """Turns a growing list of token ids into text pieces, holding back incomplete UTF-8."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # a multi-byte character not finished yet
            return ""
        piece, self.emitted = text[len(self.emitted):], text
        return piece


def info_from_hf(tokenizer_json: str, tokenizer_config: dict, config: dict) -> TokenizerInfo:
    tok = Tokenizer.from_str(tokenizer_json)

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
    special = {k: (v["content"] if isinstance(v, dict) else v) for k in ("bos_token", "eos_token")
               if isinstance(v := tokenizer_config.get(k), (str, dict))}
    return TokenizerInfo(tokenizer_json=tokenizer_json, bos_id=bos, eos_ids=eos_ids,
                         add_bos=bool(tokenizer_config.get("add_bos_token", False)),
                         chat_template=tokenizer_config.get("chat_template"),
                         special={"bos": special.get("bos_token", ""), "eos": special.get("eos_token", "")})


def loads_info(tokenizer_json: str, meta: dict) -> TokenizerInfo:
    return TokenizerInfo(tokenizer_json=tokenizer_json, **{k: meta.get(k) for k in ("bos_id", "eos_ids", "add_bos", "chat_template")},
                         special=meta.get("special") or {})

