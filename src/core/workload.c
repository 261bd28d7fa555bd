/* SPDX-License-Identifier: MIT */
/* workload.c — the named imbalance workloads (workload.h); docs/data.md §6
 * is their definition.
 */
#include "moe/workload.h"

#include <stdbool.h>
#include <stdlib.h>

#include "moe/rng.h"

static const char *const names[] = {
    [MOE_WORKLOAD_BALANCED] = "balanced",     [MOE_WORKLOAD_HOT_EXPERTS] = "hot-experts",
    [MOE_WORKLOAD_HOT_RANK] = "hot-rank",     [MOE_WORKLOAD_SPREAD_HOT] = "spread-hot",
    [MOE_WORKLOAD_RAGGED] = "ragged",         [MOE_WORKLOAD_ZERO_RANK] = "zero-rank",
    [MOE_WORKLOAD_ROTATING] = "rotating",     [MOE_WORKLOAD_BURST] = "burst",
};

const char *moe_workload_name(int workload)
{
    return workload >= MOE_WORKLOAD_BALANCED && workload <= MOE_WORKLOAD_BURST ? names[workload]
                                                                               : "router";
}

/* The hot set's size: an eighth of the experts, at least one. */
static int hot_count(int E)
{
    return E / 8 > 1 ? E / 8 : 1;
}

/* The rank a workload's lower half ends at: W5 zeroes the experts of ranks
 * >= it; with one rank, the experts from ceil(E/2) on. */
static bool zeroed(const moe_placement *p, int e)
{
    if (p->ranks == 1)
        return e >= (p->experts + 1) / 2;
    return p->expert_rank[e] >= (p->ranks + 1) / 2;
}

int moe_workload_validate(const moe_config *cfg, int ranks, moe_status *st)
{
    if (cfg->workload == MOE_WORKLOAD_NONE)
        return MOE_EXIT_OK;
    const char *other = cfg->routing[0] ? "--routing" : cfg->skew[0] ? "--skew"
                        : cfg->steps > 1 ? "--steps" : cfg->bias_update > 0 ? "--bias-update"
                        : cfg->backward ? "--backward" : NULL;
    if (other)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--workload replaces the router with its own top-k ids and weights: drop %s",
                        other);
    if (cfg->workload != MOE_WORKLOAD_ZERO_RANK)
        return MOE_EXIT_OK;
    moe_placement p;
    moe_placement_init(&p, (int)cfg->experts, ranks);
    int allowed = 0;
    for (int e = 0; e < p.experts; e++)
        allowed += !zeroed(&p, e);
    moe_placement_free(&p);
    if (allowed < cfg->topk)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--workload zero-rank leaves %d experts (those of the lower half of the %d "
                        "ranks) for --topk %lld: use more experts, fewer ranks or a smaller --topk",
                        allowed, ranks, (long long)cfg->topk);
    return MOE_EXIT_OK;
}

/* heat[e] for hot set `hot` (n experts): 3 (E - n) each, the rest n each, so
 * one draw lands in the hot set with probability 3/4; uniform when the hot
 * set is empty or every expert. */
static void heat_hot(uint64_t *heat, int E, const int *hot, int n)
{
    for (int e = 0; e < E; e++)
        heat[e] = n > 0 && n < E ? (uint64_t)n : 1;
    for (int i = 0; i < n && n < E; i++)
        heat[hot[i]] = 3 * (uint64_t)(E - n);
}

/* W1's hot set: the hot_count(E) experts with the smallest words of
 * MOE_TENSOR_WORKLOAD_HOT (ties by id). */
static int hot_by_seed(uint64_t seed, int E, int *hot)
{
    const int n = hot_count(E);
    uint32_t *word = moe_xmalloc(sizeof(uint32_t) * (size_t)E);
    bool *taken = moe_xcalloc((size_t)E, sizeof(bool));
    for (int e = 0; e < E; e++)
        word[e] = moe_synth_word(seed, MOE_TENSOR_WORKLOAD_HOT, 0, (uint64_t)e);
    for (int i = 0; i < n; i++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || word[e] < word[best]))
                best = e;
        taken[best] = true;
        hot[i] = best;
    }
    free(taken);
    free(word);
    return n;
}

/* W2 and W6: the first min(hot_count(E), its experts) experts of rank rho. */
static int hot_on_rank(const moe_placement *p, int rho, int *hot)
{
    const int local = moe_placement_local_experts(p, rho);
    const int n = hot_count(p->experts) < local ? hot_count(p->experts) : local;
    for (int i = 0; i < n; i++)
        hot[i] = p->first_expert[rho] + i;
    return n;
}

/* W3: hot_count(E) experts taken round robin over the ranks, each rank's
 * next expert in turn (rank 0's first, rank 1's first, ..., rank 0's second). */
static int hot_spread(const moe_placement *p, int *hot)
{
    const int want = hot_count(p->experts);
    int n = 0;
    for (int q = 0; n < want; q++)
        for (int r = 0; r < p->ranks && n < want; r++)
            if (q < moe_placement_local_experts(p, r))
                hot[n++] = p->first_expert[r] + q;
    return n;
}

/* The heat of every expert for this workload and step. */
static void heat_of(int workload, uint64_t seed, int64_t step, const moe_placement *p,
                    uint64_t *heat)
{
    const int E = p->experts;
    int *hot = moe_xmalloc(sizeof(int) * (size_t)E);
    int n = 0;
    switch (workload) {
    case MOE_WORKLOAD_HOT_EXPERTS: n = hot_by_seed(seed, E, hot); break;
    case MOE_WORKLOAD_HOT_RANK: n = hot_on_rank(p, 0, hot); break;
    case MOE_WORKLOAD_SPREAD_HOT: n = hot_spread(p, hot); break;
    case MOE_WORKLOAD_ROTATING: n = hot_on_rank(p, (int)((step / 3) % p->ranks), hot); break;
    case MOE_WORKLOAD_BURST: n = step % 4 == 3 ? hot_by_seed(seed, E, hot) : 0; break;
    default: break;
    }
    heat_hot(heat, E, hot, n);
    if (workload == MOE_WORKLOAD_ZERO_RANK)
        for (int e = 0; e < E; e++)
            heat[e] = zeroed(p, e) ? 0 : 1;
    free(hot);
}

/* k distinct experts of one token by heat, without replacement: slot j's
 * word u picks the first untaken expert whose running heat (ascending ids,
 * untaken only) exceeds floor(u H / 2^32), H the untaken heat. */
static void draw(const uint64_t *heat, int E, uint64_t seed, int64_t step, uint64_t first_index,
                 int topk, bool *taken, int32_t *ids)
{
    uint64_t total = 0;
    for (int e = 0; e < E; e++)
        total += heat[e];
    for (int j = 0; j < topk; j++) {
        const uint64_t u = moe_synth_word(seed, MOE_TENSOR_WORKLOAD_DRAW, (uint32_t)step,
                                          first_index + (uint64_t)j);
        const uint64_t target = (u * total) >> 32;
        uint64_t running = 0;
        int pick = -1;
        for (int e = 0; e < E && pick < 0; e++) {
            if (taken[e])
                continue;
            running += heat[e];
            if (running > target)
                pick = e;
        }
        MOE_ASSERT(pick >= 0);
        taken[pick] = true;
        total -= heat[pick];
        ids[j] = pick;
    }
    for (int j = 0; j < topk; j++)
        taken[ids[j]] = false;
}

void moe_workload_route(int workload, uint64_t seed, int64_t step, const moe_placement *p,
                        moe_index T, int rank, int topk, int32_t *ids, float *weights)
{
    MOE_ASSERT(workload >= MOE_WORKLOAD_BALANCED && workload <= MOE_WORKLOAD_BURST);
    const int E = p->experts, G = p->ranks;
    uint64_t *heat = moe_xmalloc(sizeof(uint64_t) * (size_t)E);
    bool *taken = moe_xcalloc((size_t)E, sizeof(bool));
    heat_of(workload, seed, step, p, heat);
    const moe_index routed = workload == MOE_WORKLOAD_RAGGED ? (T * (rank + 1) + G - 1) / G : T;
    for (moe_index i = 0; i < T; i++) {
        const uint64_t g = (uint64_t)rank * (uint64_t)T + (uint64_t)i; /* global token id */
        int32_t *id = ids + i * topk;
        float *w = weights + i * topk;
        if (i >= routed) {
            for (int j = 0; j < topk; j++)
                id[j] = -1, w[j] = 0.0f;
            continue;
        }
        if (workload == MOE_WORKLOAD_BALANCED)
            for (int j = 0; j < topk; j++)
                id[j] = (int32_t)((g * (uint64_t)topk + (uint64_t)j) % (uint64_t)E);
        else
            draw(heat, E, seed, step, g * (uint64_t)topk, topk, taken, id);
        uint32_t n[topk], sum = 0;
        for (int j = 0; j < topk; j++) {
            n[j] = 1 + (moe_synth_word(seed, MOE_TENSOR_WORKLOAD_WEIGHT, (uint32_t)step,
                                       g * (uint64_t)topk + (uint64_t)j) >> 28);
            sum += n[j];
        }
        for (int j = 0; j < topk; j++)
            w[j] = (float)n[j] / (float)sum;
    }
    free(taken);
    free(heat);
}
