"""Tiny models of each architecture beyond llama/qwen2, written as real files: an HF directory (config.json
as transformers writes it, per-expert tensors as published checkpoints name them) and a GGUF (llama.cpp's
tensor names and fields), both from one set of canonical tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models.args import ModelArgs
from tests.models.tiny_files import _llama_permute, add_tokenizer, tensor_adder, tokenizer_fields

_BASE = dict(
    vocab_size=320,
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    norm_eps=1e-6,
    rope_base=10000.0,
    context_length=256,
    tied_embeddings=False,
    head_dim=16,
)
ARCHS = {
    "qwen3": ModelArgs(arch="qwen3", ffn_dim=96, qkv_bias=False, qk_norm="head", **_BASE),
    "qwen2_moe": ModelArgs(
        arch="qwen2_moe",
        ffn_dim=96,
        qkv_bias=True,
        n_experts=8,
        n_experts_used=2,
        expert_ffn_dim=32,
        shared_ffn_dim=64,
        norm_topk=False,
        **_BASE,
    ),
    "qwen3_moe": ModelArgs(
        arch="qwen3_moe",
        ffn_dim=96,
        qkv_bias=False,
        qk_norm="head",
        n_experts=8,
        n_experts_used=2,
        expert_ffn_dim=32,
        norm_topk=True,
        **_BASE,
    ),
    "olmoe": ModelArgs(
        arch="olmoe",
        ffn_dim=32,
        qkv_bias=False,
        qk_norm="full",
        n_experts=8,
        n_experts_used=3,
        expert_ffn_dim=32,
        norm_topk=False,
        **_BASE,
    ),
    "mixtral": ModelArgs(
        arch="mixtral",
        ffn_dim=32,
        qkv_bias=False,
        n_experts=4,
        n_experts_used=2,
        expert_ffn_dim=32,
        norm_topk=True,
        **_BASE,
    ),
}
GGUF_ARCH = {"qwen3": "qwen3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "mixtral": "llama"}


def hf_config(a: ModelArgs) -> dict:
    cfg = {
        "model_type": a.arch,
        "vocab_size": a.vocab_size,
        "hidden_size": a.dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "intermediate_size": a.ffn_dim,
        "head_dim": a.head_dim,
        "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_base,
        "max_position_embeddings": a.context_length,
        "tie_word_embeddings": a.tied_embeddings,
        "hidden_act": "silu",
        "attention_bias": a.qkv_bias,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": None,
    }
    if a.arch == "mixtral":
        cfg.update(
            num_local_experts=a.n_experts, num_experts_per_tok=a.n_experts_used, intermediate_size=a.expert_ffn_dim
        )
    elif a.moe:
        cfg.update(
            num_experts=a.n_experts,
            num_experts_per_tok=a.n_experts_used,
            norm_topk_prob=a.norm_topk,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        if a.arch == "olmoe":
            cfg["intermediate_size"] = a.expert_ffn_dim
        else:
            cfg["moe_intermediate_size"] = a.expert_ffn_dim
        if a.arch == "qwen2_moe":
            cfg.update(shared_expert_intermediate_size=a.shared_ffn_dim, qkv_bias=a.qkv_bias)
    arch_cls = {
        "qwen3": "Qwen3",
        "qwen2_moe": "Qwen2Moe",
        "qwen3_moe": "Qwen3Moe",
        "olmoe": "Olmoe",
        "mixtral": "Mixtral",
    }
    cfg["architectures"] = [arch_cls[a.arch] + "ForCausalLM"]
    return cfg


def hf_state_dict(a: ModelArgs, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd = {"model.embed_tokens.weight": t["embed"], "model.norm.weight": t["out_norm"], "lm_head.weight": t["head"]}
    moe = "block_sparse_moe" if a.arch == "mixtral" else "mlp"
    names = (
        {"gate": "w1", "up": "w3", "down": "w2"}
        if a.arch == "mixtral"
        else {k: f"{k}_proj" for k in ("gate", "up", "down")}
    )
    for i in range(a.n_layers):
        b, p = f"blk.{i}", f"model.layers.{i}"
        for x, w in zip("qkv", t[f"{b}.attn_qkv"].split([a.q_dim, a.kv_dim, a.kv_dim])):
            sd[f"{p}.self_attn.{x}_proj.weight"] = w
        if a.qkv_bias:
            for x, w in zip("qkv", t[f"{b}.attn_qkv_bias"].split([a.q_dim, a.kv_dim, a.kv_dim])):
                sd[f"{p}.self_attn.{x}_proj.bias"] = w
        if a.qk_norm:
            sd[f"{p}.self_attn.q_norm.weight"], sd[f"{p}.self_attn.k_norm.weight"] = (
                t[f"{b}.attn_q_norm"],
                t[f"{b}.attn_k_norm"],
            )
        sd.update(
            {
                f"{p}.self_attn.o_proj.weight": t[f"{b}.attn_out"],
                f"{p}.input_layernorm.weight": t[f"{b}.attn_norm"],
                f"{p}.post_attention_layernorm.weight": t[f"{b}.ffn_norm"],
            }
        )
        if not a.moe:
            gate, up = t[f"{b}.ffn_gate_up"].chunk(2)
            sd.update(
                {
                    f"{p}.mlp.gate_proj.weight": gate,
                    f"{p}.mlp.up_proj.weight": up,
                    f"{p}.mlp.down_proj.weight": t[f"{b}.ffn_down"],
                }
            )
            continue
        sd[f"{p}.{moe}.gate.weight"] = t[f"{b}.ffn_router"]
        for e in range(a.n_experts):
            gate, up = t[f"{b}.exp.{e}.gate_up"].chunk(2)
            x = f"{p}.{moe}.experts.{e}"
            sd.update(
                {
                    f"{x}.{names['gate']}.weight": gate,
                    f"{x}.{names['up']}.weight": up,
                    f"{x}.{names['down']}.weight": t[f"{b}.exp.{e}.down"],
                }
            )
        if a.shared_ffn_dim:
            gate, up = t[f"{b}.ffn_shexp_gate_up"].chunk(2)
            sd.update(
                {
                    f"{p}.mlp.shared_expert.gate_proj.weight": gate,
                    f"{p}.mlp.shared_expert.up_proj.weight": up,
                    f"{p}.mlp.shared_expert.down_proj.weight": t[f"{b}.ffn_shexp_down"],
                    f"{p}.mlp.shared_expert_gate.weight": t[f"{b}.ffn_shexp_gate"],
                }
            )
    return sd


def write_hf(path: Path, a: ModelArgs, t: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    from text.tokenizer import tokenizer_from_gguf_fields

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(a)))
    save_file({k: v.float().contiguous() for k, v in hf_state_dict(a, t).items()}, str(path / "model.safetensors"))
    toks, types, merges = tokenizer_fields(a.vocab_size)
    (path / "tokenizer.json").write_text(tokenizer_from_gguf_fields(toks, types, merges, "qwen2").to_str())
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": "{{ messages[0]['content'] }}"})
    )
    return path


def write_gguf(path: Path, a: ModelArgs, t: dict[str, torch.Tensor], qtype: str = "F32") -> Path:
    """llama.cpp's layout: experts as [experts, out, in] tensors (ffn_*_exps), the shared expert's gate a vector."""
    import gguf

    arch = GGUF_ARCH[a.arch]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(a.n_layers)
    w.add_context_length(a.context_length)
    w.add_embedding_length(a.dim)
    w.add_feed_forward_length(a.ffn_dim)
    w.add_head_count(a.n_heads)
    w.add_head_count_kv(a.n_kv_heads)
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
    w.add_rope_freq_base(a.rope_base)
    w.add_layer_norm_rms_eps(a.norm_eps)
    if a.moe:
        w.add_expert_count(a.n_experts)
        w.add_expert_used_count(a.n_experts_used)
        if arch in ("qwen2moe", "qwen3moe"):
            w.add_expert_feed_forward_length(a.expert_ffn_dim)
        if a.shared_ffn_dim:
            w.add_expert_shared_feed_forward_length(a.shared_ffn_dim)
    add_tokenizer(w, a.vocab_size)

    put = tensor_adder(w, qtype)  # routers stay F32 (quant=False), as llama.cpp keeps them
    put("token_embd.weight", t["embed"])
    for i in range(a.n_layers):
        b = f"blk.{i}"
        wq, wk, wv = (x.numpy() for x in t[f"{b}.attn_qkv"].split([a.q_dim, a.kv_dim, a.kv_dim]))
        if arch == "llama":
            wq, wk = _llama_permute(wq, a.n_heads), _llama_permute(wk, a.n_kv_heads)
        put(f"{b}.attn_norm.weight", t[f"{b}.attn_norm"])
        put(f"{b}.attn_q.weight", wq)
        put(f"{b}.attn_k.weight", wk)
        put(f"{b}.attn_v.weight", wv)
        if a.qkv_bias:
            for n, x in zip("qkv", t[f"{b}.attn_qkv_bias"].split([a.q_dim, a.kv_dim, a.kv_dim])):
                put(f"{b}.attn_{n}.bias", x)
        if a.qk_norm:
            put(f"{b}.attn_q_norm.weight", t[f"{b}.attn_q_norm"])
            put(f"{b}.attn_k_norm.weight", t[f"{b}.attn_k_norm"])
        put(f"{b}.attn_output.weight", t[f"{b}.attn_out"])
        put(f"{b}.ffn_norm.weight", t[f"{b}.ffn_norm"])
        if not a.moe:
            gate, up = t[f"{b}.ffn_gate_up"].chunk(2)
            put(f"{b}.ffn_gate.weight", gate)
            put(f"{b}.ffn_up.weight", up)
            put(f"{b}.ffn_down.weight", t[f"{b}.ffn_down"])
            continue
        put(f"{b}.ffn_gate_inp.weight", t[f"{b}.ffn_router"], quant=False)
        gu = torch.stack([t[f"{b}.exp.{e}.gate_up"] for e in range(a.n_experts)])
        put(f"{b}.ffn_gate_exps.weight", gu[:, : a.expert_ffn_dim])
        put(f"{b}.ffn_up_exps.weight", gu[:, a.expert_ffn_dim :])
        put(f"{b}.ffn_down_exps.weight", torch.stack([t[f"{b}.exp.{e}.down"] for e in range(a.n_experts)]))
        if a.shared_ffn_dim:
            gate, up = t[f"{b}.ffn_shexp_gate_up"].chunk(2)
            put(f"{b}.ffn_gate_inp_shexp.weight", t[f"{b}.ffn_shexp_gate"].reshape(a.dim), quant=False)
            put(f"{b}.ffn_gate_shexp.weight", gate)
            put(f"{b}.ffn_up_shexp.weight", up)
            put(f"{b}.ffn_down_shexp.weight", t[f"{b}.ffn_shexp_down"])
    put("output_norm.weight", t["out_norm"])
    put("output.weight", t["head"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
