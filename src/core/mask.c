/* SPDX-License-Identifier: MIT */
/* mask.c — --mask-ranks (mask.h).
 */
#include "moe/mask.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* One number of the list at *s, advancing past it. */
static bool number(const char **s, long *v)
{
    char *end;
    errno = 0;
    if (**s < '0' || **s > '9')
        return false;
    *v = strtol(*s, &end, 10);
    if (errno || end == *s)
        return false;
    *s = end;
    return true;
}

int moe_mask_parse(const char *spec, int ranks, bool *lost, moe_status *st)
{
    memset(lost, 0, sizeof(bool) * (size_t)ranks);
    if (!spec[0])
        return MOE_EXIT_OK;
    int count = 0;
    for (const char *s = spec;;) {
        long a, b;
        if (!number(&s, &a))
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--mask-ranks must be ranks R[,R...] or ranges A-B, got '%s'", spec);
        b = a;
        if (*s == '-') {
            s++;
            if (!number(&s, &b) || b < a)
                return moe_fail(st, MOE_EXIT_USAGE,
                                "--mask-ranks: a range A-B needs A <= B, got '%s'", spec);
        }
        if (*s && *s != ',')
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--mask-ranks must be ranks R[,R...] or ranges A-B, got '%s'", spec);
        for (long r = a; r <= b; r++) {
            if (r >= ranks)
                return moe_fail(st, MOE_EXIT_USAGE, "--mask-ranks: rank %ld is not in [0, %d] (%d ranks)",
                                r, ranks - 1, ranks);
            if (lost[r])
                return moe_fail(st, MOE_EXIT_USAGE, "--mask-ranks: rank %ld is given twice", r);
            lost[r] = true;
            count++;
        }
        if (!*s)
            break;
        s++;
    }
    if (count == ranks)
        return moe_fail(st, MOE_EXIT_USAGE, "--mask-ranks loses every one of the %d ranks: keep one", ranks);
    return MOE_EXIT_OK;
}

int moe_mask_lost_experts(const bool *lost, int ranks, int experts, int *lost_ranks)
{
    moe_placement p;
    moe_placement_init(&p, experts, ranks);
    int gone = 0;
    *lost_ranks = 0;
    for (int r = 0; r < ranks; r++)
        if (lost[r])
            (*lost_ranks)++, gone += moe_placement_local_experts(&p, r);
    moe_placement_free(&p);
    return gone;
}

int moe_mask_validate(const moe_config *cfg, int ranks, moe_status *st)
{
    if (!cfg->mask_ranks[0])
        return MOE_EXIT_OK;
    bool *lost = moe_xmalloc(sizeof(bool) * (size_t)ranks);
    int rc = moe_mask_parse(cfg->mask_ranks, ranks, lost, st);
    if (rc == MOE_EXIT_OK) {
        int lost_ranks;
        if (moe_mask_lost_experts(lost, ranks, (int)cfg->experts, &lost_ranks) == cfg->experts)
            rc = moe_fail(st, MOE_EXIT_USAGE,
                          "--mask-ranks %s leaves no expert reachable: the live ranks hold none of the "
                          "%lld", cfg->mask_ranks, (long long)cfg->experts);
    }
    free(lost);
    if (rc)
        return rc;
    const char *why = cfg->backward ? "--backward would differentiate the router through the drops"
                      : cfg->dump[0] ? "--dump's router tensors would not hold the ids the layer ran"
                      : cfg->redundant_experts > 0 ? "--redundant-experts would serve a lost rank's "
                                                     "experts from their copies, which is not modelled"
                      : cfg->capacity_factor > 0 ? "--capacity-factor would count pairs the mask drops"
                                                 : NULL;
    if (why)
        return moe_fail(st, MOE_EXIT_USAGE, "--mask-ranks drops pairs after the routing, and %s: drop "
                                            "one of the two", why);
    return MOE_EXIT_OK;
}

moe_index moe_mask_apply(const bool *lost, const moe_placement *p, int rank, moe_index T, int topk,
                         int32_t *ids, float *weights)
{
    moe_index dropped = 0;
    for (moe_index i = 0; i < T; i++) {
        int32_t *id = ids + i * topk;
        float *w = weights + i * topk;
        double all = 0.0, kept = 0.0;
        int lose = 0;
        for (int j = 0; j < topk; j++) {
            if (id[j] < 0)
                continue;
            all += w[j];
            if (lost[rank] || lost[p->expert_rank[id[j]]])
                lose++;
            else
                kept += w[j];
        }
        if (lose == 0)
            continue;
        for (int j = 0; j < topk; j++) {
            if (id[j] < 0)
                continue;
            if (lost[rank] || lost[p->expert_rank[id[j]]] || !(kept > 0.0)) {
                id[j] = -1;
                w[j] = 0.0f;
                dropped++;
            } else {
                w[j] = (float)((double)w[j] * all / kept);
            }
        }
    }
    return dropped;
}
