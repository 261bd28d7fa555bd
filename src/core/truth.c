/* truth.c — dense fp64 ground truth and comparison (see truth.h). */
#include "moe/truth.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe/backward.h"
#include "moe/common.h"
#include "moe/experts.h"
#include "moe/layout.h"
#include "moe/quant.h"

static void to_f64(const float *src, moe_index n, double *dst)
{
#pragma omp parallel for schedule(static)
    for (moe_index m = 0; m < n; m++)
        dst[m] = src[m];
}


/* y (T, d) += scale[m] * out[m] into row row[m] of y, for m < rows: the
 * terms of one expert on the tokens it is evaluated on. With
 * --combine-dtype bf16 each term is rounded as the EP path rounds it: the
 * output (weight after) or the weighted output (weight before L2), and
 * allow gets one bf16 step of the term. */
static void accumulate(const moe_config *cfg, double *y, double *allow, const double *out,
                       const double *scale, const moe_index *row, moe_index rows, moe_index hidden)
{
    const bool bf16 = cfg->combine_dtype == MOE_DTYPE_BF16;
    const bool before_l2 = cfg->weight_at == MOE_WEIGHT_AT_ACTIVATION;
#pragma omp parallel for schedule(static)
    for (moe_index m = 0; m < rows; m++) {
        const double g = scale[m];
        double *yi = y + row[m] * hidden, *ai = allow ? allow + row[m] * hidden : NULL;
        for (moe_index j = 0; j < hidden; j++) {
            double v = out[m * hidden + j], term;
            if (!bf16)
                term = g * v;
            else if (before_l2)
                term = moe_round_bf16((float)(g * v));
            else
                term = g * (double)moe_round_bf16((float)v);
            yi[j] += term;
            if (bf16 && ai)
                ai[j] += fabs(before_l2 ? 1.0 : g) * moe_bf16_step(before_l2 ? g * v : v);
        }
    }
}

/* w1, w2 rounded to --dtype, in fp64. */
static void weights_f64(const moe_config *cfg, float *w1, float *w2, moe_index d, moe_index f,
                        double *w1_64, double *w2_64)
{
    moe_precision_weights(cfg->param_dtype, w1, 2 * f * d);
    moe_precision_weights(cfg->param_dtype, w2, d * f);
    to_f64(w1, 2 * f * d, w1_64);
    to_f64(w2, d * f, w2_64);
}

/* Routed expert n (or shared expert n) generated, rounded to --dtype, in
 * fp64 (w1, w2 are the fp32 scratch). */
static void generated_f64(const moe_config *cfg, bool shared, int n, float *w1, float *w2,
                          double *w1_64, double *w2_64)
{
    const moe_index d = cfg->hidden, f = cfg->ffn;
    if (shared)
        moe_shared_expert_generate(cfg->seed, n, d, f, w1, w2);
    else
        moe_expert_generate(cfg->seed, n, d, f, w1, w2);
    weights_f64(cfg, w1, w2, d, f, w1_64, w2_64);
}

/* --combine reduced: to += the partial sums of one rank's experts (or, with
 * the two-stage dispatch, of one node's ranks), rounded as the EP path
 * rounds them (one bf16 step of allowance each). */
static void flush(const moe_config *cfg, double *to, double *allow, double *partial, moe_index n)
{
    const bool bf16 = cfg->combine_dtype == MOE_DTYPE_BF16;
    for (moe_index m = 0; m < n; m++) {
        const double v = partial[m];
        to[m] += bf16 ? (double)moe_round_bf16((float)v) : v;
        if (bf16 && allow)
            allow[m] += moe_bf16_step(v);
        partial[m] = 0.0;
    }
}

/* The truth, evaluating each expert on the tokens that selected it, or
 * (literal) on every token, its unselected terms 0 * out added. */
static void truth_forward(const moe_config *cfg, enum moe_truth_gemm gemm, const float *x,
                          const float *x_dispatched, const int32_t *ids, const float *weights,
                          moe_index tokens, int ranks, const int32_t *pair_rank, bool literal,
                          double *y, double *allow)
{
    const moe_index d = cfg->hidden, f = cfg->ffn, T = tokens;
    const int E = (int)cfg->experts, k = (int)cfg->topk;
    float *w1 = moe_xmalloc(sizeof(float) * (size_t)(2 * f * d));   /* (2f, d) */
    float *w2 = moe_xmalloc(sizeof(float) * (size_t)(d * f));       /* (d, f) */
    double *w1_64 = moe_xmalloc(sizeof(double) * (size_t)(2 * f * d));
    double *w2_64 = moe_xmalloc(sizeof(double) * (size_t)(d * f));
    double *x64 = moe_xmalloc(sizeof(double) * (size_t)(T * d));     /* (T, d) */
    double *xe = moe_xmalloc(sizeof(double) * (size_t)(T * d) + 1);  /* (n, d) expert e's tokens */
    double *out = moe_xmalloc(sizeof(double) * (size_t)(T * d));     /* (T, d) */
    double *scratch = moe_xmalloc(sizeof(double) * (size_t)(T * 3 * f));
    double *gate = moe_xmalloc(sizeof(double) * (size_t)T + 1);      /* (n) their gate weights for e */
    moe_index *row = moe_xmalloc(sizeof(moe_index) * (size_t)T + 1); /* (n) and which tokens */

    to_f64(x_dispatched, T * d, x64);
    memset(y, 0, sizeof(double) * (size_t)(T * d));
    /* A reduced combine rounds the sum of each rank's experts instead. */
    const bool reduced = cfg->combine == MOE_COMBINE_REDUCED;
    double *partial = reduced ? moe_xcalloc((size_t)(T * d), sizeof(double)) : NULL;
    /* The two-stage dispatch reduces again at each node's relay. */
    const bool by_node = reduced && cfg->dispatch == MOE_DISPATCH_HIERARCHICAL;
    const int R = cfg->ranks_per_node > 0 ? (int)cfg->ranks_per_node : ranks;
    double *node_partial = by_node ? moe_xcalloc((size_t)(T * d), sizeof(double)) : NULL;
    moe_placement placement = {0};
    if (reduced)
        moe_placement_init(&placement, E, ranks);
    if (allow)
        memset(allow, 0, sizeof(double) * (size_t)(T * d));
    /* With pair_rank, a rank's sums are its pairs': one pass per rank. */
    const int passes = reduced && pair_rank ? ranks : 1;
    for (int pass = 0; pass < passes; pass++)
    for (int e = 0; e < E; e++) {
        moe_index n = 0;
        for (moe_index i = 0; i < T; i++) {
            double g = 0.0;
            for (int s = 0; s < k; s++)
                if (ids[i * k + s] == e && (passes == 1 || pair_rank[i * k + s] == pass))
                    g = weights[i * k + s];
            if (g != 0.0 || literal) {
                row[n] = i;
                gate[n++] = g;
            }
        }
        if (n > 0) { /* an expert no token selected adds nothing: not even its weights */
            generated_f64(cfg, false, e, w1, w2, w1_64, w2_64);
            for (moe_index m = 0; m < n; m++)
                memcpy(xe + m * d, x64 + row[m] * d, sizeof(double) * (size_t)d);
            moe_expert_forward_f64(gemm, w1_64, w2_64, xe, n, d, f, scratch, out);
            if (!reduced)
                accumulate(cfg, y, allow, out, gate, row, n, d);
            for (moe_index m = 0; reduced && m < n; m++)
                for (moe_index j = 0; j < d; j++)
                    partial[row[m] * d + j] += gate[m] * out[m * d + j];
        }
        if (!reduced)
            continue;
        /* the rank whose sum this expert adds to, and the next expert's
         * (`ranks` past the last): a rank's sum, and a node's, end here
         * when they differ */
        const int rank = passes > 1 ? pass : placement.expert_rank[e];
        const int next = e < E - 1 ? (passes > 1 ? pass : placement.expert_rank[e + 1])
                                   : passes > 1 ? pass + 1 : ranks;
        if (next != rank)
            flush(cfg, by_node ? node_partial : y, allow, partial, T * d);
        if (by_node && next != rank && (next == ranks || next / R != rank / R))
            flush(cfg, y, allow, node_partial, T * d);
    }
    if (reduced)
        moe_placement_free(&placement);
    free(node_partial);
    free(partial);
    if (x_dispatched != x)
        to_f64(x, T * d, x64);
    for (int s = 0; s < (int)cfg->shared_experts; s++) {
        generated_f64(cfg, true, s, w1, w2, w1_64, w2_64);
        moe_expert_forward_f64(gemm, w1_64, w2_64, x64, T, d, f, scratch, out);
        /* shared experts run at home: no combine, no rounding */
        for (moe_index n = 0; n < T * d; n++)
            y[n] += out[n];
    }
    free(row);
    free(gate);
    free(scratch);
    free(out);
    free(xe);
    free(x64);
    free(w2_64);
    free(w1_64);
    free(w2);
    free(w1);
}

void moe_truth_forward(const moe_config *cfg, enum moe_truth_gemm gemm, const float *x,
                       const float *x_dispatched, const int32_t *ids, const float *weights,
                       moe_index tokens, int ranks, double *y, double *allow)
{
    truth_forward(cfg, gemm, x, x_dispatched, ids, weights, tokens, ranks, NULL, false, y, allow);
}

void moe_truth_forward_placed(const moe_config *cfg, enum moe_truth_gemm gemm, const float *x,
                              const float *x_dispatched, const int32_t *ids, const float *weights,
                              moe_index tokens, int ranks, const int32_t *pair_rank, double *y,
                              double *allow)
{
    truth_forward(cfg, gemm, x, x_dispatched, ids, weights, tokens, ranks, pair_rank, false, y,
                  allow);
}

void moe_truth_forward_literal(const moe_config *cfg, enum moe_truth_gemm gemm, const float *x,
                               const float *x_dispatched, const int32_t *ids, const float *weights,
                               moe_index tokens, int ranks, double *y, double *allow)
{
    truth_forward(cfg, gemm, x, x_dispatched, ids, weights, tokens, ranks, NULL, true, y, allow);
}

moe_tolerance moe_tolerance_of_length(double length, double ref_rms)
{
    const double unit_roundoff = 0x1p-24;
    moe_tolerance tol;
    tol.rel = unit_roundoff * length;
    tol.abs = tol.rel * ref_rms;
    return tol;
}

moe_tolerance moe_tolerance_for(const moe_config *cfg, double ref_rms)
{
    return moe_tolerance_of_length(
        (double)(cfg->hidden + cfg->ffn + cfg->topk + cfg->shared_experts), ref_rms);
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

void moe_compare(const float *got, const double *ref, const double *allow, moe_index n,
                 moe_tolerance tol, moe_compare_stats *stats)
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
        const double used = ratio(err, tol.abs + tol.rel * mag + (allow ? allow[m] : 0.0));
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

/* The tokens that selected expert e: row (n) their indices, gate (n) their
 * weights for it. Returns n. */
static moe_index expert_rows(int e, const int32_t *ids, const float *weights, moe_index tokens,
                             int k, moe_index *row, double *gate)
{
    moe_index n = 0;
    for (moe_index i = 0; i < tokens; i++)
        for (int s = 0; s < k; s++)
            if (ids[i * k + s] == e) {
                row[n] = i;
                gate[n++] = weights[i * k + s];
            }
    return n;
}

/* rows (n, d) of src (T, d) in fp64. */
static void gather_f64(const float *src, const moe_index *row, moe_index n, moe_index d, double *dst)
{
    for (moe_index m = 0; m < n; m++)
        for (moe_index j = 0; j < d; j++)
            dst[m * d + j] = src[row[m] * d + j];
}

void moe_truth_backward_tokens(const moe_config *cfg, const moe_router *router,
                               enum moe_truth_gemm gemm, const float *gate, const float *x,
                               const int32_t *ids, const float *weights, const float *logits,
                               const float *dy, moe_index tokens, double *dx, double *dgate_w,
                               double *dshared_w1, double *dshared_w2)
{
    const moe_index d = cfg->hidden, f = cfg->ffn, T = tokens;
    const int E = (int)cfg->experts, k = (int)cfg->topk;
    float *w1 = moe_xmalloc(sizeof(float) * (size_t)(2 * f * d));
    float *w2 = moe_xmalloc(sizeof(float) * (size_t)(d * f));
    double *w1_64 = moe_xmalloc(sizeof(double) * (size_t)(2 * f * d));
    double *w2_64 = moe_xmalloc(sizeof(double) * (size_t)(d * f));
    double *xe = moe_xmalloc(sizeof(double) * (size_t)(T * d) + 1);
    double *dye = moe_xmalloc(sizeof(double) * (size_t)(T * d) + 1);
    double *dxe = moe_xmalloc(sizeof(double) * (size_t)(T * d) + 1);
    double *gate_e = moe_xmalloc(sizeof(double) * (size_t)T + 1);
    double *dg = moe_xmalloc(sizeof(double) * (size_t)T + 1);
    moe_index *row = moe_xmalloc(sizeof(moe_index) * (size_t)T + 1);
    double *dweights = moe_xcalloc((size_t)(T * k) + 1, sizeof(double)); /* (T, k) */
    memset(dx, 0, sizeof(double) * (size_t)(T * d));
    for (int e = 0; e < E; e++) { /* routed experts, on the tokens that selected them */
        const moe_index n = expert_rows(e, ids, weights, T, k, row, gate_e);
        if (n == 0)
            continue;
        generated_f64(cfg, false, e, w1, w2, w1_64, w2_64);
        gather_f64(x, row, n, d, xe);
        gather_f64(dy, row, n, d, dye);
        moe_expert_backward_f64(gemm, w1_64, w2_64, xe, dye, gate_e, cfg->weight_at, n, d, f,
                                dxe, dg, NULL, NULL);
        for (moe_index m = 0; m < n; m++) {
            for (moe_index j = 0; j < d; j++)
                dx[row[m] * d + j] += dxe[m * d + j];
            for (int s = 0; s < k; s++)
                if (ids[row[m] * k + s] == e)
                    dweights[row[m] * k + s] = dg[m];
        }
    }
    moe_router_gate_backward(router, gate, x, logits, ids, dweights, T, d, dx, dgate_w);
    to_f64(x, T * d, xe);
    to_f64(dy, T * d, dye);
    for (int s = 0; s < (int)cfg->shared_experts; s++) {
        generated_f64(cfg, true, s, w1, w2, w1_64, w2_64);
        moe_expert_backward_f64(gemm, w1_64, w2_64, xe, dye, NULL, cfg->weight_at, T, d, f, dxe,
                                NULL, dshared_w1 + s * 2 * f * d, dshared_w2 + s * d * f);
        for (moe_index m = 0; m < T * d; m++)
            dx[m] += dxe[m];
    }
    free(dweights);
    free(row);
    free(dg);
    free(gate_e);
    free(dxe);
    free(dye);
    free(xe);
    free(w2_64);
    free(w1_64);
    free(w2);
    free(w1);
}

moe_index moe_truth_backward_expert(const moe_config *cfg, enum moe_truth_gemm gemm, int e,
                                    const float *x, const float *dy, const int32_t *ids,
                                    const float *weights, moe_index tokens, double *dw1,
                                    double *dw2)
{
    const moe_index d = cfg->hidden, f = cfg->ffn, T = tokens;
    moe_index *row = moe_xmalloc(sizeof(moe_index) * (size_t)T + 1);
    double *gate = moe_xmalloc(sizeof(double) * (size_t)T + 1);
    const moe_index n = expert_rows(e, ids, weights, T, (int)cfg->topk, row, gate);
    float *w1 = moe_xmalloc(sizeof(float) * (size_t)(2 * f * d));
    float *w2 = moe_xmalloc(sizeof(float) * (size_t)(d * f));
    double *w1_64 = moe_xmalloc(sizeof(double) * (size_t)(2 * f * d));
    double *w2_64 = moe_xmalloc(sizeof(double) * (size_t)(d * f));
    double *xe = moe_xmalloc(sizeof(double) * (size_t)(n * d) + 1);
    double *dye = moe_xmalloc(sizeof(double) * (size_t)(n * d) + 1);
    generated_f64(cfg, false, e, w1, w2, w1_64, w2_64);
    gather_f64(x, row, n, d, xe);
    gather_f64(dy, row, n, d, dye);
    moe_expert_backward_f64(gemm, w1_64, w2_64, xe, dye, gate, cfg->weight_at, n, d, f, NULL, NULL,
                            dw1, dw2);
    free(dye);
    free(xe);
    free(w2_64);
    free(w1_64);
    free(w2);
    free(w1);
    free(gate);
    free(row);
    return n;
}
