/* SPDX-License-Identifier: MIT */
/* check_link.c — the --link spec and the FIFO link model. */
#include <math.h>
#include <string.h>

#include "moe/link.h"
#include "suites.h"

START_TEST(specs_parse)
{
    moe_link link = {.ranks_per_node = 4};
    moe_status st = {0};
    ck_assert_int_eq(moe_link_parse(&link, "intra=900GB/s:2us,inter=50GB/s:5us", &st), 0);
    ck_assert(link.enabled);
    ck_assert_double_eq(link.bandwidth[MOE_TIER_INTRA], 900e9);
    ck_assert_double_eq(link.bandwidth[MOE_TIER_INTER], 50e9);
    ck_assert_double_eq_tol(link.latency[MOE_TIER_INTER], 5e-6, 1e-18);
    ck_assert_int_eq(link.ranks_per_node, 4);
    ck_assert_int_eq(moe_link_parse(&link, "cb=19780,lat=3us", &st), 0);
    ck_assert_double_eq(link.cb_ratio, 19780);
    ck_assert_double_eq_tol(link.latency[MOE_TIER_INTRA], 3e-6, 1e-18);
    ck_assert_double_eq(link.cb_ratio_inter, 0); /* the inter-node tier as the other */
    ck_assert_int_eq(moe_link_parse(&link, "cb=1000,inter-cb=18000", &st), 0);
    ck_assert_double_eq(link.cb_ratio, 1000);
    ck_assert_double_eq(link.cb_ratio_inter, 18000);
    ck_assert_int_eq(moe_link_parse(&link, "bw=2MB/s", &st), 0);
    ck_assert_double_eq(link.bandwidth[MOE_TIER_INTER], 2e6);
    ck_assert_int_eq(moe_link_parse(&link, "intra=8Gb/s,inter=400Gb/s", &st), 0); /* bits */
    ck_assert_double_eq(link.bandwidth[MOE_TIER_INTRA], 1e9);
    ck_assert_double_eq(link.bandwidth[MOE_TIER_INTER], 50e9);
    ck_assert_int_eq(moe_link_parse(&link, "off", &st), 0);
    ck_assert(!link.enabled);
}
END_TEST

static const char *const bad_specs[] = {
    "fast", "bw=12", "bw=-1GB/s", "intra=1GB/s:3weeks", "cb=0", "cb=abc", "cb=10,bw=1GB/s", "lat=1us",
    /* past the ranges that bound a forward's wait; loose spellings */
    "bw=1B/s", "bw=999KB/s", "bw=2000TB/s", "bw=1GB/s:100000s", "bw=1GB/s:2s", "cb=1e300", "cb=2e5",
    "bw=8GB/S", "bw=8gb/s", "bw= 1GB/s", "bw=+1GB/s", "cb=nan", "cb=inf", "bw=infGB/s", "bw=0x10GB/s",
    "inter-cb=18", "cb=10,inter-cb=0", "cb=10,inter-cb=2e5", "cb=10,inter-cb=", "intra=1GB/s,inter-cb=10",
};

START_TEST(bad_specs_name_the_flag)
{
    moe_link link = {.ranks_per_node = 1};
    moe_status st = {0};
    ck_assert_int_eq(moe_link_parse(&link, bad_specs[_i], &st), MOE_EXIT_USAGE);
    ck_assert_msg(strstr(st.message, "--link"), "%s: %s", bad_specs[_i], st.message);
}
END_TEST

START_TEST(tiers_follow_virtual_nodes)
{
    moe_link link = {.ranks_per_node = 3};
    ck_assert_int_eq(moe_link_tier(&link, 0, 2), MOE_TIER_INTRA);
    ck_assert_int_eq(moe_link_tier(&link, 2, 3), MOE_TIER_INTER);
    ck_assert_int_eq(moe_link_tier(&link, 6, 7), MOE_TIER_INTRA); /* a last, smaller node */
}
END_TEST

/* Two operations posted together share each link first come, first served;
 * ingress and egress, and the two tiers, are separate links. */
START_TEST(links_are_fifo_servers)
{
    moe_link link = {.ranks_per_node = 2};
    moe_status st = {0};
    ck_assert_int_eq(moe_link_parse(&link, "intra=1GB/s:1ms,inter=100MB/s:10ms", &st), 0);
    moe_link_state state = {{{0}}};
    const double in1[MOE_TIERS] = {500e6, 0}, out1[MOE_TIERS] = {0, 0};
    ck_assert_double_eq_tol(moe_link_schedule(&link, &state, 0.0, in1, out1), 0.501, 1e-12);
    /* same ingress link, posted at 0.1: waits until 0.5, then 0.5 s more */
    ck_assert_double_eq_tol(moe_link_schedule(&link, &state, 0.1, in1, out1), 1.001, 1e-12);
    /* egress and the other tier are free */
    const double in2[MOE_TIERS] = {0, 0}, out2[MOE_TIERS] = {200e6, 50e6};
    ck_assert_double_eq_tol(moe_link_schedule(&link, &state, 0.1, in2, out2), 0.61, 1e-12);
    /* nothing over a link: done at post; model off: done at post */
    const double none[MOE_TIERS] = {0, 0};
    ck_assert_double_eq(moe_link_schedule(&link, &state, 2.0, none, none), 2.0);
    link.enabled = false;
    ck_assert_double_eq(moe_link_schedule(&link, &state, 3.0, in1, out2), 3.0);
}
END_TEST

Suite *make_link_suite(void)
{
    Suite *s = suite_create("link");
    TCase *tc = tcase_create("model");
    tcase_add_test(tc, specs_parse);
    tcase_add_loop_test(tc, bad_specs_name_the_flag, 0, sizeof bad_specs / sizeof bad_specs[0]);
    tcase_add_test(tc, tiers_follow_virtual_nodes);
    tcase_add_test(tc, links_are_fifo_servers);
    suite_add_tcase(s, tc);
    return s;
}
