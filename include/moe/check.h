/* SPDX-License-Identifier: MIT */
/* check.h — the collective comparison of the EP output with the dense truth.
 *
 * Each rank compares its own tokens; the tolerance's rms and the worst
 * errors are reduced over ranks so that every rank reaches the same verdict.
 */
#ifndef MOE_CHECK_H
#define MOE_CHECK_H

#include "moe/comm.h"
#include "moe/report.h"
#include "moe/truth.h"

/* y (T, d) fp32 from the EP path, truth (T, d) fp64 for this rank's tokens,
 * allow (T, d) its extra tolerance or NULL. Fills s->ref_rms, tol, cmp,
 * worst_*, nonfinite and sets s->checked. Collective. */
void moe_check_collective(const moe_comm *c, const moe_config *cfg, const float *y,
                          const double *truth, const double *allow, moe_run_summary *s);

/* The truth (T, d) of this rank's tokens, as moe_truth_forward_placed
 * defines it (pair_rank may be NULL), and allow (NULL when the combine is
 * fp32), with dgemm. Where moe_config_truth_shares, the routed experts' work is
 * split by rank: every rank's x_dispatched, ids, weights and pair_rank are
 * gathered on every rank, each rank evaluates the pairs it computes on the
 * EP path for every token (generating only those experts), and each
 * token's rank sums the G shares in rank order; then it adds the shared
 * experts. Otherwise each rank evaluates its own tokens alone. Collective. */
void moe_truth_collective(const moe_comm *c, const moe_config *cfg, const float *x,
                          const float *x_dispatched, const int32_t *ids, const float *weights,
                          const int32_t *pair_rank, double *truth, double *allow);

/* Every rank's x and dy (T, d), ids and weights (T, k) on every rank, in
 * rank order (G*T rows): what the truth of a routed expert's dW needs.
 * Collective. */
typedef struct {
    float *x, *dy, *weights;
    int32_t *ids;
} moe_layer_tokens;

void moe_gather_layer_tokens(const moe_comm *c, const moe_config *cfg, const float *x,
                             const float *dy, const int32_t *ids, const float *weights,
                             moe_layer_tokens *all);
void moe_layer_tokens_free(moe_layer_tokens *all);

#endif
