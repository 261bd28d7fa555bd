/* SPDX-License-Identifier: MIT */
/* link.h — the emulated interconnect: when an all-to-all's data "arrives".
 *
 * On one machine an all-to-all is a memcpy, far faster than a cluster's links,
 * so there is little communication to hide. With a link model, each wave's
 * dispatch or combine completes on a rank only at its modelled time
 * (docs/link-model.md). Each rank has, per tier t (intra-node, inter-node),
 * one ingress and one egress link, each a first-come first-served server
 * shared by all the rank's messages, of every operation in flight:
 *
 *   start(t, dir) = max(t_post, free(t, dir))
 *   free(t, dir)  = start(t, dir) + bytes(t, dir) / bandwidth_t
 *   t_done        = max over (t, dir) with bytes > 0 of free(t, dir) + latency_t
 *
 * bytes(t, in) are the bytes this rank receives over tier t from other ranks,
 * bytes(t, out) those it sends. Messages to self are free. Pure: no MPI.
 */
#ifndef MOE_LINK_H
#define MOE_LINK_H

#include <stdbool.h>

#include "moe/common.h"

enum { MOE_TIER_INTRA, MOE_TIER_INTER, MOE_TIERS };

typedef struct {
    bool enabled;
    double cb_ratio;            /* > 0: bandwidth from the measured FLOP/s (cb=RATIO) */
    double cb_ratio_inter;      /* > 0: the inter-node tier's own (inter-cb=RATIO) */
    double bandwidth[MOE_TIERS]; /* bytes per second */
    double latency[MOE_TIERS];  /* seconds */
    int ranks_per_node;         /* R; rank r is on virtual node r / R */
} moe_link;

/* The ranges a spec may give, so that a forward's emulated wait stays
 * bounded: C/B at most 10^5 FLOP per byte (at 100 GFLOP/s, 1 MB/s), every
 * bandwidth in [1 MB/s, 1000 TB/s], every latency at most 1 s. Past
 * MOE_LINK_WAIT_MAX seconds of modelled wait for one all-to-all (a huge
 * config on a slow link) the pipeline stops with a runtime error. */
#define MOE_LINK_CB_MAX 1e5
#define MOE_LINK_BW_MIN 1e6
#define MOE_LINK_BW_MAX 1e15
#define MOE_LINK_LATENCY_MAX 1.0
#define MOE_LINK_WAIT_MAX 600.0

/* Parse a --link spec:
 *   cb=RATIO[,inter-cb=RATIO][,lat=TIME]
 *                                   both tiers at C/B = RATIO FLOP per byte, or
 *                                   the inter-node tier at its own
 *   bw=BW[:TIME]                    both tiers
 *   intra=BW[:TIME],inter=BW[:TIME] per tier (a missing tier is unlimited)
 * BW is a number with B/s, KB/s, MB/s, GB/s or TB/s (bytes, decimal units)
 * or b/s, Kb/s, Mb/s, Gb/s, Tb/s (bits); TIME a number with ns, us, ms or s. "" or "off" disables the model. Returns
 * MOE_EXIT_OK or MOE_EXIT_USAGE with a message naming --link. */
int moe_link_parse(moe_link *link, const char *spec, moe_status *st);

/* The tier between two ranks. */
static inline int moe_link_tier(const moe_link *link, int a, int b)
{
    return a / link->ranks_per_node == b / link->ranks_per_node ? MOE_TIER_INTRA : MOE_TIER_INTER;
}

/* The busy-until times of one rank's links, (tier, in|out); start at zero. */
typedef struct {
    double free_at[MOE_TIERS][2];
} moe_link_state;

/* Schedule one all-to-all posted at t_post moving bytes_in and bytes_out
 * (MOE_TIERS each) on state; returns its completion time (t_post when the
 * model is off or nothing crosses a link). */
double moe_link_schedule(const moe_link *link, moe_link_state *state, double t_post,
                         const double *bytes_in, const double *bytes_out);

/* One line describing the model, e.g. "intra 900 GB/s + 2 us, inter 50 GB/s + 5 us". */
void moe_link_describe(const moe_link *link, char *buf, size_t size);

#endif
