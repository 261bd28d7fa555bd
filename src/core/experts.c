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
 * is set (packed only; moe_expert_forward_rows). */
static void expert_forward(const moe_expert_weights *w, enum moe_gemm_kind gemm, const float *x,
                           const float *const *row_at, const moe_index *index, moe_index rows,
                           moe_index hidden, moe_index ffn, float *scratch, float *y,
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
        if (row_at) /* the chunk's rows: index + first, or row_at + first without an index */
            moe_sgemm_packed_rows(n, 2 * ffn, hidden, index ? row_at : row_at + first,
                                  index ? index + first : NULL, w->w1t, h, 2 * ffn);
        else
            moe_expert_gemm(gemm, n, 2 * ffn, hidden, x + first * hidden, hidden, w->w1t, h,
                            2 * ffn);
        after(hooks, MOE_FFN_L1);
        swiglu(h, n, ffn, act_scale ? act_scale + first : NULL);
        after(hooks, MOE_FFN_ACTIVATION);
        moe_expert_gemm(gemm, n, hidden, ffn, h, 2 * ffn, w->w2t, y + first * hidden, hidden);
        after(hooks, MOE_FFN_L2);
    }
}

void moe_expert_forward(const moe_expert_weights *w, enum moe_gemm_kind gemm, const float *x,
                        moe_index rows, moe_index hidden, moe_index ffn, float *scratch, float *y,
                        const float *act_scale, const moe_ffn_hooks *hooks)
{
    expert_forward(w, gemm, x, NULL, NULL, rows, hidden, ffn, scratch, y, act_scale, hooks);
}

void moe_expert_forward_rows(const moe_expert_weights *w, const float *const *row_at,
                             const moe_index *index, moe_index rows, moe_index hidden,
                             moe_index ffn, float *scratch, float *y, const float *act_scale,
                             const moe_ffn_hooks *hooks)
{
    expert_forward(w, MOE_GEMM_PACKED, NULL, row_at, index, rows, hidden, ffn, scratch, y,
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
