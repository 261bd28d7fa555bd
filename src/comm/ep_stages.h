/* ep_stages.h — the stages both EP paths share, and their private plumbing.
 *
 * Not a public header: only ep.c, ep_ref.c and ep_waves.c include it. Each
 * stage is one function with one contract; shapes use the dims.h letters.
 *
 *   stage     reference path (ep_ref.c)     wave path (ep_waves.c)       shared here
 *   route     moe_ep_route (ep.h)           the same                      yes
 *   plan      ref_plan, ref_plan_receive    waves_plan, wave_plan_receive
 *   pack      moe_ep_pack                   the same, per wave            yes
 *   dispatch  ref_dispatch (MPI_Alltoallv)  wave_dispatch (Ialltoallv)
 *   experts   moe_ep_expert per expert      the same, per wave            yes
 *   combine   ref_combine (MPI_Alltoallv)   wave_combine (Ialltoallv)
 *   reduce    moe_ep_reduce                 the same, every wave at once  yes
 *   shared    moe_ep_shared                 the same                      yes
 */
#ifndef MOE_EP_STAGES_H
#define MOE_EP_STAGES_H

#include "moe/ep.h"
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
       MOE_WAVE_SUMS, /* --combine reduced */
       MOE_WAVE_BUFFERS };

struct moe_wave_state; /* one wave's plan and buffers (ep_waves.c) */

struct moe_ep_workspace {
    int waves;              /* wave slots held */
    moe_buffer *wave;       /* (waves, MOE_WAVE_BUFFERS) */
    moe_buffer expert_in;   /* the largest expert batch's rows (moe_ep_expert's work) */
    moe_buffer scratch;     /* and its activations */
    moe_buffer slot_rows;   /* the reduce table */
    moe_buffer x_scratch;   /* the quantised tokens (--dispatch-dtype) */
    /* The last wave forward's plans, kept for moe_ep_time_alltoalls. */
    struct moe_wave_state *last;
    int last_waves;
};

/* Frees the plans a wave forward kept (ep_waves.c); ep_free calls it. */
void moe_ep_forget_waves(struct moe_ep_workspace *work);

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
 * collective error. Collective. */
bool moe_ep_agreed(const moe_comm *c, const char *stage, moe_status *local);

/* Stage pack. send_rows = the rows of x (T, d) that plan sends, as the wire
 * carries them (wire.h: quantised here, so that they decode to exactly the
 * rows of moe_ep_dispatched_tokens), in plan order (destination, then local
 * token), leaving out those for rank `stay` (-1: none), whose experts read
 * them where they are; send_meta (plan rows, MOE_META_WORDS(k)) = every
 * row's top-k ids, gate weights and global token id (layout.h), copied. */
void moe_ep_pack(const moe_ep *ep, const float *x, const int32_t *ids, const float *weights,
                 const moe_send_plan *plan, int stay, uint8_t *send_rows, int32_t *send_meta);

/* Stage experts, for local expert l: gather the rows recv assigns it from
 * where row_at (received rows) says each received row is, run the SwiGLU
 * FFN (with the gate weight from recv_meta (rows, 2k + 1) applied before L2
 * when cfg->weight_at says so), round as --combine-dtype says, scatter the
 * outputs into expert_out (pairs, d). work holds (n, d + 1) floats, scratch
 * (n, 2f). The expert's rows arrive in ascending global token order
 * (layout.h), so the GEMM calls are the same on every path; with packed and
 * exact a row's output bits depend on nothing but the row. */
void moe_ep_expert(const moe_ep *ep, const moe_recv_plan *recv, int l,
                   const float *const *row_at, const int32_t *recv_meta, float *work,
                   float *scratch, float *expert_out, const moe_ffn_hooks *hooks);

/* Stage combine, at the source (--combine reduced): sums (recv->rows, d) =
 * per received row, the sum of its pairs' outputs in slot order (each
 * times its gate weight when the weight is applied after L2), in fp32,
 * then rounded to --combine-dtype: one row per (token, rank) goes back. */
void moe_ep_reduce_at_source(const moe_ep *ep, const moe_recv_plan *recv, const int32_t *recv_meta,
                             const float *expert_out, float *sums);

/* Stage reduce of a reduced combine: y (T, d) = for each token, the sum of
 * the rows its destinations sent back, over plans (count of them, one per
 * wave) and, within each, destinations in ascending rank order. from[n *
 * ranks + r] is where plan n's rows back from rank r start. A token's rows
 * are all in one plan with waves of tokens, so the order, and the bits, do
 * not depend on W. */
void moe_ep_reduce_rows(const moe_ep *ep, const moe_send_plan *const *plans, const float *const *from,
                        int count, float *y);

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
 * (64, d). Records its time and the forward's end (y complete) in stats. */
void moe_ep_shared(const moe_ep *ep, const float *x, float *y, float *scratch, float *out,
                   moe_forward_stats *stats);

#endif
