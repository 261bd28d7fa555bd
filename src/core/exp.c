/* SPDX-License-Identifier: MIT */
/* exp.c — the specified fp64 exponential (see exp.h). */
#include "moe/exp.h"

#include <math.h>
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

double moe_exp_fp64(double x)
{
    const double hi = 709.782712893384, lo = -708.3964185322641;
    if (x != x)
        return x;
    if (x > hi)
        return INFINITY;
    if (x < lo)
        return 0.0;
    const double shifter = 0x1.8p52;
    const double n = (x * 1.4426950408889634 + shifter) - shifter;
    const double r = (x - n * 0x1.62e42feep-1) - n * 0x1.a39ef35793c76p-33;
    /* 1/m! for m = 13 down to 2, each the double nearest to 1/m! (the
     * compiler rounds the constant quotient correctly; m! is exact) */
    static const double inverse_factorial[] = {
        1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
        1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0,
        1.0 / 6.0, 1.0 / 2.0,
    };
    double p = inverse_factorial[0];
    for (int m = 1; m < (int)(sizeof inverse_factorial / sizeof *inverse_factorial); m++)
        p = p * r + inverse_factorial[m];
    p = p * r + 1.0;
    p = p * r + 1.0;
    const int64_t k = (int64_t)n, k1 = k / 2, k2 = k - k1;
    return p * power_of_two(k1) * power_of_two(k2);
}
