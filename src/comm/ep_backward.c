/* ep_backward.c — the blocking reference backward (see ep.h,
 * moe_ep_backward_ref): the forward's stages run in mirror image.
 *
 *   forward    dispatch (x rows)  experts  combine (outputs)  reduce  shared
 *   backward   combine backward (dy rows, along the dispatch's plan)
 *              → experts dgrad, wgrad → dispatch backward (dx rows and
 *              dL/dweight, along the combine's) → reduce → shared → router
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

/* Stage combine backward: the dy rows of this rank's tokens to the ranks
 * holding their experts, one per (token, rank) as the dispatch sent x, into
 * dy_in (rows received, d) in the order the forward received x. */
static void combine_backward(const moe_ep *ep, moe_ref_forward *f, const float *dy, float *dy_in,
                             moe_backward_stats *stats)
{
    const int G = ep->comm.ranks, me = ep->comm.rank;
    const moe_index d = ep->cfg->hidden, rows_out = f->send.row_offset[G];
    const double t = MPI_Wtime();
    float *send = moe_xmalloc(sizeof(float) * (size_t)(rows_out * d) + 1);
    moe_gather_rows(dy, d, f->send.row_token, rows_out, send);
    moe_to_counts(f->send.row_count, G, f->send_counts, f->send_at);
    moe_to_counts(f->rows_from, G, f->recv_counts, f->recv_at);
    MPI_Datatype row;
    MOE_MPI(MPI_Type_contiguous((int)d, MPI_FLOAT, &row));
    MOE_MPI(MPI_Type_commit(&row));
    moe_comm_count_posted(f->send_counts, G, me, row);
    MOE_MPI(MPI_Alltoallv(send, f->send_counts, f->send_at, row, dy_in, f->recv_counts, f->recv_at,
                          row, ep->comm.comm));
    MOE_MPI(MPI_Type_free(&row));
    free(send);
    stats->bytes_combine = (double)rows_out * (double)d * sizeof(float);
    stats->seconds[MOE_BWD_COMBINE] = MPI_Wtime() - t;
}

/* Stage experts backward, for every local expert on its rows in global token
 * order: dx per pair into pair_dx (pairs, d) and dL/dweight into pair_dg
 * (pairs), both in the combine's pair order; then the expert's dW. */
static void experts_backward(const moe_ep *ep, const moe_ref_forward *f, const float *dy_in,
                             float *pair_dx, float *pair_dg, moe_ep_grads *g,
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
    float *work = moe_xmalloc(sizeof(float) * (size_t)moe_expert_grad_work_floats(most, d, ff));
    for (int l = 0; l < ep->local_experts; l++) {
        const moe_index first = recv->expert_offset[l], n = recv->expert_offset[l + 1] - first;
        const moe_index *row = recv->expert_row + first, *pair = recv->expert_pair + first;
        double t = MPI_Wtime();
        moe_gemm_reset_flops();
        moe_gather_rows(f->recv_values, d, row, n, x);
        moe_gather_rows(dy_in, d, row, n, dy);
        moe_gather_rows(f->expert_out, d, pair, n, out);
        for (moe_index m = 0; m < n; m++)
            gate[m] = moe_meta_weight(f->recv_meta + row[m] * MOE_META_WORDS(k), k,
                                      recv->expert_slot[first + m]);
        const moe_expert_weights fw = moe_ep_weights(ep, false, l);
        const moe_expert_grad_weights bw = moe_ep_grad_weights(ep, false, l);
        moe_expert_backward_data(&fw, &bw, ep->gemm, x, dy, gate, out, cfg->weight_at, n, d, ff,
                                 work, dx, dg);
        moe_scatter_rows(dx, d, pair, n, pair_dx);
        moe_scatter_rows(dg, 1, pair, n, pair_dg);
        stats->dgrad_flops += moe_gemm_sflops();
        stats->seconds[MOE_BWD_DGRAD] += MPI_Wtime() - t;
        t = MPI_Wtime();
        moe_gemm_reset_flops();
        moe_expert_backward_weights(ep->gemm, x, n, d, ff, work, g->dw1 + l * 2 * ff * d,
                                    g->dw2 + l * d * ff);
        stats->wgrad_flops += moe_gemm_sflops();
        stats->seconds[MOE_BWD_WGRAD] += MPI_Wtime() - t;
    }
    free(work);
    free(dg);
    free(gate);
    free(dx);
    free(out);
    free(dy);
    free(x);
}

/* Stage dispatch backward: dx home as the forward's combine came (reduced:
 * one row per received row, its pairs' dx summed in slot order from zero;
 * pairs: one per pair), and dL/dweight per pair; back (rows or pairs sent
 * out, d) and dg_back (pairs sent out) receive them. */
static void dispatch_backward(const moe_ep *ep, moe_ref_forward *f, const float *pair_dx,
                              const float *pair_dg, float *back, float *dg_back,
                              moe_backward_stats *stats)
{
    const int G = ep->comm.ranks, me = ep->comm.rank, k = (int)ep->cfg->topk;
    const moe_index d = ep->cfg->hidden;
    const moe_recv_plan *recv = &f->recv;
    const bool reduced = ep->cfg->combine == MOE_COMBINE_REDUCED;
    const double t = MPI_Wtime();
    float *sums = NULL;
    if (reduced) {
        sums = moe_xcalloc((size_t)(recv->rows * d) + 1, sizeof(float));
        const float **slot = moe_xcalloc((size_t)(recv->rows * k) + 1, sizeof(float *));
        for (moe_index m = 0; m < recv->pairs; m++)
            slot[recv->expert_row[m] * k + recv->expert_slot[m]] = pair_dx + recv->expert_pair[m] * d;
        for (moe_index r = 0; r < recv->rows; r++)
            for (int s = 0; s < k; s++)
                for (moe_index j = 0; slot[r * k + s] && j < d; j++)
                    sums[r * d + j] += slot[r * k + s][j];
        free(slot);
        moe_to_counts(f->rows_from, G, f->send_counts, f->send_at);
        moe_to_counts(f->send.row_count, G, f->recv_counts, f->recv_at);
    } else {
        moe_to_counts(recv->source_pairs, G, f->send_counts, f->send_at);
        moe_to_counts(f->send.pair_count, G, f->recv_counts, f->recv_at);
    }
    MPI_Datatype row;
    MOE_MPI(MPI_Type_contiguous((int)d, MPI_FLOAT, &row));
    MOE_MPI(MPI_Type_commit(&row));
    moe_comm_count_posted(f->send_counts, G, me, row);
    MOE_MPI(MPI_Alltoallv(reduced ? sums : pair_dx, f->send_counts, f->send_at, row, back,
                          f->recv_counts, f->recv_at, row, ep->comm.comm));
    MOE_MPI(MPI_Type_free(&row));
    const moe_index rows_back = reduced ? recv->rows : recv->pairs;
    free(sums);
    moe_to_counts(recv->source_pairs, G, f->send_counts, f->send_at);
    moe_to_counts(f->send.pair_count, G, f->recv_counts, f->recv_at);
    moe_comm_count_posted(f->send_counts, G, me, MPI_FLOAT);
    MOE_MPI(MPI_Alltoallv(pair_dg, f->send_counts, f->send_at, MPI_FLOAT, dg_back, f->recv_counts,
                          f->recv_at, MPI_FLOAT, ep->comm.comm));
    stats->bytes_dispatch = ((double)rows_back * (double)d + (double)recv->pairs) * sizeof(float);
    stats->seconds[MOE_BWD_DISPATCH] = MPI_Wtime() - t;
}

/* Stages reduce and shared at home: dx (T, d) = the rows that came home (in
 * ascending destination, or slot, order), then each shared expert's dx;
 * dweights (T, k) = dL/dweight of each slot. The shared experts' dW (this
 * rank's tokens) into g. */
static void home_backward(const moe_ep *ep, const moe_ref_forward *f, const float *x,
                          const int32_t *ids, const float *dy, const float *back,
                          const float *dg_back, double *dweights, moe_ep_grads *g,
                          moe_backward_stats *stats)
{
    const moe_config *cfg = ep->cfg;
    const int G = ep->comm.ranks, k = (int)cfg->topk;
    const moe_index T = cfg->tokens, d = cfg->hidden, ff = cfg->ffn;
    const bool reduced = cfg->combine == MOE_COMBINE_REDUCED;
    double t = MPI_Wtime();
    const float **from = moe_xmalloc(sizeof(float *) * (size_t)G);
    const float **slot_rows = moe_xmalloc(sizeof(float *) * (size_t)(T * k) + 1);
    for (int r = 0; r < G; r++)
        from[r] = back + (reduced ? f->send.row_offset[r] : f->send.pair_offset[r]) * d;
    if (reduced) {
        moe_ep_reduce_rows(ep, &ep->placement, ids, NULL, from, 1, g->dx);
    } else {
        moe_combine_locate(&f->send, from, d, slot_rows);
        moe_combine_reduce(slot_rows, NULL, T, k, d, g->dx);
    }
    for (int r = 0; r < G; r++)
        from[r] = dg_back + f->send.pair_offset[r];
    moe_combine_locate(&f->send, from, 1, slot_rows);
    for (moe_index n = 0; n < T * k; n++)
        dweights[n] = *slot_rows[n];
    free(slot_rows);
    free(from);
    stats->seconds[MOE_BWD_REDUCE] = MPI_Wtime() - t;

    t = MPI_Wtime();
    float *dxs = moe_xmalloc(sizeof(float) * (size_t)(T * d) + 1);
    float *work = moe_xmalloc(sizeof(float) * (size_t)moe_expert_grad_work_floats(T, d, ff) + 1);
    for (int s = 0; s < (int)cfg->shared_experts; s++) {
        const moe_expert_weights fw = moe_ep_weights(ep, true, s);
        const moe_expert_grad_weights bw = moe_ep_grad_weights(ep, true, s);
        moe_expert_backward_data(&fw, &bw, ep->gemm, x, dy, NULL, NULL, cfg->weight_at, T, d, ff,
                                 work, dxs, NULL);
        for (moe_index n = 0; n < T * d; n++)
            g->dx[n] += dxs[n];
        moe_expert_backward_weights(ep->gemm, x, T, d, ff, work, g->dshared_w1 + s * 2 * ff * d,
                                    g->dshared_w2 + s * d * ff);
    }
    free(work);
    free(dxs);
    stats->seconds[MOE_BWD_SHARED] = MPI_Wtime() - t;
}

/* Stage router: dx += the router's share, rounded once from fp64; dW_g
 * (this rank's tokens, fp64) into dgate_w (E, d). */
static void router_backward(const moe_ep *ep, const float *x, const float *logits,
                            const int32_t *ids, const double *dweights, float *dx,
                            double *dgate_w, moe_backward_stats *stats)
{
    const moe_config *cfg = ep->cfg;
    const moe_index T = cfg->tokens, d = cfg->hidden, E = cfg->experts;
    const double t = MPI_Wtime();
    double *dlogits = moe_xmalloc(sizeof(double) * (size_t)(T * E) + 1);
    double *dxr = moe_xcalloc((size_t)(T * d) + 1, sizeof(double));
    for (moe_index n = 0; n < T * E; n++)
        dlogits[n] = logits[n];
    moe_router_backward(&ep->router, dlogits, ids, dweights, T, dlogits);
    memset(dgate_w, 0, sizeof(double) * (size_t)(E * d));
    moe_gate_backward(dlogits, ep->gate, x, T, d, (int)E, dxr, dgate_w);
    for (moe_index n = 0; n < T * d; n++)
        dx[n] += (float)dxr[n];
    free(dxr);
    free(dlogits);
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

int moe_ep_backward_ref(const moe_ep *ep, const float *x, const float *logits, const int32_t *ids,
                        const float *weights, const float *dy, float *y, moe_ep_grads *g,
                        moe_forward_stats *fwd, moe_backward_stats *bwd, moe_status *st)
{
    const moe_config *cfg = ep->cfg;
    const moe_comm *c = &ep->comm;
    const int G = c->ranks, k = (int)cfg->topk;
    const moe_index T = cfg->tokens, d = cfg->hidden, ff = cfg->ffn, E = cfg->experts;
    const moe_index S = cfg->shared_experts;
    memset(bwd, 0, sizeof *bwd);
    moe_ref_forward f;
    int rc = moe_ep_ref_run(ep, x, ids, weights, y, fwd, NULL, &f, st);
    if (rc) {
        moe_ep_ref_free(&f);
        return rc;
    }
    const bool reduced = cfg->combine == MOE_COMBINE_REDUCED;
    const moe_index pairs_out = f.send.pair_offset[G];
    const moe_index back_rows = reduced ? f.send.row_offset[G] : pairs_out;
    float *dy_in = moe_xmalloc(sizeof(float) * (size_t)(f.rows_in * d) + 1);
    float *pair_dx = moe_xmalloc(sizeof(float) * (size_t)(f.recv.pairs * d) + 1);
    float *pair_dg = moe_xmalloc(sizeof(float) * (size_t)f.recv.pairs + 1);
    float *back = moe_xmalloc(sizeof(float) * (size_t)(back_rows * d) + 1);
    float *dg_back = moe_xmalloc(sizeof(float) * (size_t)pairs_out + 1);
    double *dweights = moe_xmalloc(sizeof(double) * (size_t)(T * k) + 1);
    const moe_index most = E * d > S * 2 * ff * d ? E * d : S * 2 * ff * d;
    double *partial = moe_xmalloc(sizeof(double) * (size_t)most);

    combine_backward(ep, &f, dy, dy_in, bwd);
    experts_backward(ep, &f, dy_in, pair_dx, pair_dg, g, bwd);
    dispatch_backward(ep, &f, pair_dx, pair_dg, back, dg_back, bwd);
    home_backward(ep, &f, x, ids, dy, back, dg_back, dweights, g, bwd);
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
    free(dg_back);
    free(back);
    free(pair_dg);
    free(pair_dx);
    free(dy_in);
    moe_ep_ref_free(&f);
    return MOE_EXIT_OK;
}
