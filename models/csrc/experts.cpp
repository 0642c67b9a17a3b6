/* A mixture-of-experts layer's routed experts in one call: the tokens of a block grouped by expert,
 * each expert's gate/up product, SwiGLU and down product, and the weighted sum per token, with one
 * team of threads and no Python per expert. The threads split the tiles of all experts' matrices
 * at once (a decode step's eight experts are eight short products: split one by one, each would
 * leave threads idle at its end).
 *
 * The bits are those of the expert-by-expert path (models/transformer.py): the same quantized
 * products, the same SwiGLU, and each token's sum taken over its experts in the order they are given
 * (ascending ids), as out[t] = out[t] + y_e[t] * w_e, starting from what `out` holds. */
#include "qlinear.hpp"

#include <algorithm>
#include <omp.h>
#include <vector>

namespace {

constexpr int REC = 9; /* per matrix: format, N, K, row0, q, a1 .. a4 */

struct Job {
    q::QW gu, dn;
    const float *bgu, *bdn;  /* the biases of gate_up and down, or null */
    std::vector<int> rows;   /* tokens routed to this expert, ascending */
    std::vector<float> w;    /* their routing weights */
    q::QA x, s;              /* the rows of h, the SwiGLU outputs, quantized */
    std::vector<float> g, y; /* gate|up [Me, 2F], down [Me, D] */
    std::vector<float> act;  /* SwiGLU [Me, F] */
};

/* This thread's share [lo, hi) of all jobs' tiles of one matrix (gate_up or down), in job order. */
template <typename Fn>
void my_tiles(std::vector<Job> &jobs, bool down, Fn fn) {
    long total = 0;
    for (Job &j : jobs) total += (down ? j.dn : j.gu).tiles();
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const long lo = total * id / nt, hi = total * (id + 1) / nt;
    long base = 0;
    for (Job &j : jobs) {
        const int n = (down ? j.dn : j.gu).tiles();
        const long a = std::max(lo, base), b = std::min(hi, base + n);
        if (a < b) fn(j, (int)(a - base), (int)(b - base));
        base += n;
    }
}

}  // namespace

/* h [T, D]; ids, top [T, k]: each token's experts and routing weights; expert_ids [E] (ascending) with
 * table [E, 2, REC]: each expert's gate_up ([2F, D]) and down ([D, F]) as qlinear.hpp matrices;
 * out [T, D] += the routed experts' weighted outputs. Tokens routed to none of the E experts are untouched.
 * biases: null, or [E, 2] addresses of each expert's gate_up and down biases (gpt-oss; 0: none), each added to
 * its product as `y + b` is; act 0: SwiGLU, 2: gpt-oss's clamped one (alpha, limit); scale_input: the routing
 * weight scales the expert's input, not its output (Llama 4: out[t] += y, the input x w quantized). */
extern "C" void cad_experts(const float *h, int T, int D, const int32_t *ids, const float *top, int k,
                            const int32_t *expert_ids, int E, const int64_t *table, float *out, int nthreads,
                            const int64_t *biases, int act, float alpha, float limit, int scale_input) {
    std::vector<Job> jobs;
    for (int e = 0; e < E; e++) {
        const float *bgu = biases ? (const float *)biases[2 * e] : nullptr;
        const float *bdn = biases ? (const float *)biases[2 * e + 1] : nullptr;
        const int64_t *r = table + (size_t)e * 2 * REC;
        Job j{q::record_qw(r), q::record_qw(r + REC), bgu, bdn, {}, {}, {}, {}, {}, {}, {}};
        for (int t = 0; t < T; t++)
            for (int i = 0; i < k; i++)
                if (ids[(size_t)t * k + i] == expert_ids[e]) j.rows.push_back(t), j.w.push_back(top[(size_t)t * k + i]);
        if (!j.rows.empty()) jobs.push_back(std::move(j));
    }
    const int nj = (int)jobs.size();
#pragma omp parallel num_threads(std::max(1, nthreads))
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        for (int i = id; i < nj; i += nt) {
            Job &j = jobs[i];
            const int me = (int)j.rows.size();
            if (scale_input) { /* x w, row by row, as the expert-by-expert path scales its input */
                std::vector<float> xs((size_t)me * D);
                for (int r = 0; r < me; r++)
                    for (int d = 0; d < D; d++) xs[(size_t)r * D + d] = h[(size_t)j.rows[r] * D + d] * j.w[r];
                q::quantize(xs.data(), me, D, q::act_rows(me), j.x);
            } else {
                q::quantize_rows(h, j.rows.data(), me, D, q::act_rows(me), j.x);
            }
            j.g.resize((size_t)me * j.gu.N);
            j.act.resize((size_t)me * j.dn.K);
            j.y.resize((size_t)me * D);
        }
#pragma omp barrier
        my_tiles(jobs, false, [](Job &j, int t0, int t1) { q::qgemm_tiles(j.gu, j.x, t0, t1, j.g.data(), j.gu.N, 0); });
#pragma omp barrier
        for (int i = id; i < nj; i += nt) {
            Job &j = jobs[i];
            const int me = (int)j.rows.size(), F = j.dn.K;
            if (j.bgu)
                for (int r = 0; r < me; r++)
                    for (int n = 0; n < 2 * F; n++) j.g[(size_t)r * 2 * F + n] = j.g[(size_t)r * 2 * F + n] + j.bgu[n];
            for (int r = 0; r < me; r++) {
                const float *g = &j.g[(size_t)r * 2 * F];
                if (act == 2)
                    oai_row(g, g + F, &j.act[(size_t)r * F], F, alpha, limit);
                else
                    swiglu_row(g, g + F, &j.act[(size_t)r * F], F);
            }
            q::quantize(j.act.data(), me, F, q::act_rows(me), j.s);
        }
#pragma omp barrier
        my_tiles(jobs, true, [D](Job &j, int t0, int t1) { q::qgemm_tiles(j.dn, j.s, t0, t1, j.y.data(), D, 0); });
#pragma omp barrier
        const int d0 = (int)((long)D * id / nt), d1 = (int)((long)D * (id + 1) / nt);
        for (Job &j : jobs) /* experts in order: each token's sum in the order of the expert-by-expert path */
            for (size_t r = 0; r < j.rows.size(); r++) {
                float *o = out + (size_t)j.rows[r] * D;
                const float *y = &j.y[r * D], w = scale_input ? 1.0f : j.w[r]; /* y 1 is y: out + y */
                if (j.bdn)
                    for (int d = d0; d < d1; d++) o[d] = o[d] + (y[d] + j.bdn[d]) * w;
                else
                    for (int d = d0; d < d1; d++) o[d] = o[d] + y[d] * w;
            }
    }
}
