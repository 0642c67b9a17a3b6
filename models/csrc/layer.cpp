/* A whole dense decoder layer in one call and one OpenMP parallel region: RMSNorm, the qkv product,
 * bias and RoPE with the keys and values written to the cache, attention, the output product added to
 * the residual, RMSNorm, gate_up, SwiGLU and down added to the residual.
 *
 * The same operations as the layer's separate calls (models/transformer.py `block_fused`), in the same
 * order, through the same functions, so the same bits: only the stages' work is shared among the threads
 * of one region, with a barrier between stages, instead of each call forking its own. A one-token step of
 * a small model makes ~10 calls a layer of tens of microseconds each; their Python and fork/join cost
 * was a fifth of the 0.5B draft's forward.
 *
 * The layer's record (int64, models/layer_kernel.py writes it): dim, H, Hkv, hd, F, the addresses of
 * attn_norm, ffn_norm and the qkv bias (0: none), then qkv, attn_out, gate_up and down as
 * `QuantLinear.record` gives them (format, n, k, row0 and five array addresses). */
#include "ops.hpp"
#include "qlinear.hpp"

#include <algorithm>
#include <omp.h>
#include <vector>

namespace {

constexpr int HEAD = 8, REC = 9;
constexpr size_t KEEP_FLOATS = 1 << 20; /* 4 MiB: the 1.5B's buffers for a 16-wide tree are ~2 MiB */

q::QW qw(const int64_t *r) {
    return q::QW((int)r[0], (int)r[1], (int)r[2], (int)r[3], (const void *)r[4], (const void *)r[5],
                 (const void *)r[6], (const void *)r[7], (const void *)r[8]);
}

}  // namespace

extern "C" void cad_layer(const int64_t *rec, float *x, int T, const int64_t *pos, const float *cos_t,
                          const float *sin_t, float *kc, float *vc, int cap, int slot0, int n_shared,
                          const int32_t *ptr, const int32_t *idx, float scale, float eps, int nthreads) {
    const int dim = (int)rec[0], H = (int)rec[1], Hkv = (int)rec[2], hd = (int)rec[3], F = (int)rec[4];
    const float *attn_norm = (const float *)rec[5], *ffn_norm = (const float *)rec[6], *bias = (const float *)rec[7];
    const q::QW qkv = qw(rec + HEAD), out = qw(rec + HEAD + REC), gate_up = qw(rec + HEAD + 2 * REC),
                down = qw(rec + HEAD + 3 * REC);
    const int nqkv = (H + 2 * Hkv) * hd, qd = H * hd;
    /* the stages' buffers: kept by the calling thread from call to call for the narrow passes of decoding;
     * a wide one (a prompt's pass) gets its own, given back when it returns, so no peak outlives its pass */
    const size_t nh = (size_t)T * std::max(dim, qd), ny = (size_t)T * std::max(nqkv, 2 * F), no = (size_t)T * qd,
                 na = (size_t)T * F;
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
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp single
        cad_rmsnorm(x, attn_norm, hb, T, dim, eps);
        q::qlinear_in(hb, T, qkv, yb, nqkv, 0, qa);
#pragma omp barrier
#pragma omp single
        cad_qkv_rope(yb, bias, pos, cos_t, sin_t, hb, kc, vc, T, H, Hkv, hd, cap, slot0);
        attention_for(hb, kc, vc, ob, nullptr, T, H, Hkv, hd, cap, n_shared, ptr, idx, scale);
        q::qlinear_in(ob, T, out, x, dim, 1, qa); /* x += o W_o^T */
#pragma omp barrier
#pragma omp single
        cad_rmsnorm(x, ffn_norm, hb, T, dim, eps);
        q::qlinear_in(hb, T, gate_up, yb, 2 * F, 0, qa);
#pragma omp barrier
        swiglu_for(yb, ab, T, F);
        q::qlinear_in(ab, T, down, x, dim, 1, qa); /* x += swiglu W_down^T */
    }
}
