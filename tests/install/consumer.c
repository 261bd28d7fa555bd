/* SPDX-License-Identifier: MIT */
/* consumer.c — a program outside the tree that uses the installed library
 * as a test suite would: build a config from flags, run the layer on
 * MPI_COMM_WORLD with its own routing (each token's top-k by a rule of its
 * own, not the library's router), check the output against the library's
 * truth (and that a wrong value fails it), check that a bad argument
 * comes back as an error naming it, and take a training step whose
 * gradients are checked against the library's fp64 truth.
 * Prints one line per rank; exit 0 when every check passes.
 */
#include <moe-ep/moe-ep.h>

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static int fail(int rank, const char *what, const char *message)
{
    fprintf(stderr, "consumer rank %d: %s: %s\n", rank, what, message);
    return 1;
}

/* A training step through the layer on every rank (--backward), its
 * gradients gathered whole and checked against the library's fp64 truth;
 * then one gradient made wrong must fail. dy is a rule of the caller's. */
static int training_step(moe_ep_config *c, int rank, int ranks, const float *x)
{
    moe_ep_config_set(c, "--backward", "true");
    moe_ep_context *ctx = NULL;
    if (moe_ep_context_new(c, MPI_COMM_WORLD, &ctx))
        return fail(rank, "backward context", moe_ep_config_error(c));
    const moe_ep_shape s = moe_ep_config_shape(c);
    const int64_t T = s.tokens, d = s.hidden, f = s.ffn, E = s.experts, S = s.shared_experts;
    const int64_t N = T * ranks, EL = E / ranks;
    float *dy = malloc(sizeof(float) * (size_t)(T * d));
    for (int64_t m = 0; m < T * d; m++) /* the caller's upstream gradient */
        dy[m] = (float)(((rank * T * d + m) * 37 % 101) - 50) / 64.0f;
    float *mine = malloc(sizeof(float) * (size_t)(T * d + EL * 3 * f * d));
    moe_ep_gradients g = {.dx = mine, .dw1 = mine + T * d, .dw2 = mine + T * d + EL * 2 * f * d,
                          .dshared_w1 = malloc(sizeof(float) * (size_t)(S * 2 * f * d)),
                          .dshared_w2 = malloc(sizeof(float) * (size_t)(S * d * f)),
                          .dgate = malloc(sizeof(float) * (size_t)(E * d))};
    int bad = 0;
    if (moe_ep_context_backward(ctx, x, dy, NULL, NULL, NULL, &g))
        bad = fail(rank, "backward", moe_ep_context_error(ctx));
    /* the whole layer's: every rank's tokens and experts, in rank order */
    float *all_x = malloc(sizeof(float) * (size_t)(N * d)), *all_dy = malloc(sizeof(float) * (size_t)(N * d));
    moe_ep_gradients all = {.dx = malloc(sizeof(float) * (size_t)(N * d)),
                            .dw1 = malloc(sizeof(float) * (size_t)(E * 2 * f * d)),
                            .dw2 = malloc(sizeof(float) * (size_t)(E * d * f)),
                            .dshared_w1 = g.dshared_w1, .dshared_w2 = g.dshared_w2, .dgate = g.dgate};
    MPI_Allgather(x, (int)(T * d), MPI_FLOAT, all_x, (int)(T * d), MPI_FLOAT, MPI_COMM_WORLD);
    MPI_Allgather(dy, (int)(T * d), MPI_FLOAT, all_dy, (int)(T * d), MPI_FLOAT, MPI_COMM_WORLD);
    MPI_Allgather(g.dx, (int)(T * d), MPI_FLOAT, all.dx, (int)(T * d), MPI_FLOAT, MPI_COMM_WORLD);
    MPI_Allgather(g.dw1, (int)(EL * 2 * f * d), MPI_FLOAT, all.dw1, (int)(EL * 2 * f * d), MPI_FLOAT, MPI_COMM_WORLD);
    MPI_Allgather(g.dw2, (int)(EL * d * f), MPI_FLOAT, all.dw2, (int)(EL * d * f), MPI_FLOAT, MPI_COMM_WORLD);
    double used = 0.0;
    if (!bad && rank == 0 && moe_ep_check_backward(c, ranks, all_x, all_dy, N, &all, &used))
        bad = fail(rank, "backward check", moe_ep_config_error(c));
    else if (!bad && rank == 0)
        printf("consumer: a training step's gradients (dx, dW1, dW2, shared, gate) within the "
               "truth's tolerance (%.1f %% of it used)\n", 100.0 * used);
    all.dw2[7] += 0.01f * (1.0f + (all.dw2[7] < 0 ? -all.dw2[7] : all.dw2[7]));
    if (!bad && rank == 0 && moe_ep_check_backward(c, ranks, all_x, all_dy, N, &all, NULL) != MOE_EP_FAIL)
        bad = fail(rank, "backward check", "a wrong dw2[0] passed");
    else if (!bad && rank == 0)
        printf("consumer: a wrong gradient is caught: %s\n", moe_ep_config_error(c));
    MPI_Bcast(&bad, 1, MPI_INT, 0, MPI_COMM_WORLD);
    free(all.dw2);
    free(all.dw1);
    free(all.dx);
    free(all_dy);
    free(all_x);
    free(g.dgate);
    free(g.dshared_w2);
    free(g.dshared_w1);
    free(mine);
    free(dy);
    moe_ep_context_free(ctx);
    return bad;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, ranks, bad = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    if (moe_ep_api_version() != MOE_EP_API_VERSION)
        return fail(rank, "version", "the library is not the header's");
    moe_ep_config *c = moe_ep_config_new();
    const char *flags[][2] = {{"--preset", "tiny"}, {"--tokens", "24"}, {"--shared-experts", "1"}};
    for (int n = 0; n < 3 && !bad; n++)
        if (moe_ep_config_set(c, flags[n][0], flags[n][1]))
            bad = fail(rank, flags[n][0], moe_ep_config_error(c));
    moe_ep_context *ctx = NULL;
    if (!bad && moe_ep_context_new(c, MPI_COMM_WORLD, &ctx))
        bad = fail(rank, "context", moe_ep_config_error(c));
    if (bad) {
        MPI_Finalize();
        return 1;
    }
    const moe_ep_shape s = moe_ep_config_shape(c);
    float *x = malloc(sizeof(float) * (size_t)(s.tokens * s.hidden));
    float *y = malloc(sizeof(float) * (size_t)(s.tokens * s.hidden));
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(s.tokens * s.topk));
    float *weights = malloc(sizeof(float) * (size_t)(s.tokens * s.topk));
    moe_ep_config_tokens(c, rank, x);
    for (int64_t i = 0; i < s.tokens; i++) /* the caller's routing: experts g, g+1, ... */
        for (int64_t j = 0; j < s.topk; j++) {
            ids[i * s.topk + j] = (int32_t)((rank * s.tokens + i + j) % s.experts);
            weights[i * s.topk + j] = 1.0f / (float)(j + 2);
        }
    double used = 0.0;
    if (moe_ep_context_forward(ctx, x, ids, weights, y))
        bad = fail(rank, "forward", moe_ep_context_error(ctx));
    else if (moe_ep_check(c, ranks, x, ids, weights, s.tokens, y, &used))
        bad = fail(rank, "check", moe_ep_config_error(c));
    y[0] += 0.01f * (1.0f + (y[0] < 0 ? -y[0] : y[0])); /* a wrong value must be caught */
    if (!bad && moe_ep_check(c, ranks, x, ids, weights, s.tokens, y, NULL) != MOE_EP_FAIL)
        bad = fail(rank, "check", "a wrong y[0][0] passed");
    else if (!bad && rank == 0)
        printf("consumer: a wrong value is caught: %s\n", moe_ep_config_error(c));
    ids[0] = (int32_t)s.experts; /* out of range, on every rank */
    if (moe_ep_context_forward(ctx, x, ids, weights, y) != MOE_EP_BAD_INPUT)
        bad = fail(rank, "bad ids", "accepted");
    else if (rank == 0)
        printf("consumer: a bad id is refused: %s\n", moe_ep_context_error(ctx));
    /* the golden set of the router's forward, and verify of its own output
     * (argv[1]: a directory that does not exist yet) */
    moe_ep_verify_result r;
    char output[4096];
    snprintf(output, sizeof output, "%s/output.safetensors", argc > 1 ? argv[1] : ".");
    if (!bad && moe_ep_context_route(ctx, x, ids, weights))
        bad = fail(rank, "route", moe_ep_context_error(ctx));
    else if (!bad && argc > 1 && moe_ep_context_dump(ctx, x, argv[1], NULL))
        bad = fail(rank, "dump", moe_ep_context_error(ctx));
    else if (!bad && argc > 1 && rank == 0 && moe_ep_verify_with(argv[1], output, NULL, NULL, &r) != MOE_EP_OK)
        bad = fail(rank, "verify", r.message);
    else if (!bad && argc > 1 && rank == 0)
        printf("consumer: moe_ep_context_dump wrote %s; its own output verifies (%d tensors)\n", argv[1], r.compared);
    if (!bad)
        bad = training_step(c, rank, ranks, x);
    if (!bad)
        printf("consumer rank %d: %lld tokens through the layer on %d ranks, within the truth's "
               "tolerance (%.1f %% of it used)\n", rank, (long long)s.tokens, ranks, 100.0 * used);
    moe_ep_context_free(ctx);
    moe_ep_config_free(c);
    free(weights);
    free(ids);
    free(y);
    free(x);
    MPI_Finalize();
    return bad;
}
