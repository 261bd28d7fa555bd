/* SPDX-License-Identifier: MIT */
/* capacity.c — expert capacity and token dropping (see capacity.h). */
#include "moe/capacity.h"
#include "moe/common.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

moe_index moe_expert_capacity(double factor, moe_index tokens, int topk, int experts)
{
    return (moe_index)ceil((double)(tokens * topk) / (double)experts * factor);
}

typedef struct {
    float weight;  /* NaN ranks below every number */
    moe_index pair; /* i * k + s: ascending pair is ascending token */
} ranked_pair;

/* Larger weight first, then the lower token. */
static int by_weight(const void *a, const void *b)
{
    const ranked_pair *p = a, *q = b;
    const float u = isnan(p->weight) ? -INFINITY : p->weight;
    const float v = isnan(q->weight) ? -INFINITY : q->weight;
    if (u != v)
        return u > v ? -1 : 1;
    return (p->pair > q->pair) - (p->pair < q->pair);
}

moe_index moe_capacity_apply(const moe_config *cfg, const int32_t *ids, const float *weights,
                             moe_index tokens, int32_t *kept)
{
    const int k = (int)cfg->topk, E = (int)cfg->experts;
    return moe_capacity_drop(ids, weights, tokens, k, E,
                             moe_expert_capacity(cfg->capacity_factor, tokens, k, E),
                             (enum moe_drop_policy)cfg->drop_policy, kept);
}

moe_index moe_capacity_drop(const int32_t *ids, const float *weights, moe_index tokens, int topk,
                            int experts, moe_index capacity, enum moe_drop_policy policy,
                            int32_t *kept)
{
    const moe_index pairs = tokens * topk;
    if (kept != ids)
        memcpy(kept, ids, sizeof(int32_t) * (size_t)pairs);
    /* Each expert's pairs in token order (a counting sort). */
    moe_index *start = moe_xcalloc((size_t)experts + 1, sizeof(moe_index));
    for (moe_index n = 0; n < pairs; n++) /* a masked pair (-1) has no expert to fill */
        if (ids[n] != MOE_DROPPED)
            start[ids[n] + 1]++;
    for (int e = 0; e < experts; e++)
        start[e + 1] += start[e];
    ranked_pair *order = moe_xmalloc(sizeof(ranked_pair) * (size_t)pairs + 1);
    moe_index *next = moe_xmalloc(sizeof(moe_index) * (size_t)experts);
    memcpy(next, start, sizeof(moe_index) * (size_t)experts);
    for (moe_index n = 0; n < pairs; n++)
        if (ids[n] != MOE_DROPPED)
            order[next[ids[n]]++] = (ranked_pair){weights[n], n};
    moe_index dropped = 0;
    for (int e = 0; e < experts; e++) {
        const moe_index count = start[e + 1] - start[e];
        if (count <= capacity)
            continue;
        if (policy == MOE_DROP_PROBS)
            qsort(order + start[e], (size_t)count, sizeof *order, by_weight);
        for (moe_index m = start[e] + capacity; m < start[e + 1]; m++)
            kept[order[m].pair] = MOE_DROPPED;
        dropped += count - capacity;
    }
    free(next);
    free(order);
    free(start);
    return dropped;
}

/* --capacity-factor: the forward drops pairs; what reads every pair of
 * the routing refuses. --drop-policy and --pad-to-capacity say nothing
 * without the capacity they act on. */
static int validate_drops(const moe_config *cfg, moe_status *st)
{
    if (cfg->drop_policy != MOE_DROP_PROBS && !(cfg->capacity_factor > 0))
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--drop-policy chooses what --capacity-factor drops: add --capacity-factor C");
    if (cfg->pad_to_capacity && !(cfg->capacity_factor > 0))
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--pad-to-capacity fills each expert to the capacity of --capacity-factor: "
                        "add --capacity-factor C");
    if (!(cfg->capacity_factor > 0))
        return MOE_EXIT_OK;
    const char *other = cfg->backward ? "--backward (the gradient of a dropped pair is not built)"
                        : cfg->dump[0] && cfg->pad_to_capacity
                            ? "--pad-to-capacity with --dump (a golden set holds the pairs computed, not the zero rows)"
                            : NULL;
    if (other)
        return moe_fail(st, MOE_EXIT_USAGE, "--capacity-factor drops pairs of the forward: drop %s",
                        other);
    return MOE_EXIT_OK;
}

/* --pad-to-capacity: the zero rows of an expert are G C minus the pairs it
 * computes, so each expert must compute all its pairs in one batch, on the
 * flat path where each pair reaches one copy of its expert. */
static int validate_padding(const moe_config *cfg, int ranks, moe_status *st)
{
    if (!cfg->pad_to_capacity)
        return MOE_EXIT_OK;
    const char *other = cfg->mode == MOE_MODE_LOW_LATENCY
                            ? "--mode low-latency (its masked layout is the fixed shape, computed "
                              "only where its counts fill it)"
                        : cfg->dispatch == MOE_DISPATCH_HIERARCHICAL
                            ? "--dispatch hierarchical (its waves split an expert's pairs by tokens)"
                        : cfg->redundant_experts > 0
                            ? "--redundant-experts (copies split an expert's pairs)"
                            : NULL;
    if (other)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--pad-to-capacity fills each expert's whole batch to G C rows: drop %s", other);
    const int64_t fewest = cfg->experts / ranks; /* waves of expert slots up to this many */
    for (int n = 0; n < cfg->waves_count && !cfg->blocking; n++) {
        const int64_t W = cfg->waves_list[n];
        if (W > 1 && (cfg->wave_by == MOE_WAVE_BY_TOKENS || W > fewest))
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--pad-to-capacity fills each expert's whole batch to G C rows: waves of "
                            "tokens split it (--waves %lld, the fewest experts a rank holds %lld); "
                            "use --wave-by experts with at most that many waves, or --blocking",
                            (long long)W, (long long)fewest);
    }
    return MOE_EXIT_OK;
}

int moe_capacity_validate(const moe_config *cfg, int ranks, moe_status *st)
{
    if (validate_drops(cfg, st) || validate_padding(cfg, ranks, st))
        return st->code;
    return MOE_EXIT_OK;
}
