/* check_layout.c — placement, and the dispatch/combine plan run through an
 * in-process all-to-all: every (token, slot) must come back as the output of
 * its own expert for its own token (the permutation and its inverse). */
#include <stdlib.h>
#include <string.h>

#include "moe/layout.h"
#include "suites.h"

START_TEST(placement_blocks_differ_by_at_most_one)
{
    const int cases[][2] = {{8, 4}, {10, 4}, {7, 3}, {3, 4}, {1, 1}, {64, 5}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        moe_placement p;
        moe_placement_init(&p, cases[c][0], cases[c][1]);
        int lo = 1 << 30, hi = -1;
        for (int r = 0; r < p.ranks; r++) {
            int n = moe_placement_local_experts(&p, r);
            lo = n < lo ? n : lo;
            hi = n > hi ? n : hi;
            for (int e = p.first_expert[r]; e < p.first_expert[r + 1]; e++)
                ck_assert_int_eq(p.expert_rank[e], r);
        }
        ck_assert_int_le(hi - lo, 1);
        ck_assert_int_eq(p.first_expert[p.ranks], p.experts);
        moe_placement_free(&p);
    }
    moe_placement p;
    moe_placement_init(&p, 10, 4);
    const int want[5] = {0, 3, 6, 8, 10};
    for (int r = 0; r <= 4; r++)
        ck_assert_int_eq(p.first_expert[r], want[r]);
    moe_placement_free(&p);
}
END_TEST

/* Token i of rank r picks k distinct experts by a fixed scramble. */
static void make_ids(int rank, int tokens, int experts, int topk, int32_t *ids)
{
    for (int i = 0; i < tokens; i++) {
        int start = (rank * 31 + i * 17 + (i * i) % 7) % experts;
        int step = 1 + (i % 3 == 0 && experts > topk * 2);
        for (int s = 0; s < topk; s++)
            ids[i * topk + s] = (start + s * step) % experts;
    }
}

/* G ranks, T tokens each, E experts, top-k. Rows carry (global token, 0);
 * each expert writes (global token, its id); all must come home right. */
static void round_trip(int G, int T, int E, int k)
{
    moe_placement p;
    moe_placement_init(&p, E, G);
    enum { WIDTH = 2 };
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(G * T * k)); /* (G, T, k) */
    moe_send_plan *send = calloc((size_t)G, sizeof *send);
    for (int r = 0; r < G; r++) {
        make_ids(r, T, E, k, ids + r * T * k);
        moe_send_plan_build(&send[r], &p, ids + r * T * k, T, k);
        /* dedup: one row per (token, destination) */
        for (int q = 0; q < G; q++) {
            moe_index tokens_to_q = 0;
            for (int i = 0; i < T; i++) {
                int hit = 0;
                for (int s = 0; s < k; s++)
                    hit |= p.expert_rank[ids[(r * T + i) * k + s]] == q;
                tokens_to_q += hit;
            }
            ck_assert_int_eq(send[r].row_count[q], tokens_to_q);
        }
    }
    /* The combine buffers coming back to each rank, filled below. */
    float **back = malloc(sizeof(float *) * (size_t)G);
    for (int r = 0; r < G; r++)
        back[r] = calloc((size_t)send[r].pair_offset[G] * WIDTH + 1, sizeof(float));

    for (int q = 0; q < G; q++) { /* receiver */
        moe_index rows = 0, rows_from[64];
        for (int r = 0; r < G; r++)
            rows += rows_from[r] = send[r].row_count[q];
        float *recv = malloc(sizeof(float) * (size_t)(rows * WIDTH + 1));
        int32_t *recv_ids = malloc(sizeof(int32_t) * (size_t)(rows * k + 1));
        moe_index at = 0;
        for (int r = 0; r < G; r++)
            for (moe_index n = send[r].row_offset[q]; n < send[r].row_offset[q + 1]; n++, at++) {
                moe_index i = send[r].row_token[n];
                recv[at * WIDTH] = (float)(r * T + i);
                recv[at * WIDTH + 1] = 0.0f;
                memcpy(recv_ids + at * k, ids + (r * T + i) * k, sizeof(int32_t) * (size_t)k);
            }
        moe_recv_plan plan;
        moe_recv_plan_build(&plan, &p, q, recv_ids, rows, k, rows_from);
        float *out = malloc(sizeof(float) * (size_t)(plan.pairs * WIDTH + 1));
        for (int l = 0; l < plan.local_experts; l++)
            for (moe_index m = plan.expert_offset[l]; m < plan.expert_offset[l + 1]; m++) {
                if (m > plan.expert_offset[l]) /* rows of an expert ascend */
                    ck_assert_int_lt(plan.expert_row[m - 1], plan.expert_row[m]);
                moe_index row = plan.expert_row[m], pair = plan.expert_pair[m];
                out[pair * WIDTH] = recv[row * WIDTH];
                out[pair * WIDTH + 1] = (float)(p.first_expert[q] + l);
            }
        /* Send back: pairs are grouped by source rank in order. */
        moe_index pair = 0;
        for (int r = 0; r < G; r++) {
            ck_assert_int_eq(plan.source_pairs[r], send[r].pair_count[q]);
            memcpy(back[r] + send[r].pair_offset[q] * WIDTH, out + pair * WIDTH,
                   sizeof(float) * (size_t)(plan.source_pairs[r] * WIDTH));
            pair += plan.source_pairs[r];
        }
        ck_assert_int_eq(pair, plan.pairs);
        moe_recv_plan_free(&plan);
        free(out);
        free(recv_ids);
        free(recv);
    }
    for (int r = 0; r < G; r++) {
        for (int i = 0; i < T; i++)
            for (int s = 0; s < k; s++) {
                const float *got = back[r] + send[r].slot_pair[i * k + s] * WIDTH;
                ck_assert_float_eq(got[0], (float)(r * T + i));
                ck_assert_float_eq(got[1], (float)ids[(r * T + i) * k + s]);
            }
        free(back[r]);
        moe_send_plan_free(&send[r]);
    }
    free(back);
    free(send);
    free(ids);
    moe_placement_free(&p);
}

START_TEST(dispatch_and_combine_are_inverse)
{
    const int cases[][4] = {
        {1, 9, 4, 2}, {2, 16, 8, 2}, {3, 13, 7, 3}, {4, 10, 8, 1},
        {4, 11, 8, 4}, {4, 7, 3, 2}, {5, 6, 16, 16}, {4, 0, 8, 2},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        round_trip(cases[c][0], cases[c][1], cases[c][2], cases[c][3]);
}
END_TEST

START_TEST(reduce_sums_in_slot_order)
{
    moe_placement p;
    moe_placement_init(&p, 4, 2);
    const int32_t ids[2 * 2] = {3, 0, 1, 2}; /* token 0 -> ranks 1, 0; token 1 -> 0, 1 */
    const float weights[4] = {0.75f, 0.25f, 0.5f, 0.5f};
    moe_send_plan plan;
    moe_send_plan_build(&plan, &p, ids, 2, 2);
    /* back rows: rank 0's pairs (token 0 slot 1, token 1 slot 0), then rank 1's. */
    ck_assert_int_eq(plan.slot_pair[0], 2);
    ck_assert_int_eq(plan.slot_pair[1], 0);
    ck_assert_int_eq(plan.slot_pair[2], 1);
    ck_assert_int_eq(plan.slot_pair[3], 3);
    const float back[4] = {10.0f, 20.0f, 30.0f, 40.0f}; /* (pairs, d=1) */
    float y[2];
    moe_combine_reduce(&plan, weights, back, 1, y);
    ck_assert_float_eq(y[0], 0.75f * 30.0f + 0.25f * 10.0f);
    ck_assert_float_eq(y[1], 0.5f * 20.0f + 0.5f * 40.0f);
    moe_send_plan_free(&plan);
    moe_placement_free(&p);
}
END_TEST

Suite *make_layout_suite(void)
{
    Suite *s = suite_create("layout");
    TCase *tc = tcase_create("plan");
    tcase_add_test(tc, placement_blocks_differ_by_at_most_one);
    tcase_add_test(tc, dispatch_and_combine_are_inverse);
    tcase_add_test(tc, reduce_sums_in_slot_order);
    suite_add_tcase(s, tc);
    return s;
}
