/* SPDX-License-Identifier: MIT */
/* check_layout.c — placement, and the dispatch/combine plan run through an
 * in-process all-to-all: every (token, slot) must come back as the output of
 * its own expert for its own token (the permutation and its inverse). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe/config.h"
#include "moe/layout.h"
#include "moe/wave_estimate.h"
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

/* The nodes a group-limited token can reach, from the placement: V3's 8
 * groups on 8 nodes keep it to 4; 8 groups on 4 nodes (two a node) let it
 * reach all 4; 4 groups on 8 nodes (each spanning two) keeping 2 reach 4. */
START_TEST(group_node_limit_follows_the_placement)
{
    const struct {
        int experts, ranks, per_node, groups, kept, want;
    } cases[] = {{256, 64, 8, 8, 4, 4}, {256, 64, 16, 8, 4, 4}, {256, 64, 8, 4, 2, 4},
                 {64, 8, 2, 8, 4, 4},   {64, 8, 1, 8, 4, 4},    {64, 8, 2, 4, 2, 2},
                 {64, 8, 2, 8, 1, 1},   {30, 6, 2, 3, 1, 1},    {30, 4, 2, 3, 1, 2}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        moe_placement p;
        moe_placement_init(&p, cases[c].experts, cases[c].ranks);
        ck_assert_int_eq(moe_group_node_limit(&p, cases[c].groups, cases[c].kept, cases[c].per_node),
                         cases[c].want);
        moe_placement_free(&p);
    }
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

/* One round of the plan (a wave, or the whole forward when waves is NULL)
 * through an in-process all-to-all. Rows carry (global token, 0); each
 * expert writes (global token, its id); slot_rows (G, T, k) gets where each
 * (token, slot) of this round landed on its home rank. */
enum { WIDTH = 2 };
static void round_trip_wave(const moe_placement *p, const int32_t *ids, const float *weights,
                            int T, int k, const moe_waves *waves, int wave, float **back,
                            const float **slot_rows)
{
    const int G = p->ranks;
    moe_send_plan *send = calloc((size_t)G, sizeof *send);
    for (int r = 0; r < G; r++) {
        moe_send_plan_build(&send[r], p, ids + r * T * k, T, k, waves, wave);
        /* dedup: one row per (token, destination) with a slot of this round */
        for (int q = 0; q < G; q++) {
            moe_index tokens_to_q = 0;
            for (int i = 0; i < T; i++) {
                int hit = 0;
                for (int s = 0; s < k; s++) {
                    int e = ids[(r * T + i) * k + s];
                    hit |= p->expert_rank[e] == q && (!waves || moe_wave_of(waves, i, e) == wave);
                }
                tokens_to_q += hit;
            }
            ck_assert_int_eq(send[r].row_count[q], tokens_to_q);
        }
        back[r] = calloc((size_t)send[r].pair_offset[G] * WIDTH + 1, sizeof(float));
    }
    for (int q = 0; q < G; q++) { /* receiver */
        moe_index rows = 0, rows_from[64];
        for (int r = 0; r < G; r++)
            rows += rows_from[r] = send[r].row_count[q];
        float *recv = malloc(sizeof(float) * (size_t)(rows * WIDTH + 1));
        int32_t *recv_meta = malloc(sizeof(int32_t) * (size_t)(rows * MOE_META_WORDS(k) + 1));
        moe_index at = 0;
        for (int r = 0; r < G; r++)
            for (moe_index n = send[r].row_offset[q]; n < send[r].row_offset[q + 1]; n++, at++) {
                moe_index i = send[r].row_token[n];
                recv[at * WIDTH] = (float)(r * T + i);
                recv[at * WIDTH + 1] = 0.0f;
                moe_pack_meta(ids + r * T * k, weights + r * T * k, k, &i, 1, (moe_index)r * T,
                              recv_meta + at * MOE_META_WORDS(k));
                ck_assert_int_eq(moe_meta_token(recv_meta + at * MOE_META_WORDS(k), k), r * T + i);
            }
        moe_recv_plan plan;
        moe_recv_plan_build(&plan, p, q, recv_meta, rows, k, rows_from, waves, wave);
        /* the wave's local experts: [wave_first, wave_end), those of its wave */
        for (int l = 0; l < plan.local_experts; l++) {
            const int e = p->first_expert[q] + l;
            const int in_wave = !waves || waves->kind != MOE_WAVES_EXPERT_SLOTS ||
                                 waves->expert_wave[e] == wave;
            ck_assert_int_eq(l >= plan.wave_first && l < plan.wave_end, in_wave);
        }
        float *out = malloc(sizeof(float) * (size_t)(plan.pairs * WIDTH + 1));
        for (int l = 0; l < plan.local_experts; l++)
            for (moe_index m = plan.expert_offset[l]; m < plan.expert_offset[l + 1]; m++) {
                if (m > plan.expert_offset[l]) /* rows of an expert ascend */
                    ck_assert_int_lt(plan.expert_row[m - 1], plan.expert_row[m]);
                moe_index row = plan.expert_row[m], pair = plan.expert_pair[m];
                /* the pair's slot names this expert and carries its weight */
                const int32_t *meta = recv_meta + row * MOE_META_WORDS(k);
                ck_assert_int_eq(moe_meta_id(meta, plan.expert_slot[m]), p->first_expert[q] + l);
                ck_assert_float_eq(moe_meta_weight(meta, k, plan.expert_slot[m]),
                                   recv[row * WIDTH] * 16.0f + (float)plan.expert_slot[m]);
                out[pair * WIDTH] = recv[row * WIDTH];
                out[pair * WIDTH + 1] = (float)(p->first_expert[q] + l);
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
        free(recv_meta);
        free(recv);
    }
    for (int r = 0; r < G; r++) {
        for (int n = 0; n < T * k; n++)
            if (send[r].slot_pair[n] >= 0) {
                ck_assert_ptr_null(slot_rows[r * T * k + n]); /* in exactly one round */
                slot_rows[r * T * k + n] = back[r] + send[r].slot_pair[n] * WIDTH;
            }
        moe_send_plan_free(&send[r]);
    }
    free(send);
}

/* G ranks, T tokens each, E experts, top-k, W waves (0: no waves): every
 * (token, slot) must come home once, as its own expert's output. */
static void round_trip(int G, int T, int E, int k, int W)
{
    moe_placement p;
    moe_placement_init(&p, E, G);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(G * T * k + 1)); /* (G, T, k) */
    float *weights = malloc(sizeof(float) * (size_t)(G * T * k + 1));  /* 16 * token + slot */
    for (int r = 0; r < G; r++)
        make_ids(r, T, E, k, ids + r * T * k);
    for (int n = 0; n < G * T * k; n++)
        weights[n] = (float)(16 * (n / k) + n % k);
    const float **slot_rows = calloc((size_t)(G * T * k + 1), sizeof *slot_rows);
    const int rounds = W ? W : 1;
    float **back = calloc((size_t)(G * rounds), sizeof *back);
    moe_waves waves;
    if (W)
        moe_waves_init(&waves, &p, W, T);
    for (int w = 0; w < rounds; w++)
        round_trip_wave(&p, ids, weights, T, k, W ? &waves : NULL, w, back + w * G, slot_rows);
    for (int r = 0; r < G; r++)
        for (int i = 0; i < T; i++)
            for (int s = 0; s < k; s++) {
                const float *got = slot_rows[(r * T + i) * k + s];
                ck_assert_ptr_nonnull(got);
                ck_assert_float_eq(got[0], (float)(r * T + i));
                ck_assert_float_eq(got[1], (float)ids[(r * T + i) * k + s]);
            }
    for (int n = 0; n < G * rounds; n++)
        free(back[n]);
    if (W)
        moe_waves_free(&waves);
    free(back);
    free(slot_rows);
    free(weights);
    free(ids);
    moe_placement_free(&p);
}

static const int round_trip_cases[][4] = {
    {1, 9, 4, 2}, {2, 16, 8, 2}, {3, 13, 7, 3}, {4, 10, 8, 1},
    {4, 11, 8, 4}, {4, 7, 3, 2}, {5, 6, 16, 16}, {4, 0, 8, 2},
};

START_TEST(dispatch_and_combine_are_inverse)
{
    for (size_t c = 0; c < sizeof round_trip_cases / sizeof round_trip_cases[0]; c++)
        round_trip(round_trip_cases[c][0], round_trip_cases[c][1], round_trip_cases[c][2],
                   round_trip_cases[c][3], 0);
}
END_TEST

/* The same with W = 1, 2, 3, 4, 8 waves: expert-slot waves where every rank
 * holds W experts, token chunks elsewhere. */
START_TEST(waves_partition_the_pairs)
{
    static const int W[] = {1, 2, 3, 4, 8};
    for (size_t c = 0; c < sizeof round_trip_cases / sizeof round_trip_cases[0]; c++)
        for (size_t w = 0; w < sizeof W / sizeof W[0]; w++)
            round_trip(round_trip_cases[c][0], round_trip_cases[c][1], round_trip_cases[c][2],
                       round_trip_cases[c][3], W[w]);
}
END_TEST

START_TEST(wave_kinds_and_boundaries)
{
    moe_placement p;
    moe_placement_init(&p, 10, 2); /* 5 experts per rank */
    moe_waves w;
    moe_waves_init(&w, &p, 2, 7);
    ck_assert_int_eq(w.kind, MOE_WAVES_EXPERT_SLOTS);
    const int want[10] = {0, 0, 0, 1, 1, 0, 0, 0, 1, 1}; /* floor(l*2/5) */
    for (int e = 0; e < 10; e++)
        ck_assert_int_eq(moe_wave_of(&w, 0, e), want[e]);
    moe_waves_free(&w);
    moe_waves_init(&w, &p, 6, 7); /* 5 experts < 6 waves: token chunks */
    ck_assert_int_eq(w.kind, MOE_WAVES_TOKEN_CHUNKS);
    for (int wave = 0; wave < 6; wave++)
        for (moe_index i = moe_wave_first_token(&w, wave); i < moe_wave_first_token(&w, wave + 1); i++)
            ck_assert_int_eq(moe_wave_of(&w, i, 0), wave);
    ck_assert_int_eq(moe_wave_first_token(&w, 6), 7);
    moe_waves_free(&w);
    moe_placement_free(&p);
}
END_TEST

START_TEST(reduce_sums_in_slot_order)
{
    moe_placement p;
    moe_placement_init(&p, 4, 2);
    const int32_t ids[2 * 2] = {3, 0, 1, 2}; /* token 0 -> ranks 1, 0; token 1 -> 0, 1 */
    const float weights[4] = {0.75f, 0.25f, 0.5f, 0.5f};
    moe_send_plan plan;
    moe_send_plan_build(&plan, &p, ids, 2, 2, NULL, 0);
    /* back rows: rank 0's pairs (token 0 slot 1, token 1 slot 0), then rank 1's. */
    ck_assert_int_eq(plan.slot_pair[0], 2);
    ck_assert_int_eq(plan.slot_pair[1], 0);
    ck_assert_int_eq(plan.slot_pair[2], 1);
    ck_assert_int_eq(plan.slot_pair[3], 3);
    const float back[4] = {10.0f, 20.0f, 30.0f, 40.0f}; /* (pairs, d=1) */
    float y[2];
    const float *slot_rows[4];
    const float *from[2] = {back, back + 2};
    moe_combine_locate(&plan, from, 1, slot_rows);
    moe_combine_reduce(slot_rows, weights, 2, 2, 1, y);
    ck_assert_float_eq(y[0], 0.75f * 30.0f + 0.25f * 10.0f);
    ck_assert_float_eq(y[1], 0.5f * 20.0f + 0.5f * 40.0f);
    /* rank 0's pairs read from elsewhere (its own send buffer) */
    const float own[2] = {11.0f, 21.0f};
    const float *split[2] = {own, back + 2};
    moe_combine_locate(&plan, split, 1, slot_rows);
    moe_combine_reduce(slot_rows, weights, 2, 2, 1, y);
    ck_assert_float_eq(y[0], 0.75f * 30.0f + 0.25f * 11.0f);
    ck_assert_float_eq(y[1], 0.5f * 21.0f + 0.5f * 40.0f);
    moe_send_plan_free(&plan);
    moe_placement_free(&p);
}
END_TEST

START_TEST(gather_follows_row_pointers_across_buffers)
{
    const float own[2 * 2] = {1, 2, 3, 4}, others[3 * 2] = {5, 6, 7, 8, 9, 10}; /* width 2 */
    const float *row_at[5] = {others, own, own + 2, others + 2, others + 4};
    const moe_index index[3] = {4, 1, 0};
    float out[3 * 2];
    moe_gather_row_ptrs(row_at, 2, index, 3, out);
    const float want[3 * 2] = {9, 10, 1, 2, 5, 6};
    for (int n = 0; n < 6; n++)
        ck_assert_float_eq(out[n], want[n]);
}
END_TEST

/* A link of bandwidth B (bytes/s) on both tiers, G ranks on one node. */
static moe_link flat_link(double bandwidth, int ranks)
{
    moe_link link = {.enabled = true, .ranks_per_node = ranks};
    for (int t = 0; t < MOE_TIERS; t++)
        link.bandwidth[t] = bandwidth;
    return link;
}

START_TEST(wave_estimate_misses_by_the_hypergeometric_law)
{
    ck_assert_double_eq(moe_waves_miss(64, 6, 0), 1.0);
    ck_assert_double_eq(moe_waves_miss(64, 6, 64), 0.0);
    ck_assert_double_eq(moe_waves_miss(64, 6, 59), 0.0); /* 5 experts left for 6 picks */
    ck_assert_double_eq_tol(moe_waves_miss(64, 6, 1), 58.0 / 64.0, 1e-15);
    /* C(56, 6) / C(64, 6) */
    ck_assert_double_eq_tol(moe_waves_miss(64, 6, 8), 32468436.0 / 74974368.0, 1e-12);
}
END_TEST

/* The estimate's rows against the rows moe_send_plan_build counts for
 * uniformly drawn top-k ids: every rank's dispatch to the others, summed
 * over the waves, for each grouping. */
START_TEST(wave_estimate_counts_the_rows_waves_send)
{
    enum { E = 64, G = 4, K = 6, T = 4096, W = 4 };
    moe_placement p;
    moe_placement_init(&p, E, G);
    int32_t *ids = malloc(sizeof(int32_t) * T * K);
    uint64_t state = 0x9E3779B97F4A7C15u;
    for (int i = 0; i < T; i++) { /* k distinct experts: a partial Fisher-Yates shuffle */
        int deck[E];
        for (int e = 0; e < E; e++)
            deck[e] = e;
        for (int s = 0; s < K; s++) {
            state ^= state << 13, state ^= state >> 7, state ^= state << 17;
            const int pick = s + (int)(state % (uint64_t)(E - s));
            const int e = deck[pick];
            deck[pick] = deck[s];
            deck[s] = e;
            ids[i * K + s] = e;
        }
    }
    const moe_link link = flat_link(1e9, G);
    for (int kind = 0; kind < 2; kind++) {
        moe_waves w;
        moe_waves_init_by(&w, &p, W, T, kind == MOE_WAVES_EXPERT_SLOTS ? MOE_WAVE_BY_EXPERTS : MOE_WAVE_BY_TOKENS);
        double sent = 0.0; /* rank 0's rows to the other ranks */
        for (int wave = 0; wave < W; wave++) {
            moe_send_plan plan;
            moe_send_plan_build(&plan, &p, ids, T, K, &w, wave);
            for (int r = 1; r < G; r++)
                sent += (double)plan.row_count[r];
            moe_send_plan_free(&plan);
        }
        moe_waves_free(&w);
        const moe_wave_traffic t = {.placement = &p, .link = &link, .tokens = T, .topk = K, .waves = W,
                                    .reduced = true, .dispatch_row_bytes = 1.0, .combine_row_bytes = 1.0};
        moe_wave_estimate e;
        moe_waves_estimate(&t, kind, &e);
        /* about 10^4 rows: the draw's spread is about 1 % */
        ck_assert_double_eq_tol(e.rows / sent, 1.0, 0.03);
    }
    free(ids);
    moe_placement_free(&p);
}
END_TEST

/* The reduced combine sends a token's sum on a rank once, whatever the
 * grouping: with only combine bytes on the wire every W moves one wave's. */
START_TEST(wave_estimate_reduced_combine_goes_once)
{
    moe_placement p;
    moe_placement_init(&p, 64, 2);
    const moe_link link = flat_link(1.0, 2); /* seconds = bytes */
    moe_wave_traffic t = {.placement = &p, .link = &link, .tokens = 512, .topk = 6, .waves = 1,
                          .reduced = true, .dispatch_row_bytes = 0.0, .combine_row_bytes = 1.0};
    moe_wave_estimate one, slots, chunks;
    moe_waves_estimate(&t, MOE_WAVES_EXPERT_SLOTS, &one);
    ck_assert_double_eq_tol(one.comm, 512.0 * (1.0 - moe_waves_miss(64, 6, 32)), 1e-9);
    t.waves = 4;
    moe_waves_estimate(&t, MOE_WAVES_EXPERT_SLOTS, &slots);
    moe_waves_estimate(&t, MOE_WAVES_TOKEN_CHUNKS, &chunks);
    ck_assert_double_eq_tol(slots.comm, one.comm, 1e-9);
    ck_assert_double_eq_tol(chunks.comm, one.comm, 1e-9);
    /* the last wave of expert slots combines every token whose last expert
     * there is in it: more than a quarter; a chunk of tokens a quarter */
    ck_assert_double_eq_tol(slots.tail, 512.0 * (1.0 - moe_waves_miss(64, 6, 8)), 1e-9);
    ck_assert_double_eq_tol(chunks.tail, one.comm / 4, 1e-9);
    moe_placement_free(&p);
}
END_TEST

/* A slow link picks token chunks (expert slots resend tokens), a free one
 * expert slots (token chunks split the GEMMs); fewer experts than waves
 * leave token chunks alone. */
START_TEST(wave_choice_follows_the_scarcer_resource)
{
    moe_placement p;
    moe_placement_init(&p, 64, 2);
    moe_link link = flat_link(1e6, 2);
    moe_wave_traffic t = {.placement = &p, .link = &link, .tokens = 512, .topk = 6, .waves = 4,
                          .reduced = true, .dispatch_row_bytes = 4136.0, .combine_row_bytes = 4096.0,
                          .compute_whole = 0.1, .compute_chunked = 0.15};
    moe_wave_estimate est[2];
    ck_assert_int_eq(moe_waves_choose(&t, est), MOE_WAVE_BY_TOKENS);
    ck_assert_double_gt(est[MOE_WAVES_EXPERT_SLOTS].rows, 2.0 * est[MOE_WAVES_TOKEN_CHUNKS].rows);
    for (int tier = 0; tier < MOE_TIERS; tier++)
        link.bandwidth[tier] = INFINITY;
    ck_assert_int_eq(moe_waves_choose(&t, est), MOE_WAVE_BY_EXPERTS);
    ck_assert_double_eq(est[MOE_WAVES_EXPERT_SLOTS].time, 0.1);
    ck_assert_double_eq(est[MOE_WAVES_TOKEN_CHUNKS].time, 0.15);
    t.waves = 33; /* 32 experts a rank */
    ck_assert_int_eq(moe_waves_choose(&t, est), MOE_WAVE_BY_TOKENS);
    ck_assert_double_eq(est[MOE_WAVES_EXPERT_SLOTS].time, 0.0);
    moe_placement_free(&p);
}
END_TEST

/* The shared experts run in the waits: beside a comm-bound grouping they
 * cost nothing, after a compute-bound one's routed experts all they do not
 * fit in its first dispatch and last combine. At W = 8 on a slow link
 * token chunks, compute-bound and a little faster without them, lose. */
START_TEST(wave_choice_counts_the_shared_experts)
{
    moe_placement p;
    moe_placement_init(&p, 64, 2);
    const moe_link link = flat_link(1e6, 2);
    moe_wave_traffic t = {.placement = &p, .link = &link, .tokens = 512, .topk = 6, .waves = 8,
                          .reduced = true, .dispatch_row_bytes = 4136.0, .combine_row_bytes = 4096.0};
    moe_wave_estimate slots, chunks, est[2];
    moe_waves_estimate(&t, MOE_WAVES_EXPERT_SLOTS, &slots);
    moe_waves_estimate(&t, MOE_WAVES_TOKEN_CHUNKS, &chunks);
    const double T = slots.time; /* comm alone: no compute given */
    t.compute_whole = 0.5 * T;
    t.compute_chunked = 0.97 * T - chunks.head - chunks.tail;
    ck_assert_double_gt(t.compute_chunked, chunks.head + chunks.tail);
    ck_assert_int_eq(moe_waves_choose(&t, est), MOE_WAVE_BY_TOKENS);
    ck_assert_double_eq_tol(est[MOE_WAVES_TOKEN_CHUNKS].time, 0.97 * T, 1e-12);
    t.compute_shared = 0.2 * T;
    ck_assert_int_eq(moe_waves_choose(&t, est), MOE_WAVE_BY_EXPERTS);
    ck_assert_double_eq_tol(est[MOE_WAVES_EXPERT_SLOTS].time, T, 1e-12);
    ck_assert_double_eq_tol(est[MOE_WAVES_TOKEN_CHUNKS].time, t.compute_chunked + 0.2 * T, 1e-12);
    moe_placement_free(&p);
}
END_TEST

Suite *make_layout_suite(void)
{
    Suite *s = suite_create("layout");
    TCase *tc = tcase_create("plan");
    tcase_add_test(tc, placement_blocks_differ_by_at_most_one);
    tcase_add_test(tc, group_node_limit_follows_the_placement);
    tcase_add_test(tc, dispatch_and_combine_are_inverse);
    tcase_add_test(tc, waves_partition_the_pairs);
    tcase_add_test(tc, wave_kinds_and_boundaries);
    tcase_add_test(tc, reduce_sums_in_slot_order);
    tcase_add_test(tc, gather_follows_row_pointers_across_buffers);
    tcase_add_test(tc, wave_estimate_misses_by_the_hypergeometric_law);
    tcase_add_test(tc, wave_estimate_counts_the_rows_waves_send);
    tcase_add_test(tc, wave_estimate_reduced_combine_goes_once);
    tcase_add_test(tc, wave_choice_follows_the_scarcer_resource);
    tcase_add_test(tc, wave_choice_counts_the_shared_experts);
    suite_add_tcase(s, tc);
    return s;
}
