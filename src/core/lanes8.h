/* SPDX-License-Identifier: MIT */
/* lanes8.h — 8-lane fp32 helpers of the SwiGLU, forward and backward.
 *
 * Private to src/core. Every operation is one IEEE single-precision
 * operation per lane (the build has -ffp-contract=off), so the bits do not
 * depend on the machine or the vector width. Include only from files that
 * compile the callers with target_clones("avx2", "default").
 */
#ifndef MOE_LANES8_H
#define MOE_LANES8_H

#include <math.h>
#include <stdint.h>

typedef float lanes8 __attribute__((vector_size(32)));
/* The helpers below pass 8-lane vectors by value. They are always inlined:
 * a call from the avx2 clone to a helper compiled for the default target
 * would pass the vectors in a different way than the helper expects. */
#pragma GCC diagnostic ignored "-Wpsabi"
#define LANES_INLINE static inline __attribute__((always_inline))
typedef float lanes8_unaligned __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t ints8 __attribute__((vector_size(32)));

LANES_INLINE lanes8 select8(ints8 mask, lanes8 yes, lanes8 no)
{
    return (lanes8)((mask & (ints8)yes) | (~mask & (ints8)no));
}

/* e^x in fp32 on 8 lanes, as moe_exp_fp32 specifies (experts.h). */
LANES_INLINE lanes8 exp8(lanes8 x)
{
    const float hi = 88.7228317f, lo = -87.3365402f; /* e^x finite and normal between */
    const float shifter = 12582912.0f;                 /* 1.5 * 2^23 */
    const ints8 over = x > hi, under = x < lo;
    lanes8 xc = select8(over, (lanes8){0} + hi, x);
    xc = select8(under, (lanes8){0} + lo, xc);
    const lanes8 t = xc * 1.44269504f + shifter; /* round(xc / ln 2) in the low bits */
    const lanes8 n = t - shifter;
    const ints8 k = (ints8)t - 0x4b400000; /* n as an integer */
    const lanes8 r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
    lanes8 p = (lanes8){0} + 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const ints8 k1 = k / 2, k2 = k - k1; /* 2^k = 2^k1 * 2^k2, each normal */
    const lanes8 e = p * (lanes8)((k1 + 127) << 23) * (lanes8)((k2 + 127) << 23);
    return select8(over, (lanes8){0} + INFINITY, select8(under, (lanes8){0}, e));
}


/* silu(gate) * up on 8 lanes. */
LANES_INLINE lanes8 swiglu8(lanes8 gate, lanes8 up)
{
    return gate / (1.0f + exp8(-gate)) * up;
}

#endif
