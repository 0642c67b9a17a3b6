"""A neuron's record (LLM in a flash §3.2, "bundling columns and rows"): the gate row, the up row and the
down column of one FFN neuron together, int4, in the layout the flash FFN kernel reads
(models/csrc/flash.cpp) and the bundle file stores (flash/bundles.py).

Each of the three rows is quantized along the model dimension K exactly as the store's int4 linears are
(models/linear.py `quantize_int4`): codes 0..15, per group of 32 an 8-bit scale and offset, per super-block
of 256 an fp16 scale and offset: w[j] = code[j] * s[j/256] * sc[j/32] - m[j/256] * mn[j/32]. With G = K/32
and S = ceil(K/256), a record is, in this order (rows gate, up, down^T):

    codes [3][K/2]   per group of 32: byte b holds code b (low nibble) and code 16 + b (high nibble)
    sc [3][G] u8, mn [3][G] u8, s [3][S] f16, m [3][S] f16

padded to a multiple of 16 bytes.
"""

from __future__ import annotations

import torch

from common.errors import CadenceError

ALIGN = 16


def check_dim(dim: int) -> None:
    if dim % 32:
        raise CadenceError(f"neuron records need a model dimension that is a multiple of 32; this model has {dim}")


def sections(dim: int) -> dict[str, tuple[int, int]]:
    """(byte offset, bytes per row) of each array of a record; rows gate, up, down follow each other."""
    g, s = dim // 32, -(-dim // 256)
    out, at = {}, 0
    for key, n in (("q", dim // 2), ("sc", g), ("mn", g), ("s", 2 * s), ("m", 2 * s)):
        out[key] = (at, n)
        at += 3 * n
    return out


def record_bytes(dim: int) -> int:
    check_dim(dim)
    at, n = sections(dim)["m"]
    return -(-(at + 3 * n) // ALIGN) * ALIGN


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes [n, K] (0..15) -> [n, K/2]: per group of 32, low nibbles codes 0..15, high nibbles 16..31."""
    g = codes.view(codes.shape[0], -1, 2, 16)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(codes.shape[0], -1)


def _unnibble(b: torch.Tensor) -> torch.Tensor:
    g = b.view(b.shape[0], -1, 1, 16)
    return torch.cat([g & 15, g >> 4], dim=2).reshape(b.shape[0], -1)


def pack(rows: list[dict[str, torch.Tensor]], dim: int) -> torch.Tensor:
    """Gate, up and down^T rows of n neurons (per-row int4 arrays: `QuantLinear.per_row()`, or
    `quantize_int4`'s output) -> records [n, record_bytes(dim)] uint8."""
    n = rows[0]["q"].shape[0]
    raw = lambda t: t.clone(memory_format=torch.contiguous_format).view(torch.uint8).reshape(n, -1)
    body = torch.cat([_nibbles(r["q"]) for r in rows] + [raw(r[k]) for k in ("sc", "mn", "s", "m") for r in rows], 1)
    out = torch.zeros(n, record_bytes(dim), dtype=torch.uint8)
    out[:, : body.shape[1]] = body
    return out


def unpack(rec: torch.Tensor, dim: int) -> list[dict[str, torch.Tensor]]:
    """Records [n, R] -> the per-row arrays of gate, up and down^T (the inverse of `pack`)."""
    out = [{}, {}, {}]
    dtypes = {"q": torch.uint8, "sc": torch.uint8, "mn": torch.uint8, "s": torch.float16, "m": torch.float16}
    for key, (at, nbytes) in sections(dim).items():
        for j, r in enumerate(out):
            t = rec[:, at + j * nbytes : at + (j + 1) * nbytes].contiguous().view(dtypes[key])
            r[key] = _unnibble(t) if key == "q" else t
    return out


def dequantize(rows: dict[str, torch.Tensor], dim: int) -> torch.Tensor:
    """Per-row int4 arrays -> fp32 [n, dim], by the store's own arithmetic (models/linear.py)."""
    n, ng = rows["q"].shape[0], dim // 32
    per_group = lambda t: t.float().repeat_interleave(8, dim=1)[:, :ng]
    scale = per_group(rows["s"]) * rows["sc"].float()
    offset = per_group(rows["m"]) * rows["mn"].float()
    return (rows["q"].view(n, ng, 32).float() * scale[..., None] - offset[..., None]).reshape(n, dim)


def ffn_reference(h: torch.Tensor, rec: torch.Tensor, dim: int) -> torch.Tensor:
    """The FFN of the neurons in `rec` [n, R] on h [T, dim], in torch fp32: down^T' (silu(gate h) * (up h))."""
    gate, up, down = (dequantize(r, dim) for r in unpack(rec, dim))
    return (torch.nn.functional.silu(h @ gate.T) * (h @ up.T)) @ down
