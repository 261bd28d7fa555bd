/* SPDX-License-Identifier: MIT */
/* cli.h — the subcommands of the moe-ep binary. Each takes the arguments after
 * its name and returns the exit code, the same on every rank. */
#ifndef MOE_CLI_H
#define MOE_CLI_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "moe/comm.h"

/* --help or -h among the arguments: rank 0 prints usage; returns true. */
bool moe_cli_help(const moe_comm *c, int argc, char **argv, void (*usage)(FILE *out));

int moe_cli_run(const moe_comm *c, int argc, char **argv);
int moe_cli_plan(const moe_comm *c, int argc, char **argv);
int moe_cli_verify(const moe_comm *c, int argc, char **argv);
int moe_cli_bench(const moe_comm *c, int argc, char **argv);
int moe_cli_explain(const moe_comm *c, int argc, char **argv);

struct moe_ep_s;
/* --steps: the trajectory a set holds beside the last batch's tensors. */
typedef struct {
    int steps;
    const float *bias;  /* (steps, E) after each step's update */
    const double *load; /* (steps, E) pairs per expert in each step, over all ranks */
} moe_dump_steps;

/* run --dump: the golden set of this run into cfg->dump, from this rank's
 * tokens x (T, d), which it routes again, and with --backward its upstream
 * gradient dy (T, d) (NULL without); steps (NULL without --steps) adds the
 * bias trajectory. Everything it dumps is computed with BLAS forbidden
 * (moe_gemm_forbid_blas), so the set is the same bytes on every machine.
 * *bytes receives the set's size on rank 0. Collective. */
int moe_cli_dump(const moe_comm *c, const struct moe_ep_s *ep, const float *x, const float *dy,
                 const moe_dump_steps *steps, double *bytes, moe_status *st);

#endif
