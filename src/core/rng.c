/* rng.c — Philox4x32-10 and the synthetic-data mapping (see rng.h, docs/data.md). */
#include "moe/rng.h"

#include "moe/common.h"
#include "moe/config.h"

#include <math.h>
#include <stdlib.h>

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

__attribute__((target_clones("avx512f", "avx2", "default")))
static void synth_batch(uint64_t seed, uint32_t tensor, uint32_t entity, uint64_t block,
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

void moe_synth_fill(uint64_t seed, enum moe_tensor tensor, uint32_t entity, uint64_t first,
                    moe_index count, float scale, float *out)
{
    if (count <= 0)
        return;
    const uint64_t end = first + (uint64_t)count;
    const int64_t first_block = (int64_t)(first >> 2);
    const int64_t last_block = (int64_t)((end - 1) >> 2);
    const int64_t batches = (last_block - first_block) / BATCH + 1;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < batches; n++) {
        const uint64_t block = (uint64_t)(first_block + n * BATCH);
        float values[4 * BATCH];
        synth_batch(seed, (uint32_t)tensor, entity, block, scale, values);
        for (int m = 0; m < 4 * BATCH; m++) {
            const uint64_t index = (block << 2) + (uint64_t)m;
            if (index >= first && index < end)
                out[index - first] = values[m];
        }
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
