/* The FFN of a set of neurons whose records (models/flash_records.py) sit in the rows of a matrix (the
 * sliding-window cache, flash/cache.py): out[t] += sum_j silu(gate_j . h[t]) (up_j . h[t]) down_j.
 *
 * A record holds neuron j's gate row, up row and down column, int4 along the model dimension K: codes
 * 0..15 per weight, per group of 32 an 8-bit sc and mn, per super-block of 256 an fp16 s and m, and
 * w = code * (s sc) - m mn. The weights stay int4 in memory; activations stay fp32:
 *   dot(h_group, w_group) = scale * dot(h_group, codes) - offset * sum(h_group)
 * with the group sums of h taken once per call.
 *
 * Two phases, one team of threads:
 *  1. over neurons: a[j][t] = silu(gate_j . h[t]) * (up_j . h[t]), into a scratch [n, T];
 *  2. over ranges of whole groups of the model dimension: each thread dequantizes the down values of
 *     its columns for a block of neurons once and adds them, scaled, into every row of out.
 * Order. Every operation is a plain float multiply or add (the build contracts nothing into an FMA) in a
 * sequence fixed by K and the neuron list alone: a[j][t] depends on neuron j and row t only, and each
 * out[t][d] is out[t][d] + a[0][t] w_0[d] + a[1][t] w_1[d] + ... in the order of `slots`, one rounding
 * after each step, whatever the number of rows, the blocking or the thread count. So a row's result is
 * the same alone or inside a block, on every thread count and every instruction-set path. */
#include "qlinear.hpp"
#include "vec.hpp"

#include <algorithm>
#include <omp.h>
#include <stdint.h>
#include <vector>

namespace {

constexpr int QG = 32;  /* weights per group */
constexpr int GPS = 8;  /* groups per super-block */
constexpr int JB = 32;  /* neurons per block of dequantized down values (phase 2) */
constexpr int TB = 4;   /* rows of h per pass over a decoded row (phase 1) */

/* Byte offsets of row 0's arrays inside a record; row r (0 gate, 1 up, 2 down) is r arrays further. */
struct Layout {
    int K, G, S;
    size_t q, sc, mn, s, m;
    explicit Layout(int K_) : K(K_), G(K_ / QG), S((K_ + 255) / 256) {
        q = 0;
        sc = q + 3 * (size_t)(K / 2);
        mn = sc + 3 * (size_t)G;
        s = mn + 3 * (size_t)G;
        m = s + 3 * 2 * (size_t)S;
    }
};

/* Row r of a record: codes as floats cf [K], group scales and offsets [G]. */
CAD_INLINE void decode_row(const uint8_t *rec, const Layout &L, int r, float *cf, float *scl, float *off) {
    const uint8_t *qp = rec + L.q + (size_t)r * (L.K / 2);
    for (int b = 0; b < L.K / 2; b += 16)
        for (int i = 0; i < 16; i++) {
            cf[2 * b + i] = (float)(qp[b + i] & 15);
            cf[2 * b + 16 + i] = (float)(qp[b + i] >> 4);
        }
    const uint8_t *sc = rec + L.sc + (size_t)r * L.G, *mn = rec + L.mn + (size_t)r * L.G;
    uint16_t s[64], m[64];  /* K <= 16384 */
    memcpy(s, rec + L.s + (size_t)r * 2 * L.S, 2 * (size_t)L.S);
    memcpy(m, rec + L.m + (size_t)r * 2 * L.S, 2 * (size_t)L.S);
    for (int g = 0; g < L.G; g++) {
        scl[g] = q::half_to_float(s[g / GPS]) * (float)sc[g];
        off[g] = q::half_to_float(m[g / GPS]) * (float)mn[g];
    }
}

/* res[i] = the decoded row . h[t0 + i] for NB rows: per row, eight lanes summed over groups as
 * acc + ((h0 c0 + h1 c1) + (h2 c2 + h3 c3)) * scale, then the offsets' dot with the group sums hs. */
template <int NB>
CAD_INLINE void row_dots(const float *h, const float *hs, int t0, const Layout &L, const float *cf, const float *scl,
                         const float *off, float *res) {
    v8f acc[NB];
    for (int i = 0; i < NB; i++) acc[i] = v8_splat(0.0f);
    for (int g = 0; g < L.G; g++) {
        const float *c = cf + (size_t)g * QG;
        const v8f c0 = v8_load(c), c1 = v8_load(c + 8), c2 = v8_load(c + 16), c3 = v8_load(c + 24), sg = v8_splat(scl[g]);
        for (int i = 0; i < NB; i++) {
            const float *x = h + (size_t)(t0 + i) * L.K + (size_t)g * QG;
            const v8f p = (v8_load(x) * c0 + v8_load(x + 8) * c1) + (v8_load(x + 16) * c2 + v8_load(x + 24) * c3);
            acc[i] = acc[i] + p * sg;
        }
    }
    for (int i = 0; i < NB; i++) {
        const float *gs = hs + (size_t)(t0 + i) * L.G;
        float o = 0.0f;
        for (int g = 0; g < L.G; g++) o = o + off[g] * gs[g];
        res[i] = v8_hsum(acc[i]) - o;
    }
}

/* Phase 1 for one neuron: a[t] = silu(gate . h[t]) * (up . h[t]) for all T rows. */
void neuron_act(const uint8_t *rec, const Layout &L, const float *h, const float *hs, int T, float *cf, float *scl,
                float *off, float *gate, float *a) {
    for (int r = 0; r < 2; r++) {
        decode_row(rec, L, r, cf, scl, off);
        float *res = r == 0 ? gate : a;
        int t = 0;
        for (; t + TB <= T; t += TB) row_dots<TB>(h, hs, t, L, cf, scl, off, res + t);
        for (; t < T; t++) row_dots<1>(h, hs, t, L, cf, scl, off, res + t);
    }
    for (int t = 0; t < T; t++) a[t] = gate[t] / (scalar_exp(-gate[t]) + 1.0f) * a[t];
}

/* Down values of neuron rec for groups [g0, g1) into w (32 floats per group): code * scale - offset. */
CAD_INLINE void decode_down(const uint8_t *rec, const Layout &L, int g0, int g1, float *w) {
    const uint8_t *qp = rec + L.q + 2 * (size_t)(L.K / 2), *sc = rec + L.sc + 2 * (size_t)L.G;
    const uint8_t *mn = rec + L.mn + 2 * (size_t)L.G;
    const uint8_t *sp = rec + L.s + 2 * 2 * (size_t)L.S, *mp = rec + L.m + 2 * 2 * (size_t)L.S;
    for (int g = g0; g < g1; g++) {
        uint16_t s, m;
        memcpy(&s, sp + 2 * (g / GPS), 2);
        memcpy(&m, mp + 2 * (g / GPS), 2);
        const float scale = q::half_to_float(s) * (float)sc[g], offset = q::half_to_float(m) * (float)mn[g];
        const uint8_t *b = qp + (size_t)g * 16;
        float *o = w + (size_t)(g - g0) * QG;
        for (int i = 0; i < 16; i++) {
            o[i] = (float)(b[i] & 15) * scale - offset;
            o[16 + i] = (float)(b[i] >> 4) * scale - offset;
        }
    }
}

/* out rows [t0, t0 + NB), columns c .. c + 32: += a[j][t] * w[j] for the nb neurons of a block, in order. */
template <int NB>
CAD_INLINE void axpy_block(float *out, int K, int t0, int c, const float *a, int T, const float *w, int ldw, int nb) {
    v8f acc[NB][4];
    for (int i = 0; i < NB; i++)
        for (int k = 0; k < 4; k++) acc[i][k] = v8_load(out + (size_t)(t0 + i) * K + c + 8 * k);
    for (int j = 0; j < nb; j++) {
        const float *wj = w + (size_t)j * ldw;
        const v8f w0 = v8_load(wj), w1 = v8_load(wj + 8), w2 = v8_load(wj + 16), w3 = v8_load(wj + 24);
        for (int i = 0; i < NB; i++) {
            const v8f s = v8_splat(a[(size_t)j * T + t0 + i]);
            acc[i][0] = acc[i][0] + s * w0;
            acc[i][1] = acc[i][1] + s * w1;
            acc[i][2] = acc[i][2] + s * w2;
            acc[i][3] = acc[i][3] + s * w3;
        }
    }
    for (int i = 0; i < NB; i++)
        for (int k = 0; k < 4; k++) v8_store(out + (size_t)(t0 + i) * K + c + 8 * k, acc[i][k]);
}

/* Phase 2 on this thread's groups [g0, g1): out[:, g0*32 .. g1*32) += sum_j a[j] down_j, j in order. */
void down_range(const uint8_t *mat, long R, const int32_t *slots, int n, const Layout &L, const float *a, int T,
                int g0, int g1, float *out, std::vector<float> &w) {
    const int ldw = (g1 - g0) * QG;
    w.resize((size_t)JB * ldw);
    for (int j0 = 0; j0 < n; j0 += JB) {
        const int nb = std::min(JB, n - j0);
        for (int j = 0; j < nb; j++) decode_down(mat + (size_t)slots[j0 + j] * R, L, g0, g1, &w[(size_t)j * ldw]);
        const float *aj = a + (size_t)j0 * T;
        for (int c = 0; c < ldw; c += QG) {
            int t = 0;
            for (; t + 2 <= T; t += 2) axpy_block<2>(out, L.K, t, g0 * QG + c, aj, T, &w[c], ldw, nb);
            for (; t < T; t++) axpy_block<1>(out, L.K, t, g0 * QG + c, aj, T, &w[c], ldw, nb);
        }
    }
}

}  // namespace

/* h [T, K] fp32; mat: records, R bytes apart; slots [n]: the rows of mat to use, in summation order;
 * out [T, K] fp32: += the neurons' FFN (accumulate) or = it. K a multiple of 32, at most 16384. */
extern "C" void cad_flash_ffn(const float *h, int T, int K, const uint8_t *mat, long R, const int32_t *slots, int n,
                              float *out, int accumulate, int nthreads) {
    const Layout L(K);
    std::vector<float> hs((size_t)T * L.G), a((size_t)n * T);
    for (int t = 0; t < T; t++)
        for (int g = 0; g < L.G; g++) {
            const float *x = h + (size_t)t * K + (size_t)g * QG;
            hs[(size_t)t * L.G + g] = v8_hsum((v8_load(x) + v8_load(x + 8)) + (v8_load(x + 16) + v8_load(x + 24)));
        }
#pragma omp parallel num_threads(std::max(1, nthreads))
    {
        std::vector<float> cf(K), scl(L.G), off(L.G), gate(T), w;
#pragma omp for schedule(static)
        for (int j = 0; j < n; j++)
            neuron_act(mat + (size_t)slots[j] * R, L, h, hs.data(), T, cf.data(), scl.data(), off.data(), gate.data(),
                       &a[(size_t)j * T]);
        /* the implicit barrier of `omp for`: every a[j] is ready */
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int g0 = (int)((long)L.G * id / nt), g1 = (int)((long)L.G * (id + 1) / nt);
        if (!accumulate)
            for (int t = 0; t < T; t++) std::fill(out + (size_t)t * K + g0 * QG, out + (size_t)t * K + g1 * QG, 0.0f);
        if (g0 < g1) down_range(mat, R, slots, n, L, a.data(), T, g0, g1, out, w);
    }
}
