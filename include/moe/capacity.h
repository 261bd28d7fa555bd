/* SPDX-License-Identifier: MIT */
/* capacity.h — expert capacity and token dropping (GShard, Switch,
 * Megatron-Core).
 *
 * Pure: no MPI. An expert takes at most `capacity` of a batch's (token,
 * expert) pairs; the pairs over it are dropped: they are neither sent nor
 * computed, and add nothing to the token's output (its other experts and
 * the shared experts still do). The decision reads the routing alone (ids
 * and gate weights), so the EP path and the dense truth each take it for
 * themselves and agree.
 *
 * The definitions are Megatron-Core's (moe_utils.py: get_capacity and
 * topk_softmax_with_capacity, flags --moe-expert-capacity-factor and
 * --moe-token-drop-policy). Its router drops on the tokens it sees, a
 * rank's own, before the dispatch, so the capacity is per expert *per
 * rank*:
 *
 *   capacity = ceil((T k / E) C)     T: the rank's tokens, C: the factor
 *
 * and an expert receives at most G capacity rows in all. Any C > 0 keeps at
 * least one pair per expert (the ceiling); C >= E / k keeps every pair.
 *
 * Which pairs stay when an expert has more than its capacity:
 *   probs     the `capacity` of largest gate weight (the router's
 *             confidence), equal weights to the lower token index;
 *   position  the first `capacity` in token order (later tokens drop).
 * Megatron-Core takes both with torch.topk, whose order among equal values
 * is not defined; here it is, as above.
 */
#ifndef MOE_CAPACITY_H
#define MOE_CAPACITY_H

#include <stdint.h>

#include "moe/config.h"
#include "moe/dims.h"

#define MOE_DROPPED (-1) /* the expert id of a dropped pair */

enum moe_drop_policy { MOE_DROP_PROBS, MOE_DROP_POSITION };

/* ceil((tokens * topk / experts) * factor), in fp64 in that order, as
 * Megatron-Core's get_capacity computes it; factor > 0. */
moe_index moe_expert_capacity(double factor, moe_index tokens, int topk, int experts);

/* kept (T, k) = ids (T, k) with MOE_DROPPED in place of each pair over its
 * expert's capacity, by `policy` on weights (T, k); kept may be ids.
 * Returns the pairs dropped. */
moe_index moe_capacity_drop(const int32_t *ids, const float *weights, moe_index tokens, int topk,
                            int experts, moe_index capacity, enum moe_drop_policy policy,
                            int32_t *kept);

/* The drops --capacity-factor and --drop-policy ask for on a rank's
 * `tokens` tokens: moe_capacity_drop at moe_expert_capacity(C, tokens, k,
 * E) (C > 0). Returns the pairs dropped. */
moe_index moe_capacity_apply(const moe_config *cfg, const int32_t *ids, const float *weights,
                             moe_index tokens, int32_t *kept);

/* --capacity-factor, --drop-policy, --pad-to-capacity: each needs what it
 * acts on, and a padded expert computes its pairs in one batch. MOE_EXIT_OK or MOE_EXIT_USAGE with st set. */
int moe_capacity_validate(const moe_config *cfg, int ranks, moe_status *st);

#endif
