/* SPDX-License-Identifier: MIT */
/* sha256.c — SHA-256 as FIPS 180-4 specifies it (see sha256.h). */
#include "moe/sha256.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define MOE_SHA_NI 1
#endif

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void compress(uint32_t state[8], const uint8_t block[64])
{
    uint32_t w[64];
    for (int t = 0; t < 16; t++)
        w[t] = (uint32_t)block[4 * t] << 24 | (uint32_t)block[4 * t + 1] << 16 |
               (uint32_t)block[4 * t + 2] << 8 | block[4 * t + 3];
    for (int t = 16; t < 64; t++) {
        const uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
        const uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
        w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
    uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
    for (int t = 0; t < 64; t++) {
        const uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + K[t] + w[t];
        const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    state[0] += a;
    state[1] += b;
    state[2] += c;
    state[3] += d;
    state[4] += e;
    state[5] += f;
    state[6] += g;
    state[7] += h;
}

#ifdef MOE_SHA_NI
/* The same compression on x86's SHA extensions (sha256rnds2 does two rounds
 * on the state held as ABEF and CDGH; sha256msg1/msg2 extend the message
 * schedule four words at a time): about 4x the portable code. */
__attribute__((target("sha,sse4.1"))) static void compress_ni(uint32_t state[8], const uint8_t *data,
                                                               size_t blocks)
{
    const __m128i swap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
    __m128i cdab = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&state[0]), 0xB1);
    __m128i efgh = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&state[4]), 0x1B);
    __m128i abef = _mm_alignr_epi8(cdab, efgh, 8);
    __m128i cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
    for (; blocks > 0; blocks--, data += 64) {
        const __m128i abef_in = abef, cdgh_in = cdgh;
        __m128i m[4];
        for (int j = 0; j < 16; j++) { /* rounds 4j .. 4j+3 */
            __m128i w;
            if (j < 4) {
                w = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 16 * j)), swap);
            } else {
                w = _mm_sha256msg1_epu32(m[j % 4], m[(j + 1) % 4]);
                w = _mm_add_epi32(w, _mm_alignr_epi8(m[(j + 3) % 4], m[(j + 2) % 4], 4));
                w = _mm_sha256msg2_epu32(w, m[(j + 3) % 4]);
            }
            m[j % 4] = w;
            __m128i wk = _mm_add_epi32(w, _mm_loadu_si128((const __m128i *)&K[4 * j]));
            cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);
            wk = _mm_shuffle_epi32(wk, 0x0E);
            abef = _mm_sha256rnds2_epu32(abef, cdgh, wk);
        }
        abef = _mm_add_epi32(abef, abef_in);
        cdgh = _mm_add_epi32(cdgh, cdgh_in);
    }
    const __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
    const __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    _mm_storeu_si128((__m128i *)&state[0], _mm_blend_epi16(feba, dchg, 0xF0));
    _mm_storeu_si128((__m128i *)&state[4], _mm_alignr_epi8(dchg, feba, 8));
}
#endif

static bool portable_only;

void moe_sha256_portable(bool on) { portable_only = on; }

/* Whole blocks, on the SHA extensions where the CPU has them. */
static void compress_blocks(uint32_t state[8], const uint8_t *data, size_t blocks)
{
#ifdef MOE_SHA_NI
    static int has_sha = -1;
    if (has_sha < 0) { /* CPUID: SHA (leaf 7, EBX bit 29), SSSE3 and SSE4.1 (leaf 1, ECX bits 9, 19) */
        unsigned a, b, c, d;
        const bool sha = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b >> 29 & 1u);
        has_sha = sha && __get_cpuid(1, &a, &b, &c, &d) && (c >> 9 & 1u) && (c >> 19 & 1u);
    }
    if (has_sha && !portable_only) {
        compress_ni(state, data, blocks);
        return;
    }
#endif
    for (; blocks > 0; blocks--, data += 64)
        compress(state, data);
}

void moe_sha256_init(moe_sha256 *h)
{
    static const uint32_t initial[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                        0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(h->state, initial, sizeof initial);
    h->length = 0;
    h->used = 0;
}

void moe_sha256_update(moe_sha256 *h, const void *data, size_t bytes)
{
    const uint8_t *p = data;
    h->length += bytes;
    if (h->used > 0) { /* complete the block begun before */
        const size_t take = 64 - h->used < bytes ? 64 - h->used : bytes;
        memcpy(h->block + h->used, p, take);
        h->used += take;
        p += take;
        bytes -= take;
        if (h->used < 64)
            return;
        compress_blocks(h->state, h->block, 1);
        h->used = 0;
    }
    compress_blocks(h->state, p, bytes / 64);
    p += bytes / 64 * 64;
    h->used = bytes % 64;
    memcpy(h->block, p, h->used);
}

void moe_sha256_final(moe_sha256 *h, uint8_t digest[32])
{
    const uint64_t bits = h->length * 8;
    const uint8_t one = 0x80, zero = 0;
    moe_sha256_update(h, &one, 1);
    while (h->used != 56)
        moe_sha256_update(h, &zero, 1);
    uint8_t length[8];
    for (int n = 0; n < 8; n++)
        length[n] = (uint8_t)(bits >> (56 - 8 * n));
    moe_sha256_update(h, length, 8);
    for (int n = 0; n < 8; n++)
        for (int b = 0; b < 4; b++)
            digest[4 * n + b] = (uint8_t)(h->state[n] >> (24 - 8 * b));
}

void moe_sha256_hex(const uint8_t digest[32], char hex[65])
{
    for (int n = 0; n < 32; n++)
        snprintf(hex + 2 * n, 3, "%02x", digest[n]);
}
