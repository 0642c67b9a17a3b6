"""What `--draft flash` holds, from a store's byte counts alone (no torch: the scheduler's process plans the
run's memory, and stays torch-free): the tensors a flash model keeps per layer, and the predictors to choose
from, best first, with their sizes."""

from __future__ import annotations

import json
import re
import zipfile
from functools import lru_cache
from pathlib import Path

import numpy as np
from numpy.lib import format as npf

from common.errors import CadenceError
from formats.store import WeightStore

ATTENTION = ("attn_norm", "attn_qkv", "attn_qkv_bias", "attn_out", "ffn_norm", "attn_q_norm", "attn_k_norm")
FFN = ("ffn_gate_up", "ffn_down")
INT2 = "int2"
KINDS = (INT2, "lowrank")  # what `launch models train-predictor --kind` makes
PATTERN = re.compile(r"predictor-(r\d+|int2)\.npz")  # a low-rank predictor of rank N (`rN`), or `int2`
SLACK = 48 << 20  # what the draft actor holds beyond the items below: its reader threads' malloc arenas, a step's
# transient buffers, torch's and oneDNN's scratch for a low-rank predictor's bf16 products (measured in a 1 GiB
# cgroup: up to 11 MiB over the items at density 0.3 with rank 128, 45 MiB at 0.2 with int2)
CACHE_TOKENS = 2  # a budget's neuron caches hold two tokens' neurons a layer (`auto`; --draft flash where they fit)
TRAIN = "train one with `launch models train-predictor {model} --prompts CAL.jsonl`"


def file_name(name: str) -> str:
    """A predictor's file: `predictor-r128.npz` (low rank, 128), `predictor-int2.npz`."""
    return f"predictor-{name}.npz"


def predictors(store: WeightStore) -> list[str]:
    """The store's predictors, best first (the higher recall measured at fitting, then the smaller), or one
    sentence saying to train one."""
    found = [m.group(1) for p in store.dir.glob("predictor-*.npz") if (m := PATTERN.fullmatch(p.name))]
    if not found:
        raise CadenceError(f"{store.dir} has no activation predictor; {TRAIN.format(model=store.dir.name)}")
    return sorted(found, key=lambda n: (-_index(store.dir / file_name(n))[0], predictor_bytes(store, n), n))


def best_predictor(store: WeightStore) -> str:
    """The predictor `Predictor.load` takes when none is named: the first of `predictors`."""
    return predictors(store)[0]


def predictor_bytes(store: WeightStore, name: str) -> int:
    """What the predictor holds in memory: its arrays as the file stores them (fp16 or int2 codes and scales)."""
    return _index(store.dir / file_name(name))[1]


def _index(path: Path) -> tuple[float, int]:
    st = path.stat()
    return _read_index(path, st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=32)
def _read_index(path: Path, mtime: int, size: int) -> tuple[float, int]:
    """(the recall in the file's header, its arrays' bytes) from the zip's directory and its header member
    alone; a file that cannot be read ranks last (loading it says what is wrong)."""
    try:
        with zipfile.ZipFile(path) as z:
            arrays = sum(_array_bytes(z, name) for name in z.namelist() if name != "header.npy")
            with z.open("header.npy") as f:
                header = json.loads(str(npf.read_array(f, allow_pickle=False)))
        return float(header.get("recall", {}).get("mean", 0.0)), arrays
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile, AttributeError):
        return -1.0, size


def _array_bytes(z: zipfile.ZipFile, name: str) -> int:
    """The bytes of one array of an npz file, from its npy header."""
    with z.open(name) as f:
        read = npf.read_array_header_1_0 if npf.read_magic(f) == (1, 0) else npf.read_array_header_2_0
        shape, _, dtype = read(f)
    return int(np.prod(shape)) * dtype.itemsize


def top_k(density: float, ffn_dim: int) -> int:
    """The neurons a token computes at `density`."""
    return max(1, round(density * ffn_dim))


def check_kind(store: WeightStore) -> None:
    """One sentence where `store` cannot have FFN bundles: a mixture of experts, or a format other than int4."""
    if store.args.moe:
        raise CadenceError(f"{store.dir} holds a mixture of experts: FFN bundles are for dense FFN models")
    if store.format != "int4":
        raise CadenceError(
            f"FFN bundles are written for int4 weight stores; {store.dir} is {store.format}: use --dtype int4"
        )


def check(store: WeightStore) -> None:
    """One sentence where `store` cannot run the flash machinery: `check_kind`, no bundles, no predictor (what
    flash/weights.py would find later, in an actor)."""
    check_kind(store)
    if store.manifest.get("bundles") is None:
        raise CadenceError(f"{store.dir} has no FFN bundles; write them with `launch models bundle {store.dir}`")
    predictors(store)


def _tensor_bytes(store: WeightStore, names) -> int:
    return sum(x["nbytes"] for t in names if t in store.tensors for x in store.tensors[t]["arrays"].values())


def draft_bytes(store: WeightStore, predictor: str, capacity: int, head_rows: int | None) -> int:
    """What flash/sparse_target.py `streamed_flash_draft` holds: every layer's attention and norms, the head's
    rows, the predictor named `predictor`, a layer's dense FFN (the prompt pass's scratch), the bundle reader's buffer (a
    layer's records, flash/bundles.py `Layout.layer_bytes`), the per-neuron bookkeeping, `capacity`
    neurons a layer of caches and SLACK."""
    a = store.args
    check(store)
    lay = store.manifest["bundles"]
    record, per_chunk = int(lay["record_bytes"]), int(lay["chunk_neurons"])
    attention = _tensor_bytes(store, [f"blk.{i}.{t}" for i in range(a.n_layers) for t in ATTENTION])
    ffn = max(_tensor_bytes(store, [f"blk.{i}.{t}" for t in FFN]) for i in range(a.n_layers))
    # the bundle reader's scratch (a layer's chunks of whole 4 KiB blocks, at most) and a step's missing records
    reader = -(-a.ffn_dim // per_chunk) * (-(-per_chunk * record // 4096) * 4096) + capacity * record
    # per layer: the reader's neuron orders and positions (int64), a cache's slot of each neuron (int32) and
    # its rows' ids and last steps (int32, int64)
    books = a.n_layers * (20 * a.ffn_dim + 12 * capacity)
    cache = a.n_layers * capacity * record
    return (
        attention
        + store.head_bytes(head_rows)
        + predictor_bytes(store, predictor)
        + ffn
        + 4096
        + reader
        + books
        + cache
        + SLACK
    )
