/* ep_backward.c — the backward of a training step (see ep.h,
 * moe_ep_backward_ref and moe_ep_backward_step): the forward's stages run
 * in mirror image, one sequence for the blocking and the nonblocking path.
 *
 *   forward    dispatch (x rows)  experts  combine (outputs)  reduce  shared
 *   backward   combine backward (dy rows, along the dispatch's plan)
 *                 in flight: the shared experts' dx and dW
 *              → experts dgrad → dispatch backward (dx rows and dL/dweight,
 *              along the combine's)
 *                 in flight: the routed experts' dW (wgrad)
 *              → reduce (+ the shared experts' dx) → router → the
 *              replicated weights' gradients summed over ranks
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
#include "ep_stages.h"

void moe_ep_grads_init(const moe_ep *ep, moe_ep_grads *g)
{
    const moe_config *cfg = ep->cfg;
    const size_t d = (size_t)cfg->hidden, f = (size_t)cfg->ffn, EL = (size_t)ep->local_experts,
                 S = (size_t)cfg->shared_experts;
    g->dx = moe_xmalloc(sizeof(float) * (size_t)cfg->tokens * d + 1);
    g->dw1 = moe_xmalloc(sizeof(float) * EL * 2 * f * d + 1);
    g->dw2 = moe_xmalloc(sizeof(float) * EL * d * f + 1);
    g->dshared_w1 = moe_xmalloc(sizeof(float) * S * 2 * f * d + 1);
    g->dshared_w2 = moe_xmalloc(sizeof(float) * S * d * f + 1);
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

/* One backward's buffers, and how its two all-to-alls run: blocking (each
 * waited for when posted), or in flight behind the computation that needs
 * none of their data (the shared experts behind the combine backward, the
 * routed experts' weight gradients behind the dispatch backward). */
enum { OP_COMBINE, OP_DISPATCH, OPS };            /* the operations of a backward */
enum { C_DY, C_DX, C_DG, COUNT_SETS };            /* their count arrays */
enum { SEND, SEND_AT, RECV, RECV_AT, COUNT_ARRAYS };

typedef struct {
    moe_progress *progress; /* NULL: blocking */
    const moe_link *link;   /* the emulated links, or NULL */
    moe_link_state links;
    double bytes[OPS][2][MOE_TIERS]; /* each op over the links: [in, out][tier] */
    int *counts;            /* (COUNT_SETS, COUNT_ARRAYS, G), kept until the operation completes */
    MPI_Datatype row;       /* d fp32 values */
    float *send_dy;         /* (rows out, d) this rank's dy rows in dispatch order */
    float *dy_in;           /* (rows in, d) as the forward received x */
    moe_expert_grad_work work; /* (pairs) each pair's dO, dH, a', grouped by expert */
    float *pair_dx;         /* (pairs, d) in the combine's pair order */
    float *pair_dg;         /* (pairs) dL/dweight */
    float *sums;            /* --combine reduced: (rows in, d) */
    float *back;            /* (rows or pairs sent out, d) dx come home */
    float *dg_back;         /* (pairs sent out) */
    float *shared_dx;       /* (T, d) the shared experts' dx */
} bwd_run;

static int *counts(bwd_run *b, int set, int array, int G)
{
    return b->counts + ((size_t)set * COUNT_ARRAYS + (size_t)array) * (size_t)G;
}

/* Post (or, blocking, run) the all-to-all of request `request` of op,
 * counts of set `set` laid out from send_rows (G) and recv_rows (G);
 * launched() then puts the op in flight. */
static void exchange(const moe_ep *ep, bwd_run *b, int op, int request, int set,
                     const moe_index *send_rows, const moe_index *recv_rows, const void *send,
                     void *recv, MPI_Datatype type)
{
    const int G = ep->comm.ranks;
    int *sc = counts(b, set, SEND, G), *sa = counts(b, set, SEND_AT, G);
    int *rc = counts(b, set, RECV, G), *ra = counts(b, set, RECV_AT, G);
    moe_to_counts(send_rows, G, sc, sa);
    moe_to_counts(recv_rows, G, rc, ra);
    if (!b->progress) {
        moe_comm_count_posted(sc, G, ep->comm.rank, type);
        MOE_MPI(MPI_Alltoallv(send, sc, sa, type, recv, rc, ra, type, ep->comm.comm));
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
    const double t = MPI_Wtime();
    moe_progress_wait(b->progress, op);
    const moe_comm_op *o = &b->progress->ops[op];
    stats->seconds[stage] += MPI_Wtime() - t;
    stats->in_flight[op] = o->completed - o->posted;
}

/* Between pieces of computation: the operations in flight move. */
static void poll(bwd_run *b)
{
    if (b->progress)
        moe_progress_poll(b->progress);
}

/* Stage combine backward: the dy rows of this rank's tokens to the ranks
 * holding their experts, one per (token, rank) as the dispatch sent x, into
 * dy_in in the order the forward received x. */
static void combine_backward(const moe_ep *ep, const moe_ref_forward *f, const float *dy,
                             bwd_run *b, moe_backward_stats *stats)
{
    const int G = ep->comm.ranks, me = ep->comm.rank;
    const moe_index d = ep->cfg->hidden, rows_out = f->send.row_offset[G];
    const double t = MPI_Wtime();
    moe_gather_rows(dy, d, f->send.row_token, rows_out, b->send_dy);
    exchange(ep, b, OP_COMBINE, 0, C_DY, f->send.row_count, f->rows_from, b->send_dy, b->dy_in,
             b->row);
    moe_pipeline_link_bytes(ep, f->rows_from, f->send.row_count, (double)d * sizeof(float),
                            b->bytes[OP_COMBINE]);
    launched(ep, b, OP_COMBINE, 1);
    stats->bytes_combine = (double)rows_out * (double)d * sizeof(float);
    stats->bytes_remote += (double)(rows_out - f->send.row_count[me]) * (double)d * sizeof(float);
    stats->seconds[MOE_BWD_COMBINE] += MPI_Wtime() - t;
}

/* Stage experts, the data gradient, for every local expert on its rows in
 * global token order: dx per pair into pair_dx and dL/dweight into pair_dg
 * (the combine's pair order), and each pair's dO, dH, a' into work. */
static void experts_dgrad(const moe_ep *ep, const moe_ref_forward *f, bwd_run *b,
                          moe_backward_stats *stats)
{
    const moe_config *cfg = ep->cfg;
    const moe_index d = cfg->hidden, ff = cfg->ffn;
    const int k = (int)cfg->topk;
    const moe_recv_plan *recv = &f->recv;
    const moe_index most = moe_ep_largest_batch(recv);
    float *x = moe_xmalloc(sizeof(float) * (size_t)(most * d));
    float *dy = moe_xmalloc(sizeof(float) * (size_t)(most * d));
    float *out = moe_xmalloc(sizeof(float) * (size_t)(most * d));
    float *dx = moe_xmalloc(sizeof(float) * (size_t)(most * d));
    float *gate = moe_xmalloc(sizeof(float) * (size_t)most);
    float *dg = moe_xmalloc(sizeof(float) * (size_t)most);
    const double t = MPI_Wtime();
    moe_gemm_reset_flops();
    for (int l = 0; l < ep->local_experts; l++) {
        const moe_index first = recv->expert_offset[l], n = recv->expert_offset[l + 1] - first;
        const moe_index *row = recv->expert_row + first, *pair = recv->expert_pair + first;
        moe_gather_rows(f->recv_values, d, row, n, x);
        moe_gather_rows(b->dy_in, d, row, n, dy);
        moe_gather_rows(f->expert_out, d, pair, n, out);
        for (moe_index m = 0; m < n; m++)
            gate[m] = moe_meta_weight(f->recv_meta + row[m] * MOE_META_WORDS(k), k,
                                      recv->expert_slot[first + m]);
        const moe_expert_weights fw = moe_ep_weights(ep, false, l);
        const moe_expert_grad_weights bw = moe_ep_grad_weights(ep, false, l);
        const moe_expert_grad_work work = moe_expert_grad_work_rows(&b->work, first, d, ff);
        moe_expert_backward_data(&fw, &bw, ep->gemm, x, dy, gate, out, cfg->weight_at, n, d, ff,
                                 &work, dx, dg);
        moe_scatter_rows(dx, d, pair, n, b->pair_dx);
        moe_scatter_rows(dg, 1, pair, n, b->pair_dg);
        poll(b);
    }
    stats->dgrad_flops = moe_gemm_sflops();
    stats->seconds[MOE_BWD_DGRAD] += MPI_Wtime() - t;
    free(dg);
    free(gate);
    free(dx);
    free(out);
    free(dy);
    free(x);
}

/* Stage experts, the weight gradient: each local expert's dW1, dW2 from its
 * rows (in global token order) and their work. */
static void experts_wgrad(const moe_ep *ep, const moe_ref_forward *f, bwd_run *b, moe_ep_grads *g,
                          moe_backward_stats *stats)
{
    const moe_index d = ep->cfg->hidden, ff = ep->cfg->ffn;
    const moe_recv_plan *recv = &f->recv;
    float *x = moe_xmalloc(sizeof(float) * (size_t)(moe_ep_largest_batch(recv) * d));
    const double t = MPI_Wtime();
    moe_gemm_reset_flops();
    for (int l = 0; l < ep->local_experts; l++) {
        const moe_index first = recv->expert_offset[l], n = recv->expert_offset[l + 1] - first;
        moe_gather_rows(f->recv_values, d, recv->expert_row + first, n, x);
        const moe_expert_grad_work work = moe_expert_grad_work_rows(&b->work, first, d, ff);
        moe_expert_backward_weights(ep->gemm, x, n, d, ff, &work, g->dw1 + l * 2 * ff * d,
                                    g->dw2 + l * d * ff);
        poll(b);
    }
    stats->wgrad_flops = moe_gemm_sflops();
    stats->seconds[MOE_BWD_WGRAD] += MPI_Wtime() - t;
    free(x);
}

/* Stage dispatch backward: dx home as the forward's combine came (reduced:
 * one row per received row, its pairs' dx summed in slot order from zero;
 * pairs: one per pair), and dL/dweight per pair. */
static void dispatch_backward(const moe_ep *ep, const moe_ref_forward *f, bwd_run *b,
                              moe_backward_stats *stats)
{
    const int me = ep->comm.rank;
    const moe_index d = ep->cfg->hidden;
    const moe_recv_plan *recv = &f->recv;
    const bool reduced = ep->cfg->combine == MOE_COMBINE_REDUCED;
    const double t = MPI_Wtime();
    if (reduced) { /* fp32 on the wire: the sums are not rounded */
        moe_ep_reduce_at_source(ep, recv, NULL, b->pair_dx, b->sums);
        exchange(ep, b, OP_DISPATCH, 0, C_DX, f->rows_from, f->send.row_count, b->sums, b->back,
                 b->row);
    } else {
        exchange(ep, b, OP_DISPATCH, 0, C_DX, recv->source_pairs, f->send.pair_count, b->pair_dx,
                 b->back, b->row);
    }
    exchange(ep, b, OP_DISPATCH, 1, C_DG, recv->source_pairs, f->send.pair_count, b->pair_dg,
             b->dg_back, MPI_FLOAT);
    moe_pipeline_link_bytes(ep, reduced ? f->send.row_count : f->send.pair_count,
                            reduced ? f->rows_from : recv->source_pairs, (double)d * sizeof(float),
                            b->bytes[OP_DISPATCH]);
    moe_pipeline_link_bytes(ep, f->send.pair_count, recv->source_pairs, sizeof(float),
                            b->bytes[OP_DISPATCH]);
    launched(ep, b, OP_DISPATCH, 2);
    const moe_index rows_back = reduced ? recv->rows : recv->pairs;
    const moe_index own_rows = reduced ? f->rows_from[me] : recv->source_pairs[me];
    stats->bytes_dispatch = ((double)rows_back * (double)d + (double)recv->pairs) * sizeof(float);
    stats->bytes_remote += ((double)(rows_back - own_rows) * (double)d +
                            (double)(recv->pairs - recv->source_pairs[me])) * sizeof(float);
    stats->seconds[MOE_BWD_DISPATCH] += MPI_Wtime() - t;
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
    const double t = MPI_Wtime();
    float *dx = moe_xmalloc(sizeof(float) * (size_t)(MOE_SHARED_ROW_BLOCK * d));
    moe_expert_grad_work work = moe_expert_grad_work_alloc(T, d, ff); /* all T rows, for the wgrad */
    memset(b->shared_dx, 0, sizeof(float) * (size_t)(T * d));
    for (int s = 0; s < (int)cfg->shared_experts; s++) {
        const moe_expert_weights fw = moe_ep_weights(ep, true, s);
        const moe_expert_grad_weights bw = moe_ep_grad_weights(ep, true, s);
        for (moe_index first = 0; first < T; first += MOE_SHARED_ROW_BLOCK) {
            const moe_index n = T - first < MOE_SHARED_ROW_BLOCK ? T - first : MOE_SHARED_ROW_BLOCK;
            const moe_expert_grad_work block = moe_expert_grad_work_rows(&work, first, d, ff);
            moe_expert_backward_data(&fw, &bw, ep->gemm, x + first * d, dy + first * d, NULL, NULL,
                                     cfg->weight_at, n, d, ff, &block, dx, NULL);
            for (moe_index m = 0; m < n * d; m++)
                b->shared_dx[first * d + m] += dx[m];
            poll(b);
        }
        moe_expert_backward_weights(ep->gemm, x, T, d, ff, &work, g->dshared_w1 + s * 2 * ff * d,
                                    g->dshared_w2 + s * d * ff);
        poll(b);
    }
    moe_expert_grad_work_free(&work);
    free(dx);
    stats->seconds[MOE_BWD_SHARED] += MPI_Wtime() - t;
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
    const double t = MPI_Wtime();
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
    for (moe_index n = 0; n < T * d; n++)
        dx[n] += b->shared_dx[n];
    free(slot_rows);
    free(from);
    stats->seconds[MOE_BWD_REDUCE] += MPI_Wtime() - t;
}

/* Stage router: dx += the router's share, rounded once from fp64; dW_g
 * (this rank's tokens, fp64) into dgate_w (E, d). */
static void router_backward(const moe_ep *ep, const float *x, const float *logits,
                            const int32_t *ids, const double *dweights, float *dx,
                            double *dgate_w, moe_backward_stats *stats)
{
    const moe_index T = ep->cfg->tokens, d = ep->cfg->hidden;
    const double t = MPI_Wtime();
    double *dxr = moe_xcalloc((size_t)(T * d) + 1, sizeof(double));
    moe_router_gate_backward(&ep->router, ep->gate, x, logits, ids, dweights, T, d, dxr, dgate_w);
    for (moe_index n = 0; n < T * d; n++)
        dx[n] += (float)dxr[n];
    free(dxr);
    stats->seconds[MOE_BWD_ROUTER] = MPI_Wtime() - t;
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

/* The backward after a kept forward f, blocking (sched NULL) or with its
 * all-to-alls in flight as sched->progress drives them; cap, when not
 * NULL, receives what this rank saw. */
static void backward(const moe_ep *ep, const moe_schedule *sched, const moe_ref_forward *f,
                     const float *x, const float *logits, const int32_t *ids, const float *dy,
                     moe_ep_grads *g, moe_backward_stats *bwd, moe_ep_bwd_capture *cap)
{
    const moe_config *cfg = ep->cfg;
    const moe_comm *c = &ep->comm;
    const int G = c->ranks, k = (int)cfg->topk;
    const moe_index T = cfg->tokens, d = cfg->hidden, ff = cfg->ffn, E = cfg->experts;
    const moe_index S = cfg->shared_experts;
    const bool reduced = cfg->combine == MOE_COMBINE_REDUCED;
    const moe_index pairs = f->recv.pairs, pairs_out = f->send.pair_offset[G];
    moe_progress progress;
    bwd_run b = {.progress = sched ? &progress : NULL,
                 .link = sched ? moe_schedule_link(ep, sched) : NULL};
    b.counts = moe_xmalloc(sizeof(int) * (size_t)(COUNT_SETS * COUNT_ARRAYS * G));
    MOE_MPI(MPI_Type_contiguous((int)d, MPI_FLOAT, &b.row));
    MOE_MPI(MPI_Type_commit(&b.row));
    if (sched) /* after the MPI calls above: a progress thread may run from here */
        moe_progress_init(&progress, sched->progress, OPS);
    b.send_dy = moe_xmalloc(sizeof(float) * (size_t)(f->send.row_offset[G] * d) + 1);
    b.dy_in = moe_xmalloc(sizeof(float) * (size_t)(f->rows_in * d) + 1);
    b.work = moe_expert_grad_work_alloc(pairs, d, ff);
    b.pair_dx = moe_xmalloc(sizeof(float) * (size_t)(pairs * d) + 1);
    b.pair_dg = moe_xmalloc(sizeof(float) * (size_t)pairs + 1);
    b.sums = reduced ? moe_xmalloc(sizeof(float) * (size_t)(f->rows_in * d) + 1) : NULL;
    b.back = moe_xmalloc(sizeof(float) * (size_t)((reduced ? f->send.row_offset[G] : pairs_out) * d) + 1);
    b.dg_back = moe_xmalloc(sizeof(float) * (size_t)pairs_out + 1);
    b.shared_dx = moe_xmalloc(sizeof(float) * (size_t)(T * d) + 1);
    double *dweights = moe_xmalloc(sizeof(double) * (size_t)(T * k) + 1);
    const moe_index most = E * d > S * 2 * ff * d ? E * d : S * 2 * ff * d;
    double *partial = moe_xmalloc(sizeof(double) * (size_t)most);

    /* The same sequence on both paths: what overlaps is what has no use for
     * the data in flight. */
    combine_backward(ep, f, dy, &b, bwd);
    shared_backward(ep, x, dy, &b, g, bwd); /* behind the combine backward */
    finish(&b, OP_COMBINE, bwd, MOE_BWD_COMBINE);
    experts_dgrad(ep, f, &b, bwd);
    dispatch_backward(ep, f, &b, bwd);
    experts_wgrad(ep, f, &b, g, bwd); /* behind the dispatch backward */
    finish(&b, OP_DISPATCH, bwd, MOE_BWD_DISPATCH);
    if (sched) {
        moe_progress_stop(&progress);
        bwd->test_seconds = progress.test_seconds;
        moe_progress_free(&progress);
    }
    if (cap)
        capture_backward(f, &b, d, cap);
    reduce_home(ep, f, ids, &b, dweights, g->dx, bwd);
    router_backward(ep, x, logits, ids, dweights, g->dx, partial, bwd);

    const double t = MPI_Wtime();
    moe_comm_sum_ordered(c, partial, E * d); /* the gate's, in fp64 so far */
    for (moe_index n = 0; n < E * d; n++)
        g->dgate[n] = (float)partial[n];
    sum_over_ranks(c, g->dshared_w1, partial, S * 2 * ff * d);
    sum_over_ranks(c, g->dshared_w2, partial, S * d * ff);
    bwd->seconds[MOE_BWD_ALLREDUCE] = MPI_Wtime() - t;

    free(partial);
    free(dweights);
    free(b.shared_dx);
    free(b.dg_back);
    free(b.back);
    free(b.sums);
    free(b.pair_dg);
    free(b.pair_dx);
    moe_expert_grad_work_free(&b.work);
    free(b.dy_in);
    free(b.send_dy);
    MOE_MPI(MPI_Type_free(&b.row));
    free(b.counts);
}

/* A training step: the kept blocking forward, then the backward. */
static int step(const moe_ep *ep, const moe_schedule *sched, const float *x, const float *logits,
                const int32_t *ids, const float *weights, const float *dy, float *y,
                moe_ep_grads *g, moe_forward_stats *fwd, moe_backward_stats *bwd,
                moe_ep_capture *fwd_capture, moe_ep_bwd_capture *bwd_capture, moe_status *st)
{
    memset(bwd, 0, sizeof *bwd);
    moe_ref_forward f;
    const int rc = moe_ep_ref_run(ep, x, ids, weights, y, fwd, fwd_capture, &f, st);
    if (rc == MOE_EXIT_OK)
        backward(ep, sched, &f, x, logits, ids, dy, g, bwd, bwd_capture);
    moe_ep_ref_free(&f);
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
