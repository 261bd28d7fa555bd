/* experts.c — SwiGLU expert FFN in fp32 and fp64 (see experts.h). */
#include "moe/experts.h"

#include <math.h>
#include <stddef.h>

#include "moe/gemm.h"
#include "moe/rng.h"

/* a (rows, f) = silu(gate) * up, times scale[n] per row when scale is set. */
static void swiglu(const float *h, moe_index rows, moe_index ffn, const float *scale, float *a)
{
#pragma omp parallel for schedule(static)
    for (moe_index n = 0; n < rows; n++) {
        const float *gate = h + n * 2 * ffn, *up = gate + ffn;
        float *act = a + n * ffn;
        for (moe_index c = 0; c < ffn; c++)
            act[c] = gate[c] / (1.0f + expf(-gate[c])) * up[c];
        if (scale)
            for (moe_index c = 0; c < ffn; c++)
                act[c] *= scale[n];
    }
}

static inline void after(const moe_ffn_hooks *hooks, enum moe_ffn_stage stage)
{
    if (hooks && hooks->after)
        hooks->after(hooks->ctx, stage);
}

void moe_expert_forward(const moe_expert_weights *w, enum moe_gemm_kind gemm, const float *x,
                        moe_index rows, moe_index hidden, moe_index ffn, float *scratch, float *y,
                        const float *act_scale, const moe_ffn_hooks *hooks)
{
    if (rows == 0)
        return;
    float *h = scratch;                  /* (rows, 2f) */
    float *a = scratch + rows * 2 * ffn; /* (rows, f) */
    if (gemm == MOE_GEMM_BLAS) {
        moe_sgemm_nt(rows, 2 * ffn, hidden, x, hidden, w->w1, hidden, h, 2 * ffn);
        after(hooks, MOE_FFN_L1);
        swiglu(h, rows, ffn, act_scale, a);
        after(hooks, MOE_FFN_ACTIVATION);
        moe_sgemm_nt(rows, hidden, ffn, a, ffn, w->w2, ffn, y, hidden);
        after(hooks, MOE_FFN_L2);
        return;
    }
    const moe_index chunk = hooks && hooks->chunk_rows > 0 ? hooks->chunk_rows : rows;
    for (moe_index first = 0; first < rows; first += chunk) {
        const moe_index n = rows - first < chunk ? rows - first : chunk;
        moe_sgemm_exact(n, 2 * ffn, hidden, x + first * hidden, hidden, w->w1t, 2 * ffn,
                        h + first * 2 * ffn, 2 * ffn);
        after(hooks, MOE_FFN_L1);
        swiglu(h + first * 2 * ffn, n, ffn, act_scale ? act_scale + first : NULL, a + first * ffn);
        after(hooks, MOE_FFN_ACTIVATION);
        moe_sgemm_exact(n, hidden, ffn, a + first * ffn, ffn, w->w2t, hidden, y + first * hidden,
                        hidden);
        after(hooks, MOE_FFN_L2);
    }
}

void moe_expert_forward_f64(const double *w1, const double *w2, const double *x, moe_index rows,
                            moe_index hidden, moe_index ffn, double *scratch, double *y)
{
    if (rows == 0)
        return;
    double *h = scratch;                 /* (rows, 2f) */
    double *a = scratch + rows * 2 * ffn; /* (rows, f) */
    moe_dgemm_nt(rows, 2 * ffn, hidden, x, hidden, w1, hidden, h, 2 * ffn);
#pragma omp parallel for schedule(static)
    for (moe_index n = 0; n < rows; n++) {
        const double *gate = h + n * 2 * ffn, *up = gate + ffn;
        double *act = a + n * ffn;
        for (moe_index c = 0; c < ffn; c++)
            act[c] = gate[c] / (1.0 + exp(-gate[c])) * up[c];
    }
    moe_dgemm_nt(rows, hidden, ffn, a, ffn, w2, ffn, y, hidden);
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
