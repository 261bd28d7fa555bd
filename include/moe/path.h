/* SPDX-License-Identifier: MIT */
/* path.h — the way a layer runs, chosen once from the validated
 * configuration.
 *
 * moe-ep runs the layer in five ways, all exact against the dense truth;
 * two of them also have a blocking form, so the table has seven entries:
 *
 *   path                 flags                       forward
 *   reference            --blocking                  moe_ep_forward_ref (ep_ref.c), never removed
 *   waves                (the default)               moe_ep_forward_waves (ep_waves.c)
 *   two-stage reference  --dispatch hierarchical     moe_ep_forward_hier (ep_hier.c)
 *                        --blocking
 *   two-stage            --dispatch hierarchical     moe_ep_hier_forward in waves of tokens
 *   low-latency          --mode low-latency          moe_ep_forward_ll (ep_ll.c)
 *   training step        --backward                  moe_ep_backward_step (ep_backward.c): the
 *                                                    reference forward, its backward in waves
 *                                                    (blocking with --blocking)
 *
 * moe_path_choose reads those flags once; moe_ep_init keeps the choice in
 * the EP object (ep->path), and every caller asks the path what it is and
 * runs it through its table, never the flags. A path owns the state it
 * keeps across forwards and frees it (moe_path_release).
 */
#ifndef MOE_PATH_H
#define MOE_PATH_H

#include <stdbool.h>

#include "moe/ep.h"

/* The buffers of one run of a path: the inputs (x (T, d), ids and weights
 * (T, k); a training step also logits (T, E) and dy (T, d)), the outputs
 * (y (T, d), the forward's stats; a training step's gradients and backward
 * stats) and the schedule a pipelined path follows (its waves, progress,
 * link model and trace; NULL: the config's), which the other paths do not
 * read. */
typedef struct {
    const moe_schedule *sched;
    const float *x, *logits, *dy;
    const int32_t *ids;
    const float *weights;
    float *y;
    moe_ep_grads *grads;
    moe_forward_stats *fwd;
    moe_backward_stats *bwd;
} moe_path_args;

typedef struct moe_path_s {
    const char *name;
    bool reference_run; /* a blocking reference (--blocking): each all-to-all waited for */
    bool pipelined;   /* waves under a schedule: a trace, a timeline, overlap */
    bool low_latency; /* one row per (token, expert) pair into fixed buffers, summed at home */
    bool training;    /* a forward and a backward: gradients */
    bool two_stage;   /* dispatch and combine in two hops, between nodes and within */
    bool linked;      /* posts its transfers under the emulated link model (--link) */
    /* One run: a forward, or a training step. Collective; MOE_EXIT_OK or an
     * exit code with st set, the same on every rank. */
    int (*run)(const moe_ep *ep, const moe_path_args *a, moe_status *st);
    /* The all-to-alls of the last run alone, seconds on this rank (the
     * pipelined forwards; NULL for the others and the training steps). */
    double (*time_alltoalls)(const moe_ep *ep, const moe_schedule *sched);
    /* The forward of the same dispatch in waves (itself for a pipelined
     * forward; the flat wave forward for the low-latency path and a
     * training step), and the blocking forward whose bits a run reproduces
     * (itself for a blocking forward; the reference for the low-latency
     * path and a training step). */
    const struct moe_path_s *waves, *blocking;
} moe_path;

/* One run of path p: p->run, then the layer output rounded to
 * --output-dtype (moe_ep_round_output) where the run succeeded. What every
 * caller runs a path through. */
int moe_path_run(const moe_path *p, const moe_ep *ep, const moe_path_args *a, moe_status *st);

/* The path cfg asks for (validated: moe_config_validate). */
const moe_path *moe_path_choose(const moe_config *cfg);

/* Free what every path keeps in work across runs. */
void moe_path_release(struct moe_ep_workspace *work);

#endif
