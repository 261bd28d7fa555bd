/* SPDX-License-Identifier: MIT */
/* plan.c — `moe-ep plan`: the seeds' arithmetic for a model on a cluster.
 *
 * No communication happens: rank 0 prints (any other rank stays quiet), so
 * `moe-ep plan` runs with or without mpirun. The numbers come from
 * src/core/cluster.c; docs/plan.md gives the formulas.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe/cli.h"
#include "moe/cluster.h"
#include "moe/eplb.h"
#include "moe/layout.h"
#include "moe/mask.h"
#include "moe/router.h"
#include "moe/routing.h"
#include "moe/wire.h"

static void print_usage(FILE *out)
{
    fprintf(out,
            "usage: moe-ep plan [--preset MODEL] [--cluster CLUSTER] [flags]\n"
            "\n"
            "The arithmetic of expert parallelism for a model on a cluster: parameters,\n"
            "experts per GPU, all-to-all bytes per GPU per layer and per step, compute and\n"
            "communication time per layer, C/B and the overlap bound, the wave pipeline.\n"
            "Flags override the presets, whatever their order.\n"
            "\n");
    moe_config_print_flags(out, MOE_CMD_PLAN);
    /* One call each: moe_config_data_path returns the same static buffer. */
    fprintf(out, "  --help                 this text\n\nModels: %s\n", moe_config_data_path("presets"));
    fprintf(out, "Clusters: %s\n", moe_config_data_path("clusters"));
}

static const char *const dtype_names[] = {"fp32", "bf16", "fp8"};

/* 653.9B, 44.04M, ... */
static char *count(double v, char *buf, size_t size)
{
    if (v >= 1e12)
        snprintf(buf, size, "%.2fT", v / 1e12);
    else if (v >= 1e9)
        snprintf(buf, size, "%.2fB", v / 1e9);
    else if (v >= 1e6)
        snprintf(buf, size, "%.2fM", v / 1e6);
    else
        snprintf(buf, size, "%.0f", v);
    return buf;
}

/* Decimal bytes, as the seeds write them: 1.31 TB, 234.9 MB. */
static char *bytes(double v, char *buf, size_t size)
{
    static const char *const units[] = {"B", "KB", "MB", "GB", "TB", "PB"};
    int u = 0;
    while (v >= 1000.0 && u < 5) {
        v /= 1000.0;
        u++;
    }
    snprintf(buf, size, u ? "%.2f %s" : "%.0f %s", v, units[u]);
    return buf;
}

static void print_plan(const moe_config *cfg, const moe_cluster *p)
{
    char a[32], b[32], c[32], d[32];
    printf("moe-ep plan · model %s · cluster %s\n", cfg->preset[0] ? cfg->preset : "(flags)",
           cfg->cluster[0] ? cfg->cluster : "(flags)");
    printf("model     d=%lld f=%lld · E=%lld routed + %lld shared · k=%lld · groups %lld keep %lld · "
           "%lld layers, %lld MoE · weights %s, dispatch %s, combine %s\n",
           (long long)cfg->hidden, (long long)cfg->ffn, (long long)cfg->experts,
           (long long)cfg->shared_experts, (long long)cfg->topk, (long long)cfg->groups,
           (long long)cfg->topk_groups, (long long)cfg->layers, (long long)cfg->moe_layers,
           dtype_names[cfg->param_dtype], dtype_names[cfg->dispatch_dtype],
           dtype_names[cfg->combine_dtype]);
    printf("params    per expert 3 x d x f = 3 x %lld x %lld = %.0f\n", (long long)cfg->hidden,
           (long long)cfg->ffn, p->params_per_expert);
    printf("          per MoE layer: routed %lld x %s = %s, shared %s\n", (long long)cfg->experts,
           count(p->params_per_expert, a, sizeof a), count(p->routed_per_layer, b, sizeof b),
           count(p->shared_per_layer, c, sizeof c));
    printf("          routed, %lld MoE layers: %s = %s in %s\n", (long long)cfg->moe_layers,
           count(p->routed_total, a, sizeof a), bytes(p->routed_bytes, b, sizeof b),
           dtype_names[cfg->param_dtype]);
    printf("cluster   %lld GPUs, %lld per node · EP %lld over %d nodes · NVLink %g GB/s, IB %g GB/s "
           "per GPU · %g TFLOP/s per GPU\n",
           (long long)cfg->gpus, (long long)cfg->gpus_per_node, (long long)cfg->ep, p->ep_nodes,
           cfg->intra_bw, cfg->inter_bw, cfg->tflops);
    printf("experts   per GPU per MoE layer: %lld / %lld = %g\n", (long long)cfg->experts,
           (long long)cfg->ep, p->experts_per_gpu);
    printf("traffic   per GPU per MoE layer, T = %lld tokens: dispatch T x k x d x %g B = %s, combine "
           "x %g B = %s\n",
           (long long)cfg->tokens, moe_dtype_bytes(cfg->dispatch_dtype),
           bytes(p->dispatch_bytes, a, sizeof a), moe_dtype_bytes(cfg->combine_dtype),
           bytes(p->combine_bytes, b, sizeof b));
    printf("          on the wire (wire.h; the times below): dispatch T x k x %.0f B (values, %s, "
           "%d meta words) = %s, combine T x k x %.0f B = %s\n",
           moe_dispatch_row_bytes(cfg),
           cfg->dispatch_dtype == MOE_DTYPE_FP8 ? "fp32 scales per 128" : "no scales",
           MOE_META_WORDS((int)cfg->topk), bytes(p->dispatch_wire_bytes, a, sizeof a),
           moe_combine_row_bytes(cfg), bytes(p->combine_wire_bytes, b, sizeof b));
    printf("          per step, %lld MoE layers: forward %s, forward + backward %s\n",
           (long long)cfg->moe_layers, bytes(p->step_forward_bytes, a, sizeof a),
           bytes(p->step_training_bytes, b, sizeof b));
    printf("          %.1f%% of the (token, expert) copies leave their node", 100.0 * p->remote_fraction);
    if (p->node_limited_copies > 0 && cfg->groups > 1)
        printf("; node-limited routing keeps a token on at most %lld of %d nodes, and its k = %lld "
               "experts reach %.2f on average (%s)",
               (long long)cfg->topk_groups, p->ep_nodes, (long long)cfg->topk, p->node_limited_copies,
               cfg->nodes_per_token[0] ? "the --nodes-per-token histogram" : "sampled from the router over 256 tokens");
    printf("\n          copies of a token: %.2f over IB, %.2f over NVLink (per token, on average)\n",
           p->inter_copies, p->intra_copies);
    if (p->experts_per_node > 0 && cfg->groups > 1)
        printf("          the headroom DeepSeek-V3 cites (report 3.2.2): up to 3.2 experts a node cost no "
               "more NVLink than one, so %lld nodes could serve %lld x 3.2 = %.1f experts a token at the "
               "IB cost of k = %lld; this router takes %.2f a node (k / %.2f nodes)\n",
               (long long)cfg->topk_groups, (long long)cfg->topk_groups, 3.2 * (double)cfg->topk_groups,
               (long long)cfg->topk, p->experts_per_node, p->node_limited_copies);
    printf("parallel  %lld GPUs = PP %lld x EP %lld x DP %d · a GPU holds %lld / %lld = %.1f MoE layers; "
           "once a step, per MoE layer and GPU: its %g experts' gradients %s, all-reduced over the DP = %d "
           "replicas that hold them (ring: 2(n-1)/n x, %s sent), the shared experts' and gate's %s over "
           "EP x DP = %lld (%s sent)\n",
           (long long)cfg->gpus, (long long)cfg->pp, (long long)cfg->ep, p->dp,
           (long long)cfg->moe_layers, (long long)cfg->pp, p->layers_per_stage, p->experts_per_gpu,
           bytes(p->expert_grad_bytes, a, sizeof a), p->dp, bytes(p->expert_sync_bytes, b, sizeof b),
           bytes(p->replicated_grad_bytes, c, sizeof c), (long long)(p->dp * cfg->ep),
           bytes(p->replicated_sync_bytes, d, sizeof d));
    printf("          against the all-to-alls' %s a layer for every micro-batch of T = %lld tokens "
           "(forward and backward; an all-to-all sends (n-1)/n of its rows once and sums nothing): "
           "they grow with the tokens, the gradients' bytes are paid once a step\n",
           bytes(p->layer_a2a_bytes, a, sizeof a), (long long)cfg->tokens);
    printf("time      per GPU per MoE layer, forward: experts 6 T k d f / FLOP/s = %.2f ms; "
           "all-to-alls %.2f ms; compute : comm = 1 : %.2f\n",
           1e3 * p->compute_seconds, 1e3 * p->comm_seconds,
           p->compute_seconds > 0 ? p->comm_seconds / p->compute_seconds : 0.0);
    if (p->ep_nodes > 1)
        printf("C/B       hardware, per tier: NVLink %.0f, IB %.0f FLOP/byte · workload: this layer "
               "6f / (%g + %g B) = %.0f FLOP per byte moved; the seed's \"2d\" (2 d_ff, docs/plan.md) = %.0f\n",
               p->cb_intra, p->cb_inter, moe_dtype_bytes(cfg->dispatch_dtype),
               moe_dtype_bytes(cfg->combine_dtype), p->layer_need, p->seed_need);
    else
        printf("C/B       hardware: NVLink %.0f FLOP/byte (one node: no inter-node link) · workload: "
               "this layer 6f / (%g + %g B) = %.0f FLOP per byte moved; the seed's \"2d\" (2 d_ff) = %.0f\n",
               p->cb_intra, moe_dtype_bytes(cfg->dispatch_dtype), moe_dtype_bytes(cfg->combine_dtype),
               p->layer_need, p->seed_need);
    printf("overlap   at most %.0f%% of this layer's all-to-all time can hide behind its expert GEMMs "
           "(min(1, compute / comm)); the seed's rule min(1, 2d/(C/B)) on the %s link gives %.0f%%\n",
           100.0 * p->overlap_bound, p->ep_nodes > 1 ? "inter-node" : "intra-node",
           100.0 * p->overlap_seed);
    const double W = (double)cfg->waves_list[0];
    printf("pipeline  one after the other %.2f ms; W = %.0f waves at best max(comm, compute + comm/W) "
           "= %.2f ms (%.2fx)\n",
           1e3 * p->naive_seconds, W, 1e3 * p->wave_seconds,
           p->wave_seconds > 0 ? p->naive_seconds / p->wave_seconds : 0.0);
    printf("          the seed's five equal stages T(1 + 4/W) = %.2f ms assume five resources%s\n",
           1e3 * p->seed_wave_seconds,
           p->seed_wave_seconds < fmax(p->comm_seconds, p->compute_seconds)
               ? ": below the all-to-all or GEMM time alone here, so not reachable"
               : "");
    printf("          perfect overlap caps any schedule's speed-up at (compute + comm) / max(compute, "
           "comm) = %.2fx here (2x when the two are equal); the seeds' Comet 1.42x and MegaMoE 1.92x "
           "are figures for layers near that balance\n", p->overlap_cap);
    /* Decode: the low-latency mode's fixed buffers (ep_ll.c) on this EP group. */
    moe_config decode = *cfg;
    const int64_t N = moe_config_max_tokens(cfg);
    decode.max_tokens_per_rank = N;
    char bytes[32];
    printf("decode    --mode low-latency's fixed buffers for N = %lld tokens per GPU "
           "(--max-tokens-per-rank): %lld local experts x %lld GPUs x N slots, each a %.0f B row "
           "and a %.0f B output, and N x k staged = %s per GPU\n",
           (long long)N, (long long)((cfg->experts + cfg->ep - 1) / cfg->ep), (long long)cfg->ep,
           moe_ll_row_bytes(&decode), moe_combine_row_bytes(&decode),
           moe_format_bytes(moe_ll_buffer_bytes(&decode, (int)cfg->ep), bytes, sizeof bytes));
}

/* Tokens the synthetic load of --redundant-experts is sampled over. */
enum { LOAD_SAMPLE = 1024 };

/* --redundant-experts: EPLB's placement on the EP group for load (E), the
 * imbalance it predicts (EPLB's own model: an expert's load split evenly
 * over its copies), the copies' memory, and where the copies sit. */
static void print_replicas(const moe_config *cfg, const moe_cluster *p, const double *load)
{
    const int E = (int)cfg->experts, G = (int)cfg->ep, P = E + (int)cfg->redundant_experts;
    const int per_node = (int)(cfg->gpus_per_node < cfg->ep ? cfg->gpus_per_node : cfg->ep);
    const int nodes = G % per_node == 0 ? G / per_node : 1, per_gpu = P / G;
    moe_replicas r;
    moe_eplb_place(load, E, P, (int)cfg->groups, nodes, G, &r);
    moe_placement logical;
    moe_placement_init(&logical, E, G);
    double *gpu = moe_xcalloc(2 * (size_t)G, sizeof(double)); /* without, with copies */
    for (int e = 0; e < E; e++)
        gpu[logical.expert_rank[e]] += load[e];
    for (int q = 0; q < P; q++)
        gpu[G + q / per_gpu] += load[r.phy2log[q]] / r.copies[r.phy2log[q]];
    char a[32], b[32], c[32];
    printf("replicas  EPLB %s: %d + %lld redundant = %d physical experts, %d per GPU; load: %s\n",
           r.hierarchical ? "hierarchical (groups onto nodes, copies within each node, then onto its GPUs)"
                          : "global (copies, then onto GPUs)",
           E, (long long)cfg->redundant_experts, P, per_gpu,
           cfg->expert_load[0] ? cfg->expert_load : "the router on the seed's first 1024 tokens");
    printf("          (token, expert) pairs per GPU, max/mean: %.2f with E/EP experts a GPU, %.2f with "
           "the copies (an expert's load split evenly over its copies)\n",
           moe_max_over_mean(gpu, G), moe_max_over_mean(gpu + G, G));
    const double extra = (double)cfg->redundant_experts * p->params_per_expert * (double)cfg->moe_layers;
    printf("          memory: the copies' %s params in %lld MoE layers = %s in %s, %s per GPU\n",
           count(extra, a, sizeof a), (long long)cfg->moe_layers,
           bytes(extra * moe_dtype_bytes(cfg->param_dtype), b, sizeof b), dtype_names[cfg->param_dtype],
           bytes(extra * moe_dtype_bytes(cfg->param_dtype) / G, c, sizeof c));
    for (int n = 0; n < (G <= 16 ? G : nodes); n++) {
        const int first = G <= 16 ? n : n * (G / nodes), last = G <= 16 ? n + 1 : (n + 1) * (G / nodes);
        if (G <= 16)
            printf("          GPU %-3d %8.0f pairs:", n, gpu[G + n]);
        else
            printf("          node %d (GPUs %d-%d): %d slots, copies of", n, first, last - 1,
                   (last - first) * per_gpu);
        int shown = 0;
        for (int q = first * per_gpu; q < last * per_gpu; q++) {
            const int e = r.phy2log[q];
            if (G <= 16)
                printf(" %s%d", r.copies[e] > 1 ? "*" : "e", e);
            else if (r.copies[e] > 1 && r.replica[q] == 0 && shown++ < 12)
                printf(" e%d x%d", e, r.copies[e]);
        }
        printf("%s\n", G <= 16 ? "" : shown > 12 ? " ..." : shown ? "" : " none");
    }
    if (G <= 16)
        printf("          (*: an expert with copies)\n");
    free(gpu);
    moe_placement_free(&logical);
    moe_replicas_free(&r);
}

/* --mask-ranks: what losing those ranks of the EP group costs, with the
 * mask's rule (drop their pairs, rescale the kept weights; mask.h) and with
 * rerouting to live experts, under uniform routing. */
static void print_mask(const moe_config *cfg, const bool *lost)
{
    const int G = (int)cfg->ep;
    int ranks;
    const int experts = moe_mask_lost_experts(lost, G, (int)cfg->experts, &ranks);
    const double E = (double)cfg->experts, k = (double)cfg->topk, T = (double)cfg->tokens;
    const double f = experts / E, g = (double)ranks / G;
    double all_lost = 1.0; /* C(X, k) / C(E, k): every one of a token's k experts lost */
    for (int i = 0; i < cfg->topk; i++)
        all_lost *= experts > i ? (experts - i) / (E - i) : 0.0;
    printf("mask      %d of %d ranks of the EP group lost (--mask-ranks %s): %d of %lld experts "
           "(%.1f%%) unreachable, and those ranks' %d x %lld tokens not served (%.1f%% of the batch)\n",
           ranks, G, cfg->mask_ranks, experts, (long long)cfg->experts, 100.0 * f, ranks,
           (long long)cfg->tokens, 100.0 * g);
    printf("          dropped (moe-ep's rule): a live token keeps k (1 - f) = %.2f of its %lld experts "
           "on average under uniform routing (all %lld lost with probability %.2g), its kept weights "
           "rescaled; a live GPU computes T k (1 - f) = %.0f pairs instead of %.0f, and its rows "
           "fall alike\n",
           k * (1.0 - f), (long long)cfg->topk, (long long)cfg->topk, all_lost, T * k * (1.0 - f), T * k);
    printf("          rerouted (a top-k over the live experts): every token keeps its %lld experts and a "
           "live GPU computes T k = %.0f pairs, the time of the whole group for %.1f%% fewer tokens\n",
           (long long)cfg->topk, T * k, 100.0 * g);
}

int moe_cli_plan(const moe_comm *c, int argc, char **argv)
{
    if (moe_cli_help(c, argc, argv, print_usage))
        return MOE_EXIT_OK;
    moe_config cfg;
    moe_status st = {0};
    moe_config_defaults(&cfg);
    if (moe_config_parse(&cfg, MOE_CMD_PLAN, argc, argv, &st) == MOE_EXIT_OK &&
        cfg.ep > cfg.gpus)
        moe_fail(&st, MOE_EXIT_USAGE, "--ep must be in [1, %lld] (at most --gpus), got %lld",
                 (long long)cfg.gpus, (long long)cfg.ep);
    if (st.code == MOE_EXIT_OK && cfg.moe_layers > cfg.layers)
        moe_fail(&st, MOE_EXIT_USAGE, "--moe-layers must be in [0, %lld] (at most --layers), got %lld",
                 (long long)cfg.layers, (long long)cfg.moe_layers);
    if (st.code == MOE_EXIT_OK && cfg.ep > cfg.experts)
        moe_fail(&st, MOE_EXIT_USAGE, "--ep must be in [1, %lld] (at most --experts: every GPU of "
                 "the group holds at least one expert), got %lld",
                 (long long)cfg.experts, (long long)cfg.ep);
    if (st.code == MOE_EXIT_OK && cfg.gpus % (cfg.pp * cfg.ep))
        moe_fail(&st, MOE_EXIT_USAGE, "--gpus %lld must be a multiple of --pp x --ep = %lld x %lld "
                 "(the GPUs are PP stages of EP groups, times the data-parallel replicas)",
                 (long long)cfg.gpus, (long long)cfg.pp, (long long)cfg.ep);
    /* The hardware the figures divide by: given by --cluster or the flags. */
    const struct {
        const char *flag;
        double value;
        bool needed;
    } hardware[] = {{"--tflops", cfg.tflops, true},
                    {"--intra-bw", cfg.intra_bw, cfg.gpus_per_node > 1 && cfg.ep > 1},
                    {"--inter-bw", cfg.inter_bw, cfg.ep > cfg.gpus_per_node}};
    for (size_t n = 0; n < sizeof hardware / sizeof hardware[0] && st.code == MOE_EXIT_OK; n++)
        if (hardware[n].needed && !(hardware[n].value > 0))
            moe_fail(&st, MOE_EXIT_USAGE, "%s must be above 0 (give --cluster NAME or the flag), got %g",
                     hardware[n].flag, hardware[n].value);
    if (st.code == MOE_EXIT_OK && cfg.topk > cfg.experts)
        moe_fail(&st, MOE_EXIT_USAGE, "--topk must be in [1, %lld] (at most --experts), got %lld",
                 (long long)cfg.experts, (long long)cfg.topk);
    if (st.code == MOE_EXIT_OK && cfg.skew[0]) {
        float skew[MOE_ROUTER_MAX_EXPERTS];
        moe_skew_parse(cfg.skew, (int)cfg.experts, skew, &st);
    }
    if (st.code == MOE_EXIT_OK)
        moe_eplb_validate(&cfg, (int)cfg.ep, "GPUs of --ep", &st);
    bool *lost = moe_xcalloc((size_t)cfg.ep, sizeof(bool));
    if (st.code == MOE_EXIT_OK && cfg.mask_ranks[0])
        moe_mask_parse(cfg.mask_ranks, (int)cfg.ep, lost, &st);
    double *load = NULL;
    if (st.code == MOE_EXIT_OK && cfg.redundant_experts > 0) {
        load = moe_xmalloc(sizeof(double) * (size_t)cfg.experts);
        if (cfg.expert_load[0])
            moe_expert_load_read(cfg.expert_load, (int)cfg.experts, load, &st);
        else
            moe_cluster_sample_load(&cfg, LOAD_SAMPLE, load);
    }
    double mean;
    if (st.code == MOE_EXIT_OK && cfg.nodes_per_token[0])
        moe_cluster_nodes_mean(cfg.nodes_per_token, (int)((cfg.ep + cfg.gpus_per_node - 1) / cfg.gpus_per_node),
                               &mean, &st);
    if (moe_comm_agree(c, &st) == MOE_EXIT_OK) {
        char *text = moe_config_canonical(&cfg, MOE_CMD_PLAN);
        moe_comm_same_config(c, text, &st);
        free(text);
    }
    if (st.code) {
        moe_comm_print_error(c, &st);
        free(load);
        free(lost);
        return st.code;
    }
    moe_cluster plan;
    moe_cluster_compute(&cfg, &plan);
    if (c->rank == 0) {
        print_plan(&cfg, &plan);
        if (load)
            print_replicas(&cfg, &plan, load);
        if (cfg.mask_ranks[0])
            print_mask(&cfg, lost);
    }
    free(load);
    free(lost);
    return MOE_EXIT_OK;
}
