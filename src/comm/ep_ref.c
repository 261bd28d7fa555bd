/* SPDX-License-Identifier: MIT */
/* ep_ref.c — the blocking reference EP forward (see ep.h), and only it.
 *
 * Per rank, after route:  plan → pack → dispatch → experts → combine →
 * reduce → shared, each stage a blocking step, the ranks agreeing between
 * stages on whether every rank may go on (a failed allocation on one rank
 * stops all of them with one message). The pure parts (plans, packing, FFN,
 * reduce) live in src/core and ep.c; this file moves the buffers they lay
 * out and times each stage. The wave path (ep_waves.c) is checked against it.
 */
#include "moe/ep.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "moe/gemm.h"
#include "moe/watchdog.h"
#include "ep_stages.h"


void moe_ep_capture_free(moe_ep_capture *capture)
{
    free(capture->recv_x);
    free(capture->recv_token);
    free(capture->out);
    free(capture->pair);
    free(capture->pair_row);
    free(capture->pair_weight);
    free(capture->sums);
    free(capture->layout_wire);
    free(capture->layout_src);
    free(capture->layout_expert);
    free(capture->layout_count);
    memset(capture, 0, sizeof *capture);
}

/* Copies of what this rank received and sent back, pairs in combine order. */
static void capture_rank(const moe_recv_plan *recv, const float *recv_rows,
                         const int32_t *recv_meta, const float *expert_out, int first_expert,
                         moe_index d, int k, moe_ep_capture *capture)
{
    capture->rows = recv->rows;
    capture->recv_x = moe_xmalloc(sizeof(float) * (size_t)(recv->rows * d));
    memcpy(capture->recv_x, recv_rows, sizeof(float) * (size_t)(recv->rows * d));
    capture->recv_token = moe_xmalloc(sizeof(int32_t) * (size_t)recv->rows);
    for (moe_index r = 0; r < recv->rows; r++)
        capture->recv_token[r] = moe_meta_token(recv_meta + r * MOE_META_WORDS(k), k);
    capture->pairs = recv->pairs;
    capture->out = moe_xmalloc(sizeof(float) * (size_t)(recv->pairs * d));
    memcpy(capture->out, expert_out, sizeof(float) * (size_t)(recv->pairs * d));
    capture->pair = moe_xmalloc(sizeof(int32_t) * (size_t)(2 * recv->pairs) + 1);
    capture->pair_row = moe_xmalloc(sizeof(int32_t) * (size_t)recv->pairs + 1);
    capture->pair_weight = moe_xmalloc(sizeof(float) * (size_t)recv->pairs + 1);
    for (int l = 0; l < recv->local_experts; l++)
        for (moe_index m = recv->expert_offset[l]; m < recv->expert_offset[l + 1]; m++) {
            const moe_index p = recv->expert_pair[m];
            capture->pair[2 * p] = capture->recv_token[recv->expert_row[m]];
            capture->pair[2 * p + 1] = first_expert + l;
            capture->pair_row[p] = (int32_t)recv->expert_row[m];
            capture->pair_weight[p] = moe_meta_weight(recv_meta + recv->expert_row[m] * MOE_META_WORDS(k), k,
                                                      recv->expert_slot[m]);
        }
}

/* The layout tensor's rows as the wire carried them (recv_wire: the
 * received rows, row_bytes each), who they are, and the counts. */
static void capture_layout(const moe_recv_plan *recv, const moe_expert_slots *slots,
                           const uint8_t *recv_wire, size_t row_bytes, moe_ep_capture *capture)
{
    const bool rows = slots->kind == MOE_LAYOUT_ROWS;
    const moe_index n = rows ? recv->rows : slots->slots;
    capture->slots = n;
    capture->layout_wire = moe_xcalloc((size_t)n * row_bytes + 1, 1);
    capture->layout_src = moe_xmalloc(sizeof(int32_t) * (size_t)n + 1);
    capture->layout_expert = moe_xmalloc(sizeof(int32_t) * (size_t)n + 1);
    capture->layout_count = moe_xmalloc(sizeof(int32_t) * (size_t)slots->experts + 1);
    for (moe_index m = 0; m < n; m++)
        capture->layout_src[m] = capture->layout_expert[m] = -1;
    if (rows) {
        memcpy(capture->layout_wire, recv_wire, (size_t)n * row_bytes);
        memcpy(capture->layout_src, capture->recv_token, sizeof(int32_t) * (size_t)n);
    }
    for (int l = 0; l < slots->experts; l++) {
        capture->layout_count[l] = (int32_t)slots->count[l];
        if (rows) /* the received rows are the tensor */
            continue;
        for (moe_index j = 0; j < slots->count[l]; j++) {
            const moe_index row = recv->expert_row[recv->expert_offset[l] + j];
            const moe_index at = slots->start[l] + j;
            memcpy(capture->layout_wire + (size_t)at * row_bytes, recv_wire + (size_t)row * row_bytes, row_bytes);
            capture->layout_src[at] = capture->recv_token[row];
            capture->layout_expert[at] = l;
        }
    }
}

/* Stage plan, send side: the rows each destination gets (deduplicated), one
 * count exchange (MPI_Alltoall) for the rows each source sends here, and
 * buffers sized for both. Allocation failures are recorded in local. */
static void ref_plan(const moe_ep *ep, const int32_t *ids, moe_ref_forward *f,
                     moe_forward_stats *stats, moe_status *local)
{
    const moe_config *cfg = ep->cfg;
    const moe_comm *c = &ep->comm;
    const int G = c->ranks, k = (int)cfg->topk;
    const moe_index T = cfg->tokens, d = cfg->hidden;
    const double t = moe_stage_begin();
    moe_send_plan_build(&f->send, &ep->placement, ids, T, k, NULL, 0);
    moe_to_counts(f->send.row_count, G, f->send_counts, f->send_at);
    moe_watch_wait(MOE_WATCH_PLAN, -1);
    MOE_MPI(MPI_Alltoall(f->send_counts, 1, MPI_INT, f->recv_counts, 1, MPI_INT, c->comm));
    moe_watch_done();
    f->rows_in = 0;
    for (int r = 0; r < G; r++) {
        f->rows_from[r] = f->recv_counts[r];
        f->rows_in += f->recv_counts[r];
    }
    moe_to_counts(f->rows_from, G, f->recv_counts, f->recv_at);
    const moe_index rows_out = f->send.row_offset[G], words = MOE_META_WORDS(k);
    const size_t row = f->dispatch_wire.bytes, out = f->combine_wire.bytes;
    const bool reduced = cfg->combine == MOE_COMBINE_REDUCED; /* one row back per row sent */
    const moe_index back = reduced ? rows_out : f->send.pair_offset[G];
    f->send_rows = moe_pool_take(f->pool, row * (size_t)rows_out, "the dispatch send buffer", c->rank, local);
    f->send_meta = moe_pool_take(f->pool, sizeof(int32_t) * (size_t)(rows_out * words), "the dispatch ids", c->rank, local);
    f->recv_rows = moe_pool_take(f->pool, row * (size_t)f->rows_in, "the dispatch receive buffer", c->rank, local);
    f->recv_meta = moe_pool_take(f->pool, sizeof(int32_t) * (size_t)(f->rows_in * words), "the received ids", c->rank, local);
    f->back = moe_pool_take(f->pool, out * (size_t)back, "the combine receive buffer", c->rank, local);
    if (f->dispatch_wire.dtype != MOE_DTYPE_FP32)
        f->recv_decoded = moe_pool_take(f->pool, sizeof(float) * (size_t)(f->rows_in * d), "the decoded rows", c->rank, local);
    if (f->combine_wire.dtype != MOE_DTYPE_FP32)
        f->back_decoded = moe_pool_take(f->pool, sizeof(float) * (size_t)(back * d), "the decoded outputs", c->rank, local);
    moe_stage_end(&stats->seconds[MOE_STAGE_PLAN], t);
}

/* One all-to-all of a step: blocking (flight NULL), or posted as request
 * `request` of flight's operation `op`. */
static void ref_alltoallv(const moe_ep *ep, const moe_ref_flight *flight, int op, int request,
                          enum moe_watch_place place, const void *send, const int *sc, const int *sa, void *recv, const int *rc,
                          const int *ra, MPI_Datatype type)
{
    moe_comm_count_posted(sc, ep->comm.ranks, ep->comm.rank, type);
    if (!flight) {
        moe_watch_wait(place, -1);
        MOE_MPI(MPI_Alltoallv(send, sc, sa, type, recv, rc, ra, type, ep->comm.comm));
        moe_watch_done();
        return;
    }
    moe_progress_lock(flight->progress);
    MOE_MPI(MPI_Ialltoallv(send, sc, sa, type, recv, rc, ra, type, ep->comm.comm,
                           &flight->progress->ops[op].requests[request]));
    moe_progress_unlock(flight->progress);
}

/* Operation op, `requests` requests posted, in flight under the link model:
 * in_rows and out_rows (G) of row_bytes each. */
static void ref_launched(const moe_ep *ep, const moe_ref_flight *flight, int op, int requests,
                         const moe_index *in_rows, const moe_index *out_rows, double row_bytes)
{
    double bytes[2][MOE_TIERS] = {{0}};
    moe_pipeline_link_bytes(ep, in_rows, out_rows, row_bytes, bytes);
    moe_progress_lock(flight->progress);
    flight->progress->ops[op].count = requests;
    moe_pipeline_track(flight->progress, op, flight->link, flight->links, bytes, ep->comm.comm);
    moe_progress_unlock(flight->progress);
}

/* Stage dispatch: every packed row once to its destination, with its ids
 * (two MPI_Alltoallv, blocking unless flight says where to post them; then
 * the received rows are read once the operation is in). */
static void ref_dispatch(const moe_ep *ep, moe_ref_forward *f, moe_forward_stats *stats,
                         const moe_ref_flight *flight)
{
    const int G = ep->comm.ranks, me = ep->comm.rank, op = flight ? flight->op : 0;
    ref_alltoallv(ep, flight, op, 0, MOE_WATCH_DISPATCH, f->send_rows, f->send_counts, f->send_at, f->recv_rows,
                  f->recv_counts, f->recv_at, f->types.dispatch);
    ref_alltoallv(ep, flight, op, 1, MOE_WATCH_DISPATCH, f->send_meta, f->send_counts, f->send_at, f->recv_meta,
                  f->recv_counts, f->recv_at, f->types.meta);
    if (flight)
        ref_launched(ep, flight, op, 2, f->rows_from, f->send.row_count,
                     (double)moe_dispatch_row_bytes(ep->cfg));
    const moe_index rows_out = f->send.row_offset[G];
    stats->rows_sent = rows_out;
    stats->rows_sent_remote = rows_out - f->send.row_count[me];
    stats->rows_received = f->rows_in;
    stats->bytes_dispatched = (double)rows_out * moe_dispatch_row_bytes(ep->cfg);
}

/* Stage plan, receive side, once the dispatch is in: the rows as values,
 * which received row visits which local expert (from the ids that came with
 * the rows), and the experts' buffers. */
static void ref_plan_receive(const moe_ep *ep, moe_ref_forward *f, moe_forward_stats *stats,
                             moe_status *local)
{
    f->recv_values = moe_ep_wire_values(&f->dispatch_wire, f->recv_rows, f->rows_in, f->recv_decoded);
    const moe_index d = ep->cfg->hidden, f_size = ep->cfg->ffn;
    const double t = moe_stage_begin();
    moe_recv_plan_build(&f->recv, &ep->placement, ep->comm.rank, f->recv_meta, f->rows_in,
                        (int)ep->cfg->topk, f->rows_from, NULL, 0);
    moe_stage_end(&stats->seconds[MOE_STAGE_PLAN], t);
    const moe_index most = moe_ep_largest_batch(&f->recv);
    const int rank = ep->comm.rank;
    f->expert_out = moe_pool_take(f->pool, sizeof(float) * (size_t)(f->recv.pairs * d), "the expert outputs", rank, local);
    const bool reduced = ep->cfg->combine == MOE_COMBINE_REDUCED;
    const moe_index back = reduced ? f->rows_in : f->recv.pairs; /* rows that travel back */
    if (reduced)
        f->sums = moe_pool_take(f->pool, sizeof(float) * (size_t)(f->rows_in * d) + 1, "the sums", rank, local);
    f->out_wire = f->combine_wire.dtype == MOE_DTYPE_FP32 && !reduced
                      ? (uint8_t *)f->expert_out
                      : f->combine_wire.dtype == MOE_DTYPE_FP32
                            ? (uint8_t *)f->sums
                            : moe_pool_take(f->pool, f->combine_wire.bytes * (size_t)back + 1, "the combine send buffer", rank, local);
    f->expert_in = moe_pool_take(f->pool, sizeof(float) * (size_t)(most * MOE_EXPERT_WORK_FLOATS(d)), "expert rows", rank, local);
    f->scratch = moe_pool_take(f->pool, sizeof(float) * (size_t)(most * 2 * f_size), "expert activations", rank, local);
}

/* Stage experts: one FFN call per local expert, rows in global token order. */
static void ref_experts(const moe_ep *ep, moe_ref_forward *f, moe_forward_stats *stats,
                        moe_ep_capture *capture, const moe_ref_flight *flight)
{
    const moe_index d = ep->cfg->hidden;
    const double t = moe_stage_begin();
    moe_gemm_reset_flops();
    const float **row_at = moe_xmalloc(sizeof(float *) * (size_t)f->rows_in + 1);
    for (moe_index m = 0; m < f->rows_in; m++)
        row_at[m] = f->recv_values + m * d;
    moe_ep_layout layout;
    moe_ep_layout_open(ep, &f->recv, &layout);
    for (int l = 0; l < ep->local_experts; l++) {
        moe_ep_expert(ep, &f->recv, l, row_at, f->recv_meta, moe_ep_layout_block(ep, &layout, l),
                      f->expert_in, f->scratch, f->expert_out, NULL);
        if (flight) /* what another schedule has in flight moves */
            moe_progress_poll(flight->progress);
    }
    free(row_at);
    stats->expert_flops = moe_gemm_sflops();
    stats->pairs_received = f->recv.pairs;
    stats->pad_rows = moe_ep_pad_rows(ep, f->recv.pairs);
    stats->layout_slots = layout.slots.slots;
    if (capture) {
        capture_rank(&f->recv, f->recv_values, f->recv_meta, f->expert_out, ep->first_expert, d,
                     (int)ep->cfg->topk, capture);
        capture_layout(&f->recv, &layout.slots, f->recv_rows, f->dispatch_wire.bytes, capture);
    }
    moe_ep_layout_close(&layout);
    stats->expert_start = t;
    stats->expert_end = moe_stage_end(&stats->seconds[MOE_STAGE_EXPERTS], t);
}

/* Stage combine: every expert output back to its row's home rank (one
 * MPI_Alltoallv, blocking unless flight says where to post it). */
static void ref_combine(const moe_ep *ep, moe_ref_forward *f, moe_forward_stats *stats,
                        const moe_ref_flight *flight)
{
    const int G = ep->comm.ranks, me = ep->comm.rank;
    const double t = moe_stage_begin();
    const bool reduced = ep->cfg->combine == MOE_COMBINE_REDUCED;
    if (reduced) { /* one row per row received, back where it came from */
        moe_ep_reduce_at_source(ep, &f->recv, f->recv_meta, f->expert_out, f->sums);
        moe_to_counts(f->rows_from, G, f->send_counts, f->send_at);
        moe_to_counts(f->send.row_count, G, f->recv_counts, f->recv_at);
    } else {
        moe_to_counts(f->recv.source_pairs, G, f->send_counts, f->send_at);
        moe_to_counts(f->send.pair_count, G, f->recv_counts, f->recv_at);
    }
    const float *values = reduced ? f->sums : f->expert_out;
    const moe_index back = reduced ? f->rows_in : f->recv.pairs;
    if (f->out_wire != (const uint8_t *)values)
        moe_wire_encode(&f->combine_wire, values, NULL, back, f->out_wire);
    const int op = flight ? flight->op + 1 : 0;
    ref_alltoallv(ep, flight, op, 0, MOE_WATCH_COMBINE, f->out_wire, f->send_counts, f->send_at, f->back,
                  f->recv_counts, f->recv_at, f->types.combine);
    if (flight)
        ref_launched(ep, flight, op, 1, reduced ? f->send.row_count : f->send.pair_count,
                     reduced ? f->rows_from : f->recv.source_pairs,
                     (double)moe_combine_row_bytes(ep->cfg));
    moe_stage_end(&stats->seconds[MOE_STAGE_COMBINE], t);
    stats->bytes_combined = (double)back * moe_combine_row_bytes(ep->cfg);
    stats->pairs_back_remote = reduced ? f->send.row_offset[G] - f->send.row_count[me]
                                       : f->send.pair_offset[G] - f->send.pair_count[me];
}

/* Stage reduce and shared: y from the outputs that came back, then the
 * shared experts on top. */
static void ref_reduce(const moe_ep *ep, moe_ref_forward *f, const float *x, const int32_t *ids,
                       const float *weights, float *y, moe_forward_stats *stats)
{
    const int G = ep->comm.ranks;
    const moe_index T = ep->cfg->tokens, d = ep->cfg->hidden;
    const double t = moe_stage_begin();
    const float **slot_rows = moe_xcalloc((size_t)(T * ep->cfg->topk) + 1, sizeof(float *)); /* (T, k) */
    const float **from = moe_xmalloc(sizeof(float *) * (size_t)G);
    const bool reduced = ep->cfg->combine == MOE_COMBINE_REDUCED;
    const moe_index *offset = reduced ? f->send.row_offset : f->send.pair_offset;
    const float *back = moe_ep_wire_values(&f->combine_wire, f->back, offset[G], f->back_decoded);
    for (int r = 0; r < G; r++)
        from[r] = back + offset[r] * d;
    if (reduced) {
        moe_ep_reduce_rows(ep, &ep->placement, ids, NULL, from, 1, y);
    } else {
        moe_combine_locate(&f->send, from, d, slot_rows);
        moe_ep_reduce(ep, slot_rows, weights, y);
    }
    free(from);
    free(slot_rows);
    moe_stage_end(&stats->seconds[MOE_STAGE_REDUCE], t);
    moe_ep_shared(ep, x, y, f->scratch, f->expert_in, stats);
}

void moe_ep_ref_release(moe_ref_forward *f)
{
    moe_pool_give(f->pool, f->scratch);
    moe_pool_give(f->pool, f->expert_in);
    if (f->out_wire != (uint8_t *)f->expert_out && f->out_wire != (uint8_t *)f->sums)
        moe_pool_give(f->pool, f->out_wire);
    moe_pool_give(f->pool, f->sums);
    moe_pool_give(f->pool, f->back_decoded);
    moe_pool_give(f->pool, f->back);
    moe_pool_give(f->pool, f->send_meta);
    moe_pool_give(f->pool, f->send_rows);
    f->scratch = f->expert_in = f->sums = f->back_decoded = NULL;
    f->out_wire = f->back = f->send_rows = NULL;
    f->send_meta = NULL;
}

void moe_ep_ref_free(moe_ref_forward *f)
{
    moe_ep_ref_release(f);
    moe_pool_give(f->pool, f->expert_out);
    moe_pool_give(f->pool, f->recv_decoded);
    moe_recv_plan_free(&f->recv);
    moe_pool_give(f->pool, f->recv_meta);
    moe_pool_give(f->pool, f->recv_rows);
    moe_send_plan_free(&f->send);
    free(f->rows_from);
    free(f->counts);
    moe_ep_types_free(&f->types);
}

static void ref_init(const moe_ep *ep, moe_ref_forward *f, moe_forward_stats *stats)
{
    const int G = ep->comm.ranks;
    *f = (moe_ref_forward){.pool = ep->work ? &ep->work->pool : NULL,
                           .counts = moe_xmalloc(sizeof(int) * (size_t)(4 * G)),
                           .rows_from = moe_xmalloc(sizeof(moe_index) * (size_t)G)};
    f->send_counts = f->counts;
    f->send_at = f->counts + G;
    f->recv_counts = f->counts + 2 * G;
    f->recv_at = f->counts + 3 * G;
    moe_ep_types_create(ep, &f->types);
    f->dispatch_wire = moe_wire_dispatch(ep->cfg);
    f->combine_wire = moe_wire_combine(ep->cfg);
    memset(stats, 0, sizeof *stats);
}

/* Stages pack and dispatch, timed together. */
static void ref_pack_dispatch(const moe_ep *ep, const float *x, const int32_t *ids,
                              const float *weights, moe_ref_forward *f, moe_forward_stats *stats,
                              const moe_ref_flight *flight)
{
    const double t = moe_stage_begin();
    moe_ep_pack(ep, x, ids, weights, &f->send, -1, f->send_rows, f->send_meta);
    ref_dispatch(ep, f, stats, flight);
    moe_stage_end(&stats->seconds[MOE_STAGE_DISPATCH], t);
}

int moe_ep_ref_begin(const moe_ep *ep, const float *x, const int32_t *ids, const float *weights,
                     moe_ref_forward *f, moe_forward_stats *stats, const moe_ref_flight *flight,
                     moe_status *st)
{
    moe_status local = {0};
    ref_init(ep, f, stats);
    ref_plan(ep, ids, f, stats, &local);
    if (!moe_ep_agreed(ep, "plan", &local)) {
        *st = local;
        return local.code;
    }
    ref_pack_dispatch(ep, x, ids, weights, f, stats, flight);
    return MOE_EXIT_OK;
}

void moe_ep_ref_experts(const moe_ep *ep, moe_ref_forward *f, moe_forward_stats *stats,
                        const moe_ref_flight *flight)
{
    moe_status local = {0};
    ref_plan_receive(ep, f, stats, &local);
    if (local.code) /* nothing can be agreed on with operations in flight */
        moe_comm_abort(&ep->comm, &local);
    ref_experts(ep, f, stats, NULL, flight);
    ref_combine(ep, f, stats, flight);
}

void moe_ep_ref_end(const moe_ep *ep, moe_ref_forward *f, const float *x, const int32_t *ids,
                    const float *weights, float *y, moe_forward_stats *stats)
{
    ref_reduce(ep, f, x, ids, weights, y, stats);
}

int moe_ep_ref_run(const moe_ep *ep, const float *x, const int32_t *ids, const float *weights,
                   float *y, moe_forward_stats *stats, moe_ep_capture *capture,
                   moe_ref_forward *f, moe_status *st)
{
    moe_status local = {0};
    ref_init(ep, f, stats);
    ref_plan(ep, ids, f, stats, &local);
    if (moe_ep_agreed(ep, "plan", &local)) {
        ref_pack_dispatch(ep, x, ids, weights, f, stats, NULL);
        ref_plan_receive(ep, f, stats, &local);
    }
    if (moe_ep_agreed(ep, "dispatch", &local))
        ref_experts(ep, f, stats, capture, NULL);
    /* A rank that failed in its experts (an injected fault stands for it)
     * stops every rank here, before the combine. */
    if (moe_ep_agreed(ep, "experts", &local)) {
        ref_combine(ep, f, stats, NULL);
        if (capture && f->sums) { /* the sums as they travelled */
            const size_t bytes = sizeof(float) * (size_t)(f->rows_in * ep->cfg->hidden);
            capture->sums = moe_xmalloc(bytes + 1);
            memcpy(capture->sums, f->sums, bytes);
        }
    }
    if (moe_ep_agreed(ep, "combine", &local))
        ref_reduce(ep, f, x, ids, weights, y, stats);
    if (local.code)
        *st = local;
    return local.code;
}

int moe_ep_forward_ref(const moe_ep *ep, const float *x, const int32_t *ids,
                       const float *weights, float *y, moe_forward_stats *stats,
                       moe_ep_capture *capture, moe_status *st)
{
    moe_ref_forward f;
    const int rc = moe_ep_ref_run(ep, x, ids, weights, y, stats, capture, &f, st);
    moe_ep_ref_free(&f);
    return rc;
}
