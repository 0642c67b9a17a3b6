/* The AMX path for wide passes: 16 activation rows (an A tile, straight from the int8 activations,
 * padded to whole tiles of rows) times one weight tile per group of 32 k. A super-block's codes are
 * unpacked to int8 once into B tiles (a quad of the layout is one B row: 16 columns x 4 bytes), tdpbsud
 * gives each (row, column) its group's exact dot product, and the AVX-512 code applies the sub-scales
 * and takes qlinear.hpp's float step, so the bits are the VNNI path's. Tile configuration is loaded by
 * each thread at the start of a call and released at its end (other libraries in the process, torch's
 * oneDNN, use tiles with their own shapes on the same threads). */
#pragma once
#include "amx_tiles.hpp"
#include "qk_avx512.hpp"

namespace q {

/* Tiles (numbers, not names: the intrinsics spell them into the instruction): activations 16 x 32 bytes,
 * codes 8 x 64 bytes, results 16 x 16 int32. */
#define CAD_TA 0
#define CAD_TB 1
#define CAD_TC 2

static inline void amx_begin() {
    alignas(64) TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[CAD_TA] = TR, cfg.colsb[CAD_TA] = QG;
    cfg.rows[CAD_TB] = QG / 4, cfg.colsb[CAD_TB] = 64;
    cfg.rows[CAD_TC] = TR, cfg.colsb[CAD_TC] = 64;
    TILE_LOADCONFIG(&cfg);
}

static inline void amx_end() { TILE_RELEASE(); }

/* Rows m0 .. m0 + 16 of the activations (rows past M are zero) against tile t: out [16, TR]. */
template <int FMT>
static void tile_amx(const QW &W, const QA &a, int t, int m0, float *out) {
    alignas(64) uint8_t B[GPS][8 * 64];
    alignas(64) int32_t C[TR][TR];
    std::fill(out, out + TR * TR, 0.0f);
    for (int b = 0; b < W.nsb; b++) {
        const int g0 = b * GPS, g1 = std::min(W.ng, g0 + GPS);
        if constexpr (FMT != Q8)
            for (int g = g0; g < g1; g++) {
                prefetch_next<FMT>(W, t, g);
                __m512i c[8];
                unpack512<FMT>(W.codes<FMT>(t, g), c);
                for (int i = 0; i < 8; i++) _mm512_store_si512(B[g - g0] + 64 * i, c[i]);
            }
        __m512i I1[TR];
        if constexpr (FMT == Q8) { /* no sub-scales: the super-block's groups add up in the C tile */
            TILE_ZERO(CAD_TC);
            for (int g = g0; g < g1; g++) {
                prefetch_next<FMT>(W, t, g);
                TILE_LOADD(CAD_TA, a.row(m0) + g * QG, a.K);
                TILE_LOADD(CAD_TB, W.codes<FMT>(t, g), 64);
                TILE_DPBSUD(CAD_TC, CAD_TA, CAD_TB);
            }
            TILE_STORED(CAD_TC, C, 64);
            for (int m = 0; m < TR; m++) I1[m] = _mm512_load_si512(C[m]);
        } else {
            for (int m = 0; m < TR; m++) I1[m] = _mm512_setzero_si512();
            for (int g = g0; g < g1; g++) {
                TILE_LOADD(CAD_TA, a.row(m0) + g * QG, a.K);
                TILE_LOADD(CAD_TB, B[g - g0], 64);
                TILE_ZERO(CAD_TC);
                TILE_DPBSUD(CAD_TC, CAD_TA, CAD_TB);
                TILE_STORED(CAD_TC, C, 64);
                const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)W.subscales(t, g)));
                for (int m = 0; m < TR; m++) I1[m] = _mm512_add_epi32(I1[m], _mm512_mullo_epi32(_mm512_load_si512(C[m]), sc));
            }
        }
        sb_finish512<FMT, TR>(W, a, t, b, m0, I1, out);
    }
    scale_rows512<FMT, TR>(W, t, out);
}

}  // namespace q
