/* SPDX-License-Identifier: MIT */
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
 * allow gets one bf16 step of the term (also where --gemm-out-dtype bf16
 * rounded the output itself), and the term's share of the expert's width
 * (moe_expert_forward_f64_rounded) when width is set. */
static void accumulate(const moe_config *cfg, double *y, double *allow, const double *out,
                       const double *width, const double *scale, const moe_index *row,
                       moe_index rows, moe_index hidden)
{
    const bool bf16 = cfg->combine_dtype == MOE_DTYPE_BF16;
    const bool step = bf16 || cfg->gemm_out_dtype == MOE_DTYPE_BF16;
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
            if (step && ai)
                ai[j] += fabs(before_l2 ? 1.0 : g) * moe_bf16_step(before_l2 ? g * v : v);
            if (width && ai)
                ai[j] += fabs(g) * width[m * hidden + j];
        }
    }
}

/* Routed expert n (or shared expert n) generated, or the caller's
 * (moe_config.given_w1 ...), rounded to --dtype, in fp64. */
static void generated_f64(const moe_config *cfg, bool shared, int n, double *w1_64, double *w2_64)
{
    const float *w1 = shared ? cfg->given_shared_w1 : cfg->given_w1;
    const float *w2 = shared ? cfg->given_shared_w2 : cfg->given_w2;
    const moe_index d = cfg->hidden, f = cfg->ffn;
    const bool pow2 = cfg->fp8_scale == MOE_FP8_SCALE_UE8M0;
    if (!w1 || !w2) {
        moe_expert_generate_f64(cfg->seed, shared, n, cfg->param_dtype, pow2, d, f, w1_64, w2_64);
        return;
    }
    float *held1 = moe_xmalloc(sizeof(float) * (size_t)(2 * f * d)); /* as the EP path holds them */
    float *held2 = moe_xmalloc(sizeof(float) * (size_t)(d * f));
    memcpy(held1, w1 + (moe_index)n * 2 * f * d, sizeof(float) * (size_t)(2 * f * d));
    memcpy(held2, w2 + (moe_index)n * d * f, sizeof(float) * (size_t)(d * f));
    moe_expert_held_f64(cfg->param_dtype, pow2, held1, held2, d, f, w1_64, w2_64);
    free(held2);
    free(held1);
}

/* rows (n, d) of src (T, d) in fp64. */
static void gather_f64(const float *src, const moe_index *row, moe_index n, moe_index d, double *dst)
{
    for (moe_index m = 0; m < n; m++)
        for (moe_index j = 0; j < d; j++)
            dst[m * d + j] = src[row[m] * d + j];
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

/* Sums (n) that are the whole of what they add to, rounded in place to
 * dtype (bf16; nothing otherwise), one bf16 step each into allow. */
static void round_whole(int dtype, double *sums, double *allow, moe_index n)
{
    if (dtype != MOE_DTYPE_BF16)
        return;
    for (moe_index m = 0; m < n; m++) {
        const double v = sums[m];
        sums[m] = (double)moe_round_bf16((float)v);
        if (allow)
            allow[m] += moe_bf16_step(v);
    }
}

/* The routed terms of the truth into y and allow (zeroed first), each
 * expert evaluated on the tokens that selected it or (literal) on every
 * token, its unselected terms 0 * out added. With only_rank >= 0, only the
 * pairs that rank computes (pair_rank, or the placement's expert_rank), as
 * one sum per token. */
/* The tokens expert e is evaluated on, into row (n) with their gate
 * weights for e into gate (n); returns n. With pair_rank, only the pairs
 * summed on rank `pass` (when passes > 1) or `only_rank` (>= 0); literal:
 * every token, a weight of 0 where e is not chosen. */
static moe_index forward_rows(const int32_t *ids, const float *weights, moe_index T, int k, int e,
                              const int32_t *pair_rank, int passes, int pass, int only_rank,
                              bool literal, moe_index *row, double *gate)
{
    moe_index n = 0;
    for (moe_index i = 0; i < T; i++) {
        double g = 0.0;
        for (int s = 0; s < k; s++) {
            const int32_t at = pair_rank ? pair_rank[i * k + s] : -1;
            if (ids[i * k + s] == e && (passes == 1 || at == pass) &&
                (only_rank < 0 || !pair_rank || at == only_rank))
                g = weights[i * k + s];
        }
        if (g != 0.0 || literal) {
            row[n] = i;
            gate[n++] = g;
        }
    }
    return n;
}

/* An expert's fp64 weights and the rows it runs on: xe, out and scratch
 * hold the most rows any expert had so far, at most `block` (a rank's
 * tokens: an expert's rows go in blocks of that many). */
typedef struct {
    double *w1, *w2;              /* (2f, d), (d, f) */
    double *xe, *out, *scratch;   /* (cap, d), (cap, d), (cap, 3f) */
    double *width;                /* (cap, d) with rounding points inside the expert */
    moe_expert_rounding rounding; /* the routed experts' (--gemm-out-dtype, --act-dtype) */
    moe_index cap, block;
} expert_work;

/* Expert e on its n rows (row, gate), in blocks: each output times its
 * gate weight into y (pairs) or into sums (a reduced combine's). */
static expert_work expert_work_new(const moe_config *cfg)
{
    const moe_index d = cfg->hidden, f = cfg->ffn;
    return (expert_work){.w1 = moe_xmalloc(sizeof(double) * (size_t)(2 * f * d)),
                         .w2 = moe_xmalloc(sizeof(double) * (size_t)(d * f)),
                         .rounding = moe_expert_rounding_of(cfg),
                         .block = cfg->tokens > 0 ? cfg->tokens : 1};
}

static void expert_work_free(expert_work *b)
{
    free(b->width);
    free(b->scratch);
    free(b->out);
    free(b->xe);
    free(b->w2);
    free(b->w1);
}

/* Room for an expert's n rows (at most a block of them at a time), and its
 * weights generated. */
static void expert_work_fit(const moe_config *cfg, int e, moe_index n, expert_work *b)
{
    const moe_index d = cfg->hidden, f = cfg->ffn;
    if (n > b->cap && b->cap < b->block) {
        free(b->xe);
        free(b->out);
        free(b->scratch);
        free(b->width);
        b->cap = n < b->block ? n : b->block;
        b->xe = moe_xmalloc(sizeof(double) * (size_t)(b->cap * d));
        b->out = moe_xmalloc(sizeof(double) * (size_t)(b->cap * d));
        b->scratch = moe_xmalloc(sizeof(double) * (size_t)(b->cap * 3 * f));
        b->width = moe_expert_rounds(&b->rounding) ? moe_xmalloc(sizeof(double) * (size_t)(b->cap * d)) : NULL;
    }
    generated_f64(cfg, false, e, b->w1, b->w2);
}

/* The expert on the block's rows (b->xe) into b->out, with the rounding
 * points inside it, and their width into b->width where there are any. */
static const double *expert_block(enum moe_truth_gemm gemm, moe_index rows, moe_index d,
                                  moe_index f, expert_work *b)
{
    if (!moe_expert_rounds(&b->rounding)) {
        moe_expert_forward_f64(gemm, b->w1, b->w2, b->xe, rows, d, f, b->scratch, b->out);
        return NULL;
    }
    moe_expert_forward_f64_rounded(gemm, &b->rounding, b->w1, b->w2, b->xe, rows, d, f, b->out,
                                   b->width);
    return b->width;
}

static void expert_terms(const moe_config *cfg, enum moe_truth_gemm gemm, const float *x_dispatched,
                         int e, moe_index n, const moe_index *row, const double *gate, double *y,
                         double *allow, double *sums, expert_work *b)
{
    const moe_index d = cfg->hidden, f = cfg->ffn;
    const bool reduced = cfg->combine == MOE_COMBINE_REDUCED;
    expert_work_fit(cfg, e, n, b);
    for (moe_index first = 0; first < n; first += b->cap) {
        const moe_index rows = n - first < b->cap ? n - first : b->cap;
        gather_f64(x_dispatched, row + first, rows, d, b->xe);
        const double *width = expert_block(gemm, rows, d, f, b);
        if (!reduced)
            accumulate(cfg, y, allow, b->out, width, gate + first, row + first, rows, d);
        for (moe_index m = 0; reduced && m < rows; m++)
            for (moe_index j = 0; j < d; j++)
                sums[row[first + m] * d + j] += gate[first + m] * b->out[m * d + j];
        /* a reduced combine's sums carry each term's width, and a step
         * where the output was rounded to bf16 (the sum's own rounding is
         * flush's) */
        for (moe_index m = 0; reduced && width && allow && m < rows; m++)
            for (moe_index j = 0; j < d; j++)
                allow[row[first + m] * d + j] +=
                    fabs(gate[first + m]) *
                    (width[m * d + j] + (b->rounding.out_bf16 ? moe_bf16_step(b->out[m * d + j]) : 0.0));
    }
}

static void routed_terms(const moe_config *cfg, enum moe_truth_gemm gemm,
                         const float *x_dispatched, const int32_t *ids, const float *weights,
                         moe_index tokens, int ranks, const int32_t *pair_rank, int only_rank,
                         bool literal, double *y, double *allow)
{
    const moe_index d = cfg->hidden, T = tokens;
    const int E = (int)cfg->experts, k = (int)cfg->topk;
    expert_work work = expert_work_new(cfg);
    double *gate = moe_xmalloc(sizeof(double) * (size_t)T + 1);      /* (n) their gate weights for e */
    moe_index *row = moe_xmalloc(sizeof(moe_index) * (size_t)T + 1); /* (n) and which tokens */
    memset(y, 0, sizeof(double) * (size_t)(T * d));
    /* A reduced combine rounds the sum of each rank's experts instead. */
    const bool reduced = cfg->combine == MOE_COMBINE_REDUCED;
    double *partial = reduced && only_rank < 0 ? moe_xcalloc((size_t)(T * d), sizeof(double)) : NULL;
    double *sums = only_rank >= 0 ? y : partial; /* one rank's: its one sum per token */
    /* The two-stage dispatch reduces again at each node's relay. */
    const bool by_node = reduced && cfg->dispatch == MOE_DISPATCH_HIERARCHICAL;
    MOE_ASSERT(only_rank < 0 || !by_node);
    const int R = cfg->ranks_per_node > 0 ? (int)cfg->ranks_per_node : ranks;
    double *node_partial = by_node ? moe_xcalloc((size_t)(T * d), sizeof(double)) : NULL;
    moe_placement placement = {0};
    if (reduced || only_rank >= 0)
        moe_placement_init(&placement, E, ranks);
    if (allow)
        memset(allow, 0, sizeof(double) * (size_t)(T * d));
    /* With pair_rank, a rank's sums are its pairs': one pass per rank (only
     * only_rank's when given). */
    const int passes = reduced && pair_rank && only_rank < 0 ? ranks : 1;
    for (int pass = 0; pass < passes; pass++)
    for (int e = 0; e < E; e++) {
        if (only_rank >= 0 && !pair_rank && placement.expert_rank[e] != only_rank)
            continue;
        const moe_index n = forward_rows(ids, weights, T, k, e, pair_rank, passes, pass, only_rank,
                                         literal, row, gate);
        if (n > 0) /* an expert no token selected adds nothing: not even its weights */
            expert_terms(cfg, gemm, x_dispatched, e, n, row, gate, y, allow, sums, &work);
        if (!reduced || only_rank >= 0)
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
    if (reduced && only_rank >= 0)
        round_whole(cfg->combine_dtype, y, allow, T * d);
    if (reduced || only_rank >= 0)
        moe_placement_free(&placement);
    free(node_partial);
    free(partial);
    expert_work_free(&work);
    free(row);
    free(gate);
}

void moe_truth_pair_outputs(const moe_config *cfg, enum moe_truth_gemm gemm,
                            const float *x_dispatched, const int32_t *ids, moe_index tokens,
                            double *out)
{
    const moe_index d = cfg->hidden, f = cfg->ffn, T = tokens;
    const int E = (int)cfg->experts, k = (int)cfg->topk;
    expert_work work = expert_work_new(cfg);
    moe_index *row = moe_xmalloc(sizeof(moe_index) * (size_t)T + 1);  /* (n) the expert's tokens */
    moe_index *pair = moe_xmalloc(sizeof(moe_index) * (size_t)T + 1); /* (n) and their pairs */
    memset(out, 0, sizeof(double) * (size_t)(T * k * d));
    for (int e = 0; e < E; e++) {
        moe_index n = 0;
        for (moe_index i = 0; i < T; i++)
            for (int s = 0; s < k; s++)
                if (ids[i * k + s] == e) {
                    row[n] = i;
                    pair[n++] = i * k + s;
                }
        if (n == 0)
            continue;
        expert_work_fit(cfg, e, n, &work);
        for (moe_index first = 0; first < n; first += work.cap) {
            const moe_index rows = n - first < work.cap ? n - first : work.cap;
            gather_f64(x_dispatched, row + first, rows, d, work.xe);
            expert_block(gemm, rows, d, f, &work);
            for (moe_index m = 0; m < rows; m++)
                memcpy(out + pair[first + m] * d, work.out + m * d, sizeof(double) * (size_t)d);
        }
    }
    expert_work_free(&work);
    free(pair);
    free(row);
}

void moe_truth_expert_widths(const moe_config *cfg, enum moe_truth_gemm gemm, int expert,
                             const float *x, moe_index rows, double *width)
{
    const moe_index d = cfg->hidden, f = cfg->ffn;
    expert_work work = expert_work_new(cfg);
    MOE_ASSERT(moe_expert_rounds(&work.rounding));
    expert_work_fit(cfg, expert, rows, &work);
    for (moe_index first = 0; first < rows; first += work.cap) {
        const moe_index n = rows - first < work.cap ? rows - first : work.cap;
        to_f64(x + first * d, n * d, work.xe);
        expert_block(gemm, n, d, f, &work);
        memcpy(width + first * d, work.width, sizeof(double) * (size_t)(n * d));
    }
    expert_work_free(&work);
}

void moe_truth_add_shared(const moe_config *cfg, enum moe_truth_gemm gemm, const float *x,
                          moe_index tokens, double *y)
{
    const moe_index d = cfg->hidden, f = cfg->ffn, T = tokens;
    const int S = (int)cfg->shared_experts;
    if (S == 0 || T == 0)
        return;
    double *w1_64 = moe_xmalloc(sizeof(double) * (size_t)(2 * f * d));
    double *w2_64 = moe_xmalloc(sizeof(double) * (size_t)(d * f));
    double *x64 = moe_xmalloc(sizeof(double) * (size_t)(T * d));
    double *out = moe_xmalloc(sizeof(double) * (size_t)(T * d));
    double *scratch = moe_xmalloc(sizeof(double) * (size_t)(T * 3 * f));
    to_f64(x, T * d, x64);
    for (int s = 0; s < S; s++) {
        generated_f64(cfg, true, s, w1_64, w2_64);
        moe_expert_forward_f64(gemm, w1_64, w2_64, x64, T, d, f, scratch, out);
        /* shared experts run at home: no combine, no rounding */
        for (moe_index n = 0; n < T * d; n++)
            y[n] += out[n];
    }
    free(scratch);
    free(out);
    free(x64);
    free(w2_64);
    free(w1_64);
}

static void truth_forward(const moe_config *cfg, enum moe_truth_gemm gemm, const float *x,
                          const float *x_dispatched, const int32_t *ids, const float *weights,
                          moe_index tokens, int ranks, const int32_t *pair_rank, bool literal,
                          double *y, double *allow)
{
    routed_terms(cfg, gemm, x_dispatched, ids, weights, tokens, ranks, pair_rank, -1, literal, y,
                 allow);
    moe_truth_add_shared(cfg, gemm, x, tokens, y);
    moe_truth_round_output(cfg, y, allow, tokens * cfg->hidden);
}

bool moe_truth_rounds(const moe_config *cfg)
{
    const moe_expert_rounding r = moe_expert_rounding_of(cfg);
    return cfg->combine_dtype != MOE_DTYPE_FP32 || cfg->output_dtype != MOE_DTYPE_FP32 ||
           moe_expert_rounds(&r);
}

void moe_truth_round_output(const moe_config *cfg, double *y, double *allow, moe_index n)
{
    round_whole(cfg->output_dtype, y, allow, n);
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

void moe_truth_forward_share(const moe_config *cfg, enum moe_truth_gemm gemm,
                             const float *x_dispatched, const int32_t *ids, const float *weights,
                             moe_index tokens, int ranks, const int32_t *pair_rank, int rank,
                             double *y, double *allow)
{
    MOE_ASSERT(moe_config_truth_shares(cfg) && rank >= 0 && rank < ranks);
    routed_terms(cfg, gemm, x_dispatched, ids, weights, tokens, ranks, pair_rank, rank, false, y,
                 allow);
}

double moe_truth_backward_length(const moe_config *cfg)
{
    return (double)(2 * cfg->hidden + 2 * cfg->ffn + cfg->topk + cfg->shared_experts + 8);
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

moe_index moe_truth_backward_expert(const moe_config *cfg, enum moe_truth_gemm gemm, int e,
                                    const float *x, const float *dy, const int32_t *ids,
                                    const float *weights, moe_index tokens, double *dx,
                                    double *dweights, double *dw1, double *dw2)
{
    const moe_index d = cfg->hidden, f = cfg->ffn;
    const int k = (int)cfg->topk;
    moe_index *row = moe_xmalloc(sizeof(moe_index) * (size_t)tokens + 1);
    double *gate = moe_xmalloc(sizeof(double) * (size_t)tokens + 1);
    const moe_index n = expert_rows(e, ids, weights, tokens, k, row, gate);
    if (n > 0 || dw1) { /* an expert no token chose only gives dw1's zeros */
        double *w1_64 = moe_xmalloc(sizeof(double) * (size_t)(2 * f * d));
        double *w2_64 = moe_xmalloc(sizeof(double) * (size_t)(d * f));
        double *xe = moe_xmalloc(sizeof(double) * (size_t)(n * d) + 1);
        double *dye = moe_xmalloc(sizeof(double) * (size_t)(n * d) + 1);
        double *dxe = dx ? moe_xmalloc(sizeof(double) * (size_t)(n * d) + 1) : NULL;
        double *dg = dx ? moe_xmalloc(sizeof(double) * (size_t)n + 1) : NULL;
        generated_f64(cfg, false, e, w1_64, w2_64);
        gather_f64(x, row, n, d, xe);
        gather_f64(dy, row, n, d, dye);
        moe_expert_backward_f64(gemm, w1_64, w2_64, xe, dye, gate, cfg->weight_at, n, d, f, dxe, dg,
                                dw1, dw2);
        for (moe_index m = 0; dx && m < n; m++) {
            for (moe_index j = 0; j < d; j++)
                dx[row[m] * d + j] += dxe[m * d + j];
            for (int s = 0; s < k; s++)
                if (ids[row[m] * k + s] == e)
                    dweights[row[m] * k + s] = dg[m];
        }
        free(dg);
        free(dxe);
        free(dye);
        free(xe);
        free(w2_64);
        free(w1_64);
    }
    free(gate);
    free(row);
    return n;
}

void moe_truth_backward_tokens(const moe_config *cfg, const moe_router *router,
                               enum moe_truth_gemm gemm, const float *gate, const float *x,
                               const int32_t *ids, const float *weights, const float *logits,
                               const float *dy, moe_index tokens, double *dx, double *dgate_w,
                               double *dshared_w1, double *dshared_w2)
{
    const moe_index T = tokens;
    double *dweights = moe_xcalloc((size_t)(T * cfg->topk) + 1, sizeof(double)); /* (T, k) */
    memset(dx, 0, sizeof(double) * (size_t)(T * cfg->hidden));
    for (int e = 0; e < (int)cfg->experts; e++) /* routed experts, on the tokens that selected them */
        moe_truth_backward_expert(cfg, gemm, e, x, dy, ids, weights, T, dx, dweights, NULL, NULL);
    moe_truth_backward_rest(cfg, router, gemm, gate, x, ids, logits, dy, T, dweights, dx, dgate_w,
                            dshared_w1, dshared_w2);
    free(dweights);
}

void moe_truth_backward_rest(const moe_config *cfg, const moe_router *router,
                             enum moe_truth_gemm gemm, const float *gate, const float *x,
                             const int32_t *ids, const float *logits, const float *dy,
                             moe_index tokens, const double *dweights, double *dx,
                             double *dgate_w, double *dshared_w1, double *dshared_w2)
{
    const moe_index d = cfg->hidden, f = cfg->ffn, T = tokens;
    moe_router_gate_backward(router, gate, x, logits, ids, dweights, T, d, dx, dgate_w);
    if (cfg->shared_experts == 0)
        return;
    double *w1_64 = moe_xmalloc(sizeof(double) * (size_t)(2 * f * d));
    double *w2_64 = moe_xmalloc(sizeof(double) * (size_t)(d * f));
    double *xe = moe_xmalloc(sizeof(double) * (size_t)(T * d) + 1);
    double *dye = moe_xmalloc(sizeof(double) * (size_t)(T * d) + 1);
    double *dxe = moe_xmalloc(sizeof(double) * (size_t)(T * d) + 1);
    to_f64(x, T * d, xe);
    to_f64(dy, T * d, dye);
    for (int s = 0; s < (int)cfg->shared_experts; s++) {
        generated_f64(cfg, true, s, w1_64, w2_64);
        moe_expert_backward_f64(gemm, w1_64, w2_64, xe, dye, NULL, cfg->weight_at, T, d, f, dxe,
                                NULL, dshared_w1 + s * 2 * f * d, dshared_w2 + s * d * f);
        for (moe_index m = 0; m < T * d; m++)
            dx[m] += dxe[m];
    }
    free(dxe);
    free(dye);
    free(xe);
    free(w2_64);
    free(w1_64);
}
