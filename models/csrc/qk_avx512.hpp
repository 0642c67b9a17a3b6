/* The AVX-512 VNNI path: a tile's 16 rows are the 16 int32 lanes of a zmm. Per group of 32 k, each
 * activation row (up to 16 per pass over a tile, their sums in registers) costs 8 vpdpbusd of the
 * group's 8 code quads against its own 4-byte quads broadcast from memory, then one multiply by the
 * sub-scales; the codes are unpacked once per 8 rows. The float step is qlinear.hpp's, lane by lane. */
#pragma once
#include "qlinear.hpp"

#include <algorithm>
#include <immintrin.h>

namespace q {

static inline __m512i bcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* The float step of super-block b for MB rows from their I1 (int4/int2: I2 from the sub-minimums here;
 * int8: the offset correction), added into out [MB, TR]. */
template <int FMT, int MB>
CAD_INLINE void sb_finish512(const QW &W, const QA &a, int t, int b, int m0, const __m512i *I1, float *out) {
    if constexpr (FMT == Q8) {
        for (int m = 0; m < MB; m++) {
            const size_t r = (size_t)(m0 + m) * a.nsb + b;
            const __m512i i = _mm512_sub_epi32(I1[m], _mm512_set1_epi32(128 * a.xsum[r]));
            const __m512 f = _mm512_mul_ps(_mm512_set1_ps(a.d[r]), _mm512_cvtepi32_ps(i));
            _mm512_storeu_ps(out + m * TR, _mm512_add_ps(_mm512_loadu_ps(out + m * TR), f));
        }
    } else {
        const int g0 = b * GPS, np = (std::min(W.ng, g0 + GPS) - g0 + 1) / 2;
        __m512i mn[GPS / 2];
        for (int p = 0; p < np; p++) mn[p] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)W.submins(t, g0 + 2 * p)));
        const __m512 S = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)W.supers(W.S, t, b)));
        const __m512 Mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)W.supers(W.Mn, t, b)));
        for (int m = 0; m < MB; m++) {
            const int16_t *xs = &a.xs[(size_t)(m0 + m) * a.ng2 + g0];
            __m512i i2 = _mm512_setzero_si512();
            for (int p = 0; p < np; p++) i2 = _mm512_dpwssd_epi32(i2, mn[p], bcast4(xs + 2 * p));
            const __m512 s = _mm512_mul_ps(S, _mm512_cvtepi32_ps(I1[m]));
            const __m512 n = _mm512_mul_ps(Mn, _mm512_cvtepi32_ps(i2));
            const __m512 f = _mm512_mul_ps(_mm512_set1_ps(a.d[(size_t)(m0 + m) * a.nsb + b]), _mm512_sub_ps(s, n));
            _mm512_storeu_ps(out + m * TR, _mm512_add_ps(_mm512_loadu_ps(out + m * TR), f));
        }
    }
}

template <int FMT, int MB>
CAD_INLINE void scale_rows512(const QW &W, int t, float *out) {
    if constexpr (FMT == Q8) {
        const __m512 s = _mm512_loadu_ps(W.scale + (size_t)t * TR);
        for (int m = 0; m < MB; m++) _mm512_storeu_ps(out + m * TR, _mm512_mul_ps(s, _mm512_loadu_ps(out + m * TR)));
    }
}

/* Group g for rows R0 .. R1 of the block (at most 8: one accumulator each, enough independent chains
 * to keep vpdpbusd busy at its latency), its codes at p: I1 += sc * <codes, x> (int8: I1 += <codes, x>).
 * Quads are unpacked as they are used, so the accumulators, I1 and a few codes fit the 32 registers. */
template <int FMT, int R0, int R1, int MB>
CAD_INLINE void group512(const uint8_t *p, const QA &a, int m0, int g, __m512i sc, __m512i *I1) {
    constexpr int R = R1 - R0;
    const int8_t *x[R];
    __m512i s[R];
    for (int r = 0; r < R; r++) x[r] = a.row(m0 + R0 + r) + g * QG, s[r] = FMT == Q8 ? I1[R0 + r] : _mm512_setzero_si512();
    if constexpr (FMT == Q4) {
        const __m512i m = _mm512_set1_epi8(15);
        for (int i = 0; i < 4; i++) {  /* chunk i: quad i in the low nibbles, quad i + 4 in the high ones */
            const __m512i v = _mm512_loadu_si512(p + 64 * i);
            const __m512i lo = _mm512_and_si512(v, m), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
            for (int r = 0; r < R; r++) s[r] = _mm512_dpbusd_epi32(s[r], lo, bcast4(x[r] + 4 * i));
            for (int r = 0; r < R; r++) s[r] = _mm512_dpbusd_epi32(s[r], hi, bcast4(x[r] + 16 + 4 * i));
        }
    } else if constexpr (FMT == Q2) {
        const __m512i m = _mm512_set1_epi8(3);
        for (int h = 0; h < 2; h++) {  /* chunk h, bits 2i: quad 4h + i */
            const __m512i v = _mm512_loadu_si512(p + 64 * h);
            for (int i = 0; i < 4; i++) {
                const __m512i c = _mm512_and_si512(_mm512_srli_epi16(v, 2 * i), m);
                for (int r = 0; r < R; r++) s[r] = _mm512_dpbusd_epi32(s[r], c, bcast4(x[r] + 16 * h + 4 * i));
            }
        }
    } else {
        for (int i = 0; i < 8; i++) {
            const __m512i c = _mm512_loadu_si512(p + 64 * i);
            for (int r = 0; r < R; r++) s[r] = _mm512_dpbusd_epi32(s[r], c, bcast4(x[r] + 4 * i));
        }
    }
    for (int r = 0; r < R; r++) I1[R0 + r] = FMT == Q8 ? s[r] : _mm512_add_epi32(I1[R0 + r], _mm512_mullo_epi32(s[r], sc));
}

/* Group g's 8 quads of tile codes at p, unpacked: c[i] holds k = 4i .. 4i + 3 of each row (the AMX path's B tiles). */
template <int FMT>
CAD_INLINE void unpack512(const uint8_t *p, __m512i c[8]) {
    if constexpr (FMT == Q4) {
        const __m512i m = _mm512_set1_epi8(15);
        for (int i = 0; i < 4; i++) {
            const __m512i v = _mm512_loadu_si512(p + 64 * i);
            c[i] = _mm512_and_si512(v, m);
            c[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
        }
    } else if constexpr (FMT == Q2) {
        const __m512i m = _mm512_set1_epi8(3);
        for (int i = 0; i < 8; i++) c[i] = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(p + 64 * (i / 4)), 2 * (i % 4)), m);
    } else {
        for (int i = 0; i < 8; i++) c[i] = _mm512_loadu_si512(p + 64 * i);
    }
}

/* Group g's sub-scales, one per row of tile t (int8 has none). */
template <int FMT>
CAD_INLINE __m512i subscales512(const QW &W, int t, int g) {
    if constexpr (FMT == Q8) return _mm512_setzero_si512();
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)W.subscales(t, g)));
}

/* Rows m0 .. m0 + MB of the activations against tile t: out [MB, TR]. */
template <int FMT, int MB>
static void tile_avx512(const QW &W, const QA &a, int t, int m0, float *out) {
    std::fill(out, out + MB * TR, 0.0f);
    for (int b = 0; b < W.nsb; b++) {
        const int g0 = b * GPS, g1 = std::min(W.ng, g0 + GPS);
        __m512i I1[MB];
        for (int m = 0; m < MB; m++) I1[m] = _mm512_setzero_si512();
        /* rows 0-7 over the super-block's groups, then rows 8-15 over them again (their codes are in L1 by
         * then): eight accumulators live at a time, so none of them spills to the stack */
        for (int g = g0; g < g1; g++) {
            prefetch_next<FMT>(W, t, g);
            group512<FMT, 0, (MB < 8 ? MB : 8), MB>(W.codes<FMT>(t, g), a, m0, g, subscales512<FMT>(W, t, g), I1);
        }
        if constexpr (MB > 8)
            for (int g = g0; g < g1; g++)
                group512<FMT, 8, MB, MB>(W.codes<FMT>(t, g), a, m0, g, subscales512<FMT>(W, t, g), I1);
        sb_finish512<FMT, MB>(W, a, t, b, m0, I1, out);
    }
    scale_rows512<FMT, MB>(W, t, out);
}

template <int FMT>
static void rows_avx512(const QW &W, const QA &a, int t, int m0, int mb, float *out) {
    switch (mb) {
#define CAD_MB(n) case n: tile_avx512<FMT, n>(W, a, t, m0, out); break;
        CAD_MB(1) CAD_MB(2) CAD_MB(3) CAD_MB(4) CAD_MB(5) CAD_MB(6) CAD_MB(7) CAD_MB(8)
        CAD_MB(9) CAD_MB(10) CAD_MB(11) CAD_MB(12) CAD_MB(13) CAD_MB(14) CAD_MB(15) CAD_MB(16)
#undef CAD_MB
    }
}

}  // namespace q
