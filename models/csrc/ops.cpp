/* The small per-layer operations around the matrix products, fused so that a decode step is a
 * handful of calls per layer instead of dozens of tensor ops. All are row-wise: a row's result
 * never depends on the other rows. */
#include "ops.hpp"
#include "vec.hpp"

#include <algorithm>
#include <cmath>

/* 1 / rms(x), x of D floats, reduced in one fixed order. */
static inline float inv_rms(const float *x, int D, float eps) {
    v8f acc = v8_splat(0.0f);
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        const v8f v = v8_load(x + d);
        acc += v * v;
    }
    float ss = v8_hsum(acc);
    for (; d < D; d++) ss += x[d] * x[d];
    return 1.0f / std::sqrt(ss / (float)D + eps);
}

/* out[t] = x[t] / rms(x[t]) * w, reduced in one fixed order. */
extern "C" void cad_rmsnorm(const float *x, const float *w, float *out, int T, int D, float eps) {
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * D;
        float *o = out + (size_t)t * D;
        const float r = inv_rms(xr, D, eps);
        int d = 0;
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
 * the layer's cache kc, vc [Hkv, cap, hd] at slots slot0 .. slot0 + T. cos/sin tables [*, hd]. `l2_eps` >= 0:
 * each rotated query and key head divided by its RMS (Llama 4's weightless "L2" norm, as cad_rmsnorm over a weight
 * of ones), before the key is stored. */
extern "C" void cad_qkv_rope(const float *qkv, const float *bias, const int64_t *pos, const float *cos_t,
                             const float *sin_t, float *q_out, void *kc, void *vc, int T, int H, int Hkv, int hd,
                             int cap, int slot0, int kv, float l2_eps) {
    const int width = (H + 2 * Hkv) * hd;
    float tmp[1024];
    for (int t = 0; t < T; t++) {
        const float *row = qkv + (size_t)t * width;
        const float *cs = cos_t + (size_t)pos[t] * hd, *sn = sin_t + (size_t)pos[t] * hd;
        for (int h = 0; h < H + 2 * Hkv; h++) {
            const float *src = row + (size_t)h * hd;
            for (int i = 0; i < hd; i++) tmp[i] = bias ? src[i] + bias[(size_t)h * hd + i] : src[i];
            if (h < H + Hkv) rope_head(tmp, cs, sn, hd);
            if (h < H + Hkv && l2_eps >= 0.0f) {
                const float r = inv_rms(tmp, hd, l2_eps);
                for (int i = 0; i < hd; i++) tmp[i] = tmp[i] * r;
            }
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
