"""The tile layout of the quantized formats (models/csrc/qlinear.hpp has the picture): weights in tiles of
TILE output rows, each array tile-major, so that whole tiles are slices (a column split, an output head's
first rows, chunks of FFN neurons) and one pass over a tile's bytes serves 16 outputs at once.

`pack` turns a format's per-row arrays into tiles; `unpack` gives them back for rows [row0, row0 + n).
A quad is 4 consecutive k of one row; a tile stores quads row by row (16 rows x 4 bytes = 64 bytes).
"""

from __future__ import annotations

import torch

TILE = 16
QUANTIZED = ("int8", "int4", "int2")


def count(n: int) -> int:
    """Tiles that hold n rows."""
    return -(-n // TILE)


def _padded(a: torch.Tensor) -> torch.Tensor:
    n = a.shape[0]
    pad = count(n) * TILE - n
    return torch.cat([a, a.new_zeros(pad, *a.shape[1:])]) if pad else a


def rows_to_tiles(a: torch.Tensor) -> torch.Tensor:
    """[N, C] -> [T, C * TILE]: per tile, column c of its 16 rows together ([c][row])."""
    p = _padded(a)
    return p.view(-1, TILE, p.shape[1]).transpose(1, 2).reshape(-1, p.shape[1] * TILE).contiguous()


def tiles_to_rows(a: torch.Tensor, row0: int, n: int) -> torch.Tensor:
    t = a.shape[0]
    return a.view(t, -1, TILE).transpose(1, 2).reshape(t * TILE, -1)[row0 : row0 + n]


def _pack_mins(mn: torch.Tensor) -> torch.Tensor:
    """[N, NG] -> [T, NG2 * TILE] as [group pair][row][2] (NG2: NG rounded up to even, zero-padded)."""
    p = _padded(mn)
    if p.shape[1] % 2:
        p = torch.cat([p, p.new_zeros(p.shape[0], 1)], dim=1)
    return p.view(-1, TILE, p.shape[1] // 2, 2).permute(0, 2, 1, 3).reshape(-1, p.shape[1] * TILE).contiguous()


def _unpack_mins(a: torch.Tensor, row0: int, n: int, ng: int) -> torch.Tensor:
    t = a.shape[0]
    return a.view(t, -1, TILE, 2).permute(0, 2, 1, 3).reshape(t * TILE, -1)[row0 : row0 + n, :ng]


def pack_codes(fmt: str, codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (int4: 0..15, int2: 0..3 as uint8; int8: -127..127 as int8) -> q [T, bytes per tile]."""
    c = _padded(codes)
    t, k = c.shape[0] // TILE, c.shape[1]
    if fmt == "int8":  # quads in k order, each code + 128
        u = (c.to(torch.int16) + 128).to(torch.uint8)
        return u.view(t, TILE, k // 4, 4).permute(0, 2, 1, 3).reshape(t, k * TILE).contiguous()
    g = c.view(t, TILE, k // 32, 2, 4, 4)  # k = 32 group + 16 h + 4 i + b
    if fmt == "int4":  # chunk i of a group: quad i in the low nibbles, quad i + 4 in the high ones
        g = g.permute(0, 2, 4, 1, 5, 3)  # [T, group, i, row, b, h]
        return (g[..., 0] | (g[..., 1] << 4)).reshape(t, -1).contiguous()
    g = g.permute(0, 2, 3, 1, 5, 4)  # int2: [T, group, h, row, b, i]; chunk h, bits 2i..2i+1: quad 4h + i
    return (g[..., 0] | (g[..., 1] << 2) | (g[..., 2] << 4) | (g[..., 3] << 6)).reshape(t, -1).contiguous()


def unpack_codes(fmt: str, q: torch.Tensor, k: int, row0: int, n: int) -> torch.Tensor:
    """q [T, bytes per tile] -> the codes [n, k] of rows row0 .. row0 + n (int8: signed)."""
    t = q.shape[0]
    if fmt == "int8":
        u = q.view(t, k // 4, TILE, 4).permute(0, 2, 1, 3).reshape(t * TILE, k)
        return (u.to(torch.int16) - 128).to(torch.int8)[row0 : row0 + n]
    if fmt == "int4":
        b = q.view(t, k // 32, 4, TILE, 4)
        c = torch.stack([b & 15, b >> 4], dim=-1)  # [T, group, i, row, b, h]
        c = c.permute(0, 3, 1, 5, 2, 4)
    else:
        b = q.view(t, k // 32, 2, TILE, 4)
        c = torch.stack([(b >> s) & 3 for s in (0, 2, 4, 6)], dim=-1)  # [T, group, h, row, b, i]
        c = c.permute(0, 3, 1, 2, 5, 4)
    return c.reshape(t * TILE, k)[row0 : row0 + n]


def pack(fmt: str, arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A quantized format's per-row arrays (codes unpacked) -> its tiles."""
    if fmt == "int8":
        return {"q": pack_codes(fmt, arrays["q"]), "scale": rows_to_tiles(arrays["scale"][:, None])}
    return {
        "q": pack_codes(fmt, arrays["q"]),
        "sc": rows_to_tiles(arrays["sc"]),
        "mn": _pack_mins(arrays["mn"]),
        "s": rows_to_tiles(arrays["s"]),
        "m": rows_to_tiles(arrays["m"]),
    }


def unpack(fmt: str, arrays: dict[str, torch.Tensor], k: int, row0: int, n: int) -> dict[str, torch.Tensor]:
    """The per-row arrays of rows row0 .. row0 + n back from tiles (codes unpacked)."""
    codes = unpack_codes(fmt, arrays["q"], k, row0, n)
    if fmt == "int8":
        return {"q": codes, "scale": tiles_to_rows(arrays["scale"], row0, n)[:, 0]}
    return {
        "q": codes,
        "sc": tiles_to_rows(arrays["sc"], row0, n),
        "mn": _unpack_mins(arrays["mn"], row0, n, k // 32),
        "s": tiles_to_rows(arrays["s"], row0, n),
        "m": tiles_to_rows(arrays["m"], row0, n),
    }
