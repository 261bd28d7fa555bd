/* SPDX-License-Identifier: MIT */
/* check_workload.c — the named imbalance workloads (workload.h): each
 * draws k distinct experts a token with the heat docs/data.md §6 gives it,
 * and the draws of a global token do not depend on the rank count where
 * the workload's heat does not. */
#include <stdlib.h>
#include <string.h>

#include "moe/workload.h"
#include "suites.h"

enum { T = 256, K = 4, E = 32, SEED = 7 };

/* Every rank's share of `workload` at G ranks and step: ids (G*T, K), the
 * pairs each expert got, and per token the weights' checks. */
static void draw_all(int workload, int G, int64_t step, int32_t *ids, long *per_expert)
{
    moe_placement p;
    moe_placement_init(&p, E, G);
    float *w = malloc(sizeof(float) * T * K);
    memset(per_expert, 0, sizeof(long) * E);
    for (int r = 0; r < G; r++) {
        int32_t *mine = ids + (size_t)r * T * K;
        moe_workload_route(workload, SEED, step, &p, T, r, K, mine, w);
        for (int i = 0; i < T; i++) {
            float sum = 0.0f;
            for (int j = 0; j < K; j++) {
                const int32_t e = mine[i * K + j];
                if (e < 0) {
                    ck_assert_float_eq(w[i * K + j], 0.0f);
                    continue;
                }
                ck_assert_int_lt(e, E);
                for (int m = 0; m < j; m++) /* distinct */
                    ck_assert_int_ne(mine[i * K + m], e);
                ck_assert_float_ge(w[i * K + j], 1.0f / (1 + 15 * K) - 1e-7f); /* n_j in [1, 16] */
                sum += w[i * K + j];
                per_expert[e]++;
            }
            if (mine[i * K] >= 0)
                ck_assert_float_eq_tol(sum, 1.0f, 1e-6f);
        }
    }
    free(w);
    moe_placement_free(&p);
}

static long sum_range(const long *n, int from, int to)
{
    long s = 0;
    for (int e = from; e < to; e++)
        s += n[e];
    return s;
}

/* The four busiest experts' share of the draws. */
static double top4_share(const long *n)
{
    long sorted[E], total = 0;
    memcpy(sorted, n, sizeof sorted);
    for (int a = 0; a < E; a++) { /* descending */
        total += n[a];
        for (int b = a + 1; b < E; b++)
            if (sorted[b] > sorted[a]) {
                const long t = sorted[a];
                sorted[a] = sorted[b], sorted[b] = t;
            }
    }
    return (double)(sorted[0] + sorted[1] + sorted[2] + sorted[3]) / (double)total;
}

START_TEST(balanced_gives_every_expert_the_same_pairs)
{
    int32_t *ids = malloc(sizeof(int32_t) * 4 * T * K);
    long n[E];
    draw_all(MOE_WORKLOAD_BALANCED, 4, 0, ids, n);
    for (int e = 0; e < E; e++)
        ck_assert_int_eq(n[e], 4L * T * K / E);
    free(ids);
}
END_TEST

/* W1 and W7's draws depend on the global token id only: 1 and 4 ranks
 * give the same ids. The hot set (E/8 = 4 experts) takes about 3/4 of the
 * draws (a token holds at most 4 of them, so somewhat less). */
START_TEST(hot_experts_do_not_depend_on_the_ranks)
{
    int32_t *one = malloc(sizeof(int32_t) * 4 * T * K), *four = malloc(sizeof(int32_t) * 4 * T * K);
    long n1[E], n4[E];
    moe_placement p;
    moe_placement_init(&p, E, 1);
    float *w = malloc(sizeof(float) * 4 * T * K);
    moe_workload_route(MOE_WORKLOAD_HOT_EXPERTS, SEED, 0, &p, 4 * T, 0, K, one, w);
    moe_placement_free(&p);
    draw_all(MOE_WORKLOAD_HOT_EXPERTS, 4, 0, four, n4);
    ck_assert_mem_eq(one, four, sizeof(int32_t) * 4 * T * K);
    ck_assert_double_gt(top4_share(n4), 0.45);
    ck_assert_double_lt(top4_share(n4), 0.80);
    /* W7: step 3 bursts with W1's heat; steps 0 .. 2 are uniform (no expert
     * near twice the mean) */
    draw_all(MOE_WORKLOAD_BURST, 4, 3, one, n1);
    ck_assert_double_gt(top4_share(n1), 0.45);
    for (int step = 0; step < 3; step++) {
        draw_all(MOE_WORKLOAD_BURST, 4, step, one, n1);
        for (int e = 0; e < E; e++)
            ck_assert_int_lt(n1[e], 3 * 4 * T * K / (2 * E));
    }
    free(w);
    free(one);
    free(four);
}
END_TEST

/* W2 puts the hot set on rank 0, W3 spreads the same count over every
 * rank, W6 moves W2's rank every 3 steps. */
START_TEST(hot_rank_spread_and_rotating)
{
    int32_t *ids = malloc(sizeof(int32_t) * 4 * T * K);
    long n[E];
    const int per_rank = E / 4;
    draw_all(MOE_WORKLOAD_HOT_RANK, 4, 0, ids, n);
    const long total = 4L * T * K;
    ck_assert_int_gt(sum_range(n, 0, per_rank), total / 2); /* rank 0 over half */
    draw_all(MOE_WORKLOAD_SPREAD_HOT, 4, 0, ids, n);
    for (int r = 0; r < 4; r++) { /* one hot expert a rank: each rank near a quarter */
        ck_assert_int_gt(sum_range(n, r * per_rank, (r + 1) * per_rank), total / 6);
        ck_assert_int_gt(n[r * per_rank], 3 * total / (E * 2)); /* its first expert is hot */
    }
    for (int step = 0; step < 12; step += 2) { /* every hot rank, the step before a move too */
        draw_all(MOE_WORKLOAD_ROTATING, 4, step, ids, n);
        const int rho = (step / 3) % 4;
        ck_assert_int_gt(sum_range(n, rho * per_rank, (rho + 1) * per_rank), total / 2);
    }
    free(ids);
}
END_TEST

/* W4: rank r routes ceil(T (r+1)/G) tokens, the rest are masked; W5: the
 * upper half of the ranks' experts get nothing, and too few left for k is
 * refused. */
START_TEST(ragged_and_zero_rank)
{
    int32_t *ids = malloc(sizeof(int32_t) * 3 * T * K);
    long n[E];
    draw_all(MOE_WORKLOAD_RAGGED, 3, 0, ids, n);
    for (int r = 0; r < 3; r++) {
        int routed = 0;
        for (int i = 0; i < T; i++)
            routed += ids[((size_t)r * T + i) * K] >= 0;
        ck_assert_int_eq(routed, (T * (r + 1) + 2) / 3);
    }
    draw_all(MOE_WORKLOAD_ZERO_RANK, 3, 0, ids, n); /* ranks 2 (of 0..2) get none */
    moe_placement p;
    moe_placement_init(&p, E, 3);
    for (int e = 0; e < E; e++)
        ck_assert_int_eq(n[e] == 0, p.expert_rank[e] >= 2);
    moe_placement_free(&p);
    moe_config cfg;
    moe_config_defaults(&cfg);
    cfg.experts = 8, cfg.topk = 5, cfg.workload = MOE_WORKLOAD_ZERO_RANK;
    moe_status st = {0};
    ck_assert_int_eq(moe_workload_validate(&cfg, 4, &st), MOE_EXIT_USAGE);
    ck_assert_ptr_nonnull(strstr(st.message, "--workload zero-rank"));
    cfg.topk = 4;
    ck_assert_int_eq(moe_workload_validate(&cfg, 4, &st), MOE_EXIT_OK);
    strcpy(cfg.skew, "zipf:1");
    ck_assert_int_eq(moe_workload_validate(&cfg, 4, &st), MOE_EXIT_USAGE);
    free(ids);
}
END_TEST

Suite *make_workload_suite(void)
{
    Suite *s = suite_create("workload");
    TCase *tc = tcase_create("workload");
    tcase_add_test(tc, balanced_gives_every_expert_the_same_pairs);
    tcase_add_test(tc, hot_experts_do_not_depend_on_the_ranks);
    tcase_add_test(tc, hot_rank_spread_and_rotating);
    tcase_add_test(tc, ragged_and_zero_rank);
    suite_add_tcase(s, tc);
    return s;
}
