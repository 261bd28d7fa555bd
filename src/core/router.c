/* router.c — gate logits, softmax and DeepSeek-V3 selection, skew (see router.h). */
#define _POSIX_C_SOURCE 200809L
#include "moe/router.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe/exp.h"


/* The gate's logits. Each logit is one sequential fp64 sum over
 * j = 0 .. d-1 of x[i, j] * W_g[e, j], rounded to fp32 at the end: the bits
 * of a dot product computed one term at a time, whatever the blocking. For
 * speed the sums of GATE_TOKENS tokens by GATE_EXPERTS experts run side by
 * side in registers over a transposed fp64 copy of the gate, so every gate
 * value loaded serves several tokens and every token value several experts;
 * the additions into one sum still happen in j order. */
#define GATE_TOKENS 4
#define GATE_EXPERTS 8

typedef double lanes4 __attribute__((vector_size(32)));
typedef double lanes4_unaligned __attribute__((vector_size(32), aligned(8), may_alias));

/* sum (n, ne) of tokens xd (n, d) in fp64 against experts [e0, e0 + ne) of
 * gate_t (d, E); n <= GATE_TOKENS, ne <= GATE_EXPERTS. A full block keeps its
 * 4 x 8 sums in eight 4-lane registers; lane e of a register only ever adds
 * its own term, in j order, as the scalar loop does. */
__attribute__((target_clones("avx2", "default")))
static void gate_block(const double *xd, const double *gate_t, moe_index hidden, moe_index E,
                       moe_index e0, int n, int ne, double sum[GATE_TOKENS][GATE_EXPERTS])
{
    if (n == GATE_TOKENS && ne == GATE_EXPERTS) {
        lanes4 a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0},
               a31 = {0};
        const double *x0 = xd, *x1 = xd + hidden, *x2 = xd + 2 * hidden, *x3 = xd + 3 * hidden;
        for (moe_index j = 0; j < hidden; j++) {
            const double *g = gate_t + j * E + e0;
            const lanes4 g0 = *(const lanes4_unaligned *)g, g1 = *(const lanes4_unaligned *)(g + 4);
            a00 += x0[j] * g0;
            a01 += x0[j] * g1;
            a10 += x1[j] * g0;
            a11 += x1[j] * g1;
            a20 += x2[j] * g0;
            a21 += x2[j] * g1;
            a30 += x3[j] * g0;
            a31 += x3[j] * g1;
        }
        lanes4_unaligned *out = (lanes4_unaligned *)&sum[0][0]; /* rows of 8: two lanes4 */
        out[0] = a00;
        out[1] = a01;
        out[2] = a10;
        out[3] = a11;
        out[4] = a20;
        out[5] = a21;
        out[6] = a30;
        out[7] = a31;
        return;
    }
    for (int t = 0; t < n; t++)
        for (int e = 0; e < ne; e++) {
            double acc = 0.0;
            for (moe_index j = 0; j < hidden; j++)
                acc += xd[t * hidden + j] * gate_t[j * E + e0 + e];
            sum[t][e] = acc;
        }
}

void moe_router_logits(const float *x, const float *gate, moe_index tokens, moe_index hidden,
                       int experts, float *logits)
{
    const moe_index E = experts;
    double *gate_t = moe_xmalloc(sizeof(double) * (size_t)(hidden * E)); /* (d, E) */
#pragma omp parallel for schedule(static)
    for (moe_index j = 0; j < hidden; j++)
        for (moe_index e = 0; e < E; e++)
            gate_t[j * E + e] = gate[e * hidden + j];
#pragma omp parallel
    {
        double *xd = moe_xmalloc(sizeof(double) * (size_t)(GATE_TOKENS * hidden)); /* (4, d) */
        double sum[GATE_TOKENS][GATE_EXPERTS];
#pragma omp for schedule(static)
        for (moe_index i0 = 0; i0 < tokens; i0 += GATE_TOKENS) {
            const int n = tokens - i0 < GATE_TOKENS ? (int)(tokens - i0) : GATE_TOKENS;
            const float *xi = x + i0 * hidden;
#pragma omp simd
            for (moe_index m = 0; m < n * hidden; m++)
                xd[m] = xi[m];
            for (moe_index e0 = 0; e0 < E; e0 += GATE_EXPERTS) {
                const int ne = E - e0 < GATE_EXPERTS ? (int)(E - e0) : GATE_EXPERTS;
                gate_block(xd, gate_t, hidden, E, e0, n, ne, sum);
                for (int t = 0; t < n; t++)
                    for (int e = 0; e < ne; e++)
                        logits[(i0 + t) * E + e0 + e] = (float)sum[t][e];
            }
        }
        free(xd);
    }
    free(gate_t);
}

static void softmax_row(const float *logits, int experts, float *scores)
{
    double max = logits[0];
    for (int e = 1; e < experts; e++)
        if (logits[e] > max)
            max = logits[e];
    double sum = 0.0;
    for (int e = 0; e < experts; e++)
        sum += moe_exp_fp64((double)logits[e] - max);
    for (int e = 0; e < experts; e++)
        scores[e] = (float)(moe_exp_fp64((double)logits[e] - max) / sum);
}

static void sigmoid_row(const float *logits, int experts, float *scores)
{
    for (int e = 0; e < experts; e++)
        scores[e] = (float)(1.0 / (1.0 + moe_exp_fp64(-(double)logits[e])));
}

/* The k largest of values (n) in descending order into ids; equal values keep
 * the lower index first because only a strictly greater value displaces one.
 * -inf values are never taken while a finite one is left. O(n*k). */
static void top_k(const float *values, int n, int k, int32_t *ids)
{
    unsigned char taken[MOE_ROUTER_MAX_EXPERTS] = {0};
    MOE_ASSERT(n <= MOE_ROUTER_MAX_EXPERTS);
    for (int s = 0; s < k; s++) {
        int best = -1;
        for (int e = 0; e < n; e++)
            if (!taken[e] && (best < 0 || values[e] > values[best]))
                best = e;
        taken[best] = 1;
        ids[s] = best;
    }
}

void moe_router_groups(const moe_router *r, const float *biased, float *group_score,
                       unsigned char *keep)
{
    const int per_group = r->experts / r->groups;
    int32_t kept[MOE_ROUTER_MAX_EXPERTS];
    for (int g = 0; g < r->groups; g++) {
        const float *member = biased + g * per_group;
        if (r->bias) { /* sum of the two best, as V3 */
            int32_t two[2];
            top_k(member, per_group, 2, two);
            group_score[g] = member[two[0]] + member[two[1]];
        } else { /* the best, as V2 */
            int32_t one;
            top_k(member, per_group, 1, &one);
            group_score[g] = member[one];
        }
    }
    top_k(group_score, r->groups, r->topk_groups, kept);
    memset(keep, 0, (size_t)r->groups);
    for (int n = 0; n < r->topk_groups; n++)
        keep[kept[n]] = 1;
}

/* DeepSeek-V3 group limit on biased (E): keep the best topk_groups groups,
 * mask the others' experts with -inf. */
static void limit_groups(const moe_router *r, float *biased)
{
    const int per_group = r->experts / r->groups;
    float group_score[MOE_ROUTER_MAX_EXPERTS];
    unsigned char keep[MOE_ROUTER_MAX_EXPERTS];
    moe_router_groups(r, biased, group_score, keep);
    for (int g = 0; g < r->groups; g++)
        if (!keep[g])
            for (int e = g * per_group; e < (g + 1) * per_group; e++)
                biased[e] = -INFINITY;
}

void moe_router_select(const moe_router *r, const float *logits, moe_index tokens, float *scores,
                       int32_t *ids, float *weights)
{
    const int E = r->experts, k = r->topk;
    MOE_ASSERT(k >= 1 && k <= E && E <= MOE_ROUTER_MAX_EXPERTS);
    MOE_ASSERT(r->groups >= 1 && E % r->groups == 0);
    MOE_ASSERT(r->topk_groups >= 1 && r->topk_groups <= r->groups);
    const bool sigmoid = r->kind == MOE_ROUTER_DEEPSEEK_V3 && r->bias;
    const bool normalize = r->normalize || sigmoid;
#pragma omp parallel for schedule(static)
    for (moe_index i = 0; i < tokens; i++) {
        float skewed[MOE_ROUTER_MAX_EXPERTS], biased[MOE_ROUTER_MAX_EXPERTS];
        float *score = scores + i * E; /* (E) */
        int32_t *id = ids + i * k;     /* (k) */
        float *weight = weights + i * k;
        const float *logit = logits + i * E;
        if (r->skew) {
            for (int e = 0; e < E; e++)
                skewed[e] = logit[e] + r->skew[e];
            logit = skewed;
        }
        if (sigmoid)
            sigmoid_row(logit, E, score);
        else
            softmax_row(logit, E, score);
        for (int e = 0; e < E; e++)
            biased[e] = r->bias ? score[e] + r->bias[e] : score[e];
        if (r->kind == MOE_ROUTER_DEEPSEEK_V3 && r->groups > 1)
            limit_groups(r, biased);
        top_k(biased, E, k, id);
        double sum = 0.0;
        for (int s = 0; s < k; s++)
            sum += score[id[s]];
        for (int s = 0; s < k; s++) {
            float w = normalize ? (float)(score[id[s]] / sum) : score[id[s]];
            weight[s] = w * r->route_scale; /* every router, as V2 and V3 apply it */
        }
    }
}

int moe_skew_parse(const char *spec, int experts, float *skew, moe_status *st)
{
    for (int e = 0; e < experts; e++)
        skew[e] = 0.0f;
    if (!*spec || !strcmp(spec, "none"))
        return MOE_EXIT_OK;
    char *end;
    if (!strncmp(spec, "zipf:", 5)) {
        errno = 0;
        double s = strtod(spec + 5, &end);
        if (end == spec + 5 || *end || errno || !(s >= 0) || s > 100)
            return moe_fail(st, MOE_EXIT_USAGE, "--skew zipf:S needs S in [0, 100], got '%s'", spec);
        for (int e = 0; e < experts; e++)
            skew[e] = (float)(-s * log((double)e + 1.0));
        return MOE_EXIT_OK;
    }
    if (strncmp(spec, "hot:", 4))
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--skew must be hot:EXPERT=+B[,...] or zipf:S, got '%s'", spec);
    char text[256];
    snprintf(text, sizeof text, "%s", spec + 4);
    int items = 0;
    for (char *save = NULL, *item = strtok_r(text, ",", &save); item;
         item = strtok_r(NULL, ",", &save), items++) {
        errno = 0;
        long e = strtol(item, &end, 10);
        if (end == item || *end != '=' || errno || e < 0 || e >= experts)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--skew hot: expert must be in [0, %d] as in hot:0=+2, got '%s'",
                            experts - 1, item);
        const char *value = end + 1;
        double b = strtod(value, &end);
        if (end == value || *end || !isfinite(b) || fabs(b) > 100)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--skew hot: bias must be a number in [-100, 100] as in hot:0=+2, got '%s'",
                            item);
        skew[e] += (float)b;
    }
    if (items == 0)
        return moe_fail(st, MOE_EXIT_USAGE, "--skew hot: needs EXPERT=+B, got '%s'", spec);
    return MOE_EXIT_OK;
}

void moe_router_bias_update(float *bias, const double *load, int experts, float gamma)
{
    double mean = 0.0;
    for (int e = 0; e < experts; e++)
        mean += load[e];
    mean /= experts;
    for (int e = 0; e < experts; e++)
        bias[e] += load[e] < mean ? gamma : load[e] > mean ? -gamma : 0.0f;
}

void moe_router_balance(const moe_router *r, const float *logits, const float *scores,
                        const int32_t *ids, moe_index tokens, double *pairs, double *prob,
                        moe_balance_sums *sums)
{
    const int E = r->experts, k = r->topk;
    double *count = moe_xcalloc((size_t)E, sizeof(double));
    double *mean_p = moe_xcalloc((size_t)E, sizeof(double));
    for (moe_index t = 0; t < tokens; t++) {
        const float *logit = logits + t * E, *score = scores + t * E;
        double most = -INFINITY, total = 0.0, exps = 0.0;
        for (int e = 0; e < E; e++) {
            most = fmax(most, (double)logit[e]);
            total += score[e];
        }
        for (int e = 0; e < E; e++)
            exps += exp((double)logit[e] - most);
        const double lse = most + log(exps);
        sums->z_sum += lse * lse;
        for (int e = 0; e < E; e++)
            mean_p[e] += total > 0 ? score[e] / total : 0.0;
        for (int s = 0; s < k; s++)
            count[ids[t * k + s]] += 1.0;
    }
    double seq = 0.0;
    for (int e = 0; e < E && tokens > 0; e++) {
        seq += (double)E / ((double)k * (double)tokens) * count[e] * (mean_p[e] / (double)tokens);
        pairs[e] += count[e];
        prob[e] += mean_p[e];
    }
    sums->tokens += (double)tokens;
    sums->seq_sum += seq;
    sums->sequences += tokens > 0;
    free(mean_p);
    free(count);
}

void moe_balance_losses(const double *pairs, const double *prob, int experts, int topk,
                        const moe_balance_sums *sums, double *aux, double *z, double *seq)
{
    const double N = sums->tokens;
    *aux = 0.0;
    for (int e = 0; e < experts && N > 0; e++)
        *aux += (double)experts * (pairs[e] / (N * topk)) * (prob[e] / N);
    *z = N > 0 ? sums->z_sum / N : 0.0;
    *seq = sums->sequences > 0 ? sums->seq_sum / sums->sequences : 0.0;
}
