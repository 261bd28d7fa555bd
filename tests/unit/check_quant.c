/* SPDX-License-Identifier: MIT */
/* check_quant.c — BF16 and FP8 E4M3 against known bit patterns, and the
 * block quantiser. */
#include <math.h>
#include <string.h>

#include "moe/quant.h"
#include "moe/wire.h"
#include "suites.h"

static float from_bits(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static const struct {
    uint32_t in;
    uint16_t out;
} bf16_cases[] = {
    {0x3f800000, 0x3f80}, /* 1 */
    {0x3f808000, 0x3f80}, /* 1 + 2^-8: tie, to even (down) */
    {0x3f818000, 0x3f82}, /* 1 + 3 * 2^-8: tie, to even (up) */
    {0x3f808001, 0x3f81}, /* just above the tie: up */
    {0xbf80ffff, 0xbf81}, /* negative, rounds away in magnitude */
    {0x7f800000, 0x7f80}, /* +Inf */
    {0xff800000, 0xff80}, /* -Inf */
    {0x7fc00000, 0x7fc0}, /* quiet NaN */
    {0x7f800001, 0x7fc0}, /* signalling NaN: stays NaN, made quiet */
    {0x7f7fffff, 0x7f80}, /* the largest float rounds to Inf */
    {0x7f7f7fff, 0x7f7f}, /* the largest bf16, from below */
    {0x00200000, 0x0020}, /* a subnormal, exact */
    {0x00008000, 0x0000}, /* half the smallest bf16 subnormal: tie to even, zero */
    {0x80000000, 0x8000}, /* -0 */
};

START_TEST(bf16_bit_patterns)
{
    const uint16_t got = moe_f32_to_bf16(from_bits(bf16_cases[_i].in));
    ck_assert_msg(got == bf16_cases[_i].out, "%08x -> %04x, want %04x", bf16_cases[_i].in, got,
                  bf16_cases[_i].out);
}
END_TEST

static const struct {
    float in;
    uint8_t out;
} e4m3_cases[] = {
    {1.0f, 0x38},          {-1.0f, 0xb8},         {448.0f, 0x7e},        {-448.0f, 0xfe},
    {500.0f, 0x7e},        {1e30f, 0x7e},         {INFINITY, 0x7e},      {-INFINITY, 0xfe},
    {440.0f, 0x7e},        {432.0f, 0x7e},        /* 416 | 448: tie goes to even (448) */
    {0x1p-9f, 0x01},       /* the smallest subnormal */
    {0x1p-10f, 0x00},      /* half of it: tie to even, zero */
    {0x3p-10f, 0x02},      /* 1.5 quanta: tie to even, 2 */
    {0x1p-6f, 0x08},       /* the smallest normal */
    {0x7p-9f, 0x07},       /* the largest subnormal */
    {1.0625f, 0x38},       /* 1 | 1.125: tie to even (1) */
    {1.1875f, 0x3a},       /* 1.125 | 1.25: tie to even (1.25) */
    {0.0f, 0x00},          {-0.0f, 0x80},
};

START_TEST(e4m3_bit_patterns)
{
    const uint8_t got = moe_f32_to_e4m3(e4m3_cases[_i].in);
    ck_assert_msg(got == e4m3_cases[_i].out, "%a -> %02x, want %02x", e4m3_cases[_i].in, got,
                  e4m3_cases[_i].out);
}
END_TEST

START_TEST(e4m3_nan_and_round_trip)
{
    ck_assert_int_eq(moe_f32_to_e4m3(NAN) & 0x7f, 0x7f);
    ck_assert(isnan(moe_e4m3_to_f32(0x7f)));
    ck_assert(isnan(moe_e4m3_to_f32(0xff)));
    /* every finite code decodes and encodes back to itself */
    for (int q = 0; q < 256; q++) {
        if ((q & 0x7f) == 0x7f)
            continue;
        const float v = moe_e4m3_to_f32((uint8_t)q);
        ck_assert_msg(moe_f32_to_e4m3(v) == (q == 0x80 ? 0x80 : q), "code %02x (%a)", q, v);
    }
    ck_assert_float_eq(moe_e4m3_to_f32(0x7e), 448.0f);
    ck_assert_float_eq(moe_e4m3_to_f32(0x01), 0x1p-9f);
}
END_TEST

/* Rows decoded from the wire are exactly the rows the emulation gives (what
 * the dense truth and this rank's own rows use), for every dtype, recipe and
 * scale format, on blocks of zeros, tiny (subnormal) values, ordinary and
 * saturating ones; and a row has the bytes wire.h says. */
START_TEST(wire_rows_decode_to_the_emulation)
{
    enum { ROWS = 4, D = 300 }; /* three blocks, the last one short */
    static float x[ROWS * D], want[ROWS * D], got[ROWS * D];
    static uint8_t wire[ROWS * (D * 4 + 16)];
    for (int i = 0; i < ROWS * D; i++) {
        const float u = (float)((i * 7919) % 2003) / 1001.0f - 1.0f;
        const int row = i / D;
        x[i] = row == 0 ? 0.0f : row == 1 ? u * 1e-40f : row == 2 ? u * 3.0f : u * 1e6f;
    }
    x[D + 5] = 0.0f; /* the tiny row keeps a zero in a block */
    moe_config cfg;
    moe_config_defaults(&cfg);
    cfg.hidden = D;
    for (int dtype = MOE_DTYPE_FP32; dtype <= MOE_DTYPE_FP8; dtype++)
        for (int recipe = 0; recipe < 4; recipe++)
            for (int ue8m0 = 0; ue8m0 < 2; ue8m0++) {
                cfg.dispatch_dtype = dtype;
                cfg.fp8_recipe = recipe;
                cfg.fp8_scale = ue8m0 ? MOE_FP8_SCALE_UE8M0 : MOE_FP8_SCALE_FLOAT;
                const moe_wire w = moe_wire_dispatch(&cfg);
                const size_t values = dtype == MOE_DTYPE_FP8 ? D : (size_t)D * (dtype == MOE_DTYPE_BF16 ? 2 : 4);
                ck_assert_uint_eq(w.bytes, values + (dtype == MOE_DTYPE_FP8 ? 3 * (ue8m0 ? 1 : 4) : 0));
                moe_precision_dispatch(dtype, w.fp8, x, ROWS, D, want);
                moe_wire_encode(&w, x, NULL, ROWS, wire);
                moe_wire_decode(&w, wire, ROWS, got);
                ck_assert_msg(memcmp(want, got, sizeof want) == 0,
                              "dtype %d recipe %d ue8m0 %d: decoded rows differ from the emulation",
                              dtype, recipe, ue8m0);
            }
}
END_TEST

START_TEST(block_quantiser)
{
    float x[200], back[200], scales[2];
    uint8_t q[200];
    for (int j = 0; j < 200; j++)
        x[j] = (float)(j - 100) / 7.0f;
    x[5] = 0.0f;
    moe_quantize_e4m3_row(x, 200, (moe_fp8_format){MOE_FP8_RECIPE_MOE, false}, q, scales, back);
    ck_assert_float_eq(scales[0], fabsf(x[0]) / 448.0f); /* amax of block 0 is |x[0]| */
    ck_assert_float_eq(scales[1], fabsf(x[199]) / 448.0f);
    ck_assert_int_eq(q[0], 0xfe);                       /* the amax lands on -448 */
    ck_assert_float_eq(back[5], 0.0f);
    for (int j = 0; j < 200; j++) /* 3 mantissa bits: within 1/16 of the value (or a subnormal step) */
        ck_assert_msg(fabsf(back[j] - x[j]) <= fabsf(x[j]) / 16.0f + scales[j / 128] * 0x1p-9f,
                      "%d: %g vs %g", j, back[j], x[j]);
    moe_quantize_e4m3_row(x, 200, (moe_fp8_format){MOE_FP8_RECIPE_MOE, true}, q, scales, back); /* UE8M0: powers of two >= amax/448 */
    for (int b = 0; b < 2; b++) {
        int e;
        ck_assert_float_eq(frexpf(scales[b], &e), 0.5f);
        ck_assert(scales[b] >= fabsf(b ? x[199] : x[0]) / 448.0f);
        ck_assert(scales[b] / 2 < fabsf(b ? x[199] : x[0]) / 448.0f);
    }
    float zeros[3] = {0, 0, 0}, s1;
    moe_quantize_e4m3_row(zeros, 3, (moe_fp8_format){MOE_FP8_RECIPE_MOE, false}, q, &s1, back);
    ck_assert_float_eq(s1, 1.0f);
}
END_TEST

/* --dtype fp8's weights: 128 x 128 blocks, each scaled by its own amax (a
 * large value in one block leaves its neighbours' steps alone), partial
 * blocks at the edges, a block of zeros kept zero, UE8M0 scales powers of
 * two; every value a dequantised E4M3 of its block's scale. */
START_TEST(fp8_weight_blocks)
{
    enum { ROWS = 130, COLS = 200 };
    static float m[ROWS * COLS], ref[ROWS * COLS];
    for (int pow2 = 0; pow2 <= 1; pow2++) {
        for (int i = 0; i < ROWS * COLS; i++)
            m[i] = (i / COLS < 128 && i % COLS >= 128) ? 0.0f : 0.01f * (float)((i * 37) % 101 - 50);
        m[5 * COLS + 7] = 448.0f * 4; /* in block (0, 0) only */
        memcpy(ref, m, sizeof m);
        moe_fp8_block_weights(m, ROWS, COLS, pow2);
        ck_assert(m[5 * COLS + 7] == 448.0f * 4); /* a block's amax comes back exactly */
        /* the documented rule, restated: the amax of each value's block */
        float block_amax[2][2] = {{0.0f}};
        for (int i = 0; i < ROWS; i++)
            for (int j = 0; j < COLS; j++)
                block_amax[i / 128][j / 128] = fmaxf(block_amax[i / 128][j / 128], fabsf(ref[i * COLS + j]));
        for (int r = 0; r < ROWS; r++)
            for (int c = 0; c < COLS; c++) {
                const float amax = block_amax[r / 128][c / 128];
                float s = amax > 0.0f ? amax / 448.0f : 1.0f;
                if (pow2 && amax > 0.0f)
                    s = exp2f(ceilf(log2f(s)));
                const float want = moe_e4m3_to_f32(moe_f32_to_e4m3(ref[r * COLS + c] / s)) * s;
                ck_assert_msg(m[r * COLS + c] == want, "(%d, %d): %g, want %g", r, c,
                              m[r * COLS + c], want);
            }
        ck_assert(m[0 * COLS + 150] == 0.0f); /* the block of zeros */
    }
}
END_TEST

Suite *make_quant_suite(void)
{
    Suite *s = suite_create("quant");
    TCase *tc = tcase_create("bits");
    tcase_add_loop_test(tc, bf16_bit_patterns, 0, sizeof bf16_cases / sizeof bf16_cases[0]);
    tcase_add_loop_test(tc, e4m3_bit_patterns, 0, sizeof e4m3_cases / sizeof e4m3_cases[0]);
    tcase_add_test(tc, e4m3_nan_and_round_trip);
    tcase_add_test(tc, block_quantiser);
    tcase_add_test(tc, fp8_weight_blocks);
    tcase_add_test(tc, wire_rows_decode_to_the_emulation);
    suite_add_tcase(s, tc);
    return s;
}
