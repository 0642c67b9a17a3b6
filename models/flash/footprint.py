"""What `--draft flash` holds, from a store's byte counts alone (no torch: the scheduler's process plans the
run's memory, and stays torch-free): the tensors a flash model keeps per layer, and the predictor to use."""

from __future__ import annotations

import re

from common.errors import CadenceError
from models.store import WeightStore

ATTENTION = ("attn_norm", "attn_qkv", "attn_qkv_bias", "attn_out", "ffn_norm", "attn_q_norm", "attn_k_norm")
FFN = ("ffn_gate_up", "ffn_down")
PATTERN = re.compile(r"predictor-r(\d+)\.npz")
SLACK = 24 << 20  # what the draft actor holds beyond the items below: its reader threads' malloc arenas, torch's
# and oneDNN's scratch for the predictor's bf16 products (measured: up to 11 MiB over the items at density 0.3)
CACHE_TOKENS = 2  # a budget's neuron caches hold two tokens' neurons a layer (`auto`; --draft flash where they fit)
TRAIN = "train one with `launch models train-predictor {model} --prompts CAL.jsonl`"


def ranks(store: WeightStore) -> list[int]:
    """The ranks of the store's predictors, highest first, or one sentence saying to train one."""
    found = [int(m.group(1)) for p in store.dir.glob("predictor-r*.npz") if (m := PATTERN.fullmatch(p.name))]
    if not found:
        raise CadenceError(f"{store.dir} has no activation predictor; {TRAIN.format(model=store.dir.name)}")
    return sorted(found, reverse=True)


def best_rank(store: WeightStore) -> int:
    """The predictor `Predictor.load` takes when no rank is given: the highest."""
    return ranks(store)[0]


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
    models/flash/weights.py would find later, in an actor)."""
    check_kind(store)
    if store.manifest.get("bundles") is None:
        raise CadenceError(f"{store.dir} has no FFN bundles; write them with `launch models bundle {store.dir}`")
    ranks(store)


def _tensor_bytes(store: WeightStore, names) -> int:
    return sum(x["nbytes"] for t in names if t in store.tensors for x in store.tensors[t]["arrays"].values())


def draft_bytes(store: WeightStore, rank: int, capacity: int, head_rows: int | None) -> int:
    """What models/flash/draft.py `streamed_flash_draft` holds: every layer's attention and norms, the head's
    rows, the predictor of `rank` (bf16), a layer's dense FFN (the prompt pass's scratch), the bundle reader's buffer (a
    layer's records, models/flash/bundles.py `Layout.layer_bytes`), the per-neuron bookkeeping, `capacity`
    neurons a layer of caches and SLACK."""
    a = store.args
    check(store)
    lay = store.manifest["bundles"]
    record, per_chunk = int(lay["record_bytes"]), int(lay["chunk_neurons"])
    attention = _tensor_bytes(store, [f"blk.{i}.{t}" for i in range(a.n_layers) for t in ATTENTION])
    ffn = max(_tensor_bytes(store, [f"blk.{i}.{t}" for t in FFN]) for i in range(a.n_layers))
    predictor = 2 * a.n_layers * rank * (a.dim + 2 * a.ffn_dim)
    # the bundle reader's scratch (a layer's chunks of whole 4 KiB blocks, at most) and a step's missing records
    reader = -(-a.ffn_dim // per_chunk) * (-(-per_chunk * record // 4096) * 4096) + capacity * record
    # per layer: the reader's neuron orders and positions (int64), a cache's slot of each neuron (int32) and
    # its rows' ids and last steps (int32, int64)
    books = a.n_layers * (20 * a.ffn_dim + 12 * capacity)
    cache = a.n_layers * capacity * record
    return attention + store.head_bytes(head_rows) + predictor + ffn + 4096 + reader + books + cache + SLACK
