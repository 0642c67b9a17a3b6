"""ARCA's measurements on this machine (`launch profile`): (a) the draft's per-depth, per-rank acceptance
on calibration prompts, (b) each unit's time for the linear and attention work of a target layer at
verification widths 1..64 and several context lengths (the verifier alone on every core; or verifier
and sparse-attention worker on one core each), (c) the draft's time per tree level; `measure` then
prices every width, tree and partition (speculative/arca.py `choose`)."""

from __future__ import annotations

import os

import torch

from bench.measure import RTT_S

from common.timing import median_time
from common.settings import SamplingConfig
from engine.profiles import partition_name
from engine.prompts import encode_prompt
from models import split_attention
from models.attention import Visibility
from speculative import arca
from speculative.generate import generate_target

CONTEXTS = (256, 1024, 2048)
# a split job costs the worker's one `serve` request beside the verifier's job, then one meeting in the arena's
# sync area (actors/syncarea.py: a counter written, a spin on the other's) per split attention and per split linear
SPLIT_RTTS = 1
SYNC_S = 20e-6
LINEARS_PER_LAYER = 4  # qkv, attn_out, gate_up, down


def calibrate(target, draft, prompts, n: int, progress, task) -> list[list[int]]:
    """Ranks of the target's greedy tokens among the draft's top-4, teacher-forced."""
    ranks = []
    for p in prompts:
        ids, _ = encode_prompt(target.tokenizer, p, "auto")
        cont = generate_target(target, ids, n, SamplingConfig(), stop_at_eos=False).new_ids
        seq = ids + cont
        cache = draft.model.new_cache(len(seq) + 1)
        logits = draft.model.forward(torch.tensor(seq[:-1]), torch.arange(len(seq) - 1), cache)
        top = torch.topk(logits[len(ids) - 1 :], 4).indices  # the draft's candidates for each continuation token
        ranks.append([next((r for r in range(4) if int(top[t, r]) == tok), 4) for t, tok in enumerate(cont)])
        progress.advance(task)
    return ranks


def unit_times(lm, widths, threads: int) -> dict:
    """One layer's linear work and attention parts, per width and context, with `threads` threads."""
    torch.set_num_threads(threads)
    model, a = lm.model, lm.args
    w = model.weights.layer(0)
    out = {}
    for width in widths:
        rows = width + 1
        x = torch.randn(rows, a.dim)
        h = torch.randn(rows, a.ffn_dim)

        def linear():
            w.qkv.matmul(x)
            w.attn_out.matmul(torch.randn(rows, a.q_dim))
            w.gate_up.matmul(x)
            w.down.matmul(h)

        out[("linear", rows)] = median_time(linear)
        for ctx in CONTEXTS:
            kc, vc = (
                torch.randn(a.n_kv_heads, ctx + rows, a.head_dim),
                torch.randn(a.n_kv_heads, ctx + rows, a.head_dim),
            )
            q = torch.randn(rows, a.n_heads, a.head_dim)
            vis = Visibility.tree(ctx, [-1] + list(range(rows - 1)))
            c_star = ctx // split_attention.CHUNK
            out[("dense", rows, ctx)] = median_time(
                lambda: split_attention.attn_dense(q, kc, vc, 0, c_star, model.scale)
            )
            out[("sparse", rows, ctx)] = median_time(
                lambda: split_attention.attn_chunks(
                    q, kc, vc, vis.n_shared, vis.ptr, vis.idx, c_star * split_attention.CHUNK, model.scale
                )
            )
    return out


def head_s(lm, rows: int) -> float:
    h = torch.randn(rows, lm.args.dim)
    return median_time(lambda: [part.out.matmul(h) for part in lm.model.weights.head], reps=2)


def engine_step(lm, ctx: int = 300) -> float:
    model = lm.model
    cache = model.new_cache(ctx + 2)
    model.forward(torch.arange(ctx) % 1000 + 100, torch.arange(ctx), cache)
    cache.commit()

    def step():
        model.forward(torch.tensor([5]), torch.tensor([ctx]), cache)
        cache.rewind(ctx)

    return median_time(step)


def draft_step(lm, m: int, ctx: int = 300) -> float:
    """One draft forward of m tree nodes (one level of a tree) after `ctx` tokens."""
    model = lm.model
    cache = model.new_cache(ctx + m + 1)
    model.forward(torch.arange(ctx) % 1000 + 100, torch.arange(ctx), cache)
    cache.commit()
    vis = Visibility.tree(ctx, [-1] * m)

    def step():
        model.forward(torch.arange(m) + 7, torch.full((m,), ctx), cache, vis)
        cache.rewind(ctx)

    return median_time(step)


def measure(target, draft, prompts, tokens: int, progress) -> dict:
    """Every measurement, and the candidates ranked: {"ranked", "acceptance", "both", "one", "step_s",
    "draft_level", "context"}."""
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    task = progress.add_task("calibration: draft acceptance", total=len(prompts))
    acc = arca.acceptance_table(calibrate(target, draft, prompts, tokens, progress, task))
    task = progress.add_task("unit times: 2 threads / 1 thread", total=2)
    both = unit_times(target, arca.WIDTHS, threads)
    progress.advance(task)
    one = unit_times(target, arca.WIDTHS, 1) if threads > 1 else both
    progress.advance(task)
    torch.set_num_threads(threads)
    task = progress.add_task("draft and target steps", total=2)
    step_s = engine_step(target)
    progress.advance(task)
    draft_level = {m: draft_step(draft, m) for m in (1, 2, 4, 8)}
    progress.advance(task)
    ctx = min(CONTEXTS, key=lambda c: abs(c - 512))  # the context the choice is made for
    verify = verify_costs(target, both, one, ctx)
    return {
        "ranked": arca.choose(acc, step_s, verify, draft_level),
        "acceptance": acc,
        "both": both,
        "one": one,
        "step_s": step_s,
        "draft_level": draft_level,
        "context": ctx,
    }


def verify_costs(target, both: dict, one: dict, ctx: int) -> dict:
    """A verification's seconds per width and partition: the verifier alone, or split with the worker."""
    L, verify = target.args.n_layers, {}
    for width in arca.WIDTHS:
        rows = width + 1
        lin2, lin1 = both[("linear", rows)], one[("linear", rows)]
        dense2, sparse2 = both[("dense", rows, ctx)], both[("sparse", rows, ctx)]
        dense1, sparse1 = one[("dense", rows, ctx)], one[("sparse", rows, ctx)]
        verify[(rows, "none")] = L * (lin2 + dense2 + sparse2) + head_s(target, rows)
        for share in (0.0, 0.25, 0.5):  # verifier core: linear + its dense share; worker core: sparse + the rest
            mine, theirs = (1 - share) * dense1, sparse1 + share * dense1
            for cols in (0.0, 0.25, 0.5):  # and the last `cols` of every linear's columns to the worker too
                lin = max(1 - cols, cols) * lin1 + (LINEARS_PER_LAYER * SYNC_S if cols else 0.0)
                verify[(rows, partition_name(share, cols))] = (
                    L * (lin + max(mine, theirs) + SYNC_S) + SPLIT_RTTS * RTT_S + head_s(target, rows)
                )
    return verify
