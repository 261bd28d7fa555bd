/* experts.c — SwiGLU expert FFN in fp32 and fp64 (see experts.h). */
#include "moe/experts.h"

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>

#include "moe/exp.h"
#include "moe/gemm.h"
#include "moe/rng.h"

/* e^x in fp32 on 8 lanes, as moe_exp_fp32 specifies (experts.h): every step
 * is one IEEE single-precision operation per lane, so the bits do not depend
 * on the machine or the vector width. */
typedef float lanes8 __attribute__((vector_size(32)));
/* The helpers below pass 8-lane vectors by value. They are always inlined:
 * a call from the avx2 clone to a helper compiled for the default target
 * would pass the vectors in a different way than the helper expects. */
#pragma GCC diagnostic ignored "-Wpsabi"
#define LANES_INLINE static inline __attribute__((always_inline))
typedef float lanes8_unaligned __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t ints8 __attribute__((vector_size(32)));

LANES_INLINE lanes8 select8(ints8 mask, lanes8 yes, lanes8 no)
{
    return (lanes8)((mask & (ints8)yes) | (~mask & (ints8)no));
}

LANES_INLINE lanes8 exp8(lanes8 x)
{
    const float hi = 88.7228317f, lo = -87.3365402f; /* e^x finite and normal between */
    const float shifter = 12582912.0f;                 /* 1.5 * 2^23 */
    const ints8 over = x > hi, under = x < lo;
    lanes8 xc = select8(over, (lanes8){0} + hi, x);
    xc = select8(under, (lanes8){0} + lo, xc);
    const lanes8 t = xc * 1.44269504f + shifter; /* round(xc / ln 2) in the low bits */
    const lanes8 n = t - shifter;
    const ints8 k = (ints8)t - 0x4b400000; /* n as an integer */
    const lanes8 r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
    lanes8 p = (lanes8){0} + 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const ints8 k1 = k / 2, k2 = k - k1; /* 2^k = 2^k1 * 2^k2, each normal */
    const lanes8 e = p * (lanes8)((k1 + 127) << 23) * (lanes8)((k2 + 127) << 23);
    return select8(over, (lanes8){0} + INFINITY, select8(under, (lanes8){0}, e));
}

float moe_exp_fp32(float x)
{
    const lanes8 v = {x};
    return exp8(v)[0];
}

/* act (n) = silu(gate) * up on 8 lanes. */
LANES_INLINE lanes8 swiglu8(lanes8 gate, lanes8 up)
{
    return gate / (1.0f + exp8(-gate)) * up;
}

/* The activation in place: row n of h (rows, 2f) becomes [silu(gate) * up,
 * up], times scale[n] when scale is set; the activation is the first f
 * columns (leading dimension 2f). */
__attribute__((target_clones("avx2", "default")))
static void swiglu(float *h, moe_index rows, moe_index ffn, const float *scale)
{
#pragma omp parallel for schedule(static)
    for (moe_index n = 0; n < rows; n++) {
        float *gate = h + n * 2 * ffn, *act = gate;
        const float *up = gate + ffn;
        moe_index c = 0;
        for (; c + 8 <= ffn; c += 8)
            *(lanes8_unaligned *)(act + c) =
                swiglu8(*(const lanes8_unaligned *)(gate + c), *(const lanes8_unaligned *)(up + c));
        if (c < ffn) {
            lanes8 g = {0}, u = {0};
            for (moe_index i = c; i < ffn; i++) {
                g[i - c] = gate[i];
                u[i - c] = up[i];
            }
            const lanes8 v = swiglu8(g, u);
            for (moe_index i = c; i < ffn; i++)
                act[i] = v[i - c];
        }
        if (scale)
            for (c = 0; c < ffn; c++)
                act[c] *= scale[n];
    }
}

static inline void after(const moe_ffn_hooks *hooks, enum moe_ffn_stage stage)
{
    if (hooks && hooks->after)
        hooks->after(hooks->ctx, stage);
}

const char *moe_gemm_label(enum moe_gemm_kind gemm)
{
    static char packed[48];
    if (gemm == MOE_GEMM_BLAS)
        return "blas";
    if (gemm == MOE_GEMM_EXACT)
        return "exact";
    snprintf(packed, sizeof packed, "packed (%s)", moe_sgemm_packed_isa());
    return packed;
}

/* C (M, N) = A (M, K) * the weight operand Bt, (K, N) in the layout of gemm. */
static void gemm_rows(enum moe_gemm_kind gemm, moe_index M, moe_index N, moe_index K,
                      const float *A, moe_index lda, const float *Bt, float *C, moe_index ldc)
{
    switch (gemm) {
    case MOE_GEMM_BLAS: moe_sgemm_nn(M, N, K, A, lda, Bt, N, C, ldc); return;
    case MOE_GEMM_EXACT: moe_sgemm_exact(M, N, K, A, lda, Bt, N, C, ldc); return;
    case MOE_GEMM_PACKED: moe_sgemm_packed(M, N, K, A, lda, Bt, C, ldc); return;
    }
}

void moe_expert_forward(const moe_expert_weights *w, enum moe_gemm_kind gemm, const float *x,
                        moe_index rows, moe_index hidden, moe_index ffn, float *scratch, float *y,
                        const float *act_scale, const moe_ffn_hooks *hooks)
{
    if (rows == 0)
        return;
    /* h (rows, 2f), then the activation in its first f columns */
    const bool chunked = moe_gemm_rows_independent(gemm) && hooks && hooks->chunk_rows > 0;
    const moe_index chunk = chunked ? hooks->chunk_rows : rows;
    for (moe_index first = 0; first < rows; first += chunk) {
        const moe_index n = rows - first < chunk ? rows - first : chunk;
        float *h = scratch + first * 2 * ffn;
        gemm_rows(gemm, n, 2 * ffn, hidden, x + first * hidden, hidden, w->w1t, h, 2 * ffn);
        after(hooks, MOE_FFN_L1);
        swiglu(h, n, ffn, act_scale ? act_scale + first : NULL);
        after(hooks, MOE_FFN_ACTIVATION);
        gemm_rows(gemm, n, hidden, ffn, h, 2 * ffn, w->w2t, y + first * hidden, hidden);
        after(hooks, MOE_FFN_L2);
    }
}

void moe_expert_forward_f64(enum moe_truth_gemm gemm, const double *w1, const double *w2,
                            const double *x, moe_index rows, moe_index hidden, moe_index ffn,
                            double *scratch, double *y)
{
    if (rows == 0)
        return;
    void (*product)(moe_index, moe_index, moe_index, const double *, moe_index, const double *,
                    moe_index, double *, moe_index) =
        gemm == MOE_TRUTH_EXACT ? moe_dgemm_nt_exact : moe_dgemm_nt;
    double *h = scratch;                 /* (rows, 2f) */
    double *a = scratch + rows * 2 * ffn; /* (rows, f) */
    product(rows, 2 * ffn, hidden, x, hidden, w1, hidden, h, 2 * ffn);
#pragma omp parallel for schedule(static)
    for (moe_index n = 0; n < rows; n++) {
        const double *gate = h + n * 2 * ffn, *up = gate + ffn;
        double *act = a + n * ffn;
        for (moe_index c = 0; c < ffn; c++)
            act[c] = gate[c] / (1.0 + moe_exp_fp64(-gate[c])) * up[c];
    }
    product(rows, hidden, ffn, a, ffn, w2, ffn, y, hidden);
}

static moe_index layout_floats(enum moe_gemm_kind gemm, moe_index K, moe_index N)
{
    return gemm == MOE_GEMM_PACKED ? moe_sgemm_packed_floats(K, N) : K * N;
}

moe_index moe_expert_w1_floats(enum moe_gemm_kind gemm, moe_index hidden, moe_index ffn)
{
    return layout_floats(gemm, hidden, 2 * ffn);
}

moe_index moe_expert_w2_floats(enum moe_gemm_kind gemm, moe_index hidden, moe_index ffn)
{
    return layout_floats(gemm, ffn, hidden);
}

/* B (N, K) as the operand Bt (K, N) of `gemm`. */
static void layout(enum moe_gemm_kind gemm, moe_index N, moe_index K, const float *B, float *Bt)
{
    if (gemm == MOE_GEMM_PACKED)
        moe_sgemm_pack(N, K, B, Bt);
    else
        moe_transpose(N, K, B, Bt);
}

void moe_expert_layout(enum moe_gemm_kind gemm, moe_index hidden, moe_index ffn, const float *w1,
                       const float *w2, float *w1t, float *w2t)
{
    layout(gemm, 2 * ffn, hidden, w1, w1t);
    layout(gemm, hidden, ffn, w2, w2t);
}

static void generate(uint64_t seed, enum moe_tensor t1, enum moe_tensor t2, int entity,
                     moe_index hidden, moe_index ffn, float *w1, float *w2)
{
    moe_synth_fill(seed, t1, (uint32_t)entity, 0, 2 * ffn * hidden,
                   moe_synth_weight_scale(hidden), w1);
    moe_synth_fill(seed, t2, (uint32_t)entity, 0, hidden * ffn, moe_synth_weight_scale(ffn), w2);
}

void moe_expert_generate(uint64_t seed, int expert, moe_index hidden, moe_index ffn, float *w1,
                         float *w2)
{
    generate(seed, MOE_TENSOR_W1, MOE_TENSOR_W2, expert, hidden, ffn, w1, w2);
}

void moe_shared_expert_generate(uint64_t seed, int shared, moe_index hidden, moe_index ffn,
                                float *w1, float *w2)
{
    generate(seed, MOE_TENSOR_SHARED_W1, MOE_TENSOR_SHARED_W2, shared, hidden, ffn, w1, w2);
}
