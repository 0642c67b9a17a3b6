/* The small per-layer operations around the matrix products, fused so that a decode step is a
 * handful of calls per layer instead of dozens of tensor ops. All are row-wise: a row's result
 * never depends on the other rows. */
#include "ops.hpp"
#include "vec.hpp"

#include <algorithm>
#include <cmath>

/* out[t] = x[t] / rms(x[t]) * w, reduced in one fixed order. */
extern "C" void cad_rmsnorm(const float *x, const float *w, float *out, int T, int D, float eps) {
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * D;
        float *o = out + (size_t)t * D;
        v8f acc = v8_splat(0.0f);
        int d = 0;
        for (; d + 8 <= D; d += 8) {
            const v8f v = v8_load(xr + d);
            acc += v * v;
        }
        float ss = v8_hsum(acc);
        for (; d < D; d++) ss += xr[d] * xr[d];
        const float r = 1.0f / std::sqrt(ss / (float)D + eps);
        d = 0;
        const v8f vr = v8_splat(r);
        for (; d + 8 <= D; d += 8) v8_store(o + d, v8_load(xr + d) * vr * v8_load(w + d));
        for (; d < D; d++) o[d] = xr[d] * r * w[d];
    }
}

static inline void rope_head(float *h, const float *cs, const float *sn, int hd) {
    /* rotate-half: (a, b) -> (a cos - b sin, b cos + a sin) over the two halves */
    const int half = hd / 2;
    for (int i = 0; i < half; i++) {
        const float a = h[i], b = h[i + half];
        h[i] = a * cs[i] - b * sn[i];
        h[i + half] = b * cs[i + half] + a * sn[i + half];
    }
}

/* qkv [T, (H + 2 Hkv) hd] (+ bias) -> rotated q into q_out [T, H, hd]; rotated k and v written to
 * the layer's cache kc, vc [Hkv, cap, hd] at slots slot0 .. slot0 + T. cos/sin tables [*, hd]. */
extern "C" void cad_qkv_rope(const float *qkv, const float *bias, const int64_t *pos, const float *cos_t,
                             const float *sin_t, float *q_out, void *kc, void *vc, int T, int H, int Hkv, int hd,
                             int cap, int slot0, int kv) {
    const int width = (H + 2 * Hkv) * hd;
    float tmp[1024];
    for (int t = 0; t < T; t++) {
        const float *row = qkv + (size_t)t * width;
        const float *cs = cos_t + (size_t)pos[t] * hd, *sn = sin_t + (size_t)pos[t] * hd;
        for (int h = 0; h < H + 2 * Hkv; h++) {
            const float *src = row + (size_t)h * hd;
            for (int i = 0; i < hd; i++) tmp[i] = bias ? src[i] + bias[(size_t)h * hd + i] : src[i];
            if (h < H + Hkv) rope_head(tmp, cs, sn, hd);
            if (h < H) {
                std::copy(tmp, tmp + hd, q_out + ((size_t)t * H + h) * hd);
                continue;
            }
            /* a key or a value: into its cache slot, as a float, a half or a q8_0 row (`kv`) */
            const size_t at = (size_t)(h < H + Hkv ? h - H : h - H - Hkv) * cap + slot0 + t;
            kv_narrow(kv, tmp, (char *)(h < H + Hkv ? kc : vc) + at * kv_row_bytes(kv, hd), hd);
        }
    }
}

/* out [T, F] = silu(gate) * up, with gu [T, 2F] = [gate | up]; element by element, so threads may take
 * any pieces of the rows. */
static constexpr int PIECE = 1024;

void glu_for(const float *gu, float *out, int T, int F, bool gelu) {
    const int per_row = (F + PIECE - 1) / PIECE, n = T * per_row;
#pragma omp for schedule(static)
    for (int i = 0; i < n; i++) {
        const int t = i / per_row, f0 = i % per_row * PIECE, fn = std::min(PIECE, F - f0);
        const float *g = gu + (size_t)t * 2 * F;
        if (gelu)
            geglu_row(g + f0, g + F + f0, out + (size_t)t * F + f0, fn);
        else
            swiglu_row(g + f0, g + F + f0, out + (size_t)t * F + f0, fn);
    }
}

void swiglu_for(const float *gu, float *out, int T, int F) { glu_for(gu, out, T, F, false); }

/* act 0: SwiGLU, 1: GeGLU with tanh gelu. */
extern "C" void cad_glu(const float *gu, float *out, int T, int F, int act, int nthreads) {
    const int n = T * ((F + PIECE - 1) / PIECE);
#pragma omp parallel num_threads(n > 4 ? nthreads : 1)
    glu_for(gu, out, T, F, act == 1);
}

/* out [T, F] = gpt-oss's clamped SwiGLU of gu [T, 2F] = [gate | up] (vec.hpp oai_row). */
extern "C" void cad_oai_glu(const float *gu, float *out, int T, int F, float alpha, float limit) {
    for (int t = 0; t < T; t++) oai_row(gu + (size_t)t * 2 * F, gu + (size_t)t * 2 * F + F, out + (size_t)t * F, F, alpha, limit);
}

/* n Mamba-2 states [n, H, P, N] a token further, into out: h' = h da + (dt B) x, each product and the sum rounded as
 * torch's separate ops round them (models/recurrent.py `ssm_step`: the same bits). rows [n, ldr]: x [H, P] at xo,
 * B [G, N] at bo, dt [H] at dto and exp(dt A) [H] at dao; a state alone or n of a tree's level, each on its own. */
extern "C" void cad_ssm_step(const float *s, const float *rows, int ldr, int n, int H, int P, int N, int G, int xo,
                             int bo, int dto, int dao, float *out, int nthreads) {
#pragma omp parallel for num_threads(n * H > 1 ? nthreads : 1) schedule(static)
    for (int ih = 0; ih < n * H; ih++) {
        const int i = ih / H, h = ih % H, g = h / (H / G);
        const float *row = rows + (size_t)i * ldr, da = row[dao + h], dt = row[dto + h], *B = row + bo + (size_t)g * N;
        float dtb[1024];
        for (int j = 0; j < N; j++) dtb[j] = dt * B[j];
        for (int p = 0; p < P; p++) {
            const size_t at = ((size_t)ih * P + p) * N;
            const float x = row[xo + h * P + p];
            for (int j = 0; j < N; j++) out[at + j] = s[at + j] * da + dtb[j] * x;
        }
    }
}

/* y [n, H, P] = each state's [n, H, P, N] rows . C [n, G, N] (C's rows ldc apart), summed in order over N. */
extern "C" void cad_ssm_read(const float *s, const float *C, int ldc, int n, int H, int P, int N, int G, float *y,
                             int nthreads) {
#pragma omp parallel for num_threads(n * H > 1 ? nthreads : 1) schedule(static)
    for (int ih = 0; ih < n * H; ih++) {
        const int i = ih / H, h = ih % H, g = h / (H / G);
        const float *c = C + (size_t)i * ldc + (size_t)g * N;
        for (int p = 0; p < P; p++) {
            const float *st = s + ((size_t)ih * P + p) * N;
            float acc = 0.0f;
            for (int j = 0; j < N; j++) acc += st[j] * c[j];
            y[(size_t)ih * P + p] = acc;
        }
    }
}

/* out [T, C] = each row's causal depthwise convolution over its taps: slots [T, K] (global, -1 before the context;
 * rows[s - base] holds slot s, rows ldr apart), w [C, K] (tap K-1 on the row itself). The taps' products and sums
 * in models/recurrent.py `conv_mix`'s order, each rounded as torch's elementwise ops round it: the same bits. */
extern "C" void cad_conv_mix(const float *rows, int ldr, int64_t base, const int64_t *slots, int T, int K,
                             const float *w, int C, float *out, int nthreads) {
    const int pieces = (C + 255) / 256;
#pragma omp parallel for num_threads((int64_t)T * C > 65536 ? nthreads : 1) schedule(static)
    for (int i = 0; i < T * pieces; i++) {
        const int t = i / pieces, c0 = i % pieces * 256, c1 = std::min(C, c0 + 256);
        float *o = out + (size_t)t * C;
        for (int j = 0; j < K; j++) {
            const int64_t slot = slots[(size_t)t * K + j];
            const float *src = rows + (size_t)std::max<int64_t>(slot - base, 0) * ldr;
            const float mask = slot >= 0 ? 1.0f : 0.0f;
            for (int c = c0; c < c1; c++) {
                const float y = src[c] * mask * w[(size_t)c * K + K - 1 - j];
                o[c] = j ? o[c] + y : y;
            }
        }
    }
}

/* n gated delta-net states [n, Hv, Dk, Dv] a token further, into out: S' = e^g S; mem = S'^T k; S' += k (beta (v -
 * mem))^T, each product rounded as torch's separate ops round it (models/recurrent.py `gdn_step`), the sum over Dk in
 * order. rows [n, ldr]: k [Hk, Dk] at ko (head h reads k head h / (Hv / Hk)), v [Hv, Dv] at vo, e^g [Hv] at go and
 * beta [Hv] at bo; a state alone or n of a tree's level, each on its own. Dv <= 1024. */
extern "C" void cad_gdn_step(const float *s, const float *rows, int ldr, int n, int Hv, int Dk, int Dv, int Hk, int ko,
                             int vo, int go, int bo, float *out, int nthreads) {
#pragma omp parallel for num_threads(n * Hv > 1 ? nthreads : 1) schedule(static)
    for (int ih = 0; ih < n * Hv; ih++) {
        const int i = ih / Hv, h = ih % Hv;
        const float *row = rows + (size_t)i * ldr, *k = row + ko + (size_t)(h / (Hv / Hk)) * Dk, *v = row + vo + (size_t)h * Dv;
        const float decay = row[go + h], beta = row[bo + h];
        const float *S = s + (size_t)ih * Dk * Dv;
        float *O = out + (size_t)ih * Dk * Dv;
        float mem[1024], delta[1024];
        for (int j = 0; j < Dv; j++) mem[j] = 0.0f;
        for (int r = 0; r < Dk; r++) {
            const float kr = k[r];
            for (int j = 0; j < Dv; j++) {
                const float d = S[(size_t)r * Dv + j] * decay;
                O[(size_t)r * Dv + j] = d;
                mem[j] += d * kr;
            }
        }
        for (int j = 0; j < Dv; j++) delta[j] = (v[j] - mem[j]) * beta;
        for (int r = 0; r < Dk; r++) {
            const float kr = k[r];
            for (int j = 0; j < Dv; j++) O[(size_t)r * Dv + j] = O[(size_t)r * Dv + j] + kr * delta[j];
        }
    }
}

/* o [n, Hv, Dv] = each state's [n, Hv, Dk, Dv] columns . q [n, Hv, Dk] (q's rows ldq apart), summed in order over Dk. */
extern "C" void cad_gdn_read(const float *s, const float *q, int ldq, int n, int Hv, int Dk, int Dv, float *o,
                             int nthreads) {
#pragma omp parallel for num_threads(n * Hv > 1 ? nthreads : 1) schedule(static)
    for (int ih = 0; ih < n * Hv; ih++) {
        const int i = ih / Hv, h = ih % Hv;
        const float *qh = q + (size_t)i * ldq + (size_t)h * Dk, *S = s + (size_t)ih * Dk * Dv;
        float *oh = o + (size_t)ih * Dv;
        for (int j = 0; j < Dv; j++) oh[j] = 0.0f;
        for (int r = 0; r < Dk; r++)
            for (int j = 0; j < Dv; j++) oh[j] += S[(size_t)r * Dv + j] * qh[r];
    }
}

/* A full memory fence: the sync words two processes share in the arena (actors/syncarea.py) are
 * written after, and read before, the data they hand over. */
extern "C" void cad_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

/* n float rows of d into q8_0 rows (out: n d / 32 * 34 bytes), and back: a write to a q8 cache outside the fused
 * one, and a read of one outside the attention (models/attention.py `store`, `floats`), the same bits as theirs. */
extern "C" void cad_q8_rows(const float *x, uint8_t *out, int n, int d) {
    for (int r = 0; r < n; r++) q8_narrow(x + (size_t)r * d, out + (size_t)r * kv_row_bytes(KV_Q8, d), d);
}

extern "C" void cad_q8_floats(const uint8_t *rows, float *out, int n, int d) {
    for (int r = 0; r < n; r++) q8_widen(rows + (size_t)r * kv_row_bytes(KV_Q8, d), out + (size_t)r * d, d);
}
