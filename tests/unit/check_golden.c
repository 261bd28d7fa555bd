/* SPDX-License-Identifier: MIT */
/* check_golden.c — SHA-256 against FIPS 180-4's examples, the 64-bit
 * digest that tells outputs apart, and safetensors round trips and corrupt
 * files. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "moe/common.h"
#include "moe/safetensors.h"
#include "moe/sha256.h"
#include "suites.h"

static void hash_hex(const char *text, char hex[65])
{
    moe_sha256 h;
    uint8_t digest[32];
    moe_sha256_init(&h);
    moe_sha256_update(&h, text, strlen(text));
    moe_sha256_final(&h, digest);
    moe_sha256_hex(digest, hex);
}

START_TEST(sha256_known_answers)
{
    char hex[65];
    hash_hex("abc", hex);
    ck_assert_str_eq(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    hash_hex("", hex);
    ck_assert_str_eq(hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    hash_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq", hex);
    ck_assert_str_eq(hex, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}
END_TEST

/* moe_digest64 sees every bit of every length (the four chains' words,
 * the tail words and the tail bytes), and its order: swapping two words of
 * different chains changes it. */
START_TEST(digest64_sees_every_bit)
{
    unsigned char data[80];
    for (size_t i = 0; i < sizeof data; i++)
        data[i] = (unsigned char)(i * 37 + 11);
    for (size_t n = 1; n <= sizeof data; n++) {
        const uint64_t base = moe_digest64(data, n);
        ck_assert_uint_eq(moe_digest64(data, n), base);
        ck_assert_uint_ne(moe_digest64(data, n - 1), base);
        for (size_t bit = 0; bit < 8 * n; bit++) {
            data[bit / 8] ^= (unsigned char)(1u << bit % 8);
            ck_assert_uint_ne(moe_digest64(data, n), base);
            data[bit / 8] ^= (unsigned char)(1u << bit % 8);
        }
    }
    uint64_t w[8];
    for (int i = 0; i < 8; i++)
        w[i] = 0x0101010101010101u * (uint64_t)(i + 1);
    const uint64_t before = moe_digest64(w, sizeof w);
    const uint64_t t = w[0];
    w[0] = w[1];
    w[1] = t;
    ck_assert_uint_ne(moe_digest64(w, sizeof w), before);
}
END_TEST

/* The CPU's SHA extensions (where it has them) and the portable code give
 * the same digests, for every length 0..300 and for a 1 MiB message fed
 * in uneven pieces, and the known answer of a million 'a's. */
static void digest_of(const uint8_t *data, size_t bytes, size_t piece, bool portable, char hex[65])
{
    moe_sha256 h;
    uint8_t digest[32];
    moe_sha256_portable(portable);
    moe_sha256_init(&h);
    for (size_t at = 0; at < bytes; at += piece)
        moe_sha256_update(&h, data + at, bytes - at < piece ? bytes - at : piece);
    moe_sha256_final(&h, digest);
    moe_sha256_hex(digest, hex);
    moe_sha256_portable(false);
}

START_TEST(sha256_extensions_match_portable)
{
    const size_t big = 1 << 20;
    uint8_t *data = malloc(big);
    ck_assert_ptr_nonnull(data);
    uint32_t x = 12345;
    for (size_t i = 0; i < big; i++)
        data[i] = (uint8_t)((x = x * 1103515245u + 12345u) >> 24);
    char a[65], b[65];
    for (size_t n = 0; n <= 300; n++) {
        digest_of(data, n, 7, true, a);
        digest_of(data, n, n ? n : 1, false, b);
        ck_assert_str_eq(a, b);
    }
    digest_of(data, big, 4099, true, a);
    digest_of(data, big, 65536, false, b);
    ck_assert_str_eq(a, b);
    memset(data, 'a', 1000000);
    digest_of(data, 1000000, 1000, false, a);
    ck_assert_str_eq(a, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    free(data);
}
END_TEST

static void fill_rows(const void *ctx, int64_t row, void *out)
{
    const int *width = ctx;
    for (int j = 0; j < *width; j++)
        ((float *)out)[j] = (float)(row * 10 + j);
}

static void temp_path(char *path, size_t size)
{
    snprintf(path, size, "/tmp/moe-ep-st-%ld-%d.safetensors", (long)getpid(), rand());
}

START_TEST(round_trip)
{
    const float a[6] = {1, 2, 3, 4, 5, 6};
    const int32_t ids[3] = {7, -1, 42};
    const double truth[2] = {0.5, -0.25};
    const int width = 3;
    moe_st_tensor t[4] = {
        {.name = "a", .dtype = MOE_ST_F32, .ndim = 2, .shape = {2, 3}, .data = a},
        {.name = "ids", .dtype = MOE_ST_I32, .ndim = 1, .shape = {3}, .data = ids},
        {.name = "truth", .dtype = MOE_ST_F64, .ndim = 1, .shape = {2}, .data = truth},
        {.name = "generated", .dtype = MOE_ST_F32, .ndim = 2, .shape = {4, 3}, .fill = fill_rows, .ctx = &width},
    };
    char path[128], hex[65];
    temp_path(path, sizeof path);
    moe_status st = {0};
    ck_assert_int_eq(moe_st_write(path, t, 4, "{\"seed\": \"1\"}", hex, &st), 0);
    ck_assert_int_eq((int)strlen(hex), 64);
    moe_st_file f;
    ck_assert_int_eq(moe_st_open(path, &f, &st), 0);
    ck_assert_int_eq(f.count, 4);
    ck_assert_int_eq((int)(f.data_start % 8), 0);
    const moe_st_entry *e = moe_st_find(&f, "generated");
    ck_assert_ptr_nonnull(e);
    float g[12];
    ck_assert_int_eq(moe_st_read(&f, e, g, &st), 0);
    ck_assert_float_eq(g[3 * 2 + 1], 21.0f);
    int32_t back[3];
    ck_assert_int_eq(moe_st_read(&f, moe_st_find(&f, "ids"), back, &st), 0);
    ck_assert_int_eq(memcmp(back, ids, sizeof ids), 0);
    moe_st_close(&f);
    unlink(path);
}
END_TEST

/* Corrupt files: each is an error with a message, never a crash. A case is
 * raw bytes, or a header whose length is written in front of it followed by
 * `data` zero bytes. */
static const struct {
    const char *raw;
    size_t raw_length;
    const char *header;
    size_t data;
    const char *fragment;
} corrupt[] = {
    {"\x04\x00\x00", 3, NULL, 0, "shorter than"},
    {"\xff\x00\x00\x00\x00\x00\x00\x00{}", 10, NULL, 0, "runs past the end"},
    {NULL, 0, "[1]", 0, "not a JSON object"},
    {NULL, 0, "{\"a\":1}", 0, "lacks dtype"},
    {NULL, 0, "{\"a\":{\"dtype\":\"F8_E5M2\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, "does not know"},
    {NULL, 0, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4, "truncated"},
    {NULL, 0, "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, "do not match"},
    {NULL, 0, "{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,8]}}", 8, "list of sizes"},
    {NULL, 0, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, "bad data_offsets"},
    /* two tensors on the same bytes (a routing file whose weights are its ids) */
    {NULL, 0, "{\"ids\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[0,8]},"
              "\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "share bytes"},
    {NULL, 0, "{\"ids\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[0,8]},"
              "\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, "share bytes"},
};

/* The candidate dtypes verify converts: every element as its value. */
START_TEST(candidate_dtypes_read_as_their_values)
{
    const uint16_t bf16[] = {0x3f80, 0xc0a0, 0x0001, 0x7f80, 0x7fc1}; /* 1, -5, tiny, inf, nan */
    const uint16_t f16[] = {0x3c00, 0xc500, 0x0001, 0x7c00, 0x7e00};  /* 1, -5, 2^-24, inf, nan */
    const int64_t i64[] = {-3, 1LL << 40};
    const int16_t i16[] = {-7, 300};
    ck_assert_double_eq(moe_st_element(bf16, MOE_ST_BF16, 0), 1.0);
    ck_assert_double_eq(moe_st_element(bf16, MOE_ST_BF16, 1), -5.0);
    ck_assert_double_eq(moe_st_element(bf16, MOE_ST_BF16, 2), ldexp(1.0, -133));
    ck_assert(isinf(moe_st_element(bf16, MOE_ST_BF16, 3)));
    ck_assert(isnan(moe_st_element(bf16, MOE_ST_BF16, 4)));
    ck_assert_double_eq(moe_st_element(f16, MOE_ST_F16, 0), 1.0);
    ck_assert_double_eq(moe_st_element(f16, MOE_ST_F16, 1), -5.0);
    ck_assert_double_eq(moe_st_element(f16, MOE_ST_F16, 2), ldexp(1.0, -24));
    ck_assert(isinf(moe_st_element(f16, MOE_ST_F16, 3)));
    ck_assert(isnan(moe_st_element(f16, MOE_ST_F16, 4)));
    ck_assert_double_eq(moe_st_element(i64, MOE_ST_I64, 0), -3.0);
    ck_assert_double_eq(moe_st_element(i64, MOE_ST_I64, 1), ldexp(1.0, 40));
    ck_assert_double_eq(moe_st_element(i16, MOE_ST_I16, 0), -7.0);
    ck_assert_double_eq(moe_st_element(i16, MOE_ST_I16, 1), 300.0);
    ck_assert(moe_st_dtype_is_integer(MOE_ST_I64) && !moe_st_dtype_is_integer(MOE_ST_BF16));
}
END_TEST

START_TEST(corrupt_files_are_errors)
{
    char path[128];
    temp_path(path, sizeof path);
    FILE *fp = fopen(path, "wb");
    if (corrupt[_i].raw) {
        fwrite(corrupt[_i].raw, 1, corrupt[_i].raw_length, fp);
    } else {
        const uint64_t length = strlen(corrupt[_i].header);
        for (int b = 0; b < 8; b++)
            fputc((int)((length >> (8 * b)) & 0xff), fp);
        fputs(corrupt[_i].header, fp);
        for (size_t n = 0; n < corrupt[_i].data; n++)
            fputc(0, fp);
    }
    fclose(fp);
    moe_st_file f;
    moe_status st = {0};
    ck_assert_int_eq(moe_st_open(path, &f, &st), MOE_EXIT_USAGE);
    ck_assert_msg(strstr(st.message, corrupt[_i].fragment), "case %d: %s", _i, st.message);
    unlink(path);
}
END_TEST

Suite *make_golden_suite(void)
{
    Suite *s = suite_create("golden");
    TCase *tc = tcase_create("files");
    tcase_add_test(tc, sha256_known_answers);
    tcase_add_test(tc, digest64_sees_every_bit);
    tcase_add_test(tc, sha256_extensions_match_portable);
    tcase_add_test(tc, round_trip);
    tcase_add_loop_test(tc, corrupt_files_are_errors, 0, sizeof corrupt / sizeof corrupt[0]);
    tcase_add_test(tc, candidate_dtypes_read_as_their_values);
    suite_add_tcase(s, tc);
    return s;
}
