/* SPDX-License-Identifier: MIT */
/* ep_waves.c — the wave-pipelined EP forward (see ep.h).
 *
 * The forward is split into W waves (layout.h: groups of expert slots, or
 * token chunks). Each wave has its own plan, its own MPI_Ialltoallv for
 * dispatch and for combine, and its own expert GEMMs. The forward reads as
 * its stages:
 *
 *   waves_plan       every wave's rows; one count exchange; buffers
 *   waves_pack       every wave's rows and ids into its send buffers
 *   waves_pipeline   dispatch, experts and combine of the waves, overlapped
 *   waves_reduce     reduce in slot order, then the shared experts the
 *                    pipeline's waits left, and every shared output added
 *
 * The pipeline keeps the neighbours of the computing wave on the wire (the
 * seed's five stages):
 *
 *   wave_dispatch(0 .. A)                       A = lookahead (1: the seed's
 *   for w = 0 .. W-1:                           neighbour-wave schedule)
 *       wave_dispatch(w+A) once w > 0           later waves' rows in flight
 *       wait dispatch(w); wave_plan_receive(w)  shared experts while waiting
 *       experts(w): L1, activation, L2          combine(w-1), dispatch(w+1)
 *                                               progress at every stage end
 *       wave_combine(w)
 *   wait every combine                          shared experts while waiting
 *
 * Every expert's rows arrive in one wave, in global token order, so with
 * expert-slot waves the GEMM calls are the blocking path's, bit for bit.
 *
 * The pass that times the all-to-alls alone (T_comm of the overlap) is not
 * part of the forward: moe_ep_time_alltoalls re-posts the last forward's
 * all-to-alls when a report or a benchmark asks for it.
 */
#include <stdlib.h>
#include <string.h>

#include "moe/ep.h"
#include "moe/gemm.h"
#include "moe/progress.h"
#include "moe/watchdog.h"
#include "ep_stages.h"

/* One wave's plan and buffers on this rank. */
typedef struct moe_wave_state {
    moe_send_plan send;
    moe_recv_plan recv;
    moe_index rows_out, rows_in, pairs_in;
    moe_index out_rows, back_in; /* rows the combine sends (pairs, or sums), rows back from others */
    moe_index *rows_from;                        /* (G) */
    int *counts;                                 /* (N_COUNTS, G): see the enum below */
    /* In ep->work. A rank's rows for its own experts, and their outputs,
     * never go through MPI: the experts read them from the tokens, the reduce
     * from expert_out, and send_rows, recv_rows and back hold only the rows
     * that travel. */
    uint8_t *send_rows, *recv_rows;  /* wire rows (wire.h) */
    float *recv_values;              /* recv_rows decoded, or recv_rows itself (fp32) */
    float *expert_out;               /* (pairs_in, d) */
    float *sums;                     /* --combine reduced: (out_rows, d) one per (token, rank) whose
                                        last wave here this is; else NULL */
    int32_t *slot_pair;              /* --combine reduced: (rows_in, k) the pair of each (row, slot), -1 */
    moe_index *closing_from;         /* --combine reduced: (G) rows from each source that close here */
    uint8_t *out_wire, *back;        /* expert_out as it travels (or itself, fp32); wire rows back */
    float *back_values;              /* back decoded, or back itself (fp32) */
    int32_t *send_meta, *recv_meta;  /* (rows, MOE_META_WORDS(k)), all rows */
    const float **row_at;            /* (rows_in) where each received row is */
    const float **from;              /* (G) where the pairs back from each rank start */
    double dispatch_bytes[2][MOE_TIERS]; /* over the links: [in, out][tier] */
    double combine_bytes[2][MOE_TIERS];
} wave_state;

/* One wave forward on this rank: the waves, their states, the shared
 * buffers (all in ep->work). */
typedef struct {
    moe_ep_types types;               /* a row, its meta, an output, as they travel */
    moe_wire dispatch_wire, combine_wire;
    moe_waves waves;
    wave_state *ws;                   /* (W) */
    float *expert_in, *scratch;       /* the largest expert batch's rows and activations */
    const float **slot_rows;          /* (T, k) the reduce table */
    float *x_scratch;                 /* (T, d) the quantised tokens, or NULL */
    moe_index *closing;               /* --combine reduced: (W, G) rows back from each rank per wave */
    const float *x_dispatch;          /* (T, d) the tokens as dispatched */
    float *shared_out;                /* (S, T, d) the shared experts' outputs, or NULL */
    moe_shared_work shared;           /* their pieces, run while the pipeline waits */
} waves_forward;

/* MPI counts and displacements, in rows: dispatch meta (every row), dispatch
 * rows and combine rows (other ranks' only: the count to self is 0, and only
 * expert_out, which the reduce reads, keeps room for self). */
enum {
    D_SEND, D_SEND_AT, D_RECV, D_RECV_AT, /* meta */
    R_SEND, R_SEND_AT, R_RECV, R_RECV_AT, /* rows */
    C_SEND, C_SEND_AT, C_RECV, C_RECV_AT, /* expert outputs */
    N_COUNTS
};
#define COUNTS(ws, which, G) ((ws)->counts + (size_t)(which) * (size_t)(G))

/* moe_to_counts without rank me: its count 0, the others packed. */
static void remote_counts(const moe_index *count, int G, int me, int *counts, int *displs)
{
    int at = 0;
    for (int r = 0; r < G; r++) {
        counts[r] = r == me ? 0 : (int)count[r];
        displs[r] = at;
        at += counts[r];
    }
}

/* Where each received row of a wave is: other ranks' in recv_rows, this
 * rank's own still in the tokens, in the order it would have sent them. */
static void row_table(wave_state *s, int G, int me, moe_index d, const float *x_dispatch)
{
    moe_index m = 0;
    for (int r = 0; r < G; r++) {
        const float *first = s->recv_values + (moe_index)COUNTS(s, R_RECV_AT, G)[r] * d;
        const moe_index *own = s->send.row_token + s->send.row_offset[me];
        for (moe_index j = 0; j < s->rows_from[r]; j++)
            s->row_at[m++] = r == me ? x_dispatch + own[j] * d : first + j * d;
    }
}

/* A wave's dispatch (its travelling rows, then every row's ids: two
 * requests) and combine (one): the calls the pipeline posts and the pass
 * that times the all-to-alls alone repeats. */
static void start_dispatch(wave_state *ws, int G, const moe_ep_types *t, MPI_Comm comm,
                           MPI_Request requests[2])
{
    MOE_MPI(MPI_Ialltoallv(ws->send_rows, COUNTS(ws, R_SEND, G), COUNTS(ws, R_SEND_AT, G), t->dispatch,
                           ws->recv_rows, COUNTS(ws, R_RECV, G), COUNTS(ws, R_RECV_AT, G), t->dispatch, comm,
                           &requests[0]));
    MOE_MPI(MPI_Ialltoallv(ws->send_meta, COUNTS(ws, D_SEND, G), COUNTS(ws, D_SEND_AT, G), t->meta,
                           ws->recv_meta, COUNTS(ws, D_RECV, G), COUNTS(ws, D_RECV_AT, G), t->meta, comm,
                           &requests[1]));
}

static void start_combine(wave_state *ws, int G, const moe_ep_types *t, MPI_Comm comm,
                          MPI_Request requests[1])
{
    MOE_MPI(MPI_Ialltoallv(ws->out_wire, COUNTS(ws, C_SEND, G), COUNTS(ws, C_SEND_AT, G), t->combine,
                           ws->back, COUNTS(ws, C_RECV, G), COUNTS(ws, C_RECV_AT, G), t->combine, comm,
                           &requests[0]));
}

static void wave_dispatch(wave_state *ws, moe_progress *p, int op, int G, const moe_ep_types *t,
                          MPI_Comm comm, const moe_link *link, moe_link_state *links)
{
    moe_comm_op *o = &p->ops[op];
    int self;
    MOE_MPI(MPI_Comm_rank(comm, &self));
    moe_comm_count_posted(COUNTS(ws, R_SEND, G), G, self, t->dispatch);
    moe_comm_count_posted(COUNTS(ws, D_SEND, G), G, self, t->meta);
    moe_progress_lock(p);
    start_dispatch(ws, G, t, comm, o->requests);
    o->count = 2;
    moe_pipeline_track(p, op, link, links, ws->dispatch_bytes, comm);
    moe_progress_unlock(p);
}

static void wave_combine(wave_state *ws, moe_progress *p, int op, int G, const moe_ep_types *t,
                         const moe_wire *wire, MPI_Comm comm, const moe_link *link,
                         moe_link_state *links)
{
    moe_comm_op *o = &p->ops[op];
    int self;
    MOE_MPI(MPI_Comm_rank(comm, &self));
    const float *values = ws->sums ? ws->sums : ws->expert_out;
    if (ws->out_wire != (const uint8_t *)values) /* bf16 on the wire */
        moe_wire_encode(wire, values, NULL, ws->out_rows, ws->out_wire);
    moe_comm_count_posted(COUNTS(ws, C_SEND, G), G, self, t->combine);
    moe_progress_lock(p);
    start_combine(ws, G, t, comm, o->requests);
    o->count = 1;
    moe_pipeline_track(p, op, link, links, ws->combine_bytes, comm);
    moe_progress_unlock(p);
}

static void free_waves(wave_state *waves, int W)
{
    for (int w = 0; w < W; w++) {
        wave_state *ws = &waves[w];
        moe_send_plan_free(&ws->send);
        moe_recv_plan_free(&ws->recv);
        free(ws->rows_from);
        free(ws->counts);
        free(ws->from);
        free(ws->closing_from);
    }
    free(waves);
}

void moe_ep_forget_waves(struct moe_ep_workspace *work)
{
    if (work->last)
        free_waves(work->last, work->last_waves);
    work->last = NULL;
    work->last_waves = 0;
}

/* (W, G): the rows a reduced combine brings back to this rank from each
 * rank in each wave: one per (token, rank), in the token's last wave there. */
static moe_index *last_waves(const moe_placement *p, const moe_waves *waves, const int32_t *ids,
                             moe_index T, int k)
{
    const int G = p->ranks;
    moe_index *rows = moe_xcalloc((size_t)(waves->waves * G), sizeof(moe_index));
    int dest[k > 0 ? k : 1], last[k > 0 ? k : 1];
    for (moe_index i = 0; i < T; i++)
        for (int n = moe_token_destinations(p, waves, ids, k, i, dest, last) - 1; n >= 0; n--)
            rows[last[n] * G + dest[n]]++;
    return rows;
}

/* Each wave's send plan, and the counts every rank sends every other: per
 * (rank, wave) its rows, then its pairs per local expert of the receiver
 * (stride 1 + the most experts a rank holds). Returns counts_in (G, W,
 * stride), the counts this rank receives; one MPI_Alltoall, one round of
 * the link model. */
static int *exchange_counts(const moe_ep *ep, const moe_schedule *sched, const int32_t *ids,
                            waves_forward *f, int stride)
{
    const moe_comm *c = &ep->comm;
    const int G = c->ranks, k = (int)ep->cfg->topk, W = sched->waves;
    const moe_index T = ep->cfg->tokens;
    int *counts_out = moe_xcalloc((size_t)(G * W * stride), sizeof(int)); /* (G, W, stride) */
    int *counts_in = moe_xmalloc(sizeof(int) * (size_t)(G * W * stride));
    for (int w = 0; w < W; w++) {
        moe_send_plan_build(&f->ws[w].send, &ep->placement, ids, T, k, &f->waves, w);
        for (int r = 0; r < G; r++)
            counts_out[(r * W + w) * stride] = (int)f->ws[w].send.row_count[r];
    }
    for (moe_index i = 0; i < T; i++)
        for (int slot = 0; slot < k; slot++) {
            const int e = ids[i * k + slot];
            if (e == MOE_DROPPED)
                continue;
            const int r = ep->placement.expert_rank[e], l = e - ep->placement.first_expert[r];
            counts_out[(r * W + moe_wave_of(&f->waves, i, e)) * stride + 1 + l]++;
        }
    const double counts_posted = moe_stage_begin();
    moe_watch_wait(MOE_WATCH_PLAN, -1);
    MOE_MPI(MPI_Alltoall(counts_out, W * stride, MPI_INT, counts_in, W * stride, MPI_INT, c->comm));
    moe_watch_done();
    moe_pipeline_count_round(ep, moe_schedule_link(ep, sched), counts_posted,
                             sizeof(int) * (double)(W * stride));
    free(counts_out);
    return counts_in;
}

/* Wave w's receive side from counts_in: rows and pairs from each rank, its
 * counts for the all-to-alls both ways, its bytes on the links. Returns
 * the rows of its largest expert batch. */
static moe_index wave_counts(const moe_ep *ep, waves_forward *f, int w, const int *counts_in,
                             int stride)
{
    const int G = ep->comm.ranks, me = ep->comm.rank, W = f->waves.waves;
    wave_state *s = &f->ws[w];
    s->rows_from = moe_xmalloc(sizeof(moe_index) * (size_t)G);
    s->counts = moe_xmalloc(sizeof(int) * (size_t)(N_COUNTS * G));
    s->from = moe_xmalloc(sizeof(float *) * (size_t)G);
    s->rows_in = s->pairs_in = 0;
    for (int r = 0; r < G; r++) {
        const int *in = counts_in + (r * W + w) * stride;
        s->rows_from[r] = in[0];
        s->rows_in += in[0];
        for (int l = 0; l < stride - 1; l++)
            s->pairs_in += in[1 + l];
    }
    moe_index most = 0;
    for (int l = 0; l < ep->local_experts; l++) {
        moe_index rows = 0; /* expert l's batch in this wave */
        for (int r = 0; r < G; r++)
            rows += counts_in[(r * W + w) * stride + 1 + l];
        most = rows > most ? rows : most;
    }
    s->rows_out = s->send.row_offset[G];
    memset(s->dispatch_bytes, 0, sizeof s->dispatch_bytes);
    moe_pipeline_link_bytes(ep, s->rows_from, s->send.row_count, moe_dispatch_row_bytes(ep->cfg),
                            s->dispatch_bytes);
    moe_to_counts(s->send.row_count, G, COUNTS(s, D_SEND, G), COUNTS(s, D_SEND_AT, G));
    moe_to_counts(s->rows_from, G, COUNTS(s, D_RECV, G), COUNTS(s, D_RECV_AT, G));
    remote_counts(s->send.row_count, G, me, COUNTS(s, R_SEND, G), COUNTS(s, R_SEND_AT, G));
    remote_counts(s->rows_from, G, me, COUNTS(s, R_RECV, G), COUNTS(s, R_RECV_AT, G));
    /* Back: a row per pair, or with a reduced combine a row per (token,
     * rank) in the last wave that holds one of its experts there. */
    const bool reduced = ep->cfg->combine == MOE_COMBINE_REDUCED;
    const moe_index *back_count = reduced ? f->closing + w * G : s->send.pair_count;
    remote_counts(back_count, G, me, COUNTS(s, C_RECV, G), COUNTS(s, C_RECV_AT, G));
    moe_index back = -back_count[me];
    for (int r = 0; r < G; r++)
        back += back_count[r];
    s->back_in = back;
    s->out_rows = reduced ? s->rows_in : s->pairs_in;
    return most;
}

/* Wave w's buffers, from the workspace's slots for it (kept across
 * forwards); a failed allocation is noted in local. */
static void wave_buffers(const moe_ep *ep, waves_forward *f, int w, moe_status *local)
{
    const moe_config *cfg = ep->cfg;
    const int me = ep->comm.rank, k = (int)cfg->topk;
    wave_state *s = &f->ws[w];
    moe_buffer *b = ep->work->wave + w * MOE_WAVE_BUFFERS;
    const bool reduced = cfg->combine == MOE_COMBINE_REDUCED;
    const size_t row = sizeof(float) * (size_t)cfg->hidden, meta = sizeof(int32_t) * (size_t)MOE_META_WORDS(k);
    const size_t wire_in = f->dispatch_wire.bytes, wire_out = f->combine_wire.bytes;
    const moe_index remote_in = s->rows_in - s->rows_from[me], back = s->back_in;
    s->sums = reduced ? moe_buffer_fit(&b[MOE_WAVE_SUMS], row * (size_t)s->rows_in, "sums", me, local) : NULL;
    s->slot_pair = reduced ? moe_buffer_fit(&b[MOE_WAVE_SLOT_PAIR], sizeof(int32_t) * (size_t)(s->rows_in * k), "the pairs of each row", me, local) : NULL;
    s->closing_from = reduced ? moe_xcalloc((size_t)ep->comm.ranks, sizeof(moe_index)) : NULL;
    s->send_rows = moe_buffer_fit(&b[MOE_WAVE_SEND_ROWS], wire_in * (size_t)(s->rows_out - s->send.row_count[me]), "dispatch rows", me, local);
    s->send_meta = moe_buffer_fit(&b[MOE_WAVE_SEND_META], meta * (size_t)s->rows_out, "dispatch ids", me, local);
    s->recv_rows = moe_buffer_fit(&b[MOE_WAVE_RECV_ROWS], wire_in * (size_t)remote_in, "received rows", me, local);
    s->recv_meta = moe_buffer_fit(&b[MOE_WAVE_RECV_META], meta * (size_t)s->rows_in, "received ids", me, local);
    s->expert_out = moe_buffer_fit(&b[MOE_WAVE_EXPERT_OUT], row * (size_t)s->pairs_in, "expert outputs", me, local);
    s->back = moe_buffer_fit(&b[MOE_WAVE_BACK], wire_out * (size_t)back, "combined rows", me, local);
    /* bf16 or fp8 on the wire: the values decoded beside the wire rows */
    const bool narrow_in = f->dispatch_wire.dtype != MOE_DTYPE_FP32, narrow_out = f->combine_wire.dtype != MOE_DTYPE_FP32;
    s->recv_values = narrow_in ? moe_buffer_fit(&b[MOE_WAVE_RECV_VALUES], row * (size_t)remote_in, "decoded rows", me, local)
                               : (float *)s->recv_rows;
    s->out_wire = narrow_out ? moe_buffer_fit(&b[MOE_WAVE_OUT_WIRE], wire_out * (size_t)s->out_rows, "expert outputs on the wire", me, local)
                             : (uint8_t *)(reduced ? s->sums : s->expert_out);
    s->back_values = narrow_out ? moe_buffer_fit(&b[MOE_WAVE_BACK_VALUES], row * (size_t)back, "decoded outputs", me, local)
                                : (float *)s->back;
    s->row_at = moe_buffer_fit(&b[MOE_WAVE_ROW_AT], sizeof(float *) * (size_t)s->rows_in, "the row table", me, local);
}

/* The buffers every wave shares: the expert batch's rows and activations
 * (most rows), the reduce table, the quantised tokens, the shared
 * experts' outputs. */
static void shared_buffers(const moe_ep *ep, waves_forward *f, moe_index most, moe_status *local)
{
    const moe_config *cfg = ep->cfg;
    const int me = ep->comm.rank;
    const moe_index T = cfg->tokens, d = cfg->hidden, k = cfg->topk;
    struct moe_ep_workspace *work = ep->work;
    f->expert_in = moe_buffer_fit(&work->expert_in, sizeof(float) * (size_t)(most * MOE_EXPERT_WORK_FLOATS(d)), "expert rows", me, local);
    f->scratch = moe_buffer_fit(&work->scratch, sizeof(float) * (size_t)(most * 2 * cfg->ffn), "expert activations", me, local);
    f->slot_rows = moe_buffer_fit(&work->slot_rows, sizeof(float *) * (size_t)(T * k), "the reduce table", me, local);
    if (f->slot_rows) /* a dropped pair's slot stays NULL: no wave fills it */
        memset(f->slot_rows, 0, sizeof(float *) * (size_t)(T * k));
    if (cfg->dispatch_dtype != MOE_DTYPE_FP32)
        f->x_scratch = moe_buffer_fit(&work->x_scratch, sizeof(float) * (size_t)(T * d), "the quantised tokens", me, local);
    if (cfg->shared_experts > 0)
        f->shared_out = moe_buffer_fit(&work->shared_out, sizeof(float) * (size_t)(cfg->shared_experts * T * d),
                                       "shared-expert outputs", me, local);
}

/* Stage plan, for every wave at once: each wave's rows per destination, one
 * count exchange for all of them (per destination and wave, the rows, then
 * the pairs of each of the destination's experts: EM slots, EM the most
 * experts a rank holds), so that every buffer is sized exactly before
 * anything moves. Allocation failures are recorded in local. */
static void waves_plan(const moe_ep *ep, const moe_schedule *sched, const int32_t *ids,
                       waves_forward *f, moe_forward_stats *stats, moe_status *local)
{
    const moe_config *cfg = ep->cfg;
    const int G = ep->comm.ranks, W = sched->waves;
    moe_waves_init_by(&f->waves, &ep->placement, W, cfg->tokens, moe_ep_wave_by(ep, sched));
    stats->wave_kind = f->waves.kind;
    int EM = 0;
    for (int r = 0; r < G; r++)
        if (moe_placement_local_experts(&ep->placement, r) > EM)
            EM = moe_placement_local_experts(&ep->placement, r);
    const int stride = 1 + EM; /* counts of one (rank, wave) */
    f->ws = moe_xcalloc((size_t)W, sizeof *f->ws);
    int *counts_in = exchange_counts(ep, sched, ids, f, stride);
    moe_ep_fit_slots(&ep->work->wave, &ep->work->waves, W, MOE_WAVE_BUFFERS);
    f->closing = cfg->combine == MOE_COMBINE_REDUCED
                     ? last_waves(&ep->placement, &f->waves, ids, cfg->tokens, (int)cfg->topk) : NULL;
    moe_index most = MOE_SHARED_ROW_BLOCK; /* rows of the largest expert batch, for scratch */
    for (int w = 0; w < W; w++) {
        const moe_index rows = wave_counts(ep, f, w, counts_in, stride);
        most = rows > most ? rows : most;
        wave_buffers(ep, f, w, local);
    }
    shared_buffers(ep, f, most, local);
    free(counts_in);
}

/* Stage pack, every wave: rows for other ranks into the wave's send buffer
 * (this rank's own stay in the tokens), every row's ids. */
static void waves_pack(const moe_ep *ep, const moe_schedule *sched, const float *x,
                       const int32_t *ids, const float *weights, waves_forward *f)
{
    f->x_dispatch = moe_ep_dispatched_tokens(ep, x, f->x_scratch); /* this rank's own rows */
    moe_shared_work_init(&f->shared, ep, x, f->scratch, f->shared_out, sched->trace, sched->origin);
    for (int w = 0; w < sched->waves; w++)
        moe_ep_pack(ep, x, ids, weights, &f->ws[w].send, ep->comm.rank, f->ws[w].send_rows,
                    f->ws[w].send_meta);
}

static void close_rows(const moe_ep *ep, const waves_forward *f, int w);

/* Stage plan, receive side of wave w (once its dispatch has arrived): which
 * received row visits which local expert, the combine counts, and where
 * each received row is. */
static void wave_plan_receive(const moe_ep *ep, const waves_forward *f, int w)
{
    const int G = ep->comm.ranks, me = ep->comm.rank;
    wave_state *s = &f->ws[w];
    moe_recv_plan_build(&s->recv, &ep->placement, me, s->recv_meta, s->rows_in,
                        (int)ep->cfg->topk, s->rows_from, &f->waves, w);
    MOE_ASSERT(s->recv.pairs == s->pairs_in);
    const bool reduced = s->sums != NULL; /* rows go back summed, in their last wave here */
    if (reduced)
        close_rows(ep, f, w);
    moe_to_counts(reduced ? s->closing_from : s->recv.source_pairs, G, COUNTS(s, C_SEND, G),
                  COUNTS(s, C_SEND_AT, G));
    COUNTS(s, C_SEND, G)[me] = 0;
    moe_ep_wire_values(&f->dispatch_wire, s->recv_rows, s->rows_in - s->rows_from[me], s->recv_values);
    row_table(s, G, me, ep->cfg->hidden, f->x_dispatch);
    memset(s->combine_bytes, 0, sizeof s->combine_bytes);
    moe_pipeline_link_bytes(ep, reduced ? f->closing + w * G : s->send.pair_count,
               reduced ? s->closing_from : s->recv.source_pairs, moe_combine_row_bytes(ep->cfg),
               s->combine_bytes);
}

/* The waves of a received row's slots on this rank (wave[s], -1 for a slot
 * whose expert is elsewhere; wave may be NULL) and the last of them: the
 * wave whose combine takes the row's sum back. source: its home rank. */
static int row_waves(const moe_ep *ep, const waves_forward *f, const int32_t *meta, int source,
                     int *wave)
{
    const int k = (int)ep->cfg->topk;
    const moe_index token = moe_meta_token(meta, k) - (moe_index)source * ep->cfg->tokens;
    int last = -1;
    for (int slot = 0; slot < k; slot++) {
        const int e = moe_meta_id(meta, slot);
        const int v = e != MOE_DROPPED && ep->placement.expert_rank[e] == ep->comm.rank
                          ? moe_wave_of(&f->waves, token, e) : -1;
        if (wave)
            wave[slot] = v;
        last = v > last ? v : last;
    }
    return last;
}

/* The received row of wave w holding global token `token`: rows arrive in
 * ascending global token order (layout.h). -1: none. */
static moe_index find_row(const wave_state *s, int k, int32_t token)
{
    moe_index lo = 0, hi = s->rows_in;
    while (lo < hi) {
        const moe_index mid = lo + (hi - lo) / 2;
        if (moe_meta_token(s->recv_meta + mid * MOE_META_WORDS(k), k) < token)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < s->rows_in && moe_meta_token(s->recv_meta + lo * MOE_META_WORDS(k), k) == token ? lo : -1;
}

/* --combine reduced, receive side of wave w: each (row, slot)'s pair, and
 * which rows close here (their token's last wave on this rank is w: they go
 * back summed in this wave's combine), per source. */
static void close_rows(const moe_ep *ep, const waves_forward *f, int w)
{
    const int k = (int)ep->cfg->topk, G = ep->comm.ranks;
    wave_state *s = &f->ws[w];
    for (moe_index n = 0; n < s->rows_in * k; n++)
        s->slot_pair[n] = -1;
    for (moe_index m = 0; m < s->recv.pairs; m++)
        s->slot_pair[s->recv.expert_row[m] * k + s->recv.expert_slot[m]] = (int32_t)s->recv.expert_pair[m];
    s->out_rows = 0;
    moe_index row = 0;
    for (int r = 0; r < G; r++) {
        s->closing_from[r] = 0;
        for (moe_index j = 0; j < s->rows_from[r]; j++, row++)
            s->closing_from[r] += row_waves(ep, f, s->recv_meta + row * MOE_META_WORDS(k), r, NULL) == w;
        s->out_rows += s->closing_from[r];
    }
}

/* --combine reduced, after wave w's experts: the sums of the rows that close
 * here, each over its token's pairs on this rank from every wave so far, in
 * slot order (moe_ep_sum_slots: the bits of the one-wave sum), rounded. */
static void wave_sums(const moe_ep *ep, const waves_forward *f, int w)
{
    const int k = (int)ep->cfg->topk;
    const moe_index d = ep->cfg->hidden;
    const wave_state *s = &f->ws[w];
    const float *out[k > 0 ? k : 1];
    moe_index closed = 0;
    for (moe_index row = 0, source = 0, j = 0; row < s->rows_in; row++, j++) {
        while (j >= s->rows_from[source])
            source++, j = 0;
        const int32_t *meta = s->recv_meta + row * MOE_META_WORDS(k);
        const int32_t token = moe_meta_token(meta, k);
        int wave[k > 0 ? k : 1];
        if (row_waves(ep, f, meta, (int)source, wave) != w)
            continue; /* goes back in a later wave */
        for (int slot = 0; slot < k; slot++) {
            out[slot] = NULL;
            if (wave[slot] < 0)
                continue;
            const wave_state *at = &f->ws[wave[slot]];
            const moe_index there = wave[slot] == w ? row : find_row(at, k, token);
            MOE_ASSERT(there >= 0 && at->slot_pair[there * k + slot] >= 0);
            out[slot] = at->expert_out + (moe_index)at->slot_pair[there * k + slot] * d;
        }
        moe_ep_sum_slots(ep, meta, out, s->sums + closed++ * d);
    }
    MOE_ASSERT(closed == s->out_rows);
    moe_precision_combine(ep->cfg->combine_dtype, s->sums, closed * d);
}

/* Stages dispatch, experts and combine of every wave, overlapped as the
 * diagram at the top of this file shows; then the timeline's comm events
 * and the forward's traffic figures. */
static void waves_pipeline(const moe_ep *ep, const moe_schedule *sched, waves_forward *f,
                           moe_forward_stats *stats)
{
    const moe_comm *c = &ep->comm;
    const int G = c->ranks, W = sched->waves;
    const moe_link *link = moe_schedule_link(ep, sched);
    wave_state *ws = f->ws;
    moe_progress progress;
    moe_progress_init(&progress, sched->progress, 2 * W);
    moe_gemm_reset_flops();
    const double start = moe_stage_begin();
    moe_stage_clock clock = {&progress, sched->trace, sched->origin, start, 0.0, 0, 0, NULL, NULL, 0};
    moe_link_state links = {{{0}}};
    int posted = 0; /* dispatches posted so far */
    for (int w = 0; w < W; w++) {
        for (const int want = w + sched->lookahead + 1 < W ? w + sched->lookahead + 1 : W;
             posted < want; posted++)
            wave_dispatch(&ws[posted], &progress, posted, G, &f->types, c->comm,
                          link, &links);
        moe_pipeline_fill(&progress, w, &f->shared, NULL, NULL);
        moe_progress_wait_at(&progress, w, MOE_WATCH_DISPATCH, w);
        moe_pipeline_fail_here(c, "dispatch");
        clock.wave = w;
        clock.mark = moe_stage_begin();
        wave_plan_receive(ep, f, w);
        moe_pipeline_experts(ep, &ws[w].recv, ws[w].row_at, ws[w].recv_meta, ws[w].expert_out,
                             NULL, f->expert_in, f->scratch, &clock);
        if (ws[w].sums) { /* --combine reduced: the rows whose last wave this is */
            wave_sums(ep, f, w);
            clock.mark = moe_stage_end(&clock.compute, clock.mark);
        }
        moe_pipeline_fail_here(c, "experts");
        wave_combine(&ws[w], &progress, W + w, G, &f->types, &f->combine_wire, c->comm, link, &links);
        moe_pipeline_fail_here(c, "combine");
    }
    for (int w = 0; w < W; w++) {
        moe_pipeline_fill(&progress, W + w, &f->shared, NULL, NULL);
        moe_progress_wait_at(&progress, W + w, MOE_WATCH_COMBINE, w);
    }
    const double end = moe_stage_end(&stats->pipeline_seconds, start);
    stats->fill_seconds = f->shared.seconds;
    stats->fill_flops = f->shared.flops;
    stats->compute_seconds = clock.compute + f->shared.seconds;
    stats->layout_slots = clock.slots;
    moe_progress_stop(&progress);
    stats->test_seconds = progress.test_seconds;
    const double row_bytes = moe_dispatch_row_bytes(ep->cfg);
    const double out_bytes = moe_combine_row_bytes(ep->cfg);
    for (int w = 0; w < W; w++) {
        wave_state *s = &ws[w];
        moe_pipeline_comm_event(sched->trace, &progress.ops[w], w ? &progress.ops[w - 1] : NULL,
                                sched->origin, w, MOE_EVENT_DISPATCH, -1,
                                (double)s->rows_out * row_bytes, s->rows_out);
        moe_pipeline_comm_event(sched->trace, &progress.ops[W + w],
                                w ? &progress.ops[W + w - 1] : NULL, sched->origin, w,
                                MOE_EVENT_COMBINE, -1, (double)s->out_rows * out_bytes,
                                s->out_rows);
        stats->seconds[MOE_STAGE_DISPATCH] += progress.ops[w].completed - progress.ops[w].posted;
        stats->seconds[MOE_STAGE_COMBINE] += progress.ops[W + w].completed - progress.ops[W + w].posted;
        stats->rows_sent += s->rows_out;
        stats->rows_sent_remote += s->rows_out - s->send.row_count[c->rank];
        stats->rows_received += s->rows_in;
        stats->pairs_received += s->recv.pairs;
        stats->pairs_back_remote += s->back_in;
        stats->bytes_dispatched += (double)s->rows_out * row_bytes;
        stats->bytes_combined += (double)s->out_rows * out_bytes;
        for (int t = 0; t < MOE_TIERS; t++)
            stats->tier_bytes[t] += s->dispatch_bytes[1][t] + s->combine_bytes[1][t];
    }
    moe_progress_free(&progress);
    stats->seconds[MOE_STAGE_EXPERTS] = clock.compute;
    stats->expert_start = start;
    stats->expert_end = end;
    stats->expert_flops = moe_gemm_sflops() - f->shared.flops;
    stats->pad_rows = moe_ep_pad_rows(ep, stats->pairs_received);
}

/* Stages reduce and shared: y in slot order, whatever wave each slot came
 * back in, then the shared experts on top. */
static void waves_reduce(const moe_ep *ep, const moe_schedule *sched, waves_forward *f,
                         const int32_t *ids, const float *weights, float *y,
                         moe_forward_stats *stats)
{
    const int G = ep->comm.ranks, me = ep->comm.rank;
    const moe_index d = ep->cfg->hidden;
    const double t = moe_stage_begin();
    const int W = sched->waves;
    const bool reduced = ep->cfg->combine == MOE_COMBINE_REDUCED;
    const float **from = moe_xmalloc(sizeof(float *) * (size_t)(W * G));
    for (int w = 0; w < W; w++) {
        wave_state *s = &f->ws[w];
        moe_ep_wire_values(&f->combine_wire, s->back, s->back_in, s->back_values);
        const float *own = reduced ? s->sums : s->expert_out; /* this rank's rows never left */
        for (int r = 0; r < G; r++)
            s->from[r] = from[w * G + r] = r == me ? own + (moe_index)COUNTS(s, C_SEND_AT, G)[me] * d
                                                   : s->back_values + (moe_index)COUNTS(s, C_RECV_AT, G)[r] * d;
        if (!reduced)
            moe_combine_locate(&s->send, s->from, d, f->slot_rows);
    }
    if (reduced)
        moe_ep_reduce_rows(ep, &ep->placement, ids, &f->waves, from, W, y);
    else
        moe_ep_reduce(ep, f->slot_rows, weights, y);
    free(from);
    moe_stage_end(&stats->seconds[MOE_STAGE_REDUCE], t);
    moe_shared_work_finish(&f->shared, y, stats);
}

int moe_ep_forward_waves(const moe_ep *ep, const moe_schedule *sched, const float *x,
                         const int32_t *ids, const float *weights, float *y,
                         moe_forward_stats *stats, moe_status *st)
{
    MOE_ASSERT(sched->waves >= 1 && sched->lookahead >= 1);
    MOE_ASSERT(ep->cfg->dispatch == MOE_DISPATCH_FLAT); /* the two-stage one: ep_hier.c */
    waves_forward f = {0};
    moe_status local = {0};
    memset(stats, 0, sizeof *stats);
    stats->waves = sched->waves;
    moe_ep_forget_waves(ep->work);
    moe_ep_types_create(ep, &f.types);
    f.dispatch_wire = moe_wire_dispatch(ep->cfg);
    f.combine_wire = moe_wire_combine(ep->cfg);

    const double t = moe_stage_begin();
    waves_plan(ep, sched, ids, &f, stats, &local);
    const bool well = moe_ep_agreed(ep, "plan", &local);
    if (well) {
        waves_pack(ep, sched, x, ids, weights, &f);
        moe_stage_end(&stats->seconds[MOE_STAGE_PLAN], t);
        waves_pipeline(ep, sched, &f, stats);
        waves_reduce(ep, sched, &f, ids, weights, y, stats);
        ep->work->last = f.ws; /* for moe_ep_time_alltoalls */
        ep->work->last_waves = sched->waves;
    } else {
        free_waves(f.ws, sched->waves);
        *st = local;
    }
    free(f.closing);
    moe_waves_free(&f.waves);
    moe_ep_types_free(&f.types);
    return local.code;
}

double moe_ep_time_alltoalls(const moe_ep *ep, const moe_schedule *sched)
{
    const moe_comm *c = &ep->comm;
    const int G = c->ranks, W = ep->work->last_waves;
    wave_state *ws = ep->work->last;
    MOE_ASSERT(ws != NULL);
    const moe_link *link = moe_schedule_link(ep, sched);
    moe_ep_types types;
    moe_ep_types_create(ep, &types);
    MPI_Request *requests = moe_xmalloc(sizeof(MPI_Request) * (size_t)(3 * W));
    MPI_Status *statuses = moe_xmalloc(sizeof(MPI_Status) * (size_t)(3 * W));
    moe_link_state alone = {{{0}}};
    double modelled = 0.0;
    MOE_MPI(MPI_Barrier(c->comm));
    const double t = moe_stage_begin();
    for (int w = 0; w < W; w++) {
        wave_state *s = &ws[w];
        start_dispatch(s, G, &types, c->comm, &requests[3 * w]);
        start_combine(s, G, &types, c->comm, &requests[3 * w + 2]);
        for (int pass = 0; pass < 2; pass++) {
            double (*bytes)[MOE_TIERS] = pass == 0 ? s->dispatch_bytes : s->combine_bytes;
            const double done = moe_link_schedule(link, &alone, 0.0, bytes[0], bytes[1]);
            modelled = done > modelled ? done : modelled;
        }
    }
    MOE_MPI(MPI_Waitall(3 * W, requests, statuses));
    const double real = moe_stage_since(t);
    free(statuses);
    free(requests);
    moe_ep_types_free(&types);
    return real > modelled ? real : modelled;
}
