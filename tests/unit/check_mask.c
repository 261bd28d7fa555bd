/* SPDX-License-Identifier: MIT */
/* check_mask.c — --mask-ranks (mask.h): the list, and the rule that drops a
 * lost rank's pairs and rescales the kept weights to the token's sum. */
#include <string.h>

#include "moe/mask.h"
#include "suites.h"

START_TEST(mask_lists_parse_and_bad_ones_are_refused)
{
    bool lost[6];
    moe_status st = {0};
    ck_assert_int_eq(moe_mask_parse("1,3-4", 6, lost, &st), MOE_EXIT_OK);
    const bool want[6] = {false, true, false, true, true, false};
    ck_assert_mem_eq(lost, want, sizeof want);
    ck_assert_int_eq(moe_mask_parse("", 6, lost, &st), MOE_EXIT_OK);
    for (int r = 0; r < 6; r++)
        ck_assert(!lost[r]);
    const char *bad[][2] = {{"6", "rank 6 is not in [0, 5]"}, {"2,2", "rank 2 is given twice"},
                            {"0-5", "loses every one of the 6 ranks"}, {"3-1", "needs A <= B"},
                            {"1,", "R[,R...]"}, {"-1", "R[,R...]"}, {"1 2", "R[,R...]"}};
    for (size_t n = 0; n < sizeof bad / sizeof bad[0]; n++) {
        ck_assert_int_eq(moe_mask_parse(bad[n][0], 6, lost, &st), MOE_EXIT_USAGE);
        ck_assert_msg(strstr(st.message, bad[n][1]), "'%s': %s", bad[n][0], st.message);
    }
}
END_TEST

/* E = 8 on 4 ranks (two each), rank 1 lost: a live token loses its pair on
 * expert 2 and its kept weights grow by 1 / 0.7; one with every expert on
 * rank 1 keeps none; rank 1's own tokens go nowhere. */
START_TEST(mask_drops_lost_pairs_and_rescales_the_rest)
{
    moe_placement p;
    moe_placement_init(&p, 8, 4);
    const bool lost[4] = {false, true, false, false};
    int32_t ids[3 * 3] = {0, 2, 5, 2, 3, -1, 7, 6, 1};
    float w[3 * 3] = {0.5f, 0.3f, 0.2f, 0.6f, 0.4f, 0.0f, 0.25f, 0.25f, 0.5f};
    ck_assert_int_eq(moe_mask_apply(lost, &p, 0, 3, 3, ids, w), 3);
    const int32_t want_ids[9] = {0, -1, 5, -1, -1, -1, 7, 6, 1};
    ck_assert_mem_eq(ids, want_ids, sizeof want_ids);
    const double all = (double)0.5f + (double)0.3f + (double)0.2f, kept = (double)0.5f + (double)0.2f;
    ck_assert_float_eq(w[0], (float)((double)0.5f * all / kept));
    ck_assert_float_eq(w[1], 0.0f);
    ck_assert_float_eq(w[2], (float)((double)0.2f * all / kept));
    ck_assert_float_eq(w[3], 0.0f);
    ck_assert_float_eq(w[4], 0.0f);
    ck_assert_float_eq(w[6], 0.25f); /* nothing lost: untouched */
    int32_t own[2] = {0, 4};
    float ow[2] = {0.5f, 0.5f};
    ck_assert_int_eq(moe_mask_apply(lost, &p, 1, 1, 2, own, ow), 2);
    ck_assert_int_eq(own[0], -1);
    ck_assert_int_eq(own[1], -1);
    ck_assert_float_eq(ow[0] + ow[1], 0.0f);
    moe_placement_free(&p);
}
END_TEST

/* What the mask cannot serve is refused, and a mask that leaves no expert
 * reachable (E < G: the live ranks hold none). */
START_TEST(mask_refuses_what_it_cannot_serve)
{
    moe_config cfg;
    moe_config_defaults(&cfg);
    moe_status st = {0};
    strcpy(cfg.mask_ranks, "1");
    ck_assert_int_eq(moe_mask_validate(&cfg, 4, &st), MOE_EXIT_OK);
    cfg.backward = true;
    ck_assert_int_eq(moe_mask_validate(&cfg, 4, &st), MOE_EXIT_USAGE);
    ck_assert_ptr_nonnull(strstr(st.message, "--backward"));
    cfg.backward = false;
    cfg.experts = 2;
    cfg.topk = 1;
    strcpy(cfg.mask_ranks, "0,1");
    ck_assert_int_eq(moe_mask_validate(&cfg, 4, &st), MOE_EXIT_USAGE);
    ck_assert_ptr_nonnull(strstr(st.message, "leaves no expert reachable"));
}
END_TEST

Suite *make_mask_suite(void)
{
    Suite *s = suite_create("mask");
    TCase *tc = tcase_create("mask");
    tcase_add_test(tc, mask_lists_parse_and_bad_ones_are_refused);
    tcase_add_test(tc, mask_drops_lost_pairs_and_rescales_the_rest);
    tcase_add_test(tc, mask_refuses_what_it_cannot_serve);
    suite_add_tcase(s, tc);
    return s;
}
