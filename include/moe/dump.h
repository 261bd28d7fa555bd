/* SPDX-License-Identifier: MIT */
/* dump.h — the golden set of a forward (`moe-ep run --dump DIR`, and the
 * library's moe_ep_context_dump): its tensors after every stage, written by
 * rank 0 (src/io/golden.c) while each rank's share streams to it. */
#ifndef MOE_DUMP_H
#define MOE_DUMP_H

#include "moe/comm.h"
#include "moe/common.h"
#include "moe/ep.h"

/* --steps: the trajectory a set holds beside the last batch's tensors. */
typedef struct {
    int steps;
    const float *bias;  /* (steps, E) after each step's update */
    const double *load; /* (steps, E) pairs per expert in each step, over all ranks */
} moe_dump_steps;

/* The golden set of this forward into dir, from this rank's tokens x (T,
 * d), which it routes again, and with --backward its upstream gradient dy
 * (T, d) (NULL without); steps (NULL without --steps) adds the bias
 * trajectory. Everything it dumps is computed with BLAS forbidden
 * (moe_gemm_forbid_blas), so the set is the same bytes on every machine.
 * *bytes receives the set's size on rank 0. Collective. */
int moe_dump_write(const moe_comm *c, const moe_ep *ep, const char *dir, const float *x, const float *dy,
                   const moe_dump_steps *steps, double *bytes, moe_status *st);

#endif
