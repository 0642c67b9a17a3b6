"""Recurrent layers under a token tree (models/recurrent.py: LFM2's short convolutions, Qwen 3.5's gated
delta-nets, Granite 4.0-H's Mamba-2): a node's taps are its own ancestors' rows, never a sibling's or the preceding row of the flattened tree;
a tree forward gives each node what decoding its path alone gives, bit for bit; a rejected branch leaves the state
exactly the accepted path's; and a draft's nodes fed one forward at a time read their pending ancestors' states."""

import pytest
import torch

from formats import loading
from models.attention import Visibility
from formats.convert import convert
from models.kernel_build import PATHS
from models import recurrent_kernels as rk
from models.recurrent import taps
from formats.source_hf import HFSource
from formats.store import WeightStore
from tests.models.families import tiny_hf

# a tree under a committed context of 5: 0 -> {1 -> {3, 4}, 2 -> 5}
PARENTS = [-1, 0, 0, 1, 1, 2]


def test_taps_are_the_nearest_ancestors_then_the_committed_rows():
    got = taps(Visibility.tree(5, PARENTS), 3).tolist()
    # slots: the tree's nodes at 5..10; committed 0..4
    assert got == [[5, 4, 3], [6, 5, 4], [7, 5, 4], [8, 6, 5], [9, 6, 5], [10, 7, 5]]
    assert taps(Visibility.causal(0, 2), 3).tolist() == [[0, -1, -1], [1, 0, -1]]  # zeros before the context


@pytest.fixture(
    scope="module", params=["lfm2", "qwen3_5_text", "granitemoehybrid", "nemotron_h", "olmo_hybrid", "falcon_h1"]
)
def model(tmp_path_factory, request):
    d = tmp_path_factory.mktemp(request.param)
    store = WeightStore(convert(HFSource(tiny_hf(request.param, "plain", d / "hf", seed=1)), d / "int4", "int4"))
    return loading.load_store(store).model


def _path(node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = PARENTS[node]
    return out[::-1]


def test_a_tree_gives_each_node_its_path_decoded_alone_and_keeps_the_accepted_state(model):
    lfm2 = model
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 300, (9,), generator=g)
    nodes = torch.randint(3, 300, (len(PARENTS),), generator=g)
    depth = [len(_path(n)) for n in range(len(PARENTS))]

    def primed():
        cache = lfm2.new_cache(32)
        lfm2.forward(prompt, torch.arange(len(prompt)), cache)
        cache.commit()
        return cache

    cache = primed()
    L = cache.length
    pos = torch.tensor([L - 1 + d for d in depth])
    tree = lfm2.forward(nodes, pos, cache, Visibility.tree(L, PARENTS))
    for n in range(len(PARENTS)):  # the chain of n's path, decoded one token at a time from the same prompt
        alone = primed()
        for k, m in enumerate(_path(n)):
            logits = lfm2.forward(nodes[m : m + 1], torch.tensor([L + k]), alone)[0]
            alone.commit()
        assert torch.equal(tree[n], logits), n
    accepted = _path(4)  # 0 -> 1 -> 4: siblings 2, 3, 5 rejected
    cache.commit(accepted)
    nxt = torch.tensor([7])
    after = lfm2.forward(nxt, torch.tensor([L + len(accepted)]), cache)[0]
    alone = primed()
    lfm2.forward(nodes[accepted], torch.arange(L, L + len(accepted)), alone)
    alone.commit()
    assert torch.equal(after, lfm2.forward(nxt, torch.tensor([L + len(accepted)]), alone)[0])
    for j in range(len(lfm2.args.rec_layers)):  # the accepted path's state and rows, bit for bit
        (ra, sa, ba), (rb, sb, bb) = cache.rec_kv(j), alone.rec_kv(j)
        assert sa is sb is None or torch.equal(sa, sb)
        lo = max(ba, bb, cache.length + 1 - lfm2.args.conv_kernel)
        assert torch.equal(ra[lo - ba : cache.length + 1 - ba], rb[lo - bb : alone.length + 1 - bb])


def test_nodes_fed_one_forward_at_a_time_read_their_pending_ancestors(model):
    """A draft grows its tree a node a forward (speculative/feed.py): a node's parent is pending from an earlier
    forward, its state stepped from the folded one along the node's visible ancestors."""
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(3, 300, (7,), generator=g)
    nodes = torch.randint(3, 300, (len(PARENTS),), generator=g)
    cache = model.new_cache(32)
    model.forward(prompt, torch.arange(len(prompt)), cache)
    cache.commit()
    L = cache.length
    whole = model.forward(
        nodes, torch.tensor([L - 1 + len(_path(n)) for n in range(len(PARENTS))]), cache, Visibility.tree(L, PARENTS)
    )
    cache.commit([])  # the whole tree rejected: the next forward starts from the same state
    for n in range(len(PARENTS)):  # one node a forward, each seeing its ancestors' pending slots and its own
        anc = [L + a for a in _path(n)[:-1]] + [cache.end]
        vis = Visibility(L, torch.tensor([0, len(anc)], dtype=torch.int32), torch.tensor(anc, dtype=torch.int32))
        one = model.forward(nodes[n : n + 1], torch.tensor([L - 1 + len(_path(n))]), cache, vis)[0]
        assert torch.equal(one, whole[n]), n


def test_a_decode_step_writes_its_state_into_the_spare_and_the_fold_swaps_the_two_buffers(model):
    """A forward of one chain from the folded state (a decode step) writes each recurrent layer's end state into
    the layer's second buffer, and the next forward's fold has the buffers change roles: no state is copied, and
    the logits are those of the same tokens in one forward (a chain's scan, written into the spare too)."""
    if model.args.rec_kind == "conv":
        pytest.skip("a convolution keeps rows, not a state")
    g = torch.Generator().manual_seed(8)
    tokens = torch.randint(3, 300, (12,), generator=g)
    cache = model.new_cache(32)
    model.forward(tokens[:6], torch.arange(6), cache)
    cache.commit()
    n = len(model.args.rec_layers)
    read, written = [], []  # each step's: the states it stepped from, and where it wrote the new ones
    for t in range(6, 11):
        step = model.forward(tokens[t : t + 1], torch.tensor([t]), cache)[0]
        cache.commit()
        read.append([cache.rec_kv(j)[1].data_ptr() for j in range(n)])
        written.append([cache.chains[cache.rec[j].data_ptr()][2].data_ptr() for j in range(n)])
        assert written[-1] == [cache.spare(j).data_ptr() for j in range(n)]  # into the layer's second buffer
    assert all(w == r for w, r in zip(written, read[1:]))  # the next step read them there: swapped, not copied
    assert all(w != r for w, r in zip(written, read))
    assert len({p for ps in read + written for p in ps}) == 2 * n  # two buffers a layer, no new one
    whole = model.new_cache(32)
    logits = model.forward(tokens[:11], torch.arange(11), whole)
    assert torch.allclose(step, logits[10], atol=1e-4)  # (a chain of 11 in one forward: a scan's bits, not a step's)
    marks, views = cache.committed()  # a prompt cache's copy of it, into a new cache: the same next token's bits
    again = model.new_cache(32)
    for name, into in again.adopt(marks).items():
        into.copy_(views[name])
    nxt = tokens[11:12], torch.tensor([11])
    assert torch.equal(model.forward(*nxt, cache)[0], model.forward(*nxt, again)[0])


def test_a_long_prompt_runs_chunked_and_speculation_on_it_stays_lossless(tmp_path):
    """A prompt's chunk of CHUNKED rows or more runs the delta rule's chunked form (models/recurrent.py
    `chunk_rule`), its end state kept for the fold: close to stepping token by token (whose end state is kept too,
    the fold's own bits), and `tree` and `chain` after it are the target's own tokens (both prefill alike)."""
    from common.settings import SamplingConfig, TreeConfig
    from models import recurrent
    from speculative.generate import generate_speculative, generate_target

    store = WeightStore(
        convert(HFSource(tiny_hf("qwen3_5_text", "plain", tmp_path / "hf", seed=1)), tmp_path / "s", "fp32")
    )
    target = loading.load_store(store)
    m = target.model
    prompt = torch.randint(3, 300, (recurrent.CHUNKED + 40,), generator=torch.Generator().manual_seed(8))
    runs = []
    for chunked in (True, False):
        cache = m.new_cache(len(prompt) + 8)
        saved, recurrent.CHUNKED = recurrent.CHUNKED, recurrent.CHUNKED if chunked else 1 << 30
        try:
            runs.append(m.forward(prompt, torch.arange(len(prompt)), cache)[-1])
            assert len(cache.chains) == len(m.args.rec_layers)  # each delta-net's end state kept for the fold
            for j in range(len(m.args.rec_layers)) if not chunked else ():  # stepped: the fold's own state, to the bit
                s = torch.zeros_like(cache.state[j])
                recurrent.fold(s, cache.rec[j, : len(prompt)], m.args)
                assert torch.equal(cache.chains[cache.rec[j].data_ptr()][2], s)
            cache.commit()
            runs.append(m.forward(torch.tensor([7]), torch.tensor([len(prompt)]), cache)[0])  # after the fold
        finally:
            recurrent.CHUNKED = saved
    for a, b in ((runs[0], runs[2]), (runs[1], runs[3])):
        assert float((a - b).abs().max()) < 1e-4 * max(1.0, float(b.abs().max()))
    reference = generate_target(target, prompt.tolist(), 16, SamplingConfig(), stop_at_eos=False).new_ids
    for cfg in (TreeConfig(), TreeConfig(mode="chain")):
        got = generate_speculative(target, target, prompt.tolist(), 16, SamplingConfig(), cfg, stop_at_eos=False)
        assert got.new_ids == reference and got.stats["accepted"] > 0, cfg.mode


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "granitemoehybrid"])
def test_the_states_a_forward_keeps_for_the_fold_are_counted_in_its_activations(tmp_path, model_type):
    """A decode step keeps each recurrent layer's last state for the next forward's fold (the fold's own bits, not
    stepped again): the plan's activations (scheduler/generation/footprint.py) count those bytes beside a
    verification's nodes' states."""
    from scheduler.generation.footprint import activation_bytes

    hf = tiny_hf(model_type, "plain", tmp_path / "hf", seed=1)
    m = loading.load_store(WeightStore(convert(HFSource(hf), tmp_path / "s", "fp32"))).model
    cache = m.new_cache(32)
    m.forward(torch.arange(3, 10), torch.arange(7), cache)
    cache.commit()
    m.forward(torch.tensor([5]), torch.tensor([7]), cache)
    kept = sum(state.numel() * state.element_size() for *_, state in cache.chains.values())
    assert len(cache.chains) == len(m.args.rec_layers) and kept > 0
    a = m.args.to_dict()
    attention_only = {k: v for k, v in a.items() if k not in ("gdn_layers", "ssm_layers")}
    assert activation_bytes(a, 1, 1) - activation_bytes(attention_only, 1, 1) >= kept


@pytest.mark.parametrize("path_name", [p.name for p in PATHS])
def test_mamba2_states_step_and_read_in_one_pass_with_torch_s_bits_on_every_path(monkeypatch, path_name):
    """The CPU kernels' Mamba-2 step (csrc/ops.cpp `cad_ssm_step`) gives the new states torch's separate ops give, to the
    bit, on every kernel path this host has; its read of y = h C is torch's within rounding; and a tree level's states
    (several at once) each get what they get alone, stepped and read."""
    from types import SimpleNamespace

    from models import kernels, recurrent
    from models import recurrent_kernels as rk
    from tests.models.test_kernel_paths import path_lib

    so = path_lib(path_name)
    H, P, N, G, conv = 8, 16, 32, 2, 24
    a = SimpleNamespace(ssm_heads=H, ssm_head_dim=P, ssm_state=N, ssm_groups=G, ssm_conv_dim=conv, ssm_layers=(0,))
    g = torch.Generator().manual_seed(3)
    states = torch.randn(5, H, P, N, generator=g)
    rows = torch.randn(5, conv + H * P + G * N + 2 * H, generator=g)
    c = torch.randn(5, 3 * G * N, generator=g)[:, G * N : 2 * G * N]  # a view with rows apart, as the mixer's C is
    with kernels.using(so):
        stepped = recurrent.ssm_step(states, rows, a)
        alone = torch.stack([recurrent.ssm_step(states[i], rows[i], a) for i in range(5)])
        read = rk.ssm_read(stepped, c, (H, P, N, G))
        read_alone = torch.cat([rk.ssm_read(stepped[i : i + 1], c[i : i + 1], (H, P, N, G)) for i in range(5)])
    monkeypatch.setattr(rk, "ssm_on", lambda *_: False)
    assert torch.equal(stepped, recurrent.ssm_step(states, rows, a))  # torch's own ops, the same bits
    assert torch.equal(stepped, alone) and torch.equal(read, read_alone)
    by_torch = (stepped * c.reshape(5, G, N).repeat_interleave(H // G, 1).unsqueeze(-2)).sum(-1)
    assert torch.allclose(read, by_torch, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path_name", [p.name for p in PATHS])
def test_delta_net_states_step_and_read_in_one_pass_on_every_path(monkeypatch, path_name):
    """The CPU kernels' gated delta-net step and read (csrc/ops.cpp `cad_gdn_step`, `cad_gdn_read`) give torch's
    states and outputs within rounding, on every kernel path this host has; a tree level's states (several at once)
    each get the bits they get alone, stepped and read."""
    from types import SimpleNamespace

    from models import kernels, recurrent
    from models import recurrent_kernels as rk
    from tests.models.test_kernel_paths import path_lib

    so = path_lib(path_name)
    hk, dk, hv, dv, conv = 2, 16, 4, 24, 40
    a = SimpleNamespace(gdn_k_heads=hk, gdn_k_dim=dk, gdn_v_heads=hv, gdn_v_dim=dv, gdn_conv_dim=conv, ssm_layers=())
    g = torch.Generator().manual_seed(3)
    states = torch.randn(5, hv, dk, dv, generator=g)
    rows = torch.randn(5, conv + hk * dk + hv * (dv + 2), generator=g)
    rows[:, -2 * hv : -hv] = torch.rand(5, hv, generator=g)  # e^g in (0, 1)
    q = torch.randn(5, 2 * hv * dk, generator=g)[:, hv * dk :].unflatten(-1, (hv, dk))  # rows apart, as the mixer's
    with kernels.using(so):
        stepped = recurrent.gdn_step(states, rows, a)
        alone = torch.stack([recurrent.gdn_step(states[i], rows[i], a) for i in range(5)])
        read = rk.gdn_read(stepped, q, hv)
        read_alone = torch.cat([rk.gdn_read(stepped[i : i + 1], q[i : i + 1], hv) for i in range(5)])
    assert torch.equal(stepped, alone) and torch.equal(read, read_alone)
    monkeypatch.setattr(rk, "gdn_on", lambda *_: False)
    assert torch.allclose(stepped, recurrent.gdn_step(states, rows, a), rtol=1e-5, atol=1e-5)  # torch's own ops
    assert torch.allclose(read, (stepped * q.unsqueeze(-1)).sum(-2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path_name", [p.name for p in PATHS])
def test_a_convolution_over_a_tree_s_taps_in_one_pass_gives_torch_s_bits_on_every_path(monkeypatch, path_name):
    """The CPU kernels' causal depthwise convolution (csrc/ops.cpp `cad_conv_mix`) gives torch's separate ops' bits,
    taps before the context (-1) included, over rows of a wider buffer, wide enough to run on several threads."""
    from models import kernels, recurrent
    from models import recurrent_kernels as rk
    from tests.models.test_kernel_paths import path_lib

    so = path_lib(path_name)
    g = torch.Generator().manual_seed(4)
    for T, C in ((1, 40), (9, 8200)):
        rows = torch.randn(20, C + 12, generator=g)[:, 5 : 5 + C]  # rows apart, as a layer's rows are
        weight = torch.randn(C, 4, generator=g)
        slots = torch.randint(-1, 20, (T, 4), generator=g) + 30  # base 30: slots 29 (before the rows: -1 here) .. 49
        slots[slots == 29] = -1
        with kernels.using(so):
            got = recurrent.conv_mix(rows, 30, slots, weight)
        with monkeypatch.context() as m:
            m.setattr(rk, "conv_on", lambda *_: False)
            assert torch.equal(got, recurrent.conv_mix(rows, 30, slots, weight))


def test_the_delta_net_s_work_around_its_state_in_the_cpu_kernels_is_torch_s_within_rounding():
    """`cad_gdn_front` (SiLU, L2 norms, decays, betas: the rows a state steps from) and `cad_gdn_back` (the gated
    RMS norm) against the same steps in torch ops, over rows of a wider projection as the mixer's are."""
    from types import SimpleNamespace

    from models import kernels, recurrent
    from models import recurrent_kernels as rk

    if not kernels.available():
        pytest.skip("no kernel library here (no C++ compiler)")
    hk, dk, hv, dv, T = 2, 16, 4, 8, 3
    C = 2 * hk * dk + hv * dv
    a = SimpleNamespace(gdn_k_heads=hk, gdn_k_dim=dk, gdn_v_heads=hv, gdn_v_dim=dv, gdn_beta_scale=2.0)
    g = torch.Generator().manual_seed(6)
    w = SimpleNamespace(gdn_a=torch.randn(hv, generator=g), gdn_dt=torch.randn(hv, generator=g))
    conv, proj = torch.randn(T, C, generator=g) * 3, torch.randn(T, hv * dv + 2 * hv + 5, generator=g) * 3
    z, b, araw = proj[:, : hv * dv], proj[:, hv * dv : hv * dv + hv], proj[:, hv * dv + hv : hv * dv + 2 * hv]
    rows = [torch.zeros(T, 7 + hk * dk + hv * (dv + 2)) for _ in range(2)]
    got = rk.gdn_front(a, w, conv, b, araw, rows[0][:, 7:])
    want = recurrent._front(a, w, conv, b, araw, rows[1][:, 7:])
    for x, y in zip((*got, rows[0]), (*want, rows[1])):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)
    o, weight, out = torch.randn(T, hv, dv, generator=g), torch.randn(dv, generator=g), torch.empty(T, hv * dv)
    kernels.lib().cad_gdn_back(
        o.data_ptr(), z.data_ptr(), z.stride(0), weight.data_ptr(), T, hv, dv, 1e-6, out.data_ptr(), 1
    )
    by_torch = recurrent._rms(o, 1e-6) * weight * torch.nn.functional.silu(z.reshape(T, hv, dv))
    assert torch.allclose(out, by_torch.reshape(T, -1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm", ["gated", "none", "before"])
def test_mamba2_s_work_around_its_state_in_the_cpu_kernels_is_torch_s_within_rounding(norm):
    """`cad_ssm_front` (SiLU with the convolution's bias, dt and exp(dt A): the rows a state steps from, and C) and
    `cad_ssm_back` (y = ys + D x, normed and gated in each of `ModelArgs.ssm_norm`'s orders) against torch's ops."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from models import kernels, recurrent
    from models import recurrent_kernels as rk

    if not kernels.available():
        pytest.skip("no kernel library here (no C++ compiler)")
    H, P, N, G, T = 4, 8, 16, 2, 3
    inner, GN = H * P, G * N
    a = SimpleNamespace(ssm_heads=H, ssm_head_dim=P, ssm_state=N, ssm_groups=G, ssm_inner=inner, ssm_norm=norm)
    a.norm_eps = 1e-5
    g = torch.Generator().manual_seed(8)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    w = SimpleNamespace(ssm_conv_b=r(inner + 2 * GN), ssm_dt=r(H), ssm_a=r(H), ssm_d=r(H), ssm_norm=r(inner))
    conv, proj = r(T, inner + 2 * GN) * 3, r(T, inner + H + 3) * 3
    z, dt_raw = proj[:, :inner], proj[:, inner : inner + H]
    rows = torch.zeros(T, 5 + inner + GN + 2 * H)
    c = rk.ssm_front(a, w, conv, dt_raw, rows[:, 5:])
    xbc = F.silu(conv + w.ssm_conv_b)
    dt = F.softplus(dt_raw + w.ssm_dt)
    want = torch.cat([xbc[:, : inner + GN], dt, torch.exp(dt * -w.ssm_a.exp())], dim=-1)
    assert torch.allclose(rows[:, 5:], want, rtol=1e-5, atol=1e-6)
    assert torch.allclose(c, xbc[:, inner + GN :], rtol=1e-5, atol=1e-6)
    ys, xs = r(T, H, P), rows[:, 5 : 5 + inner]
    got = rk.ssm_back(a, w, ys, xs, z)
    assert torch.allclose(got, recurrent._ssm_out(a, w, ys, xs, z), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path_name", [p.name for p in PATHS])
def test_a_chain_s_rows_scanned_in_one_call_get_the_bits_of_a_row_at_a_time_on_every_path(path_name):
    """`cad_ssm_scan` and `cad_gdn_scan` (a prompt's rows, a chain's: one call a layer) give each row's output and the
    last state bit for bit as T steps and reads one row at a time do (a decode step's, a tree level's)."""
    from models import kernels
    from models import recurrent_kernels as rk
    from tests.models.test_kernel_paths import path_lib

    so = path_lib(path_name)
    g = torch.Generator().manual_seed(9)
    T, H, P, N, G, conv = 6, 4, 8, 32, 2, 10
    rows = torch.randn(T + 2, conv + H * P + G * N + 2 * H, generator=g)[1 : T + 1]  # rows of a layer's buffer
    c, state = torch.randn(T, G * N, generator=g), torch.randn(H, P, N, generator=g)
    offsets = (conv, conv + H * P, conv + H * P + G * N, conv + H * P + G * N + H)
    hk, dk, hv, dv = 2, 16, 4, 8
    grows = torch.randn(T, conv + hk * dk + hv * (dv + 2), generator=g)
    q, gstate = torch.randn(T, hk, dk, generator=g), torch.randn(hv, dk, dv, generator=g)
    goffsets = (conv, conv + hk * dk, conv + hk * dk + hv * dv, conv + hk * dk + hv * (dv + 1))
    with kernels.using(so):
        ys, end = rk.ssm_scan(state, rows, c, (H, P, N, G), offsets)
        o, gend = rk.gdn_scan(gstate, grows, q, (hv, dk, dv, hk), goffsets)
        s, gs = state.unsqueeze(0), gstate.unsqueeze(0)
        for t in range(T):
            s = rk.ssm_step(s, rows[t : t + 1].contiguous(), (H, P, N, G), offsets)
            assert torch.equal(ys[t], rk.ssm_read(s, c[t : t + 1], (H, P, N, G))[0])
            gs = rk.gdn_step(gs, grows[t : t + 1], (hv, dk, dv, hk), goffsets)
            assert torch.equal(o[t], rk.gdn_read(gs, q[t : t + 1], hk)[0])
    assert torch.equal(end, s[0]) and torch.equal(gend, gs[0])


def test_a_mamba2_branch_in_one_call_gets_the_bits_of_its_separate_calls(model):
    """`cad_ssm_layer` (a chain's rows: a prompt's, a decode step's) gives the logits and the states of the branch's
    separate calls (models/recurrent.py `mamba2`), bit for bit."""
    if model.args.rec_kind != "ssm":
        pytest.skip("Mamba-2 layers only")
    layers = [model.weights.layer(i) for i in model.args.rec_layers]
    assert all(rk.ssm_record(w, model.args) is not None for w in layers)  # the one call is taken
    tokens = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(10))
    runs = []
    for one_call in (True, False):
        for w in layers:
            w.ssm_record = None if one_call else torch.empty(0, dtype=torch.int64)
        cache = model.new_cache(32)
        out = [model.forward(tokens[:8], torch.arange(8), cache)]
        for t in range(8, 12):
            cache.commit()
            out.append(model.forward(tokens[t : t + 1], torch.tensor([t]), cache))
        runs.append((out, [cache.chains[cache.rec[j].data_ptr()][2] for j in range(len(layers))]))
    for w in layers:
        w.ssm_record = None
    (a, sa), (b, sb) = runs
    assert all(torch.equal(x, y) for x, y in zip(a + sa, b + sb))
