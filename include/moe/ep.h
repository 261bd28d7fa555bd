/* SPDX-License-Identifier: MIT */
/* ep.h — the expert-parallel MoE layer across the ranks of a communicator.
 *
 * A forward is a short sequence of named stages, each with one contract
 * (src/comm/ep_stages.h):
 *
 *   route → plan → pack → dispatch → experts → combine → reduce (+ shared)
 *
 * Several paths run them (path.h: the table, chosen once from the config).
 * moe_ep_forward_ref (ep_ref.c) is the blocking reference: one count
 * exchange, dispatch and combine with MPI_Alltoallv, one SwiGLU call per
 * local expert on its rows in global token order. It is never removed.
 * moe_ep_forward_waves (ep_waves.c) runs the same stages in W pipelined
 * waves under an explicit schedule; it must match the reference, bitwise
 * where the contract says so.
 *
 * What is fixed for the object's life comes from the validated configuration
 * (held const, never written); what a caller varies from one forward to the
 * next travels in a moe_schedule. The GEMM kind is fixed too: the weights
 * are laid out for it once, at init.
 */
#ifndef MOE_EP_H
#define MOE_EP_H

#include <stdbool.h>
#include <stdint.h>

#include "moe/capacity.h"
#include "moe/comm.h"
#include "moe/config.h"
#include "moe/eplb.h"
#include "moe/experts.h"
#include "moe/layout.h"
#include "moe/link.h"
#include "moe/router.h"
#include "moe/stats.h"
#include "moe/wave_estimate.h"

struct moe_ep_workspace; /* the paths' buffers, kept across forwards (ep_stages.h) */
struct moe_path_s;       /* the path this object runs (path.h) */

typedef struct moe_ep_s {
    const moe_config *cfg; /* validated, never written */
    moe_comm comm;
    moe_placement placement; /* of the physical experts: the logical ones, or with
                                --redundant-experts the E + N slots, (E + N)/G a rank */
    moe_replicas replicas;   /* --redundant-experts: slot p holds a copy of logical expert
                                replicas.phy2log[p]; physical = 0 without */
    moe_router router;
    enum moe_gemm_kind gemm;
    int local_experts; /* EL */
    int first_expert;  /* physical id of local expert 0 */
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
    int32_t *replay_ids;   /* (T, k) --routing: this rank's ids, replacing the router's; NULL: none */
    float *replay_weights; /* (T, k) and weights (owned; moe_ep_free frees them) */
    bool *lost_ranks;      /* (G) --mask-ranks: the ranks run as lost (mask.h); NULL: none */
    moe_link link;     /* the emulated interconnect (configured by --link; its
                          bandwidths calibrated once by cb=RATIO) */
    moe_wave_choice *wave_choices; /* (cfg->waves_count) --wave-by auto under --link: the
                                      grouping of each --waves entry, chosen at start-up
                                      (moe_waves_choose); NULL: by the placement alone */
    const struct moe_path_s *path; /* chosen once from cfg at init (path.h) */
    struct moe_ep_workspace *work; /* mutable through a const moe_ep */
} moe_ep;

/* How one wave forward runs: everything a caller varies between forwards. */
typedef struct {
    int waves;                       /* W >= 1 */
    int lookahead;                   /* waves dispatched ahead of the one computing, >= 1 */
    int wave_by;                     /* enum moe_wave_by: how pairs are grouped into waves */
    enum moe_progress_kind progress; /* who drives the nonblocking collectives */
    bool link;                       /* emulate ep->link (when --link configured one) */
    moe_trace *trace;                /* this rank's events are appended here; NULL: none */
    double origin;                   /* the clock time (clock.h) events count from */
    bool serial;                     /* the backward waits for each all-to-all as it posts it
                                        (under the link model: the serial time) */
} moe_schedule;

/* The grouping (enum moe_wave_by) a forward under sched runs: --wave-by as
 * given, or for auto the one ep->wave_choices holds for sched->waves (auto,
 * by the placement, without one). */
int moe_ep_wave_by(const moe_ep *ep, const moe_schedule *sched);

/* Seconds this rank's routed experts take on a batch of `rows` rows each
 * (this rank's tokens, repeated as needed), each batch split into `chunks`
 * calls of even size, as waves of token chunks split it: every rank at
 * once, as in a forward, and the slowest rank's time. Collective. */
double moe_ep_time_experts(const moe_ep *ep, const float *x, moe_index rows, int chunks);

/* The schedule ep's configuration asks for: the first --waves,
 * --lookahead, --progress as the MPI library can give it
 * (moe_progress_granted), the link model on, no trace. */
moe_schedule moe_schedule_default(const moe_ep *ep);

/* Generate this rank's weights. Collective (allocation is agreed on): returns
 * MOE_EXIT_RUNTIME on every rank if any rank could not allocate. cfg must
 * have passed moe_config_validate and outlive ep. */
int moe_ep_init(moe_ep *ep, const moe_config *cfg, const moe_comm *comm, moe_status *st);
void moe_ep_free(moe_ep *ep);

/* --redundant-experts: moe_ep_init leaves the routed experts' weights
 * ungenerated until moe_ep_place_replicas places the copies.
 *
 * load (E) = the tokens routed to each logical expert (k pairs a token) in
 * cfg->eplb_window batches of fresh tokens, summed over ranks: window batch
 * s = 1 .. S is stream batch b = steps + s - 1, rows b*G*T + rank*T + i of
 * the token stream (rng.h); the run's own batch and --steps' are b = 0 ..
 * steps - 1, so none of them is one EPLB measured. Collective. */
void moe_ep_window_load(const moe_ep *ep, double *load);

/* Place the E + N physical experts with EPLB for load (E) (eplb.h: the
 * router's groups, nodes of ep->link.ranks_per_node ranks when they divide
 * G), the same on every rank, and generate the weights of this rank's
 * copies, in place of a placement before. load NULL: moe_ep_window_load's
 * (collective then). */
void moe_ep_place_replicas(moe_ep *ep, const double *load);

/* Stage place: placed (T, k) = the physical expert of each of this rank's
 * (token, slot) pairs of ids (T, k): moe_replica_of with the token's global
 * id and its home rank's node (--replica-choice dedup:
 * moe_replicas_of_token); the logical ids themselves without replicas.
 * With --capacity-factor, first the pairs over their expert's capacity on
 * this rank's tokens become MOE_DROPPED (moe_capacity_apply, by
 * --drop-policy on weights (T, k)): every path skips them (never sent,
 * never computed, nothing added); weights NULL: no drops (what the
 * forward would send without them). Pure. */
void moe_ep_place(const moe_ep *ep, const int32_t *ids, const float *weights, int32_t *placed);

/* x (T, d) = this rank's tokens of stream batch b: rows (b*G + rank)*T + i
 * of the token stream (rng.h). Batch 0 is the run's. */
void moe_ep_generate_batch(const moe_ep *ep, uint64_t batch, float *x);

/* x (T, d) = this rank's tokens, global ids rank*T + i. */
void moe_ep_generate_tokens(const moe_ep *ep, float *x);

/* dy (T, d) = the upstream gradient of this rank's tokens for --backward
 * (rng.h, MOE_TENSOR_GRAD_OUTPUT: uniform in [-1, 1), row = global id). */
void moe_ep_generate_grad_output(const moe_ep *ep, float *dy);

/* When this rank reached each collective agreement of its last forward
 * (the plan's, and on the blocking path each stage's), in order: at most
 * MOE_ARRIVALS_MAX clock times (clock.h) into `at` and their stages into
 * `stage`; returns how many. Every rank passes the same ones. */
int moe_ep_arrivals(const moe_ep *ep, double *at, const char **stage);

/* Stage route. x (T, d) → ids (T, k), weights (T, k); logits and scores
 * (T, E) kept for inspection. A token's routing depends on its row only
 * (fixed-order fp64 gate, specified exp): the same bits at any G. With
 * replay_ids set (--routing), ids and weights are the replayed ones; with
 * lost_ranks (--mask-ranks) the pairs mask.h drops are -1 and the kept
 * weights rescaled. Returns the pairs the mask dropped. Pure. */
moe_index moe_ep_route(const moe_ep *ep, const float *x, float *logits, float *scores, int32_t *ids,
                       float *weights);

/* out (S, rows, d) = each shared expert's output for x (rows, d), this
 * rank's copy of its weights, as the forward's shared stage computes them
 * (row for row the same bits with packed or exact GEMMs). Pure. */
void moe_ep_shared_outputs(const moe_ep *ep, const float *x, moe_index rows, float *out);

/* x (T, d) as the ranks receive it: x itself for --dispatch-dtype fp32,
 * else its quantised copy in scratch (T, d). */
const float *moe_ep_dispatched_tokens(const moe_ep *ep, const float *x, float *scratch);

/* What the blocking path saw on this rank, for --dump (owned copies). */
typedef struct {
    moe_index rows;      /* dispatch rows received */
    float *recv_x;       /* (rows, d) as received, after --dispatch-dtype */
    int32_t *recv_token; /* (rows) global token id of each */
    moe_index pairs;     /* (row, expert) pairs computed */
    float *out;          /* (pairs, d) expert outputs: as sent back, after --combine-dtype,
                            or with --combine reduced in fp32, before they are summed */
    int32_t *pair;       /* (pairs, 2) global token id and expert id of each */
    int32_t *pair_row;   /* (pairs) the received row of each */
    float *pair_weight;  /* (pairs) the gate weight of each */
    float *sums;         /* --combine reduced: (rows, d) per received row, its pairs' sum as
                            sent back, after --combine-dtype; NULL otherwise */
    /* The tensor the expert GEMMs read (--expert-layout, layout.h), its rows
     * as the wire carried them: rows: the received rows themselves;
     * masked and contiguous: per slot, its pair's row; empty and padding
     * slots all zero bytes. */
    moe_index slots;
    uint8_t *layout_wire;   /* (slots, wire row bytes) values, then fp8 scales (wire.h) */
    int32_t *layout_src;    /* (slots) global token id; -1: empty or padding */
    int32_t *layout_expert; /* (slots) local expert (DeepGEMM's m_indices); -1: empty or padding */
    int32_t *layout_count;  /* (EL) rows of each local expert */
} moe_ep_capture;

void moe_ep_capture_free(moe_ep_capture *capture);

/* y (T, d), a forward's output, rounded in place to --output-dtype (bf16:
 * as DeepEP's combine hands it back), once at home after every sum. */
void moe_ep_round_output(const moe_ep *ep, float *y);

/* y (T, d) = the MoE layer for x (T, d) routed by ids/weights (T, k), on the
 * blocking reference path. Collective. capture, when not NULL, receives the
 * rows this rank received and the expert outputs it sent back. Returns
 * MOE_EXIT_OK, or MOE_EXIT_RUNTIME on every rank (with st set) if a buffer
 * could not be allocated on any rank. */
int moe_ep_forward_ref(const moe_ep *ep, const float *x, const int32_t *ids,
                       const float *weights, float *y, moe_forward_stats *stats,
                       moe_ep_capture *capture, moe_status *st);

/* y (T, d) = the MoE layer on the low-latency path of decode (--mode
 * low-latency, ep_ll.c): every (token, expert) pair a row of its own into
 * the owner's fixed buffer (--max-tokens-per-rank N slots per source and
 * local expert) by one-sided MPI, pushed (--rma put) or pulled (get), no
 * count exchange; the home rank sums a token's outputs in slot order. With
 * packed or exact GEMMs, bitwise the output of moe_ep_forward_ref with
 * --combine pairs. The window is allocated at the first call (collective)
 * and kept; returns MOE_EXIT_OK, or MOE_EXIT_USAGE on every rank (st set)
 * when the MPI library cannot give it. Collective. */
int moe_ep_forward_ll(const moe_ep *ep, const float *x, const int32_t *ids, const float *weights,
                      float *y, moe_forward_stats *stats, moe_status *st);

/* One rank's gradients of the layer (moe_ep_backward_ref). */
typedef struct {
    float *dx;         /* (T, d) this rank's tokens */
    float *dw1, *dw2;  /* (EL, 2f, d), (EL, d, f) this rank's routed experts, over every token */
    float *dshared_w1; /* (S, 2f, d) the shared experts', over every rank's tokens */
    float *dshared_w2; /* (S, d, f) */
    float *dgate;      /* (E, d) the gate weight's, over every rank's tokens */
} moe_ep_grads;

/* Allocated for ep (moe_xmalloc: a failure ends the job with exit 3). */
void moe_ep_grads_init(const moe_ep *ep, moe_ep_grads *g);
void moe_ep_grads_free(moe_ep_grads *g);

/* g's tensors in a fixed order (dx, dW1, dW2, shared dW1, shared dW2, the
 * gate's): their values and lengths into v and n (MOE_EP_GRAD_TENSORS). */
#define MOE_EP_GRAD_TENSORS 6
void moe_ep_grads_tensors(const moe_ep *ep, const moe_ep_grads *g, const float **v, moe_index *n);

/* One training step of the layer on the blocking reference path: the
 * forward of moe_ep_forward_ref (y, fwd), keeping its plan, received rows
 * and expert outputs, then the backward for the upstream gradient dy (T,
 * d) as its mirror image (ep_backward.c): dy rows go out along the
 * dispatch's plan (one per token and rank), each rank's experts compute dx
 * per pair, dL/dweight and their dW (rows in global token order), dx goes
 * home as the combine came (summed per row at the source with --combine
 * reduced, per pair with pairs) with dL/dweight per pair, and the home rank
 * adds its shared experts' dx and the router's (through logits (T, E) of
 * moe_ep_route). The replicated weights' gradients (shared experts, gate)
 * are summed over ranks in rank order (moe_comm_sum_ordered). Needs fp32
 * on the wire and the router's own routing (moe_config_validate says so).
 * Collective; returns as moe_ep_forward_ref does. */
int moe_ep_backward_ref(const moe_ep *ep, const float *x, const float *logits, const int32_t *ids,
                        const float *weights, const float *dy, float *y, moe_ep_grads *g,
                        moe_forward_stats *fwd, moe_backward_stats *bwd, moe_status *st);

/* What a blocking backward saw on this rank, for --dump (owned copies;
 * rows and pairs in the order of the forward's moe_ep_capture). */
typedef struct {
    moe_index rows, pairs;
    float *dy;      /* (rows, d) the dy rows received (combine backward) */
    float *dx;      /* (pairs, d) dx of each pair */
    float *dweight; /* (pairs) dL/dweight of each pair */
    float *sums;    /* --combine reduced: (rows, d) per row, its pairs' dx summed as sent home */
} moe_ep_bwd_capture;

void moe_ep_bwd_capture_free(moe_ep_bwd_capture *capture);

/* moe_ep_backward_ref, capturing the forward (fwd_capture) and the
 * backward (bwd_capture) on this rank. */
int moe_ep_backward_capture(const moe_ep *ep, const float *x, const float *logits,
                            const int32_t *ids, const float *weights, const float *dy, float *y,
                            moe_ep_grads *g, moe_ep_capture *fwd_capture,
                            moe_ep_bwd_capture *bwd_capture, moe_status *st);

/* Whether the backward of sched runs the data gradients of its W > 1
 * waves as one pass, each expert's rows one batch and its weights read
 * once, after every combine backward: with --wave-by auto and no emulated
 * link, where the all-to-alls are memory copies that the shared experts
 * and the weight gradients hide whatever W (wave by wave, each expert's
 * weights are read once a wave). Else wave by wave. */
bool moe_ep_backward_one_pass(const moe_ep *ep, const moe_schedule *sched);

/* The same step with the backward in sched->waves waves of token chunks
 * (each rank's tokens [w T/W, (w+1) T/W)), its all-to-alls nonblocking,
 * driven as sched->progress says, sched->lookahead combines backward ahead
 * (sched NULL: moe_ep_backward_ref, one blocking wave): the first combines
 * backward in flight while the shared experts compute their gradients, a
 * wave's dispatch backward while later waves compute their data gradients
 * (or, moe_ep_backward_one_pass, every wave's in one pass) and the routed
 * experts their weight gradients (the zero-bubble split of a backward into
 * B, which the communication needs, and W, which it does not). With packed
 * or exact GEMMs the same bits as moe_ep_backward_ref at any W, either
 * way (a row's data gradient depends on its row only, and the weight
 * gradients sum every expert's rows in one pass); with blas, at W = 1. The
 * forward is the blocking reference (the backward reads its saved state).
 * A buffer of the backward that cannot be allocated ends the job with exit 3. */
int moe_ep_backward_step(const moe_ep *ep, const moe_schedule *sched, const float *x,
                         const float *logits, const int32_t *ids, const float *weights,
                         const float *dy, float *y, moe_ep_grads *g, moe_forward_stats *fwd,
                         moe_backward_stats *bwd, moe_status *st);

/* A pair of micro-batches as a training pipeline's steady state meets
 * them: micro-batch A's forward is done (here: moe_ep_forward_ref, not
 * timed), and micro-batch B's forward (the same tokens: the schedule is what
 * is measured) runs with A's backward, timed from a barrier to both done:
 *   MOE_PAIR_SERIAL    B's forward in one wave, then A's backward in one
 *                      wave waiting for each all-to-all as it posts it: no
 *                      overlap, the link model still applied
 *   MOE_PAIR_WAVES     B's wave forward, then A's backward in waves (sched)
 *   MOE_PAIR_DUALPIPE  DualPipe's pairing: B's forward stages where A's
 *                      backward all-to-alls are in flight and the other
 *                      way round (B's experts behind A's combines backward,
 *                      A's data gradients behind B's combine, B's reduce and
 *                      shared experts and A's weight gradients behind A's
 *                      dispatches backward); A's backward in sched->waves
 * y = B's output, g = A's gradients: with packed or exact GEMMs the bits of
 * moe_ep_forward_ref and moe_ep_backward_ref in every mode. *seconds: this
 * rank's time for the pair. Collective. */
enum moe_pair_mode { MOE_PAIR_SERIAL, MOE_PAIR_WAVES, MOE_PAIR_DUALPIPE };
int moe_ep_pair_step(const moe_ep *ep, const moe_schedule *sched, enum moe_pair_mode mode,
                     const float *x, const float *logits, const int32_t *ids,
                     const float *weights, const float *dy, float *y, moe_ep_grads *g,
                     moe_forward_stats *fwd, moe_backward_stats *bwd, double *seconds,
                     moe_status *st);

/* The same layer with the two-stage dispatch and combine of
 * --dispatch hierarchical (ep_hier.c): each token crosses to another node
 * once per node, to the rank of its local index there, which forwards it
 * within its node; outputs return the same way. Blocking: one wave, each
 * all-to-all waited for when posted. (The two-stage path runs it in waves
 * of tokens: path.h.) y has the same
 * bits as moe_ep_forward_ref with --gemm packed or exact. G must be a
 * multiple of the ranks per node. A buffer that cannot be allocated ends
 * the job with exit 3 (moe_fatal); an injected plan fault returns
 * MOE_EXIT_RUNTIME on every rank with st set. Collective. */
int moe_ep_forward_hier(const moe_ep *ep, const float *x, const int32_t *ids,
                        const float *weights, float *y, moe_forward_stats *stats, moe_status *st);

/* The same layer in sched->waves pipelined waves, progress and link model as
 * sched says; the flat dispatch only (the two-stage one in waves is its own
 * path, path.h). Output bitwise identical to moe_ep_forward_ref for
 * expert-slot waves, and for any waves with --gemm exact or packed.
 * stats->comm_seconds is left 0: the all-to-alls alone are timed by
 * moe_ep_time_alltoalls, outside the forward. Collective. */
int moe_ep_forward_waves(const moe_ep *ep, const moe_schedule *sched, const float *x,
                         const int32_t *ids, const float *weights, float *y,
                         moe_forward_stats *stats, moe_status *st);

/* T_comm of the overlap, the OSU way: the last moe_ep_forward_waves's
 * all-to-alls posted again all at once (as the pipeline may have them) with
 * no compute between post and wait, their receive buffers rewritten with
 * the same bytes; with sched->link, at least the time the modelled links
 * need for all of them. Seconds on this rank. Collective; must follow a
 * successful moe_ep_forward_waves on every rank. */
double moe_ep_time_alltoalls(const moe_ep *ep, const moe_schedule *sched);

#endif
