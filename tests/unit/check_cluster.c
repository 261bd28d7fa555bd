/* check_cluster.c — `moe-ep plan` reproduces the seeds' figures for DeepSeek-V3. */
#include <math.h>

#include "moe/cluster.h"
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
    cfg.hidden = 3072;                                 /* V4's d */
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
    ck_assert_double_eq(p.dispatch_wire_bytes, 4096.0 * 8 * (7168 + 56 * 4 + 17 * 4)); /* wire.h */
    ck_assert_double_eq(p.combine_wire_bytes, p.combine_bytes);
    ck_assert_double_eq(p.step_training_bytes, 2 * 58 * (p.dispatch_wire_bytes + p.combine_wire_bytes));
    ck_assert_double_eq_tol(p.remote_fraction, 7.0 / 8.0, 1e-12);
    ck_assert_double_eq(p.node_limited_copies, 4.0);
    /* T (1 + (S - 1) / W) with S = 5 */
    ck_assert_double_eq_tol(p.wave_seconds, p.stage_seconds * 2.0, 1e-15);
    ck_assert_double_eq_tol(p.naive_seconds / p.wave_seconds, 2.5, 1e-12);
}
END_TEST

Suite *make_cluster_suite(void)
{
    Suite *s = suite_create("cluster");
    TCase *tc = tcase_create("seed");
    tcase_add_test(tc, parameters_match_the_seed);
    tcase_add_test(tc, cb_ratios_match_the_seed);
    tcase_add_test(tc, traffic_and_pipeline);
    suite_add_tcase(s, tc);
    return s;
}
