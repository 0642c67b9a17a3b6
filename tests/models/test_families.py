"""The families users bring (Llama 3.x, Mistral, Gemma 2 and 3, Phi-3/4, Granite, OLMo 2 and 3, Qwen 2 and 3, SmolLM3,
Seed-OSS, EXAONE 4, GLM-4, Ministral 3), each a
tiny random model built by transformers itself, read from its HF directory in both config spellings and from the
GGUF llama.cpp's converter would write: the same model, HF's greedy tokens in fp32, and a file holding a tensor or
a field cadence does not use refused in one sentence naming it."""

import json

import numpy as np
import pytest
import torch

from common.errors import CadenceError
from formats.convert import convert
from formats.source import GGUFSource
from formats.source_hf import HFSource
from formats.store import WeightStore
from models.transformer import Transformer
from formats.weights import ResidentWeights
from tests.models.families import PROMPT, VARIANTS, causal_lm, tiny_hf, write_gguf_like_llama_cpp

CASES = [(mt, v) for mt, vs in VARIANTS.items() for v in vs]
N_NEW = 16
# llama.cpp's converter writes no window for these (llama.cpp runs them without one): their GGUF is another model
NO_WINDOW_IN_GGUF = {("mistral", "sliding"), ("qwen2", "sliding")}
NO_SCALE_IN_GGUF = {("lfm2_moe", "plain")}  # ... nor LFM2-MoE's routed_scaling_factor (its "unscaled" variant: 1)
NO_TEMP_IN_GGUF = {("mistral4", "plain")}  # ... nor Mistral 4's llama_4_scaling_beta (its "untempered" variant: 0)
# ... nor Llama 4's chunk size or temperature floor: llama.cpp fixes both at 8192 (its "released" variant's)
LLAMA4_FIXED = {"chunk_size": 8192, "attn_temp_scale": 8192.0}
NO_CHUNK_IN_GGUF = {("llama4_text", "plain")}
# llama.cpp's Mamba-2 layer norms after the gate only: a norm-before-gate Falcon-H1's GGUF is another model
NORM_AFTER_GATE_IN_GGUF = {("falcon_h1", "normed")}
# llama.cpp's converter folds Falcon-H1's embedding and head multipliers into those tensors too (no key holds them),
# and every other multiplier in float32 as the HF reader folds them in float64
MUP_FOLDED_IN_GGUF = {"falcon_h1"}
# ... nor a Gemma 4 cap of the logits where the config has none: llama.cpp caps those at 30 (a GGUF of a released
# Gemma 4 writes 30): the GGUF is the HF model capped
CAPPED_IN_GGUF = {("gemma4_text", "ple"), ("gemma4_text", "moe")}
NO_GGUF = {"olmo_hybrid"}  # llama.cpp has no architecture for it: read from an HF directory only


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(model_type, variant) -> (HF dir as transformers 5 wrote it, as 4 did, the GGUF, HF's model), built once."""
    cache = {}

    def get(mt: str, v: str):
        if (mt, v) not in cache:
            d = tmp_path_factory.mktemp(f"{mt}-{v}")
            d5, d4 = tiny_hf(mt, v, d / "s5", 5), tiny_hf(mt, v, d / "s4", 4)
            gguf = write_gguf_like_llama_cpp(d5, d / "m.gguf") if mt not in NO_GGUF else None
            hf = causal_lm(mt).from_pretrained(d5, dtype=torch.float32, attn_implementation="eager").eval()
            cache[mt, v] = (d5, d4, gguf, hf)
        return cache[mt, v]

    return get


def prompt_ids(folder) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PROMPT).ids


def ours(src, out, fmt="fp32") -> Transformer:
    st = WeightStore(convert(src, out, fmt))
    return Transformer(st.args, ResidentWeights(st))


def greedy_like_hf(model: Transformer, hf, ids: list[int], n: int) -> None:
    """Our greedy tokens (one cached forward a token) are HF's (the whole sequence each step): identical, or they
    part only where HF's own top two are within float noise of each other (a near tie), never otherwise."""
    cache = model.new_cache(len(ids) + n)
    logits = model.forward(torch.tensor(ids), torch.arange(len(ids)), cache)[-1]
    cache.commit()
    seq = list(ids)
    for step in range(n):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0, -1]
        mine, top = int(logits.argmax()), ref.topk(2)
        if mine != int(top.indices[0]):
            margin = float(top.values[0] - top.values[1])
            assert margin < 1e-4 * max(1.0, float(top.values[0].abs())), (step, mine, top.indices.tolist(), margin)
            return
        seq.append(mine)
        logits = model.forward(torch.tensor([mine]), torch.tensor([len(seq) - 1]), cache)[0]
        cache.commit()


@pytest.mark.parametrize("mt,v", CASES)
def test_both_spellings_and_the_gguf_read_the_same_model(built, mt, v):
    d5, d4, gguf, _ = built(mt, v)
    h5, h4 = HFSource(d5), HFSource(d4)
    assert h5.args == h4.args
    a = h5.args
    if gguf is None:
        return
    g = GGUFSource(gguf)
    if a.sliding_layers:
        assert 0 < a.sliding_window < a.context_length and len(a.sliding_layers) < a.n_layers or mt == "mistral"
    expect = a
    if (mt, v) in NO_WINDOW_IN_GGUF:
        expect = type(a)(**{**a.to_dict(), "sliding_window": 0, "sliding_layers": ()})
    if (mt, v) in NO_SCALE_IN_GGUF:
        expect = type(a)(**{**expect.to_dict(), "routed_scale": 1.0})
    if (mt, v) in NO_TEMP_IN_GGUF:
        expect = type(a)(**{**expect.to_dict(), "attn_temp_beta": 0.0, "attn_temp_scale": 1.0})
    if (mt, v) in NO_CHUNK_IN_GGUF:
        expect = type(a)(**{**expect.to_dict(), **LLAMA4_FIXED})
    if mt in ("granitemoehybrid", "nemotron_h"):  # GraniteHybridModel: a context of 2^20 for a model with no rope
        expect = type(a)(**{**expect.to_dict(), "context_length": 2**20})
    if (mt, v) in NORM_AFTER_GATE_IN_GGUF:
        expect = type(a)(**{**expect.to_dict(), "ssm_norm": "gated"})
    if mt in MUP_FOLDED_IN_GGUF:
        expect = type(a)(**{**expect.to_dict(), "embed_scale": 1.0, "logits_div": 1.0})
    if (mt, v) in CAPPED_IN_GGUF:
        expect = type(a)(**{**expect.to_dict(), "final_softcap": 30.0})
    differ = {k for k, x in a.to_dict().items() if g.args.to_dict()[k] != expect.to_dict()[k]}
    if mt == "mistral":  # llama.cpp writes Mistral as a Llama: the same block
        assert g.args.arch == "llama"
        differ.discard("arch")
    # a GGUF spells LongRoPE's factor as its attention factor, Llama 3's scaling as per-frequency divisors, and
    # keeps the norms' epsilon and the queries' temperature as float32
    assert differ <= {"rope_scaling", "norm_eps", "attn_temp_beta"}, differ
    assert g.args.norm_eps == pytest.approx(a.norm_eps, rel=1e-6)
    assert g.args.attn_temp_beta == pytest.approx(expect.attn_temp_beta, rel=1e-6)
    folded = {"embed": a.embed_scale, "head": 1 / a.logits_div} if mt in MUP_FOLDED_IN_GGUF else {}
    for _, name in _names(a):  # every tensor: the same bits; a norm within float32 of the +1 the converter adds, a
        # delta-net's or a Mamba's A_log of its -exp(A_log), a muP-folded one within float32's rounding
        if name.endswith(("norm", "gdn_a", "ssm_a")):
            assert np.allclose(h5.get(name), g.get(name), rtol=0, atol=1e-6), name
        elif mt in MUP_FOLDED_IN_GGUF:
            assert np.allclose(h5.get(name) * folded.get(name, 1.0), g.get(name), rtol=1e-6, atol=1e-9), name
        else:
            assert np.array_equal(h5.get(name), g.get(name)), name


def _names(args):
    from formats.source import canonical_names

    return canonical_names(args)


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("mt,v", CASES)
def test_fp32_logits_and_greedy_tokens_are_transformers_own(built, tmp_path, mt, v, source):
    d5, _, gguf, hf = built(mt, v)
    if source == "gguf" and mt in NO_GGUF:
        pytest.skip("llama.cpp has no architecture for this family: no GGUF of it exists")
    if source == "gguf" and (mt, v) in NO_WINDOW_IN_GGUF:
        pytest.skip("llama.cpp's converter writes no sliding window for this family: another model than HF's")
    if source == "gguf" and (mt, v) in NO_SCALE_IN_GGUF:
        pytest.skip("llama.cpp's converter writes no routed scale for this family: another model than HF's")
    if source == "gguf" and (mt, v) in NORM_AFTER_GATE_IN_GGUF:
        pytest.skip("llama.cpp runs a Mamba-2 norm after the gate only: another model than HF's")
    if source == "gguf" and (mt, v) in NO_TEMP_IN_GGUF:
        pytest.skip("llama.cpp's converter writes no position scaling of the queries: another model than HF's")
    if source == "gguf" and (mt, v) in NO_CHUNK_IN_GGUF:
        pytest.skip("llama.cpp runs every Llama 4 GGUF with chunks of 8192: another model than HF's")
    src = HFSource(d5) if source == "hf" else GGUFSource(gguf)
    if source == "gguf" and (mt, v) in CAPPED_IN_GGUF:
        hf = causal_lm(mt).from_pretrained(
            d5, dtype=torch.float32, attn_implementation="eager", final_logit_softcapping=30.0
        )
        hf = hf.eval()
    model = ours(src, tmp_path / "store")
    ids = prompt_ids(d5)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = model.forward(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids)))
    assert float((got - ref).abs().max()) < 1e-4 * max(1.0, float(ref.abs().max())), float((got - ref).abs().max())
    greedy_like_hf(model, hf, ids, N_NEW)


def _rewrite_config(folder, **changes):
    p = folder / "config.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), **changes}))


def test_a_config_field_cadence_does_not_use_is_refused_naming_it(built, tmp_path):
    import shutil

    d = shutil.copytree(built("llama", "plain")[0], tmp_path / "m")
    _rewrite_config(d, attn_temperature_tuning=True)
    with pytest.raises(CadenceError, match="config field 'attn_temperature_tuning'"):
        HFSource(d)
    _rewrite_config(d, attn_temperature_tuning=None)
    with pytest.raises(CadenceError, match="config field 'attn_temperature_tuning'"):  # even set to null
        HFSource(d)
    config = json.loads((d / "config.json").read_text())
    del config["attn_temperature_tuning"]
    (d / "config.json").write_text(json.dumps({**config, "mlp_bias": True}))
    with pytest.raises(CadenceError, match="mlp_bias: true .* is not something cadence runs in a llama model"):
        HFSource(d)
    _rewrite_config(d, mlp_bias=False, model_type="gemma5_text")
    with pytest.raises(CadenceError, match="model_type 'gemma5_text' is not supported"):
        HFSource(d)


def test_a_tensor_cadence_does_not_use_is_refused_naming_it(built, tmp_path):
    """An output projection bias (attention_bias on Llama) would be left out of the sum: refused, from either file."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = shutil.copytree(built("llama", "plain")[0], tmp_path / "m")
    t = load_file(d / "model.safetensors")
    t["model.layers.0.self_attn.o_proj.bias"] = torch.ones(64)
    save_file(t, d / "model.safetensors")
    with pytest.raises(CadenceError, match="tensor 'model.layers.0.self_attn.o_proj.bias'"):
        HFSource(d)
    gguf = _with_extra(built("gemma3_text", "plain")[2], tmp_path / "x.gguf", tensor="blk.0.attn_output.bias")
    with pytest.raises(CadenceError, match="tensor 'blk.0.attn_output.bias'"):
        GGUFSource(gguf)
    gguf = _with_extra(built("gemma3_text", "plain")[2], tmp_path / "y.gguf", key="gemma3.attention.temperature")
    with pytest.raises(CadenceError, match="key 'gemma3.attention.temperature'"):
        GGUFSource(gguf)


def test_a_gguf_part_cadence_does_not_run_is_refused_naming_it(built, tmp_path):
    """A family's reader that meets a part it does not run says so (not "a damaged file")."""
    src = built("lfm2_moe", "unscaled")[2]
    gguf = _with_extra(src, tmp_path / "softmax.gguf", changed={"lfm2moe.expert_gating_func": 1})
    with pytest.raises(CadenceError, match="expert_gating_func 1 .* is not something cadence runs") as e:
        GGUFSource(gguf)
    assert "damaged" not in str(e.value) and "\n" not in str(e.value)


def _with_extra(src, out, tensor: str | None = None, key: str | None = None, changed: dict | None = None):
    """A copy of a GGUF file with one more tensor or key, or keys `changed` to other values."""
    import gguf

    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(out), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(name, f.contents())
        else:
            w.add_key_value(name, (changed or {}).get(name, f.contents()), vt)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    if tensor:
        w.add_tensor(tensor, np.ones(64, dtype=np.float32))
    if key:
        w.add_float32(key, 1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize(
    "mt,v",
    [
        *[
            (mt, "plain")
            for mt in (
                "lfm2",
                "qwen3_5_text",
                "granitemoehybrid",
                "nemotron_h",
                "gpt_oss",
                "llama4_text",
                "exaone4",
                "glm4_moe",
                "falcon_h1",
                "mistral4",
            )
        ],
        *[("gemma4_text", v) for v in ("plain", "ple", "moe")],
    ],
)
def test_the_torch_ops_path_is_transformers_own_too(built, tmp_path, mt, v):
    """The layer in torch ops (models/torch_block.py: devices other than the CPU) on the 2026 families' new parts:
    recurrent layers, sinks, chunks, L2 and biased q/k norms, relu^2, experts."""
    d5, _, _, hf = built(mt, v)
    model = ours(HFSource(d5), tmp_path / "store")
    model.fused = model.layer_calls = False
    ids = prompt_ids(d5)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = model.forward(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids)))
    assert float((got - ref).abs().max()) < 1e-3 * max(1.0, float(ref.abs().max())), float((got - ref).abs().max())


def test_gpt_oss_experts_in_mxfp4_blocks_are_read_an_expert_at_a_time(built, tmp_path):
    """The released gpt-oss GGUFs keep the experts in MXFP4 (llama.cpp repacks the checkpoint's blocks): each
    expert read from its rows of the blocks is that expert's part of the whole tensor dequantized, and the model
    runs from them close to the float file (within MXFP4's rounding)."""
    import gguf

    src = built("gpt_oss", "plain")[2]
    r = gguf.GGUFReader(src)
    out = tmp_path / "mxfp4.gguf"
    w = gguf.GGUFWriter(str(out), r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vt = f.types[0]
        w.add_array(name, f.contents()) if vt == gguf.GGUFValueType.ARRAY else w.add_key_value(name, f.contents(), vt)
    mx = gguf.GGMLQuantizationType.MXFP4
    for t in r.tensors:
        data = np.array(t.data)
        if t.name.endswith("_exps.weight"):
            w.add_tensor(t.name, gguf.quants.quantize(data, mx), raw_dtype=mx)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g, f32 = GGUFSource(out), GGUFSource(src)
    whole = gguf.quants.dequantize(
        gguf.quants.quantize(np.array(next(t.data for t in r.tensors if t.name == "blk.1.ffn_up_exps.weight")), mx), mx
    )
    n = g.args.expert_ffn_dim
    for e in range(g.args.n_experts):
        assert np.array_equal(g.get(f"blk.1.exp.{e}.gate_up")[n:], whole[e])
    ids = prompt_ids(built("gpt_oss", "plain")[0])
    a, b = ours(g, tmp_path / "s1"), ours(f32, tmp_path / "s2")
    la = a.forward(torch.tensor(ids), torch.arange(len(ids)), a.new_cache(len(ids)))
    lb = b.forward(torch.tensor(ids), torch.arange(len(ids)), b.new_cache(len(ids)))
    corr = torch.nn.functional.cosine_similarity(la.flatten(), lb.flatten(), dim=0)
    assert 0.9 < float(corr) < 1.0  # the same model, rounded (random weights lose more to MXFP4 than trained ones)


def test_glm45s_prediction_layer_rides_in_its_gguf_and_is_left_aside(built, tmp_path):
    """GLM-4.5's checkpoints hold a multi-token prediction layer after the last (`model.layers.<n>`: a whole layer
    and its own eh_proj, enorm, hnorm and shared_head norm); llama.cpp's converter keeps it as one more block
    (`block_count` n + 1, `nextn_predict_layers` 1, `blk.<n>.nextn.*`). Both files read as the model without it."""
    import shutil

    from safetensors.torch import load_file, save_file

    d5, _, plain, _ = built("glm4_moe", "plain")
    d = shutil.copytree(d5, tmp_path / "mtp")
    t = load_file(d / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    last = [k for k in t if k.startswith("model.layers.2.")]
    mtp = {k.replace("layers.2.", "layers.3."): torch.randn(t[k].shape, generator=gen) for k in last}
    mtp |= {f"model.layers.3.{k}.weight": torch.ones(64) for k in ("enorm", "hnorm", "shared_head.norm")}
    mtp["model.layers.3.eh_proj.weight"] = torch.randn(64, 128, generator=gen)
    save_file(t | mtp, d / "model.safetensors")
    g, g0 = GGUFSource(write_gguf_like_llama_cpp(d, tmp_path / "mtp.gguf")), GGUFSource(plain)
    assert {"blk.3.nextn.eh_proj.weight", "blk.3.ffn_gate_exps.weight"} <= set(g.tensors)
    assert g.file.fields["glm4moe.block_count"] == 4 and g.args == g0.args and g.args.n_layers == 3
    assert HFSource(d).args == HFSource(d5).args
    for _, name in _names(g.args):
        assert np.array_equal(g.get(name), g0.get(name)), name
