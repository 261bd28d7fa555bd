/* SPDX-License-Identifier: MIT */
/* quant.h — bit-exact BF16 and FP8 (E4M3) emulation, and block quantisation.
 *
 * Pure C, no MPI. Values stay in fp32 buffers; "rounding to bf16" means
 * replacing each value by the nearest bf16 value, so the arithmetic around
 * it (fp32 accumulation, as GPU tensor cores do) is unchanged.
 *
 * BF16: the top 16 bits of an fp32, rounded to nearest even; Inf stays Inf,
 *       NaN stays a (quiet) NaN, overflow past the largest bf16 gives Inf.
 * E4M3 (OCP FP8 E4M3FN): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
 *       Inf; 0x7F/0xFF are NaN; the largest finite value is 448, the
 *       smallest subnormal 2^-9. Conversion rounds to nearest even and
 *       saturates to +-448 (as DeepEP and the usual quantisation kernels do).
 */
#ifndef MOE_QUANT_H
#define MOE_QUANT_H

#include <stdbool.h>
#include <stdint.h>

#include "moe/config.h"
#include "moe/dims.h"

#define MOE_FP8_BLOCK 128 /* values per FP8 scale, along a row */
#define MOE_E4M3_MAX 448.0f

uint16_t moe_f32_to_bf16(float x);
float moe_bf16_to_f32(uint16_t h);
static inline float moe_round_bf16(float x) { return moe_bf16_to_f32(moe_f32_to_bf16(x)); }

uint8_t moe_f32_to_e4m3(float x);
float moe_e4m3_to_f32(uint8_t q);

/* v (n) = the nearest bf16 values, in place. */
void moe_round_bf16_array(float *v, moe_index n);

/* One bf16 step at v: the distance from |v| to the next bf16 value away from
 * zero, 2^(e-7) for |v| in [2^e, 2^(e+1)) (8 significant bits); 0 at 0.
 * The allowance of one bf16 rounding (truth.h, golden.h). */
double moe_bf16_step(double v);

/* How a block of 128 values becomes E4M3 values q and a dequantisation
 * scale s (value = e4m3(q) * s), each recipe as its code does it, in fp32,
 * amax = max |x| over the block, fl() one fp32 rounding:
 *   moe       s = amax / 448 (1 when amax is 0);       q = e4m3(x / s)
 *   deepep    a = max(amax, 1e-4):  s = a * fl(1/448); q = e4m3(x * fl(448 / a))
 *             (DeepEP's calculate_fp8_scales, the scale its kernels send)
 *   deepgemm  a = max(amax, 1e-4):  s = a / 448;       q = e4m3(x * fl(1 / s))
 *             (DeepGEMM's per_token_cast_to_fp8)
 *   v3        a = max(amax, 1e-4):  s = a / 448;       q = e4m3(x / s)
 *             (DeepSeek-V3's act_quant)
 * With pow2 (UE8M0 scales) s becomes the smallest power of two >= the s
 * above (for moe at least 2^-126, the smallest a UE8M0 byte carries as a
 * normal float: wire.h) and x is multiplied by 1/s (deepep, deepgemm) or divided by s (moe,
 * v3) — exact either way. e4m3() rounds to nearest even and saturates at
 * ±448 (NaN stays NaN). */
typedef struct {
    enum moe_fp8_recipe recipe;
    bool pow2;
} moe_fp8_format;

/* One row of `width` values quantised to E4M3 in blocks of 128 as fmt says:
 * q (width) and scales (ceil(width/128)) receive the result; dequantised
 * (width), when not NULL, e4m3(q) * s. */
void moe_quantize_e4m3_row(const float *x, moe_index width, moe_fp8_format fmt, uint8_t *q,
                           float *scales, float *dequantised);

/* The number of scales of a row of width values. */
static inline moe_index moe_fp8_blocks(moe_index width)
{
    return (width + MOE_FP8_BLOCK - 1) / MOE_FP8_BLOCK;
}

/* The precision a run emulates (config.h: --dtype, --dispatch-dtype,
 * --combine-dtype, --fp8-scale), applied at the same points by the EP path
 * and the dense truth. */
/* w (n): the gate's weights and the layer's input tokens rounded to
 * --dtype (fp8: bf16, as DeepSeek-V3 keeps its gate and activations). */
void moe_precision_weights(int dtype, float *w, moe_index n);

/* m (rows, cols) as E4M3 in blocks of 128 x 128 (partial at the edges), one
 * scale a block: amax/448, the smallest power of two at least that when
 * pow2 (UE8M0), 1 for a block of zeros; each value becomes e4m3(w / s) * s
 * in fp32, the weight a port dequantises. */
void moe_fp8_block_weights(float *m, moe_index rows, moe_index cols, bool pow2);

/* The same, the E4M3 bytes into q (rows, cols) and each block's scale into
 * scales (ceil(rows/128), ceil(cols/128)), row-major, when not NULL. */
void moe_fp8_block_quantize(float *m, moe_index rows, moe_index cols, bool pow2, uint8_t *q,
                            float *scales);

/* An expert's W1 (2f, d) and W2 (d, f) in --dtype fp8's blocks (below), in
 * place, with the bytes q1 (2f, d), q2 (d, f) and the scales s1
 * (2 ceil(f/128), ceil(d/128): the gate projection's block rows, then the
 * up projection's), s2 (ceil(d/128), ceil(f/128)) when not NULL. */
void moe_fp8_expert_blocks(float *w1, float *w2, moe_index hidden, moe_index ffn, bool pow2,
                           uint8_t *q1, float *s1, uint8_t *q2, float *s2);

/* An expert's W1 (2f, d) and W2 (d, f) rounded to --dtype: each value to
 * bf16, or (fp8) DeepSeek-V3's checkpoint: the gate projection (rows 0..f-1
 * of W1), the up projection (rows f..2f-1) and W2 each in 128 x 128 blocks
 * (moe_fp8_block_weights, pow2: --fp8-scale ue8m0). */
void moe_precision_expert(int dtype, bool pow2, float *w1, float *w2, moe_index hidden, moe_index ffn);

/* out (T, d) = the rows of x (T, d) as a rank receives them after
 * --dispatch-dtype quantisation (fp8: E4M3 with one scale per 128 values of
 * a row, dequantised; bf16: rounded). */
void moe_precision_dispatch(int dispatch_dtype, moe_fp8_format fp8, const float *x,
                            moe_index tokens, moe_index hidden, float *out);

/* rows (n) rounded to --combine-dtype before they travel back. */
void moe_precision_combine(int combine_dtype, float *rows, moe_index n);

#endif
