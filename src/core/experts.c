/* SPDX-License-Identifier: MIT */
/* experts.c — SwiGLU expert FFN in fp32 and fp64 (see experts.h). */
#include "moe/experts.h"

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>

#include "moe/exp.h"
#include "moe/gemm.h"
#include "moe/quant.h"
#include "moe/rng.h"

#include "lanes8.h"

float moe_exp_fp32(float x)
{
    const lanes8 v = {x};
    return exp8(v)[0];
}

/* The activation in place: row n of h (rows, 2f) becomes [silu(gate) * up,
 * up], times scale[n] when scale is set; the activation is the first f
 * columns (leading dimension 2f). N lanes at a time (swigluN), the tail
 * padded with zeros; the bits are the same at either width. */
#define SWIGLU_ROWS(N)                                                                      \
    _Pragma("omp parallel for schedule(static)")                                           \
    for (moe_index n = 0; n < rows; n++) {                                                  \
        float *gate = h + n * 2 * ffn, *act = gate;                                         \
        const float *up = gate + ffn;                                                       \
        moe_index c = 0;                                                                    \
        for (; c + N <= ffn; c += N)                                                        \
            *(lanes##N##_unaligned *)(act + c) =                                            \
                swiglu##N(*(const lanes##N##_unaligned *)(gate + c),                        \
                          *(const lanes##N##_unaligned *)(up + c));                         \
        if (c < ffn) {                                                                      \
            lanes##N g = {0}, u = {0};                                                      \
            for (moe_index i = c; i < ffn; i++) {                                           \
                g[i - c] = gate[i];                                                         \
                u[i - c] = up[i];                                                           \
            }                                                                               \
            const lanes##N v = swiglu##N(g, u);                                             \
            for (moe_index i = c; i < ffn; i++)                                             \
                act[i] = v[i - c];                                                          \
        }                                                                                   \
        if (scale)                                                                          \
            for (c = 0; c < ffn; c++)                                                       \
                act[c] *= scale[n];                                                         \
    }

__attribute__((target_clones("avx2", "default")))
static void swiglu_8(float *h, moe_index rows, moe_index ffn, const float *scale)
{
    SWIGLU_ROWS(8)
}

#ifdef MOE_X86_KERNELS
/* 16 lanes: on a Zen 5 core 0.74 -> 0.40 ns an element (the division, at
 * the same rate per instruction, does twice the lanes). */
__attribute__((target("avx512f")))
static void swiglu_16(float *h, moe_index rows, moe_index ffn, const float *scale)
{
    SWIGLU_ROWS(16)
}
#endif
#undef SWIGLU_ROWS

static enum moe_isa activation_forced = MOE_ISA_WIDEST;

void moe_expert_activation_force(enum moe_isa isa) { activation_forced = isa; }

int moe_expert_activation_lanes(void) { return moe_isa_avx512(activation_forced) ? 16 : 8; }

static void swiglu(float *h, moe_index rows, moe_index ffn, const float *scale)
{
#ifdef MOE_X86_KERNELS
    if (moe_expert_activation_lanes() == 16) {
        swiglu_16(h, rows, ffn, scale);
        return;
    }
#endif
    swiglu_8(h, rows, ffn, scale);
}

moe_expert_rounding moe_expert_rounding_of(const moe_config *cfg)
{
    return (moe_expert_rounding){
        .h_bf16 = cfg->gemm_out_dtype == MOE_DTYPE_BF16,
        .out_bf16 = cfg->gemm_out_dtype == MOE_DTYPE_BF16,
        .act_dtype = cfg->act_dtype,
        .fmt = {(enum moe_fp8_recipe)cfg->fp8_recipe, cfg->fp8_scale == MOE_FP8_SCALE_UE8M0}};
}

/* The activation (rows, f; leading dimension 2f) rounded to r's
 * act_dtype in place; q (f) and scales (blocks of f) the FP8 scratch. */
static void round_activation(const moe_expert_rounding *r, float *h, moe_index rows, moe_index ffn,
                             uint8_t *q, float *scales)
{
    for (moe_index n = 0; n < rows && r->act_dtype != MOE_DTYPE_FP32; n++) {
        float *act = h + n * 2 * ffn;
        if (r->act_dtype == MOE_DTYPE_BF16)
            moe_round_bf16_array(act, ffn);
        else
            moe_quantize_e4m3_row(act, ffn, r->fmt, q, scales, act);
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

void moe_expert_gemm(enum moe_gemm_kind gemm, moe_index M, moe_index N, moe_index K,
                     const float *A, moe_index lda, const float *Bt, float *C, moe_index ldc)
{
    switch (gemm) {
    case MOE_GEMM_BLAS: moe_sgemm_nn(M, N, K, A, lda, Bt, N, C, ldc); return;
    case MOE_GEMM_EXACT: moe_sgemm_exact(M, N, K, A, lda, Bt, N, C, ldc); return;
    case MOE_GEMM_PACKED: moe_sgemm_packed(M, N, K, A, lda, Bt, C, ldc); return;
    }
}

/* moe_expert_forward, with x's rows through row_at and index when row_at
 * is set, y's through y_index when it is set (packed only;
 * moe_expert_forward_rows). */
static void expert_forward(const moe_expert_weights *w, enum moe_gemm_kind gemm, const float *x,
                           const float *const *row_at, const moe_index *index, moe_index rows,
                           moe_index hidden, moe_index ffn, float *scratch, float *y,
                           const moe_index *y_index, const float *act_scale,
                           const moe_ffn_hooks *hooks)
{
    if (rows == 0)
        return;
    /* h (rows, 2f), then the activation in its first f columns */
    const bool chunked = moe_gemm_rows_independent(gemm) && hooks && hooks->chunk_rows > 0;
    const moe_index chunk = chunked ? hooks->chunk_rows : rows;
    const moe_expert_rounding *r = &w->rounding;
    uint8_t *q = r->act_dtype == MOE_DTYPE_FP8 ? moe_xmalloc((size_t)ffn) : NULL;
    float *scales = q ? moe_xmalloc(sizeof(float) * (size_t)moe_fp8_blocks(ffn)) : NULL;
    for (moe_index first = 0; first < rows; first += chunk) {
        const moe_index n = rows - first < chunk ? rows - first : chunk;
        float *h = scratch + first * 2 * ffn;
        if (row_at) /* the chunk's rows: index + first, or row_at + first without an index */
            moe_sgemm_packed_rows(n, 2 * ffn, hidden, index ? row_at : row_at + first,
                                  index ? index + first : NULL, w->w1t, h, 2 * ffn);
        else
            moe_expert_gemm(gemm, n, 2 * ffn, hidden, x + first * hidden, hidden, w->w1t, h,
                            2 * ffn);
        if (r->h_bf16)
            moe_round_bf16_array(h, n * 2 * ffn);
        after(hooks, MOE_FFN_L1);
        swiglu(h, n, ffn, act_scale ? act_scale + first : NULL);
        round_activation(r, h, n, ffn, q, scales);
        after(hooks, MOE_FFN_ACTIVATION);
        if (y_index) { /* each output row to its place */
            moe_sgemm_packed_to(n, hidden, ffn, h, 2 * ffn, w->w2t, y, hidden, y_index + first);
            for (moe_index m = 0; m < n && r->out_bf16; m++)
                moe_round_bf16_array(y + y_index[first + m] * hidden, hidden);
        } else {
            moe_expert_gemm(gemm, n, hidden, ffn, h, 2 * ffn, w->w2t, y + first * hidden, hidden);
            if (r->out_bf16)
                moe_round_bf16_array(y + first * hidden, n * hidden);
        }
        after(hooks, MOE_FFN_L2);
    }
    free(scales);
    free(q);
}

void moe_expert_forward(const moe_expert_weights *w, enum moe_gemm_kind gemm, const float *x,
                        moe_index rows, moe_index hidden, moe_index ffn, float *scratch, float *y,
                        const float *act_scale, const moe_ffn_hooks *hooks)
{
    expert_forward(w, gemm, x, NULL, NULL, rows, hidden, ffn, scratch, y, NULL, act_scale, hooks);
}

void moe_expert_forward_rows(const moe_expert_weights *w, const float *const *row_at,
                             const moe_index *index, moe_index rows, moe_index hidden,
                             moe_index ffn, float *scratch, float *y, const moe_index *y_index,
                             const float *act_scale, const moe_ffn_hooks *hooks)
{
    expert_forward(w, MOE_GEMM_PACKED, NULL, row_at, index, rows, hidden, ffn, scratch, y, y_index,
                   act_scale, hooks);
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
        double *act = a + n * ffn; /* e^-g first, eight lanes at a time */
        for (moe_index c = 0; c < ffn; c++)
            act[c] = -gate[c];
        moe_exp_fp64_n(act, act, ffn);
        for (moe_index c = 0; c < ffn; c++)
            act[c] = gate[c] / (1.0 + act[c]) * up[c];
    }
    product(rows, hidden, ffn, a, ffn, w2, ffn, y, hidden);
}

/* The rounded truth's intervals (moe_expert_forward_f64_rounded). */
#define U32 0x1p-24 /* fp32 unit roundoff */

static double silu64(double g) { return g / (1.0 + moe_exp_fp64(-g)); }

/* v rounded to bf16 as an fp32 computation holding v would round it. */
static double bf16_of(double v) { return moe_round_bf16((float)v); }

/* [lo, hi] widened by eps times its larger end's magnitude. */
static void widen(double *lo, double *hi, double eps)
{
    const double m = eps * fmax(fabs(*lo), fabs(*hi));
    *lo -= m;
    *hi += m;
}

/* The activation silu(g) * up over the box [g0, g1] x [u0, u1]: silu falls
 * to its one minimum at g* = -1.27846454... and rises after it. */
static void act_range(double g0, double g1, double u0, double u1, double *lo, double *hi)
{
    const double star = -1.2784645427610738;
    const double a = silu64(g0), b = silu64(g1);
    const double s0 = g0 <= star && star <= g1 ? silu64(star) : fmin(a, b), s1 = fmax(a, b);
    const double p[4] = {s0 * u0, s0 * u1, s1 * u0, s1 * u1};
    *lo = fmin(fmin(p[0], p[1]), fmin(p[2], p[3]));
    *hi = fmax(fmax(p[0], p[1]), fmax(p[2], p[3]));
}

/* The FP8 scale fmt gives a block whose largest magnitude is amax. */
static double fp8_scale(moe_fp8_format fmt, float amax)
{
    uint8_t q;
    float s;
    moe_quantize_e4m3_row(&amax, 1, fmt, &q, &s, NULL);
    return s;
}

/* One row's activation quantised in blocks of 128 (act_dtype fp8): the
 * truth's values v (from its own a, as an fp32 computation would quantise
 * them), and [lo, hi] (the activation's interval on entry) mapped to every
 * value the quantiser can give a value of the interval, with the scale
 * of any amax the block's intervals allow: the quotient a / s over both
 * intervals (4 u for the recipe's fp32 steps), e4m3 at its ends, times
 * either end of the scale (u for the product). */
static void fp8_interval_row(moe_fp8_format fmt, const double *a, moe_index f, double *lo, double *hi,
                             double *v, float *af, uint8_t *q, float *scales)
{
    for (moe_index c = 0; c < f; c++)
        af[c] = (float)a[c];
    moe_quantize_e4m3_row(af, f, fmt, q, scales, af);
    for (moe_index c = 0; c < f; c++)
        v[c] = af[c];
    for (moe_index b0 = 0; b0 < f; b0 += MOE_FP8_BLOCK) {
        const moe_index b1 = b0 + MOE_FP8_BLOCK < f ? b0 + MOE_FP8_BLOCK : f;
        float amax_lo = 0.0f, amax_hi = 0.0f;
        for (moe_index c = b0; c < b1; c++) {
            const float l = (float)lo[c], h = (float)hi[c];
            amax_lo = fmaxf(amax_lo, l > 0.0f ? l : h < 0.0f ? -h : 0.0f);
            amax_hi = fmaxf(amax_hi, fmaxf(fabsf(l), fabsf(h)));
        }
        /* an all-zero block's values are zero whatever its scale: the
         * smallest positive amax stands for it */
        const double s0 = fp8_scale(fmt, fmaxf(amax_lo, 0x1p-149f)), s1 = fp8_scale(fmt, amax_hi);
        for (moe_index c = b0; c < b1; c++) {
            const double l = (float)lo[c], h = (float)hi[c];
            double r0 = fmin(l / s0, l / s1), r1 = fmax(h / s0, h / s1);
            widen(&r0, &r1, 4 * U32);
            const double q0 = moe_e4m3_to_f32(moe_f32_to_e4m3((float)r0));
            const double q1 = moe_e4m3_to_f32(moe_f32_to_e4m3((float)r1));
            lo[c] = fmin(q0 * s0, q0 * s1);
            hi[c] = fmax(q1 * s0, q1 * s1);
            widen(&lo[c], &hi[c], U32);
        }
    }
}

void moe_expert_forward_f64_rounded(enum moe_truth_gemm gemm, const moe_expert_rounding *r,
                                    const double *w1, const double *w2, const double *x,
                                    moe_index rows, moe_index hidden, moe_index ffn, double *y,
                                    double *width)
{
    if (rows == 0)
        return;
    void (*product)(moe_index, moe_index, moe_index, const double *, moe_index, const double *,
                    moe_index, double *, moe_index) =
        gemm == MOE_TRUTH_EXACT ? moe_dgemm_nt_exact : moe_dgemm_nt;
    const moe_index d = hidden, f = ffn;
    double *h = moe_xmalloc(sizeof(double) * (size_t)(rows * 2 * f));   /* x W1^T */
    double *err = moe_xmalloc(sizeof(double) * (size_t)(rows * 2 * f)); /* |x| |W1|^T */
    double *absx = moe_xmalloc(sizeof(double) * (size_t)(rows * d));
    double *absw = moe_xmalloc(sizeof(double) * (size_t)(2 * f * d));
    double *v = moe_xmalloc(sizeof(double) * (size_t)(rows * f));  /* the truth's activation */
    double *lo = moe_xmalloc(sizeof(double) * (size_t)(rows * f)); /* and its interval */
    double *hi = moe_xmalloc(sizeof(double) * (size_t)(rows * f));
    float *af = moe_xmalloc(sizeof(float) * (size_t)f);
    uint8_t *q = moe_xmalloc((size_t)f);
    float *scales = moe_xmalloc(sizeof(float) * (size_t)moe_fp8_blocks(f));
    for (moe_index m = 0; m < rows * d; m++)
        absx[m] = fabs(x[m]);
    for (moe_index m = 0; m < 2 * f * d; m++)
        absw[m] = fabs(w1[m]);
    product(rows, 2 * f, d, x, d, w1, d, h, 2 * f);
    product(rows, 2 * f, d, absx, d, absw, d, err, 2 * f);
    /* any order of an fp32 dot product over d: within gamma(d+1) sum |x w| */
    const double gamma = (double)(d + 1) * U32 / (1.0 - (double)(d + 1) * U32);
    for (moe_index n = 0; n < rows; n++) {
        for (moe_index c = 0; c < f; c++) {
            const moe_index g = n * 2 * f + c, u = g + f;
            double g0 = h[g] - gamma * err[g], g1 = h[g] + gamma * err[g];
            double u0 = h[u] - gamma * err[u], u1 = h[u] + gamma * err[u];
            double gt = h[g], ut = h[u];
            if (r->h_bf16) { /* rounding is monotone: the ends' roundings bound every value's */
                g0 = bf16_of(g0), g1 = bf16_of(g1), gt = bf16_of(gt);
                u0 = bf16_of(u0), u1 = bf16_of(u1), ut = bf16_of(ut);
            }
            const moe_index m = n * f + c;
            act_range(g0, g1, u0, u1, &lo[m], &hi[m]);
            widen(&lo[m], &hi[m], 8 * U32); /* an fp32 exp, quotient and products */
            v[m] = silu64(gt) * ut;
            if (r->act_dtype == MOE_DTYPE_BF16)
                lo[m] = bf16_of(lo[m]), hi[m] = bf16_of(hi[m]), v[m] = bf16_of(v[m]);
        }
        if (r->act_dtype == MOE_DTYPE_FP8)
            fp8_interval_row(r->fmt, v + n * f, f, lo + n * f, hi + n * f, v + n * f, af, q, scales);
    }
    product(rows, d, f, v, f, w2, f, y, d);
    if (r->out_bf16)
        for (moe_index m = 0; m < rows * d; m++)
            y[m] = bf16_of(y[m]);
    if (width) { /* |W2| (hi - lo) */
        double *absw2 = absw; /* (d, f) fits in (2f, d) */
        for (moe_index m = 0; m < d * f; m++)
            absw2[m] = fabs(w2[m]);
        for (moe_index m = 0; m < rows * f; m++)
            lo[m] = hi[m] - lo[m];
        product(rows, d, f, lo, f, absw2, f, width, d);
    }
    free(scales);
    free(q);
    free(af);
    free(hi);
    free(lo);
    free(v);
    free(absw);
    free(absx);
    free(err);
    free(h);
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

/* An expert's two weight matrices as the generator draws them: W1 (2f, d)
 * with fan-in d, W2 (d, f) with fan-in f. The fp32 and the fp64 weights
 * both read this one table, so the truth and the EP path use one set. */
struct matrix {
    enum moe_tensor tensor;
    moe_index count;
    float scale;
};

static struct matrix matrix(bool shared, int which, moe_index hidden, moe_index ffn)
{
    if (which == 1)
        return (struct matrix){shared ? MOE_TENSOR_SHARED_W1 : MOE_TENSOR_W1, 2 * ffn * hidden,
                               moe_synth_weight_scale(hidden)};
    return (struct matrix){shared ? MOE_TENSOR_SHARED_W2 : MOE_TENSOR_W2, hidden * ffn,
                           moe_synth_weight_scale(ffn)};
}

static void generate(uint64_t seed, bool shared, int entity, moe_index hidden, moe_index ffn,
                     float *w1, float *w2)
{
    for (int which = 1; which <= 2; which++) {
        const struct matrix m = matrix(shared, which, hidden, ffn);
        moe_synth_fill(seed, m.tensor, (uint32_t)entity, 0, m.count, m.scale, which == 1 ? w1 : w2);
    }
}

void moe_expert_generate(uint64_t seed, int expert, moe_index hidden, moe_index ffn, float *w1,
                         float *w2)
{
    generate(seed, false, expert, hidden, ffn, w1, w2);
}

void moe_shared_expert_generate(uint64_t seed, int shared, moe_index hidden, moe_index ffn,
                                float *w1, float *w2)
{
    generate(seed, true, shared, hidden, ffn, w1, w2);
}

/* Matrix m's values rounded to dtype, in fp64: made a piece at a time in
 * an fp32 buffer that stays in L1, so that the fp32 tensor is never
 * stored whole. */
static void fill_f64(uint64_t seed, struct matrix m, int entity, int dtype, double *out)
{
    enum { PIECE = 2048 }; /* values: whole Philox batches */
    const moe_index pieces = (m.count + PIECE - 1) / PIECE;
#pragma omp parallel for schedule(static)
    for (moe_index p = 0; p < pieces; p++) {
        float piece[PIECE];
        const moe_index first = p * PIECE;
        const moe_index n = m.count - first < PIECE ? m.count - first : PIECE;
        moe_synth_fill(seed, m.tensor, (uint32_t)entity, (uint64_t)first, n, m.scale, piece);
        moe_precision_weights(dtype, piece, n);
        for (moe_index v = 0; v < n; v++)
            out[first + v] = piece[v];
    }
}

void moe_expert_generate_f64(uint64_t seed, bool shared, int n, int dtype, bool pow2,
                             moe_index hidden, moe_index ffn, double *w1, double *w2)
{
    if (dtype != MOE_DTYPE_FP8) {
        fill_f64(seed, matrix(shared, 1, hidden, ffn), n, dtype, w1);
        fill_f64(seed, matrix(shared, 2, hidden, ffn), n, dtype, w2);
        return;
    }
    /* FP8 blocks span rows: the fp32 matrices whole, quantised, widened */
    float *w1_32 = moe_xmalloc(sizeof(float) * (size_t)(2 * ffn * hidden));
    float *w2_32 = moe_xmalloc(sizeof(float) * (size_t)(hidden * ffn));
    generate(seed, shared, n, hidden, ffn, w1_32, w2_32);
    moe_expert_held_f64(dtype, pow2, w1_32, w2_32, hidden, ffn, w1, w2);
    free(w2_32);
    free(w1_32);
}

void moe_expert_held_f64(int dtype, bool pow2, float *w1, float *w2, moe_index hidden,
                         moe_index ffn, double *w1_64, double *w2_64)
{
    moe_precision_expert(dtype, pow2, w1, w2, hidden, ffn);
    for (moe_index m = 0; m < 2 * ffn * hidden; m++)
        w1_64[m] = w1[m];
    for (moe_index m = 0; m < hidden * ffn; m++)
        w2_64[m] = w2[m];
}
