/* SPDX-License-Identifier: MIT */
/* rng.c — Philox4x32-10 and the synthetic-data mapping (see rng.h, docs/data.md). */
#include "moe/rng.h"

#include "moe/common.h"
#include "moe/config.h"

#include <math.h>
#include <stdlib.h>
#ifdef MOE_X86_KERNELS
#include <immintrin.h>
#endif

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u /* golden ratio */
#define PHILOX_W1 0xBB67AE85u /* sqrt(3) - 1 */

/* The ten rounds on `lanes` counters at once, word n of counter b in
 * c[n][b]: one definition for a single block and for a batch, whose loop
 * over the lanes the compiler runs in vector registers (32 x 32 -> 64-bit
 * products). */
static inline void philox_rounds(int lanes, uint32_t *c0, uint32_t *c1, uint32_t *c2,
                                 uint32_t *c3, const uint32_t key[2])
{
    uint32_t k0 = key[0], k1 = key[1];
    for (int round = 0; round < 10; round++) {
        if (round > 0) {
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        for (int b = 0; b < lanes; b++) {
            const uint64_t p0 = (uint64_t)PHILOX_M0 * c0[b], p1 = (uint64_t)PHILOX_M1 * c2[b];
            const uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1[b] ^ k0;
            const uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3[b] ^ k1;
            c1[b] = (uint32_t)p1;
            c3[b] = (uint32_t)p0;
            c0[b] = n0;
            c2[b] = n2;
        }
    }
}

void moe_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4])
{
    uint32_t c[4] = {counter[0], counter[1], counter[2], counter[3]};
    philox_rounds(1, &c[0], &c[1], &c[2], &c[3], key);
    for (int n = 0; n < 4; n++)
        out[n] = c[n];
}

/* One Philox block gives the four consecutive elements 4b .. 4b+3. */
static inline void synth_block(uint64_t seed, uint32_t tensor, uint32_t entity, uint64_t block,
                               uint32_t words[4])
{
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    const uint32_t counter[4] = {(uint32_t)block, (uint32_t)(block >> 32), tensor, entity};
    moe_philox4x32_10(counter, key, words);
}

/* The top 24 bits as an integer in [-2^23, 2^23), times 2^-23: exact in fp32,
 * uniform in [-1, 1). Then one fp32 rounding for the scale. */
static inline float word_to_value(uint32_t word, float scale)
{
    float unit = (float)((int32_t)(word >> 8) - 8388608) * 0x1p-23f;
    return unit * scale;
}

float moe_synth_value(uint64_t seed, enum moe_tensor tensor, uint32_t entity, uint64_t index,
                      float scale)
{
    uint32_t words[4];
    synth_block(seed, (uint32_t)tensor, entity, index >> 2, words);
    return word_to_value(words[index & 3], scale);
}

/* Blocks of a fill computed side by side: the Philox rounds on BATCH
 * counters at once, in vector lanes; the integers, and so the values, are
 * those of moe_philox4x32_10 block by block. */
enum { BATCH = 16 };

typedef void synth_batch_fn(uint64_t seed, uint32_t tensor, uint32_t entity, uint64_t block,
                            float scale, float out[4 * BATCH]);

/* The batch in plain C, whose loops over the lanes the compiler vectorises. */
__attribute__((always_inline)) static inline void synth_batch_c(uint64_t seed, uint32_t tensor,
                                                                uint32_t entity, uint64_t block,
                                                                float scale, float out[4 * BATCH])
{
    uint32_t c0[BATCH], c1[BATCH], c2[BATCH], c3[BATCH];
    for (int b = 0; b < BATCH; b++) {
        c0[b] = (uint32_t)(block + (uint64_t)b);
        c1[b] = (uint32_t)((block + (uint64_t)b) >> 32);
        c2[b] = tensor;
        c3[b] = entity;
    }
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    philox_rounds(BATCH, c0, c1, c2, c3, key);
    for (int b = 0; b < BATCH; b++) {
        out[4 * b] = word_to_value(c0[b], scale);
        out[4 * b + 1] = word_to_value(c1[b], scale);
        out[4 * b + 2] = word_to_value(c2[b], scale);
        out[4 * b + 3] = word_to_value(c3[b], scale);
    }
}

static void synth_batch_portable(uint64_t seed, uint32_t tensor, uint32_t entity, uint64_t block,
                                 float scale, float out[4 * BATCH])
{
    synth_batch_c(seed, tensor, entity, block, scale, out);
}

#ifdef MOE_X86_KERNELS
__attribute__((target("avx512f"))) static void synth_batch_avx512(uint64_t seed, uint32_t tensor,
                                                                  uint32_t entity, uint64_t block,
                                                                  float scale,
                                                                  float out[4 * BATCH])
{
    synth_batch_c(seed, tensor, entity, block, scale, out);
}

/* The high and low 32 bits of the products of a's eight lanes with m (the
 * same 32-bit constant in every lane): even lanes from one 32 x 32 -> 64
 * multiply, odd lanes from another, blended back into place. */
__attribute__((target("avx2"), always_inline)) static inline void mul_hi_lo(__m256i a, __m256i m,
                                                                            __m256i *hi, __m256i *lo)
{
    const __m256i even = _mm256_mul_epu32(a, m), odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
    *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

/* word_to_value on eight lanes: the same operations, so the same bits. */
__attribute__((target("avx2"), always_inline)) static inline __m256 words_to_values(__m256i w, __m256 scale)
{
    const __m256i centred = _mm256_sub_epi32(_mm256_srli_epi32(w, 8), _mm256_set1_epi32(8388608));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(centred), _mm256_set1_ps(0x1p-23f)), scale);
}

/* The batch with the Philox words in AVX2 registers: two groups of eight
 * counters, word n of group g in c[g][n], the rounds of both interleaved;
 * then each group's values transposed to block order. */
__attribute__((target("avx2"))) static void synth_batch_avx2(uint64_t seed, uint32_t tensor,
                                                             uint32_t entity, uint64_t block,
                                                             float scale, float out[4 * BATCH])
{
    uint32_t low[BATCH], high[BATCH];
    for (int b = 0; b < BATCH; b++) {
        low[b] = (uint32_t)(block + (uint64_t)b);
        high[b] = (uint32_t)((block + (uint64_t)b) >> 32);
    }
    __m256i c[2][4];
    for (int g = 0; g < 2; g++) {
        c[g][0] = _mm256_loadu_si256((const __m256i *)(low + 8 * g));
        c[g][1] = _mm256_loadu_si256((const __m256i *)(high + 8 * g));
        c[g][2] = _mm256_set1_epi32((int)tensor);
        c[g][3] = _mm256_set1_epi32((int)entity);
    }
    const __m256i m0 = _mm256_set1_epi32((int)PHILOX_M0), m1 = _mm256_set1_epi32((int)PHILOX_M1);
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int round = 0; round < 10; round++) {
        if (round > 0) {
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        const __m256i key0 = _mm256_set1_epi32((int)k0), key1 = _mm256_set1_epi32((int)k1);
        for (int g = 0; g < 2; g++) {
            __m256i hi0, lo0, hi1, lo1;
            mul_hi_lo(c[g][0], m0, &hi0, &lo0);
            mul_hi_lo(c[g][2], m1, &hi1, &lo1);
            c[g][0] = _mm256_xor_si256(_mm256_xor_si256(hi1, c[g][1]), key0);
            c[g][2] = _mm256_xor_si256(_mm256_xor_si256(hi0, c[g][3]), key1);
            c[g][1] = lo1;
            c[g][3] = lo0;
        }
    }
    const __m256 s = _mm256_set1_ps(scale);
    for (int g = 0; g < 2; g++) {
        const __m256 f0 = words_to_values(c[g][0], s), f1 = words_to_values(c[g][1], s);
        const __m256 f2 = words_to_values(c[g][2], s), f3 = words_to_values(c[g][3], s);
        /* lanes b of f0..f3 to out[4b .. 4b + 3]: u_j holds blocks j and j + 4 */
        const __m256 t0 = _mm256_unpacklo_ps(f0, f1), t1 = _mm256_unpackhi_ps(f0, f1);
        const __m256 t2 = _mm256_unpacklo_ps(f2, f3), t3 = _mm256_unpackhi_ps(f2, f3);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        float *o = out + 32 * g;
        _mm256_storeu_ps(o, _mm256_permute2f128_ps(u0, u1, 0x20));
        _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(u2, u3, 0x20));
        _mm256_storeu_ps(o + 16, _mm256_permute2f128_ps(u0, u1, 0x31));
        _mm256_storeu_ps(o + 24, _mm256_permute2f128_ps(u2, u3, 0x31));
    }
}
#endif

static enum moe_isa synth_forced = MOE_ISA_WIDEST;

void moe_synth_force(enum moe_isa isa) { synth_forced = isa; }

/* The batch kernel for this CPU, as moe_synth_force limits it. */
static synth_batch_fn *synth_batch(void)
{
#ifdef MOE_X86_KERNELS
    if (moe_isa_avx512(synth_forced))
        return synth_batch_avx512;
    if (moe_isa_avx2(synth_forced))
        return synth_batch_avx2;
#endif
    return synth_batch_portable;
}

void moe_synth_fill(uint64_t seed, enum moe_tensor tensor, uint32_t entity, uint64_t first,
                    moe_index count, float scale, float *out)
{
    if (count <= 0)
        return;
    synth_batch_fn *batch = synth_batch();
    const uint64_t end = first + (uint64_t)count;
    const int64_t first_block = (int64_t)(first >> 2);
    const int64_t last_block = (int64_t)((end - 1) >> 2);
    const int64_t batches = (last_block - first_block) / BATCH + 1;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < batches; n++) {
        const uint64_t block = (uint64_t)(first_block + n * BATCH);
        const uint64_t index = block << 2; /* of values[0] */
        if (index >= first && index + 4 * BATCH <= end) { /* the whole batch is in the fill */
            batch(seed, (uint32_t)tensor, entity, block, scale, out + (index - first));
            continue;
        }
        float values[4 * BATCH];
        batch(seed, (uint32_t)tensor, entity, block, scale, values);
        for (int m = 0; m < 4 * BATCH; m++)
            if (index + (uint64_t)m >= first && index + (uint64_t)m < end)
                out[index + (uint64_t)m - first] = values[m];
    }
}

float moe_synth_weight_scale(moe_index fan_in)
{
    return (float)(1.0 / sqrt((double)fan_in));
}

uint32_t moe_synth_word(uint64_t seed, enum moe_tensor tensor, uint32_t entity, uint64_t index)
{
    uint32_t words[4];
    synth_block(seed, (uint32_t)tensor, entity, index >> 2, words);
    return words[index & 3];
}

void moe_synth_tokens(uint64_t seed, uint64_t first_token, moe_index tokens, moe_index hidden,
                      float scale, int dist, float *x)
{
    moe_synth_fill(seed, MOE_TENSOR_TOKENS, 0, first_token * (uint64_t)hidden, tokens * hidden, scale,
                   x);
    if (dist != MOE_INPUT_ACTIVATIONS)
        return;
    float *channel = moe_xmalloc(sizeof(float) * (size_t)hidden); /* (d) */
    for (moe_index j = 0; j < hidden; j++)
        channel[j] = moe_synth_word(seed, MOE_TENSOR_CHANNEL, 0, (uint64_t)j) >> 27 ? 1.0f : 16.0f;
#pragma omp parallel for schedule(static)
    for (moe_index i = 0; i < tokens; i++) {
        const uint32_t word = moe_synth_word(seed, MOE_TENSOR_TOKEN_SCALE, 0, first_token + (uint64_t)i);
        const float binade = ldexpf(1.0f, (int)(word >> 30) - 2);
        for (moe_index j = 0; j < hidden; j++)
            x[i * hidden + j] = x[i * hidden + j] * binade * channel[j];
    }
    free(channel);
}
