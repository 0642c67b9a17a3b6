/* y[M, N] = x[M, K] W[N, K]^T with fp32 x and y, for dense (fp32, bf16, fp16) and weight-only
 * quantized (int8 per output channel, int4 per group of G) weights.
 *
 * Each output y[m, n] is reduced in one fixed order that depends on K alone, never on M, the
 * tiling or the thread: a row's result is the same in any batch (see attention.cpp for why).
 *
 * Dense formats: weights are decoded block by block into an fp32 tile that every activation row
 * uses; two eight-lane accumulators alternate over 16-wide steps of k, then one horizontal sum.
 *
 * Quantized formats work as llama.cpp does: each activation row is quantized in blocks of 32 to
 * int8 with an fp32 scale d (x ~ d * qx), and blocks are multiplied in integers (maddubs):
 *   int8:  y = s_n * sum_b d_b * <qw_b, qx_b>
 *   int4:  y = sum_b d_b * s_g * <q_b, qx_b> + sum_b m_g * d_b * sum(qx_b)      (w = q * s + m)
 * int4 layout: q[N, K/2] bytes; in each group of G, byte j holds weight j (low nibble) and weight
 * j + G/2 (high nibble); s, m fp16 [N, K/G]. int8: qw int8 [N, K] in [-127, 127], s fp32 [N].
 */
#include "vec.hpp"

#include <algorithm>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

static constexpr int NT = 4;   /* weight rows per tile (the dense micro-kernel is written for 4) */
static constexpr int KB = 512; /* dense: columns per tile */
static constexpr int QB = 32;  /* activation quantization block */

enum Fmt { F32 = 0, BF16 = 1, F16 = 2, Q8 = 3, Q4 = 4 };

static inline float half_to_float(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}

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

static void dense(const float *x, float *y, int M, int fmt, int N, int K, const void *w, int nthreads) {
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
                for (int j = 0; j < nt; j++)
                    y[(size_t)m * N + n0 + j] = v8_hsum(acc[((size_t)m * NT + j) * 2] + acc[((size_t)m * NT + j) * 2 + 1]);
        }
    }
}

/* ---------------------------------------------------------------- quantized formats */

struct QAct {
    std::vector<int8_t> q; /* [M, K] */
    std::vector<float> d;  /* [M, K/QB] scale per block */
    std::vector<float> xs; /* [M, K/QB] d * sum(q) per block */
};

static void quantize_rows(const float *x, int M, int K, QAct &a) {
    const int nb = K / QB;
    a.q.resize((size_t)M * K);
    a.d.resize((size_t)M * nb);
    a.xs.resize((size_t)M * nb);
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)m * K + b * QB;
            float amax = 0.0f;
            for (int i = 0; i < QB; i++) amax = std::max(amax, std::fabs(xb[i]));
            const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *qb = &a.q[(size_t)m * K + b * QB];
            int sum = 0;
            for (int i = 0; i < QB; i++) {
                qb[i] = (int8_t)std::nearbyint(xb[i] * id);
                sum += qb[i];
            }
            a.d[(size_t)m * nb + b] = d;
            a.xs[(size_t)m * nb + b] = d * (float)sum;
        }
}

/* <u, s> for 32 unsigned (0..127) and 32 signed bytes, as eight int32 partial sums -> float. */
#ifdef __AVX2__
static inline v8f dot32(__m256i u, __m256i s) {
    const __m256i p16 = _mm256_maddubs_epi16(u, s);
    return m2v(_mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1))));
}
#endif

/* The 32 codes of block b of an int4 weight row, unsigned bytes (0..15). */
static inline void unpack_q4(const uint8_t *row, int G, int b, uint8_t *out32) {
    const int half = G / 2, g = (b * QB) / G, off = (b * QB) % G; /* off: 0, or 32 in a group of 64 */
    const uint8_t *p = row + (size_t)g * half;
    for (int i = 0; i < QB; i++) {
        const int k = off + i;
        out32[i] = k < half ? (p[k] & 15) : (p[k - half] >> 4);
    }
}

#ifdef __AVX2__
static inline __m256i unpack_q4_avx2(const uint8_t *row, int G, int b) {
    const __m256i mask = _mm256_set1_epi8(15);
    if (G == 32) { /* 16 bytes: low nibbles are codes 0..15, high nibbles 16..31 */
        const __m128i raw = _mm_loadu_si128((const __m128i *)(row + (size_t)b * 16));
        const __m128i lo = _mm_and_si128(raw, _mm256_castsi256_si128(mask));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm256_castsi256_si128(mask));
        return _mm256_set_m128i(hi, lo);
    }
    /* G == 64: 32 bytes; block 2g takes the low nibbles, block 2g + 1 the high ones */
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(row + (size_t)(b / 2) * 32));
    return (b & 1) ? _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask) : _mm256_and_si256(raw, mask);
}
#endif

#ifdef __AVX2__
/* MT activation rows x NT weight rows, all blocks: accumulators stay in registers. */
template <int MT>
static inline void q_micro(int fmt, int nb, int K, const uint8_t *codes, const int8_t *const *wrow, const float *coef,
                           const QAct &a, int m0, __m256 out[MT][NT]) {
    __m256 acc[MT][NT];
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NT; j++) acc[i][j] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int b = 0; b < nb; b++) {
        __m256i vx[MT];
        for (int i = 0; i < MT; i++) vx[i] = _mm256_loadu_si256((const __m256i *)&a.q[(size_t)(m0 + i) * K + b * QB]);
        for (int j = 0; j < NT; j++) {
            __m256i vw, vs;
            if (fmt == Q4) {
                vw = _mm256_load_si256((const __m256i *)(codes + ((size_t)j * nb + b) * QB));
            } else {
                vs = _mm256_loadu_si256((const __m256i *)(wrow[j] + b * QB));
                vw = _mm256_sign_epi8(vs, vs);
            }
            for (int i = 0; i < MT; i++) {
                const __m256i sx = fmt == Q4 ? vx[i] : _mm256_sign_epi8(vx[i], vs);
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(vw, sx), ones));
                acc[i][j] = _mm256_fmadd_ps(dot, _mm256_broadcast_ss(coef + ((size_t)(m0 + i) * NT + j) * nb + b), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NT; j++) out[i][j] = acc[i][j];
}
#endif

static void quantized(const float *x, float *y, int M, int fmt, int N, int K, int G, const void *w,
                      const float *scale, const uint16_t *s16, const uint16_t *m16, int nthreads) {
    const int nb = K / QB, ng = fmt == Q4 ? K / G : 0, per = fmt == Q4 ? G / QB : 1;
    QAct a;
    quantize_rows(x, M, K, a);
    std::vector<float> xsg((size_t)M * ng, 0.0f); /* per group: sum over its blocks of d * sum(qx) */
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb && fmt == Q4; b++) xsg[(size_t)m * ng + (b * QB) / G] += a.xs[(size_t)m * nb + b];
    const int ntiles = (N + NT - 1) / NT;
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> sb((size_t)NT * nb, 1.0f), coef((size_t)M * NT * nb);
        std::vector<uint8_t> codes((size_t)NT * nb * QB + 32);
        uint8_t *cd = codes.data() + ((32 - ((uintptr_t)codes.data() & 31)) & 31); /* 32-byte aligned */
#pragma omp for schedule(static)
        for (int t = 0; t < ntiles; t++) {
            const int n0 = t * NT, nt = std::min(NT, N - n0);
            const int8_t *wrow[NT];
            int nrow[NT];
            for (int j = 0; j < NT; j++) {
                const int n = nrow[j] = n0 + std::min(j, nt - 1); /* a short last tile repeats its last row */
                wrow[j] = (const int8_t *)w + (size_t)n * K;
                if (fmt != Q4) continue;
                const uint8_t *row = (const uint8_t *)w + (size_t)n * (K / 2);
                for (int b = 0; b < nb; b++) {
#ifdef __AVX2__
                    _mm256_store_si256((__m256i *)(cd + ((size_t)j * nb + b) * QB), unpack_q4_avx2(row, G, b));
#else
                    unpack_q4(row, G, b, cd + ((size_t)j * nb + b) * QB);
#endif
                }
                const uint16_t *sr = s16 + (size_t)n * ng;
                float *sj = &sb[(size_t)j * nb];
                int g = 0;
                for (; g + 8 <= ng; g += 8) {
                    const v8f v = f16x8(sr + g);
                    if (per == 1) {
                        v8_store(sj + g, v);
                    } else {
                        for (int i = 0; i < 8; i++) sj[(g + i) * 2] = sj[(g + i) * 2 + 1] = v[i];
                    }
                }
                for (; g < ng; g++)
                    for (int r = 0; r < per; r++) sj[g * per + r] = half_to_float(sr[g]);
            }
            /* coef[m][j][b] = d[m][b] * scale of block b of row j */
            for (int m = 0; m < M; m++)
                for (int j = 0; j < NT; j++) {
                    float *c = &coef[((size_t)m * NT + j) * nb];
                    const float *d = &a.d[(size_t)m * nb], *sc = &sb[(size_t)j * nb];
                    for (int b = 0; b < nb; b++) c[b] = d[b] * sc[b];
                }
            for (int m0 = 0; m0 < M;) {
                const int mt = M - m0 >= 2 ? 2 : 1;
                float dots[2][NT];
#ifdef __AVX2__
                __m256 out[2][NT];
                if (mt == 2)
                    q_micro<2>(fmt, nb, K, cd, wrow, coef.data(), a, m0, out);
                else
                    q_micro<1>(fmt, nb, K, cd, wrow, coef.data(), a, m0, out);
                for (int i = 0; i < mt; i++)
                    for (int j = 0; j < NT; j++) dots[i][j] = v8_hsum(m2v(out[i][j]));
#else
                for (int i = 0; i < mt; i++)
                    for (int j = 0; j < NT; j++) {
                        v8f acc = v8_splat(0.0f);
                        const int8_t *qx = &a.q[(size_t)(m0 + i) * K];
                        for (int b = 0; b < nb; b++) {
                            const uint8_t *wc = cd + ((size_t)j * nb + b) * QB;
                            v8f dot;
                            for (int l = 0; l < 8; l++) {
                                int sum = 0;
                                for (int k = b * QB + l * 4; k < b * QB + l * 4 + 4; k++) {
                                    const int wv = fmt == Q4 ? wc[k - b * QB] : wrow[j][k];
                                    sum += wv * qx[k];
                                }
                                dot[l] = (float)sum;
                            }
                            acc = dot * v8_splat(coef[((size_t)(m0 + i) * NT + j) * nb + b]) + acc;
                        }
                        dots[i][j] = v8_hsum(acc);
                    }
#endif
                for (int i = 0; i < mt; i++)
                    for (int j = 0; j < nt; j++) {
                        float s = dots[i][j];
                        if (fmt == Q4) { /* the minimum's share: sum_g m_g * sum over the group's blocks of d * sum(qx) */
                            const float *xg = &xsg[(size_t)(m0 + i) * ng];
                            const uint16_t *mr = m16 + (size_t)nrow[j] * ng;
                            v8f t8 = v8_splat(0.0f);
                            int g = 0;
                            for (; g + 8 <= ng; g += 8) t8 = f16x8(mr + g) * v8_load(xg + g) + t8;
                            float t2 = v8_hsum(t8);
                            for (; g < ng; g++) t2 += half_to_float(mr[g]) * xg[g];
                            s += t2;
                        } else {
                            s *= scale[n0 + j];
                        }
                        y[(size_t)(m0 + i) * N + n0 + j] = s;
                    }
                m0 += mt;
            }
        }
    }
}

extern "C" void cad_linear(const float *x, float *y, int M, int fmt, int N, int K, int G, const void *w,
                           const float *scale, const uint16_t *s16, const uint16_t *m16, int nthreads) {
    if (fmt == Q8 || fmt == Q4)
        quantized(x, y, M, fmt, N, K, G, w, scale, s16, m16, nthreads);
    else
        dense(x, y, M, fmt, N, K, w, nthreads);
}
