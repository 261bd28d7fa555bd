/* SPDX-License-Identifier: MIT */
/* check_router.c — gate logits and softmax top-k on hand-made cases. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe/router.h"
#include "suites.h"

START_TEST(logits_are_exact_dot_products)
{
    const float x[2 * 3] = {1, 2, 3, -1, 0.5f, 0};   /* (T=2, d=3) */
    const float gate[2 * 3] = {1, 0, 0, 0.25f, 1, -1}; /* (E=2, d=3) */
    float logits[4];
    moe_router_logits(x, gate, 2, 3, 2, logits);
    ck_assert_float_eq(logits[0], 1.0f);
    ck_assert_float_eq(logits[1], 0.25f + 2.0f - 3.0f);
    ck_assert_float_eq(logits[2], -1.0f);
    ck_assert_float_eq(logits[3], -0.25f + 0.5f);
}
END_TEST

/* The blocked, vectorised gate against the plain definition, bit for bit,
 * with each register width the CPU has, on shapes with full 8- and 2-token
 * by 16-expert blocks and tails of both, within one batch of tokens and
 * across batches. Every third term is +2^40 g and the next -2^40 g, so the
 * running sum loses low bits in a way that depends on the order of the
 * terms (checked: summing backwards changes some logits). */
static void check_gate_shape(int T, int E, int D)
{
    float *x = malloc(sizeof(float) * (size_t)(T * D));
    float *gate = malloc(sizeof(float) * (size_t)(E * D));
    float *logits = malloc(sizeof(float) * (size_t)(T * E));
    float *want = malloc(sizeof(float) * (size_t)(T * E));
    float *backwards = malloc(sizeof(float) * (size_t)(T * E));
    for (int i = 0; i < T; i++)
        for (int j = 0; j < D; j++)
            x[i * D + j] = j % 3 == 1   ? 0x1p40f
                           : j % 3 == 2 ? -0x1p40f
                                        : (float)((i * 7919 + j * 104729) % 2003 - 1001) / 1001.0f;
    for (int e = 0; e < E; e++)
        for (int j = 0; j < D; j++)
            gate[e * D + j] = j % 3 == 2 ? gate[e * D + j - 1]
                                         : (float)((e * 31 + j * 131) % 1999 - 999) / 999.0f;
    for (int i = 0; i < T; i++)
        for (int e = 0; e < E; e++) {
            double acc = 0.0, back = 0.0;
            for (int j = 0; j < D; j++)
                acc += (double)x[i * D + j] * (double)gate[e * D + j];
            for (int j = D - 1; j >= 0; j--)
                back += (double)x[i * D + j] * (double)gate[e * D + j];
            want[i * E + e] = (float)acc;
            backwards[i * E + e] = (float)back;
        }
    ck_assert_int_ne(memcmp(want, backwards, sizeof(float) * (size_t)(T * E)), 0);
    const enum moe_isa isas[] = {MOE_ISA_WIDEST, MOE_ISA_AVX2, MOE_ISA_PORTABLE};
    for (size_t w = 0; w < sizeof isas / sizeof isas[0]; w++) {
        moe_router_logits_force(isas[w]);
        memset(logits, 0xff, sizeof(float) * (size_t)(T * E));
        moe_router_logits(x, gate, T, D, E, logits);
        ck_assert_msg(memcmp(logits, want, sizeof(float) * (size_t)(T * E)) == 0,
                      "T=%d E=%d d=%d, isa %zu: logits differ from the j-ordered sum", T, E, D, w);
    }
    moe_router_logits_force(MOE_ISA_WIDEST);
    free(backwards);
    free(want);
    free(logits);
    free(gate);
    free(x);
}

START_TEST(logits_are_the_j_ordered_sum_whatever_the_blocking)
{
    check_gate_shape(7, 13, 301);  /* one batch: 2-token blocks and a 1-token tail, part of a strip */
    check_gate_shape(19, 37, 97);  /* 8-token blocks, a 2-token one and a tail; strips 16, 16, 5 */
    check_gate_shape(75, 16, 64);  /* three batches, the last of 11 tokens; one full strip */
}
END_TEST

START_TEST(topk_is_descending_and_weights_normalised)
{
    const moe_router r = {MOE_ROUTER_SOFTMAX, 5, 3, true, 1, 1, 1.0f, NULL, NULL, false};
    const float logits[5] = {0.0f, 2.0f, -1.0f, 1.0f, 3.0f};
    float scores[5], weights[3];
    int32_t ids[3];
    moe_router_select(&r, logits, 1, scores, ids, weights);
    ck_assert_int_eq(ids[0], 4);
    ck_assert_int_eq(ids[1], 1);
    ck_assert_int_eq(ids[2], 3);
    double z = exp(0.0) + exp(2.0) + exp(-1.0) + exp(1.0) + exp(3.0);
    ck_assert_double_eq_tol(scores[4], exp(3.0) / z, 1e-7);
    double top = exp(3.0) + exp(2.0) + exp(1.0);
    ck_assert_double_eq_tol(weights[0], exp(3.0) / top, 1e-7);
    ck_assert_double_eq_tol(weights[2], exp(1.0) / top, 1e-7);
    ck_assert_double_eq_tol((double)weights[0] + weights[1] + weights[2], 1.0, 1e-6);
}
END_TEST

/* --route-scale applies in the softmax router too, as V2 and V3 apply it:
 * every weight exactly the scale times the unscaled one. */
START_TEST(route_scale_applies_in_every_router)
{
    const float logits[5] = {0.0f, 2.0f, -1.0f, 1.0f, 3.0f};
    float scores[5], plain[3], scaled[3];
    int32_t ids[3];
    for (int normalize = 0; normalize < 2; normalize++) {
        moe_router r = {MOE_ROUTER_SOFTMAX, 5, 3, normalize, 1, 1, 1.0f, NULL, NULL, false};
        moe_router_select(&r, logits, 1, scores, ids, plain);
        r.route_scale = 2.5f;
        moe_router_select(&r, logits, 1, scores, ids, scaled);
        for (int s = 0; s < 3; s++)
            ck_assert_float_eq(scaled[s], plain[s] * 2.5f);
    }
}
END_TEST

/* --topk-weights-dtype bf16: the scaled fp32 weight rounded to bf16 (nearest
 * even), last; the ids unchanged. */
START_TEST(bf16_weights_round_last)
{
    const float logits[5] = {0.0f, 2.0f, -1.0f, 1.0f, 3.0f};
    float scores[5], plain[3], rounded[3];
    int32_t ids[3], ids_bf16[3];
    moe_router r = {MOE_ROUTER_SOFTMAX, 5, 3, true, 1, 1, 2.5f, NULL, NULL, false};
    moe_router_select(&r, logits, 1, scores, ids, plain);
    r.bf16_weights = true;
    moe_router_select(&r, logits, 1, scores, ids_bf16, rounded);
    for (int s = 0; s < 3; s++) {
        ck_assert_int_eq(ids_bf16[s], ids[s]);
        uint32_t bits;
        memcpy(&bits, &rounded[s], sizeof bits);
        ck_assert_uint_eq(bits & 0xffffu, 0);
        ck_assert(fabsf(rounded[s] - plain[s]) <= ldexpf(1.0f, ilogbf(plain[s]) - 8));
    }
}
END_TEST

START_TEST(ties_go_to_the_lower_expert)
{
    const moe_router r = {MOE_ROUTER_SOFTMAX, 6, 3, true, 1, 1, 1.0f, NULL, NULL, false};
    const float logits[6] = {1.0f, 5.0f, 1.0f, 5.0f, 1.0f, 0.0f};
    float scores[6], weights[3];
    int32_t ids[3];
    moe_router_select(&r, logits, 1, scores, ids, weights);
    ck_assert_int_eq(ids[0], 1);
    ck_assert_int_eq(ids[1], 3);
    ck_assert_int_eq(ids[2], 0);
    ck_assert_float_eq(weights[0], weights[1]);
}
END_TEST

START_TEST(all_equal_logits_pick_the_first_k)
{
    const moe_router r = {MOE_ROUTER_SOFTMAX, 4, 4, false, 1, 1, 1.0f, NULL, NULL, false};
    const float logits[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    float scores[4], weights[4];
    int32_t ids[4];
    moe_router_select(&r, logits, 1, scores, ids, weights);
    for (int s = 0; s < 4; s++) {
        ck_assert_int_eq(ids[s], s);
        ck_assert_float_eq(weights[s], 0.25f); /* not normalised: the scores */
    }
}
END_TEST

/* The choice, on many tokens whose logits take four values (ties
 * everywhere) and with masked groups (-inf: one group kept, then three), is
 * the k-pass selection's: at
 * each pass the first of the largest values not yet taken. */
START_TEST(topk_is_the_k_pass_selection_under_ties)
{
    enum { T = 300, E = 32, K = 8 };
    const float bias[E] = {0};
    /* a group kept: fewer finite values than K, so -inf ones are taken too */
    const moe_router r = {MOE_ROUTER_DEEPSEEK_V3, E, K, true, 8, 1 + 2 * _i, 1.0f, bias, NULL, false};
    const float level[4] = {-1.0f, 0.0f, 0.5f, 1.0f};
    float *logits = malloc(sizeof(float) * T * E), *scores = malloc(sizeof(float) * T * E);
    float weights[T * K];
    int32_t ids[T * K];
    for (int n = 0; n < T * E; n++)
        logits[n] = level[(n * 7 + n / 13) % 4];
    moe_router_select(&r, logits, T, scores, ids, weights);
    for (int i = 0; i < T; i++) {
        float biased[E];
        unsigned char keep[8], taken[E] = {0};
        float group_score[8];
        memcpy(biased, scores + i * E, sizeof biased);
        moe_router_groups(&r, biased, group_score, keep);
        for (int e = 0; e < E; e++)
            biased[e] = keep[e / 4] ? biased[e] : -INFINITY;
        for (int s = 0; s < K; s++) {
            int best = -1;
            for (int e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || biased[e] > biased[best]))
                    best = e;
            taken[best] = 1;
            ck_assert_int_eq(ids[i * K + s], best);
        }
    }
    free(scores);
    free(logits);
}
END_TEST

static double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

static moe_router v3(int E, int k, int groups, int topk_groups, const float *bias)
{
    return (moe_router){MOE_ROUTER_DEEPSEEK_V3, E, k, false, groups, topk_groups, 2.5f, bias, NULL, false};
}

/* The bias picks expert 0 although its score is the lowest; the weights are
 * the unbiased sigmoid scores, normalised, times route_scale. */
START_TEST(v3_bias_selects_but_does_not_weigh)
{
    const float logits[4] = {-1.0f, 0.5f, 1.0f, 0.0f};
    const float bias[4] = {2.0f, 0.0f, 0.0f, 0.0f};
    const moe_router r = v3(4, 2, 1, 1, bias);
    float scores[4], weights[2];
    int32_t ids[2];
    moe_router_select(&r, logits, 1, scores, ids, weights);
    ck_assert_int_eq(ids[0], 0); /* 0.269 + 2 */
    ck_assert_int_eq(ids[1], 2); /* 0.731 */
    const double s0 = (float)sigmoid(-1.0), s2 = (float)sigmoid(1.0);
    ck_assert_float_eq(scores[0], (float)sigmoid(-1.0));
    ck_assert_float_eq(weights[0], (float)(s0 / (s0 + s2)) * 2.5f);
    ck_assert_float_eq(weights[1], (float)(s2 / (s0 + s2)) * 2.5f);
}
END_TEST

/* Biased scores all negative: the masked group must still lose. A port that
 * masks with 0 instead of -inf picks experts 0 and 1 here. */
START_TEST(v3_masked_groups_lose_even_when_scores_are_negative)
{
    const float logits[4] = {3.0f, 2.9f, 0.0f, 0.1f};
    const float bias[4] = {-9.0f, -9.0f, -5.0f, -5.0f};
    const moe_router r = v3(4, 2, 2, 1, bias); /* groups {0,1}, {2,3}; keep 1 */
    float scores[4], weights[2];
    int32_t ids[2];
    moe_router_select(&r, logits, 1, scores, ids, weights);
    ck_assert_int_eq(ids[0], 3);
    ck_assert_int_eq(ids[1], 2);
}
END_TEST

/* Group scores: V3 sums the two best biased scores of a group. Group 0 has
 * the single best expert but group 1 the better pair. */
START_TEST(v3_group_score_is_the_top_two_sum)
{
    const float logits[6] = {4.0f, -4.0f, -4.0f, 1.0f, 1.0f, 1.0f};
    const float bias[6] = {0};
    const moe_router r = v3(6, 2, 2, 1, bias);
    float scores[6], weights[2];
    int32_t ids[2];
    moe_router_select(&r, logits, 1, scores, ids, weights);
    ck_assert_int_eq(ids[0], 3); /* equal scores: lower index first */
    ck_assert_int_eq(ids[1], 4);
}
END_TEST

/* Without a bias (V2 style): softmax scores, group score = the group's best,
 * weights unnormalised, times route_scale. Equal groups: the lower wins. */
START_TEST(v2_style_without_bias)
{
    const float logits[4] = {1.0f, 0.0f, 1.0f, 0.5f};
    const moe_router r = v3(4, 1, 2, 1, NULL);
    float scores[4], weights[1];
    int32_t ids[1];
    moe_router_select(&r, logits, 1, scores, ids, weights);
    ck_assert_int_eq(ids[0], 0);
    const double z = 2 * exp(1.0) + exp(0.0) + exp(0.5);
    ck_assert_float_eq(weights[0], (float)(exp(1.0) / z) * 2.5f);
}
END_TEST

START_TEST(skew_specs)
{
    float skew[8];
    moe_status st = {0};
    ck_assert_int_eq(moe_skew_parse("hot:0=+2,5=-1.5", 8, skew, &st), 0);
    ck_assert_float_eq(skew[0], 2.0f);
    ck_assert_float_eq(skew[5], -1.5f);
    ck_assert_float_eq(skew[1], 0.0f);
    ck_assert_int_eq(moe_skew_parse("zipf:1", 8, skew, &st), 0);
    ck_assert_float_eq(skew[0], 0.0f);
    ck_assert_float_eq(skew[3], (float)-log(4.0));
    ck_assert_int_eq(moe_skew_parse("hot:8=+1", 8, skew, &st), MOE_EXIT_USAGE);
    ck_assert_ptr_nonnull(strstr(st.message, "expert must be in [0, 7] (--experts 8), got 8"));
    /* "hot:" repeated on each item reads as the one-prefix form */
    float again[8];
    ck_assert_int_eq(moe_skew_parse("hot:0=+2,hot:5=-1.5", 8, again, &st), 0);
    ck_assert_int_eq(moe_skew_parse("hot:0=+2,5=-1.5", 8, skew, &st), 0);
    ck_assert_mem_eq(again, skew, sizeof skew);
    ck_assert_int_eq(moe_skew_parse("hot:x=1", 8, skew, &st), MOE_EXIT_USAGE);
    ck_assert_ptr_nonnull(strstr(st.message, "'x=1' is not EXPERT=B"));
    ck_assert_int_eq(moe_skew_parse("warm:1", 8, skew, &st), MOE_EXIT_USAGE);
    ck_assert_int_eq(moe_skew_parse("zipf:-1", 8, skew, &st), MOE_EXIT_USAGE);
}
END_TEST

/* The skew moves the logits: scores and choices follow it. */
START_TEST(skew_moves_the_choice)
{
    const float logits[3] = {0.0f, 1.0f, 0.5f};
    const float skew[3] = {2.0f, 0.0f, 0.0f};
    const moe_router r = {MOE_ROUTER_SOFTMAX, 3, 1, true, 1, 1, 1.0f, NULL, skew, false};
    float scores[3], weights[1];
    int32_t ids[1];
    moe_router_select(&r, logits, 1, scores, ids, weights);
    ck_assert_int_eq(ids[0], 0);
    ck_assert_float_eq(weights[0], 1.0f);
}
END_TEST

/* The bias update on a hand-made load: mean 10; over it down, under it up,
 * at it unchanged; gamma applied in fp32. */
START_TEST(bias_update_follows_the_sign_of_the_load)
{
    const double load[4] = {4.0, 10.0, 16.0, 10.0};
    float bias[4] = {0.5f, -0.25f, 0.0f, 1.0f};
    moe_router_bias_update(bias, load, 4, 0.001f);
    ck_assert_float_eq(bias[0], 0.5f + 0.001f);
    ck_assert_float_eq(bias[1], -0.25f);
    ck_assert_float_eq(bias[2], 0.0f - 0.001f);
    ck_assert_float_eq(bias[3], 1.0f);
}
END_TEST

/* The balance losses on hand-made routings: even routing gives 1 for the
 * auxiliary and the sequence-wise loss; every token on experts 0 and 1 with
 * their probability mass there gives E/k = 2 for both; z-loss from equal
 * logits is ln(E)^2. */
START_TEST(balance_losses_on_hand_made_routings)
{
    enum { E = 4, k = 2, T = 4 };
    const moe_router r = {.kind = MOE_ROUTER_SOFTMAX, .experts = E, .topk = k};
    float logits[T * E] = {0}, scores[T * E];
    for (int n = 0; n < T * E; n++)
        scores[n] = 0.25f;
    const int32_t even[T * k] = {0, 1, 2, 3, 1, 0, 3, 2};
    double pairs[E] = {0}, prob[E] = {0}, aux, z, seq;
    moe_balance_sums sums = {0};
    moe_router_balance(&r, logits, scores, even, T, pairs, prob, &sums);
    moe_balance_losses(pairs, prob, E, k, &sums, &aux, &z, &seq);
    ck_assert_double_eq_tol(aux, 1.0, 1e-12);
    ck_assert_double_eq_tol(seq, 1.0, 1e-12);
    ck_assert_double_eq_tol(z, log(4.0) * log(4.0), 1e-12);
    /* all on experts 0 and 1, probabilities 0.5, 0.5, 0, 0 */
    for (int t = 0; t < T; t++)
        for (int e = 0; e < E; e++)
            scores[t * E + e] = e < 2 ? 0.5f : 0.0f;
    const int32_t skewed[T * k] = {0, 1, 1, 0, 0, 1, 1, 0};
    double pairs2[E] = {0}, prob2[E] = {0};
    moe_balance_sums sums2 = {0};
    moe_router_balance(&r, logits, scores, skewed, T, pairs2, prob2, &sums2);
    moe_balance_losses(pairs2, prob2, E, k, &sums2, &aux, &z, &seq);
    ck_assert_double_eq_tol(aux, 2.0, 1e-12);
    ck_assert_double_eq_tol(seq, 2.0, 1e-12);
    /* the z-loss is of the logits the router chose from: --skew's included */
    const float skew[E] = {3.0f, 0.0f, 0.0f, 0.0f};
    moe_router r_skew = r;
    r_skew.skew = skew;
    moe_balance_sums sums3 = {0};
    double pairs3[E] = {0}, prob3[E] = {0};
    moe_router_balance(&r_skew, logits, scores, skewed, T, pairs3, prob3, &sums3);
    moe_balance_losses(pairs3, prob3, E, k, &sums3, &aux, &z, &seq);
    const double lse = log(exp(3.0) + 3.0);
    ck_assert_double_eq_tol(z, lse * lse, 1e-12);
}
END_TEST

Suite *make_router_suite(void)
{
    Suite *s = suite_create("router");
    TCase *tc = tcase_create("softmax");
    tcase_add_test(tc, logits_are_exact_dot_products);
    tcase_add_test(tc, logits_are_the_j_ordered_sum_whatever_the_blocking);
    tcase_add_test(tc, topk_is_descending_and_weights_normalised);
    tcase_add_test(tc, route_scale_applies_in_every_router);
    tcase_add_test(tc, bf16_weights_round_last);
    tcase_add_test(tc, ties_go_to_the_lower_expert);
    tcase_add_loop_test(tc, topk_is_the_k_pass_selection_under_ties, 0, 2);
    tcase_add_test(tc, all_equal_logits_pick_the_first_k);
    tcase_add_test(tc, v3_bias_selects_but_does_not_weigh);
    tcase_add_test(tc, v3_masked_groups_lose_even_when_scores_are_negative);
    tcase_add_test(tc, v3_group_score_is_the_top_two_sum);
    tcase_add_test(tc, v2_style_without_bias);
    tcase_add_test(tc, skew_specs);
    tcase_add_test(tc, skew_moves_the_choice);
    tcase_add_test(tc, bias_update_follows_the_sign_of_the_load);
    tcase_add_test(tc, balance_losses_on_hand_made_routings);
    suite_add_tcase(s, tc);
    return s;
}
