"""Random-weight models of each family at one common size, for the per-architecture speed benchmark.

No trained Llama 3, Mistral, Gemma 2, Phi-3, Granite or OLMo 2 can be had here, and a forward's speed depends on
the shapes, not on the weights. `write_family` builds the family's model with transformers itself (its own random
init), saves the HF directory, writes it as the GGUF llama.cpp's converter would (bench/hf_gguf.py, F32), and has
llama.cpp quantize that to Q4_K_M: the file a user of llama.cpp would hold. (F32, not the F16 a user would convert
to: bench/hf_gguf.py's F16 makes every 2-D weight F16, where the converter keeps the convolutions of the recurrent
families and the experts' routers F32; llama.cpp's quantizer leaves those as it finds them, and its CPU
convolution takes F32 alone. From F32 the Q4_K_M file has the converter's types.) Every family gets the same trunk
(hidden 1024, 16 layers, 16 heads / 4 kv heads of 64, FFN 3072; Gemma: heads of 128, as its family has wider
ones) and Qwen 2.5's tokenizer (152k tokens, copied from the pulled Qwen2.5-Coder store), so the figures differ
only by what the family changes; ~0.45 B parameters, ~0.3 GB at Q4_K_M. The families of 2026 that llama.cpp runs
(Qwen 3.5, LFM2, Granite 4.0-H, Nemotron-H, Falcon-H1, Gemma 4, gpt-oss, Llama 4, GLM-4.5, SmolLM3, OLMo 3,
EXAONE 4, Ministral 3, Seed-OSS, GLM-4) have their presets in bench/synth_family_2026.py, on the same trunk.
`--drop-hf` deletes the HF directory's weights once the GGUF is written (the MoE ones hold ~4 GB of float32).

    python -m bench.synth_family FAMILY OUT_DIR [--drop-hf]      # FAMILY: one of PRESETS, or "all"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.synth_family_2026 import PRESETS_2026

TRUNK = dict(
    hidden_size=1024,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=3072,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
_GEMMA = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=128, query_pre_attn_scalar=128)
PRESETS: dict[str, tuple[str, dict]] = {
    "llama3": (
        "llama",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            rope_theta=500000.0,
        ),
    ),
    "mistral": ("mistral", dict(sliding_window=None, rope_theta=1e6)),
    "gemma2": ("gemma2", dict(_GEMMA, sliding_window=4096, tie_word_embeddings=True)),
    "gemma3": ("gemma3_text", dict(_GEMMA, sliding_window=512, tie_word_embeddings=True)),
    "phi3": ("phi3", dict(partial_rotary_factor=0.75, head_dim=None, sliding_window=None)),
    "granite": (
        "granite",
        dict(embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=8.0),
    ),
    "olmo2": ("olmo2", dict(rope_theta=500000.0)),
    "qwen3": ("qwen3", dict(rope_theta=1e6)),
    **PRESETS_2026,
}
Q4_K_M = 15  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M


def tokenizer_files(folder: Path) -> int:
    """Qwen 2.5's tokenizer (tokenizer.json, tokenizer_config.json) from the pulled target's store; its size."""
    from formats.convert import ensure_store
    from pulls.registry import DEFAULT_TARGET

    info = ensure_store(DEFAULT_TARGET, "int4").tokenizer_info
    (folder / "tokenizer.json").write_text(info.tokenizer_json)
    config = {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": info.chat_template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return len(json.loads(info.tokenizer_json)["model"]["vocab"]) + len(json.loads(info.tokenizer_json)["added_tokens"])


def write_family(name: str, out_dir: Path, drop_hf: bool = False) -> Path:
    """OUT_DIR/NAME/ (the HF directory; its weights deleted at the end if `drop_hf`) and OUT_DIR/NAME-q4_k_m.gguf;
    returns the GGUF's path."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.hf_gguf import write_gguf_like_llama_cpp

    model_type, extra = PRESETS[name]
    folder = out_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    vocab = tokenizer_files(folder)
    kw = {**TRUNK, **extra, "vocab_size": vocab, "bos_token_id": None, "eos_token_id": vocab - 1, "pad_token_id": 0}
    config = AutoConfig.for_model(model_type, **{k: v for k, v in kw.items() if v is not None or k != "head_dim"})
    config.architectures = [type(config).__name__.replace("TextConfig", "Config").replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    del model
    f32 = out_dir / f"{name}-f32.gguf"
    write_gguf_like_llama_cpp(folder, f32, "F32")
    gguf = out_dir / f"{name}-q4_k_m.gguf"
    quantize(f32, gguf)
    f32.unlink()
    for f in folder.glob("model*.safetensors*") if drop_hf else ():
        f.unlink()
    return gguf


def quantize(src: Path, dst: Path) -> None:
    """llama.cpp's own quantizer (llama_model_quantize, as its llama-quantize tool runs it)."""
    import llama_cpp as lc

    params = lc.llama_model_quantize_default_params()
    params.ftype, params.nthread = Q4_K_M, 2
    if lc.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.synth_family", description=__doc__.split("\n\n")[0])
    p.add_argument("family", choices=[*PRESETS, "all"])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--drop-hf", action="store_true", help="delete the HF directory's weights once the GGUF is written")
    a = p.parse_args(argv)
    for name in PRESETS if a.family == "all" else [a.family]:
        print(write_family(name, a.out_dir, a.drop_hf), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
