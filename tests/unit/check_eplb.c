/* SPDX-License-Identifier: MIT */
/* check_eplb.c — redundant experts: the EPLB port against the reference
 * algorithm's own outputs, its invariants, and the replica choice rule. */
#include <check.h>
#include <stdlib.h>

#include "moe/eplb.h"
#include "suites.h"

/* Computed with deepseek-ai/EPLB's eplb.py (commit 5791971, PyTorch 1.13,
 * one layer): rebalance_experts(load, P, groups, nodes, G)'s
 * physical_to_logical_map. Loads are random integers without ties between
 * experts (one hot expert in every third case). */
typedef struct {
    int E, P, groups, nodes, G;
    double load[64];
    int phy2log[80];
} eplb_case;

static const eplb_case cases[] = {
    {8, 12, 4, 2, 4, {17612, 74607, 8272, 33433, 15456, 64938, 99741, 58916}, {6, 3, 2, 6, 7, 7, 1, 5, 0, 1, 5, 4}},
    {16, 24, 4, 2, 8, {7413, 12005, 11125, 47325, 22163, 96466, 87783, 40389, 32976, 79423, 27816, 79535, 4684, 76180, 89293, 20760}, {6, 3, 1, 6, 3, 2, 7, 5, 0, 5, 5, 4, 14, 13, 15, 14, 13, 12, 11, 9, 8, 11, 9, 10}},
    {12, 16, 3, 2, 4, {31191, 77679, 71334, 17095, 48491, 79158, 62136, 1640300, 76134, 8589, 79378, 1726}, {7, 7, 9, 11, 7, 10, 6, 4, 7, 5, 2, 0, 7, 1, 8, 3}},
    {6, 8, 1, 1, 2, {30940, 39754, 13523, 94532, 51913, 62768}, {4, 1, 5, 0, 3, 3, 5, 2}},
    {4, 8, 1, 1, 8, {81645, 33482, 97228, 46994}, {0, 1, 2, 3, 2, 0, 2, 3}},
    {16, 32, 8, 2, 8, {75212, 10561, 63575, 99906, 34292, 4827, 60, 19082, 1737540, 76872, 61638, 99580, 96317, 48911, 41863, 2870}, {8, 8, 8, 6, 8, 8, 9, 15, 8, 8, 14, 5, 8, 8, 4, 7, 13, 3, 2, 10, 12, 3, 11, 10, 12, 3, 11, 1, 0, 0, 11, 2}},
    {10, 15, 1, 1, 5, {42446, 19773, 51751, 85320, 6329, 9495, 70240, 12338, 47932, 76388}, {3, 2, 7, 3, 8, 8, 0, 2, 1, 9, 6, 5, 9, 6, 4}},
    {32, 40, 8, 4, 8, {29715, 48551, 49201, 16559, 25313, 92382, 5739, 11166, 17937, 32433, 66370, 27447, 52522, 84131, 3971, 60180, 63885, 59393, 51181, 64879, 75121, 25197, 52781, 11740, 63583, 30695, 99487, 2621, 91903, 34966, 68181, 53434}, {30, 5, 28, 4, 6, 31, 5, 28, 29, 7, 17, 1, 19, 16, 3, 18, 2, 19, 16, 0, 15, 13, 10, 11, 14, 12, 13, 10, 9, 8, 24, 26, 20, 21, 27, 22, 26, 20, 25, 23}},
    {8, 8, 4, 2, 4, {60688, 80376, 48931, 35014, 18159, 487980, 88690, 844}, {5, 4, 2, 3, 6, 7, 1, 0}},
    {64, 80, 8, 2, 16, {74895, 4271, 56216, 63251, 75772, 1945, 27014, 60632, 64396, 36376, 85652, 21002, 4510, 68246, 64237, 42962, 9974, 32768, 97721, 47338, 5841, 55103, 18179, 79062, 46542, 50018, 55216, 37175, 88469, 34383, 59878, 22895, 89898, 39729, 86750, 47526, 17430, 59891, 31377, 57626, 80390, 49184, 5802, 76407, 532, 30888, 17561, 25553, 39697, 70300, 47992, 31482, 41205, 87385, 71957, 59065, 57152, 61601, 8519, 85588, 76618, 42558, 65788, 20503}, {8, 10, 9, 13, 44, 14, 10, 27, 51, 12, 30, 15, 43, 13, 46, 55, 53, 43, 29, 42, 26, 53, 48, 49, 11, 25, 28, 40, 54, 47, 41, 28, 52, 54, 31, 50, 24, 40, 49, 45, 62, 34, 23, 4, 20, 3, 32, 23, 4, 16, 57, 32, 59, 0, 5, 7, 19, 33, 60, 58, 37, 35, 61, 6, 63, 39, 18, 59, 0, 1, 56, 18, 34, 17, 36, 2, 21, 60, 38, 22}},
    {3, 9, 1, 1, 3, {59295, 73371, 61034}, {1, 2, 0, 1, 2, 0, 1, 2, 0}},
    {16, 20, 4, 4, 4, {62203, 35258, 86177, 69355, 87348, 45848, 18691, 1000460, 1424, 49120, 63248, 35921, 84333, 60322, 90518, 78835}, {3, 0, 2, 2, 1, 7, 7, 4, 5, 6, 9, 11, 10, 10, 8, 12, 15, 13, 14, 14}},
};

START_TEST(matches_the_reference)
{
    const eplb_case *c = &cases[_i];
    moe_replicas r;
    ck_assert_ptr_null(moe_eplb_unplaceable(c->E, c->P, c->G));
    moe_eplb_place(c->load, c->E, c->P, c->groups, c->nodes, c->G, &r);
    for (int p = 0; p < c->P; p++)
        ck_assert_msg(r.phy2log[p] == c->phy2log[p], "case %d: physical %d holds %d, the reference %d",
                      _i, p, r.phy2log[p], c->phy2log[p]);
    ck_assert_int_eq(r.hierarchical, c->groups % c->nodes == 0 && c->nodes > 1);
    /* the index agrees with the map */
    int total = 0;
    for (int e = 0; e < c->E; e++) {
        ck_assert_int_ge(r.copies[e], 1);
        total += r.copies[e];
        for (int k = 0; k < r.max_copies; k++) {
            const int p = r.log2phy[e * r.max_copies + k];
            if (k < r.copies[e]) {
                ck_assert_int_eq(r.phy2log[p], e);
                ck_assert_int_eq(r.replica[p], k);
            } else {
                ck_assert_int_eq(p, -1);
            }
        }
    }
    ck_assert_int_eq(total, c->P);
    moe_replicas_free(&r);
}
END_TEST

/* Every token to one expert: it takes every redundant slot (copies of
 * copies), and its copies spread over the ranks so that no rank holds two
 * while another holds none. */
START_TEST(one_hot_expert_takes_every_copy)
{
    enum { E = 8, G = 4, N = 8, P = E + N };
    double load[E] = {0};
    load[5] = 1000.0;
    moe_replicas r;
    moe_eplb_place(load, E, P, 1, 1, G, &r);
    ck_assert_int_eq(r.copies[5], N + 1);
    int on_rank[G] = {0};
    for (int p = 0; p < P; p++)
        if (r.phy2log[p] == 5)
            on_rank[p / (P / G)]++;
    for (int g = 0; g < G; g++)
        ck_assert_int_ge(on_rank[g], 2); /* 9 copies on 4 ranks: 2 or 3 each */
    moe_replicas_free(&r);
}
END_TEST

/* Equal loads per copy: the copy goes to the lower expert, as upstream's
 * (weight / logcnt).max(dim=-1).indices takes the first maximum. */
START_TEST(equal_loads_copy_the_lower_expert_first)
{
    enum { E = 4, G = 1, P = E + 1 };
    const double load[E] = {4.0, 4.0, 1.0, 1.0};
    moe_replicas r;
    moe_eplb_place(load, E, P, 1, 1, G, &r);
    ck_assert_int_eq(r.copies[0], 2);
    ck_assert_int_eq(r.copies[1], 1);
    moe_replicas_free(&r);
}
END_TEST

START_TEST(unplaceable_sizes_say_why)
{
    ck_assert_ptr_nonnull(moe_eplb_unplaceable(8, 10, 4));
    ck_assert_ptr_nonnull(moe_eplb_unplaceable(8, 7, 7));
    ck_assert_ptr_null(moe_eplb_unplaceable(4, 8, 8)); /* E < G: a copy on every rank */
}
END_TEST

/* The replica of a (token, expert) pair: a copy on the token's node when
 * there is one, spread by token id; else any copy, spread by token id. */
START_TEST(replica_choice_prefers_the_node_then_spreads)
{
    enum { E = 2, G = 4, P = 8, R = 2 };
    moe_replicas r = {.logical = E, .physical = P, .ranks = G, .max_copies = 5};
    /* expert 0: physical 0 (rank 0), 4, 5 (rank 2), 7 (rank 3); expert 1: the rest */
    int phy2log[P] = {0, 1, 1, 1, 0, 0, 1, 0}, replica[P] = {0, 0, 1, 2, 1, 2, 3, 3};
    int copies[E] = {4, 4}, log2phy[E * 5] = {0, 4, 5, 7, -1, 1, 2, 3, 6, -1};
    r.phy2log = phy2log;
    r.replica = replica;
    r.copies = copies;
    r.log2phy = log2phy;
    /* node 0 (ranks 0, 1) holds only physical 0 of expert 0 */
    for (uint64_t t = 0; t < 6; t++)
        ck_assert_int_eq(moe_replica_of(&r, 0, t, 0, R), 0);
    /* node 1 (ranks 2, 3) holds 4, 5, 7: token t takes the (t mod 3)-th */
    const int node1[3] = {4, 5, 7};
    for (uint64_t t = 0; t < 6; t++)
        ck_assert_int_eq(moe_replica_of(&r, 0, t, 1, R), node1[t % 3]);
    /* one node (R = G): all four copies, by token */
    for (uint64_t t = 0; t < 8; t++)
        ck_assert_int_eq(moe_replica_of(&r, 0, t, 0, G), log2phy[t % 4]);
    /* expert 1 on node 0: physical 1, 2, 3 (rank 0 and 1) */
    ck_assert_int_eq(moe_replica_of(&r, 1, 4, 0, R), 2);
}
END_TEST

/* --replica-choice dedup: a pair of the hot expert goes to a copy on the
 * rank its token visits anyway for a single-copy expert when there is one
 * (spread among those by token id), else where moe_replica_of sends it; a
 * dropped pair stays dropped; ids may be placed. */
START_TEST(dedup_choice_shares_the_row)
{
    enum { E = 4, G = 4, P = 8 };
    const double load[E] = {100.0, 3.0, 2.0, 1.0};
    moe_replicas r;
    moe_eplb_place(load, E, P, 1, 1, G, &r);
    ck_assert_int_eq(r.copies[0], 5);
    int shared = 0;
    for (int x = 1; x < E; x++)
        for (uint64_t token = 0; token < 6; token++) {
            int32_t pair[3] = {x, 0, -1};
            moe_replicas_of_token(&r, pair, 3, token, 0, G, pair);
            const int rank = r.log2phy[x * r.max_copies] / (P / G);
            ck_assert_int_eq(pair[0], r.log2phy[x * r.max_copies]);
            ck_assert_int_eq(pair[2], -1);
            ck_assert_int_eq(r.phy2log[pair[1]], 0);
            bool copy_there = false;
            for (int c = 0; c < r.copies[0]; c++)
                copy_there = copy_there || r.log2phy[c] / (P / G) == rank;
            if (copy_there) {
                ck_assert_int_eq(pair[1] / (P / G), rank);
                shared++;
            } else {
                ck_assert_int_eq(pair[1], moe_replica_of(&r, 0, token, 0, G));
            }
        }
    ck_assert_int_gt(shared, 0); /* the case tests the preference */
    moe_replicas_free(&r);
}
END_TEST

Suite *make_eplb_suite(void)
{
    Suite *s = suite_create("eplb");
    TCase *tc = tcase_create("placement");
    tcase_add_loop_test(tc, matches_the_reference, 0, sizeof cases / sizeof cases[0]);
    tcase_add_test(tc, one_hot_expert_takes_every_copy);
    tcase_add_test(tc, equal_loads_copy_the_lower_expert_first);
    tcase_add_test(tc, unplaceable_sizes_say_why);
    tcase_add_test(tc, replica_choice_prefers_the_node_then_spreads);
    tcase_add_test(tc, dedup_choice_shares_the_row);
    suite_add_tcase(s, tc);
    return s;
}
