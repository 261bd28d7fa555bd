/* check_router.c — gate logits and softmax top-k on hand-made cases. */
#include <math.h>

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

START_TEST(topk_is_descending_and_weights_normalised)
{
    const moe_router r = {MOE_ROUTER_SOFTMAX, 5, 3, true};
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

START_TEST(ties_go_to_the_lower_expert)
{
    const moe_router r = {MOE_ROUTER_SOFTMAX, 6, 3, true};
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
    const moe_router r = {MOE_ROUTER_SOFTMAX, 4, 4, false};
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

Suite *make_router_suite(void)
{
    Suite *s = suite_create("router");
    TCase *tc = tcase_create("softmax");
    tcase_add_test(tc, logits_are_exact_dot_products);
    tcase_add_test(tc, topk_is_descending_and_weights_normalised);
    tcase_add_test(tc, ties_go_to_the_lower_expert);
    tcase_add_test(tc, all_equal_logits_pick_the_first_k);
    suite_add_tcase(s, tc);
    return s;
}
