/* y[M, N] = x[M, K] W[N, K]^T for dense (fp32, bf16, fp16) and weight-only quantized (int8 per
 * output channel, int4 per group of G with fp16 scale and minimum) weights; x and y are fp32.
 *
 * Each output y[m, n] is reduced in one fixed order: two eight-lane accumulators alternate over
 * 16-wide steps of k, then one horizontal sum. The order depends on K alone, never on M, on the
 * tiling or on the thread that computes it, so a row's result is the same in any batch.
 *
 * Weights are decoded block by block (NT rows x KB columns) into an fp32 scratch tile, once per
 * block, and that tile is used by every activation row: a decode step (M = 1) reads each weight
 * once, and a verification of M tokens costs M FMAs per weight on top of the same decoding.
 *
 * int4 layout: q[N, K/2] bytes; within each group of G, byte j holds weight j (low nibble) and
 * weight j + G/2 (high nibble); w = q * scale + min with scale, min fp16 [N, K/G].
 */
#include "vec.hpp"

#include <algorithm>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

static constexpr int NT = 4; /* weight rows per tile (the micro-kernel below is written for 4) */
static constexpr int KB = 512; /* columns per tile; a multiple of 64 */

enum Fmt { F32 = 0, BF16 = 1, F16 = 2, Q8 = 3, Q4 = 4 };

struct Weights {
    int fmt, N, K, G;
    const void *w;       /* F32/BF16/F16: [N, K]; Q8: int8 [N, K]; Q4: uint8 [N, K/2] */
    const float *scale;  /* Q8: [N] */
    const uint16_t *s16; /* Q4: fp16 scale [N, K/G] */
    const uint16_t *m16; /* Q4: fp16 min [N, K/G] */
};

static inline float half_to_float(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}

#ifdef __AVX2__
static inline v8f m2v(__m256 a) { v8f v; memcpy(&v, &a, sizeof v); return v; }
static inline v8f bf16x8(const uint16_t *p) {
    __m256i i = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    return m2v(_mm256_castsi256_ps(i));
}
static inline v8f f16x8(const uint16_t *p) { return m2v(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p))); }
static inline v8f i8x8(const int8_t *p) {
    return m2v(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))));
}
static inline v8f u8x8(const uint8_t *p) {
    return m2v(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))));
}
#else
static inline v8f bf16x8(const uint16_t *p) {
    v8i v;
    for (int i = 0; i < 8; i++) v[i] = (int32_t)p[i] << 16;
    v8f f;
    memcpy(&f, &v, sizeof f);
    return f;
}
static inline v8f f16x8(const uint16_t *p) {
    v8f f;
    for (int i = 0; i < 8; i++) f[i] = half_to_float(p[i]);
    return f;
}
static inline v8f i8x8(const int8_t *p) {
    v8f f;
    for (int i = 0; i < 8; i++) f[i] = (float)p[i];
    return f;
}
static inline v8f u8x8(const uint8_t *p) {
    v8f f;
    for (int i = 0; i < 8; i++) f[i] = (float)p[i];
    return f;
}
#endif

/* Decode weight row n, columns [k0, k0 + kn) into dst (fp32). */
static void decode_row(const Weights &W, int n, int k0, int kn, float *dst) {
    const size_t row = (size_t)n * W.K;
    switch (W.fmt) {
    case BF16: {
        const uint16_t *p = (const uint16_t *)W.w + row + k0;
        for (int k = 0; k < kn; k += 8) v8_store(dst + k, bf16x8(p + k));
        break;
    }
    case F16: {
        const uint16_t *p = (const uint16_t *)W.w + row + k0;
        for (int k = 0; k < kn; k += 8) v8_store(dst + k, f16x8(p + k));
        break;
    }
    case Q8: {
        const int8_t *p = (const int8_t *)W.w + row + k0;
        for (int k = 0; k < kn; k += 8) v8_store(dst + k, i8x8(p + k));
        break;
    }
    case Q4: {
        const int G = W.G, half = G / 2, ng = W.K / G;
        const uint8_t *p = (const uint8_t *)W.w + row / 2;
        for (int g = k0 / G; g < (k0 + kn) / G; g++) {
            const uint8_t *b = p + (size_t)g * half;
            const v8f s = v8_splat(half_to_float(W.s16[(size_t)n * ng + g]));
            const v8f m = v8_splat(half_to_float(W.m16[(size_t)n * ng + g]));
            float *d = dst + g * G - k0;
            for (int j = 0; j < half; j += 16) { /* 16 bytes: weights j..j+15 (low), j+half.. (high) */
#ifdef __AVX2__
                const __m128i raw = _mm_loadu_si128((const __m128i *)(b + j)), mask = _mm_set1_epi8(15);
                const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
                v8_store(d + j, m2v(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo))) * s + m);
                v8_store(d + j + 8, m2v(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)))) * s + m);
                v8_store(d + half + j, m2v(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi))) * s + m);
                v8_store(d + half + j + 8, m2v(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))) * s + m);
#else
                for (int i = 0; i < 16; i++) {
                    d[j + i] = (float)(b[j + i] & 15) * s[0] + m[0];
                    d[half + j + i] = (float)(b[j + i] >> 4) * s[0] + m[0];
                }
#endif
            }
        }
        break;
    }
    }
}

extern "C" void cad_linear(const float *x, float *y, int M, int fmt, int N, int K, int G, const void *w,
                           const float *scale, const uint16_t *s16, const uint16_t *m16, int nthreads) {
    const Weights W{fmt, N, K, G, w, scale, s16, m16};
    const int ntiles = (N + NT - 1) / NT;
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> tile((size_t)NT * KB);
        std::vector<v8f> acc((size_t)M * NT * 2);
#pragma omp for schedule(static)
        for (int t = 0; t < ntiles; t++) {
            const int n0 = t * NT, nt = std::min(NT, N - n0);
            std::fill(acc.begin(), acc.end(), v8_splat(0.0f));
            for (int k0 = 0; k0 < K; k0 += KB) {
                const int kn = std::min(KB, K - k0);
                const float *rows[NT];
                for (int j = 0; j < nt; j++) {
                    if (fmt == F32) {
                        rows[j] = (const float *)w + (size_t)(n0 + j) * K + k0;
                    } else {
                        decode_row(W, n0 + j, k0, kn, tile.data() + (size_t)j * KB);
                        rows[j] = tile.data() + (size_t)j * KB;
                    }
                }
                for (int j = nt; j < NT; j++) rows[j] = rows[0]; /* a short last tile: computed, not stored */
                for (int m = 0; m < M; m++) {
                    const float *xr = x + (size_t)m * K + k0;
                    v8f *a = &acc[(size_t)m * NT * 2];
                    v8f a00 = a[0], a01 = a[1], a10 = a[2], a11 = a[3], a20 = a[4], a21 = a[5], a30 = a[6], a31 = a[7];
                    for (int k = 0; k < kn; k += 16) {
                        const v8f x0 = v8_load(xr + k), x1 = v8_load(xr + k + 8);
                        a00 += v8_load(rows[0] + k) * x0;
                        a01 += v8_load(rows[0] + k + 8) * x1;
                        a10 += v8_load(rows[1] + k) * x0;
                        a11 += v8_load(rows[1] + k + 8) * x1;
                        a20 += v8_load(rows[2] + k) * x0;
                        a21 += v8_load(rows[2] + k + 8) * x1;
                        a30 += v8_load(rows[3] + k) * x0;
                        a31 += v8_load(rows[3] + k + 8) * x1;
                    }
                    a[0] = a00, a[1] = a01, a[2] = a10, a[3] = a11, a[4] = a20, a[5] = a21, a[6] = a30, a[7] = a31;
                }
            }
            for (int m = 0; m < M; m++)
                for (int j = 0; j < nt; j++) {
                    float s = v8_hsum(acc[((size_t)m * NT + j) * 2] + acc[((size_t)m * NT + j) * 2 + 1]);
                    y[(size_t)m * N + n0 + j] = fmt == Q8 ? s * scale[n0 + j] : s;
                }
        }
    }
}
