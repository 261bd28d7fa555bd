/* SPDX-License-Identifier: MIT */
/* stats.h — what one forward pass measures on one rank: stage times, rows,
 * bytes. Pure data, no MPI; the comm layer fills it, the report prints it.
 */
#ifndef MOE_STATS_H
#define MOE_STATS_H

#include "moe/dims.h"

/* The stages of one forward, in pipeline order. */
enum moe_stage {
    MOE_STAGE_ROUTE,    /* gate logits, softmax, top-k */
    MOE_STAGE_PLAN,     /* send plan, count exchange (MPI_Alltoall), receive plan */
    MOE_STAGE_DISPATCH, /* pack rows and ids, MPI_Alltoallv */
    MOE_STAGE_EXPERTS,  /* group by local expert, SwiGLU FFN, scatter for combine */
    MOE_STAGE_COMBINE,  /* MPI_Alltoallv of expert outputs back to the home ranks */
    MOE_STAGE_REDUCE,   /* gate-weighted sum per token, in slot order */
    MOE_STAGE_SHARED,   /* shared experts on the home rank */
    MOE_STAGES
};

extern const char *const moe_stage_names[MOE_STAGES];

/* What a timeline shows: the seed's five stages of one wave, and a
 * training step's (--backward): its blocking forward as one block, then the
 * backward's stages. */
enum moe_event_kind {
    MOE_EVENT_DISPATCH,   /* comm lane: posted .. seen complete */
    MOE_EVENT_L1,         /* compute lane (gathering the rows included) */
    MOE_EVENT_ACTIVATION, /* compute lane */
    MOE_EVENT_L2,         /* compute lane (scattering the outputs included) */
    MOE_EVENT_COMBINE,    /* comm lane: posted .. seen complete */
    MOE_EVENT_FORWARD,    /* compute lane: a step's blocking forward, all of it */
    MOE_EVENT_SHARED_BWD, /* compute lane: the shared experts' dx and dW */
    MOE_EVENT_DGRAD,      /* compute lane: a wave's data gradient */
    MOE_EVENT_WGRAD,      /* compute lane: the routed experts' weight gradients */
    MOE_EVENT_COMBINE_BWD,  /* comm lane: a wave's dy rows out */
    MOE_EVENT_DISPATCH_BWD, /* comm lane: a wave's dx rows home */
    MOE_EVENT_SHARED,       /* compute lane: a block of tokens through a shared expert */
    MOE_EVENT_KINDS
};

/* Whether a kind is communication (the comm lane), and whether it goes in
 * the lane's upper half (rows out from home: dispatch, combine backward). */
static inline int moe_event_is_comm(int kind)
{
    return kind == MOE_EVENT_DISPATCH || kind == MOE_EVENT_COMBINE ||
           kind == MOE_EVENT_COMBINE_BWD || kind == MOE_EVENT_DISPATCH_BWD;
}
static inline int moe_event_goes_out(int kind)
{
    return kind == MOE_EVENT_DISPATCH || kind == MOE_EVENT_COMBINE_BWD;
}

extern const char *const moe_event_names[MOE_EVENT_KINDS];

typedef struct {
    int wave;            /* -1: a stage of the whole step, not of one wave */
    int kind;            /* enum moe_event_kind */
    double start, end;   /* seconds since the forward's aligned start */
    double bytes;        /* comm: bytes this rank sent */
    moe_index rows;      /* rows sent (comm) or computed (compute) */
    int tier;            /* comm of the two-stage dispatch: the tier it crossed
                            (link.h, MOE_TIER_*); -1: both (a flat all-to-all), or compute */
    double posted;       /* comm: seconds since the forward's aligned start when this rank
                            posted it (start may be later: a lane shows one at a time) */
} moe_event;

/* A growable list of one rank's events. */
typedef struct {
    moe_event *events;
    int count, capacity;
} moe_trace;

void moe_trace_add(moe_trace *t, moe_event e);
void moe_trace_clear(moe_trace *t);
void moe_trace_free(moe_trace *t);

/* The collective agreements a forward passes at most (moe_ep_arrivals). */
#define MOE_ARRIVALS_MAX 8

/* The slow-rank finder. posted (2 W) = when this rank posted each of its
 * W dispatches, then its W combines (the earliest hop of a two-stage one),
 * in seconds from the forward's aligned start, from the trace's comm
 * events; NaN for one it holds no event of (a path that records none). */
void moe_trace_posts(const moe_trace *t, int waves, double *posted);
/* From every rank's posted (G, 2 W + A) — its W dispatches, its W
 * combines, then its A collective agreements (moe_ep_arrivals), each on
 * the dispatch's side (side 0: the plan's, the dispatch's) or the
 * combine's (1) — and the dispatch bytes sends (G, G), rank row to rank
 * column (combine rows go back the other way): waits (2, G, G) = on each
 * side, how long rank r had posted before a source s that sends it rows
 * (at an agreement: any rank) posted its own, summed (r cannot have s's
 * rows sooner: a lower bound of its wait), and last (G) = of the 2 W + A
 * operations, how many each rank posted last. Returns moe_waits_slow's
 * verdict, -1 also when nothing was posted. */
int moe_waits_analyze(int G, int W, int A, const int *side, const double *posted, const double *sends,
                      double *waits, int *last);
/* The verdict on waits (2, G, G): the rank the others waited for longest in
 * all, when that is at least MOE_SLOW_MIN_SECONDS and twice as long as for
 * any other rank; else -1 (no rank stands out: which is last is then
 * jitter). waited (2) and ranked (2), when not NULL: the longest and the
 * second longest of those sums, and their ranks (-1: none, G = 1). */
#define MOE_SLOW_MIN_SECONDS 1e-3
int moe_waits_slow(int G, const double *waits, double *waited, int *ranked);

/* Overlap, the OSU way: 1 - (T_layer - T_compute) / T_comm, clamped to
 * [0, 1]; 0 when nothing was communicated. The one definition the report,
 * the benchmark and the docs use. */
static inline double moe_overlap(double layer, double compute, double comm)
{
    const double overlap = comm > 0 ? 1.0 - (layer - compute) / comm : 0.0;
    return overlap < 0 ? 0 : overlap > 1 ? 1 : overlap;
}

typedef struct {
    double seconds[MOE_STAGES];
    moe_index rows_sent;         /* dispatch rows, self included */
    moe_index rows_sent_remote;  /* dispatch rows to other ranks */
    moe_index rows_received;     /* dispatch rows received, self included */
    moe_index pairs_received;    /* (row, local expert) pairs computed here */
    moe_index pairs_back_remote; /* combine rows received from other ranks */
    moe_index rows_inter, rows_intra; /* --dispatch hierarchical: stage-1 rows to other
                                         nodes, stage-2 rows to other ranks of the node */
    double expert_flops;         /* sgemm FLOPs of the routed experts (zero rows included) */
    moe_index pad_rows;          /* --pad-to-capacity: zero rows the experts computed */
    moe_index layout_slots;      /* rows of the tensors the expert GEMMs read (--expert-layout;
                                    one per wave), of which pairs_received hold rows */
    double expert_start, expert_end; /* clock times (clock.h) at the experts stage's ends */
    double done;                 /* clock time when y was complete (before any measuring pass) */
    double bytes_dispatched;     /* payload + ids sent, self included */
    double bytes_combined;       /* expert outputs sent back, self included */
    double tier_bytes[2];        /* the wave paths: bytes sent to other ranks over each tier
                                    (link.h: intra-node, inter-node), dispatch and combine, as
                                    the link model charges them */
    /* The wave pipeline only: */
    int waves;                   /* W, 0 on the blocking path */
    int wave_kind;               /* enum moe_wave_kind */
    double pipeline_seconds;     /* first dispatch posted .. last combine complete */
    double compute_seconds;      /* compute inside the pipeline: the routed experts (the
                                    experts stage), then fill_seconds */
    double fill_seconds;         /* shared-expert pieces run while the pipeline waited */
    double fill_flops;           /* their sgemm FLOPs */
    double comm_seconds;         /* not set by the forward: moe_ep_time_alltoalls */
    double test_seconds;         /* inside MPI_Test */
} moe_forward_stats;

/* The stages of one backward, in order. With the all-to-alls in flight, a
 * communication stage's seconds are those the computing thread spent
 * posting and waiting for it. */
enum moe_bwd_stage {
    MOE_BWD_COMBINE,  /* combine backward: dy rows to the experts' ranks (MPI_Alltoallv) */
    MOE_BWD_DGRAD,    /* experts: dx per pair and dL/dweight (the backward's B) */
    MOE_BWD_WGRAD,    /* experts: dW1, dW2 (the backward's W: no communication) */
    MOE_BWD_DISPATCH, /* dispatch backward: dx rows and dL/dweight home (MPI_Alltoallv) */
    MOE_BWD_REDUCE,   /* dx of each token from the rows that came home */
    MOE_BWD_SHARED,   /* the shared experts' dx and dW */
    MOE_BWD_ROUTER,   /* through the router and the gate: dx, dW_g */
    MOE_BWD_ALLREDUCE, /* the replicated weights' gradients summed over ranks */
    MOE_BWD_STAGES
};

extern const char *const moe_bwd_stage_names[MOE_BWD_STAGES];

typedef struct {
    double seconds[MOE_BWD_STAGES];
    double bytes_combine;  /* combine backward: dy rows sent, self included */
    double bytes_dispatch; /* dispatch backward: dx rows and per-pair dL/dweight sent */
    double bytes_remote;   /* of both, those sent to other ranks */
    double dgrad_flops, wgrad_flops; /* sgemm FLOPs of the routed experts' B and W */
    /* With the all-to-alls in flight (moe_ep_backward_step with a schedule): */
    double in_flight[2];   /* combine backward, dispatch backward: posted .. complete */
    double test_seconds;   /* inside MPI_Test */
} moe_backward_stats;

#endif
