/* SPDX-License-Identifier: MIT */
/* api_test.c — the public API's bad input, as a caller would hand it in:
 * each case one call with one wrong argument, the code it must return and
 * a fragment its message must hold, the same message on every rank, and
 * nothing left on disk where a dump was refused; and a call with no MPI
 * that runs out of memory returns its error (in a scratch directory of
 * its own, removed at the end). Exit 0 when every case holds.
 */
#define _POSIX_C_SOURCE 200809L
#include <moe-ep/moe-ep.h>

#include <dirent.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static int rank, failed, cases;
static char work[64] = "/tmp/moe-ep-api.XXXXXX";

/* The message of the call just made holds `want` and reads the same on
 * every rank; rc is `code`. */
static void expect(const char *what, int rc, int code, const char *message, const char *want)
{
    char mine[512], zero[512];
    snprintf(mine, sizeof mine, "%s", message);
    memcpy(zero, mine, sizeof zero);
    MPI_Bcast(zero, sizeof zero, MPI_CHAR, 0, MPI_COMM_WORLD);
    int same = !strcmp(mine, zero), all_same;
    MPI_Allreduce(&same, &all_same, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
    const int ok = rc == code && strstr(mine, want) && all_same;
    cases++;
    if (!ok) {
        failed++;
        fprintf(stderr, "FAIL rank %d: %s: rc %d (want %d), message '%s' (want '%s')%s\n", rank,
                what, rc, code, mine, want, all_same ? "" : ", not the same on every rank");
    } else if (rank == 0)
        printf("ok: %s: %s\n", what, mine[0] ? mine : "(no message)");
}

/* The entries of the work directory besides those named. */
static int work_entries(void)
{
    DIR *d = opendir(work);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));)
        n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strcmp(e->d_name, "a-file");
    if (d)
        closedir(d);
    return n;
}

static moe_ep_config *tiny(void)
{
    moe_ep_config *c = moe_ep_config_new();
    moe_ep_config_set(c, "--preset", "tiny");
    return c;
}

/* A context refused for one flag set away from its default. */
static void refused_flag(const char *flag, const char *value, const char *want)
{
    moe_ep_config *c = tiny();
    moe_ep_context *ctx = NULL;
    const int rc = moe_ep_config_set(c, flag, value);
    char what[96];
    snprintf(what, sizeof what, "a context with %s %s", flag, value);
    expect(what, rc ? rc : moe_ep_context_new(c, MPI_COMM_WORLD, &ctx), MOE_EP_BAD_INPUT,
           moe_ep_config_error(c), want);
    moe_ep_context_free(ctx);
    moe_ep_config_free(c);
}

/* A call with no MPI that runs out of memory returns MOE_EP_RUNTIME with
 * the message, and the process goes on: the truth of 4 tokens whose
 * experts (d 1024, f 4096: 64 MiB a W1 in fp64) cannot be made under an
 * address-space limit 16 MiB above what the process holds. Every token
 * picks experts 0 and 1, so that the call that succeeds makes two experts,
 * not eight. Not under AddressSanitizer, whose shadow memory an
 * address-space limit breaks. */
static void out_of_memory(void)
{
#if defined(__SANITIZE_ADDRESS__)
    if (rank == 0)
        printf("skip: running out of memory (an AddressSanitizer build)\n");
#else
    moe_ep_config *big = moe_ep_config_new();
    moe_ep_config_set(big, "--preset", "tiny");
    moe_ep_config_set(big, "--hidden", "1024");
    moe_ep_config_set(big, "--ffn", "4096");
    moe_ep_config_set(big, "--tokens", "4");
    float x[4 * 1024] = {0};
    float w[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    int32_t ids[8] = {0, 1, 0, 1, 0, 1, 0, 1};
    double *y = malloc(sizeof(double) * 4 * 1024);
    struct rlimit was, low;
    long pages = 0;
    FILE *statm = fopen("/proc/self/statm", "r");
    const int measured = statm && fscanf(statm, "%ld", &pages) == 1;
    if (statm)
        fclose(statm);
    getrlimit(RLIMIT_AS, &was);
    low = was;
    low.rlim_cur = (rlim_t)pages * (rlim_t)sysconf(_SC_PAGESIZE) + (16u << 20);
    if (!measured || setrlimit(RLIMIT_AS, &low) != 0) {
        if (rank == 0)
            printf("skip: running out of memory (no address-space limit here)\n");
    } else {
        const int rc = moe_ep_truth(big, 1, x, ids, w, 4, y);
        setrlimit(RLIMIT_AS, &was);
        expect("the truth out of memory", rc, MOE_EP_RUNTIME, moe_ep_config_error(big), "cannot allocate");
        expect("the same config's next call, memory back", moe_ep_truth(big, 1, x, ids, w, 4, y),
               MOE_EP_OK, moe_ep_config_error(big), "");
    }
    free(y);
    moe_ep_config_free(big);
#endif
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0 && !mkdtemp(work)) {
        perror("api_test: mkdtemp");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    MPI_Bcast(work, sizeof work, MPI_CHAR, 0, MPI_COMM_WORLD);
    moe_ep_config *c = tiny();
    moe_ep_context *ctx = NULL;

    /* flags: a switch's value binds to it; huge rank counts are named */
    expect("--check maybe", moe_ep_config_set(c, "--check", "maybe"), MOE_EP_BAD_INPUT,
           moe_ep_config_error(c), "--check must be true or false, got 'maybe'");
    expect("an empty flag", moe_ep_config_set(c, "", "1"), MOE_EP_BAD_INPUT, moe_ep_config_error(c),
           "flag is empty");
    expect("2^30 ranks", moe_ep_config_validate(c, 1 << 30), MOE_EP_BAD_INPUT,
           moe_ep_config_error(c), "leave no room for one token");
    /* a default fitted to the input, as the context fits it */
    moe_ep_config *few = tiny();
    moe_ep_config_set(few, "--tokens", "3");
    expect("validate with 3 tokens and the default waves", moe_ep_config_validate(few, 2), MOE_EP_OK,
           moe_ep_config_error(few), "");
    moe_ep_config_free(few);

    /* the communicator */
    expect("MPI_COMM_NULL", moe_ep_context_new(c, MPI_COMM_NULL, &ctx), MOE_EP_BAD_INPUT,
           moe_ep_config_error(c), "comm is MPI_COMM_NULL");
    MPI_Comm a, inter;
    MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &a);
    MPI_Intercomm_create(a, 0, MPI_COMM_WORLD, rank % 2 ? 0 : 1, 7, &inter);
    expect("an inter-communicator", moe_ep_context_new(c, inter, &ctx), MOE_EP_BAD_INPUT,
           moe_ep_config_error(c), "inter-communicator");
    MPI_Comm_free(&inter);
    MPI_Comm_free(&a);

    /* ranks that disagree get one message naming the key */
    moe_ep_config *odd = tiny();
    if (rank == 1)
        moe_ep_config_set(odd, "--tokens", "5");
    expect("configs that differ by rank", moe_ep_context_new(odd, MPI_COMM_WORLD, &ctx),
           MOE_EP_BAD_INPUT, moe_ep_config_error(odd), "rank 0 has 'tokens=64', rank 1 has 'tokens=5'");
    moe_ep_config_free(odd);

    /* flags only `moe-ep run` acts on: one rule */
    refused_flag("--steps", "3", "--steps is moe-ep run's");
    refused_flag("--capacity-factor", "1.0", "--capacity-factor is moe-ep run's");
    refused_flag("--iters", "5", "--iters is moe-ep run's");
    refused_flag("--check", "true", "--check is moe-ep run's");
    refused_flag("--compare-serial", "true", "--compare-serial is moe-ep run's");
    refused_flag("--redundant-experts", "2", "--redundant-experts is moe-ep run's");

    /* the context the preset makes (its --iters is not the caller's) */
    if (moe_ep_context_new(c, MPI_COMM_WORLD, &ctx) != MOE_EP_OK) {
        fprintf(stderr, "FAIL: the tiny context: %s\n", moe_ep_config_error(c));
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    const moe_ep_shape s = moe_ep_config_shape(c);
    float *x = calloc((size_t)(s.tokens * s.hidden), sizeof(float));
    float *y = calloc((size_t)(s.tokens * s.hidden), sizeof(float));
    float *w = calloc((size_t)(s.tokens * s.topk), sizeof(float));
    int32_t *ids = calloc((size_t)(s.tokens * s.topk), sizeof(int32_t));
    double *t = calloc((size_t)(s.tokens * s.hidden), sizeof(double));
    moe_ep_config_tokens(c, rank, x);
    moe_ep_context_route(ctx, x, ids, w);

    /* non-finite tokens, on one rank, everywhere they enter */
    if (rank == 1)
        x[5] = NAN;
    expect("forward with a NaN token value on rank 1", moe_ep_context_forward(ctx, x, ids, w, y),
           MOE_EP_BAD_INPUT, moe_ep_context_error(ctx), "rank 1: x[0][5] is not finite");
    x[5] = INFINITY;
    expect("route with an infinite token value", moe_ep_config_route(c, x, s.tokens, NULL, ids, w),
           MOE_EP_BAD_INPUT, moe_ep_config_error(c), "x[0][5] is not finite");
    expect("the truth of an infinite token value", moe_ep_truth(c, 2, x, ids, w, s.tokens, t),
           MOE_EP_BAD_INPUT, moe_ep_config_error(c), "x[0][5] is not finite");
    moe_ep_config_tokens(c, rank, x);
#ifdef _OPENMP
    /* a context's call runs on the rank's share of the host's cores and
     * gives the caller's OpenMP threads back */
    omp_set_num_threads(7);
    expect("a forward", moe_ep_context_forward(ctx, x, ids, w, y), MOE_EP_OK,
           moe_ep_context_error(ctx), "");
    expect("the caller's OpenMP threads after it", omp_get_max_threads(), 7, "", "");
#endif

    /* a dump refused before it runs, nothing left behind */
    char path[4096];
    snprintf(path, sizeof path, "%s/a-file", work);
    if (rank == 0) {
        FILE *f = fopen(path, "w");
        fputs("keep me\n", f);
        fclose(f);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    expect("a dump onto a file", moe_ep_context_dump(ctx, x, path, NULL), MOE_EP_BAD_INPUT,
           moe_ep_context_error(ctx), "exists and is not a directory");
    expect("a dump into ''", moe_ep_context_dump(ctx, x, "", NULL), MOE_EP_BAD_INPUT,
           moe_ep_context_error(ctx), "needs a directory name");
    snprintf(path, sizeof path, "%s/no/such/set", work);
    expect("a dump under a missing directory", moe_ep_context_dump(ctx, x, path, NULL),
           MOE_EP_BAD_INPUT, moe_ep_context_error(ctx), "does not exist");
    int left = rank == 0 ? work_entries() : 0;
    MPI_Bcast(&left, 1, MPI_INT, 0, MPI_COMM_WORLD);
    expect("nothing left by the refused dumps", left, 0, "", "");

    /* verify's options and its message for what is missing */
    snprintf(path, sizeof path, "%s/set", work);
    moe_ep_verify_result r;
    if (moe_ep_context_dump(ctx, x, path, NULL) != MOE_EP_OK) {
        fprintf(stderr, "FAIL: the dump: %s\n", moe_ep_context_error(ctx));
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    {
        char output[4200];
        snprintf(output, sizeof output, "%s/output.safetensors", path);
        const moe_ep_verify_options past = {1u << 20, 0}, all = {~0u, 0};
        expect("verify with a require bit past the stages",
               moe_ep_verify_with(path, output, &past, NULL, &r), MOE_EP_BAD_INPUT, r.message,
               "has bits past the last stage");
        expect("verify requiring every stage of an output-only candidate",
               moe_ep_verify_with(path, output, &all, NULL, &r), MOE_EP_FAIL, r.message,
               "holds no tensor of: inputs router layout dispatch experts");
    }

    /* the training step's calls on the wrong context or arguments */
    const moe_ep_gradients g = {.dx = y};
    const moe_ep_truth_gradients tg = {.dx = t};
    expect("backward on a forward context", moe_ep_context_backward(ctx, x, y, NULL, NULL, NULL, &g),
           MOE_EP_BAD_INPUT, moe_ep_context_error(ctx), "needs a context made with --backward true");
    expect("the backward truth without --backward", moe_ep_truth_backward(c, x, y, s.tokens, &tg),
           MOE_EP_BAD_INPUT, moe_ep_config_error(c), "needs --backward true");
    expect("a dump_backward on a forward context",
           moe_ep_context_dump_backward(ctx, x, y, path, NULL), MOE_EP_BAD_INPUT,
           moe_ep_context_error(ctx), "call moe_ep_context_dump");
    moe_ep_config *train = tiny();
    moe_ep_context *step = NULL;
    moe_ep_config_set(train, "--backward", "true");
    if (moe_ep_context_new(train, MPI_COMM_WORLD, &step) != MOE_EP_OK) {
        fprintf(stderr, "FAIL: the tiny training context: %s\n", moe_ep_config_error(train));
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    expect("backward with dy NULL", moe_ep_context_backward(step, x, NULL, NULL, NULL, NULL, &g),
           MOE_EP_BAD_INPUT, moe_ep_context_error(step), "dy is NULL");
    if (rank == 1)
        y[3] = NAN;
    expect("backward with a NaN dy on rank 1", moe_ep_context_backward(step, x, y, NULL, NULL, NULL, &g),
           MOE_EP_BAD_INPUT, moe_ep_context_error(step), "rank 1: dy[0][3] is not finite");
    expect("the backward truth of 0 tokens", moe_ep_truth_backward(train, x, y, 0, &tg),
           MOE_EP_BAD_INPUT, moe_ep_config_error(train), "tokens must be at least 1, got 0");
    expect("the backward check with ranks that do not divide the tokens",
           moe_ep_check_backward(train, 3, x, y, s.tokens, &g, NULL), MOE_EP_BAD_INPUT,
           moe_ep_config_error(train), "ranks must be at least 1 and divide tokens");
    expect("a dump on a training context", moe_ep_context_dump(step, x, path, NULL),
           MOE_EP_BAD_INPUT, moe_ep_context_error(step), "call moe_ep_context_dump_backward");
    moe_ep_context_free(step);
    moe_ep_config_free(train);

    out_of_memory();

    moe_ep_context_free(ctx);
    moe_ep_config_free(c);
    free(t);
    free(ids);
    free(w);
    free(y);
    free(x);
    MPI_Barrier(MPI_COMM_WORLD);
    char rm[128];
    snprintf(rm, sizeof rm, "rm -rf '%s'", work);
    if (rank == 0 && system(rm) != 0)
        fprintf(stderr, "api_test: could not remove %s\n", work);
    int total = 0;
    MPI_Allreduce(&failed, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0)
        printf("api_test: %d cases, %d failed\n", cases, total);
    MPI_Finalize();
    return total != 0;
}
