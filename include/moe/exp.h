/* SPDX-License-Identifier: MIT */
/* exp.h — e^x in fp64, specified to the bit.
 *
 * The router's softmax and sigmoid and the dense truth's SwiGLU call this
 * rather than the C library's exp, whose last bit depends on the library's
 * version and on the instruction set it picked at load time (glibc has FMA
 * variants): a golden set must come out with the same bytes on every machine.
 * The fp32 exponential of the EP path is moe_exp_fp32 (experts.h).
 *
 * Pure; every step one IEEE double operation, round to nearest, no fused
 * multiply-add (the build passes -ffp-contract=off).
 */
#ifndef MOE_EXP_H
#define MOE_EXP_H

/* e^x in fp64:
 *   x > 709.782712893384:    +inf     (ln DBL_MAX)
 *   x < -708.3964185322641:  0        (ln DBL_MIN: results stay normal)
 *   n = (x * 1.4426950408889634 + 1.5*2^52) - 1.5*2^52         round(x / ln 2)
 *   r = (x - n * 0x1.62e42feep-1) - n * 0x1.a39ef35793c76p-33  ln 2 in two parts;
 *       the first has 32 significant bits, so n times it is exact
 *   p = Horner, from the top, of 1/13!, 1/12!, ..., 1/2!, 1, 1
 *       (the Taylor series of e^r to degree 13, each coefficient rounded
 *       to the nearest double of 1.0 / m!, with m! exact)
 *   e^x = p * 2^(n/2) * 2^(n - n/2)                            n/2 truncated
 * NaN gives NaN. Within 2 ulp of e^x over the range (tested). */
double moe_exp_fp64(double x);

/* y[i] = moe_exp_fp64(x[i]) for i < n, bit for bit, eight lanes at a time
 * (y may be x). */
void moe_exp_fp64_n(const double *x, double *y, long n);

#endif
