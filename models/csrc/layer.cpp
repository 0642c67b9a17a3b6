/* A whole dense decoder layer in one call and one OpenMP parallel region: RMSNorm, the qkv product,
 * bias, q/k norms and RoPE with the keys and values written to the cache, attention, the output product
 * added to the residual (through a norm and a scale where the family has them), RMSNorm, gate_up, the gated
 * activation (SwiGLU or GeGLU) and down added to the residual likewise.
 *
 * The same operations as the layer's separate calls (models/transformer.py `block_fused`), in the same
 * order, through the same functions, so the same bits: only the stages' work is shared among the threads
 * of one region, with a barrier between stages, instead of each call forking its own. A one-token step of
 * a small model makes ~10 calls a layer of tens of microseconds each; their Python and fork/join cost
 * was a fifth of the 0.5B draft's forward.
 *
 * The layer's record (int64, models/layer_kernel.py writes it): dim, H, Hkv, hd, F, the addresses of
 * attn_norm, ffn_norm and the qkv bias (0: none), the flags (bit 0: no norms before the branches, bit 1:
 * GeGLU, bits 2-3: q/k norms 0 none, 1 per head, 2 over the whole projection, bit 4: the values' weightless
 * norm), the addresses of q_norm, k_norm, attn_post_norm and ffn_post_norm (0: none), the residual scale and
 * the attention's soft cap (as the bits of a double), the addresses of the layer's output scalar, the attention
 * sinks (gpt-oss) and the attention output's bias (0: none), then qkv, attn_out, gate_up and down as
 * `QuantLinear.record` gives them (format, n, k, row0 and five array addresses; zeros for a layer of experts).
 * Flag bit 5: the attention branch only (a layer of experts: its FFN is run by the caller, models/moe.py); bit 6:
 * each rotated query and key head divided by its RMS (Llama 4's weightless norm, cad_qkv_rope's `l2_eps`).
 * `qscale` (null: none) is each row's factor on its queries after RoPE. */
#include "ops.hpp"
#include "qlinear.hpp"

#include <algorithm>
#include <cstring>
#include <omp.h>
#include <vector>

namespace {

constexpr int HEAD = 18, REC = 9;
constexpr size_t KEEP_FLOATS = 1 << 20; /* 4 MiB: the 1.5B's buffers for a 16-wide tree are ~2 MiB */

/* x += y (plus its bias, through its post norm and the residual scale, where the layer has them): what
 * `Transformer.residual` does with torch's elementwise ops, one rounding each. */
void add_branch(float *x, float *y, const float *bias, const float *post, float scale, int T, int dim, float eps) {
    if (bias)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < dim; j++) y[(size_t)t * dim + j] = y[(size_t)t * dim + j] + bias[j];
    if (post) cad_rmsnorm(y, post, y, T, dim, eps);
    const size_t n = (size_t)T * dim;
    if (scale != 1.0f)
        for (size_t i = 0; i < n; i++) y[i] = y[i] * scale;
    for (size_t i = 0; i < n; i++) x[i] = x[i] + y[i];
}

/* The q/k norms, before RoPE: per head over hd (Qwen 3, Gemma 3) or over each whole projection (OLMo 2); kind 0:
 * none. The values' weightless norm per head where `ones` (hd of 1.0f) is given (Gemma 4), as `Transformer.norm_qk`
 * does it: its weight of ones. */
void norm_qkv(float *qkv, int T, int H, int Hkv, int hd, int kind, const float *qn, const float *kn, const float *ones,
              float eps) {
    const int width = (H + 2 * Hkv) * hd;
    for (int t = 0; t < T; t++) {
        float *q = qkv + (size_t)t * width, *k = q + (size_t)H * hd;
        if (kind == 1) {
            cad_rmsnorm(q, qn, q, H, hd, eps);
            cad_rmsnorm(k, kn, k, Hkv, hd, eps);
        } else if (kind == 2) {
            cad_rmsnorm(q, qn, q, 1, H * hd, eps);
            cad_rmsnorm(k, kn, k, 1, Hkv * hd, eps);
        }
        if (ones) cad_rmsnorm(k + (size_t)Hkv * hd, ones, k + (size_t)Hkv * hd, Hkv, hd, eps);
    }
}

/* One generation's part of a layer's rows: rows [lo, hi) of x, their rotary tables, its cache and its
 * visibility (as cad_layer's arguments of the same names). */
struct Gen {
    int64_t lo, hi;
    const float *cos_t, *sin_t;
    void *kc, *vc; /* floats, halves or q8_0 rows, as `kv` says (--kv-dtype: csrc/vec.hpp KV_*) */
    int64_t cap, slot0, n_shared;
    const int32_t *ptr, *idx;
    int64_t kv;
};
static_assert(sizeof(Gen) == 12 * sizeof(int64_t), "a Gen is read from twelve int64s");

void layer(const int64_t *rec, float *x, int T, const int64_t *pos, const float *qscale, int ngen, const Gen *gens,
           float scale, float eps, int nthreads) {
    const int dim = (int)rec[0], H = (int)rec[1], Hkv = (int)rec[2], hd = (int)rec[3], F = (int)rec[4];
    const float *attn_norm = (const float *)rec[5], *ffn_norm = (const float *)rec[6], *bias = (const float *)rec[7];
    const int flags = (int)rec[8], qk_kind = (flags >> 2) & 3;
    const bool pre = !(flags & 1), gelu = flags & 2;
    const float *q_norm = (const float *)rec[9], *k_norm = (const float *)rec[10];
    const float *attn_post = (const float *)rec[11], *ffn_post = (const float *)rec[12];
    const float res_scale = (float)q::record_double(rec[13]), softcap = (float)q::record_double(rec[14]);
    const float *layer_scale = (const float *)rec[15]; /* x times it at the layer's end (Gemma 4), or 0 */
    const float *sinks = (const float *)rec[16], *out_bias = (const float *)rec[17];
    const bool v_norm = flags & 16, attn_only = flags & 32, l2 = flags & 64;
    const bool plain_out = !attn_post && res_scale == 1.0f && !out_bias, plain_down = !ffn_post && res_scale == 1.0f;
    const q::QW qkv = q::record_qw(rec + HEAD), out = q::record_qw(rec + HEAD + REC);
    const q::QW gate_up = q::record_qw(rec + HEAD + 2 * REC), down = q::record_qw(rec + HEAD + 3 * REC);
    const int nqkv = (H + 2 * Hkv) * hd, qd = H * hd;
    /* the stages' buffers: kept by the calling thread from call to call for the narrow passes of decoding;
     * a wide one (a prompt's pass) gets its own, given back when it returns, so no peak outlives its pass */
    const size_t nh = (size_t)T * std::max(dim, qd), ny = (size_t)T * std::max({nqkv, 2 * F, dim}),
                 no = (size_t)T * std::max(qd, dim), na = (size_t)T * F;
    thread_local std::vector<float> kept;
    thread_local q::QA kept_a;
    std::vector<float> own;
    q::QA own_a;
    const bool narrow = nh + ny + no + na <= KEEP_FLOATS;
    std::vector<float> &buf = narrow ? kept : own;
    buf.resize(nh + ny + no + na);
    /* named here, outside the region: inside it a thread_local name would be each thread's own */
    float *hb = buf.data(), *yb = hb + nh, *ob = yb + ny, *ab = ob + no;
    q::QA &qa = narrow ? kept_a : own_a;
    thread_local std::vector<float> ones; /* the widest head's: layers of two head sizes (Gemma 4) share it */
    if (v_norm && (int)ones.size() < hd) ones.assign(hd, 1.0f);
    const float *ones_p = v_norm ? ones.data() : nullptr;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp single
        if (pre) cad_rmsnorm(x, attn_norm, hb, T, dim, eps);
        q::qlinear_in(pre ? hb : x, T, qkv, yb, nqkv, 0, qa);
#pragma omp barrier
#pragma omp single
        {
            if (qk_kind || v_norm) norm_qkv(yb, T, H, Hkv, hd, qk_kind, q_norm, k_norm, ones_p, eps);
            for (int g = 0; g < ngen; g++) {
                const Gen &e = gens[g];
                cad_qkv_rope(yb + e.lo * nqkv, bias, pos + e.lo, e.cos_t, e.sin_t, hb + e.lo * qd, e.kc, e.vc,
                             (int)(e.hi - e.lo), H, Hkv, hd, (int)e.cap, (int)e.slot0, (int)e.kv, l2 ? eps : -1.0f);
            }
            if (qscale) /* each row's queries by its position's factor (Ministral 3), as torch's q *= s */
                for (int t = 0; t < T; t++)
                    for (float *q = hb + (size_t)t * qd, *end = q + qd; q < end; q++) *q = *q * qscale[t];
        }
        for (int g = 0; g < ngen; g++) { /* each generation over its own cache, with its own visibility */
            const Gen &e = gens[g];
            attention_for(hb + e.lo * qd, e.kc, e.vc, ob + e.lo * qd, nullptr, sinks, (int)(e.hi - e.lo), H, Hkv, hd,
                          (int)e.cap, (int)e.n_shared, e.ptr, e.idx, scale, softcap, (int)e.kv);
        }
        q::qlinear_in(ob, T, out, plain_out ? x : yb, dim, plain_out, qa); /* x += o W_o^T */
#pragma omp barrier
#pragma omp single
        {
            if (!plain_out) add_branch(x, yb, out_bias, attn_post, res_scale, T, dim, eps);
            if (pre && !attn_only) cad_rmsnorm(x, ffn_norm, hb, T, dim, eps);
        }
        if (!attn_only) { /* (every thread alike: a layer of experts ends here) */
            q::qlinear_in(pre ? hb : x, T, gate_up, yb, 2 * F, 0, qa);
#pragma omp barrier
            glu_for(yb, ab, T, F, gelu);
            q::qlinear_in(ab, T, down, plain_down ? x : ob, dim, plain_down, qa); /* x += act W_down^T */
        }
        if (!attn_only && (!plain_down || layer_scale)) {
#pragma omp barrier
#pragma omp single
            {
                if (!plain_down) add_branch(x, ob, nullptr, ffn_post, res_scale, T, dim, eps);
                if (layer_scale) /* x *= the layer's scalar, as `block_parts.finish` */
                    for (size_t i = 0, n = (size_t)T * dim; i < n; i++) x[i] = x[i] * *layer_scale;
            }
        }
    }
}

}  // namespace

extern "C" void cad_layer(const int64_t *rec, float *x, int T, const int64_t *pos, const float *qscale, const float *cos_t,
                          const float *sin_t, void *kc, void *vc, int cap, int slot0, int n_shared,
                          const int32_t *ptr, const int32_t *idx, float scale, float eps, int kv, int nthreads) {
    const Gen one{0, T, cos_t, sin_t, kc, vc, cap, slot0, n_shared, ptr, idx, kv};
    layer(rec, x, T, pos, qscale, 1, &one, scale, eps, nthreads);
}

/* The layer over several generations' rows at once (issue 42's batch): the norms and products over all T rows
 * together, each generation's RoPE, cache writes and attention over its own cache (`gens`: `ngen` records of
 * twelve int64s, a Gen each, their rows in order). Each row gets the bits it gets through cad_layer alone. */
extern "C" void cad_layer_many(const int64_t *rec, float *x, int T, const int64_t *pos, const float *qscale, int ngen,
                               const int64_t *gens, float scale, float eps, int nthreads) {
    layer(rec, x, T, pos, qscale, ngen, reinterpret_cast<const Gen *>(gens), scale, eps, nthreads);
}
