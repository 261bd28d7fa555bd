/* SPDX-License-Identifier: MIT */
/* workload.h — named imbalance workloads: top-k ids and weights that are a
 * pure function of (workload, seed, step, global token id), replayed
 * instead of the router (as --routing replays a file), so that every
 * imbalance a cluster meets can be reproduced on one machine and checked
 * against the dense truth. docs/data.md §6 defines each one exactly, for a
 * port to regenerate. Pure: no MPI.
 */
#ifndef MOE_WORKLOAD_H
#define MOE_WORKLOAD_H

#include <stdint.h>

#include "moe/common.h"
#include "moe/config.h"
#include "moe/layout.h"

/* The order is W0 .. W7 (Megatron-LM's imbalance benchmark names them so). */
enum moe_workload {
    MOE_WORKLOAD_NONE,        /* the router */
    MOE_WORKLOAD_BALANCED,    /* W0: round robin, every expert the same pairs */
    MOE_WORKLOAD_HOT_EXPERTS, /* W1: a seed-chosen eighth of the experts takes 3/4 of the draws */
    MOE_WORKLOAD_HOT_RANK,    /* W2: the same heat on experts of one rank */
    MOE_WORKLOAD_SPREAD_HOT,  /* W3: the same heat spread over the ranks */
    MOE_WORKLOAD_RAGGED,      /* W4: rank r routes only its first ceil(T (r+1)/G) tokens */
    MOE_WORKLOAD_ZERO_RANK,   /* W5: the upper half of the ranks' experts get nothing */
    MOE_WORKLOAD_ROTATING,    /* W6: W2's hot rank moves every 3 steps */
    MOE_WORKLOAD_BURST,       /* W7: uniform, but every 4th step W1's heat */
    MOE_WORKLOAD_ALL,         /* bench: every workload above, one row each */
};
#define MOE_WORKLOADS (MOE_WORKLOAD_BURST - MOE_WORKLOAD_NONE) /* named ones, W0 .. W7 */

/* "balanced" .. "burst" for MOE_WORKLOAD_BALANCED .. BURST. */
const char *moe_workload_name(int workload);

/* --workload and --workload-step against the rest of cfg at `ranks` ranks:
 * a workload replaces the router, so --routing, --skew, --steps,
 * --bias-update and --backward are refused; W5 needs k experts on the lower
 * half of the ranks. MOE_EXIT_USAGE with a message naming the flag. */
int moe_workload_validate(const moe_config *cfg, int ranks, moe_status *st);

/* ids and weights (tokens, topk) of global tokens first_token ..
 * first_token + tokens - 1, which rank `rank` of p->ranks holds (T tokens a
 * rank), at `step`. A token W4 leaves unrouted has every id -1 (masked)
 * and weight 0. */
void moe_workload_route(int workload, uint64_t seed, int64_t step, const moe_placement *p,
                        moe_index T, int rank, int topk, int32_t *ids, float *weights);

#endif
