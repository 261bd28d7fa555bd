/* SPDX-License-Identifier: MIT */
/* cluster.c — the seeds' arithmetic for `moe-ep plan` (see cluster.h, docs/plan.md). */
#include "moe/cluster.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/rng.h"
#include "moe/router.h"
#include "moe/wire.h"


double moe_seed_flops_per_byte(double ffn) { return 2.0 * ffn; }

/* ids (T, k): the first T tokens of the seed through the router cfg
 * describes (its synthetic gate and correction bias, groups, kept groups,
 * --skew), as `moe-ep run` routes them. */
static int32_t *sample_routing(const moe_config *cfg, moe_index T)
{
    const moe_index d = cfg->hidden;
    const int E = (int)cfg->experts, k = (int)cfg->topk;
    float *x = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    float *gate = moe_xmalloc(sizeof(float) * (size_t)(E * d));
    float *bias = moe_xmalloc(sizeof(float) * (size_t)E);
    float *skew = moe_xmalloc(sizeof(float) * (size_t)E);
    float *logits = moe_xmalloc(sizeof(float) * (size_t)(T * E));
    float *scores = moe_xmalloc(sizeof(float) * (size_t)(T * E));
    int32_t *ids = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k));
    float *weights = moe_xmalloc(sizeof(float) * (size_t)(T * k));
    moe_synth_tokens(cfg->seed, 0, T, d, (float)cfg->init_scale, cfg->input_dist, x);
    moe_synth_fill(cfg->seed, MOE_TENSOR_GATE, 0, 0, E * d, moe_synth_weight_scale(d), gate);
    const bool biased = cfg->router == MOE_ROUTER_DEEPSEEK_V3 && cfg->bias_scale > 0;
    if (biased)
        moe_synth_fill(cfg->seed, MOE_TENSOR_BIAS, 0, 0, E, (float)cfg->bias_scale, bias);
    moe_status ignored = {0}; /* validated */
    const bool skewed = cfg->skew[0] && moe_skew_parse(cfg->skew, E, skew, &ignored) == MOE_EXIT_OK;
    const moe_router router = {.kind = (enum moe_router_kind)cfg->router, .experts = E, .topk = k,
                               .normalize = moe_config_norm_topk(cfg), .groups = (int)cfg->groups,
                               .topk_groups = (int)cfg->topk_groups,
                               .route_scale = (float)cfg->route_scale, .bias = biased ? bias : NULL,
                               .skew = skewed ? skew : NULL};
    moe_router_logits(x, gate, T, d, E, logits);
    moe_router_select(&router, logits, T, scores, ids, weights);
    free(weights);
    free(scores);
    free(logits);
    free(skew);
    free(bias);
    free(gate);
    free(x);
    return ids;
}

/* The nodes a token's k experts reach, on average, over the seed's first
 * PLAN_SAMPLE tokens, with E/EP experts per GPU and gpus-per-node GPUs per
 * node. */
enum { PLAN_SAMPLE = 256 };

static double sample_nodes_reached(const moe_config *cfg, int nodes)
{
    const moe_index T = PLAN_SAMPLE;
    const int E = (int)cfg->experts, k = (int)cfg->topk;
    int32_t *ids = sample_routing(cfg, T);
    const double experts_per_node = (double)E / (double)nodes;
    double reached = 0.0;
    bool *seen = moe_xcalloc((size_t)nodes, sizeof(bool));
    for (moe_index i = 0; i < T; i++) {
        for (int n = 0; n < nodes; n++)
            seen[n] = false;
        for (int s = 0; s < k; s++) {
            const int node = (int)((double)ids[i * k + s] / experts_per_node);
            reached += !seen[node];
            seen[node] = true;
        }
    }
    free(seen);
    free(ids);
    return reached / (double)T;
}

void moe_cluster_sample_load(const moe_config *cfg, moe_index tokens, double *load)
{
    const int E = (int)cfg->experts, k = (int)cfg->topk;
    int32_t *ids = sample_routing(cfg, tokens);
    memset(load, 0, sizeof(double) * (size_t)E);
    for (moe_index n = 0; n < tokens * k; n++)
        load[ids[n]] += 1.0;
    free(ids);
}

int moe_cluster_nodes_mean(const char *hist, int nodes, double *mean, moe_status *st)
{
    char text[MOE_NAME_MAX];
    snprintf(text, sizeof text, "%s", hist);
    bool *seen = moe_xcalloc((size_t)nodes + 1, sizeof(bool));
    double sum = 0.0, weighted = 0.0;
    bool ok = *text != '\0';
    for (char *item = text, *next; ok && item; item = next) {
        next = strchr(item, ',');
        if (next)
            *next++ = '\0';
        char *end;
        const long n = isdigit((unsigned char)*item) ? strtol(item, &end, 10) : -1;
        ok = n >= 1 && n <= nodes && *end == ':' && !seen[n] && isdigit((unsigned char)end[1]);
        if (!ok)
            break;
        seen[n] = true;
        const double percent = strtod(end + 1, &end);
        ok = *end == '\0' && isfinite(percent);
        sum += percent;
        weighted += (double)n * percent;
    }
    free(seen);
    if (!ok || !(sum > 0))
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--nodes-per-token must be N:PERCENT,... with each N in [1, %d] (the nodes of "
                        "the EP group) once and percentages summing above 0, as run's report prints "
                        "them (3:2.0,4:98.0), got '%s'", nodes, hist);
    *mean = weighted / sum;
    return MOE_EXIT_OK;
}

double moe_dtype_bytes(int dtype)
{
    return dtype == MOE_DTYPE_FP8 ? 1.0 : dtype == MOE_DTYPE_BF16 ? 2.0 : 4.0;
}

/* Bytes each of n GPUs sends in a ring all-reduce of `bytes`. */
static double ring_allreduce(double bytes, double n) { return n > 1 ? 2.0 * (n - 1.0) / n * bytes : 0.0; }

void moe_cluster_compute(const moe_config *cfg, moe_cluster *p)
{
    const double d = (double)cfg->hidden, f = (double)cfg->ffn, E = (double)cfg->experts;
    const double k = (double)cfg->topk, T = (double)cfg->tokens, S = (double)cfg->shared_experts;
    const double ep = (double)cfg->ep, per_node = (double)cfg->gpus_per_node;
    const double b_dispatch = moe_dtype_bytes(cfg->dispatch_dtype);
    const double b_combine = moe_dtype_bytes(cfg->combine_dtype);

    p->params_per_expert = 3.0 * d * f;
    p->routed_per_layer = E * p->params_per_expert;
    p->shared_per_layer = S * p->params_per_expert;
    p->routed_total = (double)cfg->moe_layers * p->routed_per_layer;
    p->routed_bytes = p->routed_total * moe_dtype_bytes(cfg->param_dtype);
    p->experts_per_gpu = E / ep;
    p->ep_nodes = (int)ceil(ep / per_node);

    p->dispatch_bytes = T * k * d * b_dispatch;
    p->combine_bytes = T * k * d * b_combine;
    /* Experts spread evenly over the EP group: a copy stays on its node with
     * probability (GPUs per node within the group) / EP. */
    const double node_gpus = per_node < ep ? per_node : ep;
    p->remote_fraction = 1.0 - node_gpus / ep;
    /* Node-limited routing keeps a token on at most M nodes, one copy per
     * node over the inter-node link: at most M copies, M - 1 when the
     * token's own node is among them. */
    /* Not min(M, nodes): the router decides how many it reaches (sampled). */
    double nodes_reached = 1.0;
    moe_status ignored = {0}; /* moe-ep plan has checked the histogram */
    if (p->ep_nodes > 1 && !(cfg->nodes_per_token[0] &&
                             moe_cluster_nodes_mean(cfg->nodes_per_token, p->ep_nodes, &nodes_reached,
                                                    &ignored) == MOE_EXIT_OK))
        nodes_reached = sample_nodes_reached(cfg, p->ep_nodes);
    p->nodes_reached = nodes_reached;
    p->node_limited_copies = p->ep_nodes > 1 ? nodes_reached : 0.0;
    /* As the rows travel (wire.h): FP8 values with their scales and each
     * row's ids and weights; what the times below move. */
    p->dispatch_wire_bytes = T * k * moe_dispatch_row_bytes(cfg);
    p->combine_wire_bytes = T * k * moe_combine_row_bytes(cfg);
    p->step_forward_bytes = (p->dispatch_wire_bytes + p->combine_wire_bytes) * (double)cfg->moe_layers;
    p->step_training_bytes =
        p->step_forward_bytes + T * k * moe_backward_pair_bytes(cfg) * (double)cfg->moe_layers;

    const double flops = cfg->tflops * 1e12, intra = cfg->intra_bw * 1e9, inter = cfg->inter_bw * 1e9;
    p->compute_seconds = flops > 0 ? 6.0 * T * k * d * f / flops : 0.0;
    /* Copies of a token per link. Plain EP: k copies, a remote_fraction of
     * them over IB, (GPUs per node - 1)/EP of them over NVLink. Node-limited
     * routing (groups > 1) sends one copy per remote node reached over IB,
     * (M - 1) of M on average when the token's node is one of the M chosen
     * at random (M (nodes - 1) / nodes), and the node forwards it over
     * NVLink. The two links work in parallel. */
    const double nodes = p->ep_nodes;
    p->inter_copies = cfg->groups > 1 && nodes > 1 ? nodes_reached * (nodes - 1.0) / nodes
                                                   : k * p->remote_fraction;
    p->intra_copies = cfg->groups > 1 && nodes > 1 ? k * (node_gpus - 1.0) / node_gpus
                                                   : k * (node_gpus - 1.0) / ep;
    const double per_copy = T * (moe_dispatch_row_bytes(cfg) + moe_combine_row_bytes(cfg));
    const double inter_time = inter > 0 ? per_copy * p->inter_copies / inter : 0.0;
    const double intra_time = intra > 0 ? per_copy * p->intra_copies / intra : 0.0;
    p->comm_seconds = fmax(inter_time, intra_time);

    p->cb_intra = intra > 0 ? flops / intra : 0.0;
    p->cb_inter = inter > 0 ? flops / inter : 0.0;
    p->seed_need = moe_seed_flops_per_byte(f);
    p->layer_need = 6.0 * f / (b_dispatch + b_combine);
    const double cb = p->ep_nodes > 1 ? p->cb_inter : p->cb_intra;
    p->overlap_seed = cb > 0 ? fmin(1.0, p->seed_need / cb) : 1.0;
    /* The layer's own bound, from its times: the share of the all-to-all
     * time the expert GEMMs can cover. */
    p->overlap_bound = p->comm_seconds > 0 ? fmin(1.0, p->compute_seconds / p->comm_seconds) : 1.0;

    const double W = (double)cfg->waves_list[0];
    p->naive_seconds = p->compute_seconds + p->comm_seconds;
    /* Two resources, the GEMMs and the links: no schedule beats either's
     * time, and W waves expose at least one wave's all-to-all. */
    p->wave_seconds = fmax(p->comm_seconds, p->compute_seconds + p->comm_seconds / W);
    p->stage_seconds = p->naive_seconds / 5.0;
    p->seed_wave_seconds = p->stage_seconds * (1.0 + 4.0 / W);
    const double busiest = fmax(p->compute_seconds, p->comm_seconds);
    p->overlap_cap = busiest > 0 ? p->naive_seconds / busiest : 1.0;

    /* GPUs = PP x EP x DP (seed 000: 2048 = 16 x 64 x 2). A GPU's routed
     * experts are its own within its EP group, so only the DP replicas of
     * that group hold them again; the shared experts and the gate are on
     * every GPU of the stage, EP x DP of them. A ring all-reduce over n
     * GPUs sends 2 (n - 1) / n of the buffer from each (reduce-scatter,
     * then all-gather) and sums; an all-to-all sends (n - 1) / n of its
     * data once and sums nothing. */
    const double grad = moe_dtype_bytes(cfg->param_dtype);
    p->dp = (int)(cfg->gpus / (cfg->pp * cfg->ep));
    p->layers_per_stage = (double)cfg->moe_layers / (double)cfg->pp;
    p->expert_grad_bytes = p->experts_per_gpu * p->params_per_expert * grad;
    p->expert_sync_bytes = ring_allreduce(p->expert_grad_bytes, p->dp);
    p->replicated_grad_bytes = (p->shared_per_layer + E * d) * grad;
    p->replicated_sync_bytes = ring_allreduce(p->replicated_grad_bytes, (double)p->dp * ep);
    p->layer_a2a_bytes = cfg->moe_layers > 0 ? p->step_training_bytes / (double)cfg->moe_layers : 0.0;
    p->experts_per_node = p->node_limited_copies > 0 ? k / p->node_limited_copies : 0.0;
}
