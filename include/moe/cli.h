/* cli.h — the subcommands of the moe-ep binary. Each takes the arguments after
 * its name and returns the exit code, the same on every rank. */
#ifndef MOE_CLI_H
#define MOE_CLI_H

#include "moe/comm.h"

int moe_cli_run(const moe_comm *c, int argc, char **argv);
int moe_cli_plan(const moe_comm *c, int argc, char **argv);

#endif
