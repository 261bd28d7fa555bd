/* SPDX-License-Identifier: MIT */
/* lanes8.h — 8- and 16-lane fp32 helpers of the SwiGLU, forward and backward.
 *
 * Private to src/core. Every operation is one IEEE single-precision
 * operation per lane (the build has -ffp-contract=off), so the bits do not
 * depend on the machine or the vector width: exp16 and swiglu16 give, lane
 * for lane, exp8's and swiglu8's bits. Include only from files that
 * compile the 8-lane callers with target_clones("avx2", "default"); call
 * the 16-lane helpers only from functions built for avx512f.
 */
#ifndef MOE_LANES8_H
#define MOE_LANES8_H

#include <math.h>
#include <stdint.h>

typedef float lanes8 __attribute__((vector_size(32)));
typedef float lanes16 __attribute__((vector_size(64)));
/* The helpers below pass vectors by value. They are always inlined: a
 * call from the avx2 clone to a helper compiled for the default target
 * would pass the vectors in a different way than the helper expects.
 * (GCC's note at each definition that this ABI changed in 4.6 is beyond
 * the pragma's reach: configure adds -Wno-psabi for the library.) */
#pragma GCC diagnostic ignored "-Wpsabi"
#define LANES_INLINE static inline __attribute__((always_inline))
typedef float lanes8_unaligned __attribute__((vector_size(32), aligned(4), may_alias));
typedef float lanes16_unaligned __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t ints8 __attribute__((vector_size(32)));
typedef int32_t ints16 __attribute__((vector_size(64)));

/* For N lanes: selectN(mask, yes, no); expN(x), e^x in fp32 as
 * moe_exp_fp32 specifies (experts.h); swigluN(gate, up), silu(gate) * up. */
#define LANES_HELPERS(N)                                                                    \
    LANES_INLINE lanes##N select##N(ints##N mask, lanes##N yes, lanes##N no)                \
    {                                                                                       \
        return (lanes##N)((mask & (ints##N)yes) | (~mask & (ints##N)no));                   \
    }                                                                                       \
                                                                                            \
    LANES_INLINE lanes##N exp##N(lanes##N x)                                                \
    {                                                                                       \
        const float hi = 88.7228317f, lo = -87.3365402f; /* e^x finite and normal between */ \
        const float shifter = 12582912.0f;                 /* 1.5 * 2^23 */                 \
        const ints##N over = x > hi, under = x < lo;                                        \
        lanes##N xc = select##N(over, (lanes##N){0} + hi, x);                               \
        xc = select##N(under, (lanes##N){0} + lo, xc);                                      \
        const lanes##N t = xc * 1.44269504f + shifter; /* round(xc / ln 2) in the low bits */ \
        const lanes##N n = t - shifter;                                                     \
        const ints##N k = (ints##N)t - 0x4b400000; /* n as an integer */                    \
        const lanes##N r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;                   \
        lanes##N p = (lanes##N){0} + 1.0f / 5040.0f;                                        \
        p = p * r + 1.0f / 720.0f;                                                          \
        p = p * r + 1.0f / 120.0f;                                                          \
        p = p * r + 1.0f / 24.0f;                                                           \
        p = p * r + 1.0f / 6.0f;                                                            \
        p = p * r + 0.5f;                                                                   \
        p = p * r + 1.0f;                                                                   \
        p = p * r + 1.0f;                                                                   \
        const ints##N k1 = k / 2, k2 = k - k1; /* 2^k = 2^k1 * 2^k2, each normal */         \
        const lanes##N e = p * (lanes##N)((k1 + 127) << 23) * (lanes##N)((k2 + 127) << 23); \
        return select##N(over, (lanes##N){0} + INFINITY, select##N(under, (lanes##N){0}, e)); \
    }                                                                                       \
                                                                                            \
    LANES_INLINE lanes##N swiglu##N(lanes##N gate, lanes##N up)                             \
    {                                                                                       \
        return gate / (1.0f + exp##N(-gate)) * up;                                          \
    }
LANES_HELPERS(8)
LANES_HELPERS(16)
#undef LANES_HELPERS

#endif
