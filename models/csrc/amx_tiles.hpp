/* The few AMX tile operations the AMX path uses, or, built with CAD_AMX_EMULATE, a software model of
 * them with the hardware's semantics and checks, so that the AMX kernel's packing, strides and loops
 * run, and are compared bit for bit with the other paths, on CPUs without AMX:
 *   loadconfig: palette 1, per tile rows <= 16 and colsb <= 64 (a multiple of 4)
 *   loadd/stored: rows x colsb bytes, row r at base + r * stride
 *   dpbsud C, A, B: C[m][n] += sum_k sum_i int8(A[m][4k + i]) * uint8(B[k][4n + i]), in int32,
 *     with A.colsb = 4 B.rows, C.rows = A.rows, C.colsb = B.colsb (else #UD)
 */
#pragma once
#include <stdint.h>
#include <string.h>

struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

#ifdef CAD_AMX_EMULATE
#include <stdio.h>
#include <stdlib.h>

namespace amx_emu {
struct Tile {
    int rows, colsb;
    uint8_t b[16][64];
};
inline thread_local Tile tiles[8];
inline thread_local bool configured = false;

[[noreturn]] inline void fail(const char *what) {
    fprintf(stderr, "cadence: emulated AMX: %s (the real instruction would fault)\n", what);
    abort();
}
inline Tile &tile(int i) {
    if (!configured || i < 0 || i > 7 || tiles[i].rows == 0) fail("tile used before its configuration");
    return tiles[i];
}
inline void loadconfig(const TileConfig *c) {
    if (c->palette != 1) fail("palette other than 1");
    for (int i = 0; i < 8; i++) {
        if (c->rows[i] > 16 || c->colsb[i] > 64 || c->colsb[i] % 4) fail("tile shape beyond 16 rows x 64 bytes");
        tiles[i].rows = c->rows[i];
        tiles[i].colsb = c->colsb[i];
    }
    configured = true;
}
inline void loadd(int i, const void *base, long stride) {
    Tile &t = tile(i);
    memset(t.b, 0, sizeof t.b);
    for (int r = 0; r < t.rows; r++) memcpy(t.b[r], (const uint8_t *)base + r * stride, t.colsb);
}
inline void stored(int i, void *base, long stride) {
    Tile &t = tile(i);
    for (int r = 0; r < t.rows; r++) memcpy((uint8_t *)base + r * stride, t.b[r], t.colsb);
}
inline void zero(int i) { memset(tile(i).b, 0, sizeof tiles[i].b); }
inline void dpbsud(int ci, int ai, int bi) {
    Tile &c = tile(ci), &a = tile(ai), &b = tile(bi);
    if (a.colsb != 4 * b.rows || c.rows != a.rows || c.colsb != b.colsb) fail("tile shapes that do not multiply");
    for (int m = 0; m < c.rows; m++)
        for (int n = 0; n < c.colsb / 4; n++) {
            uint32_t acc;
            memcpy(&acc, &c.b[m][4 * n], 4);
            for (int k = 0; k < b.rows; k++)
                for (int i = 0; i < 4; i++) acc += (uint32_t)((int32_t)(int8_t)a.b[m][4 * k + i] * (int32_t)b.b[k][4 * n + i]);
            memcpy(&c.b[m][4 * n], &acc, 4);
        }
}
inline void release() { configured = false; }
}  // namespace amx_emu

#define TILE_LOADCONFIG(c) amx_emu::loadconfig(c)
#define TILE_LOADD(t, p, s) amx_emu::loadd(t, p, s)
#define TILE_STORED(t, p, s) amx_emu::stored(t, p, s)
#define TILE_ZERO(t) amx_emu::zero(t)
#define TILE_DPBSUD(c, a, b) amx_emu::dpbsud(c, a, b)
#define TILE_RELEASE() amx_emu::release()
#else
#include <immintrin.h>
#define TILE_LOADCONFIG(c) _tile_loadconfig(c)
#define TILE_LOADD(t, p, s) _tile_loadd(t, p, s)
#define TILE_STORED(t, p, s) _tile_stored(t, p, s)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DPBSUD(c, a, b) _tile_dpbsud(c, a, b)
#define TILE_RELEASE() _tile_release()
#endif
