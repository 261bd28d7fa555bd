/* SPDX-License-Identifier: MIT */
/* check_cluster.c — `moe-ep plan` reproduces the seeds' figures for DeepSeek-V3. */
#include <math.h>

#include "moe/cluster.h"
#include "moe/router.h"
#include "moe/wire.h"
#include "suites.h"

/* The deepseek-v3 preset and the H800 cluster, set by hand. */
static moe_config deepseek_v3(void)
{
    moe_config cfg;
    moe_config_defaults(&cfg);
    cfg.tokens = 4096;
    cfg.hidden = 7168;
    cfg.ffn = 2048;
    cfg.experts = 256;
    cfg.topk = 8;
    cfg.shared_experts = 1;
    cfg.router = MOE_ROUTER_DEEPSEEK_V3;
    cfg.route_scale = 2.5;
    cfg.groups = 8;
    cfg.topk_groups = 4;
    cfg.layers = 61;
    cfg.moe_layers = 58;
    cfg.param_dtype = MOE_DTYPE_BF16;
    cfg.dispatch_dtype = MOE_DTYPE_FP8;
    cfg.combine_dtype = MOE_DTYPE_BF16;
    cfg.gpus = 2048;
    cfg.gpus_per_node = 8;
    cfg.ep = 64;
    cfg.intra_bw = 900;
    cfg.inter_bw = 50;
    cfg.tflops = 989;
    return cfg;
}

/* Seed 000: 2048 = PP 16 x EP 64 x DP 2, the experts' gradients synced
 * over the 2 replicas only and the replicated weights over 128 GPUs; the
 * overlap cap (compute + comm) / max; V3's 3.2 experts a node. */
START_TEST(parallel_layout_and_gradients_match_the_seed)
{
    moe_config cfg = deepseek_v3();
    cfg.pp = 16;
    moe_cluster p;
    moe_cluster_compute(&cfg, &p);
    ck_assert_int_eq(p.dp, 2);
    ck_assert(fabs(p.layers_per_stage - 58.0 / 16.0) < 1e-12);
    ck_assert(fabs(p.expert_grad_bytes - 4.0 * 44040192.0 * 2.0) < 1e-3);
    ck_assert(fabs(p.expert_sync_bytes - p.expert_grad_bytes) < 1e-3); /* 2 (2 - 1) / 2 = 1 */
    ck_assert(fabs(p.replicated_grad_bytes - (44040192.0 + 256.0 * 7168.0) * 2.0) < 1e-3);
    ck_assert(fabs(p.replicated_sync_bytes - 2.0 * 127.0 / 128.0 * p.replicated_grad_bytes) < 1e-3);
    const double busiest = fmax(p.compute_seconds, p.comm_seconds);
    ck_assert(fabs(p.overlap_cap - (p.compute_seconds + p.comm_seconds) / busiest) < 1e-12);
    ck_assert(p.overlap_cap > 1.0 && p.overlap_cap <= 2.0);
    ck_assert(fabs(p.experts_per_node - 8.0 / p.node_limited_copies) < 1e-12);
    ck_assert(p.experts_per_node >= 2.0 && p.experts_per_node <= 3.2); /* within V3's headroom */
}
END_TEST

START_TEST(parameters_match_the_seed)
{
    moe_config cfg = deepseek_v3();
    moe_cluster p;
    moe_cluster_compute(&cfg, &p);
    ck_assert_double_eq(p.params_per_expert, 44040192.0);            /* 3 x 7168 x 2048 */
    ck_assert_double_eq_tol(p.routed_per_layer / 1e9, 11.27, 0.005); /* 11.27B */
    ck_assert_double_eq_tol(p.routed_total / 1e9, 653.9, 0.05);      /* 653.9B */
    ck_assert_double_eq_tol(p.routed_bytes / 1e12, 1.31, 0.005);     /* 1.31 TB in BF16 */
    ck_assert_double_eq(p.experts_per_gpu, 4.0);                     /* 256 / 64 */
    ck_assert_int_eq(p.ep_nodes, 8);
}
END_TEST

START_TEST(cb_ratios_match_the_seed)
{
    moe_config cfg = deepseek_v3();
    moe_cluster p;
    moe_cluster_compute(&cfg, &p);
    ck_assert_double_eq_tol(p.cb_intra, 1099.0, 0.5);  /* H100 + NVLink */
    ck_assert_double_eq_tol(p.cb_inter, 19780.0, 0.5); /* H100 + IB 400G */
    cfg.ffn = 3072; /* the seed's "d = 3072, the token dimension inside the FFN": d_ff */
    moe_cluster_compute(&cfg, &p);
    ck_assert_double_eq(p.seed_need, 6144.0);
    ck_assert_double_eq_tol(p.overlap_seed, 0.31, 0.005); /* 6144 / 19780 */
}
END_TEST

START_TEST(traffic_and_pipeline)
{
    moe_config cfg = deepseek_v3();
    cfg.waves_list[0] = 4;
    moe_cluster p;
    moe_cluster_compute(&cfg, &p);
    /* tokens x top-k x d x bytes per value */
    ck_assert_double_eq(p.dispatch_bytes, 4096.0 * 8 * 7168 * 1);
    ck_assert_double_eq(p.combine_bytes, 4096.0 * 8 * 7168 * 2);
    /* wire.h: values, 56 fp32 scales, meta of 8 int16 ids, 8 fp32 weights, an int32 token */
    ck_assert_double_eq(p.dispatch_wire_bytes, 4096.0 * 8 * (7168 + 56 * 4 + 8 * 2 + 8 * 4 + 4));
    ck_assert_double_eq(p.combine_wire_bytes, p.combine_bytes);
    /* the backward per pair (wire.h): dy as the dispatch's values and scales, dx as the
     * combine's, one fp32 dL/dweight */
    ck_assert_double_eq(p.step_training_bytes,
                        58 * (p.dispatch_wire_bytes + p.combine_wire_bytes +
                              4096.0 * 8 * ((7168 + 56 * 4) + 7168 * 2 + 4)));
    ck_assert_double_eq_tol(p.remote_fraction, 7.0 / 8.0, 1e-12);
    /* k = 8 experts in M = 4 kept groups of 32 (one group per node): the
     * router reaches at most 4 nodes, nearly always all 4 */
    ck_assert(p.node_limited_copies <= 4.0 && p.node_limited_copies > 3.8);
    /* the seed's T (1 + (S - 1) / W) with S = 5, labelled as its idealisation */
    ck_assert_double_eq_tol(p.seed_wave_seconds, p.stage_seconds * 2.0, 1e-15);
    ck_assert_double_eq_tol(p.naive_seconds / p.seed_wave_seconds, 2.5, 1e-12);
    /* what plan presents as reachable: the two-resource bound */
    ck_assert_double_eq(p.wave_seconds, fmax(p.comm_seconds, p.compute_seconds + p.comm_seconds / 4));
    cfg.topk_groups = 8; /* no limit: the router reaches about 5.3 of 8 nodes, not min(k, nodes) = 8 */
    moe_cluster_compute(&cfg, &p);
    ck_assert(p.nodes_reached > 5.0 && p.nodes_reached < 5.7);
}
END_TEST

/* plan cannot contradict itself: over a sweep of models and clusters, no
 * time it presents as reachable is below either resource's time, the
 * bounds are fractions, and the node figures stay within what routing allows. */
START_TEST(plan_invariants_hold_over_a_sweep)
{
    static const int64_t waves[] = {1, 2, 4, 8, 16};
    static const double bw[][3] = {{900, 50, 989}, {160, 50, 989}, {900, 900, 10}, {50, 400, 2000}};
    int checked = 0;
    for (int m = 0; m < 4; m++)
        for (int c = 0; c < 4; c++)
            for (size_t w = 0; w < sizeof waves / sizeof waves[0]; w++) {
                moe_config cfg = deepseek_v3();
                cfg.hidden = 256 << (m % 2);
                cfg.ffn = m < 2 ? 2048 : 12288;
                cfg.topk_groups = m == 3 ? 8 : 4;
                cfg.gpus_per_node = c == 2 ? 64 : 8; /* one node at c = 2 */
                cfg.intra_bw = bw[c][0];
                cfg.inter_bw = bw[c][1];
                cfg.tflops = bw[c][2];
                cfg.waves_list[0] = waves[w];
                moe_cluster p;
                moe_cluster_compute(&cfg, &p);
                const double floor_time = fmax(p.comm_seconds, p.compute_seconds);
                ck_assert(p.wave_seconds >= floor_time && p.wave_seconds <= p.naive_seconds);
                ck_assert(p.overlap_bound >= 0 && p.overlap_bound <= 1);
                ck_assert(p.overlap_seed >= 0 && p.overlap_seed <= 1);
                ck_assert(p.nodes_reached >= 1 && p.nodes_reached <= fmin((double)p.ep_nodes, (double)cfg.topk));
                if (cfg.groups > 1 && p.ep_nodes > 1)
                    ck_assert(p.nodes_reached <= (double)cfg.topk_groups);
                ck_assert(p.inter_copies <= p.nodes_reached || cfg.groups == 1);
                ck_assert(p.step_training_bytes ==
                          p.step_forward_bytes + (double)cfg.moe_layers * (double)cfg.tokens *
                                                     (double)cfg.topk * moe_backward_pair_bytes(&cfg));
                checked++;
            }
    ck_assert_int_eq(checked, 80);
}
END_TEST

Suite *make_cluster_suite(void)
{
    Suite *s = suite_create("cluster");
    TCase *tc = tcase_create("seed");
    tcase_add_test(tc, parameters_match_the_seed);
    tcase_add_test(tc, parallel_layout_and_gradients_match_the_seed);
    tcase_add_test(tc, cb_ratios_match_the_seed);
    tcase_add_test(tc, traffic_and_pipeline);
    tcase_add_test(tc, plan_invariants_hold_over_a_sweep);
    suite_add_tcase(s, tc);
    return s;
}
