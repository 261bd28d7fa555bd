/* SPDX-License-Identifier: MIT */
/* exp.c — the specified fp64 exponential (see exp.h). */
#include "moe/exp.h"

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

/* 2^e as a double, for -1022 <= e <= 1023. */
static double power_of_two(int64_t e)
{
    const uint64_t bits = (uint64_t)(e + 1023) << 52;
    double v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* The constants of exp.h, shared by the one-value and the lane forms. */
#define EXP_HI 709.782712893384
#define EXP_LO -708.3964185322641
#define EXP_SHIFTER 0x1.8p52
#define EXP_LOG2E 1.4426950408889634
#define EXP_LN2_HI 0x1.62e42feep-1
#define EXP_LN2_LO 0x1.a39ef35793c76p-33
/* 1/m! for m = 13 down to 2, each the double nearest to 1/m! (the compiler
 * rounds the constant quotient correctly; m! is exact) */
static const double inverse_factorial[] = {
    1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
    1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0,
    1.0 / 6.0, 1.0 / 2.0,
};
enum { TERMS = sizeof inverse_factorial / sizeof *inverse_factorial };

double moe_exp_fp64(double x)
{
    if (x != x)
        return x;
    if (x > EXP_HI)
        return INFINITY;
    if (x < EXP_LO)
        return 0.0;
    const double n = (x * EXP_LOG2E + EXP_SHIFTER) - EXP_SHIFTER;
    const double r = (x - n * EXP_LN2_HI) - n * EXP_LN2_LO;
    double p = inverse_factorial[0];
    for (int m = 1; m < TERMS; m++)
        p = p * r + inverse_factorial[m];
    p = p * r + 1.0;
    p = p * r + 1.0;
    const int64_t k = (int64_t)n, k1 = k / 2, k2 = k - k1;
    return p * power_of_two(k1) * power_of_two(k2);
}

/* Eight lanes of the same operations: the compiler lowers each vector
 * operation to the IEEE operation in every lane (SSE2 pairs, AVX or
 * AVX-512 registers by clone), and the build fuses none, so a lane's bits
 * are moe_exp_fp64's. The vectors go in and out through memory, never as
 * arguments: clang refuses 512-bit vector arguments outside avx512f. */
typedef double exp_lanes __attribute__((vector_size(64)));
typedef int64_t exp_ints __attribute__((vector_size(64)));
typedef uint64_t exp_bits __attribute__((vector_size(64)));
enum { LANES = 8 };

/* Whether moe_exp_fp64 computes x (neither NaN nor out of range). */
static inline bool regular(double x) { return x >= EXP_LO && x <= EXP_HI; }

static inline __attribute__((always_inline)) void exp_of_lanes(const double *in, double *out)
{
    /* The special lanes compute e^0 and are replaced at the end. The lanes
     * are sorted one double at a time (a loop the compiler vectorizes with
     * its own masks), not as vectors of int64 masks: with AVX-512F alone
     * those took lane-by-lane moves, as did a vector conversion of n to
     * int64 (AVX-512DQ), together three quarters of the function's time. */
    double x[LANES], regular_in[LANES]; /* x: in may be out */
    memcpy(x, in, sizeof x);
    for (int l = 0; l < LANES; l++)
        regular_in[l] = regular(x[l]) ? x[l] : 0.0;
    exp_lanes y;
    memcpy(&y, regular_in, sizeof y);
    const exp_lanes zero = {0};
    const exp_lanes shifted = y * EXP_LOG2E + EXP_SHIFTER, n = shifted - EXP_SHIFTER;
    const exp_lanes r = (y - n * EXP_LN2_HI) - n * EXP_LN2_LO;
    exp_lanes p = zero + inverse_factorial[0];
    for (int m = 1; m < TERMS; m++)
        p = p * r + inverse_factorial[m];
    p = p * r + 1.0;
    p = p * r + 1.0;
    /* k = n as an integer: shifted is 1.5 * 2^52 + n exactly (|n| <= 1025),
     * so its bits less the shifter's are n */
    const exp_ints k = (exp_ints)shifted - (exp_ints)(zero + EXP_SHIFTER), k1 = k / 2, k2 = k - k1;
    const exp_lanes two_k1 = (exp_lanes)((exp_bits)(k1 + 1023) << 52);
    const exp_lanes two_k2 = (exp_lanes)((exp_bits)(k2 + 1023) << 52);
    const exp_lanes e = p * two_k1 * two_k2;
    memcpy(out, &e, sizeof e);
    /* NaN lanes keep x, overflowing ones +inf, underflowing ones 0 */
    for (int l = 0; l < LANES; l++)
        if (!regular(x[l]))
            out[l] = x[l] != x[l] ? x[l] : x[l] > EXP_HI ? INFINITY : 0.0;
}

__attribute__((target_clones("avx512f", "avx2", "default")))
static void exp_n(const double *x, double *y, long n)
{
    long i = 0;
    for (; i + LANES <= n; i += LANES)
        exp_of_lanes(x + i, y + i);
    if (i < n) { /* the tail, padded with zeros */
        double tail[LANES] = {0};
        memcpy(tail, x + i, sizeof(double) * (size_t)(n - i));
        exp_of_lanes(tail, tail);
        memcpy(y + i, tail, sizeof(double) * (size_t)(n - i));
    }
}

/* The clones stay static behind this function: clang 14 (which builds the
 * fuzzers) names an exported clone's resolver apart from the function, so
 * calls from other files would not link. */
void moe_exp_fp64_n(const double *x, double *y, long n) { exp_n(x, y, n); }
