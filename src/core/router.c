/* SPDX-License-Identifier: MIT */
/* router.c — gate logits, softmax and DeepSeek-V3 selection, skew (see router.h). */
#define _POSIX_C_SOURCE 200809L
#include "moe/router.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe/exp.h"
#include "moe/quant.h"


/* The gate's logits. Each logit is one sequential fp64 sum over
 * j = 0 .. d-1 of x[i, j] * W_g[e, j], rounded to fp32 at the end: the bits
 * of a dot product computed one term at a time, whatever the blocking (a
 * product of two floats is exact in fp64, so only the additions round, in
 * j order). For speed the gate is copied once per call into fp64 strips of
 * GATE_STRIP experts, each strip (d, GATE_STRIP) contiguous; a batch of
 * GATE_BATCH tokens, converted to fp64 once, runs against one strip at a
 * time while the strip stays in the L2 cache, a few tokens by the whole
 * strip side by side in registers: every gate value loaded serves several
 * tokens and every token value the strip's experts. Lane e of a register
 * only ever adds its own term, in j order, as the scalar loop does. */
#define GATE_STRIP 16
#define GATE_BATCH 32

static enum moe_isa gate_forced = MOE_ISA_WIDEST;

void moe_router_logits_force(enum moe_isa isa) { gate_forced = isa; }

typedef double lanes2 __attribute__((vector_size(16)));
typedef double lanes2_unaligned __attribute__((vector_size(16), aligned(8), may_alias));

/* The strip's sums of tokens [t, n) of xd (n, d), one token at a time in
 * eight 2-lane sums: the portable path, and the tails. sum (n, GATE_STRIP). */
static void strip_one(const double *xd, const double *strip, moe_index hidden, int t, int n,
                      double (*sum)[GATE_STRIP])
{
    for (; t < n; t++) {
        lanes2 a[GATE_STRIP / 2] = {{0}};
        const double *x = xd + t * hidden;
        for (moe_index j = 0; j < hidden; j++) {
            const lanes2_unaligned *g = (const lanes2_unaligned *)(strip + j * GATE_STRIP);
#pragma GCC unroll 8
            for (int v = 0; v < GATE_STRIP / 2; v++)
                a[v] += x[j] * g[v];
        }
        lanes2_unaligned *out = (lanes2_unaligned *)sum[t];
        for (int v = 0; v < GATE_STRIP / 2; v++)
            out[v] = a[v];
    }
}

#ifdef MOE_X86_KERNELS
typedef double lanes4 __attribute__((vector_size(32)));
typedef double lanes4_unaligned __attribute__((vector_size(32), aligned(8), may_alias));
typedef double lanes8 __attribute__((vector_size(64)));
typedef double lanes8_unaligned __attribute__((vector_size(64), aligned(8), may_alias));

/* Two tokens by the strip: eight 4-lane sums. Returns the tokens done. */
__attribute__((target("avx2")))
static int strip_pairs(const double *xd, const double *strip, moe_index hidden, int n,
                       double (*sum)[GATE_STRIP])
{
    int t = 0;
    for (; t + 2 <= n; t += 2) {
        lanes4 a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a10 = {0}, a11 = {0}, a12 = {0},
               a13 = {0};
        const double *x0 = xd + t * hidden, *x1 = x0 + hidden;
        for (moe_index j = 0; j < hidden; j++) {
            const lanes4_unaligned *g = (const lanes4_unaligned *)(strip + j * GATE_STRIP);
            const lanes4 g0 = g[0], g1 = g[1], g2 = g[2], g3 = g[3];
            a00 += x0[j] * g0;
            a01 += x0[j] * g1;
            a02 += x0[j] * g2;
            a03 += x0[j] * g3;
            a10 += x1[j] * g0;
            a11 += x1[j] * g1;
            a12 += x1[j] * g2;
            a13 += x1[j] * g3;
        }
        lanes4_unaligned *o0 = (lanes4_unaligned *)sum[t], *o1 = (lanes4_unaligned *)sum[t + 1];
        o0[0] = a00, o0[1] = a01, o0[2] = a02, o0[3] = a03;
        o1[0] = a10, o1[1] = a11, o1[2] = a12, o1[3] = a13;
    }
    return t;
}

/* Eight tokens by the strip: sixteen 8-lane sums. Returns the tokens done. */
__attribute__((target("avx512f")))
static int strip_eights(const double *xd, const double *strip, moe_index hidden, int n,
                        double (*sum)[GATE_STRIP])
{
    int t = 0;
    for (; t + 8 <= n; t += 8) {
        lanes8 a[8][2] = {{{0}}};
        const double *x = xd + t * hidden;
        for (moe_index j = 0; j < hidden; j++) {
            const lanes8_unaligned *g = (const lanes8_unaligned *)(strip + j * GATE_STRIP);
            const lanes8 g0 = g[0], g1 = g[1];
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) {
                const double xr = x[r * hidden + j];
                a[r][0] += xr * g0;
                a[r][1] += xr * g1;
            }
        }
        for (int r = 0; r < 8; r++) {
            lanes8_unaligned *o = (lanes8_unaligned *)sum[t + r];
            o[0] = a[r][0];
            o[1] = a[r][1];
        }
    }
    return t;
}
#endif

/* sum (n, GATE_STRIP) of tokens xd (n, d) against one strip (d, GATE_STRIP). */
static void strip_sums(const double *xd, const double *strip, moe_index hidden, int n,
                       double (*sum)[GATE_STRIP])
{
    int t = 0;
#ifdef MOE_X86_KERNELS
    if (moe_isa_avx512(gate_forced))
        t = strip_eights(xd, strip, hidden, n, sum);
    if (moe_isa_avx2(gate_forced))
        t += strip_pairs(xd + t * hidden, strip, hidden, n - t, sum + t);
#endif
    strip_one(xd, strip, hidden, t, n, sum);
}

void moe_router_logits(const float *x, const float *gate, moe_index tokens, moe_index hidden,
                       int experts, float *logits)
{
    const moe_index E = experts, strips = (E + GATE_STRIP - 1) / GATE_STRIP;
    /* (strips, d, GATE_STRIP); experts past E are zero columns, computed and dropped */
    double *panel = moe_xcalloc((size_t)(strips * hidden * GATE_STRIP), sizeof(double));
#pragma omp parallel for schedule(static)
    for (moe_index s = 0; s < strips; s++)
        for (moe_index l = 0; l < GATE_STRIP && s * GATE_STRIP + l < E; l++)
            for (moe_index j = 0; j < hidden; j++)
                panel[(s * hidden + j) * GATE_STRIP + l] = gate[(s * GATE_STRIP + l) * hidden + j];
    const moe_index slots = moe_thread_slots();
    double *xd_all = moe_xmalloc(sizeof(double) * (size_t)(GATE_BATCH * hidden * slots));
    double (*sum_all)[GATE_STRIP] = moe_xmalloc(sizeof(double) * GATE_BATCH * GATE_STRIP * (size_t)slots);
#pragma omp parallel
    {
        double *xd = xd_all + moe_thread_slot() * GATE_BATCH * hidden;
        double (*sum)[GATE_STRIP] = sum_all + moe_thread_slot() * GATE_BATCH;
#pragma omp for schedule(static)
        for (moe_index i0 = 0; i0 < tokens; i0 += GATE_BATCH) {
            const int n = tokens - i0 < GATE_BATCH ? (int)(tokens - i0) : GATE_BATCH;
            const float *xi = x + i0 * hidden;
#pragma omp simd
            for (moe_index m = 0; m < n * hidden; m++)
                xd[m] = xi[m];
            for (moe_index s = 0; s < strips; s++) {
                const moe_index e0 = s * GATE_STRIP;
                const int ne = E - e0 < GATE_STRIP ? (int)(E - e0) : GATE_STRIP;
                strip_sums(xd, panel + s * hidden * GATE_STRIP, hidden, n, sum);
                for (int t = 0; t < n; t++)
                    for (int e = 0; e < ne; e++)
                        logits[(i0 + t) * E + e0 + e] = (float)sum[t][e];
            }
        }
    }
    free(sum_all);
    free(xd_all);
    free(panel);
}

static void softmax_row(const float *logits, int experts, float *scores)
{
    double max = logits[0];
    for (int e = 1; e < experts; e++)
        if (logits[e] > max)
            max = logits[e];
    double p[MOE_ROUTER_MAX_EXPERTS], sum = 0.0;
    for (int e = 0; e < experts; e++)
        p[e] = (double)logits[e] - max;
    moe_exp_fp64_n(p, p, experts);
    for (int e = 0; e < experts; e++)
        sum += p[e];
    for (int e = 0; e < experts; e++)
        scores[e] = (float)(p[e] / sum);
}

static void sigmoid_row(const float *logits, int experts, float *scores)
{
    double p[MOE_ROUTER_MAX_EXPERTS];
    for (int e = 0; e < experts; e++)
        p[e] = -(double)logits[e];
    moe_exp_fp64_n(p, p, experts);
    for (int e = 0; e < experts; e++)
        scores[e] = (float)(1.0 / (1.0 + p[e]));
}

/* The k largest of values (n) in descending order into ids; equal values keep
 * the lower index first because only a strictly greater value displaces one.
 * -inf values are never taken while a finite one is left. One pass keeping
 * the best k so far in order: a value enters only when it beats the k-th
 * (strictly), after every kept value it does not beat (the one order of
 * the k-pass selection this replaced: value descending, index ascending).
 * With a NaN among the values that order is not defined, and the k-pass
 * selection itself runs. */
static void top_k(const float *values, int n, int k, int32_t *ids)
{
    MOE_ASSERT(n <= MOE_ROUTER_MAX_EXPERTS && k >= 1 && k <= n);
    float kept[MOE_ROUTER_MAX_EXPERTS];
    int have = 0;
    for (int e = 0; e < n; e++) {
        const float v = values[e];
        if (v != v)
            goto selection;
        if (have == k && !(v > kept[k - 1]))
            continue;
        int at = have < k ? have++ : k - 1; /* the last place, then up past the smaller */
        for (; at > 0 && v > kept[at - 1]; at--) {
            kept[at] = kept[at - 1];
            ids[at] = ids[at - 1];
        }
        kept[at] = v;
        ids[at] = e;
    }
    return;
selection:;
    unsigned char taken[MOE_ROUTER_MAX_EXPERTS] = {0};
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
            if (r->bf16_weights)
                weight[s] = moe_round_bf16(weight[s]);
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
        if (!strncmp(item, "hot:", 4)) /* hot:0=+2,hot:5=+1 says the same as hot:0=+2,5=+1 */
            item += 4;
        errno = 0;
        long e = strtol(item, &end, 10);
        if (end == item || *end != '=' || errno || item[0] == '-' || item[0] == '+')
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--skew hot: '%s' is not EXPERT=B (an expert id, '=', a logit bias), "
                            "as in hot:0=+2,5=+1", item);
        if (e >= experts)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--skew hot: expert must be in [0, %d] (--experts %d), got %ld in '%s'",
                            experts - 1, experts, e, item);
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
        const float *raw = logits + t * E, *score = scores + t * E;
        float logit[MOE_ROUTER_MAX_EXPERTS]; /* as the router saw them: --skew added */
        double most = -INFINITY, total = 0.0, exps = 0.0;
        for (int e = 0; e < E; e++) {
            logit[e] = r->skew ? raw[e] + r->skew[e] : raw[e];
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
            if (ids[t * k + s] >= 0) /* a masked pair (-1) of a replayed routing */
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

int moe_router_validate(const moe_config *cfg, moe_status *st)
{
    const int64_t E = cfg->experts, N = cfg->groups, M = cfg->topk_groups;
    if (cfg->router != MOE_ROUTER_DEEPSEEK_V3) {
        if (N != 1 || M != 1)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--groups and --topk-groups need --router deepseek-v3");
    } else {
        if (E % N != 0)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--groups must divide --experts %lld, got %lld", (long long)E, (long long)N);
        if (M > N)
            return moe_fail(st, MOE_EXIT_USAGE, "--topk-groups must be in [1, %lld] (at most --groups), got %lld",
                            (long long)N, (long long)M);
        if (cfg->bias_scale > 0 && N > 1 && E / N < 2)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--groups %lld leaves 1 expert per group, but the biased group score sums "
                            "the top 2: use at most %lld groups, or --bias-scale 0",
                            (long long)N, (long long)(E / 2));
        if (cfg->topk > M * (E / N))
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--topk must be at most %lld (the experts in the %lld kept groups of %lld), got %lld",
                            (long long)(M * (E / N)), (long long)M, (long long)(E / N), (long long)cfg->topk);
    }
    float skew[4096];
    return moe_skew_parse(cfg->skew, (int)E, skew, st);
}

/* --steps and --bias-update: the bias is the deepseek-v3 router's; the
 * steps route fresh batches of the router's own. */
int moe_router_validate_steps(const moe_config *cfg, moe_status *st)
{
    if (cfg->bias_update > 0 && (cfg->router != MOE_ROUTER_DEEPSEEK_V3 || !(cfg->bias_scale > 0)))
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--bias-update moves deepseek-v3's correction bias: add --router deepseek-v3 "
                        "with --bias-scale above 0 (without a bias the router is V2's)");
    if (cfg->steps == 1 && !(cfg->bias_update > 0) && (cfg->steps_csv[0] || cfg->steps_plot[0]))
        return moe_fail(st, MOE_EXIT_USAGE, "--%s records the steps: add --steps N",
                        cfg->steps_csv[0] ? "steps-csv" : "steps-plot");
    if ((cfg->steps > 1 || cfg->bias_update > 0) && cfg->routing[0])
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--steps routes fresh batches with the router: drop --routing");
    if ((cfg->steps > 1 || cfg->bias_update > 0) && cfg->backward)
        return moe_fail(st, MOE_EXIT_USAGE, "--steps and --bias-update run forwards: drop --backward");
    return MOE_EXIT_OK;
}
