/* The recurrent layers' kernels (models/recurrent.py): a causal depthwise convolution over a tree's taps, Mamba-2's
 * and the gated delta-net's states stepped and read, and the delta-net's elementwise work before and after its
 * state (SiLU, L2 norms, decays and betas; the gated RMS norm). Each row on its own, in an order that depends only
 * on the row: a tree's node gets the bits its path decoded alone gets. A state step and a read are one pass each;
 * where torch computes the same thing (the convolution, Mamba-2's step) the products and sums are rounded as torch's
 * separate ops round them. */
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstddef>

namespace {

/* One Mamba-2 head's state [P, N] a token further, into O (O may be S): h' = h da + (dt B) x, each product and the
 * sum rounded as torch's separate ops round them (models/recurrent.py `ssm_step`: the same bits). row: x [H, P] at
 * xo, B [G, N] at bo, dt [H] at dto and exp(dt A) [H] at dao. */
void ssm_head_step(const float *S, const float *row, int h, int g, int P, int N, int xo, int bo, int dto, int dao,
                   float *O) {
    const float da = row[dao + h], dt = row[dto + h], *B = row + bo + (size_t)g * N;
    float dtb[1024];
    for (int j = 0; j < N; j++) dtb[j] = dt * B[j];
    for (int p = 0; p < P; p++) {
        const float x = row[xo + h * P + p];
        for (int j = 0; j < N; j++) O[(size_t)p * N + j] = S[(size_t)p * N + j] * da + dtb[j] * x;
    }
}

/* y [P] = one head's state [P, N] . c [N]: each sum in 16 lanes (element j into lane j mod 16, in order), then the
 * lanes halved pairwise: an order that depends only on N, and a loop the compiler vectorizes (one running sum is a
 * chain of dependent adds: a third of a decode step's Mamba-2 time). */
void ssm_head_read(const float *S, const float *c, int P, int N, float *y) {
    for (int p = 0; p < P; p++) {
        const float *st = S + (size_t)p * N;
        float acc[16] = {};
        int j = 0;
        for (; j + 16 <= N; j += 16)
            for (int l = 0; l < 16; l++) acc[l] += st[j + l] * c[j + l];
        for (; j < N; j++) acc[j % 16] += st[j] * c[j];
        for (int w = 8; w > 0; w /= 2)
            for (int l = 0; l < w; l++) acc[l] += acc[l + w];
        y[p] = acc[0];
    }
}

/* `ssm_head_step` then `ssm_head_read` of the new state by c, in one pass: each element read back in register as
 * it is written, summed into the same lanes in the same order: the bits of the two. */
void ssm_head_step_read(const float *S, const float *row, const float *c, int h, int g, int P, int N, int xo, int bo,
                        int dto, int dao, float *O, float *y) {
    const float da = row[dao + h], dt = row[dto + h], *B = row + bo + (size_t)g * N;
    float dtb[1024];
    for (int j = 0; j < N; j++) dtb[j] = dt * B[j];
    for (int p = 0; p < P; p++) {
        const float x = row[xo + h * P + p], *st = S + (size_t)p * N;
        float *o = O + (size_t)p * N, acc[16] = {};
        int j = 0;
        for (; j + 16 <= N; j += 16) {  // (a block of 16 computed whole before it is stored: O may be S)
            float v[16];
            for (int l = 0; l < 16; l++) v[l] = st[j + l] * da + dtb[j + l] * x;
            for (int l = 0; l < 16; l++) acc[l] += v[l] * c[j + l];
            for (int l = 0; l < 16; l++) o[j + l] = v[l];
        }
        for (; j < N; j++) {
            const float v = st[j] * da + dtb[j] * x;
            o[j] = v;
            acc[j % 16] += v * c[j];
        }
        for (int w = 8; w > 0; w /= 2)
            for (int l = 0; l < w; l++) acc[l] += acc[l + w];
        y[p] = acc[0];
    }
}

/* A delta-net step's first pass over one head's state [Dk, Dv], into O (O may be S): O = e^g S; mem = O^T k, summed
 * over Dk in order; delta [Dv] = beta (v - mem). Dv <= 1024. */
void gdn_head_decay(const float *S, const float *k, const float *v, float decay, float beta, int Dk, int Dv, float *O,
                    float *delta) {
    float mem[1024];
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
}

/* One delta-net head's state [Dk, Dv] a token further, into O (O may be S): S' = e^g S; mem = S'^T k; S' += k (beta
 * (v - mem))^T, each product rounded as torch's separate ops round it (models/recurrent.py `gdn_step`), the sum over
 * Dk in order. k [Dk], v [Dv]. Dv <= 1024. */
void gdn_head_step(const float *S, const float *k, const float *v, float decay, float beta, int Dk, int Dv, float *O) {
    float delta[1024];
    gdn_head_decay(S, k, v, decay, beta, Dk, Dv, O, delta);
    for (int r = 0; r < Dk; r++) {
        const float kr = k[r];
        for (int j = 0; j < Dv; j++) O[(size_t)r * Dv + j] = O[(size_t)r * Dv + j] + kr * delta[j];
    }
}

/* `gdn_head_step` then `gdn_head_read` of the new state by q [Dk], the update's second pass and the read in one (the
 * read's sums over Dk in the same order, each element read back in register as it is written): the bits of the
 * two. */
void gdn_head_step_read(const float *S, const float *k, const float *v, float decay, float beta, const float *q, int Dk,
                        int Dv, float *O, float *o) {
    float delta[1024], read[1024];
    gdn_head_decay(S, k, v, decay, beta, Dk, Dv, O, delta);
    for (int j = 0; j < Dv; j++) read[j] = 0.0f;
    for (int r = 0; r < Dk; r++) {
        const float kr = k[r], qr = q[r];
        float *row = O + (size_t)r * Dv;
        for (int j = 0; j < Dv; j++) {
            const float u = row[j] + kr * delta[j];
            row[j] = u;
            read[j] += u * qr;
        }
    }
    for (int j = 0; j < Dv; j++) o[j] = read[j];
}

/* o [Dv] = one delta-net head's state [Dk, Dv] columns . q [Dk], summed in order over Dk. */
void gdn_head_read(const float *S, const float *q, int Dk, int Dv, float *o) {
    for (int j = 0; j < Dv; j++) o[j] = 0.0f;
    for (int r = 0; r < Dk; r++)
        for (int j = 0; j < Dv; j++) o[j] += S[(size_t)r * Dv + j] * q[r];
}

}  // namespace

/* n Mamba-2 states [n, H, P, N] a token further, into out (`ssm_head_step`; rows [n, ldr]): a state alone or n of a
 * tree's level, each on its own. */
extern "C" void cad_ssm_step(const float *s, const float *rows, int ldr, int n, int H, int P, int N, int G, int xo,
                             int bo, int dto, int dao, float *out, int nthreads) {
#pragma omp parallel for num_threads(n * H > 1 ? nthreads : 1) schedule(static)
    for (int ih = 0; ih < n * H; ih++) {
        const int i = ih / H, h = ih % H;
        const size_t at = (size_t)ih * P * N;
        ssm_head_step(s + at, rows + (size_t)i * ldr, h, h / (H / G), P, N, xo, bo, dto, dao, out + at);
    }
}

/* y [n, H, P] = each state's [n, H, P, N] rows . C [n, G, N] (C's rows ldc apart; `ssm_head_read`). */
extern "C" void cad_ssm_read(const float *s, const float *C, int ldc, int n, int H, int P, int N, int G, float *y,
                             int nthreads) {
#pragma omp parallel for num_threads(n * H > 1 ? nthreads : 1) schedule(static)
    for (int ih = 0; ih < n * H; ih++) {
        const int i = ih / H, h = ih % H;
        ssm_head_read(s + (size_t)ih * P * N, C + (size_t)i * ldc + (size_t)(h / (H / G)) * N, P, N, y + (size_t)ih * P);
    }
}

/* A chain of T rows from the state s [H, P, N] (a prompt's, a chain's verification): each row's state stepped from
 * the last and read, y [T, H, P], the last state into out; the bits of T `cad_ssm_step`s and `cad_ssm_read`s, in
 * one call (the rows' states are not kept: a chain's rows have no other children). */
extern "C" void cad_ssm_scan(const float *s, const float *rows, int ldr, int T, int H, int P, int N, int G, int xo,
                             int bo, int dto, int dao, const float *C, int ldc, float *y, float *out, int nthreads) {
#pragma omp parallel for num_threads(H > 1 ? nthreads : 1) schedule(static)
    for (int h = 0; h < H; h++) {
        const size_t at = (size_t)h * P * N;
        for (int t = 0; t < T; t++)
            ssm_head_step_read(t ? out + at : s + at, rows + (size_t)t * ldr, C + (size_t)t * ldc + (size_t)(h / (H / G)) * N,
                               h, h / (H / G), P, N, xo, bo, dto, dao, out + at, y + ((size_t)t * H + h) * P);
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

/* n gated delta-net states [n, Hv, Dk, Dv] a token further, into out (`gdn_head_step`). rows [n, ldr]: k [Hk, Dk] at
 * ko (head h reads k head h / (Hv / Hk)), v [Hv, Dv] at vo, e^g [Hv] at go and beta [Hv] at bo; a state alone or n
 * of a tree's level, each on its own. */
extern "C" void cad_gdn_step(const float *s, const float *rows, int ldr, int n, int Hv, int Dk, int Dv, int Hk, int ko,
                             int vo, int go, int bo, float *out, int nthreads) {
#pragma omp parallel for num_threads(n * Hv > 1 ? nthreads : 1) schedule(static)
    for (int ih = 0; ih < n * Hv; ih++) {
        const int i = ih / Hv, h = ih % Hv;
        const float *row = rows + (size_t)i * ldr, *k = row + ko + (size_t)(h / (Hv / Hk)) * Dk;
        const size_t at = (size_t)ih * Dk * Dv;
        gdn_head_step(s + at, k, row + vo + (size_t)h * Dv, row[go + h], row[bo + h], Dk, Dv, out + at);
    }
}

/* o [n, Hv, Dv] = each state's [n, Hv, Dk, Dv] columns . q [n, Hk, Dk] (head h reads q head h / (Hv / Hk); q's rows
 * ldq apart; `gdn_head_read`). */
extern "C" void cad_gdn_read(const float *s, const float *q, int ldq, int n, int Hv, int Dk, int Dv, int Hk, float *o,
                             int nthreads) {
#pragma omp parallel for num_threads(n * Hv > 1 ? nthreads : 1) schedule(static)
    for (int ih = 0; ih < n * Hv; ih++) {
        const int i = ih / Hv, h = ih % Hv;
        const float *qh = q + (size_t)i * ldq + (size_t)(h / (Hv / Hk)) * Dk;
        gdn_head_read(s + (size_t)ih * Dk * Dv, qh, Dk, Dv, o + (size_t)ih * Dv);
    }
}

/* A chain of T rows from the state s [Hv, Dk, Dv]: each row's state stepped from the last and read by its q, o [T,
 * Hv, Dv], the last state into out; the bits of T `cad_gdn_step`s and `cad_gdn_read`s, in one call. */
extern "C" void cad_gdn_scan(const float *s, const float *rows, int ldr, int T, int Hv, int Dk, int Dv, int Hk, int ko,
                             int vo, int go, int bo, const float *q, int ldq, float *o, float *out, int nthreads) {
#pragma omp parallel for num_threads(Hv > 1 ? nthreads : 1) schedule(static)
    for (int h = 0; h < Hv; h++) {
        const size_t at = (size_t)h * Dk * Dv, kh = (size_t)(h / (Hv / Hk)) * Dk;
        for (int t = 0; t < T; t++) {
            const float *row = rows + (size_t)t * ldr;
            gdn_head_step_read(t ? out + at : s + at, row + ko + kh, row + vo + (size_t)h * Dv, row[go + h], row[bo + h],
                               q + (size_t)t * ldq + kh, Dk, Dv, out + at, o + ((size_t)t * Hv + h) * Dv);
        }
    }
}

namespace {

float silu(float x) { return x / (1.0f + std::exp(-x)); }

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); } /* torch's, threshold 20 */

/* x [n] scaled to unit L2 norm (1e-6 under the root), times `scale`, in place. */
void l2_unit(float *x, int n, float scale) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / std::sqrt(ss + 1e-6f);
    for (int i = 0; i < n; i++) x[i] = x[i] * r * scale;
}

}  // namespace

/* The delta-net's rows from its convolved input: for each of T rows, conv [C] = [q | k | v] (SiLU'd here), b and a
 * [Hv] (a's raw gate, `araw`): q's and k's heads of Dk L2-normed (q's times Dk^-1/2) into q [T, Hk * Dk]; into
 * row [T, ldr] at k's offset: k [Hk * Dk], v [Hv * Dv], e^g [Hv] with g = -e^A softplus(a + dt), beta [Hv] =
 * sigmoid(b) beta_scale; g itself into g [T, Hv] (a prompt's chunked form reads it). b and a rows ldb apart. */
extern "C" void cad_gdn_front(const float *conv, const float *b, const float *araw, int ldb, const float *A,
                              const float *dt, int T, int Hk, int Dk, int Hv, int Dv, float beta_scale, float *q,
                              float *row, int ldr, float *g, int nthreads) {
    const int C = 2 * Hk * Dk + Hv * Dv;
#pragma omp parallel for num_threads(T > 1 ? nthreads : 1) schedule(static)
    for (int t = 0; t < T; t++) {
        const float *c = conv + (size_t)t * C;
        float *qt = q + (size_t)t * Hk * Dk, *rt = row + (size_t)t * ldr, *kt = rt, *vt = rt + Hk * Dk;
        for (int i = 0; i < Hk * Dk; i++) qt[i] = silu(c[i]);
        for (int i = 0; i < Hk * Dk; i++) kt[i] = silu(c[Hk * Dk + i]);
        for (int i = 0; i < Hv * Dv; i++) vt[i] = silu(c[2 * Hk * Dk + i]);
        for (int h = 0; h < Hk; h++) {
            l2_unit(qt + h * Dk, Dk, 1.0f / std::sqrt((float)Dk));
            l2_unit(kt + h * Dk, Dk, 1.0f);
        }
        float *decay = vt + Hv * Dv, *beta = decay + Hv, *gt = g + (size_t)t * Hv;
        const float *bt = b + (size_t)t * ldb, *at = araw + (size_t)t * ldb;
        for (int h = 0; h < Hv; h++) {
            gt[h] = softplus(at[h] + dt[h]) * -std::exp(A[h]);
            decay[h] = std::exp(gt[h]);
            beta[h] = sigmoid(bt[h]) * beta_scale;
        }
    }
}

/* The delta-net's output before its product: each of T rows' o [Hv * Dv], head by head RMS-normed (eps), times the
 * norm's weight [Dv], times SiLU(z) (z rows ldz apart), into out [T, Hv * Dv]. */
extern "C" void cad_gdn_back(const float *o, const float *z, int ldz, const float *weight, int T, int Hv, int Dv,
                             float eps, float *out, int nthreads) {
#pragma omp parallel for num_threads(T > 1 ? nthreads : 1) schedule(static)
    for (int t = 0; t < T; t++)
        for (int h = 0; h < Hv; h++) {
            const float *x = o + ((size_t)t * Hv + h) * Dv, *zt = z + (size_t)t * ldz + (size_t)h * Dv;
            float ss = 0.0f;
            for (int j = 0; j < Dv; j++) ss += x[j] * x[j];
            const float r = 1.0f / std::sqrt(ss / (float)Dv + eps);
            float *y = out + ((size_t)t * Hv + h) * Dv;
            for (int j = 0; j < Dv; j++) y[j] = x[j] * r * weight[j] * silu(zt[j]);
        }
}

/* Mamba-2's rows from its convolved input: for each of T rows, conv [inner + 2 G N] = [x | B | C] (plus the
 * convolution's bias cb where it has one, 0: none; SiLU'd here): into row [T, ldr] x [inner], B [G N], dt [H] =
 * softplus(dt_raw + dt_bias) and exp(dt A) [H], A = -e^a; C into c [T, G N]. dt_raw's rows ldd apart. */
extern "C" void cad_ssm_front(const float *conv, const float *cb, const float *dt_raw, int ldd, const float *dt_bias,
                              const float *a, int T, int inner, int GN, int H, float *row, int ldr, float *c,
                              int nthreads) {
    const int width = inner + 2 * GN;
#pragma omp parallel for num_threads(T > 1 ? nthreads : 1) schedule(static)
    for (int t = 0; t < T; t++) {
        const float *x = conv + (size_t)t * width, *d = dt_raw + (size_t)t * ldd;
        float *rt = row + (size_t)t * ldr, *ct = c + (size_t)t * GN;
        for (int i = 0; i < inner + GN; i++) rt[i] = silu(cb ? x[i] + cb[i] : x[i]);
        for (int i = inner + GN; i < width; i++) ct[i - inner - GN] = silu(cb ? x[i] + cb[i] : x[i]);
        float *dt = rt + inner + GN, *da = dt + H;
        for (int h = 0; h < H; h++) {
            dt[h] = softplus(d[h] + dt_bias[h]);
            da[h] = std::exp(dt[h] * -std::exp(a[h]));
        }
    }
}

/* Mamba-2's output before its product, each of T rows: y = ys + D x (ys [T, H, P], x the row's [H P], rows ldx apart),
 * then by `norm`: 0 group-RMS-normed (groups of `group`, eps) after the gate SiLU(z), times weight; 1 the gate
 * alone; 2 normed and weighted before the gate. z's rows ldz apart; into out [T, H P]. */
extern "C" void cad_ssm_back(const float *ys, const float *x, int ldx, const float *D, const float *z, int ldz,
                             const float *weight, int T, int H, int P, int group, int norm, float eps, float *out,
                             int nthreads) {
    const int inner = H * P;
#pragma omp parallel for num_threads(T > 1 ? nthreads : 1) schedule(static)
    for (int t = 0; t < T; t++) {
        const float *yt = ys + (size_t)t * inner, *xt = x + (size_t)t * ldx, *zt = z + (size_t)t * ldz;
        float *o = out + (size_t)t * inner;
        for (int i = 0; i < inner; i++) o[i] = yt[i] + D[i / P] * xt[i];
        if (norm == 0)
            for (int i = 0; i < inner; i++) o[i] = o[i] * silu(zt[i]);
        if (norm != 1)
            for (int g0 = 0; g0 < inner; g0 += group) {
                float ss = 0.0f;
                for (int i = g0; i < g0 + group; i++) ss += o[i] * o[i];
                const float r = 1.0f / std::sqrt(ss / (float)group + eps);
                for (int i = g0; i < g0 + group; i++) o[i] = o[i] * r * weight[i];
            }
        if (norm != 0)
            for (int i = 0; i < inner; i++) o[i] = o[i] * silu(zt[i]);
    }
}
