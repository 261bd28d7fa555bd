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

typedef struct {
    double seconds[MOE_STAGES];
    moe_index rows_sent;         /* dispatch rows, self included */
    moe_index rows_sent_remote;  /* dispatch rows to other ranks */
    moe_index rows_received;     /* dispatch rows received, self included */
    moe_index pairs_received;    /* (row, local expert) pairs computed here */
    moe_index pairs_back_remote; /* combine rows received from other ranks */
    double expert_flops;         /* sgemm FLOPs of the routed experts */
    double expert_start, expert_end; /* MPI_Wtime at the experts stage's ends */
    double bytes_dispatched;     /* payload + ids sent, self included */
    double bytes_combined;       /* expert outputs sent back, self included */
} moe_forward_stats;

#endif
