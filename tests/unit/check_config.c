/* SPDX-License-Identifier: MIT */
/* check_config.c — flag parsing, presets, validation. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "moe/common.h"
#include "moe/config.h"
#include "suites.h"

static int parse(moe_config *cfg, moe_status *st, const char *line)
{
    char buf[512], *argv[32];
    int argc = 0;
    snprintf(buf, sizeof buf, "%s", line);
    for (char *tok = strtok(buf, " "); tok && argc < 32; tok = strtok(NULL, " "))
        argv[argc++] = tok;
    moe_config_defaults(cfg);
    memset(st, 0, sizeof *st);
    return moe_config_parse(cfg, MOE_CMD_RUN, argc, argv, st);
}

/* The median the bench and the report quote: the middle value, or the mean
 * of the two middle ones for an even count (v is sorted in place). */
START_TEST(median_of_odd_and_even_counts)
{
    double odd[3] = {5.0, 1.0, 3.0}, even[4] = {4.0, 1.0, 3.0, 2.0};
    ck_assert_double_eq(moe_median(odd, 3), 3.0);
    ck_assert_double_eq(moe_median(even, 4), 2.5);
}
END_TEST

/* The pool a context keeps its step's large buffers in: a loop of calls
 * taking the same sizes gets the same blocks back, a busy block is never
 * handed out twice, a block more than a third larger than a need does not
 * serve it, idle blocks too small for a need are freed before its new
 * block, and a pointer the pool did not hand out is freed (the leak
 * checkers would name it otherwise). */
static int held(const moe_pool *pool)
{
    int n = 0;
    for (int b = 0; b < pool->n; b++)
        n += pool->block[b].buffer.data != NULL;
    return n;
}

START_TEST(a_pool_hands_its_blocks_out_again)
{
    moe_pool pool = {0};
    moe_status st = {0};
    void *a = moe_pool_take(&pool, 1000, "a", 0, &st), *b = moe_pool_take(&pool, 4000, "b", 0, &st);
    ck_assert_ptr_nonnull(a);
    ck_assert_ptr_ne(a, b);
    moe_pool_give(&pool, a);
    moe_pool_give(&pool, b);
    ck_assert_ptr_eq(moe_pool_take(&pool, 4000, "b", 0, &st), b);
    ck_assert_ptr_eq(moe_pool_take(&pool, 900, "a", 0, &st), a);
    void *c = moe_pool_take(&pool, 900, "c", 0, &st);
    ck_assert(c != a && c != b);
    ck_assert_int_eq(pool.n, 3);
    moe_pool_give(&pool, a);
    moe_pool_give(&pool, b);
    moe_pool_give(&pool, c);
    void *small = moe_pool_take(&pool, 100, "small", 0, &st);
    ck_assert(small != a && small != b && small != c);
    ck_assert_int_eq(held(&pool), 4);
    moe_pool_give(&pool, small);
    void *big = moe_pool_take(&pool, 100000, "big", 0, &st);
    ck_assert_ptr_nonnull(big);
    ck_assert_int_eq(held(&pool), 1);
    ck_assert_int_eq(pool.n, 4);
    moe_pool_give(&pool, big);
    ck_assert_ptr_eq(moe_pool_take(&pool, 90000, "big", 0, &st), big);
    moe_pool_give(&pool, malloc(16));
    moe_pool_give(&pool, NULL);
    ck_assert_int_eq(st.code, MOE_EXIT_OK);
    moe_pool_free(&pool);
    ck_assert_int_eq(pool.n, 0);
    void *alone = moe_pool_take(NULL, 64, "alone", 0, &st); /* no pool: malloc and free */
    ck_assert_ptr_nonnull(alone);
    moe_pool_give(NULL, alone);
}
END_TEST

/* A block given back twice is a double free under another name: the
 * second give stops the program rather than let two callers hold it. */
START_TEST(a_pool_block_given_twice_is_an_internal_error)
{
    moe_pool pool = {0};
    moe_status st = {0};
    void *a = moe_pool_take(&pool, 1000, "a", 0, &st);
    moe_pool_give(&pool, a);
    moe_pool_give(&pool, a);
}
END_TEST

START_TEST(flags_set_fields)
{
    moe_config cfg;
    moe_status st;
    ck_assert_int_eq(parse(&cfg, &st, "--tokens 100 --hidden=64 --experts 9 --topk 3 --check --seed 0x10"), 0);
    ck_assert_int_eq(cfg.tokens, 100);
    ck_assert_int_eq(cfg.hidden, 64);
    ck_assert_int_eq(cfg.experts, 9);
    ck_assert_int_eq(cfg.topk, 3);
    ck_assert(cfg.check);
    ck_assert_uint_eq(cfg.seed, 16);
}
END_TEST

static const char *preset_file(void)
{
    static char path[] = "/tmp/moe-ep-check-XXXXXX.conf";
    int fd = mkstemps(path, 5);
    ck_assert_int_ge(fd, 0);
    const char text[] = "# a preset\ntokens = 32\nhidden = 16  # trailing comment\ncheck = yes\n";
    ck_assert_int_eq(write(fd, text, sizeof text - 1), (ssize_t)(sizeof text - 1));
    close(fd);
    return path;
}

START_TEST(flags_override_preset_in_any_order)
{
    const char *path = preset_file();
    char line[256];
    snprintf(line, sizeof line, "--tokens 7 --preset %s", path);
    moe_config cfg;
    moe_status st;
    ck_assert_int_eq(parse(&cfg, &st, line), 0);
    ck_assert_int_eq(cfg.tokens, 7);  /* the flag wins although it comes first */
    ck_assert_int_eq(cfg.hidden, 16); /* from the preset */
    ck_assert(cfg.check);
    unlink(path);
}
END_TEST

START_TEST(preset_syntax_error_names_file_and_line)
{
    char path[] = "/tmp/moe-ep-bad-XXXXXX.conf";
    int fd = mkstemps(path, 5);
    const char text[] = "tokens = 4\n\nhidden 16\n";
    ck_assert_int_eq(write(fd, text, sizeof text - 1), (ssize_t)(sizeof text - 1));
    close(fd);
    moe_config cfg;
    moe_status st;
    char line[256];
    snprintf(line, sizeof line, "--preset %s", path);
    ck_assert_int_eq(parse(&cfg, &st, line), MOE_EXIT_USAGE);
    char want[128];
    snprintf(want, sizeof want, "%s:3:", path);
    ck_assert_msg(strstr(st.message, want), "message: %s", st.message);
    unlink(path);
}
END_TEST

static const struct {
    const char *args, *fragment;
} bad[] = {
    {"--tokens 0", "--tokens must be an integer in [1, 16777216], got '0'"},
    {"--tokens 99999999999", "got '99999999999'"},
    {"--tokens 12x", "got '12x'"},
    {"--hidden", "--hidden needs a value"},
    {"--nope 1", "unknown flag '--nope'"},
    {"stray", "unexpected argument 'stray'"},
    {"--seed -3", "--seed must be an integer"},
    {"--preset ../nonexistent-preset", "cannot read"},
    {"--preset /", "cannot read '/'"},
    {"--preset bad!name", "--preset must be a name"},
};

START_TEST(bad_flags_are_usage_errors)
{
    moe_config cfg;
    moe_status st;
    ck_assert_int_eq(parse(&cfg, &st, bad[_i].args), MOE_EXIT_USAGE);
    ck_assert_msg(strstr(st.message, bad[_i].fragment), "'%s' gave: %s", bad[_i].args, st.message);
}
END_TEST

/* --norm-topk auto follows each gate's reference code; true and false win. */
/* Numbers are read strictly and alike everywhere; switches take a value
 * either way; presets skip a byte-order mark and read long comments. */
START_TEST(values_are_parsed_strictly)
{
    moe_config cfg;
    moe_status st;
    static const char *const refused[][2] = {
        {"--seed", " -1"}, {"--seed", "+1"}, {"--seed", "-1"}, {"--tokens", "+-3"},
        {"--tokens", " 7"}, {"--route-scale", "inf"}, {"--route-scale", "nan"},
        {"--init-scale", "0x1p3"}, {"--waves", "1,,2"}, {"--waves", "2,"}, {"--waves", ",2"},
        {"--waves", "1, 2"}, {"--seed", "18446744073709551616"}, {"--skew", "hot:0=+1\xff"}};
    for (size_t n = 0; n < sizeof refused / sizeof refused[0]; n++) {
        char *argv[2] = {(char *)refused[n][0], (char *)refused[n][1]};
        moe_config_defaults(&cfg);
        memset(&st, 0, sizeof st);
        ck_assert_msg(moe_config_parse(&cfg, MOE_CMD_RUN, 2, argv, &st) == MOE_EXIT_USAGE,
                      "accepted: %s '%s'", refused[n][0], refused[n][1]);
    }
    char zeros[320] = "--waves="; /* no length cap: 300 leading zeros, then 2 */
    memset(zeros + 8, '0', 300);
    strcpy(zeros + 308, "2");
    char *long_waves[1] = {zeros};
    moe_config_defaults(&cfg);
    ck_assert_int_eq(moe_config_parse(&cfg, MOE_CMD_RUN, 1, long_waves, &st), 0);
    ck_assert(cfg.waves_count == 1 && cfg.waves_list[0] == 2);
    ck_assert_int_eq(parse(&cfg, &st, "--seed 010 --route-scale .5 --waves 1,2,8"), 0);
    ck_assert_uint_eq(cfg.seed, 10);
    ck_assert(cfg.route_scale == 0.5);
    ck_assert_int_eq(cfg.waves_count, 3);
    ck_assert_int_eq(parse(&cfg, &st, "--check false --blocking true --norm-topk false --tokens 9"), 0);
    ck_assert(!cfg.check && cfg.blocking && cfg.norm_topk == MOE_NORM_TOPK_OFF && cfg.tokens == 9);
    ck_assert_int_eq(parse(&cfg, &st, "--check --tokens 9"), 0);
    ck_assert(cfg.check);

    char path[] = "/tmp/moe-ep-check-XXXXXX.conf";
    FILE *fp = fdopen(mkstemps(path, 5), "w");
    fprintf(fp, "\xef\xbb\xbftokens = 12\n# %02000d\nhidden = 24\n", 0);
    fclose(fp);
    char line[600];
    snprintf(line, sizeof line, "--preset %s", path);
    ck_assert_int_eq(parse(&cfg, &st, line), 0);
    ck_assert(cfg.tokens == 12 && cfg.hidden == 24);
    fp = fopen(path, "w");
    fprintf(fp, "# %03000d\n\ntokens = x\n", 0);
    fclose(fp);
    ck_assert_int_eq(parse(&cfg, &st, line), MOE_EXIT_USAGE);
    ck_assert_msg(strstr(st.message, ":3: tokens") != NULL, "%s", st.message);
    unlink(path);
}
END_TEST

/* A message is one line whatever the values echoed in it hold. */
START_TEST(messages_are_one_line)
{
    moe_status st = {0};
    moe_fail(&st, MOE_EXIT_USAGE, "unknown preset '%s'", "a\nmoe-ep: error: b\tc\x7f");
    ck_assert_str_eq(st.message, "unknown preset 'a\\nmoe-ep: error: b\\x09c\\x7f'");
    moe_config cfg;
    char *argv[2] = {"--preset", "two\nlines"};
    moe_config_defaults(&cfg);
    ck_assert_int_eq(moe_config_parse(&cfg, MOE_CMD_RUN, 2, argv, &st), MOE_EXIT_USAGE);
    ck_assert_ptr_null(strchr(st.message, '\n'));
}
END_TEST

START_TEST(norm_topk_auto_follows_the_gate)
{
    moe_config cfg;
    moe_status st;
    ck_assert_int_eq(parse(&cfg, &st, "--router softmax"), MOE_EXIT_OK);
    ck_assert(moe_config_norm_topk(&cfg)); /* Mixtral, GShard */
    ck_assert_int_eq(parse(&cfg, &st, "--router deepseek-v3 --bias-scale 0"), MOE_EXIT_OK);
    ck_assert(!moe_config_norm_topk(&cfg)); /* V2: norm_topk_prob = False */
    ck_assert_int_eq(parse(&cfg, &st, "--router deepseek-v3"), MOE_EXIT_OK);
    ck_assert(moe_config_norm_topk(&cfg)); /* V3 */
    ck_assert_int_eq(parse(&cfg, &st, "--router deepseek-v3 --bias-scale 0 --norm-topk"), MOE_EXIT_OK);
    ck_assert(moe_config_norm_topk(&cfg)); /* alone: true */
    ck_assert_int_eq(parse(&cfg, &st, "--norm-topk=false"), MOE_EXIT_OK);
    ck_assert(!moe_config_norm_topk(&cfg));
}
END_TEST

START_TEST(validation_checks_combinations)
{
    moe_config cfg;
    moe_status st = {0};
    moe_config_defaults(&cfg);
    cfg.experts = 4;
    cfg.topk = 5;
    ck_assert_int_eq(moe_config_validate(&cfg, 2, &st), MOE_EXIT_USAGE);
    ck_assert_ptr_nonnull(strstr(st.message, "--topk must be in [1, 4]"));
    cfg.topk = 4;
    ck_assert_int_eq(moe_config_validate(&cfg, 2, &st), MOE_EXIT_OK);
    ck_assert_int_eq(moe_config_validate(&cfg, 16, &st), MOE_EXIT_OK); /* E < G is allowed */
    cfg.tokens = 1 << 24;
    cfg.topk = 4;
    ck_assert_int_eq(moe_config_validate(&cfg, 64, &st), MOE_EXIT_USAGE);
    ck_assert_ptr_nonnull(strstr(st.message, "32-bit MPI count"));
}
END_TEST

/* The integer lists of --waves and --token: strict, bounded, counted. */
START_TEST(int_lists_are_strict)
{
    int64_t out[3];
    ck_assert_int_eq(moe_parse_int_list("7", 0, 9, out, 3), 1);
    ck_assert_int_eq(out[0], 7);
    ck_assert_int_eq(moe_parse_int_list("0,9,4", 0, 9, out, 3), 3);
    ck_assert(out[0] == 0 && out[1] == 9 && out[2] == 4);
    ck_assert_int_eq(moe_parse_int_list("1,2,3,4", 0, 9, out, 3), -2);
    const char *refused[] = {"", ",", "1,", ",1", "1,,2", " 1", "1 ", "+1", "-1", "10", "1.5",
                         "0x1", "a", "99999999999999999999"};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++)
        ck_assert_msg(moe_parse_int_list(refused[i], 0, 9, out, 3) == -1, "'%s' was taken", refused[i]);
}
END_TEST

Suite *make_config_suite(void)
{
    Suite *s = suite_create("config");
    TCase *tc = tcase_create("parse");
    tcase_add_test(tc, median_of_odd_and_even_counts);
    tcase_add_test(tc, a_pool_hands_its_blocks_out_again);
    tcase_add_test_raise_signal(tc, a_pool_block_given_twice_is_an_internal_error, SIGABRT);
    tcase_add_test(tc, flags_set_fields);
    tcase_add_test(tc, flags_override_preset_in_any_order);
    tcase_add_test(tc, preset_syntax_error_names_file_and_line);
    tcase_add_loop_test(tc, bad_flags_are_usage_errors, 0, sizeof bad / sizeof bad[0]);
    tcase_add_test(tc, values_are_parsed_strictly);
    tcase_add_test(tc, int_lists_are_strict);
    tcase_add_test(tc, messages_are_one_line);
    tcase_add_test(tc, norm_topk_auto_follows_the_gate);
    tcase_add_test(tc, validation_checks_combinations);
    suite_add_tcase(s, tc);
    return s;
}
