"""A model's vocabulary, fingerprinted without converting anything: which models can draft for which.

A draft proposes token ids that the target verifies, so the two must give every id the same token: the same
vocabulary. The fingerprint is a sha256 over the token of each id, in id order, added and special tokens
included, read cheaply from where the model is: a GGUF file's `tokenizer.ggml.tokens` (its header, a fraction
of a second), an HF directory's tokenizer.json, or a weight store's (or its tokenizer.spm, text/spm.py). The
padding llama.cpp appends to a GGUF's list up to the embedding's rows (`[PAD151665]` ...) is left out, so a
GGUF and the HF directory it was converted from have the same fingerprint; the embedding's rows (`rows`) are
compared on their own, since a draft's distributions must be as wide as the target's. Cached by path, size
and mtime, as
formats/convert.py caches a file's sha256; read in a child process by a process without torch (the scheduler of
a run, whose memory counts against its budget: a GGUF's vocabulary and merges are tens of MB of strings while
they are read).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from common import paths
from common.errors import CadenceError
from common.files import read_json

CACHE_VERSION = 3  # 3: whether the model chats


@dataclass(frozen=True)
class Vocab:
    """What decides whether one model can draft for another: its vocabulary's fingerprint and size (tokens, the
    tokenizer's; rows, the embedding's: the ids its logits cover) and its parameters (a draft is the smaller)."""

    fingerprint: str
    tokens: int
    rows: int
    params: int
    chat: bool = False  # its files carry a chat template: an instruct model (else a base model, to complete text)

    def same_ids(self, other: Vocab) -> bool:
        """The two give every token id the same token, over the same rows of logits."""
        return self.fingerprint == other.fingerprint and self.rows == other.rows

    def drafts_for(self, target: Vocab) -> bool:
        """A model with this vocabulary can draft for `target`: the same ids, and fewer parameters."""
        return self.same_ids(target) and self.params < target.params


def from_tokens(tokens: list, rows: int, params: int, chat: bool = False) -> Vocab:
    """The Vocab of an id -> token list: llama.cpp's trailing `[PAD<id>]` rows and unassigned ids left out of
    its fingerprint and count."""
    n = len(tokens)
    while n and (tokens[n - 1] is None or tokens[n - 1] == f"[PAD{n - 1}]"):
        n -= 1
    digest = hashlib.sha256(json.dumps(tokens[:n], ensure_ascii=False).encode()).hexdigest()
    return Vocab(digest, n, int(rows), int(params), bool(chat))


def tokens_of_json(tokenizer_json: dict, origin: Path) -> list:
    """The id -> token list of a tokenizers JSON: its model's vocabulary (a dict, or Unigram's [piece, score]
    list) with its added tokens at their ids; an id nothing names is None."""
    model = tokenizer_json.get("model") or {}
    vocab = model.get("vocab")
    if isinstance(vocab, list):
        by_id = {i: (e[0] if isinstance(e, list) else e) for i, e in enumerate(vocab)}
    elif isinstance(vocab, dict):
        by_id = {i: t for t, i in vocab.items() if isinstance(i, int)}
    else:
        raise CadenceError(f"{origin} has no vocabulary (model.vocab) a tokenizer.json has; re-download it")
    for added in tokenizer_json.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("id"), int):
            by_id[added["id"]] = added.get("content")
    out = [None] * (max(by_id, default=-1) + 1)
    for i, t in by_id.items():
        if i >= 0:
            out[i] = t
    return out


def _of_gguf(path: Path) -> Vocab:
    from formats.gguf_file import GGUFFile

    g = GGUFFile(path)
    tokens = g.fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise CadenceError(f"{path} has no tokenizer.ggml.tokens, so no vocabulary; use a GGUF file with its tokenizer")
    emb = g.tensors.get("token_embd.weight")
    rows = emb.shape[0] if emb is not None else len(tokens)
    params = sum(math.prod(t.shape) for t in g.tensors.values())
    return from_tokens(tokens, rows, params, bool(g.fields.get("tokenizer.chat_template")))


def _safetensors_params(path: Path) -> int:
    """Elements of every tensor in a safetensors file, from its header alone."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    except (OSError, struct.error, ValueError, KeyError, TypeError) as e:
        raise CadenceError(f"{path} is a damaged safetensors file ({e}); re-download it") from None


def _of_hf(path: Path) -> Vocab:
    advice = "re-download it"
    tokens = tokens_of_json(read_json(path / "tokenizer.json", advice), path / "tokenizer.json")
    cfg = read_json(path / "config.json", advice) if (path / "config.json").is_file() else {}
    rows = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size") or len(tokens)
    params = sum(_safetensors_params(f) for f in sorted(path.glob("*.safetensors")))
    tc = read_json(path / "tokenizer_config.json", advice) if (path / "tokenizer_config.json").is_file() else {}
    chat = bool(tc.get("chat_template")) or (path / "chat_template.jinja").is_file()
    return from_tokens(tokens, rows, params, chat)


def _of_store(path: Path) -> Vocab:
    from formats.store import WeightStore

    st = WeightStore(path)
    if st.tokenizer_file.name == "tokenizer.json":
        tokens = tokens_of_json(read_json(st.tokenizer_file, f"delete {path} and convert again"), path)
    else:  # a SentencePiece vocabulary (text/spm.py): its tokens as they are
        tokens = [t.decode() for t in st.tokenizer_info.spm.tokens]
    a = st.args
    per_layer = a.layer_params() + (a.n_experts * a.expert_params() if a.moe else 0)
    params = a.n_layers * per_layer + a.vocab_size * a.dim * (1 if a.tied_embeddings else 2)
    from text.tokenizer_gguf import FAMILY_TEMPLATES  # a template cadence supplied is not the model's own

    template = st.tokenizer_info.chat_template
    return from_tokens(tokens, a.vocab_size, params, bool(template) and template not in FAMILY_TEMPLATES)


def _key_files(path: Path) -> tuple[str, list[Path]]:
    """What `path` is (gguf, hf, store) and the files whose size and mtime say it is unchanged."""
    if path.is_file():
        return "gguf", [path]
    if (path / "manifest.json").is_file():
        return "store", [path / "manifest.json", path / "tokenizer.json", path / "tokenizer.spm"]
    if (path / "tokenizer.json").is_file():
        return "hf", [path / "tokenizer.json", path / "config.json", *sorted(path.glob("*.safetensors"))]
    raise CadenceError(f"{path} is neither a GGUF file, an HF model directory (with tokenizer.json) nor a weight store")


def _cache_path() -> Path:
    return paths.stores_dir() / "vocab-fingerprints.json"


def vocab_of(path: Path) -> Vocab:
    """The vocabulary of the model at `path` (a GGUF file, an HF directory or a weight store), cached."""
    path = Path(path).expanduser()
    kind, files = _key_files(path)
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.exists()]
    key = json.dumps([CACHE_VERSION, kind, stats])
    cache = _cache_path()
    try:
        idx = json.loads(cache.read_text())
    except (OSError, ValueError):
        idx = {}
    if key in idx:
        try:
            return Vocab(**idx[key])
        except TypeError:
            pass
    v = read(kind, path) if "torch" in sys.modules else _read_in_child(path)
    idx[key] = asdict(v)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(idx))
        os.replace(tmp, cache)
    except OSError:
        pass  # a cache: a home we cannot write still answers, reading the file again next time
    return v


def read(kind: str, path: Path) -> Vocab:
    """The vocabulary of a `kind` ("gguf", "hf", "store") model at `path`, read now (not cached)."""
    return {"gguf": _of_gguf, "hf": _of_hf, "store": _of_store}[kind](path)


def _read_in_child(path: Path) -> Vocab:
    from shm.watchdog import python_env

    p = subprocess.run(
        [sys.executable, "-m", "formats.vocab", str(path)], env=python_env(), capture_output=True, text=True
    )
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        raise CadenceError(
            lines[-1] if lines else f"reading the vocabulary of {path} failed (exit code {p.returncode})"
        )
    return Vocab(**json.loads(p.stdout))


def main(argv: list[str]) -> int:
    """`python -m formats.vocab PATH`: what `vocab_of` runs in a child; the Vocab as JSON on stdout."""
    path = Path(argv[0])
    try:
        print(json.dumps(asdict(read(_key_files(path)[0], path))))
    except CadenceError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
