/* SPDX-License-Identifier: MIT */
/* rng.h — Philox4x32-10 and the synthetic-data mapping.
 *
 * Every element of every generated tensor is a pure function of
 * (seed, tensor id, entity, element index): a rank generates exactly its own
 * share, and the value does not depend on G, W or the thread count. The exact
 * mapping is specified in docs/data.md so that a GPU port can regenerate it.
 * This is not a general-purpose RNG: there is no state and no stream.
 */
#ifndef MOE_RNG_H
#define MOE_RNG_H

#include <stdint.h>

#include "moe/common.h"
#include "moe/dims.h"

/* Philox4x32 with 10 rounds (Salmon et al., SC'11; Random123). Pure function. */
void moe_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);

/* Tensor ids: word 2 of the Philox counter. Values are part of the data
 * format (docs/data.md); never renumber. */
enum moe_tensor {
    MOE_TENSOR_TOKENS = 1,    /* X   (G*T, d), entity 0, row = global token id */
    MOE_TENSOR_GATE = 2,      /* W_g (E, d), entity 0 */
    MOE_TENSOR_W1 = 3,        /* W1  (2f, d) of routed expert `entity` */
    MOE_TENSOR_W2 = 4,        /* W2  (d, f) of routed expert `entity` */
    MOE_TENSOR_SHARED_W1 = 5, /* W1  (2f, d) of shared expert `entity` */
    MOE_TENSOR_SHARED_W2 = 6, /* W2  (d, f) of shared expert `entity` */
    MOE_TENSOR_BIAS = 7,      /* deepseek-v3 correction bias (E), entity 0 */
    MOE_TENSOR_TOKEN_SCALE = 8, /* --input-dist activations: a token's binade, index = global id */
    MOE_TENSOR_CHANNEL = 9,   /* --input-dist activations: outlier channels, index = j */
    MOE_TENSOR_GRAD_OUTPUT = 10, /* dy (G*T, d) of --backward, entity 0, row = global token id */
    MOE_TENSOR_WORKLOAD_DRAW = 11,   /* --workload: one word per (token, slot), entity = step */
    MOE_TENSOR_WORKLOAD_WEIGHT = 12, /* --workload: one word per (token, slot), entity = step */
    MOE_TENSOR_WORKLOAD_HOT = 13,    /* --workload: one word per expert (W1's hot set), entity 0 */
};

/* The fp32 value of element `index` of (tensor, entity): uniform in
 * [-scale, scale), exactly as docs/data.md defines it. */
float moe_synth_value(uint64_t seed, enum moe_tensor tensor, uint32_t entity, uint64_t index,
                      float scale);

/* out[n] = moe_synth_value(seed, tensor, entity, first + n, scale) for
 * 0 <= n < count. OpenMP-parallel; the result does not depend on threads. */
void moe_synth_fill(uint64_t seed, enum moe_tensor tensor, uint32_t entity, uint64_t first,
                    moe_index count, float scale, float *out);

/* Limit the instruction set moe_synth_fill runs its Philox batches with
 * (AVX-512, AVX2 or plain C, each where the CPU has it; the same values on
 * each): for tests. */
void moe_synth_force(enum moe_isa isa);

/* The raw Philox word of element `index` of (tensor, entity). */
uint32_t moe_synth_word(uint64_t seed, enum moe_tensor tensor, uint32_t entity, uint64_t index);

/* x (T, d) = the input tokens with global ids first_token .. first_token+T-1,
 * uniform in [-scale, scale) (--init-scale), and with dist
 * MOE_INPUT_ACTIVATIONS shaped like a layer's activations (docs/data.md):
 * token g times 2^k, k = (word(8, 0, g) >> 30) - 2, a binade in [-2, 1];
 * channel j times 16 when word(9, 0, j) >> 27 is 0 (1 channel in 32, the
 * outliers). Both factors are powers of two: the products are exact. */
void moe_synth_tokens(uint64_t seed, uint64_t first_token, moe_index tokens, moe_index hidden,
                      float scale, int dist, float *x);

/* The scale of a weight whose dot products run over fan_in inputs:
 * (float)(1 / sqrt(fan_in)), computed in double then rounded once. */
float moe_synth_weight_scale(moe_index fan_in);

#endif
