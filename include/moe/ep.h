/* ep.h — the expert-parallel MoE layer across the ranks of a communicator.
 *
 * moe_ep_forward_ref is the blocking reference path: count exchange with
 * MPI_Alltoall, dispatch and combine with MPI_Alltoallv, one SwiGLU FFN call
 * per local expert on its rows in global token order. moe_ep_forward_waves
 * is the pipelined path; it must match the reference (bitwise where the
 * contract says so), which is never removed.
 */
#ifndef MOE_EP_H
#define MOE_EP_H

#include <stdint.h>

#include "moe/comm.h"
#include "moe/config.h"
#include "moe/experts.h"
#include "moe/layout.h"
#include "moe/link.h"
#include "moe/router.h"
#include "moe/stats.h"

/* Shared experts are applied in blocks of this many of the home rank's
 * tokens, block b covering local tokens [64b, 64b+64): the same sgemm calls
 * whenever blocks cover the same global tokens (T a multiple of 64). */
#define MOE_SHARED_ROW_BLOCK 64

/* The wave path's large buffers, kept across forwards: a forward reuses
 * them (no allocation and no page faults once they are sized), and refits
 * them when the configuration changes. */
enum { MOE_WAVE_SEND_ROWS, MOE_WAVE_SEND_META, MOE_WAVE_RECV_ROWS, MOE_WAVE_RECV_META,
       MOE_WAVE_EXPERT_OUT, MOE_WAVE_BACK, MOE_WAVE_ROW_AT, MOE_WAVE_BUFFERS };
typedef struct {
    int waves;              /* wave slots held */
    moe_buffer *wave;       /* (waves, MOE_WAVE_BUFFERS) */
    moe_buffer expert_in;   /* the largest expert batch's rows (moe_ep_run_expert's work) */
    moe_buffer scratch;     /* and its activations */
    moe_buffer slot_rows;   /* the reduce table */
    moe_buffer x_scratch;   /* the quantised tokens (--dispatch-dtype) */
} moe_ep_workspace;

typedef struct moe_ep_s {
    const moe_config *cfg;
    moe_comm comm;
    moe_placement placement;
    moe_router router;
    enum moe_gemm_kind gemm;
    int local_experts; /* EL */
    int first_expert;  /* global id of local expert 0 */
    /* Expert weights in the layout of ep->gemm (moe_expert_layout): W1^T
     * (d, 2f) and W2^T (f, d), transposed, (in, out), and for packed in
     * moe_sgemm_pack's panels; moe_expert_w1_floats and _w2_floats each. */
    float *w1;         /* (EL, ...) */
    float *w2;         /* (EL, ...) */
    float *shared_w1;  /* (S, ...) */
    float *shared_w2;  /* (S, ...) */
    float *gate;       /* (E, d) */
    float *bias;       /* (E) deepseek-v3 correction bias, NULL without */
    float *skew;       /* (E) --skew logit bias, NULL without */
    moe_link link;     /* the emulated interconnect (off unless --link) */
    moe_ep_workspace *work; /* the wave path's buffers (mutable through a const moe_ep) */
} moe_ep;

/* x (T, d) as the ranks receive it: x itself for --dispatch-dtype fp32,
 * else its quantised copy in scratch (T, d). */
const float *moe_ep_dispatched_tokens(const moe_ep *ep, const float *x, float *scratch);

/* The weights of local expert l, or of shared expert s. */
moe_expert_weights moe_ep_expert(const moe_ep *ep, int local);
moe_expert_weights moe_ep_shared_expert(const moe_ep *ep, int shared);

/* Local expert l on the rows recv assigns it: gather them from where row_at
 * (received rows) says each received row is, run the FFN (with the gate
 * weight from recv_meta (rows, 2k + 1) applied before L2 when
 * cfg->weight_at says so), scatter the outputs into expert_out (pairs, d).
 * work holds (n, d + 1) floats, scratch (n, 2f). */
void moe_ep_run_expert(const moe_ep *ep, const moe_recv_plan *recv, int l,
                       const float *const *row_at, const int32_t *recv_meta, float *work,
                       float *scratch, float *expert_out, const moe_ffn_hooks *hooks);

/* Floats of one expert-input work buffer row (see moe_ep_run_expert). */
#define MOE_EXPERT_WORK_FLOATS(d) ((d) + 1)

/* y (T, d) += the shared experts of x (T, d), in blocks of
 * MOE_SHARED_ROW_BLOCK tokens; scratch (64, 2f), out (64, d). */
void moe_ep_shared_forward(const moe_ep *ep, const float *x, float *y, float *scratch, float *out);

/* Generate this rank's weights. Collective (allocation is agreed on): returns
 * MOE_EXIT_RUNTIME on every rank if any rank could not allocate. */
int moe_ep_init(moe_ep *ep, const moe_config *cfg, const moe_comm *comm, moe_status *st);
void moe_ep_free(moe_ep *ep);

/* x (T, d) = this rank's tokens, global ids rank*T + i. */
void moe_ep_generate_tokens(const moe_ep *ep, float *x);

/* Route x (T, d): ids (T, k), weights (T, k); logits and scores (T, E) kept
 * for inspection. Pure (no communication). */
void moe_ep_route(const moe_ep *ep, const float *x, float *logits, float *scores, int32_t *ids,
                  float *weights);

/* What the blocking path saw on this rank, for --dump (owned copies). */
typedef struct {
    moe_index rows;      /* dispatch rows received */
    float *recv_x;       /* (rows, d) as received, after --dispatch-dtype */
    int32_t *recv_token; /* (rows) global token id of each */
    moe_index pairs;     /* (row, expert) pairs computed */
    float *out;          /* (pairs, d) expert outputs as sent back, after --combine-dtype */
    int32_t *pair;       /* (pairs, 2) global token id and expert id of each */
} moe_ep_capture;

void moe_ep_capture_free(moe_ep_capture *capture);

/* y (T, d) = the MoE layer for x (T, d) routed by ids/weights (T, k).
 * Collective. capture, when not NULL, receives the rows this rank received
 * and the expert outputs it sent back. Returns MOE_EXIT_OK, or
 * MOE_EXIT_RUNTIME on every rank (with st set) if a buffer could not be
 * allocated on any rank. */
int moe_ep_forward_ref(const moe_ep *ep, const float *x, const int32_t *ids,
                       const float *weights, float *y, moe_forward_stats *stats,
                       moe_ep_capture *capture, moe_status *st);

/* The same layer in cfg->waves pipelined waves (ep_waves.c), with progress
 * driven as cfg->progress says. Appends this rank's events to trace (may be
 * NULL), timed from origin (an MPI_Wtime taken right after a barrier). Output
 * bitwise identical to moe_ep_forward_ref for expert-slot waves, and for any
 * waves with --gemm exact. Collective. */
int moe_ep_forward_waves(const moe_ep *ep, const float *x, const int32_t *ids,
                         const float *weights, float *y, moe_forward_stats *stats,
                         moe_trace *trace, double origin, moe_status *st);

#endif
