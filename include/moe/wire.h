/* SPDX-License-Identifier: MIT */
/* wire.h — the bytes a row puts on the wire: the one definition that the
 * all-to-alls send, and that the traffic figures, the link model, bench's
 * all-to-all anchor and `moe-ep plan` count.
 *
 * A dispatched row is its d values as --dispatch-dtype, then its meta (the
 * top-k ids as int16, gate weights and token id, MOE_META_WORDS(k) int32
 * words, layout.h), sent as a second message of the same rows:
 *   fp32  4d bytes
 *   bf16  2d bytes (the top half of each fp32, rounded to nearest even)
 *   fp8   d E4M3 bytes, then ceil(d/128) scales: fp32 (4 bytes each), or
 *         with --fp8-scale ue8m0 one byte each, the biased exponent of the
 *         power-of-two scale (2^(e-127), as DeepGEMM's UE8M0)
 * An expert output on its way back is d values as --combine-dtype (fp32 or
 * bf16). Decoding a row gives exactly the values the dense truth's
 * emulation gives (quant.h): E4M3 byte times its scale in fp32, or the bf16
 * value. Pure: no MPI.
 */
#ifndef MOE_WIRE_H
#define MOE_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "moe/config.h"
#include "moe/dims.h"
#include "moe/quant.h"

typedef struct {
    int dtype;            /* MOE_DTYPE_* of the values */
    moe_fp8_format fp8;   /* fp8: the recipe and whether scales are UE8M0 */
    moe_index hidden;     /* d */
    size_t scale_bytes;   /* fp8: bytes of one scale (4, or 1 for UE8M0); else 0 */
    size_t bytes;         /* one row's values (and scales) */
} moe_wire;

/* The formats of a run's dispatched rows and expert outputs. */
moe_wire moe_wire_dispatch(const moe_config *cfg);
moe_wire moe_wire_combine(const moe_config *cfg);

/* rows rows of x (rows, d) as the wire carries them, into out (rows, bytes);
 * with row_index not NULL, row i is x's row row_index[i] (a gather). */
void moe_wire_encode(const moe_wire *w, const float *x, const moe_index *row_index, moe_index rows,
                     uint8_t *out);

/* rows wire rows of in back to values, out (rows, d). */
void moe_wire_decode(const moe_wire *w, const uint8_t *in, moe_index rows, float *out);

/* fp8: the block scales of rows wire rows as fp32, scales (rows,
 * ceil(d/128)) (UE8M0 ones as the powers of two they stand for). */
void moe_wire_scales(const moe_wire *w, const uint8_t *in, moe_index rows, float *scales);

/* Bytes one dispatched row (values and meta) and one expert output put on
 * the wire. */
double moe_dispatch_row_bytes(const moe_config *cfg);
double moe_combine_row_bytes(const moe_config *cfg);

/* Bytes one (token, expert) pair puts on the wire in a backward (the
 * forward's mirror, docs/backward.md): its dy row out as the dispatch's
 * values (--dispatch-dtype, with its scales, without the meta the experts
 * kept), its dx row home as --combine-dtype (as DeepSeek-V3 sends the
 * gradient before the down-projection in FP8, the backward combine in
 * BF16), and its dL/dweight, one fp32. The
 * deduplicated backward sends one dy row per (token, rank), as the dispatch
 * sends x, and with --combine reduced one dx row per (token, rank) too. */
double moe_backward_pair_bytes(const moe_config *cfg);

/* --mode low-latency (ep_ll.c): the meta of a pair's row (its local token,
 * its slot, its gate weight), and the bytes of the fixed buffers a rank
 * holds in its MPI window: per local expert (the fullest rank's,
 * ceil(E/G)) a slot for N = --max-tokens-per-rank tokens of every rank,
 * each a dispatched row, its meta and an output; the N k rows it stages to
 * send, with their meta, and the N k outputs that come home; the tables. */
#define MOE_LL_META_WORDS 3
double moe_ll_buffer_bytes(const moe_config *cfg, int ranks);
/* Bytes of one pair's dispatched row in that mode: values, then its meta. */
double moe_ll_row_bytes(const moe_config *cfg);

/* --mode low-latency and --max-tokens-per-rank: the buffers hold at least
 * --tokens; the decode forward runs alone (no backward, two-stage
 * dispatch, trace, timeline or dump). MOE_EXIT_OK or MOE_EXIT_USAGE with
 * st set. */
int moe_ll_validate(const moe_config *cfg, moe_status *st);

/* Bytes the low-latency mode adds on a rank: its window (moe_ll_buffer_bytes),
 * its experts' decoded batch and activations, the shared experts' outputs
 * kept apart. */
double moe_ll_memory(const moe_config *cfg, int ranks);

/* x (rows, d) as a rank receives it: rounded to --dispatch-dtype (and back
 * to fp32) into scratch (rows, d), or x itself for fp32. */
const float *moe_wire_dispatched(const moe_config *cfg, const float *x, moe_index rows,
                                 float *scratch);

#endif
