"""Recurrent layers over token trees: LFM2's short convolution and Qwen 3.5's gated delta-net, verified in one
forward where every node reads its own ancestors' state, and kept to the accepted path by `KVCache.commit`.

A recurrent layer keeps rows of its recent tokens (models/kvcache.py, from global slot `base`): a convolution's
input row (LFM2: B * x~; a delta-net: its q/k/v channels before the convolution), and a delta-net's k, v, decay
and beta after it. Its state [v heads, k dim, v dim] holds every token up to slot `folded`; the rows past it are
folded in when a forward starts (`fold`), after `commit(keep)` has kept the accepted path's rows as it keeps keys.

A node's convolution taps are its nearest ancestors' rows (the last slots its visibility lists, then the committed
ones before them), never a sibling's or the flattened tree's preceding row. Its delta-net state is its parent's
stepped once, the parent's own stepped from the state along the ancestors its visibility lists: a tree costs a
step a node, and a node's state is the one decoding its path alone gives, bit for bit (the same steps in the same
order). Siblings share their parent's state; a rejected branch's rows are dropped by the commit, never folded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models import recurrent_kernels as rk
from models.attention import Visibility, lanes, padded


_LAST_TAPS: list = [None, 0, None]  # the last forward's (visibility, kernel, taps): its every recurrent layer's
_LAST_CHAIN: list = [None, None, False]  # the last forward's (visibility, (rows, folded), whether one chain)


def taps(vis: Visibility, kernel: int) -> torch.Tensor:
    """int64 [T, kernel]: the global slot of each row's j-th nearest ancestor (j = 0: the row itself), -1 before
    the start of the context. Every recurrent layer of a forward reads the same visibility: computed once a forward."""
    last_vis, last_kernel, last = _LAST_TAPS
    if last_vis is vis and last_kernel == kernel:
        return last
    _LAST_TAPS[:] = [vis, kernel, _taps(vis, kernel)]
    return _LAST_TAPS[2]


def _taps(vis: Visibility, kernel: int) -> torch.Tensor:
    ptr, idx = vis.ptr.long(), vis.idx.long()
    count = ptr[1:] - ptr[:-1]  # each row's own slots (ancestors in this forward or pending, itself last)
    j = torch.arange(kernel).view(1, -1)
    own = j < count.view(-1, 1)
    at = (ptr[1:].view(-1, 1) - 1 - j).clamp(min=0, max=max(idx.numel() - 1, 0))
    from_idx = idx[at] if idx.numel() else torch.zeros_like(at)
    committed = vis.n_shared - 1 - (j - count.view(-1, 1))
    return torch.where(own, from_idx, committed).clamp(min=-1)


def conv_mix(rows: torch.Tensor, base: int, slots: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each row's causal depthwise convolution over its taps `slots` [T, K] (global; rows[s - base] holds slot s):
    [T, channels]. `weight` [channels, K] as transformers' Conv1d holds it (tap K-1 on the row itself)."""
    kernel = weight.shape[1]
    width = weight.shape[0]
    if rk.conv_on(rows, weight):  # the same products and sums, one pass over the taps
        return rk.conv_mix(rows, base, slots, weight)
    got = rows[(slots - base).clamp(min=0), :width] * (slots >= 0).unsqueeze(-1).to(rows.dtype)  # [T, K, C]
    out = got[:, 0] * weight[:, kernel - 1]
    for j in range(1, kernel):  # tap by tap: each row's sum in the same order whatever the forward's rows
        out += got[:, j] * weight[:, kernel - 1 - j]
    return out


def short_conv(model, x: torch.Tensor, w, at, norm, h: torch.Tensor) -> None:
    """LFM2's convolution branch, added to x in place: in_proj -> [B | C | x~]; C * conv(B * x~); out_proj."""
    a = model.args
    b, c, xx = w.conv_in.matmul(h).split(a.dim, dim=-1)
    T = x.shape[0]
    at.k[at.slot0 : at.slot0 + T] = b * xx
    y = c * conv_mix(at.k, at.base, taps(at.vis, a.conv_kernel).to(x.device), w.conv_w)
    model.residual(x, w.conv_out, y, None, norm)


# -- gated delta-net ------------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


CHUNKED = 128  # a chain of at least this many rows (a prompt's chunk: a verification has at most 65) runs chunked


def _one_chain(at, T: int) -> bool:
    """The forward's rows are one chain from the folded state (a prompt's chunk): row r sees the committed text and
    rows 0..r, nothing pending before them."""
    vis = at.vis
    if vis.n_shared != at.folded or at.base + at.slot0 != at.folded:
        return False
    if _LAST_CHAIN[0] is not vis or _LAST_CHAIN[1] != (T, at.folded):  # every recurrent layer of a forward asks alike
        lens = (vis.ptr[1:] - vis.ptr[:-1]).tolist()
        rows = vis.idx[vis.ptr[-2] :].tolist()
        _LAST_CHAIN[:] = [
            vis,
            (T, at.folded),
            lens == list(range(1, T + 1)) and rows == list(range(at.folded, at.folded + T)),
        ]
    return _LAST_CHAIN[2]


def _keep(at, T: int, out: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """A one-chain forward's last state kept for the next forward's fold (`KVCache.chains`, by the layer's rows); out."""
    if at.chains is not None:
        at.chains[at.k.data_ptr()] = (at.folded, at.base + at.slot0 + T, end)
    return out


def chunk_rule(q, k, v, g, beta, state, chunk: int = 64):
    """The gated delta rule over a chain of T tokens at once (transformers' chunked WY form): q, k [T, H, Dk] (q
    normalised and scaled, k normalised), v [T, H, Dv], g (log decays) and beta [T, H], from `state` [H, Dk, Dv];
    (outputs [T, H, Dv], the state after the last token). Equal to T steps up to rounding."""
    T = q.shape[0]
    pad = (chunk - T % chunk) % chunk
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, T', D]
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))  # [H, T']
    H, n = q.shape[0], (T + pad) // chunk
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(H, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(H, n, chunk).cumsum(-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool).triu(1)
    pair = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair
    inner = (q @ k.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_v)
    s = state.clone()
    for i in range(n):
        vn = new_v[:, i] - k_cum[:, i] @ s
        out[:, i] = q[:, i] @ s + inner[:, i] @ vn
        s = s * decay[:, i] + k[:, i].transpose(-1, -2) @ vn
    return out.reshape(H, -1, out.shape[-1])[:, :T].transpose(0, 1), s


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def lanes2(fn, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`lanes` of an elementwise fn of two [T, n] tensors."""
    return fn(padded(x), padded(y))[:, : x.shape[1]]


def _heads(x: torch.Tensor, d: int, fn) -> torch.Tensor:
    """fn of each d-wide head of the rows x [T, n] (`lanes`, the heads viewed [T, heads, d])."""
    return lanes(lambda p: fn(p.view(p.shape[0], -1, d)).reshape(p.shape), x, d)


def step(state: torch.Tensor, row: torch.Tensor, a, out: torch.Tensor | None = None) -> torch.Tensor:
    """A recurrent state after one more token, from its row (the model's kind of layer): a new tensor, or `out` (a
    buffer of the state's shape, not `state`)."""
    got = (ssm_step if a.ssm_layers else gdn_step)(state, row, a, out)
    return got if out is None or got.data_ptr() == out.data_ptr() else out.copy_(got)


def gdn_step(state: torch.Tensor, row: torch.Tensor, a, out: torch.Tensor | None = None) -> torch.Tensor:
    """A delta-net state [..., Hv, Dk, Dv] after one more token, from its row's [..., W] k, v, decay e^g and beta:
    S <- e^g S; S <- S + k (beta (v - S^T k))^T (transformers' recurrent gated delta rule, in its float steps).
    Several states at once (a tree's level) get the bits each gets alone: a state's slab is whole vectors."""
    hk, dk, hv, dv = a.gdn_k_heads, a.gdn_k_dim, a.gdn_v_heads, a.gdn_v_dim
    lo = a.gdn_conv_dim + hk * dk
    if rk.gdn_on(state, a):  # the same products, each rounded alike, in one pass over the state
        flat, rows = state.reshape(-1, hv, dk, dv).contiguous(), row.reshape(-1, row.shape[-1]).contiguous()
        offsets = (a.gdn_conv_dim, lo, lo + hv * dv, lo + hv * (dv + 1))
        into = None if out is None else out.view(flat.shape)
        return rk.gdn_step(flat, rows, (hv, dk, dv, hk), offsets, into).view(state.shape)
    decay, beta = row[..., lo + hv * dv : lo + hv * (dv + 1)], row[..., lo + hv * (dv + 1) : lo + hv * (dv + 2)]
    k = row[..., a.gdn_conv_dim : lo].unflatten(-1, (hk, dk)).repeat_interleave(hv // hk, -2)
    v = row[..., lo : lo + hv * dv].unflatten(-1, (hv, dv))
    state = state * decay[..., None, None]
    kv_mem = (state * k.unsqueeze(-1)).sum(-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    return state + k.unsqueeze(-1) * delta.unsqueeze(-2)


def fold(state: torch.Tensor, rows: torch.Tensor, a) -> None:
    """The state stepped over `rows` (a chain of tokens, in order), in place."""
    s = state
    for r in range(rows.shape[0]):
        s = step(s, rows[r], a)
    state.copy_(s)


def _levels(at, a, T: int):
    """Yields (first row, the states [n, *state] of rows first..first+n-1) for the forward's T rows in order, a level
    at a time: rows whose parents are all known before them (a tree's depth; a chain's one row) stepped together from
    their parents' states. A row's parent is its last visible slot before itself; an ancestor from an earlier forward
    (a draft's pending nodes) is stepped from the folded state along what the row sees. A state is dropped once its
    rows' children are done."""
    vis, rows, base, end = at.vis, at.k, at.base, at.base + at.slot0
    ptr, idx = vis.ptr.tolist(), vis.idx.tolist()
    chains = [list(range(at.folded, vis.n_shared)) + idx[ptr[r] : ptr[r + 1]] for r in range(T)]
    parent = [c[-2] if len(c) > 1 else None for c in chains]
    children: dict[int, int] = {}
    for p in parent:
        if p is not None:
            children[p] = children.get(p, 0) + 1
    memo: dict[int, torch.Tensor] = {}
    kept = at.chains is not None and _one_chain(at, T)  # its end state kept for the fold (a decode step's: the spare)
    r = 0
    while r < T:
        e = r + 1
        while e < T and not (parent[e] is not None and end + r <= parent[e] < end + e):
            e += 1
        starts = []
        for i in range(r, e):
            chain = chains[i]
            j = len(chain) - 1  # the nearest ancestor whose state is known, then step from there
            while j > 0 and chain[j - 1] not in memo:
                j -= 1
            s = memo[chain[j - 1]] if j > 0 else at.v
            for slot in chain[j:-1]:  # ancestors from earlier forwards (this forward's are in the memo)
                s = memo[slot] = step(s, rows[slot - base], a)
            starts.append(s)
        if e - r == 1:  # a row alone (a chain's, a decode step's) is stepped as the fold steps a row: the same bits
            into = at.spare() if kept and T == 1 and at.spare else None
            states = step(starts[0], rows[end + r - base], a, into).unsqueeze(0)
        else:
            states = step(torch.stack(starts), rows[end + r - base : end + e - base], a)
        for i in range(r, e):
            if children.get(end + i):
                memo[end + i] = states[i - r]
            p = parent[i]
            if p is not None and p >= end:
                children[p] -= 1
                if not children[p]:
                    memo.pop(p, None)
        yield r, states
        r = e
    if kept:  # a decode step's state kept for the fold: it is the fold's own
        at.chains[rows.data_ptr()] = (at.folded, end + T, states[-1])


def gated_delta_net(model, x: torch.Tensor, w, at, norm, h: torch.Tensor) -> None:
    """Qwen 3.5's delta-net branch, added to x in place: in_proj -> q/k/v (convolved, SiLU), z, b, a; each row's
    state stepped from its parent's; out = out_proj(gated_norm(S^T q) * silu(z))."""
    a = model.args
    T, C, hk, dk, hv, dv = x.shape[0], a.gdn_conv_dim, a.gdn_k_heads, a.gdn_k_dim, a.gdn_v_heads, a.gdn_v_dim
    pre, z, b, araw = w.gdn_in.matmul(h).split([C, hv * dv, hv, hv], dim=-1)
    rows, s0 = at.k, at.slot0
    rows[s0 : s0 + T, :C] = pre
    conv = conv_mix(rows, at.base, taps(at.vis, a.conv_kernel).to(x.device), w.gdn_conv)
    fused = rk.gdn_on(at.v, a) and rows.stride(1) == 1
    q, g = (rk.gdn_front if fused else _front)(a, w, conv, b, araw, rows[s0 : s0 + T, C:])  # q [T, Hk, Dk]
    if T >= CHUNKED and _one_chain(at, T):  # a prompt's chunk: the chunked form, its end state kept for the fold
        k, vr, _, beta = rows[s0 : s0 + T, C:].split([hk * dk, hv * dv, hv, hv], dim=-1)
        k_v, q = (t.reshape(T, hk, dk).repeat_interleave(hv // hk, 1) for t in (k, q))
        o, end = chunk_rule(q, k_v, vr.reshape(T, hv, dv), g, beta, at.v)
        o = _keep(at, T, o.contiguous(), end)
    elif fused and _one_chain(at, T):  # a chain's rows (a short prompt's, a step's): stepped and read in one call
        offsets = (C, C + hk * dk, C + hk * dk + hv * dv, C + hk * dk + hv * (dv + 1))
        spare = at.spare() if at.spare else None
        o = _keep(at, T, *rk.gdn_scan(at.v, rows[s0 : s0 + T], q, (hv, dk, dv, hk), offsets, spare))
    else:
        o = torch.empty(T, hv, dv, dtype=x.dtype, device=x.device)
        q = q if fused else q.repeat_interleave(hv // hk, 1)
        for r, s in _levels(at, a, T):
            if fused:  # o = S^T q, each state read in one pass
                o[r : r + len(s)] = rk.gdn_read(s.contiguous(), q[r : r + len(s)], hk)
            else:
                o[r : r + len(s)] = (s * q[r : r + len(s)].unsqueeze(-1)).sum(-2)  # [n, Hv, Dv]
    eps = a.gdn_norm_eps or a.norm_eps
    if fused and w.gdn_norm.is_contiguous():  # the gated norm in the CPU kernels
        o = rk.gdn_back(o, z, w.gdn_norm, eps)
    else:
        o = _heads(o.view(T, -1), dv, lambda t: _rms(t, eps))
        o = lanes2(lambda y, g: y * F.silu(g), (o.view(T, hv, dv) * w.gdn_norm).view(T, -1), z)
    model.residual(x, w.gdn_out, o, None, norm)


def _front(a, w, conv: torch.Tensor, b: torch.Tensor, araw: torch.Tensor, out: torch.Tensor):
    """The delta-net's rows from its convolution: [k | v | e^g | beta] written to `out` [T, W - C] (the layer's rows);
    (q [T, Hk, Dk], normed and scaled; g [T, Hv]). Every elementwise op over rows padded to whole vectors (`lanes`):
    a node gets the bits its path decoded alone gets."""
    T, hk, dk, hv, dv = conv.shape[0], a.gdn_k_heads, a.gdn_k_dim, a.gdn_v_heads, a.gdn_v_dim
    qr, kr, vr = lanes(F.silu, conv).split([hk * dk, hk * dk, hv * dv], dim=-1)
    q = _heads(qr, dk, lambda t: _l2norm(t) * dk**-0.5).reshape(T, hk, dk)
    k = _heads(kr.contiguous(), dk, _l2norm)
    g = lanes(F.softplus, araw + w.gdn_dt) * -w.gdn_a.exp()  # g = -e^A softplus(a + dt)
    beta = lanes(lambda t: torch.sigmoid(t) * a.gdn_beta_scale, b.contiguous())
    out.copy_(torch.cat([k, vr, lanes(torch.exp, g), beta], dim=-1))
    return q, g


# -- Mamba-2 ------------------------------------------------------------------------------------------------------


def ssm_step(state: torch.Tensor, row: torch.Tensor, a, out: torch.Tensor | None = None) -> torch.Tensor:
    """A Mamba-2 state [H, P, N] after one more token: h <- exp(dt A) h + (dt B) x (transformers' selective state
    update, in its float steps), from the row's x, B, dt and exp(dt A)."""
    H, P, N, G = a.ssm_heads, a.ssm_head_dim, a.ssm_state, a.ssm_groups
    lo = a.ssm_conv_dim
    if rk.ssm_on(state, a):  # the same products and sum, each rounded alike, in one pass over the state
        offsets = (lo, lo + H * P, lo + H * P + G * N, lo + H * P + G * N + H)
        flat, rows = state.reshape(-1, H, P, N).contiguous(), row.reshape(-1, row.shape[-1]).contiguous()
        into = None if out is None else out.view(flat.shape)
        return rk.ssm_step(flat, rows, (H, P, N, G), offsets, into).view(state.shape)
    x = row[..., lo : lo + H * P].unflatten(-1, (H, P))
    lo += H * P
    B = row[..., lo : lo + G * N].unflatten(-1, (G, N)).repeat_interleave(H // G, -2)
    lo += G * N
    dt, da = row[..., lo : lo + H], row[..., lo + H : lo + 2 * H]
    return state * da[..., None, None] + (dt[..., None] * B).unsqueeze(-2) * x.unsqueeze(-1)


def mamba2(model, x: torch.Tensor, w, at, norm, h: torch.Tensor) -> None:
    """A Mamba-2 branch of h, the layer's normed input (Granite 4.0-H, Nemotron-H, Falcon-H1), added to x in place:
    in_proj -> z, x B C (convolved with a bias, SiLU), dt; each row's state stepped from its parent's; y = C h + D x;
    out_proj(group_norm(y * silu(z))) (or `ModelArgs.ssm_norm`'s other order, or no norm)."""
    a = model.args
    T, H, P, N, G = x.shape[0], a.ssm_heads, a.ssm_head_dim, a.ssm_state, a.ssm_groups
    inner, conv_dim = a.ssm_inner, a.ssm_conv_dim
    rows, s0 = at.k, at.slot0
    fused = rk.ssm_on(at.v, a) and rows.stride(1) == 1
    if fused and _one_chain(at, T) and _one_call_takes(x, h, at) and rk.conv_on(rows, w.ssm_conv):
        rec = rk.ssm_record(w, a)
        if rec is not None:  # the branch in one call (a decode step's row, a prompt's): the same bits
            end = at.spare() if at.spare else torch.empty_like(at.v)
            rk.ssm_layer(rec, x, h, at, taps(at.vis, a.conv_kernel).contiguous(), end)
            _keep(at, T, x, end)
            return
    z, pre, dt_raw = w.ssm_in.matmul(h).split([inner, conv_dim, H], dim=-1)
    rows[s0 : s0 + T, :conv_dim] = pre
    xbc = conv_mix(rows, at.base, taps(at.vis, a.conv_kernel).to(x.device), w.ssm_conv)
    if fused:  # the rows and C in the CPU kernels
        cs = rk.ssm_front(a, w, xbc, dt_raw, rows[s0 : s0 + T, conv_dim:])
    else:  # every elementwise op over whole vectors (`lanes`)
        xbc = lanes(F.silu, xbc + w.ssm_conv_b if w.ssm_conv_b is not None else xbc)
        xs, br, cs = xbc.split([inner, G * N, G * N], dim=-1)
        dt = lanes(F.softplus, dt_raw + w.ssm_dt)
        rows[s0 : s0 + T, conv_dim:] = torch.cat([xs, br, dt, lanes(torch.exp, dt * -w.ssm_a.exp())], dim=-1)
    if fused and _one_chain(at, T):  # a prompt's rows, a chain's, a decode step's: stepped and read in one call
        offsets = (conv_dim, conv_dim + H * P, conv_dim + H * P + G * N, conv_dim + H * P + G * N + H)
        spare = at.spare() if at.spare else None
        ys = _keep(at, T, *rk.ssm_scan(at.v, rows[s0 : s0 + T], cs, (H, P, N, G), offsets, spare))
    else:
        ys = torch.empty(T, H, P, dtype=x.dtype)
        heads = cs if fused else cs.reshape(T, G, N).repeat_interleave(H // G, 1)  # [T, G * N] or [T, H, N]
        for r, s in _levels(at, a, T):
            if fused:  # y = h C, each state read in one pass
                ys[r : r + len(s)] = rk.ssm_read(s.contiguous(), heads[r : r + len(s)], (H, P, N, G))
            else:
                ys[r : r + len(s)] = (s * heads[r : r + len(s)].unsqueeze(-2)).sum(-1)
    if fused and (w.ssm_norm is None or w.ssm_norm.is_contiguous()):
        o = rk.ssm_back(a, w, ys, rows[s0 : s0 + T, conv_dim : conv_dim + inner], z)
    else:
        o = _ssm_out(a, w, ys, rows[s0 : s0 + T, conv_dim : conv_dim + inner], z)
    model.residual(x, w.ssm_out, o, None, norm)


def _one_call_takes(x: torch.Tensor, h: torch.Tensor, at) -> bool:
    """x, h and the layer's state as one kernel call takes them: fp32, contiguous."""
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in (x, h, at.v))


def _ssm_out(a, w, ys: torch.Tensor, xs: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """y = ys + D x, normed and gated as the model says (`rk.ssm_back` in torch ops, over whole vectors)."""
    T, H, P, inner, G = ys.shape[0], a.ssm_heads, a.ssm_head_dim, a.ssm_inner, a.ssm_groups
    y = lanes2(torch.add, ys.view(T, -1), (w.ssm_d.view(H, 1) * xs.reshape(T, H, P)).view(T, -1))
    gate = lambda u, g: u * F.silu(g)  # noqa: E731
    z, rms = z.contiguous(), lambda t: _rms(t, a.norm_eps)  # noqa: E731
    if a.ssm_norm == "gated":
        return _heads(lanes2(gate, y, z), inner // G, rms) * w.ssm_norm
    return lanes2(gate, y if a.ssm_norm == "none" else _heads(y, inner // G, rms) * w.ssm_norm, z)  # (Falcon-H1)


MIXERS = {"conv": short_conv, "gdn": gated_delta_net, "ssm": mamba2}
