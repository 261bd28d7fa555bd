/* SPDX-License-Identifier: MIT */
/* ep_stages.h — the stages both EP paths share, and their private plumbing.
 *
 * Not a public header: only the EP forwards (src/comm/ep*.c) include it. Each
 * stage is one function with one contract; shapes use the dims.h letters.
 *
 * The two-stage dispatch (ep_hier.c) runs the same stages, with dispatch
 * and combine in two hops each; ep_pipeline.c holds what both pipelines
 * share (the compute clock, posting under the link model, comm events).
 *
 *   stage     reference path (ep_ref.c)     wave path (ep_waves.c)       shared here
 *   route     moe_ep_route (ep.h)           the same                      yes
 *   plan      ref_plan, ref_plan_receive    waves_plan, wave_plan_receive
 *   pack      moe_ep_pack                   the same, per wave            yes
 *   dispatch  ref_dispatch (MPI_Alltoallv)  wave_dispatch (Ialltoallv)
 *   experts   moe_ep_expert per expert      the same, per wave            yes
 *   combine   ref_combine (MPI_Alltoallv)   wave_combine (Ialltoallv)
 *   reduce    moe_ep_reduce                 the same, every wave at once  yes
 *   shared    moe_ep_shared                 moe_shared_work pieces in the
 *                                           pipeline's waits, the rest after
 *                                           the reduce
 */
#ifndef MOE_EP_STAGES_H
#define MOE_EP_STAGES_H

#include "moe/backward.h"
#include "moe/clock.h"
#include "moe/ep.h"
#include "moe/progress.h"
#include "moe/wire.h"

/* Shared experts are applied in blocks of this many of the home rank's
 * tokens, block b covering local tokens [64b, 64b+64): the same sgemm calls
 * whenever blocks cover the same global tokens (T a multiple of 64). */
#define MOE_SHARED_ROW_BLOCK 64

/* Floats of one expert-input work buffer row (see moe_ep_expert). */
#define MOE_EXPERT_WORK_FLOATS(d) ((d) + 1)

/* The wave path's large buffers, kept across forwards: a forward reuses
 * them (no allocation and no page faults once they are sized), and refits
 * them when the schedule changes. */
enum { MOE_WAVE_SEND_ROWS, MOE_WAVE_SEND_META, MOE_WAVE_RECV_ROWS, MOE_WAVE_RECV_META,
       MOE_WAVE_EXPERT_OUT, MOE_WAVE_BACK, MOE_WAVE_ROW_AT,
       MOE_WAVE_RECV_VALUES, MOE_WAVE_OUT_WIRE, MOE_WAVE_BACK_VALUES, /* bf16/fp8 on the wire */
       MOE_WAVE_SUMS, MOE_WAVE_SLOT_PAIR, /* --combine reduced */
       MOE_WAVE_BUFFERS };

/* The same for a wave of the two-stage dispatch (ep_hier.c). */
enum { MOE_HIER_SEND1, MOE_HIER_META1_OUT, MOE_HIER_RECV1, MOE_HIER_META1, MOE_HIER_IDS1,
       MOE_HIER_SEND2, MOE_HIER_META2_OUT, MOE_HIER_RECV2, MOE_HIER_META2, MOE_HIER_VALUES,
       MOE_HIER_ROW_AT, MOE_HIER_EXPERT_OUT, MOE_HIER_OUT_WIRE, MOE_HIER_BACK2, MOE_HIER_RET1,
       MOE_HIER_BACK1, MOE_HIER_BACK,
       MOE_HIER_SUMS, MOE_HIER_BACK2_VALUES, MOE_HIER_NODE_SUMS, /* --combine reduced */
       MOE_HIER_BUFFERS };

struct moe_wave_state; /* one wave's plan and buffers (ep_waves.c) */
struct moe_hier_wave;  /* the same, two-stage (ep_hier.c) */

struct moe_ep_workspace {
    int waves;              /* wave slots held */
    moe_buffer *wave;       /* (waves, MOE_WAVE_BUFFERS) */
    moe_buffer expert_in;   /* the largest expert batch's rows (moe_ep_expert's work) */
    moe_buffer scratch;     /* and its activations */
    moe_buffer slot_rows;   /* the reduce table */
    moe_buffer x_scratch;   /* the quantised tokens (--dispatch-dtype) */
    moe_buffer shared_out;  /* the shared experts' outputs (S, T, d) while a pipeline runs them */
    moe_pool pool;          /* the blocking forward's and the backward's large buffers */
    /* The last wave forward's plans, kept for moe_ep_time_alltoalls. */
    struct moe_wave_state *last;
    int last_waves;
    /* The two-stage dispatch: its four communicators (made at its first
     * forward), its wave slots (hier_waves, MOE_HIER_BUFFERS), its last plans. */
    bool hier_comms;
    MPI_Comm hier_comm[4];
    int hier_waves;
    moe_buffer *hier;
    struct moe_hier_wave *hier_last;
    int hier_last_waves;
    struct moe_ll_state *ll; /* --mode low-latency: the window and its layout (ep_ll.c) */
    /* When this rank reached each collective agreement of the forward under
     * way (moe_ep_agreed: plan, and on the blocking path each stage), for
     * the slow-rank finder; moe_path_run starts the list. */
    int arrivals;
    double arrived[MOE_ARRIVALS_MAX];     /* clock times (clock.h) */
    const char *arrived_at[MOE_ARRIVALS_MAX]; /* the stages */
};

/* Free the low-latency mode's window (collective, as ep_free is). */
void moe_ep_ll_close(struct moe_ep_workspace *work);

/* Free the plans a wave forward kept (ep_waves.c), and what the two-stage
 * dispatch kept (ep_hier.c); ep_free calls them. */
void moe_ep_forget_waves(struct moe_ep_workspace *work);
void moe_ep_forget_hier(struct moe_ep_workspace *work);

/* The two-stage counterparts of moe_ep_forward_waves and
 * moe_ep_time_alltoalls (ep_hier.c), which call them for --dispatch
 * hierarchical. sched NULL: the blocking run (one wave, each all-to-all
 * waited for as soon as it is posted, no link model). */
int moe_ep_hier_forward(const moe_ep *ep, const moe_schedule *sched, const float *x,
                        const int32_t *ids, const float *weights, float *y,
                        moe_forward_stats *stats, moe_status *st);
double moe_ep_hier_time_alltoalls(const moe_ep *ep, const moe_schedule *sched);

/* What both pipelines share (ep_pipeline.c). */

/* Buffer slots for W waves of per_wave buffers each in *slots (*held waves
 * held); the slots of waves past W are handed back. */
void moe_ep_fit_slots(moe_buffer **slots, int *held, int W, int per_wave);

/* The compute clock of a pipeline, passed to the expert FFN's hooks: after
 * each compute stage it adds the stage's time, records its event, polls
 * the operations in flight, then calls `between` (the two-stage dispatch
 * relays there what has landed). */
typedef struct {
    moe_progress *progress;
    moe_trace *trace;  /* NULL: no events */
    double origin;     /* clock time (clock.h) of the aligned start */
    double mark;       /* start of the current compute segment */
    double compute;    /* compute seconds so far */
    int wave;
    moe_index rows;
    void (*between)(void *arg); /* NULL: nothing */
    void *between_arg;
    moe_index slots; /* rows of the layout tensors so far (moe_forward_stats.layout_slots) */
} moe_stage_clock;

/* Rows per exact-kernel chunk between polls: a few hundred microseconds of
 * L1 at d = 1024, so a poll costs well under 1 % of the compute around it. */
#define MOE_POLL_CHUNK_ROWS 32

void moe_pipeline_after_stage(void *clock, enum moe_ffn_stage stage);

/* The link model a schedule runs under: ep's, or none. */
const moe_link *moe_schedule_link(const moe_ep *ep, const moe_schedule *sched);

/* bytes ([in, out][tier]) += what an all-to-all moves over each tier:
 * in_rows (G) to this rank and out_rows (G) from it, row_bytes each;
 * messages to self cross no link. */
void moe_pipeline_link_bytes(const moe_ep *ep, const moe_index *in_rows, const moe_index *out_rows,
                             double row_bytes, double bytes[2][MOE_TIERS]);

/* Post time and modelled arrival (bytes: [in, out][tier] over this rank's
 * links) of operation op, just posted on comm; a modelled wait past
 * MOE_LINK_WAIT_MAX ends the job (exit 3) rather than holding it for hours. */
void moe_pipeline_track(moe_progress *p, int op, const moe_link *link, moe_link_state *links,
                        double bytes[2][MOE_TIERS], MPI_Comm comm);

/* A blocking exchange posted at `posted`, already complete in MPI: wait
 * (spinning) until the link model says it arrived, `rounds` latency-bound
 * rounds (a pull reads a ready mark before the rows: 2) moving bytes
 * ([in, out][tier]): moe_link_schedule, plus rounds - 1 more latencies of
 * the slowest tier it crosses; without a model at once. A wait past
 * MOE_LINK_WAIT_MAX ends the job. */
void moe_pipeline_hold(const moe_link *link, moe_link_state *links, double posted,
                       double bytes[2][MOE_TIERS], int rounds, MPI_Comm comm);

/* The count exchange before a forward's all-to-alls, posted at `posted`:
 * bytes_per_rank to and from every other rank, one round under the link
 * model (a decode-sized forward pays its latency, which the low-latency
 * mode skips). */
void moe_pipeline_count_round(const moe_ep *ep, const moe_link *link, double posted,
                              double bytes_per_rank);

/* A comm event runs from when its operation had the wire to itself, i.e.
 * from its post or the previous operation of its kind's completion,
 * whichever is later, to its completion: operations posted together then
 * show one after another, as they pass through the links. No trace: nothing. */
void moe_pipeline_comm_event(moe_trace *trace, const moe_comm_op *o, const moe_comm_op *previous,
                             double origin, int wave, int kind, int tier, double bytes,
                             moe_index rows);

/* Stage experts of one wave under clock: every local expert of recv (hooks
 * time and poll), then with sums the reduce at the source. */
void moe_pipeline_experts(const moe_ep *ep, const moe_recv_plan *recv, const float *const *row_at,
                          const int32_t *recv_meta, float *expert_out, float *sums,
                          float *expert_in, float *scratch, moe_stage_clock *clock);

/* A rank that fails inside the pipeline cannot stop the others together:
 * it ends the job (an injected fault stands for a failure here). */
void moe_pipeline_fail_here(const moe_comm *c, const char *stage);

/* MPI datatypes of one dispatched row as it travels (wire.h: its values in
 * --dispatch-dtype), of its meta (MOE_META_WORDS(k) int32 words) and of one
 * expert output on its way back (--combine-dtype). */
typedef struct {
    MPI_Datatype dispatch, meta, combine;
} moe_ep_types;
void moe_ep_types_create(const moe_ep *ep, moe_ep_types *types);
void moe_ep_types_free(moe_ep_types *types);

/* A wire buffer's rows as values: decoded into values, or (fp32, whose wire
 * rows are the values) wire itself without a copy. Returns the values. */
float *moe_ep_wire_values(const moe_wire *w, uint8_t *wire, moe_index rows, float *values);

/* After a stage that may have failed on some ranks: inject the test fault of
 * `stage` (moe_fault_here) on a rank that is still well, then agree. True
 * when every rank may go on; otherwise every rank's local holds the
 * collective error. Records when this rank got here (moe_ep_arrivals).
 * Collective. */
bool moe_ep_agreed(const moe_ep *ep, const char *stage, moe_status *local);

/* Stage pack. send_rows = the rows of x (T, d) that plan sends, as the wire
 * carries them (wire.h: quantised here, so that they decode to exactly the
 * rows of moe_ep_dispatched_tokens), in plan order (destination, then local
 * token), leaving out those for rank `stay` (-1: none), whose experts read
 * them where they are; send_meta (plan rows, MOE_META_WORDS(k)) = every
 * row's top-k ids, gate weights and global token id (layout.h), copied. */
void moe_ep_pack(const moe_ep *ep, const float *x, const int32_t *ids, const float *weights,
                 const moe_send_plan *plan, int stay, uint8_t *send_rows, int32_t *send_meta);

/* The tensor the expert GEMMs read (--expert-layout, layout.h) for recv:
 * its slots and, masked or contiguous, the tensor (slots, d), allocated
 * when opened; only the slots that hold rows are ever written (the pages
 * of the empty ones are never touched). */
typedef struct {
    moe_expert_slots slots;
    float *x; /* NULL: rows */
} moe_ep_layout;
void moe_ep_layout_open(const moe_ep *ep, const moe_recv_plan *recv, moe_ep_layout *t);
/* Local expert l's block of the tensor; NULL for rows. */
float *moe_ep_layout_block(const moe_ep *ep, const moe_ep_layout *t, int l);
void moe_ep_layout_close(moe_ep_layout *t);

/* Stage experts, for local expert l: lay the rows recv assigns it out
 * into its block of the layout tensor (block NULL, rows: into work; with
 * --gemm packed the rows layout reads them in place instead), from
 * where row_at (received rows) says each received row is, run the SwiGLU
 * FFN on them (with the gate weight from recv_meta (rows, MOE_META_WORDS(k))
 * applied before L2 when cfg->weight_at says so), round as --combine-dtype
 * says, scatter the outputs into expert_out (pairs, d). With m = max(n,
 * MOE_SHARED_ROW_BLOCK), work holds (m, d + 1) floats, scratch (m, 2f).
 * The expert's rows arrive in ascending global token order (layout.h), so
 * the GEMM calls are the same on every path and in every layout; with
 * packed and exact a row's output bits depend on nothing but the row. */
void moe_ep_expert(const moe_ep *ep, const moe_recv_plan *recv, int l,
                   const float *const *row_at, const int32_t *recv_meta, float *block, float *work,
                   float *scratch, float *expert_out, const moe_ffn_hooks *hooks);

/* --pad-to-capacity: the rows each expert computes, G C (C its capacity of
 * each rank's tokens, capacity.h), 0 without; moe_ep_expert adds the zero
 * rows that fill an expert to it after the expert's own rows. */
moe_index moe_ep_padded_rows(const moe_ep *ep);

/* The zero rows this rank computes when its experts compute `pairs` pairs:
 * its experts times moe_ep_padded_rows, less the pairs; 0 without padding. */
moe_index moe_ep_pad_rows(const moe_ep *ep, moe_index pairs);

/* sum (d) = a row's pair outputs out[s] (d each; NULL for a slot whose
 * expert is elsewhere) in slot order, each times its gate weight from the
 * row's meta when the weight is applied after L2, in fp32 from zero: what
 * one row of a reduced combine carries, before its rounding. row_meta NULL:
 * no weights (the backward's dx rows). */
void moe_ep_sum_slots(const moe_ep *ep, const int32_t *row_meta, const float *const *out, float *sum);

/* sum[j] += row[j] for j < d: one fp32 add a lane, in vectors (the same
 * bits as one at a time). */
void moe_ep_add_row(moe_index d, const float *restrict row, float *restrict sum);

/* Stage combine, at the source (--combine reduced): sums (recv->rows, d) =
 * per received row, moe_ep_sum_slots of its pairs in expert_out, rounded to
 * --combine-dtype: one row per (token, rank) goes back. For rows whose
 * pairs all ran together (one wave). recv_meta NULL: the rows' plain sums
 * (the dispatch backward's dx). */
void moe_ep_reduce_at_source(const moe_ep *ep, const moe_recv_plan *recv, const int32_t *recv_meta,
                             const float *expert_out, float *sums);

/* Stage reduce of a reduced combine: y (T, d) = for each token i, the sum of
 * the rows its destinations sent back (destinations as `to` places the
 * experts: ranks, or nodes for the two-stage dispatch), in ascending
 * destination order. The row from destination r arrives in the last wave
 * (of `count`, waves NULL: one) holding one of the token's experts on r,
 * among the rows from r of that wave in ascending token order; from[w * D +
 * r] is where they start. The order, and the bits, do not depend on W. */
void moe_ep_reduce_rows(const moe_ep *ep, const moe_placement *to, const int32_t *ids,
                        const moe_waves *waves, const float *const *from, int count, float *y);

/* Local routed expert n's weights (shared: shared expert n's) as the
 * forward's GEMMs take them; and as the backward's data GEMMs do, laid out
 * from those into scratch (moe_ep_grad_weights_floats; packed: nothing, the
 * GEMMs read the forward's panels): the rank keeps one copy of its
 * weights, not two. */
moe_expert_weights moe_ep_weights(const moe_ep *ep, bool shared, int n);
moe_index moe_ep_grad_weights_floats(const moe_ep *ep);
moe_expert_grad_weights moe_ep_grad_weights(const moe_ep *ep, bool shared, int n, float *scratch);

/* Rows of the work buffers the experts stage needs for recv: its largest
 * expert batch, and at least a shared-expert block (the shared stage reuses
 * them). */
static inline moe_index moe_ep_largest_batch(const moe_recv_plan *recv)
{
    moe_index most = MOE_SHARED_ROW_BLOCK;
    for (int l = 0; l < recv->local_experts; l++)
        if (recv->expert_offset[l + 1] - recv->expert_offset[l] > most)
            most = recv->expert_offset[l + 1] - recv->expert_offset[l];
    return most;
}

/* Stage reduce. y (T, d) = sum over the k slots of each token, in slot
 * order, of its expert output row slot_rows (T, k) points to, times the
 * slot's gate weight from weights (T, k) when it was not applied before L2.
 * Fixed order: the same bits whatever rank or wave each row came back from. */
void moe_ep_reduce(const moe_ep *ep, const float *const *slot_rows, const float *weights,
                   float *y);

/* Stage shared, the last of a forward. y (T, d) += the shared experts of x
 * (T, d), in blocks of MOE_SHARED_ROW_BLOCK tokens; scratch (64, 2f), out
 * (64, d). Records its time and the forward's end (y complete) in stats.
 * y NULL: out (S, T, d) keeps every expert's outputs instead, the same
 * bits, for a caller to add to y in expert order later. */
void moe_ep_shared(const moe_ep *ep, const float *x, float *y, float *scratch, float *out,
                   moe_forward_stats *stats);

/* y (T, d) += out (S, T, d), shared expert by shared expert: what
 * moe_ep_shared adds, the same bits. */
void moe_ep_shared_add(const moe_ep *ep, const float *out, float *y);

/* The shared experts as pieces of work that a pipeline runs while it waits
 * for an all-to-all, as DeepSeek-V3 computes its shared expert while the
 * dispatch is on the wire: piece n is shared expert n / B on the (n % B)-th
 * block of MOE_SHARED_ROW_BLOCK tokens (B blocks), the call moe_ep_shared
 * makes, into out (S, T, d); moe_ep_shared_add then adds them to y. The
 * same bits whenever each piece runs. */
typedef struct {
    const moe_ep *ep;
    const float *x;        /* (T, d) */
    float *scratch, *out;  /* (64, 2f), (S, T, d) */
    int next, pieces;
    double seconds, flops; /* in the pieces run so far; their sgemm FLOPs */
    moe_trace *trace;      /* an event per piece; NULL: none */
    double origin;
} moe_shared_work;

void moe_shared_work_init(moe_shared_work *w, const moe_ep *ep, const float *x, float *scratch,
                          float *out, moe_trace *trace, double origin);
/* Run the next piece (hooks between its stages, or NULL); false when none
 * was left. */
bool moe_shared_work_step(moe_shared_work *w, const moe_ffn_hooks *hooks);

/* After the reduce: the pieces the waits left, then every shared expert's
 * outputs added to y (T, d) as moe_ep_shared_add adds them. Records the
 * stage's time (stats->fill_seconds, the pieces in the waits, and this)
 * and the forward's end in stats. */
void moe_shared_work_finish(moe_shared_work *w, float *y, moe_forward_stats *stats);

/* Pieces of w until op has completed or none are left, the operations in
 * flight polled before each piece and between its stages, each poll
 * followed by between(arg) when between is not NULL. */
void moe_pipeline_fill(moe_progress *p, int op, moe_shared_work *w, void (*between)(void *arg),
                       void *arg);

/* One reference forward's plan and buffers on this rank (ep_ref.c): what
 * the blocking backward (ep_backward.c) reads as the forward's saved state. */
typedef struct {
    moe_pool *pool;                    /* where the buffers below come from (the workspace's) */
    moe_ep_types types;                /* a row, its meta, an output, as they travel */
    moe_wire dispatch_wire, combine_wire;
    int *counts;                       /* (4, G): the four arrays below */
    int *send_counts, *send_at;        /* (G) rows to each rank, and where they start */
    int *recv_counts, *recv_at;        /* (G) rows from each rank, and where they land */
    moe_index *rows_from;              /* (G) rows received from each rank */
    moe_index rows_in;
    moe_send_plan send;
    moe_recv_plan recv;
    uint8_t *send_rows, *recv_rows;    /* wire rows: (rows out), (rows_in) */
    float *recv_decoded, *recv_values; /* (rows_in, d): decoded, or recv_rows itself (fp32) */
    int32_t *send_meta, *recv_meta;    /* (rows out, MOE_META_WORDS(k)), (rows_in, ...) */
    float *expert_in, *scratch;        /* the largest expert batch's rows and activations */
    float *expert_out;                 /* (pairs received, d) */
    uint8_t *out_wire;                 /* what travels back: expert_out or the sums, as the wire has them */
    float *sums;                       /* --combine reduced: (rows_in, d) one row per (token, rank) */
    uint8_t *back;                     /* (pairs sent) wire rows: the outputs of this rank's tokens */
    float *back_decoded;               /* (pairs sent, d) decoded, unless fp32 */
} moe_ref_forward;

/* Where the reference forward's all-to-alls go when a schedule interleaves
 * it with other work (DualPipe's pairing, ep_backward.c): posted on
 * progress, the dispatch as operation op and the combine as op + 1, under
 * the link model; the caller waits for each before the next step. */
typedef struct {
    moe_progress *progress;
    int op;
    const moe_link *link;
    moe_link_state *links;
} moe_ref_flight;

/* The reference forward in three steps, its all-to-alls in flight:
 *   moe_ep_ref_begin     plan (one count exchange, agreed on: collective),
 *                        pack, post the dispatch; MOE_EXIT_OK or the
 *                        collective error, in st
 *   moe_ep_ref_experts   once the dispatch is in: the receive plan, the
 *                        experts (polling between them), post the combine;
 *                        a buffer that cannot be allocated ends the job
 *   moe_ep_ref_end       once the combine is in: reduce, shared experts
 * The same computations as moe_ep_ref_run: the same bits. f is freed with
 * moe_ep_ref_free whatever the result. */
int moe_ep_ref_begin(const moe_ep *ep, const float *x, const int32_t *ids, const float *weights,
                     moe_ref_forward *f, moe_forward_stats *stats, const moe_ref_flight *flight,
                     moe_status *st);
void moe_ep_ref_experts(const moe_ep *ep, moe_ref_forward *f, moe_forward_stats *stats,
                        const moe_ref_flight *flight);
void moe_ep_ref_end(const moe_ep *ep, moe_ref_forward *f, const float *x, const int32_t *ids,
                    const float *weights, float *y, moe_forward_stats *stats);

/* The blocking reference forward (moe_ep_forward_ref) keeping its plan and
 * buffers in *f, which the caller frees with moe_ep_ref_free whatever the
 * result. Collective. */
int moe_ep_ref_run(const moe_ep *ep, const float *x, const int32_t *ids, const float *weights,
                   float *y, moe_forward_stats *stats, moe_ep_capture *capture,
                   moe_ref_forward *f, moe_status *st);
void moe_ep_ref_free(moe_ref_forward *f);
/* Frees what only the forward itself uses (its send, combine and expert
 * buffers), keeping the plans, the received rows and ids and the expert
 * outputs: what a backward reads. */
void moe_ep_ref_release(moe_ref_forward *f);

#endif
