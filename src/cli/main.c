/* SPDX-License-Identifier: MIT */
/* main.c — the moe-ep binary: MPI start-up and the subcommand dispatch.
 *
 * Every rank parses the same arguments, so usage errors are decided alike on
 * all of them; rank 0 alone prints. The exit status is the verdict, the same
 * on every rank.
 */
#include <limits.h>
#include <stdio.h>
#include <string.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "config.h"
#include "moe/cli.h"
#include "moe/comm.h"

static void print_usage(FILE *out)
{
    fprintf(out,
            "moe-ep %s — MoE expert parallelism on MPI ranks, checked against a dense truth\n"
            "\n"
            "usage: mpirun -np G moe-ep COMMAND [flags]\n"
            "\n"
            "commands:\n"
            "  run        the EP forward: route, dispatch, experts, combine (--help for flags)\n"
            "  plan       the arithmetic of EP for a model on a cluster (--help for flags)\n"
            "  verify     a GPU port's tensors against a golden set (run --dump makes one)\n"
            "  bench      the wave pipeline at each W against in-run anchors (--help for flags)\n"
            "  explain    follow tokens through the layer, stage by stage (--token N)\n"
            "\n"
            "  moe-ep --version | --help\n"
            "Exit status: 0 ok, 1 check failed, 2 bad flag or config, 3 runtime error.\n",
            PACKAGE_VERSION);
}

bool moe_cli_help(const moe_comm *c, int argc, char **argv, void (*usage)(FILE *out))
{
    for (int n = 0; n < argc; n++)
        if (!strcmp(argv[n], "--help") || !strcmp(argv[n], "-h")) {
            if (c->rank == 0)
                usage(stdout);
            return true;
        }
    return false;
}

/* Large buffers come from the heap and stay there when freed. A training
 * step allocates and frees its buffers every step; glibc maps each block
 * above its mmap threshold on its own and unmaps it on free, so every page
 * was faulted in again each step: on the laptop preset 28,000 faults a
 * step, a third of its time in the kernel. No mappings (M_MMAP_MAX 0; glibc
 * refuses an M_MMAP_THRESHOLD above 32 MiB, and the step's largest buffers
 * are bigger) and no trimming: the next step reuses the pages the last one
 * freed, and the peak resident size does not change. */
static void keep_freed_memory(void)
{
#ifdef __GLIBC__
    mallopt(M_MMAP_MAX, 0);
    mallopt(M_TRIM_THRESHOLD, INT_MAX);
#endif
}

int main(int argc, char **argv)
{
    keep_freed_memory();
    if (argc > 1 && !strcmp(argv[1], "sgemm-anchor")) /* bench's child: no MPI */
        return moe_cli_sgemm_anchor(argc, argv);
    moe_comm c;
    moe_comm_init_deferred(&argc, &argv, &c);
    int rc;
    const char *command = argc > 1 ? argv[1] : "";
    if (!strcmp(command, "run")) {
        rc = moe_cli_run(&c, argc - 2, argv + 2);
    } else if (!strcmp(command, "plan")) {
        rc = moe_cli_plan(&c, argc - 2, argv + 2);
    } else if (!strcmp(command, "bench")) {
        rc = moe_cli_bench(&c, argc - 2, argv + 2);
    } else if (!strcmp(command, "explain")) {
        rc = moe_cli_explain(&c, argc - 2, argv + 2);
    } else if (!strcmp(command, "verify")) {
        rc = moe_cli_verify(&c, argc - 2, argv + 2);
    } else if (!strcmp(command, "--help") || !strcmp(command, "-h")) {
        if (c.rank == 0)
            print_usage(stdout);
        rc = MOE_EXIT_OK;
    } else if (!strcmp(command, "--version")) {
        if (c.rank == 0)
            printf("moe-ep %s\n", PACKAGE_VERSION);
        rc = MOE_EXIT_OK;
    } else {
        moe_status st = {0};
        if (!*command)
            moe_fail(&st, MOE_EXIT_USAGE, "missing command (try: moe-ep run --preset tiny)");
        else
            moe_fail(&st, MOE_EXIT_USAGE, "unknown command '%s' (commands: run, plan, verify, bench, explain; see moe-ep --help)",
                     command);
        moe_comm_print_error(&c, &st);
        rc = st.code;
    }
    moe_comm_finalize();
    return rc;
}
