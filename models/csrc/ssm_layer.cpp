/* A Mamba-2 branch in one call (models/recurrent.py `mamba2`, a chain's rows: a decode step's, a prompt's): the
 * input product, the rows' convolution, their front (x, B, dt, exp(dt A); C), the scan from the layer's state, the
 * back (D, gate, norm) and the output product added to the residual, through the same functions in the same order
 * as the separate calls, so the same bits. A decode step of a hybrid makes ~8 calls a Mamba-2 layer; their Python
 * was a tenth of the step.
 *
 * The record (int64, models/recurrent_kernels.py `ssm_record` writes it): H, P, N, G, inner, the convolution's
 * width and taps K, the norm's kind (`cad_ssm_back`), the addresses of the convolution's taps [width, K] and bias
 * (0: none), dt's bias, A_log, D and the norm's weight (D where there is no norm), the residual scale and the norm's
 * eps (as the bits of a double), then the input and output products as `QuantLinear.record` gives them. */
#include "qlinear.hpp"

#include <cstring>
#include <vector>

extern "C" void cad_conv_mix(const float *rows, int ldr, int64_t base, const int64_t *slots, int T, int K,
                             const float *w, int C, float *out, int nthreads);
extern "C" void cad_ssm_front(const float *conv, const float *cb, const float *dt_raw, int ldd, const float *dt_bias,
                              const float *a, int T, int inner, int GN, int H, float *row, int ldr, float *c,
                              int nthreads);
extern "C" void cad_ssm_scan(const float *s, const float *rows, int ldr, int T, int H, int P, int N, int G, int xo,
                             int bo, int dto, int dao, const float *C, int ldc, float *y, float *out, int nthreads);
extern "C" void cad_ssm_back(const float *ys, const float *x, int ldx, const float *D, const float *z, int ldz,
                             const float *weight, int T, int H, int P, int group, int norm, float eps, float *out,
                             int nthreads);

namespace {

constexpr int HEAD = 16, REC = 9;

const float *f(int64_t address) { return (const float *)address; }

}  // namespace

/* x [T, dim] += the branch of h [T, dim] (the layer's normed input) over the layer's rows (ldr floats apart; slot s
 * at rows[s - base], this forward's from slot0) and its convolution taps `slots` [T, K]; the chain's state `state`
 * [H, P, N] stepped over the T rows, the last into `end`. */
extern "C" void cad_ssm_layer(const int64_t *rec, float *x, const float *h, int T, float *rows, int ldr, int64_t base,
                              int slot0, const int64_t *slots, const float *state, float *end, int nthreads) {
    const int H = (int)rec[0], P = (int)rec[1], N = (int)rec[2], G = (int)rec[3], inner = (int)rec[4];
    const int width = (int)rec[5], K = (int)rec[6], norm = (int)rec[7];
    const float scale = (float)q::record_double(rec[14]), eps = (float)q::record_double(rec[15]);
    const q::QW in = q::record_qw(rec + HEAD), out = q::record_qw(rec + HEAD + REC);
    const int wide = inner + width + H, GN = G * N, xo = width;
    std::vector<float> zxd((size_t)T * wide), conv((size_t)T * width), c((size_t)T * GN), ys((size_t)T * H * P);
    std::vector<float> o((size_t)T * inner);
    q::qlinear(h, T, in, zxd.data(), wide, 0, nthreads);  // [z | x B C | dt]
    float *mine = rows + (size_t)(slot0)*ldr;
    for (int t = 0; t < T; t++)
        std::memcpy(mine + (size_t)t * ldr, zxd.data() + (size_t)t * wide + inner, sizeof(float) * width);
    cad_conv_mix(rows, ldr, base, slots, T, K, f(rec[8]), width, conv.data(), nthreads);
    cad_ssm_front(conv.data(), f(rec[9]), zxd.data() + inner + width, wide, f(rec[10]), f(rec[11]), T, inner, GN, H,
                  mine + width, ldr, c.data(), nthreads);
    const int bo = xo + H * P, dto = bo + GN, dao = dto + H;
    cad_ssm_scan(state, mine, ldr, T, H, P, N, G, xo, bo, dto, dao, c.data(), GN, ys.data(), end, nthreads);
    cad_ssm_back(ys.data(), mine + width, ldr, f(rec[12]), zxd.data(), wide, f(rec[13]), T, H, P, inner / G, norm, eps,
                 o.data(), nthreads);
    if (scale == 1.0f) {
        q::qlinear(o.data(), T, out, x, out.N, 1, nthreads);  // added in place, as `Transformer.residual` adds it
        return;
    }
    std::vector<float> y((size_t)T * out.N);
    q::qlinear(o.data(), T, out, y.data(), out.N, 0, nthreads);
    for (size_t i = 0; i < y.size(); i++) y[i] = y[i] * scale;
    for (size_t i = 0; i < y.size(); i++) x[i] = x[i] + y[i];
}
