/* SPDX-License-Identifier: MIT */
/* mask.h — --mask-ranks: the layer as if some ranks were lost, as an
 * all-to-all with an active-rank mask or elastic EP after a failure runs
 * it. A lost rank sends and receives nothing: its own tokens go to no
 * expert (their output is the shared experts' alone), and each pair of a
 * live rank's token whose expert is on a lost rank is dropped (id -1,
 * weight 0), the token's kept weights rescaled so that they sum to what
 * its k weights summed (docs/diagnosis.md §2). The dense truth sees the
 * same ids and weights. Pure: no MPI.
 */
#ifndef MOE_MASK_H
#define MOE_MASK_H

#include <stdbool.h>

#include "moe/common.h"
#include "moe/config.h"
#include "moe/layout.h"

/* Parse "R[,R...]" or ranges "A-B" into lost (ranks entries). MOE_EXIT_USAGE
 * with a message naming --mask-ranks for a rank outside [0, ranks), one
 * given twice, or every rank lost. "" loses none. */
int moe_mask_parse(const char *spec, int ranks, bool *lost, moe_status *st);

/* The experts the lost ranks hold (contiguous blocks of `experts` over
 * `ranks`, layout.h), and in *lost_ranks how many ranks are lost. */
int moe_mask_lost_experts(const bool *lost, int ranks, int experts, int *lost_ranks);

/* --mask-ranks against the rest of cfg at `ranks` ranks: the list parses,
 * a live rank holds an expert, and the flags it cannot serve are refused
 * (--backward, --dump, --redundant-experts, --capacity-factor). */
int moe_mask_validate(const moe_config *cfg, int ranks, moe_status *st);

/* Apply lost (p->ranks entries) to rank `rank`'s ids and weights (T, topk),
 * in place. Returns the pairs it dropped (those already -1 not counted). */
moe_index moe_mask_apply(const bool *lost, const moe_placement *p, int rank, moe_index T, int topk,
                         int32_t *ids, float *weights);

#endif
