/* router.c — gate logits and softmax top-k selection (see router.h). */
#include "moe/router.h"

#include <math.h>

#include "moe/common.h"

void moe_router_logits(const float *x, const float *gate, moe_index tokens, moe_index hidden,
                       int experts, float *logits)
{
#pragma omp parallel for schedule(static)
    for (moe_index i = 0; i < tokens; i++) {
        const float *row = x + i * hidden; /* (d) */
        for (int e = 0; e < experts; e++) {
            const float *w = gate + (moe_index)e * hidden; /* (d) */
            double sum = 0.0;
            for (moe_index j = 0; j < hidden; j++)
                sum += (double)row[j] * (double)w[j];
            logits[i * experts + e] = (float)sum;
        }
    }
}

static void softmax_row(const float *logits, int experts, float *scores)
{
    double max = logits[0];
    for (int e = 1; e < experts; e++)
        if (logits[e] > max)
            max = logits[e];
    double sum = 0.0;
    for (int e = 0; e < experts; e++)
        sum += exp((double)logits[e] - max);
    for (int e = 0; e < experts; e++)
        scores[e] = (float)(exp((double)logits[e] - max) / sum);
}

/* The k largest of scores (E) in descending order; equal scores keep the
 * lower index first because only a strictly greater score displaces one.
 * O(E*k); E is at most MOE_ROUTER_MAX_EXPERTS (the --experts bound). */
#define MOE_ROUTER_MAX_EXPERTS 4096
static void top_k(const float *scores, int experts, int topk, int32_t *ids)
{
    unsigned char taken[MOE_ROUTER_MAX_EXPERTS] = {0};
    MOE_ASSERT(experts <= MOE_ROUTER_MAX_EXPERTS);
    for (int s = 0; s < topk; s++) {
        int best = -1;
        for (int e = 0; e < experts; e++)
            if (!taken[e] && (best < 0 || scores[e] > scores[best]))
                best = e;
        taken[best] = 1;
        ids[s] = best;
    }
}

void moe_router_select(const moe_router *r, const float *logits, moe_index tokens, float *scores,
                       int32_t *ids, float *weights)
{
    MOE_ASSERT(r->kind == MOE_ROUTER_SOFTMAX);
    MOE_ASSERT(r->topk >= 1 && r->topk <= r->experts);
    const int E = r->experts, k = r->topk;
#pragma omp parallel for schedule(static)
    for (moe_index i = 0; i < tokens; i++) {
        float *score = scores + i * E; /* (E) */
        int32_t *id = ids + i * k;     /* (k) */
        float *weight = weights + i * k;
        softmax_row(logits + i * E, E, score);
        top_k(score, E, k, id);
        double sum = 0.0;
        for (int s = 0; s < k; s++)
            sum += score[id[s]];
        for (int s = 0; s < k; s++)
            weight[s] = r->normalize ? (float)(score[id[s]] / sum) : score[id[s]];
    }
}
