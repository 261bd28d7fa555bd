/* SPDX-License-Identifier: MIT */
/* check_rng.c — Philox4x32-10 against Random123's known answers, and the
 * synthetic-data mapping of docs/data.md. */
#include <math.h>
#include <stdlib.h>

#include "moe/config.h"
#include "moe/rng.h"
#include "suites.h"

/* Random123 kat_vectors, the three "philox4x32 10" lines: counter, key, result. */
static const uint32_t kat[3][10] = {
    {0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000,
     0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
    {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff,
     0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
    {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0,
     0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1},
};

START_TEST(philox_known_answers)
{
    uint32_t out[4];
    moe_philox4x32_10(kat[_i], kat[_i] + 4, out);
    for (int n = 0; n < 4; n++)
        ck_assert_msg(out[n] == kat[_i][6 + n], "vector %d word %d: got %08x, want %08x", _i, n,
                      out[n], kat[_i][6 + n]);
}
END_TEST

/* The documented mapping, spelled out once more by hand for one element. */
START_TEST(synth_value_follows_the_documented_mapping)
{
    const uint64_t seed = 0x0123456789abcdefULL, index = 4 * 1000003ULL + 2;
    const uint32_t key[2] = {0x89abcdefu, 0x01234567u};
    const uint32_t counter[4] = {1000003u, 0u, MOE_TENSOR_W1, 7u};
    uint32_t words[4];
    moe_philox4x32_10(counter, key, words);
    const float want = ((float)(int32_t)(words[2] >> 8) - 8388608.0f) / 8388608.0f * 0.5f;
    ck_assert_float_eq(moe_synth_value(seed, MOE_TENSOR_W1, 7, index, 0.5f), want);
}
END_TEST

/* A slice generated alone equals the same elements of a larger fill: a rank
 * may generate exactly its share, at any offset. */
START_TEST(synth_fill_is_independent_of_the_slice)
{
    enum { N = 8 * 97 + 1 + 301 };
    float *whole = malloc(sizeof(float) * N), *part = malloc(sizeof(float) * N);
    moe_synth_fill(42, MOE_TENSOR_TOKENS, 0, 0, N, 1.0f, whole);
    for (int first = 0; first < 9; first++) {
        moe_synth_fill(42, MOE_TENSOR_TOKENS, 0, (uint64_t)first * 97 + 1, 301, 1.0f, part);
        for (int n = 0; n < 301; n++)
            ck_assert_float_eq(part[n], whole[first * 97 + 1 + n]);
    }
    free(part);
    free(whole);
}
END_TEST

/* Every instruction set's batches give the documented values, element by
 * element: whole batches and cut ones, a negative and a large scale, and a
 * counter whose low word carries into the high one inside a batch. */
START_TEST(synth_fill_matches_the_value_at_every_isa)
{
    static const enum moe_isa isas[] = {MOE_ISA_WIDEST, MOE_ISA_AVX2, MOE_ISA_PORTABLE};
    static const float scales[] = {1.0f, -0.037f, 3.0e4f};
    enum { N = 4 * 16 * 5 + 7 };
    float *v = malloc(sizeof(float) * N);
    const uint64_t firsts[] = {0, 3, 4 * (0x100000000ULL - 21) + 2};
    for (int i = 0; i < 3; i++) {
        moe_synth_force(isas[i]);
        for (int f = 0; f < 3; f++) {
            moe_synth_fill(0x9e3779b97f4a7c15ULL, MOE_TENSOR_W2, 5, firsts[f], N, scales[f], v);
            for (int n = 0; n < N; n++)
                ck_assert_msg(v[n] == moe_synth_value(0x9e3779b97f4a7c15ULL, MOE_TENSOR_W2, 5,
                                                      firsts[f] + (uint64_t)n, scales[f]),
                              "isa %d, element %llu", i, (unsigned long long)(firsts[f] + (uint64_t)n));
        }
    }
    moe_synth_force(MOE_ISA_WIDEST);
    free(v);
}
END_TEST

START_TEST(synth_values_are_in_range_and_spread)
{
    enum { N = 1 << 16 };
    float *v = malloc(sizeof(float) * N);
    moe_synth_fill(7, MOE_TENSOR_GATE, 0, 0, N, 0.25f, v);
    double sum = 0.0, sum_sq = 0.0;
    for (int n = 0; n < N; n++) {
        ck_assert(v[n] >= -0.25f && v[n] < 0.25f);
        sum += v[n];
        sum_sq += (double)v[n] * v[n];
    }
    /* Uniform on [-a, a): mean 0, variance a^2/3; 5-sigma bounds for N draws. */
    const double a = 0.25, var = a * a / 3.0;
    ck_assert_double_le(fabs(sum / N), 5.0 * sqrt(var / N));
    ck_assert_double_le(fabs(sum_sq / N - var), 5.0 * var * sqrt(0.8 / N) + 1e-12);
    free(v);
}
END_TEST

START_TEST(synth_tensors_and_entities_differ)
{
    float a = moe_synth_value(1, MOE_TENSOR_W1, 0, 5, 1.0f);
    ck_assert_float_ne(a, moe_synth_value(1, MOE_TENSOR_W2, 0, 5, 1.0f));
    ck_assert_float_ne(a, moe_synth_value(1, MOE_TENSOR_W1, 1, 5, 1.0f));
    ck_assert_float_ne(a, moe_synth_value(2, MOE_TENSOR_W1, 0, 5, 1.0f));
}
END_TEST

/* --input-dist activations, spelled out from docs/data.md: the uniform
 * value, times 2^((word(8, 0, g) >> 30) - 2), times 16 on the channels with
 * word(9, 0, j) >> 27 == 0; and some channels are outliers, some not. */
START_TEST(activation_tokens_follow_the_documented_mapping)
{
    enum { T = 5, D = 300, FIRST = 40 };
    static float x[T * D];
    moe_synth_tokens(3, FIRST, T, D, 1.0f, MOE_INPUT_ACTIVATIONS, x);
    int outliers = 0;
    for (int j = 0; j < D; j++)
        outliers += moe_synth_word(3, MOE_TENSOR_CHANNEL, 0, (uint64_t)j) >> 27 == 0;
    ck_assert_int_gt(outliers, 0);
    ck_assert_int_lt(outliers, D / 8);
    for (int i = 0; i < T; i++)
        for (int j = 0; j < D; j++) {
            const uint64_t g = FIRST + (uint64_t)i;
            const uint32_t word = moe_synth_word(3, MOE_TENSOR_TOKEN_SCALE, 0, g);
            const float factor = ldexpf(1.0f, (int)(word >> 30) - 2) *
                                 (moe_synth_word(3, MOE_TENSOR_CHANNEL, 0, (uint64_t)j) >> 27 ? 1.0f : 16.0f);
            const float want = moe_synth_value(3, MOE_TENSOR_TOKENS, 0, g * D + (uint64_t)j, 1.0f) * factor;
            ck_assert_float_eq(x[i * D + j], want);
        }
}
END_TEST

Suite *make_rng_suite(void)
{
    Suite *s = suite_create("rng");
    TCase *tc = tcase_create("philox");
    tcase_add_loop_test(tc, philox_known_answers, 0, 3);
    tcase_add_test(tc, synth_value_follows_the_documented_mapping);
    tcase_add_test(tc, synth_fill_is_independent_of_the_slice);
    tcase_add_test(tc, synth_fill_matches_the_value_at_every_isa);
    tcase_add_test(tc, synth_values_are_in_range_and_spread);
    tcase_add_test(tc, synth_tensors_and_entities_differ);
    tcase_add_test(tc, activation_tokens_follow_the_documented_mapping);
    suite_add_tcase(s, tc);
    return s;
}
