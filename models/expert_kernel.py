"""The experts' kernels: a mixture-of-experts layer's routed experts in one call (csrc/experts.cpp), plain SwiGLU
experts, gpt-oss's (biases, a clamped SwiGLU) and Llama 4's (the routing weight scaling the input), and gpt-oss's
activation alone for the expert-by-expert path (csrc/ops.cpp): the bits of one are the other's."""

from __future__ import annotations

import torch

from models.kernels import lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def experts(
    h: torch.Tensor,
    ids: torch.Tensor,
    top: torch.Tensor,
    expert_ids: torch.Tensor,
    table: torch.Tensor,
    out: torch.Tensor,
    biases: torch.Tensor | None = None,
    oai: tuple[float, float] | None = None,
    scale_input: bool = False,
) -> torch.Tensor:
    """out [T, D] += each token's routed experts (ids, top [T, k]) among `expert_ids` (int32 [E], ascending),
    weighted, in one call (csrc/experts.cpp); table int64 [E, 2, 9]: each one's gate_up and down
    (`QuantLinear.record`); biases int64 [E, 2]: their biases' addresses (0: none); oai: gpt-oss's clamped SwiGLU
    (alpha, limit); scale_input: the weight scales each expert's input (Llama 4)."""
    T, D = h.shape
    assert out.is_contiguous() and out.shape == (T, D) and table.dtype == torch.int64
    ids, top = ids.to(torch.int32).contiguous(), top.float().contiguous()
    rows = (_ptr(h.contiguous()), T, D, _ptr(ids), _ptr(top), ids.shape[1])
    which = (_ptr(expert_ids), expert_ids.numel(), _ptr(table), _ptr(out), torch.get_num_threads())
    lib().cad_experts(*rows, *which, _ptr(biases), 2 if oai else 0, *(oai or (1.0, 0.0)), int(scale_input))
    return out


def oai_glu(gu: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of gu [T, 2F] = [gate | up]: (clamp(up, -limit, limit) + 1) * gate' sigmoid(alpha
    gate'), gate' = min(gate, limit), as the expert kernel computes it."""
    T, f2 = gu.shape
    out = torch.empty(T, f2 // 2, dtype=torch.float32)
    lib().cad_oai_glu(_ptr(gu.contiguous()), _ptr(out), T, f2 // 2, alpha, limit)
    return out
