/* truth.c — dense fp64 ground truth and comparison (see truth.h). */
#include "moe/truth.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe/common.h"
#include "moe/experts.h"

static void to_f64(const float *src, moe_index n, double *dst)
{
#pragma omp parallel for schedule(static)
    for (moe_index m = 0; m < n; m++)
        dst[m] = src[m];
}

/* y (T, d) += scale (T) * out (T, d); a NULL scale means 1. */
static void accumulate(double *y, const double *out, const double *scale, moe_index tokens,
                       moe_index hidden)
{
#pragma omp parallel for schedule(static)
    for (moe_index i = 0; i < tokens; i++) {
        const double g = scale ? scale[i] : 1.0;
        for (moe_index j = 0; j < hidden; j++)
            y[i * hidden + j] += g * out[i * hidden + j];
    }
}

void moe_truth_forward(const moe_config *cfg, const float *x, const int32_t *ids,
                       const float *weights, moe_index tokens, double *y)
{
    const moe_index d = cfg->hidden, f = cfg->ffn, T = tokens;
    const int E = (int)cfg->experts, k = (int)cfg->topk;
    float *w1 = moe_xmalloc(sizeof(float) * (size_t)(2 * f * d));   /* (2f, d) */
    float *w2 = moe_xmalloc(sizeof(float) * (size_t)(d * f));       /* (d, f) */
    double *w1_64 = moe_xmalloc(sizeof(double) * (size_t)(2 * f * d));
    double *w2_64 = moe_xmalloc(sizeof(double) * (size_t)(d * f));
    double *x64 = moe_xmalloc(sizeof(double) * (size_t)(T * d));     /* (T, d) */
    double *out = moe_xmalloc(sizeof(double) * (size_t)(T * d));     /* (T, d) */
    double *scratch = moe_xmalloc(sizeof(double) * (size_t)(T * 3 * f));
    double *gate = moe_xmalloc(sizeof(double) * (size_t)T);          /* (T) column e of the dense gate */

    to_f64(x, T * d, x64);
    memset(y, 0, sizeof(double) * (size_t)(T * d));
    for (int e = 0; e < E; e++) {
        for (moe_index i = 0; i < T; i++) {
            gate[i] = 0.0;
            for (int s = 0; s < k; s++)
                if (ids[i * k + s] == e)
                    gate[i] = weights[i * k + s];
        }
        moe_expert_generate(cfg->seed, e, d, f, w1, w2);
        to_f64(w1, 2 * f * d, w1_64);
        to_f64(w2, d * f, w2_64);
        moe_expert_forward_f64(w1_64, w2_64, x64, T, d, f, scratch, out);
        accumulate(y, out, gate, T, d);
    }
    for (int s = 0; s < (int)cfg->shared_experts; s++) {
        moe_shared_expert_generate(cfg->seed, s, d, f, w1, w2);
        to_f64(w1, 2 * f * d, w1_64);
        to_f64(w2, d * f, w2_64);
        moe_expert_forward_f64(w1_64, w2_64, x64, T, d, f, scratch, out);
        accumulate(y, out, NULL, T, d);
    }
    free(gate);
    free(scratch);
    free(out);
    free(x64);
    free(w2_64);
    free(w1_64);
    free(w2);
    free(w1);
}

moe_tolerance moe_tolerance_for(const moe_config *cfg, double ref_rms)
{
    const double unit_roundoff = 0x1p-24;
    const double length =
        (double)(cfg->hidden + cfg->ffn + cfg->topk + cfg->shared_experts);
    moe_tolerance tol;
    tol.rel = unit_roundoff * length;
    tol.abs = tol.rel * ref_rms;
    return tol;
}

double moe_sum_squares(const double *ref, moe_index n)
{
    double sum = 0.0;
    for (moe_index m = 0; m < n; m++)
        sum += ref[m] * ref[m];
    return sum;
}

/* err / bound, where a zero bound allows only a zero error. */
static double ratio(double err, double bound)
{
    return bound > 0.0 ? err / bound : (err > 0.0 ? INFINITY : 0.0);
}

void moe_compare(const float *got, const double *ref, moe_index n, moe_tolerance tol,
                 moe_compare_stats *stats)
{
    const double floor = tol.rel > 0.0 ? tol.abs / tol.rel : 0.0; /* the rms */
    stats->max_abs = stats->max_rel = stats->max_used = 0.0;
    stats->worst = -1;
    stats->first_nonfinite = -1;
    for (moe_index m = 0; m < n; m++) {
        if (!isfinite(got[m])) {
            if (stats->first_nonfinite < 0)
                stats->first_nonfinite = stats->worst = m;
            stats->max_abs = stats->max_rel = stats->max_used = INFINITY;
            continue;
        }
        const double err = fabs((double)got[m] - ref[m]);
        const double mag = fabs(ref[m]);
        const double rel = ratio(err, mag > floor ? mag : floor);
        const double used = ratio(err, tol.abs + tol.rel * mag);
        if (err > stats->max_abs)
            stats->max_abs = err;
        if (rel > stats->max_rel)
            stats->max_rel = rel;
        if (stats->worst < 0 || used > stats->max_used) {
            stats->max_used = used;
            stats->worst = m;
        }
    }
}
