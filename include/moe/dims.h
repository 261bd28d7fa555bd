/* SPDX-License-Identifier: MIT */
/* dims.h — the one dimension legend of moe-ep.
 *
 * Every buffer in the code carries a shape comment written with these letters,
 * e.g. `float *x; // (T, d)`. This header defines no code beyond the index types.
 *
 *   G   ranks (one rank plays one GPU)          r   a rank, 0 <= r < G
 *   T   tokens per rank                         i   a local token, 0 <= i < T
 *                                               global token id = r*T + i
 *   d   hidden size (token width)               j   a hidden index
 *   f   FFN (intermediate) size of one expert; W1 is (2f, d): rows [0, f) are the
 *       gate half, rows [f, 2f) the up half; W2 is (d, f)
 *   E   routed experts                          e   a global expert id
 *   EL  experts held by one rank (E/G, +1 on the first E%G ranks)
 *   k   experts per token (top-k)               s   a top-k slot, 0 <= s < k
 *   S   shared experts (applied to every token on its home rank)
 *   W   waves (pipelined groups of expert slots)
 *
 * A "row" is one token's d values. A "pair" is one (row, expert) the row must
 * visit: a token sent once to a rank (dedup) may make several pairs there.
 */
#ifndef MOE_DIMS_H
#define MOE_DIMS_H

#include <stdint.h>

typedef int64_t moe_index; /* sizes and offsets: T*G*k*d overflows 32 bits */

#endif
