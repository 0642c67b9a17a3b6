/* Eight-lane float vectors (GCC vector extensions: AVX2 on x86-64-v3, two halves of a zmm on
 * AVX-512, NEON pairs on Arm) and the few operations the kernels share. Every reduction here
 * has one fixed order, so a result depends only on its inputs, never on batch size or thread.
 * The library is built with -ffp-contract=off: no a * b + c becomes an FMA behind the code's back,
 * so these operations give the same bits on every instruction set; v8_fma asks for one explicitly. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef float v8fu __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t v8i __attribute__((vector_size(32)));

/* Sixteen lanes: a zmm where the build has AVX-512, two ymm (or four NEON) elsewhere. Lane by lane the
 * same IEEE operations as two v8f, so the same bits on every build: only the instruction count differs. */
typedef float v16f __attribute__((vector_size(64)));
typedef float v16fu __attribute__((vector_size(64), aligned(4), may_alias));

static inline v8f v8_load(const float *p) { return *(const v8fu *)p; }
static inline v16f v16_load(const float *p) { return *(const v16fu *)p; }
static inline void v16_store(float *p, v16f v) { *(v16fu *)p = v; }
static inline v16f v16_splat(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline v8f v16_lo(v16f v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
static inline v8f v16_hi(v16f v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }
static inline void v8_store(float *p, v8f v) { *(v8fu *)p = v; }
static inline v8f v8_splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* Pairwise horizontal sum in a fixed order. */
static inline float v8_hsum(v8f v) {
    float a = (v[0] + v[4]) + (v[2] + v[6]);
    float b = (v[1] + v[5]) + (v[3] + v[7]);
    return a + b;
}

static inline v8f v8_max(v8f a, v8f b) { return a > b ? a : b; }

/* a * b + c: one rounding where the build has FMA, two where it has not. */
static inline v8f v8_fma(v8f a, v8f b, v8f c) {
#ifdef __FMA__
    return __builtin_ia32_vfmaddps256(a, b, c);
#else
    return a * b + c;
#endif
}

/* exp(x) for eight lanes: Cephes' single-precision polynomial, about 1 ulp. */
static inline v8f v8_exp(v8f x) {
    const v8f hi = v8_splat(88.3762626647949f), lo = v8_splat(-87.3365447504f);
    x = x > hi ? hi : x;
    v8i under = x < lo;
    x = x < lo ? lo : x;
    v8f fx = x * 1.44269504088896341f + 0.5f;
    v8i n = __builtin_convertvector(fx, v8i);
    v8f fn = __builtin_convertvector(n, v8f);
    fn = fn > fx ? fn - 1.0f : fn; /* floor */
    n = __builtin_convertvector(fn, v8i);
    x = x - fn * 0.693359375f;
    x = x - fn * -2.12194440e-4f;
    v8f z = x * x;
    v8f y = v8_splat(1.9875691500E-4f);
    y = y * x + 1.3981999507E-3f;
    y = y * x + 8.3334519073E-3f;
    y = y * x + 4.1665795894E-2f;
    y = y * x + 1.6666665459E-1f;
    y = y * x + 5.0000001201E-1f;
    y = y * z + x + 1.0f;
    v8i bits = (n + 127) << 23;
    v8f pow2;
    memcpy(&pow2, &bits, sizeof pow2);
    y = y * pow2;
    return under ? v8_splat(0.0f) : y;
}

static inline float scalar_exp(float x) { return v8_exp(v8_splat(x))[0]; }

/* What a KV cache holds (--kv-dtype): floats, IEEE halves, or rows of llama.cpp's q8_0 blocks (a half scale d,
 * then 32 int8 q; the value q d). A cache row of D values is D floats, D halves or D / 32 * 34 bytes. */
enum { KV_F32 = 0, KV_F16 = 1, KV_Q8 = 2 };
static constexpr int Q8_BLOCK = 32, Q8_BYTES = 34;

static inline size_t kv_row_bytes(int kind, int D) {
    return kind == KV_Q8 ? (size_t)D / Q8_BLOCK * Q8_BYTES : (size_t)D * (kind == KV_F16 ? 2 : 4);
}

/* A half cache row as floats: exact, so what follows sums the same floats in the same order as over a float
 * cache holding the rounded values; the compiler's F16C conversions where the build has them. */
static inline void widen(const _Float16 *src, float *dst, int n) {
    for (int i = 0; i < n; i++) dst[i] = (float)src[i];
}

/* Floats into a half cache row, rounded to nearest even (as torch's .half() rounds). */
static inline void narrow(const float *src, _Float16 *dst, int n) {
    for (int i = 0; i < n; i++) dst[i] = (_Float16)src[i];
}

/* A q8_0 row as floats, as llama.cpp's dequantize_row_q8_0: q times the scale widened. */
static inline void q8_widen(const uint8_t *src, float *dst, int n) {
    for (int b = 0; b < n / Q8_BLOCK; b++, src += Q8_BYTES, dst += Q8_BLOCK) {
        _Float16 h;
        memcpy(&h, src, 2);
        const float d = (float)h;
        const int8_t *q = (const int8_t *)(src + 2);
        for (int i = 0; i < Q8_BLOCK; i++) dst[i] = (float)q[i] * d;
    }
}

/* Floats into a q8_0 row, as llama.cpp's quantize_row_q8_0_ref: d = max |x| / 127 kept as a half, each x
 * rounded (half away from zero) to x / d, by the unrounded d. */
static inline void q8_narrow(const float *src, uint8_t *dst, int n) {
    for (int b = 0; b < n / Q8_BLOCK; b++, src += Q8_BLOCK, dst += Q8_BYTES) {
        float amax = 0.0f;
        for (int i = 0; i < Q8_BLOCK; i++) amax = fmaxf(amax, fabsf(src[i]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const _Float16 h = (_Float16)d;
        memcpy(dst, &h, 2);
        int8_t *q = (int8_t *)(dst + 2);
        for (int i = 0; i < Q8_BLOCK; i++) q[i] = (int8_t)roundf(src[i] * id);
    }
}

/* n cache values of a row (`kind`) as floats into dst, and floats into one. */
static inline void kv_widen(int kind, const void *row, float *dst, int n) {
    if (kind == KV_Q8)
        q8_widen((const uint8_t *)row, dst, n);
    else
        widen((const _Float16 *)row, dst, n);
}
static inline void kv_narrow(int kind, const float *src, void *row, int n) {
    if (kind == KV_Q8)
        q8_narrow(src, (uint8_t *)row, n);
    else if (kind == KV_F16)
        narrow(src, (_Float16 *)row, n);
    else
        memcpy(row, src, (size_t)n * 4);
}

/* out[i] = silu(g[i]) * u[i] for one row of F: what cad_swiglu computes, shared with the expert kernel. */
static inline void swiglu_row(const float *g, const float *u, float *o, int F) {
    int i = 0;
    for (; i + 8 <= F; i += 8) {
        const v8f x = v8_load(g + i);
        v8_store(o + i, x / (v8_exp(-x) + 1.0f) * v8_load(u + i));
    }
    for (; i < F; i++) o[i] = g[i] / (scalar_exp(-g[i]) + 1.0f) * u[i];
}

/* gpt-oss's clamped SwiGLU for one row of F: out[i] = (clamp(u, -L, L) + 1) * (g' / (exp(-alpha g') + 1)), g' = min(g,
 * L) (a NaN stays a NaN, as torch's clamp keeps it), shared by cad_oai_glu and the expert kernel. */
static inline void oai_row(const float *g, const float *u, float *o, int F, float alpha, float limit) {
    float xs[8], us[8];
    for (int i = 0; i < F; i += 8) {
        const int n = F - i < 8 ? F - i : 8;
        for (int j = 0; j < 8; j++) {
            const float gj = j < n ? g[i + j] : 0.0f, uj = j < n ? u[i + j] : 0.0f;
            xs[j] = gj > limit ? limit : gj;
            us[j] = uj > limit ? limit : uj < -limit ? -limit : uj;
        }
        const v8f x = v8_load(xs), y = (v8_load(us) + 1.0f) * (x / (v8_exp(-(x * alpha)) + 1.0f));
        for (int j = 0; j < n; j++) o[i + j] = y[j];
    }
}

/* out[i] = gelu_tanh(g[i]) * u[i] (Gemma's GeGLU): 0.5 x (1 + tanh(y)) = x / (1 + exp(-2y)), with
 * y = sqrt(2 / pi) (x + 0.044715 x^3), the exp above. */
static inline void geglu_row(const float *g, const float *u, float *o, int F) {
    const float c = 0.7978845608028654f, c3 = 0.7978845608028654f * 0.044715f;
    int i = 0;
    for (; i + 8 <= F; i += 8) {
        const v8f x = v8_load(g + i);
        const v8f y = x * c + x * x * x * c3;
        v8_store(o + i, x / (v8_exp(y * -2.0f) + 1.0f) * v8_load(u + i));
    }
    for (; i < F; i++) {
        const float x = g[i], y = x * c + x * x * x * c3;
        o[i] = x / (scalar_exp(y * -2.0f) + 1.0f) * u[i];
    }
}
