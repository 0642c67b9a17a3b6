/* The portable path: qlinear.hpp's reduction in plain loops, no intrinsics. It is the reference the
 * other paths are tested against, and the path of CPUs without AVX2. */
#pragma once
#include "qlinear.hpp"

#include <algorithm>

namespace q {

/* The 32 codes of group g of each row of tile t, as bytes in k order: c[row][k]. */
template <int FMT>
static inline void group_codes(const QW &W, int t, int g, int16_t c[TR][QG]) {
    const uint8_t *p = W.codes<FMT>(t, g);
    for (int i = 0; i < 8; i++) /* quad i: int4 chunk i % 4 (high nibbles from 4 on); int2 chunk i / 4, bits 2 (i % 4) */
        for (int j = 0; j < TR; j++)
            for (int b = 0; b < 4; b++) {
                const uint8_t v = FMT == Q4 ? p[64 * (i % 4) + 4 * j + b] : FMT == Q2 ? p[64 * (i / 4) + 4 * j + b] : p[64 * i + 4 * j + b];
                c[j][4 * i + b] = FMT == Q4 ? (i < 4 ? v & 15 : v >> 4) : FMT == Q2 ? (v >> (2 * (i % 4))) & 3 : v;
            }
}

/* Rows m0 .. m0 + mb (mb <= TR) of the activations against tile t: out [mb, TR]. */
template <int FMT>
static void tile_portable(const QW &W, const QA &a, int t, int m0, int mb, float *out) {
    int32_t i1[TR][TR], i2[TR][TR];
    int16_t c[TR][QG], xw[QG]; /* 16-bit: the dot products below become pmaddwd without SSSE3 */
    std::fill(out, out + mb * TR, 0.0f);
    for (int b = 0; b < W.nsb; b++) {
        const int g0 = b * GPS, g1 = std::min(W.ng, g0 + GPS);
        for (int m = 0; m < mb; m++)
            for (int j = 0; j < TR; j++) i1[m][j] = i2[m][j] = 0;
        for (int g = g0; g < g1; g++) {
            group_codes<FMT>(W, t, g, c);
            for (int m = 0; m < mb; m++) {
                const int8_t *x = a.row(m0 + m) + g * QG;
                const int xs = a.xs[(size_t)(m0 + m) * a.ng2 + g];
                for (int k = 0; k < QG; k++) xw[k] = x[k];
                for (int j = 0; j < TR; j++) {
                    int32_t dot = 0;
                    for (int k = 0; k < QG; k++) dot += c[j][k] * xw[k];
                    if (FMT == Q8) {
                        i1[m][j] += dot;
                    } else {
                        i1[m][j] += W.subscales(t, g)[j] * dot;
                        i2[m][j] += W.submins(t, g & ~1)[2 * j + (g & 1)] * xs;
                    }
                }
            }
        }
        for (int m = 0; m < mb; m++) {
            const float d = a.d[(size_t)(m0 + m) * a.nsb + b];
            const int32_t off = 128 * a.xsum[(size_t)(m0 + m) * a.nsb + b]; /* int8 codes are stored + 128 */
            for (int j = 0; j < TR; j++) {
                float &o = out[m * TR + j];
                if (FMT == Q8)
                    o = o + d * (float)(i1[m][j] - off);
                else
                    o = o + sb_term(d, half_to_float(W.supers(W.S, t, b)[j]), half_to_float(W.supers(W.Mn, t, b)[j]),
                                    i1[m][j], i2[m][j]);
            }
        }
    }
    if (FMT == Q8)
        for (int m = 0; m < mb; m++)
            for (int j = 0; j < TR; j++) out[m * TR + j] = W.scale[(size_t)t * TR + j] * out[m * TR + j];
}

}  // namespace q
