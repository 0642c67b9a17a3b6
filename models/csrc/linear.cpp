/* y[M, N] = x[M, K] W[N, K]^T with fp32 x and y, for dense (fp32, bf16, fp16) and weight-only
 * quantized (int8 per output channel, int4 and int2 in blocks) weights.
 *
 * Each output y[m, n] is reduced in one fixed order that depends on K alone, never on M, the
 * tiling or the thread: a row's result is the same in any batch (see attention.cpp for why).
 *
 * Dense formats: weights are decoded block by block into an fp32 tile that every activation row
 * uses; two eight-lane accumulators alternate over 16-wide steps of k, then one horizontal sum.
 *
 * Quantized formats multiply in integers, as llama.cpp's K-quants do. Each activation row is
 * quantized per super-block of 256 to int8 with one fp32 scale (x ~ d qx). Within a super-block
 * the int8 x int8 (or x int4) products and the int4 8-bit sub-scales are summed in int32
 * (maddubs, then madd), and only once per super-block does the sum meet a float scale:
 *   int8:  y = s_n  * sum_sb d_sb * sum_k qw qx
 *   int4:  y = sum_sb d_sb * (S_sb * sum_g sc_g <q_g, qx_g>  -  M_sb * sum_g mn_g sum(qx_g))
 * with w = S_sb sc_g q - M_sb mn_g (q 0..15; sc, mn 8-bit per 32; S, M fp16 per 256).
 * int4 codes: q[N, K/2] bytes; in each group of 32, byte j holds weight j (low nibble) and j + 16.
 * Two neighbouring groups of a super-block are one 32-byte load: its low nibbles are weights 0..15
 * of both groups, its high nibbles weights 16..31, so the activations are kept in that order too
 * (QAct::qp) and one maddubs covers 32 weights with no shuffling (as in llama.cpp's q4_K dot).
 * An integer sum is exact in any order; what fixes the float result is which of the eight int32
 * lanes each product lands in (pair_lane below), and every path here uses the same lanes.
 * int2 has int4's scales and minimums with codes 0..3: q[N, K/4] bytes; each run of 128 weights (four
 * groups) is 32 bytes, byte l holding weight l of the run's group s in bits 2s..2s+1, so a shift and a
 * mask of one 32-byte load give a group in weight order (activations in plain order; weights
 * 4i..4i+3 of every group add into lane i). K is a multiple of 128.
 */
#include "vec.hpp"

#include <algorithm>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

static constexpr int NT = 4;   /* weight rows per tile (the dense micro-kernel is written for 4) */
static constexpr int KB = 512; /* dense: columns per tile */
static constexpr int QG = 32;  /* int4 sub-block: one 8-bit scale and minimum */
static constexpr int SB = 256; /* super-block: activation scale, int4 fp16 scales; the last may be short */

enum Fmt { F32 = 0, BF16 = 1, F16 = 2, Q8 = 3, Q4 = 4, Q2 = 5 };

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
                {
                    const float s = v8_hsum(acc[((size_t)m * NT + j) * 2] + acc[((size_t)m * NT + j) * 2 + 1]);
                    float &out = y[(size_t)m * ldy + n0 + j];
                    out = accumulate ? out + s : s;
                }
        }
    }
}

/* ---------------------------------------------------------------- quantized formats */

struct QAct {
    std::vector<int8_t> q;  /* [M, K] */
    std::vector<int8_t> qp; /* [M, K] q with each pair of groups (g, g + 1) in a super-block as
                               g[0:16] g+1[0:16] g[16:32] g+1[16:32]; a group left without a pair as is */
    std::vector<float> d;   /* [M, NSB] scale per super-block */
    std::vector<float> xs;  /* [M, K/QG] d * sum(q) per 32-group: what a group's minimum multiplies */
};

/* int4: also the group sums (xs) and the paired order (qp) its kernels read; int2: the group sums;
 * int8 needs neither. */
static void quantize_rows(const float *x, int M, int K, QAct &a, int fmt) {
    const int nsb = (K + SB - 1) / SB, ng = K / QG;
    const bool sums = fmt != Q8, int4 = fmt == Q4;
    a.q.resize((size_t)M * K);
    a.d.resize((size_t)M * nsb);
    if (sums) a.xs.resize((size_t)M * ng);
    if (int4) a.qp.resize((size_t)M * K);
    for (int m = 0; m < M; m++)
        for (int sb = 0; sb < nsb; sb++) {
            const int k0 = sb * SB, kn = std::min(SB, K - k0);
            const float *xb = x + (size_t)m * K + k0;
            float amax = 0.0f;
            for (int i = 0; i < kn; i++) amax = std::max(amax, std::fabs(xb[i]));
            const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *qb = &a.q[(size_t)m * K + k0];
            for (int i = 0; i < kn; i++) qb[i] = (int8_t)std::nearbyint(xb[i] * id);
            const float d = amax / 127.0f;
            a.d[(size_t)m * nsb + sb] = d;
            if (!sums) continue;
            for (int g = 0; g < kn / QG; g++) {
                int sum = 0;
                for (int i = 0; i < QG; i++) sum += qb[g * QG + i];
                a.xs[(size_t)m * ng + k0 / QG + g] = d * (float)sum;
            }
            if (!int4) continue;
            int8_t *pb = &a.qp[(size_t)m * K + k0];
            const int gn = kn / QG;
            for (int g = 0; g + 1 < gn; g += 2)
                for (int h = 0; h < 2; h++)      /* weights 0..15, then 16..31 */
                    for (int e = 0; e < 2; e++)  /* of group g, then g + 1 */
                        memcpy(pb + g * QG + h * 32 + e * 16, qb + (g + e) * QG + h * 16, 16);
            if (gn & 1) memcpy(pb + (gn - 1) * QG, qb + (gn - 1) * QG, QG);
        }
}

/* The int32 lane that weight k of group g (g0: the super-block's first group) adds into: a paired
 * group puts products of weights 4i..4i+3 and 16+4i..16+4i+3 in lane i (first of the pair) or
 * 4 + i (second); a group left without a pair (the last of an odd count) puts weights 4i..4i+3 in
 * lane i. */
static inline int pair_lane(int g, int g0, int g1, int k) {
    const bool paired = !((g - g0) == g1 - g0 - 1 && ((g1 - g0) & 1));
    return paired ? ((g - g0) & 1) * 4 + (k & 15) / 4 : k / 4;
}

struct QWeights {
    int fmt, N, K;
    const void *w;      /* int8 [N, K], int4 codes [N, K/2] or int2 codes [N, K/4] */
    const float *scale; /* int8: [N] */
    const uint8_t *sc;  /* int4, int2: [N, K/32] */
    const uint8_t *mn;  /* int4, int2: [N, K/32] */
    const uint16_t *S;  /* int4, int2: fp16 [N, NSB] */
    const uint16_t *Mn; /* int4, int2: fp16 [N, NSB] */
};

/* The 32 codes of group g of an int4 row, as unsigned bytes in weight order. */
static inline void unpack_group(const uint8_t *row, int g, uint8_t *out) {
    const uint8_t *p = row + (size_t)g * 16;
#ifdef __AVX2__
    const __m128i raw = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(15);
    _mm_store_si128((__m128i *)out, _mm_and_si128(raw, mask));
    _mm_store_si128((__m128i *)(out + 16), _mm_and_si128(_mm_srli_epi16(raw, 4), mask));
#else
    for (int i = 0; i < 16; i++) out[i] = p[i] & 15, out[16 + i] = p[i] >> 4;
#endif
}

/* The 32 codes of group g of an int2 row, as unsigned bytes in weight order. */
static inline void unpack_group2(const uint8_t *row, int g, uint8_t *out) {
    const uint8_t *p = row + (size_t)(g / 4) * 32;
    const int shift = 2 * (g % 4);
    for (int i = 0; i < QG; i++) out[i] = (p[i] >> shift) & 3;
}

/* The minimums' share of one output: sum_g off_g * xs_g, a lane per group in blocks of eight,
 * then the tail. One out-of-line function, so every caller gets the same float operations. */
__attribute__((noinline)) static float min_share(const float *off, const float *xs, int ng) {
    v8f t8 = v8_splat(0.0f);
    int g = 0;
    for (; g + 8 <= ng; g += 8) t8 = v8_load(off + g) * v8_load(xs + g) + t8;
    float tail = 0.0f;
    for (; g < ng; g++) tail += off[g] * xs[g];
    return v8_hsum(t8) + tail;
}

/* off[g] = M_sb(g) * mn_g for one int4 weight row. */
static inline void group_minimums(const QWeights &W, size_t n, float *off) {
    const int ng = W.K / QG, nsb = (W.K + SB - 1) / SB;
    const uint8_t *mn = W.mn + n * ng;
    for (int sb = 0; sb < nsb; sb++) {
        const float mf = half_to_float(W.Mn[n * nsb + sb]);
        const int g0 = sb * SB / QG, g1 = std::min(ng, g0 + SB / QG);
        int g = g0;
#ifdef __AVX2__
        if (g1 - g0 == 8) {
            const v8f m8 = m2v(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mn + g0)))));
            v8_store(off + g0, m8 * v8_splat(mf));
            g = g1;
        }
#endif
        for (; g < g1; g++) off[g] = mf * (float)mn[g];
    }
}

#ifdef __AVX2__
/* Sub-scales of a pair of groups (2p, 2p + 1 of a super-block) as int16 lanes: eight of the
 * first, then eight of the second. `s16`: the super-block's eight sub-scales as int16 in both
 * 128-bit halves. */
static inline __m256i pair_scales(__m256i s16, int p) {
    const __m256i pick = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                          2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    return _mm256_shuffle_epi8(s16, _mm256_add_epi8(pick, _mm256_set1_epi8((char)(4 * p))));
}

/* A super-block's sub-scales of one row (g1 - g0 <= 8 of them) as int16 in both halves. */
static inline __m256i block_scales(const uint8_t *sc, int g0, int g1) {
    __m128i b;
    if (g1 - g0 == 8) {
        b = _mm_loadl_epi64((const __m128i *)(sc + g0));
    } else {
        uint8_t t[8] = {0};
        memcpy(t, sc + g0, g1 - g0);
        b = _mm_loadl_epi64((const __m128i *)t);
    }
    return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(b));
}

/* sum of 32 weights x 32 activations of one pair of groups, scaled: lo/hi the codes' low and
 * high nibbles, xa/xb the activations in QAct::qp order, s the pair's scales. */
static inline __m256i pair_dot(__m256i lo, __m256i hi, __m256i xa, __m256i xb, __m256i s) {
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb)), s);
}
#endif

/* One tile: NT (= 4) weight rows `rows`, activation rows m0 .. m0 + MT (MT = 1 or 2): int8, and
 * int4 and int2 where there is no AVX2 (q4_tile and q2_rows otherwise).
 * codes [NT, K/QG, 32]: the tile's int4 codes unpacked (AVX2: a pair of groups as their low
 * nibbles, then their high nibbles; a group left alone, and without AVX2 every group, in weight
 * order; int2: every group in weight order); sc16 [NT, K/QG]: sub-scales as int16; Sf [NT, NSB]: super-scales as floats;
 * off [NT, K/QG]: each group's minimum M_sb mn_g as a float. */
template <int FMT, int MT>
static void q_rows(const QWeights &W, const QAct &a, int m0, const int *rows, const uint8_t *codes, const int16_t *sc16,
                   const float *Sf, const float *off, float out[][NT]) {
    const int K = W.K, nsb = (K + SB - 1) / SB, ng = K / QG;
    v8f accv[MT][NT];
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NT; j++) accv[i][j] = v8_splat(0.0f);
    for (int sb = 0; sb < nsb; sb++) {
        const int g0 = sb * SB / QG, g1 = std::min(ng, g0 + SB / QG);
#ifdef __AVX2__
        static_assert(FMT == Q8, "with AVX2, int4 tiles go through q4_tile");
        const __m256i ones = _mm256_set1_epi16(1);
        /* Two weight rows at a time over the super-block's groups, so that the four accumulators,
         * two activation vectors and the weights stay in registers (no spills). */
        __m256i c00 = _mm256_setzero_si256(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;
#define CAD_PAIR(J0, J1, A0, A1, B0, B1)                                                                              \
    for (int g = g0; g < g1; g++) {                                                                                   \
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)&a.q[(size_t)m0 * K + g * QG]);                         \
        const __m256i x1 = MT == 2 ? _mm256_loadu_si256((const __m256i *)&a.q[(size_t)(m0 + 1) * K + g * QG]) : x0;    \
        const __m256i r0 = _mm256_loadu_si256((const __m256i *)((const int8_t *)W.w + (size_t)rows[J0] * K + g * QG)); \
        const __m256i r1 = _mm256_loadu_si256((const __m256i *)((const int8_t *)W.w + (size_t)rows[J1] * K + g * QG)); \
        const __m256i w0 = _mm256_sign_epi8(r0, r0), w1 = _mm256_sign_epi8(r1, r1);                                   \
        A0 = _mm256_add_epi32(A0, _mm256_madd_epi16(_mm256_maddubs_epi16(w0, _mm256_sign_epi8(x0, r0)), ones));       \
        B0 = _mm256_add_epi32(B0, _mm256_madd_epi16(_mm256_maddubs_epi16(w1, _mm256_sign_epi8(x0, r1)), ones));       \
        if (MT == 2) {                                                                                                \
            A1 = _mm256_add_epi32(A1, _mm256_madd_epi16(_mm256_maddubs_epi16(w0, _mm256_sign_epi8(x1, r0)), ones));   \
            B1 = _mm256_add_epi32(B1, _mm256_madd_epi16(_mm256_maddubs_epi16(w1, _mm256_sign_epi8(x1, r1)), ones));   \
        }                                                                                                             \
    }
        CAD_PAIR(0, 1, c00, c10, c01, c11)
        CAD_PAIR(2, 3, c02, c12, c03, c13)
#undef CAD_PAIR
        const __m256i acc[2][NT] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}};
#endif
        for (int i = 0; i < MT; i++) {
            const float d = a.d[(size_t)(m0 + i) * nsb + sb];
            const int8_t *qx = &a.q[(size_t)(m0 + i) * K];
            (void)qx;
            for (int j = 0; j < NT; j++) {
#ifdef __AVX2__
                v8i ii;
                memcpy(&ii, &acc[i][j], sizeof ii);
#else
                v8i ii = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int g = g0; g < g1; g++)
                    for (int k = 0; k < QG; k++) {
                        const int wv = FMT != Q8 ? (int)codes[((size_t)j * ng + g) * QG + k] * sc16[(size_t)j * ng + g]
                                                 : ((const int8_t *)W.w)[(size_t)rows[j] * K + g * QG + k];
                        ii[FMT == Q4 ? pair_lane(g, g0, g1, k) : k / 4] += wv * qx[g * QG + k];
                    }
#endif
                const v8f f = __builtin_convertvector(ii, v8f);
                accv[i][j] = f * v8_splat(FMT != Q8 ? d * Sf[(size_t)j * nsb + sb] : d) + accv[i][j];
            }
        }
    }
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NT; j++) {
            const float mins = FMT != Q8 ? min_share(off + (size_t)j * ng, &a.xs[(size_t)(m0 + i) * ng], ng) : 0.0f;
            out[i][j] = v8_hsum(accv[i][j]) - mins;
        }
}

#ifdef __AVX2__
/* Q4, MT (1..4) activation rows against one tile of NT weight rows unpacked in `codes` (pair
 * layout, see q_rows): one weight row at a time, its codes and scales loaded once per pair of
 * groups for all MT rows. Same integer lanes and float steps as q_rows and q4_row. */
template <int MT>
static void q4_tile(const QWeights &W, const QAct &a, int m0, const int *rows, const uint8_t *codes, const int16_t *sc16,
                    const float *Sf, const float *off, float out[][NT]) {
    const int K = W.K, nsb = (K + SB - 1) / SB, ng = K / QG;
    v8f accv[MT][NT];
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NT; j++) accv[i][j] = v8_splat(0.0f);
    const int8_t *xq[MT];
    for (int i = 0; i < MT; i++) xq[i] = &a.qp[(size_t)(m0 + i) * K];
    for (int sb = 0; sb < nsb; sb++) {
        const int g0 = sb * SB / QG, g1 = std::min(ng, g0 + SB / QG), gp = g0 + ((g1 - g0) & ~1);
        float d[MT];
        for (int i = 0; i < MT; i++) d[i] = a.d[(size_t)(m0 + i) * nsb + sb];
        for (int j = 0; j < NT; j++) {
            const __m256i t = block_scales(W.sc + (size_t)rows[j] * ng, g0, g1);
            __m256i acc[MT];
            for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_si256();
            for (int g = g0; g < gp; g += 2) {
                const uint8_t *p = codes + ((size_t)j * ng + g) * QG;
                const __m256i lo = _mm256_load_si256((const __m256i *)p), hi = _mm256_load_si256((const __m256i *)(p + 32));
                const __m256i sc = pair_scales(t, (g - g0) / 2);
                for (int i = 0; i < MT; i++)
                    acc[i] = _mm256_add_epi32(acc[i], pair_dot(lo, hi, _mm256_loadu_si256((const __m256i *)(xq[i] + g * QG)),
                                                               _mm256_loadu_si256((const __m256i *)(xq[i] + g * QG + 32)), sc));
            }
            if (gp < g1) {
                const __m256i w = _mm256_load_si256((const __m256i *)(codes + ((size_t)j * ng + gp) * QG));
                const __m256i sc = _mm256_set1_epi16(sc16[(size_t)j * ng + gp]);
                for (int i = 0; i < MT; i++)
                    acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)(xq[i] + gp * QG))), sc));
            }
            for (int i = 0; i < MT; i++) {
                v8i ii;
                memcpy(&ii, &acc[i], sizeof ii);
                accv[i][j] = __builtin_convertvector(ii, v8f) * v8_splat(d[i] * Sf[(size_t)j * nsb + sb]) + accv[i][j];
            }
        }
    }
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NT; j++)
            out[i][j] = v8_hsum(accv[i][j]) - min_share(off + (size_t)j * ng, &a.xs[(size_t)(m0 + i) * ng], ng);
}
#endif

#ifdef __AVX2__
/* Q4, one activation row: codes, sub-scales and minimums decoded in registers, no tile buffers.
 * Same arithmetic as q_rows (exact integer sums in the same lanes, then the same float steps in
 * the same order). */
static void q4_row(const QWeights &W, const QAct &a, int m, const int *rows, float *out) {
    const int K = W.K, nsb = (K + SB - 1) / SB, ng = K / QG;
    const size_t PF = std::min<size_t>((size_t)NT * (K / 2) + 1024, 16384); /* about a tile ahead: the hardware prefetcher
                                                   loses NT interleaved short streams */
    const __m128i mask = _mm_set1_epi8(15);
    const __m256i mask2 = _mm256_set1_epi8(15);
    v8f accv[NT];
    for (int j = 0; j < NT; j++) accv[j] = v8_splat(0.0f);
    const float *xs = &a.xs[(size_t)m * ng];
    const int8_t *xq = &a.qp[(size_t)m * K];
    for (int sb = 0; sb < nsb; sb++) {
        const int g0 = sb * SB / QG, g1 = std::min(ng, g0 + SB / QG), gp = g0 + ((g1 - g0) & ~1);
        const float d = a.d[(size_t)m * nsb + sb];
        __m256i acc[NT], s16[NT];
        for (int j = 0; j < NT; j++) {
            acc[j] = _mm256_setzero_si256();
            s16[j] = block_scales(W.sc + (size_t)rows[j] * ng, g0, g1);
        }
        for (int g = g0; g < gp; g += 2) {
            const __m256i xa = _mm256_loadu_si256((const __m256i *)(xq + g * QG));
            const __m256i xb = _mm256_loadu_si256((const __m256i *)(xq + g * QG + 32));
            for (int j = 0; j < NT; j++) {
                const uint8_t *p = (const uint8_t *)W.w + (size_t)rows[j] * (K / 2) + g * 16;
                _mm_prefetch((const char *)p + PF, _MM_HINT_T0);
                const __m256i raw = _mm256_loadu_si256((const __m256i *)p);
                const __m256i lo = _mm256_and_si256(raw, mask2), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask2);
                acc[j] = _mm256_add_epi32(acc[j], pair_dot(lo, hi, xa, xb, pair_scales(s16[j], (g - g0) / 2)));
            }
        }
        if (gp < g1) { /* the last group of an odd count */
            const int g = gp;
            const __m256i vx = _mm256_loadu_si256((const __m256i *)(xq + g * QG));
            for (int j = 0; j < NT; j++) {
                const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint8_t *)W.w + (size_t)rows[j] * (K / 2) + g * 16));
                const __m256i vw = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
                const __m256i vs = _mm256_set1_epi16((int16_t)W.sc[(size_t)rows[j] * ng + g]);
                acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(vw, vx), vs));
            }
        }
        for (int j = 0; j < NT; j++) {
            const size_t n = rows[j];
            v8i ii;
            memcpy(&ii, &acc[j], sizeof ii);
            accv[j] = __builtin_convertvector(ii, v8f) * v8_splat(d * half_to_float(W.S[n * nsb + sb])) + accv[j];
        }
    }
    float off[SB * 64 / QG]; /* K up to 16384 */
    for (int j = 0; j < NT; j++) {
        group_minimums(W, rows[j], off);
        out[j] = v8_hsum(accv[j]) - min_share(off, xs, ng);
    }
}
#endif

#ifdef __AVX2__
/* Q4, MT (2..8) activation rows against one tile of NT weight rows, decoded in registers straight
 * from the packed codes as q4_row does: per weight row and pair of groups, one 32-byte load, two
 * masks and a shuffle of the scales serve all MT rows (eight accumulators still fit the 16 ymm
 * registers). For a narrow verification this beats unpacking the tile first (q4_tile), which pays
 * off only when more rows share the unpacked codes (5 rows: ~140 ms a pass of the 1.5B against ~185).
 * Same integer lanes and float steps as q4_row and q_rows. */
template <int MT>
static void q4_rows(const QWeights &W, const QAct &a, int m0, const int *rows, float out[][NT]) {
    const int K = W.K, nsb = (K + SB - 1) / SB, ng = K / QG;
    const size_t PF = std::min<size_t>((size_t)NT * (K / 2) + 1024, 16384);
    const __m128i mask = _mm_set1_epi8(15);
    const __m256i mask2 = _mm256_set1_epi8(15);
    v8f accv[MT][NT];
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NT; j++) accv[i][j] = v8_splat(0.0f);
    const int8_t *xq[MT];
    for (int i = 0; i < MT; i++) xq[i] = &a.qp[(size_t)(m0 + i) * K];
    for (int sb = 0; sb < nsb; sb++) {
        const int g0 = sb * SB / QG, g1 = std::min(ng, g0 + SB / QG), gp = g0 + ((g1 - g0) & ~1);
        for (int j = 0; j < NT; j++) {
            const uint8_t *row = (const uint8_t *)W.w + (size_t)rows[j] * (K / 2);
            const __m256i s16 = block_scales(W.sc + (size_t)rows[j] * ng, g0, g1);
            __m256i acc[MT];
            for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_si256();
            for (int g = g0; g < gp; g += 2) {
                const uint8_t *p = row + g * 16;
                _mm_prefetch((const char *)p + PF, _MM_HINT_T0);
                const __m256i raw = _mm256_loadu_si256((const __m256i *)p);
                const __m256i lo = _mm256_and_si256(raw, mask2), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask2);
                const __m256i sc = pair_scales(s16, (g - g0) / 2);
                for (int i = 0; i < MT; i++)
                    acc[i] = _mm256_add_epi32(acc[i], pair_dot(lo, hi, _mm256_loadu_si256((const __m256i *)(xq[i] + g * QG)),
                                                               _mm256_loadu_si256((const __m256i *)(xq[i] + g * QG + 32)), sc));
            }
            if (gp < g1) { /* the last group of an odd count */
                const __m128i raw = _mm_loadu_si128((const __m128i *)(row + gp * 16));
                const __m256i vw = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
                const __m256i vs = _mm256_set1_epi16((int16_t)W.sc[(size_t)rows[j] * ng + gp]);
                for (int i = 0; i < MT; i++)
                    acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(vw, _mm256_loadu_si256((const __m256i *)(xq[i] + gp * QG))), vs));
            }
            const float S = half_to_float(W.S[(size_t)rows[j] * nsb + sb]);
            for (int i = 0; i < MT; i++) {
                v8i ii;
                memcpy(&ii, &acc[i], sizeof ii);
                accv[i][j] = __builtin_convertvector(ii, v8f) * v8_splat(a.d[(size_t)(m0 + i) * nsb + sb] * S) + accv[i][j];
            }
        }
    }
    float off[SB * 64 / QG]; /* K up to 16384 */
    for (int j = 0; j < NT; j++) {
        group_minimums(W, rows[j], off);
        for (int i = 0; i < MT; i++) out[i][j] = v8_hsum(accv[i][j]) - min_share(off, &a.xs[(size_t)(m0 + i) * ng], ng);
    }
}
#endif

template <int FMT>
static void quantized(const float *x, float *y, int M, const QWeights &W, int nthreads, int accumulate, int ldy) {
    const int N = W.N, K = W.K, ng = K / QG, nsb = (K + SB - 1) / SB;
    QAct a;
    quantize_rows(x, M, K, a, FMT);
    const int ntiles = (N + NT - 1) / NT;
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<uint8_t> buf((size_t)NT * ng * QG + 32);
        uint8_t *codes = buf.data() + ((32 - ((uintptr_t)buf.data() & 31)) & 31); /* 32-byte aligned */
        std::vector<int16_t> sc16((size_t)NT * ng);
        std::vector<float> Sf((size_t)NT * nsb), off((size_t)NT * ng);
#pragma omp for schedule(static)
        for (int t = 0; t < ntiles; t++) {
            const int n0 = t * NT, nt = std::min(NT, N - n0);
            int rows[NT];
            for (int j = 0; j < NT; j++) rows[j] = n0 + std::min(j, nt - 1); /* a short tile repeats its last row */
#ifdef __AVX2__
            if (FMT == Q4 && M > 1 && M <= 8 && K <= 16384) { /* narrow: decoded in registers; wider: an unpacked tile */
                float out[8][NT];
                switch (M) {
                case 8: q4_rows<8>(W, a, 0, rows, out); break;
                case 7: q4_rows<7>(W, a, 0, rows, out); break;
                case 6: q4_rows<6>(W, a, 0, rows, out); break;
                case 5: q4_rows<5>(W, a, 0, rows, out); break;
                case 4: q4_rows<4>(W, a, 0, rows, out); break;
                case 3: q4_rows<3>(W, a, 0, rows, out); break;
                default: q4_rows<2>(W, a, 0, rows, out);
                }
                for (int i = 0; i < M; i++)
                    for (int j = 0; j < nt; j++) {
                        float &o = y[(size_t)i * ldy + n0 + j];
                        o = accumulate ? o + out[i][j] : out[i][j];
                    }
                continue;
            }
            if (FMT == Q4 && M == 1 && K <= 16384) {
                float out[NT];
                q4_row(W, a, 0, rows, out);
                for (int j = 0; j < nt; j++) {
                    float &o = y[n0 + j];  /* M == 1: the row stride does not matter */
                    o = accumulate ? o + out[j] : out[j];
                }
                continue;
            }
#endif
            if (FMT == Q4)
                for (int j = 0; j < NT; j++) {
                    const size_t n = rows[j];
                    const uint8_t *row = (const uint8_t *)W.w + n * (K / 2);
                    for (int g = 0; g < ng; g++) sc16[(size_t)j * ng + g] = W.sc[n * ng + g];
                    for (int sb = 0; sb < nsb; sb++) {
                        const int g0 = sb * SB / QG, g1 = std::min(ng, g0 + SB / QG);
                        int g = g0;
#ifdef __AVX2__
                        for (; g + 1 < g1; g += 2) { /* a pair: low nibbles of both groups, then high */
                            /* the next tile's bytes arrive while this one is multiplied */
                            _mm_prefetch((const char *)row + (size_t)NT * (K / 2) + (size_t)g * 16, _MM_HINT_T0);
                            const __m256i raw = _mm256_loadu_si256((const __m256i *)(row + (size_t)g * 16));
                            const __m256i mask = _mm256_set1_epi8(15);
                            uint8_t *c = codes + ((size_t)j * ng + g) * QG;
                            _mm256_store_si256((__m256i *)c, _mm256_and_si256(raw, mask));
                            _mm256_store_si256((__m256i *)(c + 32), _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask));
                        }
#endif
                        for (; g < g1; g++) unpack_group(row, g, codes + ((size_t)j * ng + g) * QG);
                    }
                    for (int sb = 0; sb < nsb; sb++) Sf[(size_t)j * nsb + sb] = half_to_float(W.S[n * nsb + sb]);
                    group_minimums(W, n, &off[(size_t)j * ng]);
                }
            for (int m0 = 0; m0 < M;) {
                int mt = M - m0 >= 2 ? 2 : 1;
                float out[4][NT];
#ifdef __AVX2__
                if constexpr (FMT == Q4) {
                    mt = std::min(4, M - m0);
                    if (mt == 4) q4_tile<4>(W, a, m0, rows, codes, sc16.data(), Sf.data(), off.data(), out);
                    else if (mt == 3) q4_tile<3>(W, a, m0, rows, codes, sc16.data(), Sf.data(), off.data(), out);
                    else if (mt == 2) q4_tile<2>(W, a, m0, rows, codes, sc16.data(), Sf.data(), off.data(), out);
                    else q4_tile<1>(W, a, m0, rows, codes, sc16.data(), Sf.data(), off.data(), out);
                } else
#endif
                {
                    if (mt == 2)
                        q_rows<FMT, 2>(W, a, m0, rows, codes, sc16.data(), Sf.data(), off.data(), out);
                    else
                        q_rows<FMT, 1>(W, a, m0, rows, codes, sc16.data(), Sf.data(), off.data(), out);
                }
                for (int i = 0; i < mt; i++)
                    for (int j = 0; j < nt; j++) {
                        float s = out[i][j];
                        if (FMT == Q8) s *= W.scale[n0 + j];
                        float &o = y[(size_t)(m0 + i) * ldy + n0 + j];
                        o = accumulate ? o + s : s;
                    }
                m0 += mt;
            }
        }
    }
}

#ifdef __AVX2__
/* Q2, MT (1..8) activation rows against one tile of NT weight rows, decoded in registers: per weight
 * row and run of four groups, one 32-byte load; a shift and a mask give each group's 32 codes in
 * weight order, one maddubs and one madd with the group's sub-scale put weights 4i..4i+3 in lane i
 * (the lanes of q_rows). `off`: room for one row's K/QG group minimums. */
template <int MT>
static void q2_rows(const QWeights &W, const QAct &a, int m0, const int *rows, float *off, float out[][NT]) {
    const int K = W.K, nsb = (K + SB - 1) / SB, ng = K / QG;
    const size_t PF = std::min<size_t>((size_t)NT * (K / 4) + 1024, 16384);
    const __m256i mask = _mm256_set1_epi8(3);
    v8f accv[MT][NT];
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NT; j++) accv[i][j] = v8_splat(0.0f);
    const int8_t *xq[MT];
    for (int i = 0; i < MT; i++) xq[i] = &a.q[(size_t)(m0 + i) * K];
    for (int sb = 0; sb < nsb; sb++) {
        const int g0 = sb * SB / QG, g1 = std::min(ng, g0 + SB / QG); /* a multiple of four groups */
        for (int j = 0; j < NT; j++) {
            const uint8_t *row = (const uint8_t *)W.w + (size_t)rows[j] * (K / 4);
            const uint8_t *sc = W.sc + (size_t)rows[j] * ng;
            __m256i acc[MT];
            for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_si256();
            for (int g = g0; g < g1; g += 4) {
                const uint8_t *p = row + (size_t)g * 8;
                _mm_prefetch((const char *)p + PF, _MM_HINT_T0);
                const __m256i raw = _mm256_loadu_si256((const __m256i *)p);
                for (int s = 0; s < 4; s++) {
                    const __m256i w = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * s), mask);
                    const __m256i vs = _mm256_set1_epi16((int16_t)sc[g + s]);
                    for (int i = 0; i < MT; i++)
                        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)(xq[i] + (g + s) * QG))), vs));
                }
            }
            const float S = half_to_float(W.S[(size_t)rows[j] * nsb + sb]);
            for (int i = 0; i < MT; i++) {
                v8i ii;
                memcpy(&ii, &acc[i], sizeof ii);
                accv[i][j] = __builtin_convertvector(ii, v8f) * v8_splat(a.d[(size_t)(m0 + i) * nsb + sb] * S) + accv[i][j];
            }
        }
    }
    for (int j = 0; j < NT; j++) {
        group_minimums(W, rows[j], off);
        for (int i = 0; i < MT; i++) out[i][j] = v8_hsum(accv[i][j]) - min_share(off, &a.xs[(size_t)(m0 + i) * ng], ng);
    }
}
#endif

/* int2: with AVX2 every batch goes through q2_rows, eight activation rows at a time (a row's result
 * does not depend on which others share its call); without, the tile's codes are unpacked for q_rows. */
static void q2_linear(const float *x, float *y, int M, const QWeights &W, int nthreads, int accumulate, int ldy) {
    const int N = W.N, K = W.K, ng = K / QG;
    QAct a;
    quantize_rows(x, M, K, a, Q2);
    const int ntiles = (N + NT - 1) / NT;
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> off((size_t)NT * ng);
#ifndef __AVX2__
        const int nsb = (K + SB - 1) / SB;
        std::vector<uint8_t> codes((size_t)NT * ng * QG);
        std::vector<int16_t> sc16((size_t)NT * ng);
        std::vector<float> Sf((size_t)NT * nsb);
#endif
#pragma omp for schedule(static)
        for (int t = 0; t < ntiles; t++) {
            const int n0 = t * NT, nt = std::min(NT, N - n0);
            int rows[NT];
            for (int j = 0; j < NT; j++) rows[j] = n0 + std::min(j, nt - 1); /* a short tile repeats its last row */
#ifndef __AVX2__
            for (int j = 0; j < NT; j++) {
                const size_t n = rows[j];
                const uint8_t *row = (const uint8_t *)W.w + n * (K / 4);
                for (int g = 0; g < ng; g++) {
                    sc16[(size_t)j * ng + g] = W.sc[n * ng + g];
                    unpack_group2(row, g, &codes[((size_t)j * ng + g) * QG]);
                }
                for (int sb = 0; sb < nsb; sb++) Sf[(size_t)j * nsb + sb] = half_to_float(W.S[n * nsb + sb]);
                group_minimums(W, n, &off[(size_t)j * ng]);
            }
#endif
            for (int m0 = 0; m0 < M;) {
                float out[8][NT];
#ifdef __AVX2__
                const int mt = std::min(8, M - m0);
                switch (mt) {
                case 8: q2_rows<8>(W, a, m0, rows, off.data(), out); break;
                case 7: q2_rows<7>(W, a, m0, rows, off.data(), out); break;
                case 6: q2_rows<6>(W, a, m0, rows, off.data(), out); break;
                case 5: q2_rows<5>(W, a, m0, rows, off.data(), out); break;
                case 4: q2_rows<4>(W, a, m0, rows, off.data(), out); break;
                case 3: q2_rows<3>(W, a, m0, rows, off.data(), out); break;
                case 2: q2_rows<2>(W, a, m0, rows, off.data(), out); break;
                default: q2_rows<1>(W, a, m0, rows, off.data(), out);
                }
#else
                const int mt = M - m0 >= 2 ? 2 : 1;
                if (mt == 2)
                    q_rows<Q2, 2>(W, a, m0, rows, codes.data(), sc16.data(), Sf.data(), off.data(), out);
                else
                    q_rows<Q2, 1>(W, a, m0, rows, codes.data(), sc16.data(), Sf.data(), off.data(), out);
#endif
                for (int i = 0; i < mt; i++)
                    for (int j = 0; j < nt; j++) {
                        float &o = y[(size_t)(m0 + i) * ldy + n0 + j];
                        o = accumulate ? o + out[i][j] : out[i][j];
                    }
                m0 += mt;
            }
        }
    }
}

/* y = x W^T, or y += x W^T with accumulate (the residual add, in the same order as a separate add).
 * y's rows are ldy floats apart (ldy = N, or the width of a larger buffer whose columns this call
 * fills: a column split writes each unit's columns straight into one shared output).
 * Format arrays: int8: a1 = scale fp32 [N]; int4, int2: a1 = sc u8, a2 = mn u8 [N, K/32], a3 = S, a4 = M fp16
 * [N, K/256]. */
extern "C" void cad_linear(const float *x, float *y, int M, int fmt, int N, int K, const void *w, const void *a1,
                           const void *a2, const void *a3, const void *a4, int nthreads, int accumulate, int ldy) {
    if (ldy < N) ldy = N;
    if (fmt == Q8 || fmt == Q4 || fmt == Q2) {
        const QWeights W{fmt, N, K, w, (const float *)a1, (const uint8_t *)a1, (const uint8_t *)a2,
                         (const uint16_t *)a3, (const uint16_t *)a4};
        if (fmt == Q2)
            q2_linear(x, y, M, W, nthreads, accumulate, ldy);
        else if (fmt == Q4)
            quantized<Q4>(x, y, M, W, nthreads, accumulate, ldy);
        else
            quantized<Q8>(x, y, M, W, nthreads, accumulate, ldy);
    } else {
        dense(x, y, M, fmt, N, K, w, nthreads, accumulate, ldy);
    }
}
