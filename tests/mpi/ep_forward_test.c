/* SPDX-License-Identifier: MIT */
/* ep_forward_test.c — the EP forward on G ranks against the dense truth and
 * against the same layer on one rank.
 *
 * Run under mpirun by tests/mpi/mpi-case. Takes `moe-ep run` flags (the
 * forward compared with the truth and with one rank is the wave pipeline,
 * or the blocking reference path with --blocking) plus:
 *   --route-elsewhere    replace the router's choice by k experts held by
 *                        other ranks than the token's home (no self traffic)
 *   --np1 bitwise|tolerance
 *                        how the G-rank output must match the one-rank output
 *                        that rank 0 computes on MPI_COMM_SELF for all G*T
 *                        tokens (same seed, same global token ids)
 *   --np1-layout L       the one-rank output is computed with --expert-layout
 *                        L (rows: on the normal path), so --np1 bitwise
 *                        also says that the layouts give the same bits
 *   --max-nodes M        every token's experts must lie on at most M virtual
 *                        nodes (--ranks-per-node), as node-limited routing
 *                        promises
 *   --sweep W1,W2,..     also run the wave pipeline at each W, with poll and
 *                        with thread progress, and compare it with the
 *                        blocking path on the same ranks: bitwise where that
 *                        is the contract (expert-slot waves, or --gemm
 *                        packed or exact), within the truth's tolerance
 *                        otherwise
 * Exit 0 when every check holds, 1 otherwise.
 *
 * Why bitwise can hold across G: routing is row-independent (fixed-order
 * gate); the combine sums in slot order; with --gemm packed or exact an
 * expert's output row depends on nothing but the row. With blas, each
 * expert's rows reach its single sgemm pair in global token order whatever G
 * is, so the calls are identical; shared experts run in 64-token blocks,
 * identical when T % 64 == 0; the BLAS thread count is the same for both
 * computations (same process).
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "moe/check.h"
#include "moe/capacity.h"
#include "moe/ep.h"
#include "moe/path.h"
#include "moe/progress.h"
#include "moe/truth.h"
#include "moe/wire.h"

typedef struct {
    bool route_elsewhere;
    bool np1_bitwise;
    const char *sweep; /* "1,2,4" or NULL */
    int max_nodes;     /* 0: no bound to check */
    const char *np1_layout; /* NULL: the run's own */
} test_options;

/* ceil(T k / E * C): the capacity per expert and rank, in real arithmetic. */
static moe_index capacity_per_expert(const moe_config *cfg, moe_index T)
{
    const double share = (double)T * (double)cfg->topk / (double)cfg->experts;
    return (moe_index)ceil(share * cfg->capacity_factor);
}

/* ids/weights (T, k) for tokens with global ids first .. first+T-1: k experts
 * not held by the token's home rank (global id / tokens_per_rank), starting
 * at a token-dependent offset; weights are the router's scores renormalised. */
static void route_elsewhere(const moe_placement *p, moe_index tokens_per_rank, moe_index first,
                            moe_index tokens, int k, const float *scores, int32_t *ids,
                            float *weights)
{
    const int E = p->experts;
    for (moe_index i = 0; i < tokens; i++) {
        const moe_index g = first + i;
        const int home = (int)(g / tokens_per_rank);
        int picked = 0;
        for (int step = 0; step < E && picked < k; step++) {
            int e = (int)((g + step) % E);
            if (p->expert_rank[e] != home)
                ids[i * k + picked++] = e;
        }
        MOE_ASSERT(picked == k);
        double sum = 0.0;
        for (int s = 0; s < k; s++)
            sum += scores[i * E + ids[i * k + s]];
        for (int s = 0; s < k; s++)
            weights[i * k + s] = (float)(scores[i * E + ids[i * k + s]] / sum);
    }
}

/* Route x (T, d) on `ep`, as the options say. */
static void route(const moe_ep *ep, const moe_placement *home_placement, moe_index tokens_per_rank,
                  moe_index first, const float *x, const test_options *opt, int32_t *ids,
                  float *weights)
{
    const moe_index T = ep->cfg->tokens, E = ep->cfg->experts;
    float *logits = moe_xmalloc(sizeof(float) * (size_t)(T * E));
    float *scores = moe_xmalloc(sizeof(float) * (size_t)(T * E));
    moe_ep_route(ep, x, logits, scores, ids, weights);
    if (opt->route_elsewhere)
        route_elsewhere(home_placement, tokens_per_rank, first, T, (int)ep->cfg->topk, scores,
                        ids, weights);
    free(scores);
    free(logits);
}

/* y (T, d) of the layer on communicator c for its ranks' tokens; ids the
 * logical experts, placed (T, k) the physical ones the pairs went to. */
static int forward(const moe_comm *c, const moe_config *cfg, const moe_placement *home_placement,
                   moe_index tokens_per_rank, const test_options *opt, float *x, int32_t *ids,
                   int32_t *placed, float *weights, float *y, moe_forward_stats *stats)
{
    moe_ep ep;
    moe_status st = {0};
    if (moe_ep_init(&ep, cfg, c, &st)) {
        fprintf(stderr, "ep_forward_test: %s\n", st.message);
        return 1;
    }
    if (cfg->redundant_experts)
        moe_ep_place_replicas(&ep, NULL);
    moe_ep_generate_tokens(&ep, x);
    route(&ep, home_placement, tokens_per_rank, (moe_index)c->rank * cfg->tokens, x, opt, ids,
          weights);
    moe_ep_place(&ep, ids, weights, placed);
    const moe_schedule sched = moe_schedule_default(&ep);
    const moe_path_args a = {.sched = &sched, .x = x, .ids = placed, .weights = weights, .y = y,
                             .fwd = stats};
    int rc = ep.path->run(&ep, &a, &st);
    if (rc)
        fprintf(stderr, "ep_forward_test: %s\n", st.message);
    moe_ep_free(&ep);
    return rc;
}

/* The pairs --capacity-factor keeps, stated here apart from capacity.c (the
 * path under test drops with it): an expert keeps at most
 * ceil(T k / E * C) of a rank's pairs (Megatron-Core's get_capacity, in
 * real arithmetic: T k need not be a multiple of E), and a pair stays when
 * fewer than that many pairs of its expert come before it in the policy's
 * order (probs: the larger weight, then the lower token; position: the
 * lower token). kept (T, k) is ids with -1 for a dropped pair. Returns the
 * pairs dropped. */
static moe_index capacity_by_hand(const moe_config *cfg, const int32_t *ids, const float *weights,
                                  moe_index T, int32_t *kept)
{
    const moe_index pairs = T * cfg->topk;
    const moe_index capacity = capacity_per_expert(cfg, T);
    moe_index dropped = 0;
    for (moe_index m = 0; m < pairs; m++) {
        moe_index before = 0;
        for (moe_index n = 0; n < pairs; n++) {
            if (n == m || ids[n] != ids[m])
                continue;
            const bool earlier = cfg->drop_policy == MOE_DROP_POSITION
                                     ? n < m
                                     : weights[n] > weights[m] || (weights[n] == weights[m] && n < m);
            before += earlier;
        }
        kept[m] = before < capacity ? ids[m] : -1;
        dropped += before >= capacity;
    }
    return dropped;
}

/* Each token's k gate weights, stated apart from the router's code: the
 * reference gates renormalise the k scores to sum to one (the softmax gate,
 * DeepSeek-V3's sigmoid gate with its correction bias, or --norm-topk true)
 * or keep them as they are (DeepSeek-V2's softmax gate, norm_topk_prob
 * false, or --norm-topk false: then k softmax probabilities of E > k sum
 * below one), and then scale them by --route-scale. Returns the tokens
 * whose weights break this (rank 0 prints a line). */
static int check_weight_sums(const moe_comm *c, const moe_config *cfg, const float *weights,
                             moe_index T)
{
    const int k = (int)cfg->topk;
    const bool v3 = cfg->router == MOE_ROUTER_DEEPSEEK_V3;
    const bool renormalised = cfg->norm_topk == MOE_NORM_TOPK_ON ||
                              (cfg->norm_topk == MOE_NORM_TOPK_AUTO && (!v3 || cfg->bias_scale > 0));
    const double scale = cfg->route_scale;
    double bad = 0.0, low = INFINITY, high = 0.0;
    for (moe_index i = 0; i < T; i++) {
        double sum = 0.0;
        for (int s = 0; s < k; s++)
            sum += weights[i * k + s];
        sum /= scale;
        low = fmin(low, sum);
        high = fmax(high, sum);
        bad += renormalised ? fabs(sum - 1.0) > 1e-5 * k : !(sum < 1.0 - 1e-6);
    }
    bad = moe_comm_sum(c, bad);
    if (c->rank == 0)
        printf("gate weights: %s, each token's sum / route scale in [%.6f, %.6f]: %s\n",
               renormalised ? "renormalised to one" : "not renormalised (below one)", low, high,
               bad == 0.0 ? "ok" : "FAIL");
    return bad != 0.0;
}

/* The wave pipeline at every W of opt->sweep and both progress modes against
 * the blocking path, on the ranks of `world`. Returns the failures. */
static int sweep_waves(const moe_comm *world, const moe_config *cfg, const moe_placement *home,
                       const test_options *opt, const double *truth, const double *allow)
{
    const moe_index T = cfg->tokens, d = cfg->hidden, k = cfg->topk;
    float *x = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    float *y_ref = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    float *y = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    int32_t *ids = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k));
    float *weights = moe_xmalloc(sizeof(float) * (size_t)(T * k));
    moe_status st = {0};
    moe_ep ep;
    int failures = 0;
    if (moe_ep_init(&ep, cfg, world, &st)) {
        fprintf(stderr, "ep_forward_test: %s\n", st.message);
        return 1;
    }
    if (cfg->redundant_experts)
        moe_ep_place_replicas(&ep, NULL);
    moe_ep_generate_tokens(&ep, x);
    route(&ep, home, T, (moe_index)world->rank * T, x, opt, ids, weights);
    moe_ep_place(&ep, ids, weights, ids); /* the truth is the caller's: only the physical ids here */
    moe_forward_stats stats;
    /* The two-stage dispatch with a reduced combine sums at the relay too:
     * its waves match its own blocking run, not the flat path's sums. */
    const bool two_stage_sums = cfg->combine == MOE_COMBINE_REDUCED &&
                                cfg->dispatch == MOE_DISPATCH_HIERARCHICAL;
    failures += (two_stage_sums ? moe_ep_forward_hier(&ep, x, ids, weights, y_ref, &stats, &st)
                                : moe_ep_forward_ref(&ep, x, ids, weights, y_ref, &stats, NULL, &st)) != 0;
    char list[256];
    snprintf(list, sizeof list, "%s", opt->sweep);
    for (char *save = NULL, *item = strtok_r(list, ",", &save); item; item = strtok_r(NULL, ",", &save))
        for (int progress = MOE_PROGRESS_POLL; progress <= MOE_PROGRESS_THREAD; progress++) {
            moe_schedule sched = moe_schedule_default(&ep);
            sched.waves = atoi(item);
            sched.progress = moe_progress_granted(world, (enum moe_progress_kind)progress);
            const moe_path_args a = {.sched = &sched, .x = x, .ids = ids, .weights = weights,
                                     .y = y, .fwd = &stats};
            failures += ep.path->waves->run(&ep, &a, &st) != 0;
            double differ = 0.0;
            for (moe_index n = 0; n < T * d; n++)
                differ += memcmp(&y[n], &y_ref[n], sizeof(float)) != 0;
            differ = moe_comm_sum(world, differ);
            const bool bitwise = moe_gemm_rows_independent(ep.gemm) || stats.wave_kind == MOE_WAVES_EXPERT_SLOTS;
            moe_run_summary s = {.cfg = cfg};
            moe_check_collective(world, cfg, y, truth, allow, &s);
            const bool ok = bitwise ? differ == 0.0 : !s.nonfinite && s.cmp.max_used <= 1.0;
            if (world->rank == 0)
                printf("W=%-2d %-6s %-12s vs blocking path: %s, %.0f values differ "
                       "(%s expected; truth used %.1f%% of tolerance)\n",
                       sched.waves, progress == MOE_PROGRESS_POLL ? "poll" : "thread",
                       stats.wave_kind == MOE_WAVES_EXPERT_SLOTS ? "expert-slots" : "token-chunks",
                       ok ? "ok" : "FAIL", differ, bitwise ? "bitwise" : "tolerance",
                       100 * s.cmp.max_used);
            failures += !ok;
        }
    moe_ep_free(&ep);
    free(weights);
    free(ids);
    free(y);
    free(y_ref);
    free(x);
    return failures;
}

/* Prints the wire check's line on rank 0; true when the figures differ. */
static bool r_posted_report(int rank, double posted, double reported)
{
    if (rank == 0)
        printf("wire: %.0f bytes posted to other ranks, %.0f reported: %s\n", posted, reported,
               posted == reported ? "ok" : "FAIL");
    return posted != reported;
}

/* The same forward without --pad-to-capacity: y bitwise, and the padded
 * run's expert FLOPs those of (E G C) rows where this one computed its
 * pairs. Collective; returns the failures. */
static int check_padding(const moe_comm *c, const moe_config *cfg, const moe_placement *home,
                         const test_options *opt, const float *y_pad,
                         const moe_forward_stats *padded)
{
    const moe_index T = cfg->tokens, d = cfg->hidden, k = cfg->topk;
    moe_config plain = *cfg;
    plain.pad_to_capacity = false;
    float *x = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    float *y = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    int32_t *ids = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k));
    int32_t *placed = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k));
    float *weights = moe_xmalloc(sizeof(float) * (size_t)(T * k));
    moe_forward_stats stats;
    int failures = forward(c, &plain, home, T, opt, x, ids, placed, weights, y, &stats);
    double differ = 0.0;
    for (moe_index n = 0; n < T * d; n++)
        differ += memcmp(&y[n], &y_pad[n], sizeof(float)) != 0;
    differ = moe_comm_sum(c, differ);
    const double row_flops = 6.0 * (double)d * (double)cfg->ffn;
    const double pads = moe_comm_sum(c, (double)padded->pad_rows);
    const double pairs = moe_comm_sum(c, (double)stats.pairs_received);
    const double extra = moe_comm_sum(c, padded->expert_flops - stats.expert_flops);
    const double want = (double)cfg->experts * c->ranks * (double)capacity_per_expert(cfg, T);
    const bool ok = differ == 0.0 && pads + pairs == want && extra == pads * row_flops;
    if (c->rank == 0)
        printf("pad to capacity: %.0f values differ from the run without; %.0f pairs + %.0f zero rows "
               "= %.0f rows (E G C = %.0f); %.0f FLOPs more (%.0f rows' worth): %s\n",
               differ, pairs, pads, pairs + pads, want, extra, extra / row_flops, ok ? "ok" : "FAIL");
    free(weights);
    free(placed);
    free(ids);
    free(y);
    free(x);
    return failures + !ok;
}

int main(int argc, char **argv)
{
    moe_comm world;
    moe_comm_init(&argc, &argv, &world);
    test_options opt = {false, true, NULL, 0, NULL};
    char **rest = malloc(sizeof(char *) * (size_t)argc);
    int n_rest = 0, failures = 0;
    for (int n = 1; n < argc; n++) {
        if (!strcmp(argv[n], "--route-elsewhere"))
            opt.route_elsewhere = true;
        else if (!strcmp(argv[n], "--np1") && n + 1 < argc)
            opt.np1_bitwise = !strcmp(argv[++n], "bitwise");
        else if (!strcmp(argv[n], "--sweep") && n + 1 < argc)
            opt.sweep = argv[++n];
        else if (!strcmp(argv[n], "--np1-layout") && n + 1 < argc)
            opt.np1_layout = argv[++n];
        else if (!strcmp(argv[n], "--max-nodes") && n + 1 < argc)
            opt.max_nodes = atoi(argv[++n]);
        else
            rest[n_rest++] = argv[n];
    }
    moe_config cfg;
    moe_status st = {0};
    moe_config_defaults(&cfg);
    if (moe_config_parse(&cfg, MOE_CMD_RUN, n_rest, rest, &st) || moe_config_validate(&cfg, world.ranks, &st)) {
        if (world.rank == 0)
            fprintf(stderr, "ep_forward_test: %s\n", st.message);
        moe_comm_finalize();
        return 2;
    }
    const int G = world.ranks, r = world.rank;
    const moe_index T = cfg.tokens, d = cfg.hidden, k = cfg.topk;
    moe_placement home;
    moe_placement_init(&home, (int)cfg.experts, G);

    float *x = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    float *y = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    int32_t *ids = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k));
    float *weights = moe_xmalloc(sizeof(float) * (size_t)(T * k));
    moe_forward_stats stats;
    const double posted_before = moe_comm_posted_bytes();
    int32_t *placed = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k));
    if (forward(&world, &cfg, &home, T, &opt, x, ids, placed, weights, y, &stats))
        failures++;
    if (!opt.route_elsewhere && cfg.topk < cfg.experts)
        failures += check_weight_sums(&world, &cfg, weights, T);
    /* The bytes MPI was asked to move to other ranks (counts times the wire
     * row types) are the bytes the traffic figures report (wire.h). */
    {
        const double posted = moe_comm_sum(&world, moe_comm_posted_bytes() - posted_before);
        const double reported =
            moe_comm_sum(&world, (double)stats.rows_sent_remote) *
                (cfg.mode == MOE_MODE_LOW_LATENCY ? moe_ll_row_bytes(&cfg) : moe_dispatch_row_bytes(&cfg)) +
            moe_comm_sum(&world, (double)stats.pairs_back_remote) * moe_combine_row_bytes(&cfg);
        if (r_posted_report(world.rank, posted, reported))
            failures++;
    }
    /* --pad-to-capacity: the experts computed G C rows each, the zero rows
     * among them changed no bit of y, and their FLOPs are the difference. */
    if (cfg.pad_to_capacity)
        failures += check_padding(&world, &cfg, &home, &opt, y, &stats);
    /* The two-stage dispatch's rows on each tier are what the routing says
     * they must be (layout.h, moe_node_copies), to the row. */
    if (cfg.dispatch == MOE_DISPATCH_HIERARCHICAL) {
        moe_placement placement;
        moe_placement_init(&placement, (int)(cfg.experts + cfg.redundant_experts), world.ranks);
        moe_node_rows want = {0};
        const int R = cfg.ranks_per_node > 0 ? (int)cfg.ranks_per_node : world.ranks;
        moe_node_copies(&placement, placed, cfg.tokens, (int)cfg.topk, R, world.rank, &want);
        moe_comm_sum_array(&world, &want.flat_inter, 4);
        const double inter = moe_comm_sum(&world, (double)stats.rows_inter);
        const double intra = moe_comm_sum(&world, (double)stats.rows_intra);
        const bool same = inter == want.two_stage_inter && intra == want.two_stage_intra;
        if (world.rank == 0)
            printf("two-stage rows: %.0f between nodes, %.0f within; the routing says %.0f and %.0f: %s\n",
                   inter, intra, want.two_stage_inter, want.two_stage_intra, same ? "ok" : "FAIL");
        failures += !same;
        moe_placement_free(&placement);
    }

    /* --capacity-factor: the drops, decided here from the routing alone */
    moe_index dropped = 0;
    if (cfg.capacity_factor > 0) {
        dropped = capacity_by_hand(&cfg, ids, weights, T, ids);
        dropped = (moe_index)moe_comm_sum(&world, (double)dropped);
        if (r == 0)
            printf("capacity factor %g: %lld of %lld pairs dropped\n", cfg.capacity_factor,
                   (long long)dropped, (long long)(G * T * k));
    }

    /* 1. Against the dense fp64 truth. */
    double *truth = moe_xmalloc(sizeof(double) * (size_t)(T * d));
    double *allow = moe_xmalloc(sizeof(double) * (size_t)(T * d));
    float *x_dispatched = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    {
        moe_ep ep;
        if (moe_ep_init(&ep, &cfg, &world, &st) == MOE_EXIT_OK) {
            moe_truth_forward(&cfg, MOE_TRUTH_EXACT, x,
                              moe_ep_dispatched_tokens(&ep, x, x_dispatched), ids, weights, T,
                              world.ranks, truth, allow);
            moe_ep_free(&ep);
        }
    }
    moe_run_summary s = {.cfg = &cfg};
    moe_check_collective(&world, &cfg, y, truth, allow, &s);
    const bool truth_ok = !s.nonfinite && s.cmp.max_used <= 1.0;
    if (r == 0)
        printf("np=%d %s vs dense truth: %s max_abs=%.3e max_rel=%.3e used=%.1f%% of tol %.3e+%.3e*|ref|\n",
               G, cfg.mode == MOE_MODE_LOW_LATENCY ? "low-latency" : cfg.blocking ? "blocking" : "waves", truth_ok ? "ok" : "FAIL", s.cmp.max_abs, s.cmp.max_rel, 100 * s.cmp.max_used,
               s.tol.abs, s.tol.rel);
    failures += !truth_ok;

    /* 2. Rows and pairs add up: every (token, slot) not dropped computed
     * exactly once. */
    double pairs = moe_comm_sum(&world, (double)stats.pairs_received);
    double self_rows = moe_comm_sum(&world, (double)(stats.rows_sent - stats.rows_sent_remote));
    if (pairs != (double)G * (double)T * (double)k - (double)dropped) {
        if (r == 0)
            printf("FAIL: %.0f pairs computed, expected G*T*k - dropped = %.0f\n", pairs,
                   (double)G * (double)T * (double)k - (double)dropped);
        failures++;
    }
    if (opt.route_elsewhere && self_rows != 0.0) {
        if (r == 0)
            printf("FAIL: %.0f rows sent to their own rank under --route-elsewhere\n", self_rows);
        failures++;
    }
    if (r == 0 && opt.route_elsewhere)
        printf("route-elsewhere: 0 rows to self, %.0f remote rows\n",
               moe_comm_sum(&world, (double)stats.rows_sent_remote));
    else if (opt.route_elsewhere)
        moe_comm_sum(&world, (double)stats.rows_sent_remote);

    /* 3. Node-limited routing: no token reaches more than max_nodes nodes. */
    if (opt.max_nodes > 0) {
        const int R = cfg.ranks_per_node > 0 ? (int)cfg.ranks_per_node : G;
        const int nodes = (G + R - 1) / R;
        double *hist = moe_xcalloc((size_t)nodes + 1, sizeof(double));
        moe_nodes_per_token(&home, ids, T, (int)k, R, hist);
        moe_comm_sum_array(&world, hist, nodes + 1);
        double over = 0.0;
        for (int n = opt.max_nodes + 1; n <= nodes; n++)
            over += hist[n];
        if (r == 0) {
            printf("nodes per token (%d nodes):", nodes);
            for (int n = 1; n <= nodes; n++)
                printf(" %d:%.0f", n, hist[n]);
            printf(" -> %s (%.0f tokens over %d nodes)\n", over == 0.0 ? "ok" : "FAIL", over,
                   opt.max_nodes);
        }
        failures += over != 0.0;
        free(hist);
    }

    /* 4. The wave pipeline against the blocking path. */
    if (opt.sweep)
        failures += sweep_waves(&world, &cfg, &home, &opt, truth, allow);

    /* 5. Against one rank: gather y, recompute on MPI_COMM_SELF at rank 0. */
    float *all = r == 0 ? moe_xmalloc(sizeof(float) * (size_t)(G * T * d)) : NULL;
    MPI_Gather(y, (int)(T * d), MPI_FLOAT, all, (int)(T * d), MPI_FLOAT, 0, MPI_COMM_WORLD);
    /* A reduced combine sums per rank: one rank is another layout, whose
     * sums differ (rounded to bf16, by more than the fp32 tolerance). */
    if (r == 0 && cfg.combine == MOE_COMBINE_REDUCED)
        printf("np=1: not compared (a reduced combine's sums depend on the layout; the truth above is)\n");
    else if (r == 0 && cfg.capacity_factor > 0)
        printf("np=1: not compared (the capacity is per rank's tokens: one rank drops other pairs)\n");
    if (r == 0 && cfg.combine == MOE_COMBINE_PAIRS && !(cfg.capacity_factor > 0)) {
        moe_comm self;
        moe_comm_attach(&self, MPI_COMM_SELF);
        self.threads = world.threads;
        moe_config one = cfg;
        one.tokens = (int64_t)G * T;
        if (one.max_tokens_per_rank > 0) /* low-latency: one rank's buffers hold them all */
            one.max_tokens_per_rank = one.tokens;
        one.dispatch = MOE_DISPATCH_FLAT; /* one rank: one node, the flat reference */
        if (opt.np1_layout) {
            const char *argv1[] = {"--expert-layout", opt.np1_layout};
            MOE_ASSERT(moe_config_parse(&one, MOE_CMD_RUN, 2, (char **)argv1, &st) == MOE_EXIT_OK);
            if (one.expert_layout == MOE_LAYOUT_ROWS)
                one.mode = MOE_MODE_NORMAL;
            if (moe_config_layout(&one) != MOE_LAYOUT_MASKED && one.mode == MOE_MODE_NORMAL)
                one.max_tokens_per_rank = -1;
        }
        one.ranks_per_node = 0;
        one.redundant_experts = 0; /* copies hold the same weights: the same bits without them */
        one.eplb_window = 1;
        float *x1 = moe_xmalloc(sizeof(float) * (size_t)(G * T * d));
        float *y1 = moe_xmalloc(sizeof(float) * (size_t)(G * T * d));
        int32_t *ids1 = moe_xmalloc(sizeof(int32_t) * (size_t)(G * T * k));
        float *w1 = moe_xmalloc(sizeof(float) * (size_t)(G * T * k));
        moe_forward_stats stats1;
        /* With --gemm exact or packed the bits must not depend on the thread
         * count: the one-rank run uses another one. */
        const int threads =
            moe_gemm_rows_independent(cfg.gemm) ? world.threads + 1 : world.threads;
#ifdef _OPENMP
        omp_set_num_threads(threads);
#endif
        if (forward(&self, &one, &home, T, &opt, x1, ids1, ids1, w1, y1, &stats1))
            failures++;
#ifdef _OPENMP
        omp_set_num_threads(world.threads);
#endif
        /* Within tolerance: both outputs lie within abs + rel*|ref| of the
         * truth, so they differ by at most twice that; |ref| is taken as
         * |y1| widened by the relative tolerance itself. */
        moe_index differ = 0, first = -1;
        double max_diff = 0.0, max_used = 0.0;
        for (moe_index n = 0; n < G * T * d; n++)
            if (memcmp(&all[n], &y1[n], sizeof(float)) != 0) {
                if (first < 0)
                    first = n;
                differ++;
                double diff = fabs((double)all[n] - (double)y1[n]);
                double bound = 2.0 * (s.tol.abs + s.tol.rel * fabs((double)y1[n])) * (1.0 + 2.0 * s.tol.rel);
                max_diff = fmax(max_diff, diff);
                max_used = fmax(max_used, isfinite(diff) ? diff / bound : INFINITY);
            }
        bool ok = opt.np1_bitwise ? differ == 0 : max_used <= 1.0;
        printf("np=%d (%d threads) vs np=1 (%d threads%s%s) (%s expected): %s, %lld of %lld values differ, max |diff| %.3e",
               G, world.threads, threads, opt.np1_layout ? ", --expert-layout " : "",
               opt.np1_layout ? opt.np1_layout : "", opt.np1_bitwise ? "bitwise" : "within tolerance", ok ? "ok" : "FAIL",
               (long long)differ, (long long)(G * T * d), max_diff);
        if (first >= 0)
            printf(", first at token %lld column %lld", (long long)(first / d),
                   (long long)(first % d));
        printf("\n");
        failures += !ok;
        free(w1);
        free(ids1);
        free(y1);
        free(x1);
    }
    free(all);
    MPI_Allreduce(MPI_IN_PLACE, &failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    free(x_dispatched);
    free(allow);
    free(truth);
    free(weights);
    free(placed);
    free(ids);
    free(y);
    free(x);
    free(rest);
    moe_placement_free(&home);
    moe_comm_finalize();
    return failures ? 1 : 0;
}
