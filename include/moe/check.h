/* check.h — the collective comparison of the EP output with the dense truth.
 *
 * Each rank compares its own tokens; the tolerance's rms and the worst
 * errors are reduced over ranks so that every rank reaches the same verdict.
 */
#ifndef MOE_CHECK_H
#define MOE_CHECK_H

#include "moe/comm.h"
#include "moe/report.h"

/* y (T, d) fp32 from the EP path, truth (T, d) fp64 for this rank's tokens,
 * allow (T, d) its extra tolerance or NULL. Fills s->ref_rms, tol, cmp,
 * worst_*, nonfinite and sets s->checked. Collective. */
void moe_check_collective(const moe_comm *c, const moe_config *cfg, const float *y,
                          const double *truth, const double *allow, moe_run_summary *s);

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
