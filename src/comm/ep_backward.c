/* SPDX-License-Identifier: MIT */
/* ep_backward.c — the backward of a training step (see ep.h,
 * moe_ep_backward_ref and moe_ep_backward_step): the forward's stages run
 * in mirror image, one sequence for the blocking and the nonblocking path.
 *
 *   forward    dispatch (x rows)  experts  combine (outputs)  reduce  shared
 *   backward   combine backward of waves 0 .. A-1 (dy rows, along the
 *              dispatch's plan)
 *                 in flight: the shared experts' dx and dW
 *              for each wave w of W (token chunks):
 *                 combine backward of wave w+A posted; wait for wave w's
 *                 experts dgrad of wave w (B)   in flight: later combines,
 *                 dispatch backward of wave w    earlier dispatches
 *                 (dx rows and dL/dweight, along the combine's)
 *              experts wgrad, every expert's rows at once (W)
 *                 in flight: the last dispatches
 *              → reduce (+ the shared experts' dx) → router → the
 *              replicated weights' gradients summed over ranks
 *
 * A wave is a chunk of every rank's tokens, so a (token, rank) row and its
 * pairs travel in one wave, deduplicated as the forward's; the weight
 * gradients sum each expert's rows of every wave in global token order, in
 * one pass after the last wave: with packed or exact GEMMs the bits do not
 * depend on W.
 *
 * Saved from the forward (moe_ref_forward): its plans and counts, the rows
 * each rank received (x as the experts saw it) with their meta, and the
 * expert outputs. The backward recomputes h = x W1^T (backward.h).
 */
#include <stdlib.h>
#include <string.h>

#include "moe/backward.h"
#include "moe/ep.h"
#include "moe/gemm.h"
#include "moe/progress.h"
#include "moe/watchdog.h"
#include "ep_stages.h"

void moe_ep_grads_init(const moe_ep *ep, moe_ep_grads *g)
{
    const moe_config *cfg = ep->cfg;
    const size_t d = (size_t)cfg->hidden, f = (size_t)cfg->ffn, EL = (size_t)ep->local_experts,
                 S = (size_t)cfg->shared_experts;
    g->dx = moe_xmalloc(sizeof(float) * (size_t)cfg->tokens * d + 1);
    /* the weight gradients' GEMMs write them whole: on cache lines */
    g->dw1 = moe_xmalloc_lines(sizeof(float) * EL * 2 * f * d + 1);
    g->dw2 = moe_xmalloc_lines(sizeof(float) * EL * d * f + 1);
    g->dshared_w1 = moe_xmalloc_lines(sizeof(float) * S * 2 * f * d + 1);
    g->dshared_w2 = moe_xmalloc_lines(sizeof(float) * S * d * f + 1);
    g->dgate = moe_xmalloc(sizeof(float) * (size_t)cfg->experts * d + 1);
}

void moe_ep_grads_tensors(const moe_ep *ep, const moe_ep_grads *g, const float **v, moe_index *n)
{
    const moe_config *cfg = ep->cfg;
    const moe_index d = cfg->hidden, f = cfg->ffn, EL = ep->local_experts, S = cfg->shared_experts;
    const float *values[MOE_EP_GRAD_TENSORS] = {g->dx, g->dw1, g->dw2, g->dshared_w1,
                                                g->dshared_w2, g->dgate};
    const moe_index sizes[MOE_EP_GRAD_TENSORS] = {cfg->tokens * d, EL * 2 * f * d, EL * d * f,
                                                  S * 2 * f * d, S * d * f, cfg->experts * d};
    memcpy(v, values, sizeof values);
    memcpy(n, sizes, sizeof sizes);
}

void moe_ep_grads_free(moe_ep_grads *g)
{
    free(g->dx);
    free(g->dw1);
    free(g->dw2);
    free(g->dshared_w1);
    free(g->dshared_w2);
    free(g->dgate);
    memset(g, 0, sizeof *g);
}

/* One backward's buffers, and how its all-to-alls run. The backward runs in
 * W waves of token chunks (layout.h: wave w is local tokens [w T/W, (w+1)
 * T/W) of every rank), so a (token, rank) row and all its pairs fall in one
 * wave and the per-rank dedup of the forward is kept. Each wave has its
 * combine backward and its dispatch backward; the buffers keep the
 * forward's layout, a wave filling its part of every peer's block. The
 * all-to-alls are blocking (each waited for when posted), or in flight
 * behind the computation that needs none of their data: the shared experts
 * and earlier waves' data gradients behind the combine backward, later
 * waves' data gradients and the routed experts' weight gradients behind the
 * dispatch backward. */
enum { C_DY, C_DX, C_DG, COUNT_SETS };            /* a wave's count arrays */
enum { SEND, SEND_AT, RECV, RECV_AT, COUNT_ARRAYS };
/* Per wave and peer: rows and pairs of this rank's tokens (home), and of
 * the rows it received (in), with where they start in the forward's layout. */
enum { HOME_ROWS, HOME_PAIRS, IN_ROWS, IN_PAIRS, SPLITS };

typedef struct {
    moe_pool *pool;         /* where the large buffers below come from (the workspace's) */
    moe_progress *progress; /* NULL: blocking */
    const moe_link *link;   /* the emulated links, or NULL */
    moe_trace *trace;       /* this rank's events are appended here; NULL: none */
    double origin;          /* when the events count from (clock.h) */
    bool serial;            /* wait for each operation as it is posted */
    moe_link_state links;
    int W, lookahead;
    int pass;               /* waves a data-gradient pass covers: 1, or W (one pass) */
    moe_waves waves;        /* token chunks */
    moe_index *split;       /* (SPLITS, W, G) rows or pairs per wave and peer */
    moe_index *split_at;    /* (SPLITS, W, G) where they start */
    int *row_wave;          /* (rows in) the wave of each received row */
    double (*bytes)[2][MOE_TIERS]; /* (2W) each op over the links: [in, out][tier] */
    int *counts;            /* (2W, COUNT_SETS, COUNT_ARRAYS, G), kept until the operation completes */
    MPI_Datatype row;       /* d fp32 values */
    float *send_dy;         /* (rows out, d) this rank's dy rows in dispatch order */
    float *dy_in;           /* (rows in, d) as the forward received x */
    moe_expert_grad_work work; /* (pairs) each pair's dH, a', grouped by expert */
    float *pair_dx;         /* (pairs, d) in the combine's pair order; NULL when only sums travel */
    float *pair_dg;         /* (pairs) dL/dweight */
    float *sums;            /* --combine reduced: (rows in, d), zero until the experts add to it */
    float *back;            /* (rows or pairs sent out, d) dx come home */
    float *dg_back;         /* (pairs sent out) */
    float *shared_dx;       /* (T, d) the shared experts' dx (NULL without them) */
} bwd_run;

/* The operations: wave w's combine backward, then its dispatch backward. */
static int op_combine(int w)
{
    return 2 * w;
}
static int op_dispatch(int w)
{
    return 2 * w + 1;
}

static moe_index *split(const bwd_run *b, int kind, int w, int G)
{
    return b->split + ((size_t)kind * (size_t)b->W + (size_t)w) * (size_t)G;
}
static moe_index *split_at(const bwd_run *b, int kind, int w, int G)
{
    return b->split_at + ((size_t)kind * (size_t)b->W + (size_t)w) * (size_t)G;
}

/* The wave of the source-local token of a received row. */
static int row_wave_of(const moe_ref_forward *f, const moe_waves *waves, int k, moe_index T,
                       int source, moe_index row)
{
    const moe_index token = moe_meta_token(f->recv_meta + row * MOE_META_WORDS(k), k);
    return moe_wave_of(waves, token - (moe_index)source * T, 0);
}

/* Every wave's rows and pairs per peer, where they start (the forward's
 * blocks, each cut in wave order: the rows and pairs of a peer's block are
 * in ascending token order), and each received row's wave. */
static void plan_waves(const moe_ep *ep, const moe_ref_forward *f, const int32_t *ids, bwd_run *b)
{
    const int G = ep->comm.ranks, W = b->W, k = (int)ep->cfg->topk;
    const moe_index T = ep->cfg->tokens;
    const moe_recv_plan *recv = &f->recv;
    b->split = moe_xcalloc((size_t)(SPLITS * W * G), sizeof(moe_index));
    b->split_at = moe_xmalloc(sizeof(moe_index) * (size_t)(SPLITS * W * G));
    b->row_wave = moe_xmalloc(sizeof(int) * (size_t)f->rows_in + 1);
    for (int r = 0; r < G; r++)
        for (moe_index j = f->send.row_offset[r]; j < f->send.row_offset[r + 1]; j++)
            split(b, HOME_ROWS, moe_wave_of(&b->waves, f->send.row_token[j], 0), G)[r]++;
    for (moe_index i = 0; i < T; i++)
        for (int s = 0; s < k; s++)
            if (ids[i * k + s] != MOE_DROPPED)
                split(b, HOME_PAIRS, moe_wave_of(&b->waves, i, 0), G)[ep->placement.expert_rank[ids[i * k + s]]]++;
    moe_index *row_pairs = moe_xcalloc((size_t)f->rows_in + 1, sizeof(moe_index));
    for (moe_index m = 0; m < recv->pairs; m++)
        row_pairs[recv->expert_row[m]]++;
    moe_index row = 0;
    for (int r = 0; r < G; r++)
        for (moe_index j = 0; j < f->rows_from[r]; j++, row++) {
            const int w = b->row_wave[row] = row_wave_of(f, &b->waves, k, T, r, row);
            split(b, IN_ROWS, w, G)[r]++;
            split(b, IN_PAIRS, w, G)[r] += row_pairs[row];
        }
    free(row_pairs);
    /* Where each block starts in the forward's layout: */
    moe_index *base = moe_xmalloc(sizeof(moe_index) * (size_t)(SPLITS * G));
    moe_index in_rows = 0, in_pairs = 0;
    for (int r = 0; r < G; r++) {
        base[HOME_ROWS * G + r] = f->send.row_offset[r];
        base[HOME_PAIRS * G + r] = f->send.pair_offset[r];
        base[IN_ROWS * G + r] = in_rows;
        base[IN_PAIRS * G + r] = in_pairs;
        in_rows += f->rows_from[r];
        in_pairs += recv->source_pairs[r];
    }
    for (int kind = 0; kind < SPLITS; kind++)
        for (int r = 0; r < G; r++) {
            moe_index at = base[kind * G + r];
            for (int w = 0; w < W; w++) {
                split_at(b, kind, w, G)[r] = at;
                at += split(b, kind, w, G)[r];
            }
        }
    free(base);
}

static int *counts(bwd_run *b, int op, int set, int array, int G)
{
    return b->counts + (((size_t)op * COUNT_SETS + (size_t)set) * COUNT_ARRAYS + (size_t)array) * (size_t)G;
}

static void to_ints(const moe_index *v, int G, int *out)
{
    for (int r = 0; r < G; r++)
        out[r] = (int)v[r];
}

/* Post (or, blocking, run) the all-to-all of request `request` of op with
 * counts of set `set`: send_rows (G) from send_at (G), recv_rows (G) into
 * recv_at (G); launched() then puts the op in flight. */
static void exchange(const moe_ep *ep, bwd_run *b, int op, int request, int set,
                     const moe_index *send_rows, const moe_index *send_at,
                     const moe_index *recv_rows, const moe_index *recv_at, const void *send,
                     void *recv, MPI_Datatype type)
{
    const int G = ep->comm.ranks;
    int *sc = counts(b, op, set, SEND, G), *sa = counts(b, op, set, SEND_AT, G);
    int *rc = counts(b, op, set, RECV, G), *ra = counts(b, op, set, RECV_AT, G);
    to_ints(send_rows, G, sc);
    to_ints(send_at, G, sa);
    to_ints(recv_rows, G, rc);
    to_ints(recv_at, G, ra);
    if (!b->progress) {
        moe_comm_count_posted(sc, G, ep->comm.rank, type);
        moe_watch_wait(MOE_WATCH_BACKWARD, -1);
        MOE_MPI(MPI_Alltoallv(send, sc, sa, type, recv, rc, ra, type, ep->comm.comm));
        moe_watch_done();
        return;
    }
    moe_progress_lock(b->progress); /* every MPI call, with a progress thread running */
    moe_comm_count_posted(sc, G, ep->comm.rank, type);
    MOE_MPI(MPI_Ialltoallv(send, sc, sa, type, recv, rc, ra, type, ep->comm.comm,
                           &b->progress->ops[op].requests[request]));
    moe_progress_unlock(b->progress);
}

/* op's `requests` requests are posted: from now on it is in flight, and
 * under the link model (docs/link-model.md) arrives no sooner than its
 * bytes take on the emulated links. */
static void launched(const moe_ep *ep, bwd_run *b, int op, int requests)
{
    if (!b->progress)
        return;
    moe_progress_lock(b->progress);
    b->progress->ops[op].count = requests;
    moe_pipeline_track(b->progress, op, b->link, &b->links, b->bytes[op], ep->comm.comm);
    moe_progress_unlock(b->progress);
}

/* Until op has completed (nothing when blocking); its time into `stage`. */
static void finish(bwd_run *b, int op, moe_backward_stats *stats, int stage)
{
    if (!b->progress)
        return;
    const double t = moe_stage_begin();
    moe_progress_wait_at(b->progress, op, MOE_WATCH_BACKWARD, -1);
    moe_stage_end(&stats->seconds[stage], t);
}

/* A compute stage ends: its time since `start` into *seconds and, with a
 * trace, its event. */
static void compute_end(const bwd_run *b, double *seconds, int kind, int wave, double start,
                        moe_index rows)
{
    const double now = moe_stage_event(b->trace, b->origin, start,
                                       (moe_event){.wave = wave, .kind = kind, .rows = rows, .tier = -1});
    *seconds += now - start;
}

/* Between pieces of computation: the operations in flight move. */
static void poll(bwd_run *b)
{
    if (b->progress)
        moe_progress_poll(b->progress);
}

/* Stage combine backward of wave w: the dy rows of this rank's tokens in
 * the wave to the ranks holding their experts, one per (token, rank) as
 * the dispatch sent x, into dy_in where the forward received x. */
static void combine_backward(const moe_ep *ep, const moe_ref_forward *f, bwd_run *b, int w,
                             moe_backward_stats *stats)
{
    const int G = ep->comm.ranks, me = ep->comm.rank, op = op_combine(w);
    const moe_index d = ep->cfg->hidden;
    const moe_index *out = split(b, HOME_ROWS, w, G), *in = split(b, IN_ROWS, w, G);
    const double t = moe_stage_begin();
    exchange(ep, b, op, 0, C_DY, out, split_at(b, HOME_ROWS, w, G), in, split_at(b, IN_ROWS, w, G),
             b->send_dy, b->dy_in, b->row);
    moe_pipeline_link_bytes(ep, in, out, (double)d * sizeof(float), b->bytes[op]);
    launched(ep, b, op, 1);
    if (b->serial)
        finish(b, op, stats, MOE_BWD_COMBINE);
    for (int r = 0; r < G; r++) {
        stats->bytes_combine += (double)out[r] * (double)d * sizeof(float);
        if (r != me)
            stats->bytes_remote += (double)out[r] * (double)d * sizeof(float);
    }
    moe_stage_end(&stats->seconds[MOE_BWD_COMBINE], t);
}

/* Rows of an expert's data gradient at a time: its temporaries (dx, h,
 * dA, dO) are this many rows, not the expert's. */
enum { DGRAD_ROW_BLOCK = 512 };

/* The selected rows of one expert in one wave, a block at a time: x, dy
 * and the outputs read where they are through the block's row tables. */
typedef struct {
    moe_index *at;  /* (n) position in the expert-ordered pair lists */
    moe_index *row, *pair;
    const float **x, **dy, **out; /* (block) row tables */
    float *dx, *gate, *dg;
    float *weights; /* the expert's, laid out for its data GEMMs */
    moe_expert_grad_work work; /* when the wave has some of the expert's rows only */
} dgrad_batch;

/* The gate of expert row m of recv (the weight of its pair). */
static float pair_gate(const moe_ref_forward *f, moe_index m, int k)
{
    return moe_meta_weight(f->recv_meta + f->recv.expert_row[m] * MOE_META_WORDS(k), k,
                           f->recv.expert_slot[m]);
}

/* rows[row[i]] += dx[i] for the n rows of a block (d floats each). */
static void add_rows(const float *dx, moe_index d, const moe_index *row, moe_index n, float *rows)
{
    for (moe_index i = 0; i < n; i++)
        moe_ep_add_row(d, dx + i * d, rows + row[i] * d);
}

/* Stage experts, the data gradient of waves [w0, w1), for every local
 * expert on its rows of those waves in global token order (its rows in
 * the waves' order then, as one batch), DGRAD_ROW_BLOCK rows at a time
 * (with packed and exact a row's results depend on that row only): dx per
 * pair added to its row's sum (--combine reduced: a row's pairs summed from
 * zero in local expert order, as the experts run, so no pair's dx waits for
 * its row's last expert) or written to pair_dx (--combine pairs, and for a
 * dump), dL/dweight into pair_dg (the combine's pair order), and each
 * pair's dH and a' into work at the pair's place in its expert's rows. */
static void experts_dgrad(const moe_ep *ep, const moe_ref_forward *f, bwd_run *b, int w0,
                          int w1, moe_backward_stats *stats)
{
    const moe_config *cfg = ep->cfg;
    const moe_index d = cfg->hidden, ff = cfg->ffn;
    const int k = (int)cfg->topk;
    const moe_recv_plan *recv = &f->recv;
    const moe_index most = moe_ep_largest_batch(recv);
    const moe_index block = most < DGRAD_ROW_BLOCK ? most : DGRAD_ROW_BLOCK;
    dgrad_batch q = {.at = moe_xmalloc(sizeof(moe_index) * (size_t)most * 3)};
    q.row = q.at + most;
    q.pair = q.row + most;
    q.gate = moe_xmalloc(sizeof(float) * (size_t)most);
    q.x = moe_xmalloc(sizeof(float *) * (size_t)(3 * block));
    q.dy = q.x + block;
    q.out = q.dy + block;
    q.dx = moe_xmalloc(sizeof(float) * (size_t)(block * (d + 1)));
    q.dg = q.dx + block * d;
    q.weights = moe_xmalloc(sizeof(float) * (size_t)moe_ep_grad_weights_floats(ep));
    const bool some = w1 - w0 < b->W; /* of the waves: an expert's rows in part */
    if (some)
        q.work = moe_expert_grad_work_alloc(block, d, ff);
    const double t = moe_stage_begin();
    moe_index rows = 0;
    moe_gemm_reset_flops();
    for (int l = 0; l < ep->local_experts; l++) {
        const moe_index first = recv->expert_offset[l];
        moe_index n = 0;
        for (moe_index m = first; m < recv->expert_offset[l + 1]; m++) {
            const int wave = b->row_wave[recv->expert_row[m]];
            if (wave >= w0 && wave < w1) {
                q.at[n] = m;
                q.row[n] = recv->expert_row[m];
                q.pair[n] = recv->expert_pair[m];
                q.gate[n] = pair_gate(f, m, k);
                n++;
            }
        }
        if (n == 0)
            continue;
        rows += n;
        /* All the expert's rows: its work in place; some: gathered, then
         * scattered to their places. */
        const bool whole = n == recv->expert_offset[l + 1] - first;
        const moe_expert_weights fw = moe_ep_weights(ep, false, l);
        const moe_expert_grad_weights bw = moe_ep_grad_weights(ep, false, l, q.weights);
        for (moe_index b0 = 0; b0 < n; b0 += block) {
            const moe_index nb = n - b0 < block ? n - b0 : block;
            for (moe_index i = 0; i < nb; i++) {
                q.x[i] = f->recv_values + q.row[b0 + i] * d;
                q.dy[i] = b->dy_in + q.row[b0 + i] * d;
                q.out[i] = f->expert_out + q.pair[b0 + i] * d;
            }
            const moe_expert_grad_work work =
                whole ? moe_expert_grad_work_rows(&b->work, first + b0, d, ff) : q.work;
            moe_expert_backward_data_rows(&fw, &bw, ep->gemm, q.x, q.dy, q.gate + b0, q.out,
                                          cfg->weight_at, nb, d, ff, &work, q.dx, q.dg);
            if (!whole) {
                moe_scatter_rows(work.dH, 2 * ff, q.at + b0, nb, b->work.dH);
                moe_scatter_rows(work.act, ff, q.at + b0, nb, b->work.act);
            }
            if (b->sums)
                add_rows(q.dx, d, q.row + b0, nb, b->sums);
            if (b->pair_dx)
                moe_scatter_rows(q.dx, d, q.pair + b0, nb, b->pair_dx);
            moe_scatter_rows(q.dg, 1, q.pair + b0, nb, b->pair_dg);
            poll(b);
        }
    }
    stats->dgrad_flops += moe_gemm_sflops();
    compute_end(b, &stats->seconds[MOE_BWD_DGRAD], MOE_EVENT_DGRAD, some ? w0 : -1, t, rows);
    if (some)
        moe_expert_grad_work_free(&q.work);
    free(q.weights);
    free(q.dx);
    free(q.x);
    free(q.gate);
    free(q.at);
}

/* Stage experts, the weight gradient: each local expert's dW1, dW2 from all
 * its rows (in global token order, whatever their waves), their x and dy
 * read in place in the received rows, their gates and their work. */
static void experts_wgrad(const moe_ep *ep, const moe_ref_forward *f, bwd_run *b, moe_ep_grads *g,
                          moe_backward_stats *stats)
{
    const moe_index d = ep->cfg->hidden, ff = ep->cfg->ffn;
    const int k = (int)ep->cfg->topk;
    const moe_recv_plan *recv = &f->recv;
    float *gate = moe_xmalloc(sizeof(float) * (size_t)moe_ep_largest_batch(recv) + 1);
    const double t = moe_stage_begin();
    moe_gemm_reset_flops();
    for (int l = 0; l < ep->local_experts; l++) {
        const moe_index first = recv->expert_offset[l], n = recv->expert_offset[l + 1] - first;
        for (moe_index i = 0; i < n; i++)
            gate[i] = pair_gate(f, first + i, k);
        const moe_expert_grad_work work = moe_expert_grad_work_rows(&b->work, first, d, ff);
        moe_expert_backward_weights(ep->gemm, f->recv_values, b->dy_in, recv->expert_row + first,
                                    gate, ep->cfg->weight_at, n, d, ff, &work,
                                    g->dw1 + l * 2 * ff * d, g->dw2 + l * d * ff);
        poll(b);
    }
    stats->wgrad_flops = moe_gemm_sflops();
    compute_end(b, &stats->seconds[MOE_BWD_WGRAD], MOE_EVENT_WGRAD, -1, t, recv->pairs);
    free(gate);
}

/* Stage dispatch backward of wave w: dx home as the forward's combine came
 * (reduced: one row per received row, its pairs' dx summed by the data
 * gradient; pairs: one per pair), and dL/dweight per pair. */
static void dispatch_backward(const moe_ep *ep, bwd_run *b, int w, moe_backward_stats *stats)
{
    const int G = ep->comm.ranks, me = ep->comm.rank, op = op_dispatch(w);
    const moe_index d = ep->cfg->hidden;
    const bool reduced = ep->cfg->combine == MOE_COMBINE_REDUCED;
    const int out_kind = reduced ? IN_ROWS : IN_PAIRS, back_kind = reduced ? HOME_ROWS : HOME_PAIRS;
    const moe_index *out = split(b, out_kind, w, G), *out_at = split_at(b, out_kind, w, G);
    const moe_index *pairs = split(b, IN_PAIRS, w, G);
    const double t = moe_stage_begin();
    exchange(ep, b, op, 0, C_DX, out, out_at, split(b, back_kind, w, G),
             split_at(b, back_kind, w, G), reduced ? b->sums : b->pair_dx, b->back, b->row);
    exchange(ep, b, op, 1, C_DG, pairs, split_at(b, IN_PAIRS, w, G), split(b, HOME_PAIRS, w, G),
             split_at(b, HOME_PAIRS, w, G), b->pair_dg, b->dg_back, MPI_FLOAT);
    moe_pipeline_link_bytes(ep, split(b, back_kind, w, G), out, (double)d * sizeof(float),
                            b->bytes[op]);
    moe_pipeline_link_bytes(ep, split(b, HOME_PAIRS, w, G), pairs, sizeof(float), b->bytes[op]);
    launched(ep, b, op, 2);
    if (b->serial)
        finish(b, op, stats, MOE_BWD_DISPATCH);
    for (int r = 0; r < G; r++) {
        const double bytes = ((double)out[r] * (double)d + (double)pairs[r]) * sizeof(float);
        stats->bytes_dispatch += bytes;
        if (r != me)
            stats->bytes_remote += bytes;
    }
    moe_stage_end(&stats->seconds[MOE_BWD_DISPATCH], t);
}

/* Stage shared: each shared expert's dx (into shared_dx, summed in
 * expert order) and dW over this rank's tokens. The data gradient runs in
 * blocks of MOE_SHARED_ROW_BLOCK tokens (a row's dx depends on its row only
 * with packed and exact), between which the operations in flight move. */
static void shared_backward(const moe_ep *ep, const float *x, const float *dy, bwd_run *b,
                            moe_ep_grads *g, moe_backward_stats *stats)
{
    const moe_config *cfg = ep->cfg;
    const moe_index T = cfg->tokens, d = cfg->hidden, ff = cfg->ffn;
    const double t = moe_stage_begin();
    float *dx = moe_xmalloc(sizeof(float) * (size_t)(MOE_SHARED_ROW_BLOCK * d));
    moe_expert_grad_work work = {0};
    if (cfg->shared_experts > 0) /* all T rows, for the wgrad */
        work = moe_expert_grad_work_alloc(T, d, ff);
    float *weights = moe_xmalloc(sizeof(float) * (size_t)moe_ep_grad_weights_floats(ep));
    if (b->shared_dx)
        memset(b->shared_dx, 0, sizeof(float) * (size_t)(T * d));
    for (int s = 0; s < (int)cfg->shared_experts; s++) {
        const moe_expert_weights fw = moe_ep_weights(ep, true, s);
        const moe_expert_grad_weights bw = moe_ep_grad_weights(ep, true, s, weights);
        for (moe_index first = 0; first < T; first += MOE_SHARED_ROW_BLOCK) {
            const moe_index n = T - first < MOE_SHARED_ROW_BLOCK ? T - first : MOE_SHARED_ROW_BLOCK;
            const moe_expert_grad_work block = moe_expert_grad_work_rows(&work, first, d, ff);
            moe_expert_backward_data(&fw, &bw, ep->gemm, x + first * d, dy + first * d, NULL, NULL,
                                     cfg->weight_at, n, d, ff, &block, dx, NULL);
            for (moe_index m = 0; m < n * d; m++)
                b->shared_dx[first * d + m] += dx[m];
            poll(b);
        }
        moe_expert_backward_weights(ep->gemm, x, dy, NULL, NULL, cfg->weight_at, T, d, ff, &work,
                                    g->dshared_w1 + s * 2 * ff * d, g->dshared_w2 + s * d * ff);
        poll(b);
    }
    moe_expert_grad_work_free(&work);
    free(weights);
    free(dx);
    compute_end(b, &stats->seconds[MOE_BWD_SHARED], MOE_EVENT_SHARED_BWD, -1, t, T);
}

/* Stage reduce at home: dx (T, d) = the rows that came home (ascending
 * destination, or slot, order), then the shared experts' dx; dweights (T,
 * k) = dL/dweight of each slot. */
static void reduce_home(const moe_ep *ep, const moe_ref_forward *f, const int32_t *ids,
                        const bwd_run *b, double *dweights, float *dx, moe_backward_stats *stats)
{
    const moe_config *cfg = ep->cfg;
    const int G = ep->comm.ranks, k = (int)cfg->topk;
    const moe_index T = cfg->tokens, d = cfg->hidden;
    const bool reduced = cfg->combine == MOE_COMBINE_REDUCED;
    const double t = moe_stage_begin();
    const float **from = moe_xmalloc(sizeof(float *) * (size_t)G);
    const float **slot_rows = moe_xmalloc(sizeof(float *) * (size_t)(T * k) + 1);
    for (int r = 0; r < G; r++)
        from[r] = b->back + (reduced ? f->send.row_offset[r] : f->send.pair_offset[r]) * d;
    if (reduced) {
        moe_ep_reduce_rows(ep, &ep->placement, ids, NULL, from, 1, dx);
    } else {
        moe_combine_locate(&f->send, from, d, slot_rows);
        moe_combine_reduce(slot_rows, NULL, T, k, d, dx);
    }
    for (int r = 0; r < G; r++)
        from[r] = b->dg_back + f->send.pair_offset[r];
    moe_combine_locate(&f->send, from, 1, slot_rows);
    for (moe_index n = 0; n < T * k; n++)
        dweights[n] = *slot_rows[n];
    if (b->shared_dx)
        for (moe_index n = 0; n < T * d; n++)
            dx[n] += b->shared_dx[n];
    free(slot_rows);
    free(from);
    moe_stage_end(&stats->seconds[MOE_BWD_REDUCE], t);
}

/* Stage router: dx += the router's share, rounded once from fp64; dW_g
 * (this rank's tokens, fp64) into dgate_w (E, d). */
static void router_backward(const moe_ep *ep, const float *x, const float *logits,
                            const int32_t *ids, const double *dweights, float *dx,
                            double *dgate_w, moe_backward_stats *stats)
{
    const moe_index T = ep->cfg->tokens, d = ep->cfg->hidden;
    const double t = moe_stage_begin();
    moe_router_gate_backward_rounded(&ep->router, ep->gate, x, logits, ids, dweights, T, d, dx,
                                     dgate_w);
    moe_stage_end(&stats->seconds[MOE_BWD_ROUTER], t);
}

/* The all-to-alls of every wave as comm events, the rows and bytes this
 * rank sent to other ranks in each (nothing without a trace). */
static void comm_events(const moe_ep *ep, const bwd_run *b)
{
    const int G = ep->comm.ranks, me = ep->comm.rank;
    const bool reduced = ep->cfg->combine == MOE_COMBINE_REDUCED;
    const double row = (double)ep->cfg->hidden * sizeof(float);
    for (int w = 0; b->trace && w < b->W; w++) {
        moe_index dy_rows = 0, dx_rows = 0, pairs = 0;
        for (int r = 0; r < G; r++)
            if (r != me) {
                dy_rows += split(b, HOME_ROWS, w, G)[r];
                dx_rows += split(b, reduced ? IN_ROWS : IN_PAIRS, w, G)[r];
                pairs += split(b, IN_PAIRS, w, G)[r];
            }
        const moe_comm_op *ops = b->progress->ops;
        moe_pipeline_comm_event(b->trace, &ops[op_combine(w)], w ? &ops[op_combine(w - 1)] : NULL,
                                b->origin, w, MOE_EVENT_COMBINE_BWD, -1, (double)dy_rows * row,
                                dy_rows);
        moe_pipeline_comm_event(b->trace, &ops[op_dispatch(w)], w ? &ops[op_dispatch(w - 1)] : NULL,
                                b->origin, w, MOE_EVENT_DISPATCH_BWD, -1,
                                (double)dx_rows * row + (double)pairs * sizeof(float), dx_rows);
    }
}

/* v (n) = every rank's v summed in rank order in fp64 (moe_comm_sum_ordered),
 * rounded once; partial (n) is scratch. */
static void sum_over_ranks(const moe_comm *c, float *v, double *partial, moe_index n)
{
    for (moe_index m = 0; m < n; m++)
        partial[m] = v[m];
    moe_comm_sum_ordered(c, partial, n);
    for (moe_index m = 0; m < n; m++)
        v[m] = (float)partial[m];
}

static float *copy_floats(const float *v, moe_index n)
{
    float *c = moe_xmalloc(sizeof(float) * (size_t)n + 1);
    memcpy(c, v, sizeof(float) * (size_t)n);
    return c;
}

static void capture_backward(const moe_ref_forward *f, const bwd_run *b, moe_index d,
                             moe_ep_bwd_capture *cap)
{
    cap->rows = f->rows_in;
    cap->pairs = f->recv.pairs;
    cap->dy = copy_floats(b->dy_in, cap->rows * d);
    cap->dx = copy_floats(b->pair_dx, cap->pairs * d);
    cap->dweight = copy_floats(b->pair_dg, cap->pairs);
    cap->sums = b->sums ? copy_floats(b->sums, cap->rows * d) : NULL;
}

void moe_ep_bwd_capture_free(moe_ep_bwd_capture *capture)
{
    free(capture->dy);
    free(capture->dx);
    free(capture->dweight);
    free(capture->sums);
    memset(capture, 0, sizeof *capture);
}

/* DualPipe's pairing: another micro-batch's reference forward, run inside a
 * backward with its all-to-alls on the same progress engine. */
typedef struct {
    const float *x;
    const int32_t *ids;
    const float *weights;
    float *y;
    moe_forward_stats *stats;
    moe_ref_forward f;
} paired_forward;

/* Until the paired forward's operation op is in; its wait into `stage`. */
static void paired_wait(moe_progress *p, int op, paired_forward *pf, int stage)
{
    const double t = moe_stage_begin();
    moe_progress_wait_at(p, op, MOE_WATCH_BACKWARD, -1);
    moe_stage_end(&pf->stats->seconds[stage], t);
}

/* At `laptop`, np 2, W = 4 wave by wave the data gradient read 126-129
 * GFLOP/s a rank against 156-161 at W = 1 (docs/performance.md). */
bool moe_ep_backward_one_pass(const moe_ep *ep, const moe_schedule *sched)
{
    return sched && sched->waves > 1 && sched->wave_by == MOE_WAVE_BY_AUTO &&
           !moe_schedule_link(ep, sched)->enabled;
}

/* The backward's buffers, its waves' plan and this rank's dy rows packed in
 * the dispatch's order; progress (sched not NULL) set up for the
 * backward's 2W operations and a paired forward's two. */
static void bwd_open(const moe_ep *ep, const moe_schedule *sched, const moe_ref_forward *f,
                     const int32_t *ids, const float *dy, bool paired, bool capture,
                     moe_progress *progress, bwd_run *b, moe_backward_stats *bwd)
{
    const moe_config *cfg = ep->cfg;
    const int G = ep->comm.ranks;
    const moe_index T = cfg->tokens, d = cfg->hidden, ff = cfg->ffn;
    const bool reduced = cfg->combine == MOE_COMBINE_REDUCED;
    const moe_index pairs = f->recv.pairs, pairs_out = f->send.pair_offset[G];
    const int W = sched ? sched->waves : 1, ops = 2 * W;
    *b = (bwd_run){.pool = ep->work ? &ep->work->pool : NULL,
                   .progress = sched ? progress : NULL,
                   .link = sched ? moe_schedule_link(ep, sched) : NULL,
                   .trace = sched ? sched->trace : NULL,
                   .serial = sched && sched->serial,
                   .origin = sched ? sched->origin : 0.0,
                   .W = W,
                   .lookahead = sched && sched->lookahead < W ? sched->lookahead : W};
    /* One pass: every combine backward on the wire before the shared
     * experts, which hide them. */
    b->pass = moe_ep_backward_one_pass(ep, sched) ? W : 1;
    if (b->pass > 1)
        b->lookahead = W;
    moe_waves_init_by(&b->waves, &ep->placement, W, T, MOE_WAVE_BY_TOKENS);
    b->counts = moe_xmalloc(sizeof(int) * (size_t)(ops * COUNT_SETS * COUNT_ARRAYS * G));
    b->bytes = moe_xcalloc((size_t)ops, sizeof *b->bytes);
    MOE_MPI(MPI_Type_contiguous((int)d, MPI_FLOAT, &b->row));
    MOE_MPI(MPI_Type_commit(&b->row));
    if (sched) /* after the MPI calls above: a progress thread may run from here */
        moe_progress_init(progress, sched->progress, ops + (paired ? 2 : 0));
    b->send_dy = moe_pool_xtake(b->pool, sizeof(float) * (size_t)(f->send.row_offset[G] * d) + 1);
    b->dy_in = moe_pool_xtake(b->pool, sizeof(float) * (size_t)(f->rows_in * d) + 1);
    b->work = moe_expert_grad_work_in(moe_pool_xtake(b->pool, moe_expert_grad_work_bytes(pairs, ff)),
                                      pairs, ff);
    b->pair_dx = !reduced || capture ? moe_pool_xtake(b->pool, sizeof(float) * (size_t)(pairs * d) + 1) : NULL;
    b->pair_dg = moe_pool_xtake(b->pool, sizeof(float) * (size_t)pairs + 1);
    /* fp32 on the wire */
    if (reduced) {
        b->sums = moe_pool_xtake(b->pool, sizeof(float) * (size_t)(f->rows_in * d) + 1);
        memset(b->sums, 0, sizeof(float) * (size_t)(f->rows_in * d));
    }
    const moe_index back_rows = reduced ? f->send.row_offset[G] : pairs_out;
    b->back = moe_pool_xtake(b->pool, sizeof(float) * (size_t)(back_rows * d) + 1);
    b->dg_back = moe_pool_xtake(b->pool, sizeof(float) * (size_t)pairs_out + 1);
    b->shared_dx = cfg->shared_experts > 0 ? moe_pool_xtake(b->pool, sizeof(float) * (size_t)(T * d)) : NULL;
    plan_waves(ep, f, ids, b);
    const double t0 = moe_stage_begin();
    moe_gather_rows(dy, d, f->send.row_token, f->send.row_offset[G], b->send_dy);
    moe_stage_end(&bwd->seconds[MOE_BWD_COMBINE], t0);
}

/* Pass by pass (b->pass waves each), as the combines backward land: the
 * combine w + A posted as wave w's turn comes (lookahead A), the pass's
 * data gradients behind the later combines and the earlier dispatches,
 * then its waves' dispatches backward posted. */
static void bwd_data_waves(const moe_ep *ep, const moe_ref_forward *f, bwd_run *b,
                           moe_backward_stats *bwd)
{
    const int W = b->W;
    for (int w0 = 0, w1; w0 < W; w0 = w1) {
        w1 = w0 + b->pass < W ? w0 + b->pass : W;
        for (int w = w0; w < w1; w++) {
            if (w + b->lookahead < W)
                combine_backward(ep, f, b, w + b->lookahead, bwd);
            finish(b, op_combine(w), bwd, MOE_BWD_COMBINE);
        }
        if (w1 == W) { /* every combine backward is in: dy as sent is done with */
            moe_pool_give(b->pool, b->send_dy);
            b->send_dy = NULL;
        }
        experts_dgrad(ep, f, b, w0, w1, bwd);
        for (int w = w0; w < w1; w++)
            dispatch_backward(ep, b, w, bwd);
    }
}

/* The progress engine stopped; each direction's time in flight, from the
 * first post to the last completion, and the backward's comm events. */
static void bwd_progress_close(const moe_ep *ep, bwd_run *b, moe_progress *progress,
                               moe_backward_stats *bwd)
{
    moe_progress_stop(progress);
    bwd->test_seconds = progress->test_seconds;
    for (int dir = 0; dir < 2; dir++) {
        double first = 0, last = 0;
        for (int w = 0; w < b->W; w++) {
            const moe_comm_op *o = &progress->ops[dir ? op_dispatch(w) : op_combine(w)];
            first = w == 0 || o->posted < first ? o->posted : first;
            last = o->completed > last ? o->completed : last;
        }
        bwd->in_flight[dir] = last - first;
    }
    comm_events(ep, b);
    moe_progress_free(progress);
}

/* dx home and the router's gradients, then the replicated weights'
 * gradients (the gate's, the shared experts') summed over the ranks in
 * rank order, in fp64. */
static void bwd_home(const moe_ep *ep, const moe_ref_forward *f, const float *x,
                     const float *logits, const int32_t *ids, bwd_run *b, moe_ep_grads *g,
                     moe_backward_stats *bwd)
{
    const moe_config *cfg = ep->cfg;
    const moe_index d = cfg->hidden, ff = cfg->ffn, E = cfg->experts, S = cfg->shared_experts;
    double *dweights = moe_xmalloc(sizeof(double) * (size_t)(cfg->tokens * cfg->topk) + 1);
    const moe_index most = E * d > S * 2 * ff * d ? E * d : S * 2 * ff * d;
    double *partial = moe_xmalloc(sizeof(double) * (size_t)most);
    reduce_home(ep, f, ids, b, dweights, g->dx, bwd);
    router_backward(ep, x, logits, ids, dweights, g->dx, partial, bwd);
    const double t = moe_stage_begin();
    moe_comm_sum_ordered(&ep->comm, partial, E * d); /* the gate's, in fp64 so far */
    for (moe_index n = 0; n < E * d; n++)
        g->dgate[n] = (float)partial[n];
    sum_over_ranks(&ep->comm, g->dshared_w1, partial, S * 2 * ff * d);
    sum_over_ranks(&ep->comm, g->dshared_w2, partial, S * d * ff);
    moe_stage_end(&bwd->seconds[MOE_BWD_ALLREDUCE], t);
    free(partial);
    free(dweights);
}

static void bwd_free(bwd_run *b)
{
    moe_pool_give(b->pool, b->shared_dx);
    moe_pool_give(b->pool, b->dg_back);
    moe_pool_give(b->pool, b->back);
    moe_pool_give(b->pool, b->sums);
    moe_pool_give(b->pool, b->pair_dg);
    moe_pool_give(b->pool, b->pair_dx);
    moe_pool_give(b->pool, b->work.dH);
    moe_pool_give(b->pool, b->dy_in);
    moe_pool_give(b->pool, b->send_dy);
    MOE_MPI(MPI_Type_free(&b->row));
    free(b->row_wave);
    free(b->split_at);
    free(b->split);
    free(b->bytes);
    free(b->counts);
    moe_waves_free(&b->waves);
}

/* The backward after a kept forward f, blocking (sched NULL) or with its
 * all-to-alls in flight as sched->progress drives them; cap, when not NULL,
 * receives what this rank saw. The same sequence on both: what overlaps is
 * what has no use for the data in flight. Paired (DualPipe, pf): the other
 * micro-batch's forward stages go where this backward's all-to-alls are in
 * flight, and the other way round. */
static void backward(const moe_ep *ep, const moe_schedule *sched, const moe_ref_forward *f,
                     const float *x, const float *logits, const int32_t *ids, const float *dy,
                     moe_ep_grads *g, moe_backward_stats *bwd, moe_ep_bwd_capture *cap,
                     paired_forward *pf)
{
    moe_progress progress;
    bwd_run b;
    bwd_open(ep, sched, f, ids, dy, pf != NULL, cap != NULL, &progress, &b, bwd);
    const moe_ref_flight flight = {&progress, 2 * b.W, b.link, &b.links};
    if (pf) { /* its plan agreed on while nothing is in flight */
        moe_status st = {0};
        if (moe_ep_ref_begin(ep, pf->x, pf->ids, pf->weights, &pf->f, pf->stats, &flight, &st))
            moe_comm_abort(&ep->comm, &st);
    }
    for (int w = 0; w < b.lookahead; w++) /* waves 0 .. A-1 on the wire before anything computes */
        combine_backward(ep, f, &b, w, bwd);
    shared_backward(ep, x, dy, &b, g, bwd); /* behind the first combines */
    if (pf) { /* behind the combines backward */
        paired_wait(&progress, flight.op, pf, MOE_STAGE_DISPATCH);
        moe_ep_ref_experts(ep, &pf->f, pf->stats, &flight);
    }
    bwd_data_waves(ep, f, &b, bwd);
    if (pf) { /* behind the dispatches backward */
        paired_wait(&progress, flight.op + 1, pf, MOE_STAGE_COMBINE);
        moe_ep_ref_end(ep, &pf->f, pf->x, pf->ids, pf->weights, pf->y, pf->stats);
    }
    if (cap)
        capture_backward(f, &b, ep->cfg->hidden, cap);
    experts_wgrad(ep, f, &b, g, bwd); /* behind the last dispatches */
    for (int w = 0; w < b.W; w++)
        finish(&b, op_dispatch(w), bwd, MOE_BWD_DISPATCH);
    if (sched)
        bwd_progress_close(ep, &b, &progress, bwd);
    bwd_home(ep, f, x, logits, ids, &b, g, bwd);
    bwd_free(&b);
}

/* A training step: the kept blocking forward, then the backward. */
static int step(const moe_ep *ep, const moe_schedule *sched, const float *x, const float *logits,
                const int32_t *ids, const float *weights, const float *dy, float *y,
                moe_ep_grads *g, moe_forward_stats *fwd, moe_backward_stats *bwd,
                moe_ep_capture *fwd_capture, moe_ep_bwd_capture *bwd_capture, moe_status *st)
{
    memset(bwd, 0, sizeof *bwd);
    moe_ref_forward f;
    const double start = moe_stage_begin();
    const int rc = moe_ep_ref_run(ep, x, ids, weights, y, fwd, fwd_capture, &f, st);
    if (sched) /* the blocking forward, one block */
        moe_stage_event(sched->trace, sched->origin, start,
                        (moe_event){.wave = -1, .kind = MOE_EVENT_FORWARD,
                                    .rows = ep->cfg->tokens, .tier = -1});
    if (rc == MOE_EXIT_OK) {
        moe_ep_ref_release(&f); /* the backward's buffers take their place */
        backward(ep, sched, &f, x, logits, ids, dy, g, bwd, bwd_capture, NULL);
    }
    moe_ep_ref_free(&f);
    return rc;
}

int moe_ep_pair_step(const moe_ep *ep, const moe_schedule *sched, enum moe_pair_mode mode,
                     const float *x, const float *logits, const int32_t *ids,
                     const float *weights, const float *dy, float *y, moe_ep_grads *g,
                     moe_forward_stats *fwd, moe_backward_stats *bwd, double *seconds,
                     moe_status *st)
{
    memset(bwd, 0, sizeof *bwd);
    moe_ref_forward a; /* micro-batch A's forward, kept for its backward */
    moe_forward_stats fwd_a;
    int rc = moe_ep_ref_run(ep, x, ids, weights, y, &fwd_a, NULL, &a, st);
    if (rc == MOE_EXIT_OK)
        moe_ep_ref_release(&a);
    moe_schedule quiet = *sched; /* no pictures of these */
    quiet.trace = NULL;
    moe_comm_barrier(&ep->comm);
    const double start = moe_stage_begin();
    if (rc == MOE_EXIT_OK && mode == MOE_PAIR_SERIAL) { /* one wave, each all-to-all waited for */
        quiet.waves = 1;
        quiet.serial = true;
        rc = moe_ep_forward_waves(ep, &quiet, x, ids, weights, y, fwd, st);
        if (rc == MOE_EXIT_OK)
            backward(ep, &quiet, &a, x, logits, ids, dy, g, bwd, NULL, NULL);
    } else if (rc == MOE_EXIT_OK && mode == MOE_PAIR_WAVES) {
        rc = moe_ep_forward_waves(ep, &quiet, x, ids, weights, y, fwd, st);
        if (rc == MOE_EXIT_OK)
            backward(ep, &quiet, &a, x, logits, ids, dy, g, bwd, NULL, NULL);
    } else if (rc == MOE_EXIT_OK) {
        memset(fwd, 0, sizeof *fwd);
        paired_forward b = {.x = x, .ids = ids, .weights = weights, .y = y, .stats = fwd};
        backward(ep, &quiet, &a, x, logits, ids, dy, g, bwd, NULL, &b);
        moe_ep_ref_free(&b.f);
    }
    *seconds = moe_stage_since(start);
    moe_ep_ref_free(&a);
    return rc;
}

int moe_ep_backward_step(const moe_ep *ep, const moe_schedule *sched, const float *x,
                         const float *logits, const int32_t *ids, const float *weights,
                         const float *dy, float *y, moe_ep_grads *g, moe_forward_stats *fwd,
                         moe_backward_stats *bwd, moe_status *st)
{
    return step(ep, sched, x, logits, ids, weights, dy, y, g, fwd, bwd, NULL, NULL, st);
}

int moe_ep_backward_ref(const moe_ep *ep, const float *x, const float *logits, const int32_t *ids,
                        const float *weights, const float *dy, float *y, moe_ep_grads *g,
                        moe_forward_stats *fwd, moe_backward_stats *bwd, moe_status *st)
{
    return step(ep, NULL, x, logits, ids, weights, dy, y, g, fwd, bwd, NULL, NULL, st);
}

int moe_ep_backward_capture(const moe_ep *ep, const float *x, const float *logits,
                            const int32_t *ids, const float *weights, const float *dy, float *y,
                            moe_ep_grads *g, moe_ep_capture *fwd_capture,
                            moe_ep_bwd_capture *bwd_capture, moe_status *st)
{
    moe_forward_stats fwd;
    moe_backward_stats bwd;
    return step(ep, NULL, x, logits, ids, weights, dy, y, g, &fwd, &bwd, fwd_capture, bwd_capture,
                st);
}
