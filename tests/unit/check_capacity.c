/* SPDX-License-Identifier: MIT */
/* check_capacity.c — expert capacity and the drop decisions on hand-made routings. */
#include <math.h>

#include "moe/capacity.h"
#include "suites.h"

START_TEST(capacity_is_megatrons)
{
    ck_assert_int_eq(moe_expert_capacity(1.0, 10, 2, 4), 5);
    ck_assert_int_eq(moe_expert_capacity(1.25, 10, 2, 4), 7);  /* ceil(6.25) */
    ck_assert_int_eq(moe_expert_capacity(1.1, 3, 1, 3), 2);    /* ceil(1.1) */
    ck_assert_int_eq(moe_expert_capacity(0.01, 10, 2, 4), 1);  /* below one token: one */
    ck_assert_int_eq(moe_expert_capacity(2.0, 10, 2, 4), 10);  /* C = E/k: every pair */
    ck_assert_int_eq(moe_expert_capacity(1.0, 0, 2, 4), 0);
    /* T k not a multiple of E: the share is real, not an integer quotient */
    ck_assert_int_eq(moe_expert_capacity(1.0, 10, 3, 8), 4);   /* ceil(3.75), not 3 */
    ck_assert_int_eq(moe_expert_capacity(0.75, 37, 2, 6), 10); /* ceil(9.25), not 9 */
    ck_assert_int_eq(moe_expert_capacity(2.0, 7, 1, 4), 4);    /* ceil(3.5), not 2 */
}
END_TEST

/* Six tokens, k = 2, three experts: expert 0 has six pairs, its weights
 * .6 .5 .7 .2 .5 .9 for tokens 0..5 (tokens 1 and 4 tie at .5); experts 1
 * and 2 have three each. */
enum { T = 6, K = 2, E = 3 };
static const int32_t ids[T * K] = {0, 1, 0, 2, 0, 1, 1, 0, 2, 0, 0, 2};
static const float weights[T * K] = {.6f, .4f, .5f, .5f, .7f, .3f, .8f, .2f, .5f, .5f, .9f, .1f};

static void expect(const int32_t *kept, const int32_t *want)
{
    for (int n = 0; n < T * K; n++)
        ck_assert_msg(kept[n] == want[n], "token %d slot %d: %d, expected %d", n / K, n % K,
                      kept[n], want[n]);
}

START_TEST(probs_keeps_the_largest_weights)
{
    int32_t kept[T * K];
    ck_assert_int_eq(moe_expert_capacity(0.75, T, K, E), 3);
    ck_assert_int_eq(moe_capacity_drop(ids, weights, T, K, E, 3, MOE_DROP_PROBS, kept), 3);
    const int32_t want[T * K] = {0, 1, -1, 2, 0, 1, 1, -1, 2, -1, 0, 2}; /* .9 .7 .6 stay */
    expect(kept, want);
}
END_TEST

/* At capacity 4 the fourth place is a tie at .5 between tokens 1 and 4:
 * the lower token stays. */
START_TEST(probs_ties_go_to_the_lower_token)
{
    int32_t kept[T * K];
    ck_assert_int_eq(moe_capacity_drop(ids, weights, T, K, E, 4, MOE_DROP_PROBS, kept), 2);
    const int32_t want[T * K] = {0, 1, 0, 2, 0, 1, 1, -1, 2, -1, 0, 2};
    expect(kept, want);
}
END_TEST

START_TEST(position_keeps_the_first_tokens)
{
    int32_t kept[T * K];
    ck_assert_int_eq(moe_capacity_drop(ids, weights, T, K, E, 4, MOE_DROP_POSITION, kept), 2);
    const int32_t want[T * K] = {0, 1, 0, 2, 0, 1, 1, 0, 2, -1, -1, 2}; /* .9 of token 5 drops */
    expect(kept, want);
}
END_TEST

START_TEST(room_for_all_drops_nothing)
{
    int32_t kept[T * K];
    ck_assert_int_eq(moe_capacity_drop(ids, weights, T, K, E, 6, MOE_DROP_PROBS, kept), 0);
    expect(kept, ids);
}
END_TEST

/* Every token to expert 2 (k = 1): the capacity of a hot expert is what
 * is left of it, in place (kept = ids). A NaN weight ranks last. */
START_TEST(one_hot_expert_in_place)
{
    int32_t hot[8] = {2, 2, 2, 2, 2, 2, 2, 2};
    const float w[8] = {.1f, NAN, .3f, .2f, .9f, .1f, .8f, .4f};
    const moe_index cap = moe_expert_capacity(1.0, 8, 1, 4);
    ck_assert_int_eq(cap, 2);
    ck_assert_int_eq(moe_capacity_drop(hot, w, 8, 1, 4, cap, MOE_DROP_PROBS, hot), 6);
    const int32_t want[8] = {-1, -1, -1, -1, 2, -1, 2, -1};
    for (int n = 0; n < 8; n++)
        ck_assert_int_eq(hot[n], want[n]);
    int32_t nan_first[2] = {0, 0};
    const float w2[2] = {NAN, -1.0f};
    moe_capacity_drop(nan_first, w2, 2, 1, 1, 1, MOE_DROP_PROBS, nan_first);
    ck_assert_int_eq(nan_first[0], MOE_DROPPED);
    ck_assert_int_eq(nan_first[1], 0);
}
END_TEST

/* A masked pair (-1, from a replayed routing) stays masked, is no expert's
 * and takes no place: expert 1's two real pairs fit a capacity of 2. */
START_TEST(masked_pairs_take_no_place)
{
    int32_t ids_masked[8] = {-1, 1, 1, -1, -1, -1, 0, -1};
    const float w[8] = {.9f, .1f, .2f, .8f, .7f, .6f, .5f, .4f};
    ck_assert_int_eq(moe_capacity_drop(ids_masked, w, 4, 2, 2, 2, MOE_DROP_PROBS, ids_masked), 0);
    const int32_t want[8] = {-1, 1, 1, -1, -1, -1, 0, -1};
    for (int n = 0; n < 8; n++)
        ck_assert_int_eq(ids_masked[n], want[n]);
}
END_TEST

Suite *make_capacity_suite(void)
{
    Suite *s = suite_create("capacity");
    TCase *tc = tcase_create("drops");
    tcase_add_test(tc, capacity_is_megatrons);
    tcase_add_test(tc, probs_keeps_the_largest_weights);
    tcase_add_test(tc, probs_ties_go_to_the_lower_token);
    tcase_add_test(tc, position_keeps_the_first_tokens);
    tcase_add_test(tc, room_for_all_drops_nothing);
    tcase_add_test(tc, one_hot_expert_in_place);
    tcase_add_test(tc, masked_pairs_take_no_place);
    suite_add_tcase(s, tc);
    return s;
}
