/* SPDX-License-Identifier: MIT */
/* ep_backward_test.c — the EP backward on G ranks against itself run again
 * and against the same layer on one rank.
 *
 * Run under mpirun by tests/mpi/mpi-case. Takes `moe-ep run` flags (with
 * --blocking --backward) plus
 *   --np1 bitwise|tolerance   how this rank's dx must match the one-rank dx
 * and checks, on every rank:
 *   0. the bytes posted to MPI for other ranks in a step are those its
 *      figures report (forward and backward);
 *   1. a second step gives the same bits (every gradient tensor), and so
 *      does the backward with its all-to-alls in flight (moe_ep_backward_step,
 *      poll and thread progress), in 1 wave and, with packed or exact
 *      GEMMs, in 2, 3 and T+1 waves, their data gradients wave by wave
 *      and in one pass; so do the pairs of micro-batches
 *      (moe_ep_pair_step: serial, waves, DualPipe's pairing), whose
 *      forward output is also the blocking forward's;
 *   2. dx of this rank's tokens against every rank's computing the whole
 *      layer (G*T tokens) alone on MPI_COMM_SELF: bitwise with --np1
 *      bitwise (--combine pairs: the home rank sums per pair in slot order,
 *      whatever ranks hold the experts), else within the truth's tolerance
 *      (--combine reduced sums per rank first);
 *   3. the routed experts' dW1 and dW2 against the one-rank ones: bitwise
 *      with --gemm packed or exact, at any G and either combine (an
 *      expert's rows reach its wgrad in global token order);
 *   4. the replicated weights' gradients (shared experts, gate): the same
 *      on every rank, and within tolerance of the one-rank ones (per-rank
 *      sums added in rank order: not bitwise across G; the gate's are
 *      summed in fp64, within 1e-6).
 * Exit 0 when every check holds, 1 otherwise.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/ep.h"
#include "moe/progress.h"
#include "moe/wire.h"

/* One training step of cfg on c: the rank's tokens routed, the synthetic
 * dy, moe_ep_backward_ref into g (allocated here). */
static double remote_reported; /* the last step's bytes to other ranks, as its stats say */

/* pair -1: moe_ep_backward_step; else moe_ep_pair_step in that mode. The
 * layer's output (B's, for a pair) into y_out when not NULL. */
static int pair_step(const moe_comm *c, const moe_config *cfg, moe_ep *ep,
                     const moe_schedule *sched, int pair, moe_ep_grads *g, float *y_out)
{
    const moe_index T = cfg->tokens, d = cfg->hidden, E = cfg->experts, k = cfg->topk;
    moe_status st = {0};
    float *x = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    float *dy = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    float *y = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    float *logits = moe_xmalloc(sizeof(float) * (size_t)(T * E));
    float *scores = moe_xmalloc(sizeof(float) * (size_t)(T * E));
    int32_t *ids = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k));
    float *weights = moe_xmalloc(sizeof(float) * (size_t)(T * k));
    moe_ep_generate_tokens(ep, x);
    moe_ep_generate_grad_output(ep, dy);
    moe_ep_route(ep, x, logits, scores, ids, weights);
    moe_forward_stats fwd;
    moe_backward_stats bwd;
    moe_ep_grads_init(ep, g);
    double seconds;
    const int rc = pair < 0 ? moe_ep_backward_step(ep, sched, x, logits, ids, weights, dy, y, g,
                                                   &fwd, &bwd, &st)
                            : moe_ep_pair_step(ep, sched, (enum moe_pair_mode)pair, x, logits, ids,
                                               weights, dy, y, g, &fwd, &bwd, &seconds, &st);
    if (y_out)
        memcpy(y_out, y, sizeof(float) * (size_t)(T * d));
    if (rc)
        fprintf(stderr, "ep_backward_test: %s\n", st.message);
    remote_reported = (double)fwd.rows_sent_remote * moe_dispatch_row_bytes(cfg) +
                      (double)fwd.pairs_back_remote * moe_combine_row_bytes(cfg) + bwd.bytes_remote;
    free(weights);
    free(ids);
    free(scores);
    free(logits);
    free(y);
    free(dy);
    free(x);
    return rc;
}

static int step(const moe_comm *c, const moe_config *cfg, moe_ep *ep, const moe_schedule *sched,
                moe_ep_grads *g)
{
    return pair_step(c, cfg, ep, sched, -1, g, NULL);
}

/* Compare n values; bitwise, or within rel of rms(want) + |want|. */
static int compare(const char *what, int rank, const float *got, const float *want, moe_index n,
                   bool bitwise, double rel)
{
    double squares = 0.0, worst = 0.0;
    moe_index differ = 0;
    for (moe_index m = 0; m < n; m++)
        squares += (double)want[m] * want[m];
    const double rms = n > 0 ? sqrt(squares / (double)n) : 0.0;
    for (moe_index m = 0; m < n; m++) {
        differ += memcmp(&got[m], &want[m], sizeof(float)) != 0;
        const double diff = fabs((double)got[m] - want[m]);
        const double used = diff / (rel * (rms + fabs(want[m])));
        worst = used > worst || diff != diff ? used : worst;
    }
    const bool ok = bitwise ? differ == 0 : worst <= 1.0;
    if (!ok || rank == 0)
        printf("rank %d %-30s %s (%lld of %lld differ%s; worst %.1f%% of %.0e relative)\n", rank,
               what, ok ? "ok" : "FAIL", (long long)differ, (long long)n,
               bitwise ? ", bitwise expected" : "", 100.0 * worst, rel);
    return !ok;
}

/* Every gradient tensor of got has the bits of want's. */
static int same_bits(const char *when, int rank, const moe_ep *ep, const moe_ep_grads *got,
                     const moe_ep_grads *want)
{
    static const char *const names[MOE_EP_GRAD_TENSORS] = {
        "dx", "routed dW1", "routed dW2", "shared dW1", "shared dW2", "gate dW_g"};
    const float *a[MOE_EP_GRAD_TENSORS], *b[MOE_EP_GRAD_TENSORS];
    moe_index n[MOE_EP_GRAD_TENSORS];
    moe_ep_grads_tensors(ep, got, a, n);
    moe_ep_grads_tensors(ep, want, b, n);
    int failures = 0;
    for (int t = 0; t < MOE_EP_GRAD_TENSORS; t++) {
        char what[112];
        snprintf(what, sizeof what, "%s, %s", names[t], when);
        failures += compare(what, rank, a[t], b[t], n[t], true, 0.0);
    }
    return failures;
}

int main(int argc, char **argv)
{
    moe_comm world;
    moe_comm_init(&argc, &argv, &world);
    bool np1_bitwise = true;
    char **rest = malloc(sizeof(char *) * (size_t)argc);
    int n_rest = 0, failures = 0;
    for (int n = 1; n < argc; n++) {
        if (!strcmp(argv[n], "--np1") && n + 1 < argc)
            np1_bitwise = !strcmp(argv[++n], "bitwise");
        else
            rest[n_rest++] = argv[n];
    }
    moe_config cfg;
    moe_status st = {0};
    moe_config_defaults(&cfg);
    if (moe_config_parse(&cfg, MOE_CMD_RUN, n_rest, rest, &st) ||
        moe_config_validate(&cfg, world.ranks, &st)) {
        if (world.rank == 0)
            fprintf(stderr, "ep_backward_test: %s\n", st.message);
        moe_comm_finalize();
        return 2;
    }
    const int G = world.ranks, r = world.rank;
    const moe_index T = cfg.tokens, d = cfg.hidden, f = cfg.ffn, E = cfg.experts;
    const moe_index S = cfg.shared_experts;
    const bool rows_independent = cfg.gemm != MOE_GEMM_BLAS;
    moe_ep ep;
    if (moe_ep_init(&ep, &cfg, &world, &st)) {
        fprintf(stderr, "ep_backward_test: %s\n", st.message);
        return 1;
    }
    moe_ep_grads g, again;
    const double posted_before = moe_comm_posted_bytes();
    failures += step(&world, &cfg, &ep, NULL, &g) != 0;
    { /* the bytes MPI was asked to move to other ranks are the ones reported */
        const double posted = moe_comm_sum(&world, moe_comm_posted_bytes() - posted_before);
        const double reported = moe_comm_sum(&world, remote_reported);
        if (r == 0)
            printf("wire: %.0f bytes posted to other ranks in a step, %.0f reported: %s\n", posted,
                   reported, posted == reported ? "ok" : "FAIL");
        failures += posted != reported;
    }
    failures += step(&world, &cfg, &ep, NULL, &again) != 0;
    const moe_index EL = ep.local_experts;
    failures += same_bits("second step", r, &ep, &again, &g);

    /* The backward with its all-to-alls in flight, both progress modes, in
     * W waves of token chunks (with packed or exact GEMMs a row's data
     * gradient does not depend on the rows beside it, and the weight
     * gradients sum every expert's rows in one pass: any W), W+1 more than
     * a rank's tokens (empty waves) and a lookahead of 1 and of W, their
     * data gradients wave by wave (--wave-by tokens) and in one pass (auto,
     * no link): the blocking backward's bits. */
    const int wave_counts[] = {1, 2, 3, (int)T + 1};
    for (int n = 0; n < (rows_independent ? 4 : 1); n++)
        for (int by = 0; by < (n ? 2 : 1); by++)
            for (int kind = MOE_PROGRESS_POLL; kind <= MOE_PROGRESS_THREAD; kind++) {
                moe_schedule sched = moe_schedule_default(&ep);
                sched.progress = moe_progress_granted(&world, (enum moe_progress_kind)kind);
                sched.waves = wave_counts[n];
                sched.lookahead = kind == MOE_PROGRESS_POLL ? 1 : sched.waves;
                sched.wave_by = by ? MOE_WAVE_BY_AUTO : MOE_WAVE_BY_TOKENS;
                moe_ep_grads overlapped;
                char what[80];
                snprintf(what, sizeof what, "in flight (%s, W = %d, lookahead %d, %s)",
                         sched.progress == MOE_PROGRESS_THREAD ? "thread" : "poll", sched.waves,
                         sched.lookahead, by ? "one pass" : "wave by wave");
                failures += step(&world, &cfg, &ep, &sched, &overlapped) != 0;
                failures += same_bits(what, r, &ep, &overlapped, &g);
                moe_ep_grads_free(&overlapped);
            }

    /* DualPipe's pairing (and the serial and wave-only pairs it is
     * measured against): micro-batch B's output and A's gradients are the
     * blocking step's bits, at W = 1 and 3, both progress modes, at W = 3
     * A's data gradients wave by wave (poll) and in one pass (thread), as
     * --wave-by tokens and auto without a link run them (packed or exact
     * GEMMs: the wave forward and the waves of the backward keep the bits;
     * the wave forward's grouping under auto is its own). */
    {
        float *y_ref = moe_xmalloc(sizeof(float) * (size_t)(T * d));
        float *y_pair = moe_xmalloc(sizeof(float) * (size_t)(T * d));
        moe_ep_grads ref_again;
        failures += pair_step(&world, &cfg, &ep, NULL, -1, &ref_again, y_ref) != 0;
        moe_ep_grads_free(&ref_again);
        static const char *const modes[] = {"serial", "waves", "dualpipe"};
        for (int mode = MOE_PAIR_SERIAL; rows_independent && mode <= MOE_PAIR_DUALPIPE; mode++)
            for (int n = 0; n < 3; n++) { /* W = 1; W = 3 wave by wave; W = 3 one pass */
                moe_schedule sched = moe_schedule_default(&ep);
                sched.progress = moe_progress_granted(
                    &world, (enum moe_progress_kind)(n == 2 ? MOE_PROGRESS_THREAD : MOE_PROGRESS_POLL));
                sched.waves = n ? 3 : 1;
                sched.wave_by = n == 2 ? MOE_WAVE_BY_AUTO : MOE_WAVE_BY_TOKENS;
                moe_ep_grads paired;
                char what[64];
                snprintf(what, sizeof what, "pair %s (W = %d, %s%s)", modes[mode], sched.waves,
                         n == 2 ? "thread" : "poll", n == 2 ? ", one pass" : "");
                failures += pair_step(&world, &cfg, &ep, &sched, mode, &paired, y_pair) != 0;
                failures += same_bits(what, r, &ep, &paired, &g);
                char output[80];
                snprintf(output, sizeof output, "y of B, %s", what);
                failures += compare(output, r, y_pair, y_ref, T * d, true, 0.0);
                moe_ep_grads_free(&paired);
            }
        free(y_pair);
        free(y_ref);
    }

    /* The replicated gradients are the same bits on every rank. */
    float *rank0 = moe_xmalloc(sizeof(float) * (size_t)(E * d + S * 3 * f * d) + 1);
    memcpy(rank0, g.dgate, sizeof(float) * (size_t)(E * d));
    memcpy(rank0 + E * d, g.dshared_w1, sizeof(float) * (size_t)(S * 2 * f * d));
    memcpy(rank0 + E * d + S * 2 * f * d, g.dshared_w2, sizeof(float) * (size_t)(S * d * f));
    moe_comm_bcast(&world, rank0, (int)(sizeof(float) * (size_t)(E * d + S * 3 * f * d)), 0);
    failures += compare("gate dW_g, rank 0's", r, g.dgate, rank0, E * d, true, 0.0);
    failures += compare("shared dW1, rank 0's", r, g.dshared_w1, rank0 + E * d, S * 2 * f * d, true, 0.0);
    failures += compare("shared dW2, rank 0's", r, g.dshared_w2, rank0 + E * d + S * 2 * f * d,
                        S * d * f, true, 0.0);

    /* The whole layer on this rank alone. */
    moe_comm self;
    moe_comm_attach(&self, MPI_COMM_SELF);
    moe_config one = cfg;
    one.tokens = (int64_t)G * T;
    moe_ep ep1;
    if (moe_ep_init(&ep1, &one, &self, &st)) {
        fprintf(stderr, "ep_backward_test: %s\n", st.message);
        return 1;
    }
    moe_ep_grads g1;
    failures += step(&self, &one, &ep1, NULL, &g1) != 0;
    failures += compare("dx, one rank's", r, g.dx, g1.dx + (moe_index)r * T * d, T * d, np1_bitwise,
                        0x1p-24 * (double)(2 * d + 2 * f + cfg.topk + S + 8));
    const moe_index first = ep.first_expert;
    failures += compare("routed dW1, one rank's", r, g.dw1, g1.dw1 + first * 2 * f * d,
                        EL * 2 * f * d, rows_independent, 1e-6);
    failures += compare("routed dW2, one rank's", r, g.dw2, g1.dw2 + first * d * f, EL * d * f,
                        rows_independent, 1e-6);
    /* A shared expert's dW: fp32 sums over each rank's T rows, then over
     * ranks, against one sum over G*T rows: the truth's tolerance for it. */
    const double shared_rel = 0x1p-24 * (double)(G * T + 2 * d + 2 * f + cfg.topk + S + 8);
    failures += compare("shared dW1, one rank's", r, g.dshared_w1, g1.dshared_w1, S * 2 * f * d,
                        G == 1, shared_rel);
    failures += compare("shared dW2, one rank's", r, g.dshared_w2, g1.dshared_w2, S * d * f,
                        G == 1, shared_rel);
    failures += compare("gate dW_g, one rank's", r, g.dgate, g1.dgate, E * d, G == 1, 1e-6);

    moe_ep_grads_free(&g1);
    moe_ep_free(&ep1);
    free(rank0);
    moe_ep_grads_free(&again);
    moe_ep_grads_free(&g);
    moe_ep_free(&ep);
    free(rest);
    failures = (int)moe_comm_sum(&world, failures);
    if (r == 0)
        printf("ep_backward_test: %s\n", failures ? "FAIL" : "ok");
    moe_comm_finalize();
    return failures ? 1 : 0;
}
