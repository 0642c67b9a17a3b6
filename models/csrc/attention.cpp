/* Canonical attention over a KV cache with per-row visible keys (causal blocks, token trees).
 *
 * A row's output depends only on its own ordered key sequence: the keys are cut into chunks of
 * CH consecutive keys by their index in that sequence, each chunk is reduced in one fixed order
 * to (max m, sum l, unnormalised output o), and chunks merge left to right. A token scored
 * inside a tree therefore gets bit-for-bit the output it gets when decoded alone, whatever the
 * batch, the tree shape or the thread: the ground on which speculative decoding is lossless.
 *
 * Layouts: q, out [T, H, D]; k, v cache [Hkv, cap, D] of floats, or (`kv`: --kv-dtype) of IEEE halves or
 * q8_0 rows, widened to floats a chunk at a time: the same sums of the same floats; lse [T, H] (optional);
 * sinks [H] (optional, gpt-oss): a logit per head that joins each softmax's denominator only.
 * Row r sees cache slots [0, n_shared) and then slots idx[ptr[r] .. ptr[r+1]), in that order.
 */
#include "ops.hpp"
#include "vec.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

static constexpr int CH = 32;

/* dot(q, k) over D in one fixed order: two eight-lane accumulators over 16-wide steps (lanes 0-7 and 8-15
 * of one sixteen-lane one), then hsum. */
static inline float dot(const float *a, const float *b, int D) {
    v16f acc = v16_splat(0.0f);
    int i = 0;
    for (; i + 16 <= D; i += 16) acc += v16_load(a + i) * v16_load(b + i);
    v8f acc0 = v16_lo(acc);
    for (; i + 8 <= D; i += 8) acc0 += v8_load(a + i) * v8_load(b + i);
    float s = v8_hsum(acc0 + v16_hi(acc));
    for (; i < D; i++) s += a[i] * b[i];
    return s;
}

/* v8_hsum(lo + hi) of four sixteen-lane vectors at once, lane-wise: the same additions of the same pairs in the same order as
 * v8_hsum (v[i] + v[i + 4], then (0 + 2) and (1 + 3) of those, then their sum), so the same bits. */
static inline void hsum16x4(v16f a, v16f b, v16f c, v16f d, float *out) {
    const v8f x = v16_lo(a) + v16_hi(a), y = v16_lo(b) + v16_hi(b), z = v16_lo(c) + v16_hi(c), w = v16_lo(d) + v16_hi(d);
    const v8f s1 = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15); /* x0+x4 .. x3+x7, y0+y4 .. */
    const v8f s2 = __builtin_shufflevector(z, w, 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(z, w, 4, 5, 6, 7, 12, 13, 14, 15);
    const v8f e = __builtin_shufflevector(s1, s2, 0, 1, 4, 5, 8, 9, 12, 13) +
                  __builtin_shufflevector(s1, s2, 2, 3, 6, 7, 10, 11, 14, 15); /* (0+4)+(2+6), (1+5)+(3+7) each */
    const v8f f = __builtin_shufflevector(e, e, 0, 2, 4, 6, 0, 2, 4, 6) + __builtin_shufflevector(e, e, 1, 3, 5, 7, 1, 3, 5, 7);
    out[0] = f[0], out[1] = f[1], out[2] = f[2], out[3] = f[3];
}

/* Four dots at once, each in exactly dot()'s order (same bits), for more independent work. */
static inline void dot4(const float *a, const float *const *b, int D, float *out) {
    if (D % 16 != 0) {
        for (int t = 0; t < 4; t++) out[t] = dot(a, b[t], D);
        return;
    }
    v16f x = v16_splat(0.0f), y = x, z = x, w = x;
    for (int i = 0; i < D; i += 16) {
        const v16f q = v16_load(a + i);
        x += q * v16_load(b[0] + i);
        y += q * v16_load(b[1] + i);
        z += q * v16_load(b[2] + i);
        w += q * v16_load(b[3] + i);
    }
    hsum16x4(x, y, z, w, out);
}

struct ChunkState {
    float m, l;
};

/* A chunk's scores into exp weights: s[j] = exp(scale q.k_j - m) for j < n (0 up to CH); returns (m, l).
 * cap > 0 soft-caps each scaled score first, cap tanh(s / cap) (Gemma 2), as transformers does. */
static ChunkState softmax_part(float *s, int n, float scale, float cap) {
    int j;
    float m = -INFINITY;
    for (j = 0; j < n; j++) {
        s[j] *= scale;
        if (cap > 0.0f) s[j] = std::tanh(s[j] / cap) * cap;
        m = std::max(m, s[j]);
    }
    for (j = n; j < CH; j++) s[j] = m - 1000.0f; /* exp underflows to exactly 0 */
    for (j = 0; j < CH; j += 8) v8_store(s + j, v8_exp(v8_load(s + j) - m));
    float l = 0.0f;
    for (j = 0; j < n; j++) l += s[j];
    return {m, l};
}

/* oc = sum_j s[j] v_j over n keys: each output lane sums its keys in order, however the lanes are grouped
 * into vectors. */
static void weighted_sum(const float *s, const float *const *vp, int n, int D, float *oc) {
    int j, d = 0;
    for (; d + 64 <= D; d += 64) { /* four independent chains hide the add latency */
        v16f a0 = v16_splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
        for (j = 0; j < n; j++) {
            const v16f p = v16_splat(s[j]);
            const float *v = vp[j] + d;
            a0 += p * v16_load(v);
            a1 += p * v16_load(v + 16);
            a2 += p * v16_load(v + 32);
            a3 += p * v16_load(v + 48);
        }
        v16_store(oc + d, a0);
        v16_store(oc + d + 16, a1);
        v16_store(oc + d + 32, a2);
        v16_store(oc + d + 48, a3);
    }
    for (; d + 32 <= D; d += 32) {
        v16f a0 = v16_splat(0.0f), a1 = a0;
        for (j = 0; j < n; j++) {
            const v16f p = v16_splat(s[j]);
            a0 += p * v16_load(vp[j] + d);
            a1 += p * v16_load(vp[j] + d + 16);
        }
        v16_store(oc + d, a0);
        v16_store(oc + d + 16, a1);
    }
    for (; d + 8 <= D; d += 8) {
        v8f acc = v8_splat(0.0f);
        for (j = 0; j < n; j++) acc += s[j] * v8_load(vp[j] + d);
        v8_store(oc + d, acc);
    }
    for (; d < D; d++) {
        float acc = 0.0f;
        for (j = 0; j < n; j++) acc += s[j] * vp[j][d];
        oc[d] = acc;
    }
}

/* One chunk of n <= CH keys: m = max score, l = sum exp(s - m), oc = sum exp(s - m) v.
 * Sums run over keys in order; lanes run over the head dimension. */
static ChunkState chunk(const float *q, const float *const *kp, const float *const *vp, int n, int D, float scale,
                        float *oc, float cap = 0.0f) {
    alignas(32) float s[CH];
    int j = 0;
    for (; j + 4 <= n; j += 4) dot4(q, kp + j, D, s + j);
    for (; j < n; j++) s[j] = dot(q, kp[j], D);
    const ChunkState cs = softmax_part(s, n, scale, cap);
    weighted_sum(s, vp, n, D, oc);
    return cs;
}

/* `chunk` for two queries over the same keys (two heads that share a KV head, or two rows), each key and
 * value loaded once for both: each query's every sum in `chunk`'s order, so the same bits. D % 64 == 0. */
static void chunk2(const float *qa, const float *qb, const float *const *kp, const float *const *vp, int n, int D,
                   float scale, float cap, float *oca, float *ocb, ChunkState *out) {
    alignas(32) float sa[CH], sb[CH];
    int j = 0;
    for (; j + 4 <= n; j += 4) { /* dot4's sums for both queries */
        v16f a0 = v16_splat(0.0f), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        const float *const *k = kp + j;
        for (int i = 0; i < D; i += 16) {
            const v16f x = v16_load(qa + i), y = v16_load(qb + i);
            const v16f k0 = v16_load(k[0] + i), k1 = v16_load(k[1] + i), k2 = v16_load(k[2] + i),
                       k3 = v16_load(k[3] + i);
            a0 += x * k0, a1 += x * k1, a2 += x * k2, a3 += x * k3;
            b0 += y * k0, b1 += y * k1, b2 += y * k2, b3 += y * k3;
        }
        hsum16x4(a0, a1, a2, a3, sa + j);
        hsum16x4(b0, b1, b2, b3, sb + j);
    }
    for (; j < n; j++) sa[j] = dot(qa, kp[j], D), sb[j] = dot(qb, kp[j], D);
    out[0] = softmax_part(sa, n, scale, cap);
    out[1] = softmax_part(sb, n, scale, cap);
    for (int d = 0; d < D; d += 64) { /* weighted_sum's 64-lane blocks for both */
        v16f a0 = v16_splat(0.0f), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (j = 0; j < n; j++) {
            const v16f p = v16_splat(sa[j]), r = v16_splat(sb[j]);
            const float *v = vp[j] + d;
            const v16f v0 = v16_load(v), v1 = v16_load(v + 16), v2 = v16_load(v + 32), v3 = v16_load(v + 48);
            a0 += p * v0, a1 += p * v1, a2 += p * v2, a3 += p * v3;
            b0 += r * v0, b1 += r * v1, b2 += r * v2, b3 += r * v3;
        }
        v16_store(oca + d, a0), v16_store(oca + d + 16, a1), v16_store(oca + d + 32, a2), v16_store(oca + d + 48, a3);
        v16_store(ocb + d, b0), v16_store(ocb + d + 16, b1), v16_store(ocb + d + 32, b2), v16_store(ocb + d + 48, b3);
    }
}

/* Fold a chunk's state into the running state (m, l, o). */
static void merge(float *m, float *l, float *o, ChunkState c, const float *oc, int D, bool first) {
    if (first) {
        *m = c.m;
        *l = c.l;
        std::copy(oc, oc + D, o);
        return;
    }
    float mn = std::max(*m, c.m);
    float a = scalar_exp(*m - mn), b = scalar_exp(c.m - mn);
    *l = *l * a + c.l * b;
    int d = 0;
    v8f va = v8_splat(a), vb = v8_splat(b);
    for (; d + 8 <= D; d += 8) v8_store(o + d, v8_load(o + d) * va + v8_load(oc + d) * vb);
    for (; d < D; d++) o[d] = o[d] * a + oc[d] * b;
    *m = mn;
}

static constexpr int RB = 4; /* rows per work item */

/* Point kp, vp at the n keys and values of KV head kh at cache slots slot(0..n): into a float cache itself, or
 * (halves, q8_0: `kv`) widened into `wide` (2 CH D floats). */
template <typename Slot>
static void gather(const void *kc, const void *vc, int kv, int kh, int cap, int D, int n, Slot slot,
                   const float **kp, const float **vp, float *wide) {
    if (kv == KV_F32) {
        const float *K = (const float *)kc + (size_t)kh * cap * D, *V = (const float *)vc + (size_t)kh * cap * D;
        for (int j = 0; j < n; j++) {
            kp[j] = K + (size_t)slot(j) * D;
            vp[j] = V + (size_t)slot(j) * D;
        }
        return;
    }
    const size_t row = kv_row_bytes(kv, D);
    const char *K = (const char *)kc + (size_t)kh * cap * row, *V = (const char *)vc + (size_t)kh * cap * row;
    for (int j = 0; j < n; j++) {
        float *wk = wide + (size_t)j * D, *wv = wide + (size_t)(CH + j) * D;
        kv_widen(kv, K + (size_t)slot(j) * row, wk, D);
        kv_widen(kv, V + (size_t)slot(j) * row, wv, D);
        kp[j] = wk;
        vp[j] = wv;
    }
}

/* States s0 .. s1 of a work item (s = (row - r0) * G + head within the KV head's group) folded over one
 * chunk of n keys, two queries at a time where D allows (chunk2), else one (chunk). oc: 2 D floats. */
static void fold_chunk(const float *q, int H, int G, int kh, int r0, int s0, int s1, const float *const *kp,
                       const float *const *vp, int n, int D, float scale, float cap, float *m, float *l, float *o,
                       float *oc, bool first) {
    const auto qp = [&](int s) { return q + ((size_t)(r0 + s / G) * H + kh * G + s % G) * D; };
    int s = s0;
    if (D % 64 == 0)
        for (; s + 1 < s1; s += 2) {
            ChunkState cs[2];
            chunk2(qp(s), qp(s + 1), kp, vp, n, D, scale, cap, oc, oc + D, cs);
            merge(&m[s], &l[s], &o[(size_t)s * D], cs[0], oc, D, first);
            merge(&m[s + 1], &l[s + 1], &o[(size_t)(s + 1) * D], cs[1], oc + D, D, first);
        }
    for (; s < s1; s++) {
        const ChunkState cs = chunk(qp(s), kp, vp, n, D, scale, oc, cap);
        merge(&m[s], &l[s], &o[(size_t)s * D], cs, oc, D, first);
    }
}

/* The work items (a KV head and a block of rows each) shared among the threads of the enclosing parallel
 * region (csrc/layer.cpp's, or cad_attention's own); on one thread outside any. */
void attention_for(const float *q, const void *kc, const void *vc, float *out, float *lse, const float *sinks, int T,
                   int H, int Hkv, int D, int cap, int n_shared, const int32_t *ptr, const int32_t *idx, float scale,
                   float softcap, int kv) {
    const int G = H / Hkv;
    const int nblocks = (T + RB - 1) / RB;
    const int nfull = n_shared / CH;
#pragma omp for schedule(dynamic)
    for (int item = 0; item < Hkv * nblocks; item++) {
        const int kh = item % Hkv, r0 = (item / Hkv) * RB, r1 = std::min(T, r0 + RB);
        std::vector<float> m(RB * G), l(RB * G), o((size_t)RB * G * D), oc(2 * D), wide(kv ? 2 * CH * D : 0);
        const float *kp[CH], *vp[CH];
        /* Chunks made only of shared keys: loaded once, used by every row and head of the item. */
        for (int c = 0; c < nfull; c++) {
            gather(kc, vc, kv, kh, cap, D, CH, [&](int j) { return c * CH + j; }, kp, vp, wide.data());
            fold_chunk(q, H, G, kh, r0, 0, (r1 - r0) * G, kp, vp, CH, D, scale, softcap, m.data(), l.data(),
                       o.data(), oc.data(), c == 0);
        }
        /* The rest of each row: the shared tail after the last full chunk, then its own keys. */
        std::vector<int32_t> slots;
        for (int r = r0; r < r1; r++) {
            slots.clear();
            for (int t = nfull * CH; t < n_shared; t++) slots.push_back(t);
            for (int t = ptr[r]; t < ptr[r + 1]; t++) slots.push_back(idx[t]);
            for (size_t c0 = 0; c0 < slots.size(); c0 += CH) {
                const int n = (int)std::min<size_t>(CH, slots.size() - c0);
                gather(kc, vc, kv, kh, cap, D, n, [&](int j) { return slots[c0 + j]; }, kp, vp, wide.data());
                fold_chunk(q, H, G, kh, r0, (r - r0) * G, (r - r0 + 1) * G, kp, vp, n, D, scale, softcap, m.data(),
                           l.data(), o.data(), oc.data(), nfull == 0 && c0 == 0);
            }
            for (int g = 0; g < G; g++) {
                const int s = (r - r0) * G + g, h = kh * G + g;
                float *dst = out + ((size_t)r * H + h) * D;
                const float inv = 1.0f / l[s], row_lse = m[s] + std::log(l[s]);
                for (int d = 0; d < D; d++) dst[d] = o[(size_t)s * D + d] * inv;
                if (sinks) { /* the sink's logit in the denominator only: times sum e^s / (sum e^s + e^sink) */
                    const float keep = 1.0f / (1.0f + std::exp(sinks[h] - row_lse));
                    for (int d = 0; d < D; d++) dst[d] = dst[d] * keep;
                }
                if (lse) lse[(size_t)r * H + h] = row_lse;
            }
        }
    }
}

extern "C" void cad_attention(const float *q, const void *kc, const void *vc, float *out, float *lse,
                              const float *sinks, int T, int H, int Hkv, int D, int cap, int n_shared,
                              const int32_t *ptr, const int32_t *idx, float scale, float softcap, int kv,
                              int nthreads) {
#pragma omp parallel num_threads(nthreads)
    attention_for(q, kc, vc, out, lse, sinks, T, H, Hkv, D, cap, n_shared, ptr, idx, scale, softcap, kv);
}

/* ---- The same attention, split in three (Ghidorah's dense / sparse parts, merged by online softmax).
 *
 * A chunk state is (m, l, o[D]) as `chunk` makes it; an empty running state has l = 0. Folding chunk
 * states left to right in chunk order gives exactly cad_attention's result, wherever each was made.
 *   cad_attn_dense:  each row's running state folded over the shared-prefix chunks [c0, c1)
 *                    (c1 <= n_shared / CH) into st_m, st_l [T, H], st_o [T, H, D]
 *   cad_attn_chunks: each row's chunk states from key index k0 (a multiple of CH) to its end, into
 *                    ch [T, H, maxc, D + 2] as (m, l, o[D]), with the count per row in nch [T]
 *   cad_attn_merge:  fold those chunk states into the running states, normalise, write out [T, H, D]
 */

static inline void fold(float *m, float *l, float *o, ChunkState cs, const float *oc, int D) {
    merge(m, l, o, cs, oc, D, *l == 0.0f);
}

extern "C" void cad_attn_dense(const float *q, const void *kc, const void *vc, float *st_m, float *st_l, float *st_o,
                               int T, int H, int Hkv, int D, int cap, int c0, int c1, float scale, int kv,
                               int nthreads) {
    const int G = H / Hkv, nblocks = (T + RB - 1) / RB;
#pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int item = 0; item < Hkv * nblocks; item++) {
        const int kh = item % Hkv, r0 = (item / Hkv) * RB, r1 = std::min(T, r0 + RB);
        std::vector<float> oc(D), wide(kv ? 2 * CH * D : 0);
        const float *kp[CH], *vp[CH];
        for (int c = c0; c < c1; c++) {
            gather(kc, vc, kv, kh, cap, D, CH, [&](int j) { return c * CH + j; }, kp, vp, wide.data());
            for (int r = r0; r < r1; r++)
                for (int g = 0; g < G; g++) {
                    const size_t s = (size_t)r * H + kh * G + g;
                    ChunkState cs = chunk(q + s * D, kp, vp, CH, D, scale, oc.data());
                    fold(&st_m[s], &st_l[s], &st_o[s * D], cs, oc.data(), D);
                }
        }
    }
}

extern "C" void cad_attn_chunks(const float *q, const void *kc, const void *vc, float *ch, int32_t *nch, int T, int H,
                                int Hkv, int D, int cap, int n_shared, const int32_t *ptr, const int32_t *idx, int k0,
                                int maxc, float scale, int kv, int nthreads) {
    const int G = H / Hkv;
#pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int item = 0; item < Hkv * T; item++) {
        const int kh = item % Hkv, r = item / Hkv;
        std::vector<int32_t> slots;
        for (int t = k0; t < n_shared; t++) slots.push_back(t);
        const int extra0 = std::max(0, k0 - n_shared); /* k0 past the shared prefix skips own keys */
        for (int t = ptr[r] + extra0; t < ptr[r + 1]; t++) slots.push_back(idx[t]);
        const int n = (int)((slots.size() + CH - 1) / CH);
        if (kh == 0) nch[r] = n;
        const float *kp[CH], *vp[CH];
        std::vector<float> wide(kv ? 2 * CH * D : 0);
        for (int c = 0; c < n && c < maxc; c++) {
            const int cnt = (int)std::min<size_t>(CH, slots.size() - (size_t)c * CH);
            gather(kc, vc, kv, kh, cap, D, cnt, [&](int j) { return slots[c * CH + j]; }, kp, vp, wide.data());
            for (int g = 0; g < G; g++) {
                const size_t s = (size_t)r * H + kh * G + g;
                float *dst = ch + (s * maxc + c) * (D + 2);
                ChunkState cs = chunk(q + s * D, kp, vp, cnt, D, scale, dst + 2);
                dst[0] = cs.m;
                dst[1] = cs.l;
            }
        }
    }
}

extern "C" void cad_attn_merge(float *st_m, float *st_l, float *st_o, const float *ch, const int32_t *nch, float *out,
                               int T, int H, int D, int maxc) {
    for (int r = 0; r < T; r++)
        for (int h = 0; h < H; h++) {
            const size_t s = (size_t)r * H + h;
            for (int c = 0; c < nch[r] && c < maxc; c++) {
                const float *src = ch + (s * maxc + c) * (D + 2);
                fold(&st_m[s], &st_l[s], &st_o[s * D], ChunkState{src[0], src[1]}, src + 2, D);
            }
            const float inv = 1.0f / st_l[s];
            for (int d = 0; d < D; d++) out[s * D + d] = st_o[s * D + d] * inv;
        }
}
