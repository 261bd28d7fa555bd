/* SPDX-License-Identifier: MIT */
/* cluster.h — the seeds' arithmetic for a model on a cluster (`moe-ep plan`).
 *
 * Not the dispatch plan (layout.h): "plan" in the code means which rows go
 * where; this module is what a whole cluster would send and compute.
 *
 * Pure: no MPI, no I/O. Parameters, experts per GPU, all-to-all bytes per GPU
 * per layer and per step, compute and communication time per layer, the
 * hardware's compute-to-bandwidth ratio C/B against the workload's, the
 * overlap bound and the wave pipeline time. docs/plan.md gives every formula
 * and where the seeds' own figures disagree with each other.
 */
#ifndef MOE_CLUSTER_H
#define MOE_CLUSTER_H

#include "moe/config.h"

/* The seed's "2d" of C/B, FLOP per byte a layer needs for its all-to-all
 * to hide behind its GEMMs: L1's 2 s d d_ff FLOPs over the s d values it
 * moves is 2 d_ff per value (docs/plan.md: the seed's d = 3,072 is d_ff).
 * The one definition `plan` and `run` print. */
double moe_seed_flops_per_byte(double ffn);

typedef struct {
    /* parameters */
    double params_per_expert;   /* 3 d f: gate, up, down */
    double routed_per_layer;    /* E x params_per_expert */
    double shared_per_layer;    /* S x params_per_expert */
    double routed_total;        /* moe_layers x routed_per_layer */
    double routed_bytes;        /* at the weight dtype */
    double experts_per_gpu;     /* E / EP */
    int ep_nodes;               /* nodes the EP group spans: ceil(EP / gpus per node) */
    /* traffic per GPU per MoE layer, forward, T tokens per GPU */
    double dispatch_bytes;      /* T k d x dispatch bytes per value */
    double combine_bytes;       /* T k d x combine bytes per value */
    double dispatch_wire_bytes; /* T k x a dispatched row on the wire (wire.h) */
    double combine_wire_bytes;  /* T k x an expert output on the wire */
    double remote_fraction;     /* share of (token, expert) copies leaving the node */
    double nodes_reached;       /* nodes a token's k experts reach: sampled from the router,
                                   or the mean of --nodes-per-token */
    double node_limited_copies; /* node-limited routing: nodes a token reaches, <= M */
    double inter_copies;        /* copies of a token over the inter-node link, on average */
    double intra_copies;        /* copies of a token over NVLink, on average */
    double step_forward_bytes;  /* (dispatch + combine) x MoE layers */
    double step_training_bytes; /* and the backward's (wire.h, moe_backward_pair_bytes) */
    /* time per GPU per MoE layer, forward */
    double compute_seconds;     /* 6 T k d f / FLOP/s */
    double comm_seconds;        /* max(IB bytes / inter bw, NVLink bytes / intra bw) */
    /* C/B */
    double cb_intra, cb_inter;  /* FLOP/s over bytes/s */
    double seed_need;           /* the seed's "2d" FLOP per byte (moe_seed_flops_per_byte) */
    double layer_need;          /* this layer's FLOP per byte moved: 6 f / (b_dispatch + b_combine) */
    double overlap_seed;        /* the seed's min(1, 2d / (C/B)), C/B of the link the group crosses */
    double overlap_bound;       /* the layer's: min(1, compute / comm), from its own times */
    /* the parallel layout and the gradients (per MoE layer and GPU, once a step) */
    int dp;                     /* data-parallel replicas: GPUs / (PP x EP) */
    double layers_per_stage;    /* MoE layers a GPU holds: moe_layers / PP */
    double expert_grad_bytes;   /* its E/EP experts' gradients, at the weight dtype */
    double expert_sync_bytes;   /* a ring all-reduce of them over DP: 2 (DP - 1) / DP x */
    double replicated_grad_bytes; /* the shared experts' and the gate's (every GPU holds them) */
    double replicated_sync_bytes; /* over EP x DP GPUs: 2 (n - 1) / n x */
    double layer_a2a_bytes;     /* one micro-batch's all-to-alls, forward and backward */
    double experts_per_node;    /* node-limited routing: k over the nodes a token reaches */
    /* the wave pipeline */
    double naive_seconds;       /* compute + comm, one after the other */
    double wave_seconds;        /* at best: max(comm, compute + comm / W) */
    double stage_seconds;       /* seed 003's five equal stages: T = (compute + comm) / 5 */
    double seed_wave_seconds;   /* its T (1 + 4 / W): five resources, an idealisation */
    double overlap_cap;         /* perfect overlap: (compute + comm) / max(compute, comm) <= 2 */
} moe_cluster;

/* Bytes per value of a dtype. */
double moe_dtype_bytes(int dtype);

/* The mean of a nodes-per-token histogram "N:PERCENT,..." (run's report
 * prints it: "3: 2.0%  4: 98.0%" is given as 3:2.0,4:98.0) over a group of
 * `nodes` nodes: every N in [1, nodes] at most once, percentages >= 0 with
 * a positive sum (they are normalised). MOE_EXIT_USAGE naming
 * --nodes-per-token when it is not one. */
int moe_cluster_nodes_mean(const char *hist, int nodes, double *mean, moe_status *st);

/* Everything above from cfg (model, cluster, tokens per GPU, waves); nodes
 * reached from cfg->nodes_per_token when given (valid), else sampled. */
void moe_cluster_compute(const moe_config *cfg, moe_cluster *p);

/* load (E) = the (token, expert) pairs of each expert over the seed's first
 * `tokens` tokens routed as `moe-ep run` routes them (the synthetic gate and
 * correction bias, groups, --skew): the synthetic load `plan` places
 * redundant experts by. */
void moe_cluster_sample_load(const moe_config *cfg, moe_index tokens, double *load);

#endif
