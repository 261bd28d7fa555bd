/* SPDX-License-Identifier: MIT */
/* explain.c — `moe-ep explain`: the walk of chosen tokens through the layer.
 *
 * One forward on the blocking reference path, captured as --dump captures
 * it (the rows each rank received, the expert outputs it sent back), then
 * for each token of --token: its input, the router's logits and scores (and
 * DeepSeek-V3's group scores and kept groups), the top-k experts with their
 * ranks and nodes, the rows the dispatch sends after deduplication, where
 * each row lands in its rank's receive buffer and in which wave the wave
 * pipeline would send it, each expert's output, what each rank sends back,
 * the weighted sum, the shared experts, and the output next to the fp64
 * truth; with the two-stage dispatch each node's relay and what it
 * forwards (and, reduced, each relay's sum), with the low-latency mode each
 * pair's buffer slot. Then the per-rank view: rows and pairs from each
 * rank to each.
 * Every rank fills a fixed-size record per token; rank 0 gathers and
 * prints. With --dump the golden set of the same forward is written too,
 * which is what tests/mpi/explain checks the printed numbers against.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/capacity.h"
#include "moe/cli.h"
#include "moe/dump.h"
#include "moe/context.h"
#include "moe/ep.h"
#include "moe/files.h"
#include "moe/layout.h"
#include "moe/placement_svg.h"
#include "moe/router.h"
#include "moe/truth.h"
#include "moe/workload.h"

#define SHOW 4         /* values shown of a d-long row */
#define MAX_TOKENS 16  /* entries of --token */
#define ALL_SCORES 16  /* up to this E every logit and score is shown */

static void print_usage(FILE *out)
{
    fprintf(out,
            "usage: mpirun -np G moe-ep explain [--token N[,N...]] [--preset NAME] [flags]\n"
            "\n"
            "Follows tokens through one forward on the blocking reference path: the router's\n"
            "logits and scores, the top-k experts and where they live, the rows the dispatch\n"
            "sends after deduplication and where each lands, the experts' outputs, what comes\n"
            "back, the weighted sum, the shared experts and the output next to the fp64 truth;\n"
            "then the rows and pairs each rank sends to each. With --dispatch hierarchical it\n"
            "follows the token through each node's relay (and each relay's sum); with --mode\n"
            "low-latency into each expert's buffer slot. Rows show their first %d values.\n"
            "Flags override the preset, whatever their order.\n"
            "\n",
            SHOW);
    moe_config_print_flags(out, MOE_CMD_EXPLAIN);
    fprintf(out,
            "  --help                 this text\n"
            "\n"
            "Exit status: 0 ok, 2 bad flag or config, 3 runtime error.\n");
}

/* --token: a list of global ids in [0, N). Returns the count, or 0 with st set. */
static int parse_tokens(const char *text, int64_t N, int64_t *out, moe_status *st)
{
    const int count = moe_parse_int_list(text, 0, N - 1, out, MAX_TOKENS);
    if (count < 0)
        moe_fail(st, MOE_EXIT_USAGE,
                 "--token must be a global token id in [0, %lld] (G*T - 1) or a list of at most "
                 "%d of them, got '%s'",
                 (long long)(N - 1), MAX_TOKENS, text);
    return count < 0 ? 0 : count;
}

/* What the token's home rank knows, in doubles: x, logits, scores, ids,
 * weights, the wave of each slot, the low-latency buffer slot of each (the
 * tokens of its rank before it that chose the same expert), y, the shared
 * experts' outputs, the truth, max |y - truth| and the truth's rms over d. */
typedef struct {
    int E, k, S;
    size_t x, logits, scores, ids, weights, wave, slot, y, shared, truth, diff, size;
} home_layout;

static home_layout home_layout_of(const moe_config *cfg)
{
    home_layout h = {.E = (int)cfg->experts, .k = (int)cfg->topk, .S = (int)cfg->shared_experts};
    h.logits = h.x + SHOW;
    h.scores = h.logits + (size_t)h.E;
    h.ids = h.scores + (size_t)h.E;
    h.weights = h.ids + (size_t)h.k;
    h.wave = h.weights + (size_t)h.k;
    h.slot = h.wave + (size_t)h.k;
    h.y = h.slot + (size_t)h.k;
    h.shared = h.y + SHOW;
    h.truth = h.shared + (size_t)h.S * SHOW;
    h.diff = h.truth + SHOW;
    h.size = h.diff + 2;
    return h;
}

/* What one rank saw of the token, in doubles: its receive row (-1: none)
 * and the rows it received, the pairs it computed (expert, output), and
 * with --combine reduced the sum it sent back. */
typedef struct {
    size_t row, rows, pairs, pair, sum, size;
} rank_layout;

static rank_layout rank_layout_of(const moe_config *cfg)
{
    rank_layout r = {0, 1, 2, 3, 0, 0};
    r.sum = r.pair + (size_t)cfg->topk * (1 + SHOW);
    r.size = r.sum + SHOW;
    return r;
}

static void copy_show(double *to, const float *from, moe_index d)
{
    for (int n = 0; n < SHOW; n++)
        to[n] = n < d ? (double)from[n] : NAN;
}

static void fill_home(const moe_run_context *ctx, const moe_waves *waves, moe_index i, const float *xd,
                      const home_layout *h, double *rec)
{
    const moe_config *cfg = &ctx->cfg;
    const moe_index d = cfg->hidden;
    const int E = h->E, k = h->k, S = h->S;
    copy_show(rec + h->x, ctx->x + i * d, d);
    for (int e = 0; e < E; e++) {
        rec[h->logits + e] = ctx->logits[i * E + e];
        rec[h->scores + e] = ctx->scores[i * E + e];
    }
    for (int s = 0; s < k; s++) {
        rec[h->ids + s] = ctx->ids[i * k + s];
        rec[h->weights + s] = ctx->weights[i * k + s];
        rec[h->wave + s] = moe_wave_of(waves, i, ctx->ids[i * k + s]);
        int before = 0;
        for (moe_index j = 0; j < i; j++)
            for (int t = 0; t < k; t++)
                before += ctx->ids[j * k + t] == ctx->ids[i * k + s];
        rec[h->slot + s] = before;
    }
    copy_show(rec + h->y, ctx->y + i * d, d);
    float *shared = moe_xmalloc(sizeof(float) * (size_t)(S * d) + 1);
    moe_ep_shared_outputs(&ctx->ep, ctx->x + i * d, 1, shared);
    for (int s = 0; s < S; s++)
        copy_show(rec + h->shared + (size_t)s * SHOW, shared + s * d, d);
    free(shared);
    double *truth = moe_xmalloc(sizeof(double) * (size_t)d);
    double *allow = moe_xmalloc(sizeof(double) * (size_t)d);
    moe_truth_forward(cfg, MOE_TRUTH_EXACT, ctx->x + i * d, xd + i * d, ctx->ids + i * k,
                      ctx->weights + i * k, 1, ctx->comm->ranks, truth, allow);
    double most = 0.0, squares = 0.0;
    for (moe_index n = 0; n < d; n++) {
        most = fmax(most, fabs((double)ctx->y[i * d + n] - truth[n]));
        squares += truth[n] * truth[n];
        if (n < SHOW)
            rec[h->truth + n] = truth[n];
    }
    for (moe_index n = d; n < SHOW; n++)
        rec[h->truth + n] = NAN;
    rec[h->diff] = most;
    rec[h->diff + 1] = sqrt(squares / (double)d);
    free(allow);
    free(truth);
}

static void fill_rank(const moe_ep_capture *cap, int64_t g, moe_index d, const rank_layout *r,
                      double *rec)
{
    memset(rec, 0, sizeof(double) * r->size);
    rec[r->rows] = (double)cap->rows;
    moe_index row = -1;
    for (moe_index n = 0; n < cap->rows && row < 0; n++)
        if (cap->recv_token[n] == g)
            row = n;
    rec[r->row] = (double)row;
    int found = 0;
    for (moe_index p = 0; p < cap->pairs; p++)
        if (cap->pair[2 * p] == g) {
            double *at = rec + r->pair + (size_t)found * (1 + SHOW);
            at[0] = cap->pair[2 * p + 1];
            copy_show(at + 1, cap->out + p * d, d);
            found++;
        }
    rec[r->pairs] = found;
    if (cap->sums && row >= 0)
        copy_show(rec + r->sum, cap->sums + row * d, d);
}

static void print_row(const char *label, const double *v, moe_index d)
{
    printf("  %-11s [", label);
    for (int n = 0; n < SHOW && n < d; n++)
        printf("%s%.6g", n ? ", " : "", v[n]);
    printf("%s]\n", d > SHOW ? ", ..." : "");
}

static int node_of(const moe_ep *ep, int rank)
{
    return rank / ep->link.ranks_per_node;
}

/* The waves of the pipeline that carry the token's row to rank r: one per
 * wave that holds any of its experts there (expert-slot waves may send a
 * row twice; one wave, or token chunks, send it once). */
static void print_waves(const moe_ep *ep, const double *home, const home_layout *h, int r, int W,
                        bool own)
{
    int waves[MOE_ROUTER_MAX_EXPERTS], count = 0;
    for (int s = 0; s < h->k; s++) {
        if (ep->placement.expert_rank[(int)home[h->ids + s]] != r)
            continue;
        const int w = (int)home[h->wave + s];
        bool seen = false;
        for (int n = 0; n < count; n++)
            seen = seen || waves[n] == w;
        if (!seen)
            waves[count++] = w;
    }
    for (int n = 1; n < count; n++) /* ascending */
        for (int m = n; m > 0 && waves[m - 1] > waves[m]; m--) {
            const int t = waves[m];
            waves[m] = waves[m - 1];
            waves[m - 1] = t;
        }
    /* the wave path's experts read a rank's own rows from its tokens */
    printf("the wave pipeline %s in wave%s", own ? "reads it in place" : "sends it", count == 1 ? "" : "s");
    for (int n = 0; n < count; n++)
        printf("%s %d", n ? "," : "", waves[n]);
    printf(" of %d%s\n", W,
           count > 1 && !own ? " (once per wave: more rows than one wave sends)" : "");
}

/* Rank 0: the walk of token g from the home record and every rank's. */
/* The router's part of a token's walk: the gate, its logits and scores
 * (up to ALL_SCORES experts), the groups kept, the top-k and where each
 * expert lives. */
static void print_router(const moe_run_context *ctx, const double *home, const home_layout *h)
{
    const moe_config *cfg = &ctx->cfg;
    const moe_ep *ep = &ctx->ep;
    const int E = h->E, k = h->k;
    const bool v3 = cfg->router == MOE_ROUTER_DEEPSEEK_V3;
    const bool sigmoid = v3 && ep->bias;
    if (cfg->routing[0] || cfg->workload != MOE_WORKLOAD_NONE)
        printf("  %-11s the top-k below replayed from %s, not chosen from these scores\n", "router",
               cfg->routing[0] ? "--routing" : "--workload");
    printf("  %-11s %s\n", "router",
           v3 ? (sigmoid ? "deepseek-v3: scores = sigmoid(logits); selection on scores + bias"
                         : "deepseek-v3 without a bias: scores = softmax(logits)")
              : "softmax: scores = softmax(logits)");
    if (E <= ALL_SCORES) {
        printf("  %-11s", "logits");
        for (int e = 0; e < E; e++)
            printf(" e%d %.4g", e, home[h->logits + e]);
        printf("\n  %-11s", "scores");
        for (int e = 0; e < E; e++)
            printf(" e%d %.4g", e, home[h->scores + e]);
        printf("\n");
    }
    if (v3 && cfg->groups > 1) {
        float biased[MOE_ROUTER_MAX_EXPERTS], group_score[MOE_ROUTER_MAX_EXPERTS];
        unsigned char keep[MOE_ROUTER_MAX_EXPERTS];
        for (int e = 0; e < E; e++)
            biased[e] = (float)home[h->scores + e] + (ep->bias ? ep->bias[e] : 0.0f);
        moe_router_groups(&ep->router, biased, group_score, keep);
        printf("  %-11s", "groups");
        for (int q = 0; q < (int)cfg->groups; q++)
            printf(" g%d %.4g%s", q, group_score[q], keep[q] ? "*" : "");
        printf("  (%s; * kept: the best %lld, the others' experts masked with -inf)\n",
               ep->bias ? "the sum of each group's two best biased scores" : "each group's best score",
               (long long)cfg->topk_groups);
    }
    for (int s = 0; s < k; s++) {
        const int e = (int)home[h->ids + s];
        if (e == MOE_DROPPED) {
            const bool replayed = cfg->routing[0] || cfg->workload != MOE_WORKLOAD_NONE;
            printf("  %-11s masked (-1, %s): not dispatched, its weight %.6g unused\n", s ? "" : "top-k",
                   !cfg->mask_ranks[0] ? "replayed" : replayed ? "replayed or --mask-ranks" : "--mask-ranks",
                   home[h->weights + s]);
            continue;
        }
        const int r = ep->placement.expert_rank[e];
        printf("  %-11s expert %d: logit %.4g, score %.4g, weight %.6g; on rank %d, node %d\n",
               s ? "" : "top-k", e, home[h->logits + e], home[h->scores + e], home[h->weights + s], r,
               node_of(ep, r));
    }
}

/* The two-stage dispatch of the token: per node holding any of its
 * experts, the one row that crosses the inter-node tier to the node's
 * relay (the rank of the home's local index there; none for the home's own
 * node), and the ranks of that node the relay forwards it to over NVLink;
 * then the IB rows against the flat dispatch's. */
static void print_relay(const moe_run_context *ctx, int home_rank, const double *ranks,
                        const rank_layout *rl)
{
    const moe_ep *ep = &ctx->ep;
    const int G = ctx->comm->ranks, R = ep->link.ranks_per_node, nodes = G / R;
    int ib = 0, flat = 0, shown = 0;
    for (int n = 0; n < nodes; n++) {
        int held = 0;
        for (int r = n * R; r < (n + 1) * R; r++)
            held += ranks[(size_t)r * rl->size + rl->row] >= 0;
        if (!held)
            continue;
        const int relay = n * R + home_rank % R;
        const char *label = shown++ ? "" : "two-stage";
        if (n == node_of(ep, home_rank))
            printf("  %-11s node %d (home's): no inter-node hop; rank %d forwards it over NVLink to rank%s",
                   label, n, home_rank, held == 1 ? "" : "s");
        else
            printf("  %-11s node %d: one row over IB to its relay, rank %d (local index %d, as the home's), "
                   "which forwards it over NVLink to rank%s",
                   label, n, relay, home_rank % R, held == 1 ? "" : "s");
        for (int r = n * R, first = 1; r < (n + 1) * R; r++)
            if (ranks[(size_t)r * rl->size + rl->row] >= 0) {
                printf("%s %d%s", first ? "" : ",", r, r == relay ? " (itself)" : "");
                first = 0;
            }
        printf("\n");
        ib += n != node_of(ep, home_rank);
        flat += n != node_of(ep, home_rank) ? held : 0;
    }
    printf("  %-11s %d row%s cross%s the inter-node tier (the flat dispatch would send %d); the combine "
           "returns the same way%s\n",
           "", ib, ib == 1 ? "" : "s", ib == 1 ? "es" : "", flat,
           ctx->cfg.combine == MOE_COMBINE_REDUCED ? ", each relay summing its node's rows first" : "");
}

/* The two-stage dispatch's reduced combine: each node's relay adds its
 * ranks' sums of the token (ascending local index, in fp32), rounds the
 * sum as it travels, and sends one row home. */
static void print_node_sums(const moe_run_context *ctx, const double *ranks, const rank_layout *rl)
{
    const int G = ctx->comm->ranks, R = ctx->ep.link.ranks_per_node;
    for (int n = 0; n < G / R; n++) {
        float sum[SHOW] = {0};
        bool any = false;
        for (int r = n * R; r < (n + 1) * R; r++)
            if (ranks[(size_t)r * rl->size + rl->row] >= 0) {
                any = true;
                for (int c = 0; c < SHOW; c++)
                    sum[c] += (float)ranks[(size_t)r * rl->size + rl->sum + c];
            }
        if (!any)
            continue;
        moe_precision_combine(ctx->cfg.combine_dtype, sum, SHOW);
        double shown[SHOW];
        for (int c = 0; c < SHOW; c++)
            shown[c] = sum[c];
        char label[32];
        snprintf(label, sizeof label, "node %d sum", n);
        print_row(label, shown, ctx->cfg.hidden);
    }
}

/* The low-latency dispatch of the token: every pair its own row (no
 * deduplication), written one-sidedly into the owner's fixed buffer. */
static void print_low_latency(const moe_run_context *ctx, int home_rank, const double *home,
                              const home_layout *h)
{
    const moe_ep *ep = &ctx->ep;
    const moe_config *cfg = &ctx->cfg;
    for (int s = 0; s < h->k; s++) {
        const int e = (int)home[h->ids + s];
        if (e == MOE_DROPPED)
            continue;
        const int r = ep->placement.expert_rank[e];
        char how[64];
        if (cfg->rma == MOE_RMA_GET)
            snprintf(how, sizeof how, "read by rank %d from rank %d's window into", r, home_rank);
        else
            snprintf(how, sizeof how, "put by rank %d into", home_rank);
        printf("  %-11s expert %d: its own row, %s rank %d's buffer of local expert %d, source block %d, "
               "slot %.0f of %lld\n",
               s ? "" : "low-latency", e, how, r, e - ep->placement.first_expert[r], home_rank,
               home[h->slot + s], (long long)moe_config_max_tokens(cfg));
    }
}

static void print_token(const moe_run_context *ctx, int64_t g, const double *home,
                        const home_layout *h, const double *ranks, const rank_layout *rl)
{
    const moe_config *cfg = &ctx->cfg;
    const moe_ep *ep = &ctx->ep;
    const int G = ctx->comm->ranks, k = h->k, S = h->S;
    const moe_index T = cfg->tokens, d = cfg->hidden;
    const int home_rank = (int)(g / T);
    printf("\ntoken %lld: rank %d's token %lld (node %d)\n", (long long)g, home_rank,
           (long long)(g % T), node_of(ep, home_rank));
    print_row("x", home + h->x, d);
    print_router(ctx, home, h);
    /* the dispatch: one row per rank that holds any of its experts */
    int copies = 0, nodes = 0, last_node = -1, pairs = 0;
    for (int s = 0; s < k; s++)
        pairs += home[h->ids + s] != MOE_DROPPED;
    for (int r = 0; r < G; r++)
        if (ranks[(size_t)r * rl->size + rl->row] >= 0) {
            copies++;
            nodes += node_of(ep, r) != last_node;
            last_node = node_of(ep, r);
        }
    const bool ll = cfg->mode == MOE_MODE_LOW_LATENCY;
    if (ll)
        printf("  %-11s %d pair%s, %d row%s: the low-latency mode sends each pair as its own row (no "
               "deduplication), to %d rank%s on %d of %d node%s\n",
               "dispatch", pairs, pairs == 1 ? "" : "s", pairs, pairs == 1 ? "" : "s", copies,
               copies == 1 ? "" : "s", nodes, node_of(ep, G - 1) + 1, node_of(ep, G - 1) ? "s" : "");
    else
        printf("  %-11s %d pair%s, %d row%s after deduplication (one per rank holding any of its "
               "experts), on %d of %d node%s\n",
               "dispatch", pairs, pairs == 1 ? "" : "s", copies, copies == 1 ? "" : "s", nodes,
               node_of(ep, G - 1) + 1, node_of(ep, G - 1) ? "s" : "");
    if (cfg->dispatch == MOE_DISPATCH_HIERARCHICAL)
        print_relay(ctx, home_rank, ranks, rl);
    if (cfg->mode == MOE_MODE_LOW_LATENCY)
        print_low_latency(ctx, home_rank, home, h);
    double routed[SHOW] = {0};
    const bool reduced = cfg->combine == MOE_COMBINE_REDUCED;
    const bool at_output = cfg->weight_at == MOE_WEIGHT_AT_OUTPUT;
    for (int r = 0; r < G; r++) {
        const double *rec = ranks + (size_t)r * rl->size;
        if (rec[rl->row] < 0)
            continue;
        if (ll) {
            printf("  %-11s rank %d%s: its buffer slots above\n", "arrives", r, r == home_rank ? " (its own rank)" : "");
        } else {
            printf("  %-11s rank %d%s: receive row %.0f of %.0f; ", "arrives", r,
                   r == home_rank ? " (its own rank)" : "", rec[rl->row], rec[rl->rows]);
            print_waves(ep, home, h, r, ctx->schedule.waves, r == home_rank);
        }
        for (int p = 0; p < (int)rec[rl->pairs]; p++) {
            const double *pair = rec + rl->pair + (size_t)p * (1 + SHOW);
            int slot = 0;
            while (slot < k && (int)home[h->ids + slot] != (int)pair[0])
                slot++;
            char label[32];
            snprintf(label, sizeof label, "expert %d", (int)pair[0]);
            print_row(label, pair + 1, d);
            for (int n = 0; n < SHOW && !reduced; n++)
                routed[n] += (at_output ? home[h->weights + slot] : 1.0) * pair[1 + n];
        }
        if (reduced) {
            print_row("back (sum)", rec + rl->sum, d);
            for (int n = 0; n < SHOW; n++)
                routed[n] += rec[rl->sum + n];
        } else {
            printf("  %-11s the %.0f output%s above, each its own row\n", "back",
                   rec[rl->pairs], rec[rl->pairs] == 1 ? "" : "s");
        }
    }
    if (reduced && cfg->dispatch == MOE_DISPATCH_HIERARCHICAL)
        print_node_sums(ctx, ranks, rl);
    printf("  %-11s %s\n", "combine",
           reduced && cfg->dispatch == MOE_DISPATCH_HIERARCHICAL
               ? "each rank sent its experts' outputs weighted and summed to the relay, each relay its "
                 "node's sum home; home adds the nodes' sums"
           : reduced ? (at_output ? "each rank sent its experts' outputs weighted and summed; home adds the sums"
                                : "each rank sent its experts' outputs summed (weights applied before L2)")
                   : (at_output ? "home sums weight x output over the k slots, in slot order"
                                : "home sums the k outputs (weights applied before L2), in slot order"));
    print_row("routed sum", routed, d);
    for (int s = 0; s < S; s++) {
        char label[32];
        snprintf(label, sizeof label, "shared %d", s);
        print_row(label, home + h->shared + (size_t)s * SHOW, d);
    }
    print_row("y", home + h->y, d);
    print_row("truth", home + h->truth, d);
    printf("  %-11s max |y - truth| over d = %.3g (truth rms %.3g)\n", "", home[h->diff],
           home[h->diff + 1]);
}

/* The widest matrix explain prints; past it, each rank's totals. */
enum { TRAFFIC_MATRIX_MAX = 16 };

/* "rows/pairs", as each cell of the traffic table reads; its length. */
static int traffic_cell(char *cell, size_t size, double rows, double pairs)
{
    return snprintf(cell, size, "%.0f/%.0f", rows, pairs);
}

/* Rank 0: rows (deduplicated) and pairs from each rank to each, in columns
 * as wide as the widest cell; past TRAFFIC_MATRIX_MAX ranks, what each rank
 * sends and receives in all. all: per rank, G rows then G pairs. */
static void print_traffic(const moe_run_context *ctx, const double *all)
{
    const int G = ctx->comm->ranks;
#define ROWS(from, to) all[(size_t)(from) * 2 * G + (to)]
#define PAIRS(from, to) all[(size_t)(from) * 2 * G + G + (to)]
    if (G > TRAFFIC_MATRIX_MAX) {
        printf("\nrows sent after deduplication / (token, expert) pairs they carry, each rank's "
               "totals (the matrix up to %d ranks):\n%10s %15s %15s\n",
               TRAFFIC_MATRIX_MAX, "", "sent", "received");
        for (int r = 0; r < G; r++) {
            double sent[2] = {0, 0}, received[2] = {0, 0};
            for (int o = 0; o < G; o++) {
                sent[0] += ROWS(r, o), sent[1] += PAIRS(r, o);
                received[0] += ROWS(o, r), received[1] += PAIRS(o, r);
            }
            char out[48], in[48];
            traffic_cell(out, sizeof out, sent[0], sent[1]);
            traffic_cell(in, sizeof in, received[0], received[1]);
            printf("  rank %-3d %15s %15s\n", r, out, in);
        }
        return;
    }
    int width = 2;
    for (int from = 0; from < G; from++)
        for (int to = 0; to < G; to++) {
            char cell[48];
            const int n = traffic_cell(cell, sizeof cell, ROWS(from, to), PAIRS(from, to));
            width = n > width ? n : width;
        }
    printf("\nrows sent after deduplication / (token, expert) pairs they carry, from each rank "
           "(row) to each (column):\n%8s", "");
    for (int r = 0; r < G; r++)
        printf(" %*d", width + 1, r);
    printf("\n");
    for (int from = 0; from < G; from++) {
        printf("  from %-2d", from);
        for (int to = 0; to < G; to++) {
            char cell[48];
            traffic_cell(cell, sizeof cell, ROWS(from, to), PAIRS(from, to));
            printf(" %*s", width + 1, cell);
        }
        printf("\n");
    }
#undef ROWS
#undef PAIRS
}

static void write_placement(FILE *out, const void *arg)
{
    moe_write_placement_svg(out, arg);
}

/* --placement-svg: rank 0 draws the experts' placement and the first
 * token's rows (its ids from the home record); every rank learns how it
 * went. */
static int placement_svg(moe_run_context *ctx, int64_t g, const double *home, const home_layout *h)
{
    const moe_ep *ep = &ctx->ep;
    const moe_comm *c = ctx->comm;
    moe_status local = {0};
    if (c->rank == 0) {
        int chosen[MOE_ROUTER_MAX_EXPERTS];
        for (int s = 0; s < h->k; s++)
            chosen[s] = (int)home[h->ids + s];
        char title[256];
        snprintf(title, sizeof title, "%d ranks in %d node%s of %d, %lld experts · token %lld's rows (%s dispatch)",
                 c->ranks, (c->ranks + ep->link.ranks_per_node - 1) / ep->link.ranks_per_node,
                 c->ranks > ep->link.ranks_per_node ? "s" : "", ep->link.ranks_per_node,
                 (long long)ctx->cfg.experts, (long long)g,
                 ctx->cfg.dispatch == MOE_DISPATCH_HIERARCHICAL ? "two-stage" : "flat");
        const moe_placement_picture picture = {
            title, c->ranks, ep->link.ranks_per_node, ep->placement.experts, ep->placement.first_expert,
            ep->replicas.phy2log, g, (int)(g / ctx->cfg.tokens), h->k, chosen,
            ctx->cfg.dispatch == MOE_DISPATCH_HIERARCHICAL};
        moe_write_file_atomic(ctx->cfg.placement_svg, write_placement, &picture, &local);
    }
    if (moe_comm_agree(c, &local))
        ctx->status = local;
    return local.code;
}

static int explain(moe_run_context *ctx, const int64_t *tokens, int count)
{
    const moe_comm *c = ctx->comm;
    const moe_config *cfg = &ctx->cfg;
    moe_ep *ep = &ctx->ep;
    const int G = c->ranks, k = (int)cfg->topk;
    const moe_index T = cfg->tokens, d = cfg->hidden;
    moe_ep_route(ep, ctx->x, ctx->logits, ctx->scores, ctx->ids, ctx->weights);
    moe_ep_capture cap = {0};
    moe_forward_stats stats;
    int rc = moe_ep_forward_ref(ep, ctx->x, ctx->ids, ctx->weights, ctx->y, &stats, &cap, &ctx->status);
    /* the two-stage dispatch's reduced combine sums again at each relay: the
     * output is that path's (the walk's rows and sums are the same) */
    if (!rc && !moe_config_truth_shares(cfg))
        rc = moe_ep_forward_hier(ep, ctx->x, ctx->ids, ctx->weights, ctx->y, &stats, &ctx->status);
    if (rc) {
        moe_ep_capture_free(&cap);
        return rc;
    }
    float *scratch = moe_xmalloc(sizeof(float) * (size_t)(T * d) + 1);
    const float *xd = moe_ep_dispatched_tokens(ep, ctx->x, scratch);
    moe_waves waves;
    moe_waves_init_by(&waves, &ep->placement, ctx->schedule.waves, T, cfg->wave_by);
    const home_layout h = home_layout_of(cfg);
    const rank_layout rl = rank_layout_of(cfg);
    double *home = moe_xcalloc(h.size, sizeof(double));
    double *homes = c->rank == 0 ? moe_xmalloc(sizeof(double) * h.size * (size_t)G) : NULL;
    double *mine = moe_xcalloc(rl.size, sizeof(double));
    double *ranks = c->rank == 0 ? moe_xmalloc(sizeof(double) * rl.size * (size_t)G) : NULL;
    if (c->rank == 0)
        printf("moe-ep explain · G=%d ranks · T=%lld tokens per rank · d=%lld f=%lld E=%lld k=%d · "
               "router %s · %lld shared · %s%s combine · W=%d (%s)\n",
               G, (long long)T, (long long)d, (long long)cfg->ffn, (long long)cfg->experts, k,
               moe_config_choice_name("router", cfg->router), (long long)cfg->shared_experts,
               cfg->mode == MOE_MODE_LOW_LATENCY ? "low-latency dispatch (one-sided), "
               : cfg->dispatch == MOE_DISPATCH_HIERARCHICAL ? "two-stage dispatch (IB, then NVLink), "
                                                             : "",
               moe_config_choice_name("combine", cfg->combine), ctx->schedule.waves,
               waves.kind == MOE_WAVES_EXPERT_SLOTS ? "expert-slot waves" : "token-chunk waves");
    for (int n = 0; n < count; n++) {
        const int64_t g = tokens[n];
        memset(home, 0, sizeof(double) * h.size);
        if (g / T == c->rank)
            fill_home(ctx, &waves, g % T, xd, &h, home);
        fill_rank(&cap, g, d, &rl, mine);
        moe_comm_gather_bytes(c, home, sizeof(double) * h.size, homes);
        moe_comm_gather_bytes(c, mine, sizeof(double) * rl.size, ranks);
        if (c->rank == 0)
            print_token(ctx, g, homes + (size_t)(g / T) * h.size, &h, ranks, &rl);
        if (n == 0 && cfg->placement_svg[0])
            rc = placement_svg(ctx, g, c->rank == 0 ? homes + (size_t)(g / T) * h.size : NULL, &h);
    }
    /* the per-rank view: rows to each rank after dedup, and the pairs they carry */
    double *counts = moe_xcalloc((size_t)(2 * G), sizeof(double));
    double *all = c->rank == 0 ? moe_xmalloc(sizeof(double) * (size_t)(2 * G * G)) : NULL;
    moe_send_plan plan;
    moe_send_plan_build(&plan, &ep->placement, ctx->ids, T, k, NULL, 0);
    for (int r = 0; r < G; r++)
        counts[r] = (double)plan.row_count[r];
    moe_send_plan_free(&plan);
    for (moe_index p = 0; p < T * k; p++)
        if (ctx->ids[p] != MOE_DROPPED) /* a masked pair of --routing */
            counts[G + ep->placement.expert_rank[ctx->ids[p]]] += 1.0;
    moe_comm_gather_bytes(c, counts, sizeof(double) * (size_t)(2 * G), all);
    if (c->rank == 0) {
        print_traffic(ctx, all);
        fflush(stdout);
    }
    free(all);
    free(counts);
    free(ranks);
    free(mine);
    free(homes);
    free(home);
    moe_waves_free(&waves);
    free(scratch);
    moe_ep_capture_free(&cap);
    if (cfg->dump[0] && !rc)
        rc = moe_dump_write(c, ep, ctx->cfg.dump, ctx->x, ctx->dy, NULL, &ctx->summary.dump_bytes, &ctx->status);
    return rc;
}

int moe_cli_explain(moe_comm *c, int argc, char **argv)
{
    if (moe_cli_help(c, argc, argv, print_usage))
        return MOE_EXIT_OK;
    moe_run_context ctx;
    int rc = moe_context_open(&ctx, c, MOE_CMD_EXPLAIN, argc, argv);
    if (rc)
        return rc;
    int64_t tokens[MAX_TOKENS];
    const int count =
        parse_tokens(ctx.cfg.explain, (int64_t)c->ranks * ctx.cfg.tokens, tokens, &ctx.status);
    rc = count ? explain(&ctx, tokens, count) : ctx.status.code;
    if (rc)
        moe_comm_print_error(c, &ctx.status);
    moe_context_close(&ctx);
    return rc;
}
