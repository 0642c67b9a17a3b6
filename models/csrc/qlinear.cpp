/* The quantized product's driver: activations rounded to int8, tiles split between threads, each tile
 * computed by the path this build was compiled for (models/kernels.py builds one library per path,
 * each for its instruction set, and loads the best one the CPU has). The AMX build also holds the
 * AVX-512 VNNI path: AMX takes the wide passes once the kernel has granted this process its tile state
 * and a self-check has agreed with the VNNI path. */
#include "qlinear.hpp"

#include <algorithm>
#include <omp.h>
#include <stdio.h>

#if defined(__AMX_INT8__) || defined(CAD_AMX_EMULATE)
#define CAD_AMX 1
#include "qk_amx.hpp"
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "qk_avx512.hpp"
#define CAD_PATH "avx512vnni"
#elif defined(__AVX2__)
#include "qk_avx2.hpp"
#ifdef __AVXVNNI__
#define CAD_PATH "avxvnni"
#else
#define CAD_PATH "avx2"
#endif
#else
#include "qk_portable.hpp"
#define CAD_PATH "portable"
#endif
#ifndef CAD_AMX_MIN_ROWS
#define CAD_AMX_MIN_ROWS 8 /* a pass this wide goes to AMX */
#endif

namespace q {

static bool amx_on = false;

static bool use_amx(int M) { return amx_on && M >= CAD_AMX_MIN_ROWS; }

int act_rows(int M) { return use_amx(M) ? (M + TR - 1) / TR * TR : M; }

/* x rounded to the nearest integer, ties to even, for |x| < 2^22: adding and taking away 1.5 x 2^23
 * leaves its integer part in the float's mantissa (eight lanes at a time on every instruction set, and
 * the same result as nearbyint). */
static inline v8f v8_round(v8f x) {
    const v8f c = v8_splat(12582912.0f);
    return (x + c) - c;
}

typedef int8_t v8c __attribute__((vector_size(8)));

static inline float v8_hmax(v8f v) {
    float m = v[0];
    for (int i = 1; i < 8; i++) m = std::max(m, v[i]);
    return m;
}

static void quantize_row(const float *x, int K, QA &a, int m) {
    /* locals, not a's members: the int8 stores may alias anything, which would reload every member */
    int8_t *q = a.q.data() + (size_t)m * K;
    int16_t *xs = a.xs.data() + (size_t)m * a.ng2;
    float *d = a.d.data() + (size_t)m * a.nsb;
    int32_t *xsum = a.xsum.data() + (size_t)m * a.nsb;
    const v8i nosign = v8i{} + 0x7fffffff;
    for (int b = 0, nsb = a.nsb; b < nsb; b++) {
        const int k0 = b * SB, kn = std::min(SB, K - k0); /* a multiple of QG */
        const float *xb = x + k0;
        v8f mx[4] = {v8_splat(0.0f), v8_splat(0.0f), v8_splat(0.0f), v8_splat(0.0f)}; /* four chains */
        for (int i = 0; i < kn; i += 8) {
            v8i bits;
            memcpy(&bits, xb + i, 32);
            bits &= nosign;
            v8f v;
            memcpy(&v, &bits, 32);
            mx[i / 8 % 4] = v > mx[i / 8 % 4] ? v : mx[i / 8 % 4];
        }
        const float amax = std::max(std::max(v8_hmax(mx[0]), v8_hmax(mx[1])), std::max(v8_hmax(mx[2]), v8_hmax(mx[3])));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t total = 0;
        for (int g = 0; g < kn / QG; g++) {
            v8i sum = v8i{};
            for (int i = 0; i < QG; i += 8) {
                const v8i r = __builtin_convertvector(v8_round(v8_load(xb + g * QG + i) * id), v8i);
                const v8c c = __builtin_convertvector(r, v8c);
                memcpy(q + k0 + g * QG + i, &c, 8);
                sum += r;
            }
            const int32_t s = (sum[0] + sum[4]) + (sum[1] + sum[5]) + (sum[2] + sum[6]) + (sum[3] + sum[7]);
            xs[k0 / QG + g] = (int16_t)s;
            total += s;
        }
        d[b] = amax / 127.0f;
        xsum[b] = total;
    }
}

static void shape(int M, int K, int rows_pad, QA &a) {
    a.M = M, a.K = K, a.ng = K / QG, a.ng2 = a.ng + (a.ng & 1), a.nsb = (K + SB - 1) / SB;
    const size_t rows = std::max(M, rows_pad);
    a.q.assign(rows * K, 0);
    a.d.assign(rows * a.nsb, 0.0f);
    a.xs.assign(rows * a.ng2, 0);
    a.xsum.assign(rows * a.nsb, 0);
}

void quantize(const float *x, int M, int K, int rows_pad, QA &a) {
    shape(M, K, rows_pad, a);
    for (int m = 0; m < M; m++) quantize_row(x + (size_t)m * K, K, a, m);
}

void quantize_rows(const float *x, const int *rows, int M, int K, int rows_pad, QA &a) {
    shape(M, K, rows_pad, a);
    for (int m = 0; m < M; m++) quantize_row(x + (size_t)rows[m] * K, K, a, m);
}

/* Rows m0 .. m0 + mb of tile t from out [mb, TR] into y (the columns this matrix has). */
static void store(const QW &W, const float *out, int t, int m0, int mb, float *y, int ldy, int accumulate) {
    const int j0 = std::max(0, W.row0 - t * TR), j1 = std::min(TR, W.row0 + W.N - t * TR);
    for (int m = 0; m < mb; m++) {
        float *yr = y + (size_t)(m0 + m) * ldy + t * TR - W.row0;
        for (int j = j0; j < j1; j++) yr[j] = accumulate ? yr[j] + out[m * TR + j] : out[m * TR + j];
    }
}

template <int FMT>
static void tiles(const QW &W, const QA &a, int t0, int t1, float *y, int ldy, int accumulate) {
    const bool amx = use_amx(a.M);
#ifdef CAD_AMX
    if (amx) amx_begin();
#endif
#if defined(__AVX2__) && !defined(__AVX512VNNI__)
    const int step = MB256; /* rows per pass over a tile */
#else
    const int step = TR;
#endif
    alignas(64) float out[TR * TR];
    for (int t = t0; t < t1; t++)
        for (int m0 = 0; m0 < a.M; m0 += step) {
            const int mb = std::min(step, a.M - m0);
#ifdef CAD_AMX
            if (amx)
                tile_amx<FMT>(W, a, t, m0, out);
            else
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
                rows_avx512<FMT>(W, a, t, m0, mb, out);
#elif defined(__AVX2__)
                rows_avx2<FMT>(W, a, t, m0, mb, out);
#else
                tile_portable<FMT>(W, a, t, m0, mb, out);
#endif
            store(W, out, t, m0, mb, y, ldy, accumulate);
        }
#ifdef CAD_AMX
    if (amx) amx_end();
#endif
}

void qgemm_tiles(const QW &W, const QA &a, int t0, int t1, float *y, int ldy, int accumulate) {
    if (W.fmt == Q4)
        tiles<Q4>(W, a, t0, t1, y, ldy, accumulate);
    else if (W.fmt == Q2)
        tiles<Q2>(W, a, t0, t1, y, ldy, accumulate);
    else
        tiles<Q8>(W, a, t0, t1, y, ldy, accumulate);
}

void qlinear_in(const float *x, int M, const QW &W, float *y, int ldy, int accumulate, QA &a) {
#pragma omp single
    shape(M, W.K, act_rows(M), a);
    const int T = W.tiles(), nt = omp_get_num_threads(), id = omp_get_thread_num();
    for (int m = id; m < M; m += nt) quantize_row(x + (size_t)m * W.K, W.K, a, m);
#pragma omp barrier
    qgemm_tiles(W, a, (int)((long)T * id / nt), (int)((long)T * (id + 1) / nt), y, ldy, accumulate);
}

void qlinear(const float *x, int M, const QW &W, float *y, int ldy, int accumulate, int nthreads) {
    QA a;
#pragma omp parallel num_threads(std::max(1, std::min(nthreads, W.tiles())))
    qlinear_in(x, M, W, y, ldy, accumulate, a);
}

#ifdef CAD_AMX
/* Whether this process may use tile state: the CPU has AMX-INT8 and the kernel granted XTILEDATA
 * (asked for here when `ask`; refused, or not asked for, the answer is no and nothing faults). */
static bool tiles_granted(bool ask) {
#ifdef CAD_AMX_EMULATE
    return ask;
#else
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
    const long ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XTILEDATA = 18;
    if (ask) syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA);
    unsigned long granted = 0;
    return syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &granted) == 0 && (granted & (1ul << XTILEDATA));
#endif
}

/* A small random product of each format through AMX and through the VNNI path: the same bits, or AMX stays off. */
static bool amx_agrees() {
    const int M = 20, N = 40, K = 576;
    uint32_t seed = 12345;
    auto rnd = [&seed] { return seed = seed * 1664525u + 1013904223u, seed >> 8; };
    std::vector<float> x((size_t)M * K), y1((size_t)M * N), y2((size_t)M * N);
    for (float &v : x) v = (float)(int)(rnd() % 2001 - 1000) / 300.0f;
    std::vector<uint8_t> codes((size_t)3 * K * TR), small((size_t)3 * K);
    for (uint8_t &v : codes) v = (uint8_t)rnd();
    for (uint8_t &v : small) v = (uint8_t)rnd();
    std::vector<uint16_t> half((size_t)3 * TR * 3, 0x3c00); /* 1.0 */
    std::vector<float> scale(3 * TR, 0.5f);
    QA a;
    for (int fmt : {Q4, Q2, Q8}) {
        const QW W(fmt, N, K, 0, codes.data(), fmt == Q8 ? (const void *)scale.data() : small.data(), small.data(),
                   half.data(), half.data());
        for (int amx : {1, 0}) {
            amx_on = amx;
            quantize(x.data(), M, K, act_rows(M), a);
            qgemm_tiles(W, a, 0, W.tiles(), amx ? y1.data() : y2.data(), N, 0);
        }
        if (memcmp(y1.data(), y2.data(), y1.size() * sizeof(float))) return false;
    }
    return true;
}
#endif

}  // namespace q

/* Once per process, before the first product: the AMX build asks for tile state (`ask_tiles`) and checks itself. */
extern "C" void cad_init(int ask_tiles) {
#ifdef CAD_AMX
    static bool done = false;
    if (done) return;
    done = true;
    if (!q::tiles_granted(ask_tiles)) return;
    q::amx_on = q::amx_agrees();
    if (!q::amx_on)
        fprintf(stderr, "cadence: the AMX kernel disagreed with the AVX-512 one on its self-check; AMX is off in this process\n");
#else
    (void)ask_tiles;
#endif
}

/* The path the wide passes take in this process (the AMX build without tiles runs its VNNI path). */
extern "C" const char *cad_kernel_path(void) { return q::amx_on ? "amx" : CAD_PATH; }
