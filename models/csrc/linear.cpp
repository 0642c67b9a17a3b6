/* y[M, N] = x[M, K] W[N, K]^T with fp32 x and y, for dense (fp32, bf16, fp16) and weight-only
 * quantized (int8 per output channel, int4 and int2 in blocks: qlinear.hpp) weights.
 *
 * Each output y[m, n] is reduced in one fixed order that depends on K alone, never on M, the
 * tiling or the thread: a row's result is the same in any batch (see attention.cpp for why).
 *
 * Dense formats: weights are decoded block by block into an fp32 tile that every activation row
 * uses; two eight-lane accumulators alternate over 16-wide steps of k, then one horizontal sum.
 * Builds with FMA multiply-add in one rounding (v8_fma), the portable build in two: dense results
 * agree between the FMA paths, not with the portable one (the quantized formats agree everywhere).
 */
#include "qlinear.hpp"
#include "vec.hpp"

#include <algorithm>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

static constexpr int NT = 4;   /* weight rows per tile (the dense micro-kernel is written for 4) */
static constexpr int KB = 512; /* dense: columns per tile */

enum Fmt { F32 = 0, BF16 = 1, F16 = 2, Q8 = 3, Q4 = 4, Q2 = 5 };
using q::half_to_float;

/* ---------------------------------------------------------------- dense formats */

#ifdef __AVX2__
static inline v8f m2v(__m256 a) { v8f v; memcpy(&v, &a, sizeof v); return v; }
static inline __m256 v2m(v8f v) { __m256 a; memcpy(&a, &v, sizeof a); return a; }
static inline v8f bf16x8(const uint16_t *p) {
    __m256i i = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    return m2v(_mm256_castsi256_ps(i));
}
static inline v8f f16x8(const uint16_t *p) { return m2v(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p))); }
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
#endif

static void dense(const float *x, float *y, int M, int fmt, int N, int K, const void *w, int nthreads, int accumulate,
                  int ldy) {
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
                    const size_t off = (size_t)(n0 + j) * K + k0;
                    float *d = tile.data() + (size_t)j * KB;
                    if (fmt == F32) {
                        rows[j] = (const float *)w + off;
                        continue;
                    }
                    const uint16_t *p = (const uint16_t *)w + off;
                    for (int k = 0; k < kn; k += 8) v8_store(d + k, fmt == BF16 ? bf16x8(p + k) : f16x8(p + k));
                    rows[j] = d;
                }
                for (int j = nt; j < NT; j++) rows[j] = rows[0]; /* a short last tile: computed, not stored */
                for (int m = 0; m < M; m++) {
                    const float *xr = x + (size_t)m * K + k0;
                    v8f *a = &acc[(size_t)m * NT * 2];
                    v8f a00 = a[0], a01 = a[1], a10 = a[2], a11 = a[3], a20 = a[4], a21 = a[5], a30 = a[6], a31 = a[7];
                    for (int k = 0; k < kn; k += 16) {
                        const v8f x0 = v8_load(xr + k), x1 = v8_load(xr + k + 8);
                        a00 = v8_fma(v8_load(rows[0] + k), x0, a00);
                        a01 = v8_fma(v8_load(rows[0] + k + 8), x1, a01);
                        a10 = v8_fma(v8_load(rows[1] + k), x0, a10);
                        a11 = v8_fma(v8_load(rows[1] + k + 8), x1, a11);
                        a20 = v8_fma(v8_load(rows[2] + k), x0, a20);
                        a21 = v8_fma(v8_load(rows[2] + k + 8), x1, a21);
                        a30 = v8_fma(v8_load(rows[3] + k), x0, a30);
                        a31 = v8_fma(v8_load(rows[3] + k + 8), x1, a31);
                    }
                    a[0] = a00, a[1] = a01, a[2] = a10, a[3] = a11, a[4] = a20, a[5] = a21, a[6] = a30, a[7] = a31;
                }
            }
            for (int m = 0; m < M; m++)
                for (int j = 0; j < nt; j++)
                {
                    const float s = v8_hsum(acc[((size_t)m * NT + j) * 2] + acc[((size_t)m * NT + j) * 2 + 1]);
                    float &out = y[(size_t)m * ldy + n0 + j];
                    out = accumulate ? out + s : s;
                }
        }
    }
}

/* y = x W^T, or y += x W^T with accumulate (the residual add, in the same order as a separate add).
 * y's rows are ldy floats apart (ldy = N, or the width of a larger buffer whose columns this call
 * fills: a column split writes each unit's columns straight into one shared output).
 * Format arrays: int8: a1 = scale fp32; int4, int2: a1 = sc, a2 = mn, a3 = S, a4 = Mn (qlinear.hpp's
 * layout; `row0`: the first output row within the first tile of the arrays; dense formats: 0). */
extern "C" void cad_linear(const float *x, float *y, int M, int fmt, int N, int K, const void *w, const void *a1,
                           const void *a2, const void *a3, const void *a4, int row0, int nthreads, int accumulate,
                           int ldy) {
    if (ldy < N) ldy = N;
    if (fmt == Q8 || fmt == Q4 || fmt == Q2) {
        q::qlinear(x, M, q::QW(fmt, N, K, row0, w, a1, a2, a3, a4), y, ldy, accumulate, nthreads);
    } else {
        dense(x, y, M, fmt, N, K, w, nthreads, accumulate, ldy);
    }
}

/* The greedy answer of an output head in parts (models/transformer.py `head_steps`), in one parallel region: each
 * part's logits as cad_linear makes them, then each row's first maximum, a NaN above every number (as
 * models/sampling.py `HeadArgmax` folds torch's max), part after part in token order. `recs`: ten int64s a part,
 * its first token then its product as `QuantLinear.record` gives it (int8, int4 or int2). best [M] and ids [M]: the
 * running maximum and its token, updated in place. `div`: the logits divided by it first (Granite's logit scale), as
 * torch divides them. */
extern "C" void cad_head_argmax(const int64_t *recs, int nparts, const float *x, int M, float div, float *best,
                                int64_t *ids, int nthreads) {
    int widest = 0;
    for (int p = 0; p < nparts; p++) widest = std::max(widest, (int)recs[(size_t)p * 10 + 2]);
    std::vector<float> y((size_t)M * widest);
    q::QA qa;
#pragma omp parallel num_threads(nthreads)
    for (int p = 0; p < nparts; p++) {
        const int64_t *r = recs + (size_t)p * 10;
        const q::QW w = q::record_qw(r + 1);
        q::qlinear_in(x, M, w, y.data(), w.N, 0, qa);
#pragma omp barrier
#pragma omp for
        for (int m = 0; m < M; m++) { /* (the loop's own barrier: y is free for the next part after it) */
            const float *row = y.data() + (size_t)m * w.N;
            for (int j = 0; j < w.N; j++) {
                const float v = div == 1.0f ? row[j] : row[j] / div;
                if (v != v ? best[m] == best[m] : v > best[m]) {
                    best[m] = v;
                    ids[m] = r[0] + j;
                }
            }
        }
    }
}
