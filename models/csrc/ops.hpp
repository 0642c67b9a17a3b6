/* The per-layer operations other files call: each `..._for` shares its work among the threads of the
 * enclosing OpenMP parallel region (an orphaned `omp for`, with its barrier at the end), or runs on the
 * calling thread outside one; a row's result is the same either way. */
#pragma once
#include <stdint.h>

extern "C" void cad_rmsnorm(const float *x, const float *w, float *out, int T, int D, float eps);
extern "C" void cad_qkv_rope(const float *qkv, const float *bias, const int64_t *pos, const float *cos_t,
                             const float *sin_t, float *q_out, void *kc, void *vc, int T, int H, int Hkv, int hd,
                             int cap, int slot0, int kv, float l2_eps);
void swiglu_for(const float *gu, float *out, int T, int F);
void glu_for(const float *gu, float *out, int T, int F, bool gelu);
/* `sinks` (null: none): a logit per head in each softmax's denominator only (gpt-oss) */
void attention_for(const float *q, const void *kc, const void *vc, float *out, float *lse, const float *sinks, int T,
                   int H, int Hkv, int D, int cap, int n_shared, const int32_t *ptr, const int32_t *idx, float scale,
                   float softcap, int kv);
