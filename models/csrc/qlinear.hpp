/* Weight-only quantized linear layers (int8, int4, int2): the weight layout, the activations, and the
 * one reduction that every instruction-set path computes.
 *
 * Layout (models/linear.py writes it). Weights come in tiles of TR = 16 output rows; each array is
 * tile-major, so a tile is one contiguous run of bytes and a range of whole tiles is a slice. Inside
 * a tile, a "quad" is 4 consecutive k of each of the 16 rows: 64 bytes, row j's 4 bytes at 4j. That
 * is the operand of one vpdpbusd (16 int32 lanes, lane j = row j) and one row of an AMX B tile.
 *   int4 q   [T, K/32 * 256]  per group of 32 k, 4 chunks of 64 bytes: chunk p holds quad p in its low
 *                             nibbles and quad p + 4 in its high ones
 *   int2 q   [T, K/32 * 128]  per group, 2 chunks: chunk h, bits 2s..2s+1 hold quad 4h + s
 *   int8 q   [T, K/4 * 64]    one quad after another, each code stored as q + 128 (unsigned)
 *   sc       [T, K/32 * 16]   int4/int2 sub-scales, [group][row]
 *   mn       [T, NG2 * 16]    int4/int2 sub-minimums, [group pair][row][2] (NG2: K/32 rounded up to even, 0-padded)
 *   S, Mn    [T, NSB * 16]    int4/int2 fp16 super-scales and super-minimums, [super-block][row]
 *   scale    [T, 16]          int8 fp32 scale per row
 * Rows past N in the last tile are zeros.
 *
 * The reduction. Each activation row is rounded to int8 per super-block of SB = 256 (x ~ d q, the
 * last super-block may be short). For output (m, n) and super-block b, with w = S sc c - Mn mn
 * (int4/int2: codes c 0..15 or 0..3; sc, mn 8-bit per group of 32) or w = scale * c (int8):
 *   I1 = sum_g sc_g <c_g, q_g>      I2 = sum_g mn_g sum(q_g)      (int8: I1 = <c, q>, I2 = 0)
 * are exact int32 (|I1| < 2^27 for int4), whatever the lanes or the order they are added in. Only
 * then do floats enter, in one fixed sequence per super-block, super-blocks in order:
 *   acc = acc + d_b * (S_b * float(I1) - Mn_b * float(I2))        (int4, int2)
 *   acc = acc + d_b * float(I1);  at the end acc = scale * acc     (int8)
 * Every path (portable, AVX2, AVX-VNNI, AVX-512 VNNI, AMX) computes these integers with its own
 * instructions and then these float operations one by one (the build contracts no a * b + c into
 * an FMA), so every path gives the same bits, and a row's result never depends on the other rows.
 */
#pragma once
#include "vec.hpp"

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <vector>

/* The kernels' building blocks are inlined whatever the compiler's budget: passed out of line, their
 * register arrays of accumulators go through memory (and a function of prefetches alone is dropped). */
#define CAD_INLINE __attribute__((always_inline)) static inline

namespace q {

constexpr int TR = 16;            /* weight rows per tile */
constexpr int QG = 32;            /* k per group: one sub-scale and sub-minimum */
constexpr int SB = 256;           /* k per super-block: one activation scale, one S and Mn */
constexpr int GPS = SB / QG;      /* groups per super-block */
enum Fmt { Q8 = 3, Q4 = 4, Q2 = 5 };

/* One quantized weight matrix: its arrays start at the tile holding output row0 (0 <= row0 < TR);
 * outputs are rows row0 .. row0 + N - 1 of that run of tiles. */
struct QW {
    int fmt, N, K, row0;
    const uint8_t *q;
    const float *scale;             /* int8 */
    const uint8_t *sc, *mn;         /* int4, int2 */
    const uint16_t *S, *Mn;         /* int4, int2: fp16 */
    int ng, ng2, nsb;

    QW(int fmt_, int N_, int K_, int row0_, const void *q_, const void *a1, const void *a2, const void *a3,
       const void *a4)
        : fmt(fmt_), N(N_), K(K_), row0(row0_), q((const uint8_t *)q_), scale((const float *)a1),
          sc((const uint8_t *)a1), mn((const uint8_t *)a2), S((const uint16_t *)a3), Mn((const uint16_t *)a4),
          ng(K_ / QG), ng2(K_ / QG + (K_ / QG & 1)), nsb((K_ + SB - 1) / SB) {}
    int tiles() const { return (row0 + N + TR - 1) / TR; }
    /* the codes of group g of tile t (FMT: this matrix's format, known where the kernels are compiled) */
    template <int FMT>
    const uint8_t *codes(int t, int g) const { return q + ((size_t)t * ng + g) * group_bytes(FMT); }
    static constexpr size_t group_bytes(int f) { return f == Q4 ? 256 : f == Q2 ? 128 : 512; }
    const uint8_t *subscales(int t, int g) const { return sc + ((size_t)t * ng + g) * TR; }
    const uint8_t *submins(int t, int g) const { return mn + ((size_t)t * ng2 + g) * TR; } /* g even */
    const uint16_t *supers(const uint16_t *a, int t, int b) const { return a + ((size_t)t * nsb + b) * TR; }
};

/* Fetch ahead what tile t + 1 reads at group g (its codes, and its scales where a line of them starts):
 * a thread walks its tiles in order, so this keeps its weights one tile ahead of the arithmetic. The
 * hardware prefetcher alone loses the stream at every 4 KiB page, which stalls a pass of many rows
 * (its work per byte hides less of the miss): 16 rows ran twice as fast with the weights in cache. */
template <int FMT>
CAD_INLINE void prefetch_next(const QW &W, int t, int g) {
    const char *c = (const char *)W.codes<FMT>(t + 1, g);
    for (size_t i = 0; i < QW::group_bytes(FMT); i += 64) __builtin_prefetch(c + i);
    if (FMT == Q8) {
        if (g == 0) __builtin_prefetch(W.scale + (size_t)(t + 1) * TR);
        return;
    }
    if (g % 4 == 0) __builtin_prefetch(W.subscales(t + 1, g));
    if (g % 2 == 0) __builtin_prefetch(W.submins(t + 1, g));
    if (g % GPS == 0) __builtin_prefetch(W.supers(W.S, t + 1, g / GPS)), __builtin_prefetch(W.supers(W.Mn, t + 1, g / GPS));
}

/* Activations rounded to int8 per super-block: q [rows, K] (rows: M, or M rounded up to a multiple
 * of TR with zero rows, for AMX tiles), d [M, NSB], group sums xs [M, NG2] (int16, 0-padded; what a
 * sub-minimum multiplies), super-block sums xsum [M, NSB] (int8's correction for its offset codes). */
struct QA {
    int M = 0, K = 0, ng = 0, ng2 = 0, nsb = 0;
    std::vector<int8_t> q;
    std::vector<float> d;
    std::vector<int16_t> xs;
    std::vector<int32_t> xsum;
    const int8_t *row(int m) const { return q.data() + (size_t)m * K; }
};

/* Rows x [M, K] rounded to int8 (rows_pad >= M rows of q; the extra ones are zero). */
void quantize(const float *x, int M, int K, int rows_pad, QA &a);
/* The same for rows picked from x by index: row i of `a` is x[rows[i]]. */
void quantize_rows(const float *x, const int *rows, int M, int K, int rows_pad, QA &a);

/* One super-block's float step: the canonical formula above, operation by operation. */
static inline float sb_term(float d, float S, float Mn, int32_t i1, int32_t i2) {
    const float a = S * (float)i1;
    const float b = Mn * (float)i2;
    return d * (a - b);
}

static inline float half_to_float(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}

/* y[m, n] (+)= x W^T for x [M, K]: the rows rounded to int8, then the tiles, by `nthreads` threads;
 * y's rows are ldy floats apart. */
void qlinear(const float *x, int M, const QW &W, float *y, int ldy, int accumulate, int nthreads);
/* A product as `QuantLinear.record` writes it into a record (models/linear.py): format, n, k, row0 and its five
 * arrays' addresses, nine int64s. */
inline QW record_qw(const int64_t *r) {
    return QW((int)r[0], (int)r[1], (int)r[2], (int)r[3], (const void *)r[4], (const void *)r[5], (const void *)r[6],
              (const void *)r[7], (const void *)r[8]);
}
/* A record's float field: the double whose bits the int64 holds (models/layer_kernel.py `double_bits`). */
inline double record_double(int64_t bits) {
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
}
/* The same inside an OpenMP parallel region, its work shared among the region's threads (`a`: the
 * activations' buffers, shared by them; reused from call to call). y is complete once every thread
 * has passed a barrier after it. */
void qlinear_in(const float *x, int M, const QW &W, float *y, int ldy, int accumulate, QA &a);
/* y (+)= x W^T for the tiles [t0, t1) of W and the rows of `a` (quantized), on the calling thread. */
void qgemm_tiles(const QW &W, const QA &a, int t0, int t1, float *y, int ldy, int accumulate);
/* Rows that need the padded activations of the wide (AMX) path. */
int act_rows(int M);

}  // namespace q
