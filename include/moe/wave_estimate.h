/* SPDX-License-Identifier: MIT */
/* wave_estimate.h — which grouping of waves is faster for a forward's
 * traffic on the emulated links: the two-resource estimate behind
 * `--wave-by auto` under `--link` (docs/waves.md, "Choosing the grouping").
 *
 * Expert slots keep every expert's rows in one batch but send a token once
 * per wave holding one of its experts on a rank; token chunks send each
 * token once per rank, as one wave does, but split every expert's rows W
 * ways. Which costs less depends on the link (the extra rows) and on the
 * GEMMs (the smaller batches), so the estimate weighs the rows each would
 * send, under uniform routing, against expert times measured at the batch
 * sizes each would run. It is an estimate of a forward, not a simulation:
 * the links as link.h schedules them, the GEMMs as one measured figure per
 * grouping. Pure: no MPI, no clock.
 */
#ifndef MOE_WAVE_ESTIMATE_H
#define MOE_WAVE_ESTIMATE_H

#include <stdbool.h>

#include "moe/dims.h"
#include "moe/layout.h"
#include "moe/link.h"

/* What a forward of one rank's traffic gives the estimate. */
typedef struct {
    const moe_placement *placement; /* G ranks, E experts (the physical slots) */
    const moe_link *link;           /* bandwidths set (cb=RATIO calibrated) */
    moe_index tokens;               /* T per rank */
    int topk;                       /* k */
    int waves;                      /* W >= 1 */
    bool reduced;                   /* --combine reduced: a token's sum on a rank goes
                                       back once, in the last wave holding one of its
                                       experts there; false: one row per pair */
    double dispatch_row_bytes;      /* a dispatched row on the wire, meta included */
    double combine_row_bytes;       /* a combined row on the wire */
    double compute_whole;           /* seconds of a rank's experts at whole batches
                                       (T G k / E rows each): one wave, expert slots */
    double compute_chunked;         /* the same split into W token chunks */
    double compute_shared;          /* seconds of its shared experts: they run in the
                                       waits (the first dispatch's, the last
                                       combine's), never beside a routed expert */
} moe_wave_traffic;

/* The estimate of one grouping, for the rank it is longest on. */
typedef struct {
    double rows;    /* dispatch rows that rank sends to other ranks */
    double comm;    /* seconds its busiest link is busy with the forward's all-to-alls */
    double compute; /* seconds of its experts */
    double shared;  /* seconds of its shared experts (compute_shared) */
    double head;    /* the first wave's dispatch: nothing to compute before it lands */
    double tail;    /* the last wave's combine: nothing left to compute behind it */
    double time;    /* max(comm, head + compute + tail, compute + the shared
                       experts), with the links' latency */
} moe_wave_estimate;

/* The probability that none of a token's k distinct experts, drawn
 * uniformly from E, is one of n given experts: C(E - n, k) / C(E, k). */
double moe_waves_miss(int experts, int topk, int n);

/* The estimate of t's forward with waves of `kind` (enum moe_wave_kind).
 * Rows per wave under uniform routing: a rank's T tokens reach a set of n
 * experts with probability 1 - moe_waves_miss(E, k, n); token chunks carry
 * T/W of the tokens each. Each (rank, tier, direction) link is busy for
 * its bytes over the tier's bandwidth; the first wave's dispatch and the
 * last wave's combine cannot overlap an expert, the rest can. The shared
 * experts fill those two waits; what they do not fit adds to the routed
 * experts' time on the one core that computes both. */
void moe_waves_estimate(const moe_wave_traffic *t, int kind, moe_wave_estimate *out);

/* MOE_WAVE_BY_TOKENS when token chunks' estimate is shorter than expert
 * slots', else MOE_WAVE_BY_EXPERTS; est[kind] each grouping's (both
 * computed). Expert slots need every rank to hold at least W experts: when
 * one holds fewer, token chunks with est[MOE_WAVES_EXPERT_SLOTS] zeroed. */
int moe_waves_choose(const moe_wave_traffic *t, moe_wave_estimate est[2]);

/* What `--wave-by auto` chose for one --waves entry, and why. */
typedef struct {
    int waves;                     /* W */
    int by;                        /* MOE_WAVE_BY_EXPERTS or MOE_WAVE_BY_TOKENS */
    moe_wave_estimate estimate[2]; /* each grouping's (enum moe_wave_kind) */
} moe_wave_choice;

#endif
