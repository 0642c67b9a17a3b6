"""A prompt cache that outlives its slot (issue 57, item 3): the target's committed KV rows of a cache about to be
overwritten (its slot taken by another conversation, its range of the KV pool given to another generation, its
text left for another), kept by the text they hold, so that a later prompt continuing any of them (a conversation's
next turn after others took its slot, a system prompt shared by several) starts from them and prefills only its own
new tokens. llama-server's `--cache-ram` and vLLM's prefix caching keep prefixes past their requests the same way.

The entries live in memory up to `ram_bytes` (the plan counts them) and, with a directory, on disk as well: each
written once when kept (its parts in 4 KiB-aligned pieces, the page cache dropped behind them), read back with the
loader's direct reads (shm/dio.py) straight into the new cache's rows, and found again by a later run of the same
model (a file holds the text and the marks of its cache in a header). Both tiers are least recently used first
out, by bytes. A restored cache is the cache that was kept, to the bit (models/kvcache.py `committed`, `adopt`),
rewound to the prefix the prompt shares with it where its layers allow (a recurrent state cannot step back past
what it folded: such a model reuses an entry only as far as its state reaches).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from common.errors import CadenceError
from common.settings import PromptCacheConfig
from models import kernel_build
from shm.dio import ALIGN, DirectReader

MIN_TOKENS = 32  # a shorter text is not worth a copy: its prefill is as quick
_MAGIC = b"cadence-prefix-1"


@dataclass
class _Entry:
    text: tuple[int, ...]
    marks: dict
    nbytes: int
    parts: dict | None = None  # name -> a contiguous CPU tensor (in memory)
    path: Path | None = None  # on disk
    layout: list | None = None  # on disk: [name, dtype, shape, offset] of each part


class PrefixCache:
    def __init__(self, ram_bytes: int, directory: str | Path | None = None, model_key: str = "", disk_bytes: int = 0):
        """`ram_bytes`: what the entries in memory may hold; `directory`: where entries are kept on disk as well
        (a folder per model, `model_key`), up to `disk_bytes` (0: as much as memory holds, at least 1 GiB)."""
        self.ram_bytes = max(0, int(ram_bytes))
        self.dir = Path(directory) / _safe(model_key) if directory else None
        self.disk_bytes = PromptCacheConfig(self.ram_bytes, None, int(disk_bytes)).disk_bound
        self.ram: OrderedDict[tuple, _Entry] = OrderedDict()
        self.disk: OrderedDict[tuple, _Entry] = OrderedDict()
        self.reused = self.kept = 0  # prompt tokens restored from an entry; entries kept
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._index()

    @property
    def enabled(self) -> bool:
        return self.ram_bytes > 0 or self.dir is not None

    def keep(self, tokens: list[int], cache) -> None:
        """The committed rows of `cache` (the text `tokens` holds) kept before the cache is overwritten."""
        if not self.enabled or cache is None or cache.length < MIN_TOKENS or cache.whole:
            return  # (`whole`: a forward that never committed left its states past its text)
        text = tuple(tokens[: cache.length])
        if len(text) < cache.length:
            return
        free = not cache.args.rec_layers  # a cache of attention layers only rewinds to any prefix
        covering = [(tier, t) for tier in (self.ram, self.disk) for t in tier if t[: len(text)] == text]
        if any(free or t == text for _, t in covering):  # an entry holds these rows already
            for tier, t in covering:
                tier.move_to_end(t)
            return
        marks, views = cache.committed()
        nbytes = sum(v.numel() * v.element_size() for v in views.values())
        fits = [self.ram_bytes >= nbytes, self.dir is not None and self.disk_bytes >= nbytes]
        if fits[0]:
            parts = {n: v.detach().to("cpu", copy=True).contiguous() for n, v in views.items()}
            self._add(self.ram, _Entry(text, marks, nbytes, parts=parts), self.ram_bytes, free)
        if fits[1]:
            self._add(self.disk, self._write(text, marks, views, nbytes), self.disk_bytes, free)
        self.kept += any(fits)

    def take(self, prompt_ids: list[int], cache, have: int = 0) -> int:
        """The longest prefix of the prompt an entry holds past the first `have` tokens restored into `cache` (a new
        cache, or the last one kept to `have`): the prompt tokens now in it (`have` where no entry does better; the
        prompt's last token is always left to run, its logits are needed)."""
        best, best_n = None, have
        for tier in (self.ram, self.disk):
            for text, e in tier.items():
                n = min(_common(text, prompt_ids), len(prompt_ids) - 1)
                if n > best_n and n >= MIN_TOKENS and cache.fits(e.marks, n):
                    best, best_n = (tier, text, e), n
        if best is None:
            return have
        tier, text, e = best
        tier.move_to_end(text)
        views = cache.adopt(e.marks)
        if e.parts is not None:
            for name, v in views.items():
                v.copy_(e.parts[name])
        else:
            _read(e, views)
        if best_n < cache.length:
            cache.rewind(best_n)
        self.reused += best_n
        return best_n

    def _add(self, tier: OrderedDict, e: _Entry, bound: int, supersede: bool) -> None:
        """`e` in `tier`, the least recently used entries out past `bound` bytes; `supersede`: entries whose text `e`
        continues go (a cache rewinds to any of its prefixes)."""
        for t in [t for t in tier if supersede and len(t) <= len(e.text) and e.text[: len(t)] == t]:
            self._drop(tier, t)
        tier[e.text] = e
        tier.move_to_end(e.text)
        while sum(x.nbytes for x in tier.values()) > bound and len(tier) > 1:
            self._drop(tier, next(iter(tier)))

    def _drop(self, tier: OrderedDict, text: tuple) -> None:
        e = tier.pop(text)
        if e.path is not None and tier is self.disk:
            e.path.unlink(missing_ok=True)

    def _write(self, text: tuple, marks: dict, views: dict, nbytes: int) -> _Entry:
        """The entry's file: a header (its length, then JSON: the text, the marks, each part's layout), then each part's
        contiguous pieces from 4 KiB-aligned offsets; written whole to a temporary name, synced, its pages dropped."""
        layout, at = [], 0
        for name, v in views.items():
            layout.append([name, str(v.dtype).removeprefix("torch."), list(v.shape), at])
            at += _up(v.numel() * v.element_size())
        head = json.dumps({"text": list(text), "marks": marks, "layout": layout}).encode()
        start = _up(len(_MAGIC) + 8 + len(head))
        path = self.dir / f"{hashlib.sha1(str(text).encode()).hexdigest()[:24]}.kv"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(_MAGIC + struct.pack("<Q", len(head)) + head)
            for (_, _, _, offset), v in zip(layout, views.values()):
                f.seek(start + offset)
                for piece in _pieces(v.detach().cpu()):
                    f.write(memoryview(piece.numpy()).cast("B"))
            f.truncate(start + at)
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(tmp, path)
        for e in layout:
            e[3] += start
        return _Entry(text, marks, nbytes, path=path, layout=layout)

    def _index(self) -> None:
        """The entries an earlier run left in the directory (oldest first); a file that does not read is removed."""
        for path in sorted(self.dir.glob("*.kv"), key=lambda p: p.stat().st_mtime):
            try:
                with open(path, "rb") as f:
                    if f.read(len(_MAGIC)) != _MAGIC:
                        raise ValueError("not an entry")
                    (n,) = struct.unpack("<Q", f.read(8))
                    h = json.loads(f.read(n))
                start = _up(len(_MAGIC) + 8 + n)
                layout = [[name, dt, shape, start + off] for name, dt, shape, off in h["layout"]]
                nbytes = sum(_numel(s) * getattr(torch, dt).itemsize for _, dt, s, _ in layout)
                self.disk[tuple(h["text"])] = _Entry(tuple(h["text"]), h["marks"], nbytes, path=path, layout=layout)
            except (OSError, ValueError, KeyError, AttributeError):
                path.unlink(missing_ok=True)
        for p in self.dir.glob("*.tmp"):  # a run that stopped while writing
            p.unlink(missing_ok=True)


def _read(e: _Entry, views: dict) -> None:
    """An entry's parts read from its file into the cache's views: each contiguous piece straight into its rows with
    direct reads (through a buffer of its own off the CPU)."""
    reader = DirectReader(e.path, threads=2)
    try:
        for name, _, _, offset in e.layout:
            for piece in _pieces(views[name]):
                nbytes = piece.numel() * piece.element_size()
                if piece.device.type == "cpu":
                    reader.read_into(offset, nbytes, piece.data_ptr())
                else:
                    host = torch.empty_like(piece, device="cpu")
                    reader.read_into(offset, nbytes, host.data_ptr())
                    piece.copy_(host)
                offset += nbytes
    finally:
        reader.close()


def _pieces(t: torch.Tensor):
    """The contiguous blocks a view is made of, in order (a cache's rows of each head)."""
    if t.is_contiguous():
        yield t
        return
    for i in range(t.shape[0]):
        yield from _pieces(t[i])


def _common(a, b) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _safe(key: str) -> str:
    return hashlib.sha1(key.encode()).hexdigest()[:16] if key else "model"


def cache_key(store: str, kv_dtype: str = "f32") -> str:
    """Whose rows an entry on disk holds: the weight store's (its folder, its manifest's time), at --kv-dtype, as
    this kernel path and this cadence's math compute them (models/kernel_build.py `numerics_digest`)."""
    manifest = Path(store) / "manifest.json"
    key = f"{Path(store).resolve().name}:{manifest.stat().st_mtime_ns if manifest.exists() else 0}"
    key += "" if kv_dtype == "f32" else f":{kv_dtype}"
    try:
        path = kernel_build.chosen_path()
    except CadenceError:  # a $CADENCE_KERNEL_PATH this CPU refuses: the kernels say so where they load (not on CUDA)
        path = os.environ.get(kernel_build.ENV_PATH, "")
    return f"{key}:{path}:{kernel_build.numerics_digest()[:16]}"


def prompt_cache(config: dict | None, store: str, kv_dtype: str = "f32") -> PrefixCache | None:
    """The prompt cache a run's options ask for (`PromptCacheConfig` as a dict: `ram_bytes`, `dir`, `disk_bytes`) for
    the target in weight store `store` (its entries on disk are the store's own: keyed by its folder and its
    manifest, by the caches' --kv-dtype, since rows are read back as the bytes they were, and by the kernel path
    and the math that computed them, `cache_key`), or None where they ask for none."""
    if not config or not (config.get("ram_bytes") or config.get("dir")):
        return None
    key = cache_key(store, kv_dtype)
    return PrefixCache(int(config.get("ram_bytes") or 0), config.get("dir"), key, int(config.get("disk_bytes") or 0))
