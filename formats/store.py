"""The weight store: `manifest.json` + `weights.bin` + the tokenizer in one directory (`tokenizer.json`, or
`tokenizer.spm` for a GGUF's SentencePiece vocabulary: text/spm.py; the manifest names which).

`weights.bin` holds every array at a 4 KiB-aligned offset, grouped in the order a
layer-by-layer reader needs them: `embed`, `layer.0` ... `layer.N-1`, `head.0` ... `head.P-1`
(the output head in parts of about a layer's bytes, rows [lo, hi) each; `head.0` also holds the
final norm). Each group is
one contiguous byte range, so the loader reads a layer with one large (direct) read and the
engine maps arrays out of that buffer with no copy.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from common.errors import CadenceError
from models.args import ModelArgs
from common.files import read_json, what_is

# torch, numpy and the tokenizer are imported where they are used: the I/O loader reads a store's
# manifest and nothing else, and stays a small process.
ALIGN = 4096
FORMAT_VERSION = 5  # 2: int4 as 8-bit sub-scales under fp16 super-scales; 3: the head in parts (head.0 ...);
# 4: int8, int4 and int2 in tiles of 16 rows (models/tiles.py); 5: a SentencePiece vocabulary in
# tokenizer.spm, not a tokenizer.json, the manifest's tokenizer entry naming the file
_DTYPE_NAMES = ("float32", "bfloat16", "float16", "int8", "uint8", "int32")


def __getattr__(name):  # DTYPES: built on first use, so that importing this module needs no torch
    if name == "DTYPES":
        import torch

        return {n: getattr(torch, n) for n in _DTYPE_NAMES}
    raise AttributeError(name)


HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64; arm64 with 4 KiB pages)


def weights_buffer(nbytes: int):
    """An empty uint8 tensor of `nbytes` for weights that every forward reads. Where the kernel gives transparent huge
    pages on request (Linux with THP "madvise" or "always"), it is a mapping of its own whose whole 2 MiB pages are
    asked for before anything touches them: a decode step sweeps every weight, and with 4 KiB pages it walks the page
    tables every 4 KiB (a resident decode step 3-10% faster, BENCHMARKS.md). Only pages wholly inside the buffer are
    asked for, and the mapping's other pages are never touched: it holds no more memory than `torch.empty` would.
    `CADENCE_HUGE_PAGES=0` in the environment: plain pages."""
    import torch

    if nbytes < 2 * HUGE_PAGE or not huge_pages():
        return torch.empty(nbytes, dtype=torch.uint8)
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (private: shared is tmpfs)
    raw = torch.frombuffer(m, dtype=torch.uint8)  # (it keeps the mapping alive)
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # (a kernel or a sandbox that refuses it: plain pages, as before)
        pass
    return raw[start : start + nbytes]


@functools.cache
def huge_pages() -> bool:
    """Whether this kernel gives transparent huge pages to a mapping that asks (and the environment allows it)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or os.environ.get("CADENCE_HUGE_PAGES", "1") == "0":
        return False
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def expert_group(layer: int, expert: int) -> str:
    """The store group of one expert of a mixture of experts."""
    return f"expert.{layer}.{expert}"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


class StoreWriter:
    """Appends arrays group by group; `finish` writes the manifest last, so a store without one is incomplete."""

    def __init__(self, directory: Path):
        import numpy  # noqa: F401  (the writer converts arrays; the reader of a manifest needs neither)

        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=False)
        self.f = open(self.dir / "weights.bin", "wb")
        self.pos = 0
        self.tensors: dict[str, dict] = {}
        self.groups: list[dict] = []

    def add(self, group: str, name: str, fmt: str, arrays: dict, meta: dict | None = None):
        import numpy as np
        import torch

        if not self.groups or self.groups[-1]["name"] != group:
            if any(g["name"] == group for g in self.groups):
                raise ValueError(f"group {group} written twice")
            self.groups.append({"name": group, "offset": _align(self.pos), "nbytes": 0, "tensors": []})
        entry = {"format": fmt, "arrays": {}, **(meta or {})}
        for key, t in arrays.items():
            t = t.detach().contiguous().cpu()
            off = _align(self.pos)
            self.f.write(b"\0" * (off - self.pos))
            raw = t.view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
            self.f.write(memoryview(raw).cast("B"))
            self.pos = off + raw.nbytes
            entry["arrays"][key] = {
                "offset": off,
                "nbytes": raw.nbytes,
                "dtype": _dtype_name(t),
                "shape": list(t.shape),
            }
        self.tensors[name] = entry
        g = self.groups[-1]
        g["tensors"].append(name)
        g["nbytes"] = _align(self.pos) - g["offset"]

    def finish(self, manifest: dict, tokenizer):
        self.f.write(b"\0" * (_align(self.pos) - self.pos))
        self.f.close()
        (self.dir / tokenizer.file).write_bytes(tokenizer.dumps())
        manifest = {
            "format_version": FORMAT_VERSION,
            **manifest,
            "align": ALIGN,
            "file": "weights.bin",
            "file_bytes": _align(self.pos),
            "groups": self.groups,
            "tensors": self.tensors,
            "tokenizer": tokenizer.to_dict(),
        }
        tmp = self.dir / "manifest.json.tmp"
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, self.dir / "manifest.json")

    def abort(self):
        try:
            self.f.close()
        except OSError:  # its buffer could not be flushed (a full disk): the folder is removed anyway
            pass


@dataclass(frozen=True)
class Group:
    name: str
    offset: int
    nbytes: int
    tensors: tuple[str, ...]


class WeightStore:
    def __eq__(self, other) -> bool:
        """The same store: the same directory and manifest (read twice, it is the same store)."""
        return isinstance(other, WeightStore) and self.dir == other.dir and self.manifest == other.manifest

    def __hash__(self) -> int:
        return hash(self.dir)

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        mpath = self.dir / "manifest.json"
        if not mpath.exists():
            raise CadenceError(
                f"{self.dir} is not a complete weight store (no manifest.json); delete it and convert again"
            )
        again = f"delete {self.dir} and convert again"
        self.manifest = read_json(mpath, again)
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise CadenceError(f"{self.dir} was written by another cadence version; delete it and convert again")
        try:
            self.args = ModelArgs.from_dict(self.manifest["model"])
            self.format: str = self.manifest["format"]
            self.path = self.dir / self.manifest["file"]
            self.groups = {
                g["name"]: Group(g["name"], g["offset"], g["nbytes"], tuple(g["tensors"]))
                for g in self.manifest["groups"]
            }
            self.tensors: dict[str, dict] = self.manifest["tensors"]
            self._tokenizer_meta = dict(self.manifest["tokenizer"])
            expected = int(self.manifest["file_bytes"])
        except KeyError as e:
            raise CadenceError(f"{mpath} is damaged (it has no {e} entry); {again}") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise CadenceError(f"{mpath} is damaged ({e}); {again}") from None
        if not self.path.is_file():
            raise CadenceError(f"{self.path} {what_is(self.path)}; {again}")
        if self.path.stat().st_size != expected:
            raise CadenceError(
                f"{self.path} has {self.path.stat().st_size} bytes, the manifest says {expected}; {again}"
            )

    @property
    def tokenizer_file(self) -> Path:
        """The tokenizer's file: tokenizer.json, or tokenizer.spm (text/spm.py)."""
        name = self._tokenizer_meta.get("file")
        if name not in ("tokenizer.json", "tokenizer.spm"):
            raise CadenceError(
                f"{self.dir / 'manifest.json'} is damaged (its tokenizer entry names no tokenizer file); "
                f"delete {self.dir} and convert again"
            )
        return self.dir / name

    @property
    def tokenizer_info(self):
        from text.tokenizer import read_info

        return read_info(self.tokenizer_file, self._tokenizer_meta, f"delete {self.dir} and convert again")

    def group_names(self) -> list[str]:
        return list(self.groups)

    def head_groups(self) -> list[str]:
        """The output head's parts, in token order."""
        return [g for g in self.groups if g.startswith("head.")]

    def head_rows(self, group: str) -> tuple[int, int]:
        """Token rows [lo, hi) of a head part."""
        lo, hi = self.tensors[group]["rows"]
        return lo, hi

    def head_arrays(self, group: str, rows: int | None = None) -> list[tuple[str, str, dict, int]]:
        """(tensor, key, array entry, bytes to read) of a head part, keeping only the arrays' rows
        below token `rows` (FR-Spec's frequent-token head: byte-level BPE numbers its tokens in merge
        order, so the lowest ids are the most frequent ones); every array has one row per token, or
        per tile of tokens (the tiles holding them all are kept)."""
        lo, hi = self.head_rows(group)
        keep = hi - lo if rows is None else max(0, min(hi, rows) - lo)
        out = []
        for name in self.groups[group].tensors:
            per = self.tensors[name].get("tile", 1)  # token rows per entry (quantized formats: whole tiles)
            units = -(-(hi - lo) // per)
            for key, a in self.tensors[name]["arrays"].items():
                per_token = name == group and a["shape"] and a["shape"][0] == units
                out.append((name, key, a, a["nbytes"] // units * -(-keep // per) if per_token else a["nbytes"]))
        return out

    def head_bytes(self, rows: int | None = None) -> int:
        """Bytes of the output head, or of its first `rows` token rows."""
        return sum(n for g in self.head_groups() for *_, n in self.head_arrays(g, rows))

    def views(self, group: str, buf) -> dict:
        """Arrays of a group as zero-copy views into `buf` (a uint8 tensor holding that group's bytes)."""
        g = self.groups[group]
        return self.tensor_views(g.tensors, buf, g.offset)

    def tensor_views(self, names, buf, start: int) -> dict:
        """Arrays of the tensors `names` as zero-copy views into `buf`, which holds the file from byte `start`."""
        from formats.store import DTYPES

        out = {}
        for name in names:
            arrays = {}
            for key, a in self.tensors[name]["arrays"].items():
                lo = a["offset"] - start
                arrays[key] = buf[lo : lo + a["nbytes"]].view(DTYPES[a["dtype"]]).view(a["shape"])
            out[name] = arrays
        return out

    def read_all(self, start: int = 0, huge: bool = True):
        """The weights file from byte `start` (a group's offset) to its end, in one uint8 tensor (`huge`: on huge
        pages where the kernel gives them; False: a buffer read once, on its way to a GPU)."""
        import torch

        n = self.manifest["file_bytes"] - start
        buf = weights_buffer(n) if huge else torch.empty(n, dtype=torch.uint8)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(start)
            mv = memoryview(buf.numpy())
            got = 0
            while got < len(mv):
                n = f.readinto(mv[got:])
                if not n:
                    raise CadenceError(f"{self.path} ended early; delete {self.dir} and convert again")
                got += n
        return buf

    def group_bytes(self) -> dict[str, int]:
        return {name: g.nbytes for name, g in self.groups.items()}


class EmbeddingRows:
    """The embedding table left on disk: `rows[tokens]` reads just those rows from the store file.

    A 152k-token vocabulary is a large share of a small model's bytes, and a decode step needs a
    handful of its rows; under a memory budget they are read when needed (buffered: a few KiB).
    """

    def __init__(self, store: WeightStore, name: str = "embed"):
        a = store.tensors[name]["arrays"]["w"]
        self.offset, self.shape, self.dtype = a["offset"], a["shape"], a["dtype"]
        self.row_bytes = a["nbytes"] // self.shape[0]
        self.fd = os.open(store.path, os.O_RDONLY)

    def __getitem__(self, tokens: "torch.Tensor") -> "torch.Tensor":  # noqa: F821
        import torch

        from formats.store import DTYPES

        ids = tokens.flatten().tolist()
        buf = bytearray(self.row_bytes * len(ids))
        for i, t in enumerate(ids):
            if not 0 <= t < self.shape[0]:
                raise IndexError(f"token id {t} is outside the vocabulary of {self.shape[0]}")
            buf[i * self.row_bytes : (i + 1) * self.row_bytes] = os.pread(
                self.fd, self.row_bytes, self.offset + t * self.row_bytes
            )
        return torch.frombuffer(buf, dtype=DTYPES[self.dtype]).view(len(ids), self.shape[1])

    def close(self):
        os.close(self.fd)
