/* SPDX-License-Identifier: MIT */
/* quant.c — BF16 and FP8 E4M3 conversions and block quantisation (see quant.h). */
#include "moe/quant.h"

#include "moe/common.h"
#include "moe/config.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static inline uint32_t bits_of(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static inline float float_of(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

uint16_t moe_f32_to_bf16(float x)
{
    uint32_t u = bits_of(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep the sign, make it quiet */
        return (uint16_t)((u >> 16) | 0x0040u);
    /* Round to nearest even on the 16 dropped bits; a carry into the
     * exponent rounds up to the next binade, or to Inf past the largest. */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float moe_bf16_to_f32(uint16_t h) { return float_of((uint32_t)h << 16); }

double moe_bf16_step(double v)
{
    if (v == 0.0 || !isfinite(v))
        return 0.0;
    int e;
    frexp(v, &e);
    return ldexp(1.0, e - 8); /* v in [2^(e-1), 2^e) */
}

void moe_round_bf16_array(float *v, moe_index n)
{
    for (moe_index m = 0; m < n; m++)
        v[m] = moe_round_bf16(v[m]);
}

float moe_e4m3_to_f32(uint8_t q)
{
    const int sign = q >> 7, exponent = (q >> 3) & 0xf, mantissa = q & 7;
    float v;
    if (exponent == 0xf && mantissa == 7)
        return NAN;
    if (exponent == 0)
        v = ldexpf((float)mantissa, -9); /* subnormal: m * 2^-3 * 2^-6 */
    else
        v = ldexpf((float)(8 + mantissa), exponent - 7 - 3);
    return sign ? -v : v;
}

uint8_t moe_f32_to_e4m3(float x)
{
    const uint8_t sign = signbit(x) ? 0x80 : 0x00;
    if (isnan(x))
        return 0x7f | sign;
    float a = fabsf(x);
    if (a >= MOE_E4M3_MAX) /* saturate, Inf included */
        return sign | 0x7e;
    /* Scale so that the representable neighbours are consecutive integers:
     * in the binade [2^e, 2^(e+1)) values are multiples of 2^(e-3); below
     * 2^-6 (subnormal) multiples of 2^-9. Round to nearest even there. */
    int e;
    frexpf(a, &e);      /* a = f * 2^e, f in [0.5, 1): binade 2^(e-1) */
    int binade = e - 1; /* a in [2^binade, 2^(binade+1)) */
    if (binade < -6)
        binade = -6;
    const int shift = binade - 3; /* quantum 2^shift */
    float units = ldexpf(a, -shift);
    float rounded = nearbyintf(units); /* default rounding mode: to nearest even */
    float value = ldexpf(rounded, shift);
    if (value >= MOE_E4M3_MAX)
        return sign | 0x7e;
    if (value == 0.0f)
        return sign;
    /* Encode value = (8 + m) * 2^(E - 10) or m * 2^-9. */
    int ve;
    frexpf(value, &ve);
    const int exponent = ve - 1 + 7;
    if (exponent <= 0)
        return sign | (uint8_t)(int)ldexpf(value, 9);
    const int mantissa = (int)ldexpf(value, -(ve - 1) + 3) - 8;
    return sign | (uint8_t)(exponent << 3) | (uint8_t)mantissa;
}

/* The smallest power of two >= s (s > 0, normal). */
static float pow2_at_least(float s)
{
    int e;
    const float f = frexpf(s, &e); /* s = f 2^e, f in [0.5, 1) */
    return ldexpf(1.0f, f == 0.5f ? e - 1 : e);
}

void moe_quantize_e4m3_row(const float *x, moe_index width, moe_fp8_format fmt, uint8_t *q,
                           float *scales, float *dequantised)
{
    const float max = MOE_E4M3_MAX, margin = 1e-4f;
    for (moe_index b = 0; b * MOE_FP8_BLOCK < width; b++) {
        const moe_index first = b * MOE_FP8_BLOCK;
        const moe_index end = first + MOE_FP8_BLOCK < width ? first + MOE_FP8_BLOCK : width;
        float amax = 0.0f;
        for (moe_index j = first; j < end; j++)
            amax = fmaxf(amax, fabsf(x[j]));
        const bool finite = isfinite(amax);
        float scale, multiplier = 0.0f; /* multiplier 0: divide by scale */
        if (fmt.recipe == MOE_FP8_RECIPE_MOE) {
            scale = amax > 0.0f && finite ? amax / max : 1.0f;
            if (fmt.pow2 && amax > 0.0f && finite) /* a normal power of two: one UE8M0 byte */
                scale = fmaxf(pow2_at_least(scale), 0x1p-126f);
        } else {
            const float a = fmaxf(amax, margin);
            if (fmt.recipe == MOE_FP8_RECIPE_DEEPEP) {
                scale = a * (1.0f / max);
                multiplier = max / a;
            } else {
                scale = a / max;
                if (fmt.recipe == MOE_FP8_RECIPE_DEEPGEMM)
                    multiplier = 1.0f / scale;
            }
            if (fmt.pow2 && finite) {
                scale = pow2_at_least(scale);
                multiplier = fmt.recipe == MOE_FP8_RECIPE_V3 ? 0.0f : 1.0f / scale; /* exact */
            }
        }
        scales[b] = scale;
        for (moe_index j = first; j < end; j++) {
            q[j] = moe_f32_to_e4m3(multiplier != 0.0f ? x[j] * multiplier : x[j] / scale);
            if (dequantised)
                dequantised[j] = moe_e4m3_to_f32(q[j]) * scale;
        }
    }
}

void moe_precision_weights(int dtype, float *w, moe_index n)
{
    if (dtype == MOE_DTYPE_BF16 || dtype == MOE_DTYPE_FP8)
        moe_round_bf16_array(w, n);
}

void moe_fp8_block_quantize(float *m, moe_index rows, moe_index cols, bool pow2, uint8_t *q,
                            float *scales)
{
    const moe_index blocks = moe_fp8_blocks(cols);
    for (moe_index r0 = 0; r0 < rows; r0 += MOE_FP8_BLOCK)
        for (moe_index c0 = 0; c0 < cols; c0 += MOE_FP8_BLOCK) {
            const moe_index r1 = r0 + MOE_FP8_BLOCK < rows ? r0 + MOE_FP8_BLOCK : rows;
            const moe_index c1 = c0 + MOE_FP8_BLOCK < cols ? c0 + MOE_FP8_BLOCK : cols;
            float amax = 0.0f;
            for (moe_index r = r0; r < r1; r++)
                for (moe_index c = c0; c < c1; c++)
                    amax = fmaxf(amax, fabsf(m[r * cols + c]));
            float scale = amax > 0.0f ? amax / MOE_E4M3_MAX : 1.0f;
            if (pow2 && amax > 0.0f)
                scale = fmaxf(pow2_at_least(scale), 0x1p-126f);
            if (scales)
                scales[r0 / MOE_FP8_BLOCK * blocks + c0 / MOE_FP8_BLOCK] = scale;
            for (moe_index r = r0; r < r1; r++)
                for (moe_index c = c0; c < c1; c++) {
                    float *w = &m[r * cols + c];
                    const uint8_t byte = moe_f32_to_e4m3(*w / scale);
                    if (q)
                        q[r * cols + c] = byte;
                    *w = moe_e4m3_to_f32(byte) * scale;
                }
        }
}

void moe_fp8_block_weights(float *m, moe_index rows, moe_index cols, bool pow2)
{
    moe_fp8_block_quantize(m, rows, cols, pow2, NULL, NULL);
}

void moe_fp8_expert_blocks(float *w1, float *w2, moe_index hidden, moe_index ffn, bool pow2,
                           uint8_t *q1, float *s1, uint8_t *q2, float *s2)
{
    const moe_index half = moe_fp8_blocks(ffn) * moe_fp8_blocks(hidden); /* scales of a projection */
    moe_fp8_block_quantize(w1, ffn, hidden, pow2, q1, s1);                /* gate projection */
    moe_fp8_block_quantize(w1 + ffn * hidden, ffn, hidden, pow2, q1 ? q1 + ffn * hidden : NULL,
                           s1 ? s1 + half : NULL); /* up projection */
    moe_fp8_block_quantize(w2, hidden, ffn, pow2, q2, s2);
}

void moe_precision_expert(int dtype, bool pow2, float *w1, float *w2, moe_index hidden, moe_index ffn)
{
    if (dtype != MOE_DTYPE_FP8) {
        moe_precision_weights(dtype, w1, 2 * ffn * hidden);
        moe_precision_weights(dtype, w2, hidden * ffn);
        return;
    }
    moe_fp8_expert_blocks(w1, w2, hidden, ffn, pow2, NULL, NULL, NULL, NULL);
}

void moe_precision_dispatch(int dispatch_dtype, moe_fp8_format fp8, const float *x,
                            moe_index tokens, moe_index hidden, float *out)
{
    if (dispatch_dtype == MOE_DTYPE_FP8) {
        const moe_index blocks = moe_fp8_blocks(hidden), slots = moe_thread_slots();
        uint8_t *q_all = moe_xmalloc((size_t)(hidden * slots));
        float *scales_all = moe_xmalloc(sizeof(float) * (size_t)(blocks * slots));
#pragma omp parallel
        {
            uint8_t *q = q_all + moe_thread_slot() * hidden;
            float *scales = scales_all + moe_thread_slot() * blocks;
#pragma omp for schedule(static)
            for (moe_index i = 0; i < tokens; i++)
                moe_quantize_e4m3_row(x + i * hidden, hidden, fp8, q, scales, out + i * hidden);
        }
        free(scales_all);
        free(q_all);
        return;
    }
    memcpy(out, x, sizeof(float) * (size_t)(tokens * hidden));
    if (dispatch_dtype == MOE_DTYPE_BF16)
        moe_round_bf16_array(out, tokens * hidden);
}

void moe_precision_combine(int combine_dtype, float *rows, moe_index n)
{
    if (combine_dtype == MOE_DTYPE_BF16)
        moe_round_bf16_array(rows, n);
}
