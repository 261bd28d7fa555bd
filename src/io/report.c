/* SPDX-License-Identifier: MIT */
/* report.c — rank 0's text report (see report.h). */
#include "moe/report.h"

#include "config.h"

#include <math.h>
#include <stdlib.h>

#include "moe/capacity.h"
#include "moe/cluster.h"
#include "moe/experts.h"
#include "moe/layout.h"
#include "moe/mask.h"
#include "moe/path.h"
#include "moe/router.h"
#include "moe/wire.h"
#include "moe/workload.h"

/* The links cannot do less than all the traffic, nor the cores less than
 * all the compute, and the routed experts cannot start before the first
 * wave's dispatch nor finish before the last wave's combine (together one
 * wave's traffic, T_comm/W). */
double moe_curve_bound(const moe_curve_point *p)
{
    const double routed = p->compute_seconds - p->fill_seconds;
    return fmax(fmax(p->comm_seconds, p->compute_seconds), routed + p->comm_seconds / p->waves);
}

static void print_spread(FILE *out, const char *what, moe_spread s)
{
    fprintf(out, "          %-34s min %-9.0f mean %-10.1f max %-9.0f imbalance %.2f\n", what,
            s.min, s.mean, s.max, s.mean > 0 ? s.max / s.mean : 0.0);
}

const char *const moe_grad_names[MOE_GRAD_TENSORS] = {
    "dx", "dW1 routed", "dW2 routed", "dW1 shared", "dW2 shared", "dW_g gate",
};

bool moe_report_check_passed(const moe_run_summary *s)
{
    const bool reference_ok =
        !s->ref_compared || !s->ref_bitwise_expected || s->ref_differ == 0.0;
    bool grads_ok = !s->backward || s->grads_identical;
    grads_ok = grads_ok && (!s->bwd_ref_compared || !s->bwd_ref_bitwise_expected ||
                            s->bwd_ref_differ == 0.0);
    for (int t = 0; t < MOE_GRAD_TENSORS; t++)
        if (s->grad_check[t].checked)
            grads_ok = grads_ok && !s->grad_check[t].nonfinite && s->grad_check[t].max_used <= 1.0;
    return s->checked && !s->nonfinite && s->cmp.max_used <= 1.0 && s->iterations_identical &&
           reference_ok && grads_ok;
}

/* --backward: the step's stages, its GEMM work and the four all-to-alls. */
static void print_backward(FILE *out, const moe_run_summary *s)
{
    char b1[32], b2[32], b3[32], b4[32], b5[32];
    fprintf(out, "backward  the forward's mirror: dy rows out along the dispatch's plan, dx rows "
                 "(%s) and dL/dweight per pair home along the combine's; ",
            s->cfg->combine == MOE_COMBINE_REDUCED ? "summed per token and rank at the source"
                                                   : "one per pair");
    if (s->bwd_one_pass)
        fprintf(out, "W = %lld waves of token chunks, in flight behind the shared experts and "
                     "the weight gradients, their data gradients in one pass (no --link: each "
                     "expert's weights read once)\n",
                (long long)s->cfg->waves_list[0]);
    else if (s->bwd_overlapped)
        fprintf(out, "W = %lld waves of token chunks, in flight behind the shared experts, the "
                     "other waves' data gradients and the weight gradients\n",
                (long long)s->cfg->waves_list[0]);
    else
        fprintf(out, "blocking\n");
    fprintf(out, "          ms per step, max over ranks, median of %lld: forward %.2f, step %.2f;",
            (long long)s->cfg->iters, 1e3 * s->layer_seconds, 1e3 * s->step_seconds);
    for (int n = 0; n < MOE_BWD_STAGES; n++)
        fprintf(out, "%s %s %.2f", n ? " ·" : "", moe_bwd_stage_names[n], 1e3 * s->bwd_seconds[n]);
    if (s->bwd_overlapped)
        fprintf(out, "\n          in flight (posted .. complete, max over ranks): combine backward "
                     "%.2f ms, dispatch backward %.2f ms; the stage times above are what the "
                     "computing thread spent posting and waiting",
                1e3 * s->bwd_in_flight[0], 1e3 * s->bwd_in_flight[1]);
    /* Rates per rank: each stage's FLOPs over the ranks, over its time on
     * the slowest rank. */
    const double G = s->ranks;
    fprintf(out, "\n          routed expert GEMMs, all ranks: forward %.3g GFLOP, dgrad %.3g "
                 "(h recomputed), wgrad %.3g (K = an expert's rows); per rank %.1f, %.1f and "
                 "%.1f GFLOP/s\n",
            1e-9 * s->expert_flops, 1e-9 * s->dgrad_flops, 1e-9 * s->wgrad_flops,
            s->stage_seconds[MOE_STAGE_EXPERTS] > 0 ? 1e-9 * s->expert_flops / G / s->stage_seconds[MOE_STAGE_EXPERTS] : 0.0,
            s->bwd_seconds[MOE_BWD_DGRAD] > 0 ? 1e-9 * s->dgrad_flops / G / s->bwd_seconds[MOE_BWD_DGRAD] : 0.0,
            s->bwd_seconds[MOE_BWD_WGRAD] > 0 ? 1e-9 * s->wgrad_flops / G / s->bwd_seconds[MOE_BWD_WGRAD] : 0.0);
    fprintf(out, "          the four all-to-alls of a step, all ranks: dispatch %s, combine %s, "
                 "combine backward %s (dy rows), dispatch backward %s (dx rows, dL/dweight); "
                 "in all %s · gradients bitwise identical across steps: %s\n",
            moe_format_bytes(s->bytes_dispatched, b1, sizeof b1),
            moe_format_bytes(s->bytes_combined, b2, sizeof b2),
            moe_format_bytes(s->bwd_bytes_combine, b3, sizeof b3),
            moe_format_bytes(s->bwd_bytes_dispatch, b4, sizeof b4),
            moe_format_bytes(s->bytes_dispatched + s->bytes_combined +
                                 s->bwd_bytes_combine + s->bwd_bytes_dispatch, b5, sizeof b5),
            s->grads_identical ? "yes" : "NO");
}

/* --backward --check: one line per gradient tensor. */
static void print_grad_checks(FILE *out, const moe_run_summary *s)
{
    for (int t = 0; t < MOE_GRAD_TENSORS; t++) {
        const moe_grad_check *g = &s->grad_check[t];
        if (!g->checked)
            continue;
        fprintf(out, "%s %-11s rms(truth) %.3e · max |diff| %.3e · tol %.0f u x (rms + |truth|) · "
                     "used %.1f%%%s\n",
                t == 0 ? "gradient " : "         ", moe_grad_names[t], g->rms, g->max_abs,
                g->length, 100.0 * g->max_used, g->nonfinite ? " · NON-FINITE" : "");
    }
}

static const char *const progress_names[] = {"poll", "thread"};

static const char *const dtype_names[] = {"fp32", "bf16", "fp8"};

/* The group-limited router against the nodes: DeepSeek-V3 keeps 4 of 8
 * groups so that a token reaches at most 4 nodes, which holds when the
 * groups are the nodes; say so when they are not. */
static void print_node_limit(FILE *out, const moe_run_summary *s)
{
    const moe_config *cfg = s->cfg;
    if (cfg->routing[0] || cfg->workload || cfg->router != MOE_ROUTER_DEEPSEEK_V3 || cfg->groups <= 1 ||
        cfg->topk_groups >= cfg->groups || cfg->groups == s->nodes)
        return;
    moe_placement p;
    moe_placement_init(&p, (int)cfg->experts, s->ranks);
    const int reach = moe_group_node_limit(&p, (int)cfg->groups, (int)cfg->topk_groups, s->ranks_per_node);
    moe_placement_free(&p);
    fprintf(out, "          note: %lld expert groups on %d nodes: keeping %lld groups lets a token "
                 "reach up to %d of the %d nodes; the node limit DeepSeek-V3 relies on (a token on "
                 "at most %lld nodes) holds when --groups is the node count, %d\n",
            (long long)cfg->groups, s->nodes, (long long)cfg->topk_groups, reach, s->nodes,
            (long long)cfg->topk_groups, s->nodes);
}

static void print_router(FILE *out, const moe_config *cfg)
{
    if (cfg->routing[0]) {
        fprintf(out, "top-%lld ids and weights replayed from %s (--routing) · weight on the %s",
                (long long)cfg->topk, cfg->routing,
                cfg->weight_at == MOE_WEIGHT_AT_OUTPUT ? "expert output" : "activation (before L2)");
        fprintf(out, "\n");
        return;
    }
    if (cfg->workload != MOE_WORKLOAD_NONE) {
        fprintf(out, "top-%lld ids and weights of workload W%d %s at step %lld (--workload, "
                     "docs/data.md §6) · weight on the %s",
                (long long)cfg->topk, cfg->workload - MOE_WORKLOAD_BALANCED,
                moe_workload_name(cfg->workload), (long long)cfg->workload_step,
                cfg->weight_at == MOE_WEIGHT_AT_OUTPUT ? "expert output" : "activation (before L2)");
        fprintf(out, "\n");
        return;
    }
    if (cfg->router == MOE_ROUTER_DEEPSEEK_V3 && cfg->bias_scale > 0)
        fprintf(out, "deepseek-v3 (sigmoid, correction bias in ±%g for selection, ", cfg->bias_scale);
    else if (cfg->router == MOE_ROUTER_DEEPSEEK_V3)
        fprintf(out, "deepseek-v3 without bias (V2 style: softmax, group max%s, ",
                moe_config_norm_topk(cfg) ? ", renormalised" : "");
    else
        fprintf(out, "softmax top-%lld%s", (long long)cfg->topk, moe_config_norm_topk(cfg) ? " (renormalised)" : "");
    if (cfg->router == MOE_ROUTER_DEEPSEEK_V3)
        fprintf(out, "top-%lld, %lld groups keep %lld, route scale %g)", (long long)cfg->topk,
                (long long)cfg->groups, (long long)cfg->topk_groups, cfg->route_scale);
    fprintf(out, " · weight on the %s", cfg->weight_at == MOE_WEIGHT_AT_OUTPUT ? "expert output" : "activation (before L2)");
    if (cfg->skew[0])
        fprintf(out, " · skew %s", cfg->skew);
    fprintf(out, "\n");
}

/* --mask-ranks: what the lost ranks cost the layer. */
static void print_mask(FILE *out, const moe_run_summary *s)
{
    const moe_config *cfg = s->cfg;
    const int G = s->ranks;
    bool lost[G];
    moe_status ignored;
    moe_mask_parse(cfg->mask_ranks, G, lost, &ignored);
    int ranks;
    const int experts = moe_mask_lost_experts(lost, G, (int)cfg->experts, &ranks);
    const double pairs = (double)G * (double)cfg->tokens * (double)cfg->topk;
    fprintf(out, "mask      %d of %d ranks lost (--mask-ranks %s): their %d of %lld experts "
                 "unreachable, their %lld tokens routed to no expert; %.0f of %.0f pairs dropped "
                 "(%.1f%%), each token's kept weights rescaled to its k weights' sum\n",
            ranks, G, cfg->mask_ranks, experts, (long long)cfg->experts,
            (long long)cfg->tokens * ranks, s->mask_dropped, pairs,
            pairs > 0 ? 100.0 * s->mask_dropped / pairs : 0.0);
}

/* --redundant-experts: the policy, the copies, the balance they buy, their
 * memory, and the placement table (G <= 16). */
static void print_replicas(FILE *out, const moe_run_summary *s)
{
    const moe_replicas *r = s->replicas;
    const moe_config *cfg = s->cfg;
    const int G = s->ranks, E = r->logical, P = r->physical, per_rank = P / G;
    fprintf(out, "replicas  EPLB %s: %d logical + %d redundant = %d physical experts, %d per rank; "
                 "load: %s\n",
            r->hierarchical ? "hierarchical (groups onto nodes, copies within each node, then onto its ranks)"
                            : "global (copies, then onto ranks)",
            E, P - E, P, per_rank,
            cfg->expert_load[0] ? cfg->expert_load
            : cfg->bias_update > 0 ? "the routing of the --eplb-window batches after the steps', under the "
                                     "final bias (placed again after the steps)"
                                   : "the routing of the --eplb-window batches of fresh tokens");
    fprintf(out, "          a pair goes to %s\n",
            cfg->replica_choice == MOE_REPLICA_DEDUP
                ? "a copy on a rank its token's rows go to anyway, if any (--replica-choice dedup)"
                : "a copy on its token's node, spread by token id (--replica-choice spread)");
    fprintf(out, "          copies:");
    int shown = 0;
    for (int e = 0; e < E; e++)
        if (r->copies[e] > 1 && shown++ < 12)
            fprintf(out, " e%d x%d (load %.0f)", e, r->copies[e], s->expert_load[e]);
    fprintf(out, "%s\n", shown > 12 ? " ..." : shown ? "; the others one" : " none (the load is even)");
    if (r->hierarchical && s->ranks_per_node == 1)
        fprintf(out, "          nodes of one rank (--ranks-per-node 1): the hierarchical policy keeps an "
                     "expert's copies on its own rank, where they balance nothing; nodes of several "
                     "ranks let them spread\n");
    print_spread(out, "tokens per physical expert", s->tokens_per_physical);
    fprintf(out, "          pairs per rank, max/mean: %.2f without copies (E/G experts a rank), %.2f with them\n",
            moe_max_over_mean(s->rank_pairs[0], G), moe_max_over_mean(s->rank_pairs[1], G));
    const double extra = (double)(P - E) * s->expert_bytes;
    fprintf(out, "          memory: the copies' weights, %.2f MiB in all, %.2f MiB a rank (%d experts a rank "
                 "instead of %.4g)\n", extra / 1048576.0, extra / G / 1048576.0, per_rank, (double)E / G);
    if (G > 16)
        return;
    for (int g = 0; g < G; g++) {
        fprintf(out, "          rank %-3d %7.0f pairs:", g, s->rank_pairs[1][g]);
        for (int p = g * per_rank; p < (g + 1) * per_rank; p++)
            fprintf(out, " %s%d", r->copies[r->phy2log[p]] > 1 ? "*" : "e", r->phy2log[p]);
        fprintf(out, "\n");
    }
    fprintf(out, "          (*: an expert with copies; each rank's experts in slot order)\n");
}

/* --capacity-factor: what was dropped, where, and what it saved. */
static void print_drops(FILE *out, const moe_run_summary *s)
{
    const moe_config *cfg = s->cfg;
    const int G = s->ranks, E = (int)cfg->experts;
    const double pairs = (double)cfg->tokens * (double)cfg->topk * G;
    const double kept = pairs - s->pairs_dropped;
    fprintf(out, "drops     capacity factor %g: each expert takes %lld of each rank's %lld x %lld "
                 "pairs (Megatron-Core's ceil(C T k / E)), keeping the %s\n",
            cfg->capacity_factor, (long long)s->capacity, (long long)cfg->tokens,
            (long long)cfg->topk,
            cfg->drop_policy == MOE_DROP_PROBS ? "largest gate weights (--drop-policy probs)"
                                               : "first tokens (--drop-policy position)");
    if (cfg->redundant_experts > 0)
        fprintf(out, "          with --redundant-experts the capacity is per logical expert, over all "
                     "its copies: the drops follow the logical load and can undo the balance the "
                     "copies made (see max/mean per rank below)\n");
    fprintf(out, "          dropped %.0f of %.0f pairs (%.2f%%)", s->pairs_dropped, pairs,
            pairs > 0 ? 100.0 * s->pairs_dropped / pairs : 0.0);
    int shown = 0;
    for (int e = 0; e < E; e++) {
        const double routed = s->tokens_expert[e];
        if (s->expert_dropped[e] > 0 && shown++ < 8)
            fprintf(out, "%s e%d %.1f%%", shown == 1 ? "; of expert" : ",", e,
                    100.0 * s->expert_dropped[e] / routed);
    }
    fprintf(out, "%s\n", shown > 8 ? ", ..." : "");
    double busiest = 0.0; /* the most pairs an expert computes */
    for (int e = 0; e < E; e++)
        busiest = fmax(busiest, s->tokens_expert[e] - s->expert_dropped[e]);
    fprintf(out, "          max/mean: pairs per expert %.2f routed, %.2f computed; per rank %.2f routed, "
                 "%.2f computed", moe_max_over_mean(s->tokens_expert, E),
            kept > 0 ? busiest / (kept / E) : 0.0, moe_max_over_mean(s->rank_pairs_routed, G),
            moe_max_over_mean(s->rank_pairs_kept, G));
    for (int g = 0; g < G && G <= 16; g++)
        fprintf(out, "%s%.1f%%", g ? " " : "; dropped per rank: ",
                s->rank_pairs_routed[g] > 0
                    ? 100.0 * (1.0 - s->rank_pairs_kept[g] / s->rank_pairs_routed[g]) : 0.0);
    fprintf(out, "\n");
    /* a dispatch row's bytes, and a combine row's (a row per dispatch row
     * with --combine reduced, per pair otherwise) */
    const bool per_row = cfg->combine == MOE_COMBINE_REDUCED && !s->path->low_latency;
    const double in_row = s->rows_sent > 0 ? s->bytes_dispatched / s->rows_sent : 0.0;
    const double back_rows = per_row ? s->rows_sent : kept;
    const double out_row = back_rows > 0 ? s->bytes_combined / back_rows : 0.0;
    const double saved_rows = s->rows_undropped - s->rows_sent;
    const double saved_back = per_row ? saved_rows : s->pairs_dropped;
    const double pair_flops = 6.0 * (double)cfg->hidden * (double)cfg->ffn;
    const double saved_flops = s->pairs_dropped * pair_flops;
    const double kept_flops = s->expert_flops - s->pad_rows * pair_flops; /* --pad-to-capacity's zero rows aside */
    char b1[32], b2[32];
    fprintf(out, "          saved: dispatch rows %.0f -> %.0f (%s), combine %s, expert GEMMs %.3f "
                 "GFLOP (%.1f%%)\n",
            s->rows_undropped, s->rows_sent, moe_format_bytes(saved_rows * in_row, b1, sizeof b1),
            moe_format_bytes(saved_back * out_row, b2, sizeof b2), saved_flops / 1e9,
            kept_flops + saved_flops > 0 ? 100.0 * saved_flops / (kept_flops + saved_flops) : 0.0);
    if (cfg->pad_to_capacity) {
        const double computed = kept + s->pad_rows;
        fprintf(out, "          padded: each expert computes G x C = %lld rows (--pad-to-capacity): %.0f zero "
                     "rows (%.1f%% of %.0f), %.3f GFLOP more; the output is the same, bit for bit\n",
                (long long)(G * s->capacity), s->pad_rows, computed > 0 ? 100.0 * s->pad_rows / computed : 0.0,
                computed, s->pad_rows * pair_flops / 1e9);
        fprintf(out, "          Megatron's padded all-to-all sends a row per pair, C per expert: %lld rows "
                     "from each rank, against %.0f dispatch rows a rank here\n",
                (long long)(E * s->capacity), s->rows_sent / G);
    }
}

static void print_routing(FILE *out, const moe_run_summary *s)
{
    const int G = s->ranks;
    fprintf(out, "routing   ");
    print_router(out, s->cfg);
    print_spread(out, "tokens per expert", s->tokens_per_expert);
    print_spread(out, "dispatch rows received per rank", s->rows_received);
    print_spread(out, "expert pairs computed per rank", s->pairs_received);
    if (s->replicas)
        print_replicas(out, s);
    if (s->capacity > 0)
        print_drops(out, s);
    const int layout = moe_config_layout(s->cfg);
    const double filled = s->pairs_received.mean * G, empty = s->layout_slots - filled;
    if (layout != MOE_LAYOUT_ROWS) {
        if (layout == MOE_LAYOUT_MASKED)
            fprintf(out, "          expert layout masked: per local expert C = G x N = %lld slots "
                         "(--max-tokens-per-rank N)",
                    (long long)G * (long long)moe_config_max_tokens(s->cfg));
        else
            fprintf(out, "          expert layout contiguous: each expert's rows padded to a "
                         "multiple of A = %lld (--expert-alignment)",
                    (long long)s->cfg->expert_alignment);
        fprintf(out, "; %.0f slots on all ranks%s, %.0f hold rows, %.0f (%.1f%%) %s, never "
                     "computed\n",
                s->layout_slots, s->waves > 1 && !s->path->low_latency ? " (one tensor per wave)" : "",
                filled, empty, s->layout_slots > 0 ? 100.0 * empty / s->layout_slots : 0.0,
                layout == MOE_LAYOUT_MASKED ? "empty" : "padding");
    }
    if (s->nodes_hist && s->nodes > 1) {
        double total = 0.0;
        for (int n = 0; n <= s->nodes; n++)
            total += s->nodes_hist[n];
        fprintf(out, "          nodes per token (%d virtual nodes of %d ranks):", s->nodes, s->ranks_per_node);
        for (int n = 1; n <= s->nodes; n++)
            if (s->nodes_hist[n] > 0)
                fprintf(out, "  %d: %.1f%%", n, 100.0 * s->nodes_hist[n] / total);
        fprintf(out, "\n");
        print_node_limit(out, s);
    }
    if (s->rank_expert_seconds && G > 1) {
        int slow = 0, fast = 0;
        for (int r = 1; r < G; r++) {
            slow = s->rank_expert_seconds[r] > s->rank_expert_seconds[slow] ? r : slow;
            fast = s->rank_expert_seconds[r] < s->rank_expert_seconds[fast] ? r : fast;
        }
        fprintf(out, "          expert time: slowest rank %d %.2f ms, fastest rank %d %.2f ms; "
                     "every rank waits for the slowest in the all-to-all\n",
                slow, 1e3 * s->rank_expert_seconds[slow], fast, 1e3 * s->rank_expert_seconds[fast]);
    }
    if (s->cfg->mask_ranks[0])
        print_mask(out, s);
}

/* A (G, G) matrix of bytes in KiB under its header. */
static void print_kib(FILE *out, const char *header, const double *matrix, int G)
{
    fprintf(out, "          %s:\n          %6s", header, "");
    for (int q = 0; q < G; q++)
        fprintf(out, " %7d", q);
    fprintf(out, "\n");
    for (int r = 0; r < G; r++) {
        fprintf(out, "          %6d", r);
        for (int q = 0; q < G; q++)
            fprintf(out, " %7.0f", matrix[r * G + q] / 1024.0);
        fprintf(out, "\n");
    }
}

/* The dispatch's bytes from rank to rank: the matrix up to 16 ranks (and
 * the two stages' as they cross the links), the spread of what each sends
 * and receives beyond. */
static void print_matrix(FILE *out, const moe_run_summary *s)
{
    const int G = s->ranks;
    char b1[32], b2[32], b3[32];
    if (s->matrix && G <= 16) {
        print_kib(out, "dispatch KiB, from rank (row) to rank (column)", s->matrix, G);
        if (s->wire)
            print_kib(out, "dispatch KiB as the two stages send it (over IB to each node's relay, then "
                           "within the node)", s->wire, G);
    } else if (s->matrix) {
        moe_spread out_bytes = {INFINITY, 0, 0}, in_bytes = {INFINITY, 0, 0};
        for (int r = 0; r < G; r++) {
            double sent = 0, got = 0;
            for (int q = 0; q < G; q++) {
                sent += s->matrix[r * G + q];
                got += s->matrix[q * G + r];
            }
            out_bytes = (moe_spread){fmin(out_bytes.min, sent), out_bytes.mean + sent / G, fmax(out_bytes.max, sent)};
            in_bytes = (moe_spread){fmin(in_bytes.min, got), in_bytes.mean + got / G, fmax(in_bytes.max, got)};
        }
        fprintf(out, "          dispatch per rank (G = %d, matrix left out): sent min %s mean %s max %s\n", G,
                moe_format_bytes(out_bytes.min, b1, sizeof b1), moe_format_bytes(out_bytes.mean, b2, sizeof b2),
                moe_format_bytes(out_bytes.max, b3, sizeof b3));
        fprintf(out, "          %*s received min %s mean %s max %s\n", 41, "",
                moe_format_bytes(in_bytes.min, b1, sizeof b1), moe_format_bytes(in_bytes.mean, b2, sizeof b2),
                moe_format_bytes(in_bytes.max, b3, sizeof b3));
    }
}

/* On virtual nodes: the bytes within and between nodes, the rows per token
 * of the flat and the two-stage dispatch, and what the links carried. */
static void print_nodes(FILE *out, const moe_run_summary *s)
{
    const moe_config *cfg = s->cfg;
    const int G = s->ranks;
    const double T = (double)cfg->tokens;
    char b1[32], b2[32];
    if (s->matrix && s->nodes > 1) {
        double intra = 0, inter = 0;
        for (int r = 0; r < G; r++)
            for (int q = 0; q < G; q++)
                if (r != q)
                    *(r / s->ranks_per_node == q / s->ranks_per_node ? &intra : &inter) += s->matrix[r * G + q];
        fprintf(out, "          dispatch between ranks: intra-node %s, inter-node %s (%.0f%%)\n",
                moe_format_bytes(intra, b1, sizeof b1), moe_format_bytes(inter, b2, sizeof b2),
                intra + inter > 0 ? 100.0 * inter / (intra + inter) : 0.0);
        const moe_node_rows *nr = &s->node_rows;
        fprintf(out, "          rows per token: the flat dispatch %.2f between nodes + %.2f within; the "
                     "two-stage %.2f between (once per other node reached) + %.2f within: %.0f%% "
                     "fewer on the inter-node tier\n",
                nr->flat_inter / (G * T), nr->flat_intra / (G * T), nr->two_stage_inter / (G * T),
                nr->two_stage_intra / (G * T),
                nr->flat_inter > 0 ? 100.0 * (1.0 - nr->two_stage_inter / nr->flat_inter) : 0.0);
        if (s->path->two_stage) {
            const double tokens = G * T, flat_rows = inter / moe_dispatch_row_bytes(cfg);
            fprintf(out, "          two-stage dispatch: %.0f rows between nodes (%.2f per token, once per "
                         "node reached but its own), %.0f forwarded within nodes; the flat dispatch "
                         "above sends %.0f rows between nodes (%.2f per token), %.0f%% more\n",
                    s->rows_inter, s->rows_inter / tokens, s->rows_intra, flat_rows,
                    flat_rows / tokens, s->rows_inter > 0 ? 100.0 * (flat_rows / s->rows_inter - 1.0) : 0.0);
        }
        if (s->tier_bytes[0] + s->tier_bytes[1] > 0)
            fprintf(out, "          on the links, as the link model charges them (dispatch and combine, "
                         "all ranks): intra-node %.0f B, inter-node %.0f B\n",
                    s->tier_bytes[0], s->tier_bytes[1]);
    }
}

static void print_traffic(FILE *out, const moe_run_summary *s)
{
    const moe_config *cfg = s->cfg;
    const int G = s->ranks;
    const double T = (double)cfg->tokens, k = (double)cfg->topk;
    char b1[32], b2[32], b3[32], b4[32];
    const double pairs = G * T * k, saved = pairs - s->rows_sent;
    const bool two_stage = s->path->two_stage, low_latency = s->path->low_latency;
    fprintf(out, "traffic   dispatch %s (%s to other ranks): ",
            moe_format_bytes(s->bytes_dispatched, b1, sizeof b1),
            moe_format_bytes(s->bytes_dispatched * (s->rows_sent > 0 ? s->rows_sent_remote / s->rows_sent : 0), b2, sizeof b2));
    if (low_latency) {
        const double N = (double)moe_config_max_tokens(cfg);
        fprintf(out, "%.0f rows, one per (token, expert) pair, not deduplicated (the normal path "
                     "sends %.0f, one per (token, rank)), each expert's as one block, no count "
                     "exchange\n", s->rows_sent, s->rows_one_wave);
        fprintf(out, "          combine  %s (%s from other ranks): one row per pair, summed at "
                     "home in slot order\n", moe_format_bytes(s->bytes_combined, b1, sizeof b1),
                moe_format_bytes(s->pairs_back_remote * moe_combine_row_bytes(cfg), b2, sizeof b2));
        fprintf(out, "          fixed buffers %s per rank in its MPI window: %lld local experts x "
                     "%d ranks x N = %.0f slots (--max-tokens-per-rank), a row, its meta and an "
                     "output each, and N x k staged rows and outputs\n",
                moe_format_bytes(moe_ll_buffer_bytes(cfg, G), b3, sizeof b3),
                (long long)((cfg->experts + G - 1) / G), G, N);
    } else if (two_stage) /* a row per hop: a token's rows add up over both */
        fprintf(out, "%.0f rows in two hops for %.0f (token, expert) pairs (see the tiers below)\n",
                s->rows_sent, pairs);
    else
        fprintf(out, "%.0f rows for %.0f (token, expert) pairs, dedup saved %.1f%%\n", s->rows_sent,
                pairs, pairs > 0 ? 100.0 * saved / pairs : 0.0);
    if (moe_report_wave_extra_rows(s) > 0)
        fprintf(out, "          W = %d waves of expert slots send %.0f rows more than one wave would "
                     "(+%.1f%%: a token goes once per wave holding one of its experts on a rank); "
                     "--wave-by tokens keeps the dedup\n",
                s->waves, moe_report_wave_extra_rows(s),
                100.0 * moe_report_wave_extra_rows(s) / s->rows_one_wave);
    if (!low_latency) {
        fprintf(out, "          combine  %s (%s from other ranks)", moe_format_bytes(s->bytes_combined, b1, sizeof b1),
                moe_format_bytes(s->pairs_back_remote * moe_combine_row_bytes(cfg), b2, sizeof b2));
        if (two_stage && cfg->combine == MOE_COMBINE_REDUCED)
            fprintf(out, ": one row per (token, rank) back to its relay, whose sums go home as one row "
                         "per (token, node) (--combine reduced)\n");
        else if (two_stage)
            fprintf(out, ": one row per (token, expert) pair back to its relay, and from the relay "
                         "home\n");
        else if (cfg->combine == MOE_COMBINE_REDUCED)
            fprintf(out, ": %.0f rows, one per (token, rank), each rank's pairs summed before they "
                         "travel (--combine reduced; the pairs would be %.0f)\n",
                    s->bytes_combined / moe_combine_row_bytes(cfg), pairs);
        else
            fprintf(out, ": one row per (token, expert) pair (--combine reduced sends %.0f, one per "
                         "(token, rank))\n", s->rows_one_wave > 0 ? s->rows_one_wave : s->rows_sent);
    }
    print_matrix(out, s);
    print_nodes(out, s);
    /* The seeds' arithmetic, with the wire rows (wire.h) in place of d x 4 B. */
    const moe_wire in = moe_wire_dispatch(cfg), back = moe_wire_combine(cfg);
    const double there = G * T * k * moe_dispatch_row_bytes(cfg), home = G * T * k * moe_combine_row_bytes(cfg);
    char what[96];
    if (in.dtype == MOE_DTYPE_FP8)
        snprintf(what, sizeof what, "d fp8 + %lld %s scales", (long long)moe_fp8_blocks(cfg->hidden),
                 in.scale_bytes == 1 ? "ue8m0" : "fp32");
    else
        snprintf(what, sizeof what, "d %s", in.dtype == MOE_DTYPE_BF16 ? "bf16" : "fp32");
    fprintf(out, "          without dedup, tokens x k x row: dispatch %.0f x %.0f x %.0f B (%s + %d meta "
                 "words) = %s, combine x %.0f B (d %s) = %s; per layer %s, per training step "
                 "(forward + backward) %s\n",
            G * T, k, moe_dispatch_row_bytes(cfg), what, MOE_META_WORDS((int)k),
            moe_format_bytes(there, b1, sizeof b1), (double)back.bytes,
            back.dtype == MOE_DTYPE_BF16 ? "bf16" : "fp32", moe_format_bytes(home, b2, sizeof b2),
            moe_format_bytes(there + home, b3, sizeof b3),
            moe_format_bytes(there + home + G * T * k * moe_backward_pair_bytes(cfg), b4, sizeof b4));
}

void moe_report_print_machine(FILE *out, const moe_run_summary *s)
{
    fprintf(out, "machine   %d ranks on this host · %d cores · threads per rank: %d OpenMP, %d BLAS",
            s->ranks_on_host, s->cores, s->threads, s->blas_threads);
    if (s->bound < s->cores)
        fprintf(out, " · each rank bound to %d core%s", s->bound, s->bound == 1 ? "" : "s");
    fprintf(out, "\n");
    const int busy = s->threads > s->blas_threads ? s->threads : s->blas_threads;
    if (busy > s->bound && s->bound < s->cores)
        fprintf(out, "          note: %d threads per rank on %d bound core%s time-slice; unbind the "
                     "ranks (Open MPI: --bind-to none) or use fewer threads\n",
                busy, s->bound, s->bound == 1 ? "" : "s");
    else if (busy > s->cores)
        fprintf(out, "          note: %d threads per rank on %d cores time-slice; use fewer "
                     "threads\n", busy, s->cores);
    else if (s->bound < s->cores && s->ranks_on_host * s->bound < s->cores)
        fprintf(out, "          note: the ranks' bindings leave %d of %d cores idle; unbind them "
                     "(Open MPI: --bind-to none) to use every core\n",
                s->cores - s->ranks_on_host * s->bound, s->cores);
}

/* The title line, the config and the machine. */
static void print_header(FILE *out, const moe_run_summary *s)
{
    const moe_config *cfg = s->cfg;
    const double G = s->ranks;
    if (s->path->low_latency)
        fprintf(out, "moe-ep %s · MoE forward with expert parallelism · low-latency mode, one-sided "
                     "MPI (%s) · gemm %s\n",
                PACKAGE_VERSION, cfg->rma == MOE_RMA_PUT ? "put: the sources push" : "get: the owners pull",
                moe_gemm_label((enum moe_gemm_kind)cfg->gemm));
    else if (s->waves > 0)
        fprintf(out, "moe-ep %s · MoE forward with expert parallelism · W = %d (%s) · "
                     "progress %s · gemm %s\n",
                PACKAGE_VERSION, s->waves,
                s->wave_kind == MOE_WAVES_EXPERT_SLOTS ? "expert slots" : "token chunks",
                progress_names[s->progress], moe_gemm_label((enum moe_gemm_kind)cfg->gemm));
    else
        fprintf(out, "moe-ep %s · MoE forward with expert parallelism · blocking reference "
                     "path · gemm %s\n",
                PACKAGE_VERSION, moe_gemm_label((enum moe_gemm_kind)cfg->gemm));
    fprintf(out, "config    preset %s · G=%d ranks · T=%lld tokens per rank (%.0f in all) · d=%lld · f=%lld\n",
            cfg->preset[0] ? cfg->preset : "(none)", s->ranks, (long long)cfg->tokens, G * (double)cfg->tokens,
            (long long)cfg->hidden, (long long)cfg->ffn);
    if (cfg->waves_fitted_from > 0)
        fprintf(out, "          W = %lld: the default of %lld waves fitted to T = %lld tokens (--waves "
                     "sets W)\n", (long long)cfg->waves_list[0], (long long)cfg->waves_fitted_from,
                (long long)cfg->tokens);
    char redundant[48] = "";
    if (cfg->redundant_experts)
        snprintf(redundant, sizeof redundant, " + %lld redundant", (long long)cfg->redundant_experts);
    fprintf(out, "          E=%lld routed experts%s (%d..%d per rank) · k=%lld · S=%lld shared · "
                 "seed %llu · %lld iters\n",
            (long long)cfg->experts, redundant,
            s->local_experts_min, s->local_experts_max,
            (long long)cfg->topk, (long long)cfg->shared_experts,
            (unsigned long long)cfg->seed, (long long)cfg->iters);
    moe_report_print_machine(out, s);
}

/* The stage times, the pipeline, the link model and the experts' rate. */
static void print_time(FILE *out, const moe_run_summary *s)
{
    const moe_config *cfg = s->cfg;
    const double G = s->ranks;
    fprintf(out, "time      ms per forward, max over ranks, median of %lld iters%s\n",
            (long long)cfg->iters,
            s->waves > 0 ? "; dispatch and combine: in flight, summed over waves" : "");
    fprintf(out, "         ");
    for (int n = 0; n < MOE_STAGES; n++)
        fprintf(out, " %9s", moe_stage_names[n]);
    fprintf(out, " %9s\n         ", "layer");
    for (int n = 0; n < MOE_STAGES; n++)
        fprintf(out, " %9.2f", 1e3 * s->stage_seconds[n]);
    fprintf(out, " %9.2f\n", 1e3 * s->layer_seconds);
    if (s->waves > 0) {
        /* Pipeline minus compute: waiting for the all-to-alls, for slower
         * ranks and in progress calls, so it may exceed the all-to-alls alone. */
        const double idle = s->pipeline_seconds - s->compute_seconds;
        const double overlap =
            moe_overlap(s->pipeline_seconds, s->compute_seconds, s->comm_seconds);
        fprintf(out, "pipeline  %.2f ms from first dispatch to last combine · compute %.2f ms "
                     "(shared experts in the waits %.2f) · all-to-alls alone %.2f ms · not computing "
                     "%.2f ms · overlap %.0f%% · in MPI_Test %.2f ms\n",
                1e3 * s->pipeline_seconds, 1e3 * s->compute_seconds, 1e3 * s->fill_seconds,
                1e3 * s->comm_seconds, 1e3 * idle, 100.0 * overlap, 1e3 * s->test_seconds);
    }

    /* Ranks that share cores do not compute at the same moment: the aggregate
     * rate divides by the window in which any rank computed, never by one
     * rank's time, so it cannot exceed what the cores can do. */
    if (s->path->low_latency && s->link && s->link->enabled) {
        char text[160];
        moe_link_describe(s->link, text, sizeof text);
        fprintf(out, "link      emulated (docs/link-model.md): %s; dispatch and combine each "
                     "complete at their modelled time, a push after one latency, a pull after two "
                     "(the ready mark, then the rows)\n", text);
    }
    if (s->waves > 0 && s->link && s->link->enabled) {
        char text[160];
        moe_link_describe(s->link, text, sizeof text);
        fprintf(out, "link      emulated (docs/link-model.md): %s\n", text);
        /* C: a rank's expert FLOP/s, measured (cb) or from this run. */
        const double C = s->rank_flops > 0 ? s->rank_flops
                         : s->expert_seconds > 0 ? s->expert_flops / G / s->expert_seconds : 0.0;
        /* The slower tier the layer's messages cross: one node has no inter-node link. */
        const double B = s->nodes > 1 && s->link->bandwidth[MOE_TIER_INTER] < s->link->bandwidth[MOE_TIER_INTRA]
                             ? s->link->bandwidth[MOE_TIER_INTER] : s->link->bandwidth[MOE_TIER_INTRA];
        const double cb = C / B;
        /* FLOPs this layer does per byte it moves between ranks (dispatch +
         * combine; messages to self cross no link). */
        const double remote = s->bytes_dispatched * (s->rows_sent > 0 ? s->rows_sent_remote / s->rows_sent : 0) +
                              s->pairs_back_remote * moe_combine_row_bytes(cfg);
        const double need = remote > 0 ? s->expert_flops / remote : INFINITY;
        const double seed = moe_seed_flops_per_byte((double)cfg->ffn);
        fprintf(out, "          C/B = %.0f FLOP/byte (C = %.1f GFLOP/s per rank%s, B = %.3g GB/s) · "
                     "overlap bound min(1, 2d/(C/B)) = %.0f%% (seed; its 2d is 2 d_ff = %.0f, "
                     "docs/plan.md) · this layer does %.0f FLOP per byte moved: min(1, %.0f/(C/B)) "
                     "= %.0f%%\n",
                cb, C * 1e-9, s->rank_flops > 0 ? ", measured" : "", B * 1e-9,
                100.0 * fmin(1.0, seed / cb), seed, need, need, 100.0 * fmin(1.0, need / cb));
    }

    /* The window holds the shared experts that ran in the pipeline's waits:
     * the aggregate counts their FLOPs too. */
    char fill[96] = "";
    if (s->fill_flops > 0)
        snprintf(fill, sizeof fill, ", with the shared experts' %.2f GFLOP run in it", s->fill_flops * 1e-9);
    fprintf(out, "experts   %.2f GFLOP per forward in the expert GEMMs · %.1f GFLOP/s aggregate (over the "
                 "window any rank computed, %.2f ms%s) · slowest rank %.2f ms\n",
            s->expert_flops * 1e-9,
            s->expert_window > 0 ? (s->expert_flops + s->fill_flops) * 1e-9 / s->expert_window : 0.0,
            1e3 * s->expert_window, fill, 1e3 * s->expert_seconds);
}

/* With --waves W1,W2,...: each W's pipeline against its bound. */
static void print_curve(FILE *out, const moe_run_summary *s)
{
    const moe_config *cfg = s->cfg;
    if (s->curve_count > 1) {
        /* Each point against moe_curve_bound, and the seed's five-stage
         * formula T(1 + 4/W), T = (T_compute + T_comm)/5 at the first W (the
         * routed experts' compute: the seed's stages), which assumes five
         * equal stages on five resources. */
        const moe_curve_point *first = &s->curve[0];
        /* rows against one wave of the same dispatch (the two-stage one's waves
         * of tokens keep its dedup: its first point is the base) */
        const double base = s->path->two_stage ? first->rows_sent : s->rows_one_wave;
        const double stage = (first->compute_seconds - first->fill_seconds + first->comm_seconds) / 5.0;
        fprintf(out, "curve     speed-up against W = %d, per forward, ms (median of %lld iters each)\n",
                first->waves, (long long)cfg->iters);
        fprintf(out, "          %4s %-12s %9s %8s %9s %8s %8s %9s %9s %8s %8s %8s\n", "W", "waves", "layer",
                "speedup", "pipeline", "compute", "comm", "bound", "pipe/bnd", "overlap", "T(1+4/W)",
                "rows");
        for (int n = 0; n < s->curve_count; n++) {
            const moe_curve_point *p = &s->curve[n];
            const double W = p->waves, Tc = p->compute_seconds, Tm = p->comm_seconds;
            const double bound = moe_curve_bound(p);
            fprintf(out, "          %4d %-12s %9.2f %8.2f %9.2f %8.2f %8.2f %9.2f %9.2f %7.0f%% %8.2f %+7.1f%%\n",
                    p->waves, p->wave_kind == MOE_WAVES_EXPERT_SLOTS ? "expert slots" : "token chunks",
                    1e3 * p->layer_seconds, first->layer_seconds / p->layer_seconds,
                    1e3 * p->pipeline_seconds, 1e3 * Tc, 1e3 * Tm, 1e3 * bound,
                    p->pipeline_seconds / bound,
                    100.0 * moe_overlap(p->pipeline_seconds, Tc, Tm),
                    1e3 * stage * (1.0 + 4.0 / W),
                    base > 0 ? 100.0 * (p->rows_sent / base - 1.0) : 0.0);
        }
    }
}

/* --wave-by auto under --link: each W's two estimates and the grouping it ran. */
static void print_grouping(FILE *out, const moe_run_summary *s)
{
    const moe_config *cfg = s->cfg;
    if (!s->wave_choices)
        return;
    const moe_wave_estimate *first = NULL;
    for (int n = 0; n < cfg->waves_count && !first; n++)
        if (s->wave_choices[n].waves > 1)
            first = &s->wave_choices[n].estimate[MOE_WAVES_TOKEN_CHUNKS];
    fprintf(out, "grouping  --wave-by auto: each W runs the grouping estimated faster, ms: max(comm, first "
                 "dispatch + compute + last combine, compute + shared experts %.2f), uniform routing, "
                 "experts timed at each one's batches (docs/waves.md)\n",
            first ? 1e3 * first->shared : 0.0);
    fprintf(out, "          %4s %13s %8s %8s %13s %8s %8s   %s\n", "W", "expert slots", "comm", "compute",
            "token chunks", "comm", "compute", "runs");
    for (int n = 0; n < cfg->waves_count; n++) {
        const moe_wave_choice *c = &s->wave_choices[n];
        if (c->waves < 2)
            continue;
        const moe_wave_estimate *e = &c->estimate[MOE_WAVES_EXPERT_SLOTS], *t = &c->estimate[MOE_WAVES_TOKEN_CHUNKS];
        if (e->time > 0)
            fprintf(out, "          %4d %13.2f %8.2f %8.2f", c->waves, 1e3 * e->time, 1e3 * e->comm, 1e3 * e->compute);
        else
            fprintf(out, "          %4d %13s %8s %8s", c->waves, "-", "", "");
        fprintf(out, " %13.2f %8.2f %8.2f   %s\n", 1e3 * t->time, 1e3 * t->comm, 1e3 * t->compute,
                c->by == MOE_WAVE_BY_TOKENS ? "token chunks" : "expert slots");
    }
}

/* The slow-rank finder: how long each rank waited for each source's rows,
 * and the rank the others waited for longest when it stands out
 * (moe_waits_analyze). */
static void print_waits(FILE *out, const moe_run_summary *s)
{
    const int G = s->ranks, W = s->posted_waves, A = s->posted_agreements;
    if (!s->posted || !s->matrix || G < 2)
        return;
    double *waits = moe_xmalloc(sizeof(double) * 2 * (size_t)G * (size_t)G);
    int *last = moe_xmalloc(sizeof(int) * (size_t)G);
    const int slow = moe_waits_analyze(G, W, A, s->posted_side, s->posted, s->matrix, waits, last);
    int posted = 0;
    for (int r = 0; r < G; r++)
        posted += last[r];
    if (posted > 0 && G <= 16) {
        fprintf(out, "waits     ms each rank (row) had posted an all-to-all or reached an agreement "
                     "before a source (column) that sends it rows did, the last forward (%d wave%s)\n"
                     "          %-*s  combine\n          %6s", W, W == 1 ? "" : "s", 6 + 8 * G,
                "dispatch", "");
        for (int half = 0; half < 2; half++)
            for (int q = 0; q < G; q++)
                fprintf(out, " %7d", q);
        fprintf(out, "\n");
        for (int r = 0; r < G; r++) {
            fprintf(out, "          %6d", r);
            for (int half = 0; half < 2; half++)
                for (int q = 0; q < G; q++)
                    fprintf(out, " %7.2f", 1e3 * waits[((size_t)half * G + r) * G + q]);
            fprintf(out, "\n");
        }
    }
    double waited[2];
    int ranked[2];
    moe_waits_slow(G, waits, waited, ranked);
    if (posted > 0 && slow >= 0)
        fprintf(out, "verdict   rank %d is the slow one: the others waited %.2f ms for its rows in all "
                     "(the next, rank %d, %.2f ms), and it was last in %d of the %d all-to-alls and "
                     "agreements\n",
                slow, 1e3 * waited[0], ranked[1], 1e3 * waited[1], last[slow], 2 * W + A);
    else if (posted > 0)
        fprintf(out, "verdict   no rank stands out: the others waited longest for rank %d, %.2f ms in "
                     "all, then rank %d, %.2f ms (a slow rank is waited for %.0f ms or more, and twice "
                     "as long as any other)\n",
                ranked[0], 1e3 * waited[0], ranked[1], 1e3 * waited[1], 1e3 * MOE_SLOW_MIN_SECONDS);
    free(last);
    free(waits);
}

/* The golden set written, and the memory. */
static void print_outputs(FILE *out, const moe_run_summary *s)
{
    const moe_config *cfg = s->cfg;
    if (cfg->dump[0]) {
        char size[32];
        fprintf(out, "golden    %s: %s in %.2f s (moe-ep verify %s CANDIDATE.safetensors)\n", cfg->dump,
                moe_format_bytes(s->dump_bytes, size, sizeof size), s->dump_seconds, cfg->dump);
    }
    if (s->rss_peak > 0) {
        char peak[32], estimate[32];
        fprintf(out, "memory    peak resident %s on the fullest rank; estimated up front %s "
                     "(refused when past what the machine has free)\n",
                moe_format_bytes(s->rss_peak, peak, sizeof peak),
                moe_format_bytes(s->memory_estimate, estimate, sizeof estimate));
    }
}

/* --check: the truth, the comparisons and the verdict. */
static void print_check(FILE *out, const moe_run_summary *s)
{
    const moe_config *cfg = s->cfg;
    const double G = s->ranks;
    fprintf(out, "truth     dense fp64: all %lld experts on all %.0f tokens, gate-weighted "
                 "(zero when not selected), plus shared experts\n",
            (long long)cfg->experts, G * (double)cfg->tokens);
    fprintf(out, "          rms(truth) %.3e · worst element: token %lld (rank %d) column %lld · "
                 "iterations bitwise identical: %s\n",
            s->ref_rms, s->worst_token, s->worst_rank, s->worst_column,
            s->iterations_identical ? "yes" : "NO");
    if (s->nonfinite)
        fprintf(out, "          non-finite output at token %lld (rank %d) column %lld\n",
                s->worst_token, s->worst_rank, s->worst_column);
    if (s->drop_error_measured)
        fprintf(out, "          the truth drops the same pairs, decided again from the routing; against "
                     "the truth of every pair max |diff| %.3e = %.2e x rms (the cost of the drops, not "
                     "checked)\n", s->drop_max_abs, s->drop_max_rel_rms);
    if (s->quantised)
        fprintf(out, "precision weights and tokens %s%s, dispatch %s%s%s%s%s, combine %s%s%s%s%s: against the fp32 "
                     "truth max |diff| %.3e = %.2e x rms (the cost of the precision, not checked)\n",
                dtype_names[cfg->param_dtype],
                cfg->param_dtype != MOE_DTYPE_FP8 ? ""
                : cfg->fp8_scale ? " (expert weights E4M3, UE8M0 scales per 128 x 128; gate and tokens bf16)"
                                 : " (expert weights E4M3, fp32 scales per 128 x 128; gate and tokens bf16)",
                dtype_names[cfg->dispatch_dtype],
                cfg->dispatch_dtype == MOE_DTYPE_FP8 ? (cfg->fp8_scale ? " (E4M3, UE8M0 scales per 128" : " (E4M3, fp32 scales per 128") : "",
                cfg->dispatch_dtype == MOE_DTYPE_FP8 ? ", recipe " : "",
                cfg->dispatch_dtype == MOE_DTYPE_FP8 ? moe_config_choice_name("fp8-recipe", cfg->fp8_recipe) : "",
                cfg->dispatch_dtype == MOE_DTYPE_FP8 ? ")" : "",
                dtype_names[cfg->combine_dtype],
                cfg->output_dtype == MOE_DTYPE_BF16 ? ", output bf16" : "",
                cfg->gemm_out_dtype == MOE_DTYPE_BF16 ? ", experts' GEMM outputs bf16" : "",
                cfg->act_dtype != MOE_DTYPE_FP32 ? ", activation " : "",
                cfg->act_dtype != MOE_DTYPE_FP32 ? dtype_names[cfg->act_dtype] : "", s->quant_max_abs,
                s->quant_max_rel_rms);
    if (s->ref_compared)
        fprintf(out, "          vs the blocking %s: %s (%.0f values differ, max |diff| "
                     "%.3e; %s)\n",
                s->ref_two_stage ? "two-stage path (its sums, not the flat path's)" : "reference path",
                s->ref_differ == 0.0 ? "bitwise identical" : "differs", s->ref_differ,
                s->ref_max_diff,
                s->ref_bitwise_expected ? "bitwise expected"
                                        : "token-chunk waves with blas: within tolerance expected");
    print_grad_checks(out, s);
    if (s->bwd_ref_compared)
        fprintf(out, "          backward vs the blocking backward: %s (%.0f gradient values "
                     "differ; %s)\n",
                s->bwd_ref_differ == 0.0 ? "bitwise identical" : "differs", s->bwd_ref_differ,
                s->bwd_ref_bitwise_expected ? "bitwise expected"
                                            : "waves with blas: the truth's tolerance expected");
    const moe_expert_rounding rounding = moe_expert_rounding_of(cfg);
    fprintf(out, "check: %s max_abs=%.3e max_rel=%.3e tol=%.3e+%.3e*|ref|%s%s%s used=%.1f%%\n",
            moe_report_check_passed(s) ? "PASS" : "FAIL", s->cmp.max_abs, s->cmp.max_rel,
            s->tol.abs, s->tol.rel,
            cfg->combine_dtype == MOE_DTYPE_BF16 ? "+1 bf16 step per combined term" : "",
            cfg->output_dtype == MOE_DTYPE_BF16 ? "+1 bf16 step of the output" : "",
            moe_expert_rounds(&rounding) ? "+the experts' rounding intervals" : "",
            100.0 * s->cmp.max_used);
}

double moe_report_wave_extra_rows(const moe_run_summary *s)
{
    const bool flat = !s->path->low_latency && !s->path->two_stage; /* one row per (token, rank) */
    return flat && s->rows_one_wave > 0 && s->rows_sent > s->rows_one_wave
               ? s->rows_sent - s->rows_one_wave
               : 0.0;
}

void moe_report_print(FILE *out, const moe_run_summary *s)
{
    print_header(out, s);
    print_routing(out, s);
    print_traffic(out, s);
    if (s->backward)
        print_backward(out, s);
    print_time(out, s);
    print_grouping(out, s);
    print_curve(out, s);
    print_waits(out, s);
    print_outputs(out, s);
    if (s->checked)
        print_check(out, s);
}
