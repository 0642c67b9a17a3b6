"""Real, tiny model files written by the tests: a GGUF (as llama.cpp lays it out) and an HF directory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from models.args import ModelArgs

BYTE_TOKENS = None


def byte_vocab() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, plus a few merges' results and specials."""
    from text.bytetable import byte_alphabet

    return [ch for _, ch in byte_alphabet()]


def tokenizer_fields(vocab_size: int):
    toks = byte_vocab()
    merges = ["Ġ t", "Ġ a", "i n", "h e"]
    toks += ["Ġt", "Ġa", "in", "he"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    toks += specials
    assert len(toks) <= vocab_size
    toks += [f"<unused{i}>" for i in range(vocab_size - len(toks))]
    types = [1] * len(toks)
    for s in specials:
        types[toks.index(s)] = 3
    return toks, types, merges


def tensor_adder(w, qtype: str):
    """put(name, x, quant=True): a tensor into a `gguf.GGUFWriter`, a weight (2-D or more) quantized to `qtype`."""
    import gguf

    q = getattr(gguf.GGMLQuantizationType, qtype)

    def put(name, x, quant=True):
        arr = np.ascontiguousarray(x.float().numpy() if isinstance(x, torch.Tensor) else x, dtype=np.float32)
        if quant and arr.ndim >= 2 and q != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(arr, q), raw_dtype=q)
        else:
            w.add_tensor(name, arr)

    return put


def add_tokenizer(w, vocab_size: int):
    """The tiny byte-level BPE tokenizer's fields, on a `gguf.GGUFWriter`."""
    toks, types, merges = tokenizer_fields(vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(toks.index("<|endoftext|>"))
    w.add_eos_token_id(toks.index("<|im_end|>"))


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (the inverse of what we undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, args: ModelArgs, t: dict[str, torch.Tensor], qtype: str = "F32", tokenizer=None) -> Path:
    """`tokenizer(w, vocab_size)` writes the tokenizer's fields (default: the tiny byte-level BPE's, `add_tokenizer`)."""
    import gguf

    w = gguf.GGUFWriter(str(path), args.arch)
    a = args.arch
    w.add_block_count(args.n_layers)
    w.add_context_length(args.context_length)
    w.add_embedding_length(args.dim)
    w.add_feed_forward_length(args.ffn_dim)
    w.add_head_count(args.n_heads)
    w.add_head_count_kv(args.n_kv_heads)
    w.add_rope_freq_base(args.rope_base)
    w.add_layer_norm_rms_eps(args.norm_eps)
    (tokenizer or add_tokenizer)(w, args.vocab_size)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    put = tensor_adder(w, qtype)
    put("token_embd.weight", t["embed"])
    for i in range(args.n_layers):
        b = f"blk.{i}"
        qkv = t[f"{b}.attn_qkv"].numpy()
        wq, wk, wv = np.split(qkv, [args.q_dim, args.q_dim + args.kv_dim])
        if a == "llama":
            wq, wk = _llama_permute(wq, args.n_heads), _llama_permute(wk, args.n_kv_heads)
        put(f"{b}.attn_norm.weight", t[f"{b}.attn_norm"])
        put(f"{b}.attn_q.weight", torch.from_numpy(np.ascontiguousarray(wq)))
        put(f"{b}.attn_k.weight", torch.from_numpy(np.ascontiguousarray(wk)))
        put(f"{b}.attn_v.weight", torch.from_numpy(np.ascontiguousarray(wv)))
        if args.qkv_bias:
            bq, bk, bv = np.split(t[f"{b}.attn_qkv_bias"].numpy(), [args.q_dim, args.q_dim + args.kv_dim])
            for n, x in (("q", bq), ("k", bk), ("v", bv)):
                put(f"{b}.attn_{n}.bias", torch.from_numpy(np.ascontiguousarray(x)))
        put(f"{b}.attn_output.weight", t[f"{b}.attn_out"])
        put(f"{b}.ffn_norm.weight", t[f"{b}.ffn_norm"])
        gate, up = t[f"{b}.ffn_gate_up"].chunk(2)
        put(f"{b}.ffn_gate.weight", gate)
        put(f"{b}.ffn_up.weight", up)
        put(f"{b}.ffn_down.weight", t[f"{b}.ffn_down"])
    put("output_norm.weight", t["out_norm"])
    if not args.tied_embeddings:
        put("output.weight", t["head"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_hf_dir(path: Path, args: ModelArgs, t: dict[str, torch.Tensor]) -> Path:
    """config.json + model.safetensors (bf16) + tokenizer.json, as transformers saves them."""
    from safetensors.torch import save_file

    from text.tokenizer import tokenizer_from_gguf_fields

    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "model_type": args.arch,
        "architectures": ["Qwen2ForCausalLM" if args.arch == "qwen2" else "LlamaForCausalLM"],
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "intermediate_size": args.ffn_dim,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_base,
        "max_position_embeddings": args.context_length,
        "tie_word_embeddings": args.tied_embeddings,
        "hidden_act": "silu",
        "attention_bias": args.qkv_bias,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(cfg))
    sd = {"model.embed_tokens.weight": t["embed"], "model.norm.weight": t["out_norm"]}
    if not args.tied_embeddings:
        sd["lm_head.weight"] = t["head"]
    for i in range(args.n_layers):
        b, p = f"blk.{i}", f"model.layers.{i}"
        wq, wk, wv = t[f"{b}.attn_qkv"].split([args.q_dim, args.kv_dim, args.kv_dim])
        sd.update(
            {
                f"{p}.self_attn.q_proj.weight": wq,
                f"{p}.self_attn.k_proj.weight": wk,
                f"{p}.self_attn.v_proj.weight": wv,
                f"{p}.self_attn.o_proj.weight": t[f"{b}.attn_out"],
                f"{p}.input_layernorm.weight": t[f"{b}.attn_norm"],
                f"{p}.post_attention_layernorm.weight": t[f"{b}.ffn_norm"],
                f"{p}.mlp.down_proj.weight": t[f"{b}.ffn_down"],
            }
        )
        gate, up = t[f"{b}.ffn_gate_up"].chunk(2)
        sd[f"{p}.mlp.gate_proj.weight"], sd[f"{p}.mlp.up_proj.weight"] = gate, up
        if args.qkv_bias:
            bq, bk, bv = t[f"{b}.attn_qkv_bias"].split([args.q_dim, args.kv_dim, args.kv_dim])
            sd.update(
                {f"{p}.self_attn.q_proj.bias": bq, f"{p}.self_attn.k_proj.bias": bk, f"{p}.self_attn.v_proj.bias": bv}
            )
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    toks, types, merges = tokenizer_fields(args.vocab_size)
    (path / "tokenizer.json").write_text(tokenizer_from_gguf_fields(toks, types, merges, "qwen2").to_str())
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": "{{ messages[0]['content'] }}"})
    )
    return path
