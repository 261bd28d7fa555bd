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

/* run, bench and explain start MPI once their arguments are valid
 * (moe_context_open); plan and verify never communicate. */
int moe_cli_run(moe_comm *c, int argc, char **argv);
int moe_cli_plan(const moe_comm *c, int argc, char **argv);
int moe_cli_verify(const moe_comm *c, int argc, char **argv);
int moe_cli_bench(moe_comm *c, int argc, char **argv);
int moe_cli_explain(moe_comm *c, int argc, char **argv);
/* bench's anchor sgemm in a process of its own (moe-ep sgemm-anchor M N K). */
int moe_cli_sgemm_anchor(int argc, char **argv);

#endif
