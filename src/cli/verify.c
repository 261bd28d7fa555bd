/* SPDX-License-Identifier: MIT */
/* verify.c — `moe-ep verify GOLDEN_DIR CANDIDATE.safetensors`: a port's
 * tensors against a golden set, stage by stage: the library's moe_ep_verify
 * (src/api/api.c, over src/io/verify.c). Rank 0 does the work; it needs no
 * mpirun. */
#include <stdbool.h>
#include <string.h>

#include "moe/cli.h"
#include "moe/golden.h"
#include "moe-ep/moe-ep.h"

static void print_usage(FILE *out)
{
    fprintf(out,
            "usage: moe-ep verify [--require STAGE,...|all] [--allow-unknown] [--] GOLDEN_DIR CANDIDATE.safetensors\n"
            "\n"
            "Compares every tensor of CANDIDATE whose name is in GOLDEN_DIR/manifest.json\n"
            "with the golden one under its contract (exact, abs + rel*|ref|, or top-k ids\n"
            "matched as a set per token, with near-ties), prints a table in pipeline order\n"
            "(ids and slots before values) and names the first stage that fails, with the\n"
            "first differing element (a token's top-k, an expert output's token and\n"
            "expert). Ids may be I64, I32, I16, U8 or BOOL, values F64, F32, BF16 or F16,\n"
            "and FP8 rows F8_E4M3 with their scales in NAME.scale (F32, UE8M0 exponent\n"
            "bytes U8, or DeepGEMM's packed I32). Elements one bf16 step from the golden\n"
            "are allowed, but not when they all go one way (truncation). A tensor whose\n"
            "shape follows from routing that already differs is shown as not compared.\n"
            "The table ends with the stages checked and those the candidate left out.\n"
            "\n"
            "  --require STAGE,...|all  fail (exit 1) when the candidate holds no tensor of\n"
            "                           a named stage (all: every stage of the set); stages:\n"
            "                           inputs router layout dispatch experts output backward\n"
            "  --allow-unknown          ignore candidate tensors the set does not name\n"
            "                           (default: refused, exit 2, with the nearest name)\n"
            "  --                       the arguments after it are paths, even those that\n"
            "                           begin with --\n"
            "\n"
            "Exit status: 0 all within contract, 1 some not (or a required stage missing),\n"
            "2 files that cannot be read or a name the set does not hold.\n");
}

/* The options, anywhere among the arguments before a "--", and the two paths. */
static int parse_options(int argc, char **argv, moe_ep_verify_options *opt, const char *path[2], moe_status *st)
{
    int paths = 0;
    bool options = true;
    for (int n = 0; n < argc; n++) {
        if (options && !strcmp(argv[n], "--")) {
            options = false;
        } else if (!options) {
            if (paths < 2)
                path[paths] = argv[n];
            paths++;
        } else if (!strcmp(argv[n], "--allow-unknown")) {
            opt->allow_unknown = 1;
        } else if (!strcmp(argv[n], "--require") || !strncmp(argv[n], "--require=", 10)) {
            const char *value = argv[n][9] == '=' ? argv[n] + 10 : n + 1 < argc ? argv[++n] : NULL;
            if (!value)
                return moe_fail(st, MOE_EXIT_USAGE, "--require needs stage names separated by commas, or all");
            if (moe_golden_parse_require(value, &opt->require, st))
                return st->code;
        } else if (!strncmp(argv[n], "--", 2)) {
            return moe_fail(st, MOE_EXIT_USAGE, "verify: unknown option '%s' (--require, --allow-unknown)",
                            argv[n]);
        } else if (paths < 2) {
            path[paths++] = argv[n];
        } else {
            paths++;
        }
    }
    if (paths != 2)
        return moe_fail(st, MOE_EXIT_USAGE, "verify needs GOLDEN_DIR and CANDIDATE.safetensors, got %d path%s",
                        paths, paths == 1 ? "" : "s");
    return MOE_EXIT_OK;
}

int moe_cli_verify(const moe_comm *c, int argc, char **argv)
{
    if (moe_cli_help(c, argc, argv, print_usage))
        return MOE_EXIT_OK;
    moe_status st = {0};
    moe_ep_verify_options opt = {0};
    const char *path[2] = {NULL, NULL};
    int rc = parse_options(argc, argv, &opt, path, &st);
    if (rc == MOE_EXIT_OK && c->rank == 0) { /* the library's verify (moe-ep.h), its table on stdout */
        moe_ep_verify_result r;
        rc = moe_ep_verify_with(path[0], path[1], &opt, stdout, &r);
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
