/* The 256-bit paths: AVX2 (maddubs) and AVX-VNNI (vpdpbusd on ymm). A tile is two halves of 8 rows,
 * each half's rows the 8 int32 lanes of a ymm; up to 4 activation rows per pass (16 registers).
 * AVX2 multiplies u8 codes by s8 activations with maddubs into int16 pairs and adds a group's 8 quads
 * there (int4: at most 8 x 2 x 15 x 127 = 30480, no saturation), then one madd with the sub-scales;
 * int8 codes go back to signed (xor 0x80) and take the sign trick. AVX-VNNI accumulates vpdpbusd
 * in int32 as the AVX-512 path does. Either way the integers are those of qlinear.hpp. */
#pragma once
#include "qlinear.hpp"

#include <algorithm>
#include <immintrin.h>

namespace q {

constexpr int MB256 = 4; /* activation rows per pass */

static inline __m256i bcast4_256(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Quad i of a group's codes for the 8 rows of half h: p = the group's codes + 32 h. */
template <int FMT>
static inline __m256i quad256(const uint8_t *p, int i) {
    if constexpr (FMT == Q4) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * (i & 3)));
        return _mm256_and_si256(i < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
    } else if constexpr (FMT == Q2) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * (i / 4)));
        return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * (i % 4))), _mm256_set1_epi8(3));
    } else {
        return _mm256_loadu_si256((const __m256i *)(p + 64 * i));
    }
}

/* I1 of one group for MB rows, half h, added into I1. */
template <int FMT, int MB>
CAD_INLINE void group256(const QW &W, const QA &a, int t, int g, int h, int m0, __m256i *I1) {
    const uint8_t *p = W.codes<FMT>(t, g) + 32 * h;
    const int8_t *x[MB];
    for (int m = 0; m < MB; m++) x[m] = a.row(m0 + m) + g * QG;
#ifdef __AVXVNNI__
    __m256i s[MB];
    for (int m = 0; m < MB; m++) s[m] = FMT == Q8 ? I1[m] : _mm256_setzero_si256();
    for (int i = 0; i < 8; i++) {
        const __m256i c = quad256<FMT>(p, i);
        for (int m = 0; m < MB; m++) s[m] = _mm256_dpbusd_avx_epi32(s[m], c, bcast4_256(x[m] + 4 * i));
    }
    if constexpr (FMT == Q8) {
        for (int m = 0; m < MB; m++) I1[m] = s[m];
    } else {
        const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(W.subscales(t, g) + 8 * h)));
        for (int m = 0; m < MB; m++) I1[m] = _mm256_add_epi32(I1[m], _mm256_mullo_epi32(s[m], sc));
    }
#else
    if constexpr (FMT == Q8) {
        const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
        for (int i = 0; i < 8; i++) {
            const __m256i w = _mm256_xor_si256(quad256<FMT>(p, i), flip), aw = _mm256_sign_epi8(w, w);
            for (int m = 0; m < MB; m++) {
                const __m256i pr = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4_256(x[m] + 4 * i), w));
                I1[m] = _mm256_add_epi32(I1[m], _mm256_madd_epi16(pr, ones));
            }
        }
    } else {
        __m256i s[MB];
        for (int m = 0; m < MB; m++) s[m] = _mm256_setzero_si256();
        for (int i = 0; i < 8; i++) {
            const __m256i c = quad256<FMT>(p, i);
            for (int m = 0; m < MB; m++) s[m] = _mm256_add_epi16(s[m], _mm256_maddubs_epi16(c, bcast4_256(x[m] + 4 * i)));
        }
        const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(W.subscales(t, g) + 8 * h)));
        const __m256i sc16 = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16)); /* the scale in both int16 halves */
        for (int m = 0; m < MB; m++) I1[m] = _mm256_add_epi32(I1[m], _mm256_madd_epi16(s[m], sc16));
    }
#endif
}

/* The float step of super-block b for MB rows of half h, added into out [MB, TR]. */
template <int FMT, int MB>
CAD_INLINE void sb_finish256(const QW &W, const QA &a, int t, int b, int h, int m0, const __m256i *I1, float *out) {
    for (int m = 0; m < MB; m++) {
        const size_t r = (size_t)(m0 + m) * a.nsb + b;
        float *o = out + m * TR + 8 * h;
        __m256 f;
        if constexpr (FMT == Q8) {
#ifdef __AVXVNNI__
            const __m256i i = _mm256_sub_epi32(I1[m], _mm256_set1_epi32(128 * a.xsum[r])); /* codes stored + 128 */
#else
            const __m256i i = I1[m]; /* signed codes: no offset */
#endif
            f = _mm256_mul_ps(_mm256_set1_ps(a.d[r]), _mm256_cvtepi32_ps(i));
        } else {
            const int g0 = b * GPS, np = (std::min(W.ng, g0 + GPS) - g0 + 1) / 2;
            const int16_t *xs = &a.xs[(size_t)(m0 + m) * a.ng2 + g0];
            __m256i i2 = _mm256_setzero_si256();
            for (int p = 0; p < np; p++) {
                const __m256i mn = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(W.submins(t, g0 + 2 * p) + 16 * h)));
                i2 = _mm256_add_epi32(i2, _mm256_madd_epi16(mn, bcast4_256(xs + 2 * p)));
            }
            const __m256 S = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(W.supers(W.S, t, b) + 8 * h)));
            const __m256 Mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(W.supers(W.Mn, t, b) + 8 * h)));
            const __m256 s = _mm256_mul_ps(S, _mm256_cvtepi32_ps(I1[m])), n = _mm256_mul_ps(Mn, _mm256_cvtepi32_ps(i2));
            f = _mm256_mul_ps(_mm256_set1_ps(a.d[r]), _mm256_sub_ps(s, n));
        }
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), f));
    }
}

/* Rows m0 .. m0 + MB of the activations against tile t: out [MB, TR]. */
template <int FMT, int MB>
static void tile_avx2(const QW &W, const QA &a, int t, int m0, float *out) {
    std::fill(out, out + MB * TR, 0.0f);
    for (int h = 0; h < 2; h++)
        for (int b = 0; b < W.nsb; b++) {
            const int g0 = b * GPS, g1 = std::min(W.ng, g0 + GPS);
            __m256i I1[MB];
            for (int m = 0; m < MB; m++) I1[m] = _mm256_setzero_si256();
            for (int g = g0; g < g1; g++) {
                if (h == 0) prefetch_next<FMT>(W, t, g);
                group256<FMT, MB>(W, a, t, g, h, m0, I1);
            }
            sb_finish256<FMT, MB>(W, a, t, b, h, m0, I1, out);
        }
    if constexpr (FMT == Q8)
        for (int m = 0; m < MB; m++)
            for (int h = 0; h < 2; h++) {
                float *o = out + m * TR + 8 * h;
                _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_loadu_ps(W.scale + (size_t)t * TR + 8 * h), _mm256_loadu_ps(o)));
            }
}

template <int FMT>
static void rows_avx2(const QW &W, const QA &a, int t, int m0, int mb, float *out) {
    switch (mb) {
    case 4: tile_avx2<FMT, 4>(W, a, t, m0, out); break;
    case 3: tile_avx2<FMT, 3>(W, a, t, m0, out); break;
    case 2: tile_avx2<FMT, 2>(W, a, t, m0, out); break;
    default: tile_avx2<FMT, 1>(W, a, t, m0, out);
    }
}

}  // namespace q
