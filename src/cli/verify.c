/* SPDX-License-Identifier: MIT */
/* verify.c — `moe-ep verify GOLDEN_DIR CANDIDATE.safetensors`: a port's
 * tensors against a golden set, stage by stage: the library's moe_ep_verify
 * (src/api/api.c, over src/io/verify.c). Rank 0 does the work; it needs no
 * mpirun. */
#include <string.h>

#include "moe/cli.h"
#include "moe-ep/moe-ep.h"

static void print_usage(FILE *out)
{
    fprintf(out,
            "usage: moe-ep verify GOLDEN_DIR CANDIDATE.safetensors\n"
            "\n"
            "Compares every tensor of CANDIDATE whose name is in GOLDEN_DIR/manifest.json\n"
            "with the golden one under its contract (exact, abs + rel*|ref|, or top-k ids\n"
            "with near-ties), prints a table in pipeline order and names the first stage\n"
            "that fails, with the first differing element (a token's top-k, an expert\n"
            "output's token and expert). Ids may be I64, I32, I16, U8 or BOOL, values F64,\n"
            "F32, BF16 or F16, and FP8 rows F8_E4M3 with their scales in NAME.scale. A\n"
            "tensor whose shape follows from routing that already differs is shown as not\n"
            "compared.\n"
            "Exit status: 0 all within contract, 1 some not, 2 files that cannot be read.\n");
}

int moe_cli_verify(const moe_comm *c, int argc, char **argv)
{
    if (moe_cli_help(c, argc, argv, print_usage))
        return MOE_EXIT_OK;
    moe_status st = {0};
    int rc = MOE_EXIT_OK;
    if (argc != 2)
        rc = moe_fail(&st, MOE_EXIT_USAGE, "verify needs GOLDEN_DIR and CANDIDATE.safetensors, got %d argument%s",
                      argc, argc == 1 ? "" : "s");
    else if (c->rank == 0) { /* the library's verify (moe-ep.h), its table on stdout */
        moe_ep_verify_result r;
        rc = moe_ep_verify(argv[0], argv[1], stdout, &r);
        if (rc != MOE_EXIT_OK && rc != MOE_EXIT_CHECK_FAILED)
            moe_fail(&st, rc, "%s", r.message);
    }
    fflush(stdout);
    /* every rank leaves with rank 0's verdict */
    moe_status shared = {0};
    if (rc == MOE_EXIT_USAGE)
        shared = st;
    if (moe_comm_agree(c, &shared) == MOE_EXIT_USAGE) {
        moe_comm_print_error(c, &shared);
        return MOE_EXIT_USAGE;
    }
    moe_status verdict = {.code = rc == MOE_EXIT_CHECK_FAILED ? MOE_EXIT_CHECK_FAILED : MOE_EXIT_OK};
    return moe_comm_agree(c, &verdict);
}
