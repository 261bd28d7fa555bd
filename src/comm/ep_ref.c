/* ep_ref.c — the blocking reference EP forward (see ep.h).
 *
 * Per rank:  route → plan → dispatch → experts → combine → reduce → shared.
 * The pure parts (plan, packing, FFN, reduce) live in src/core; this file
 * only moves the buffers they lay out and measures each stage.
 */
#include "moe/ep.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "moe/experts.h"
#include "moe/quant.h"
#include "moe/gemm.h"
#include "moe/rng.h"

const char *const moe_stage_names[MOE_STAGES] = {
    "route", "plan", "dispatch", "experts", "combine", "reduce", "shared",
};


int moe_ep_init(moe_ep *ep, const moe_config *cfg, const moe_comm *comm, moe_status *st)
{
    memset(ep, 0, sizeof *ep);
    ep->cfg = cfg;
    ep->comm = *comm;
    moe_placement_init(&ep->placement, (int)cfg->experts, comm->ranks);
    ep->router = (moe_router){.kind = (enum moe_router_kind)cfg->router,
                              .experts = (int)cfg->experts,
                              .topk = (int)cfg->topk,
                              .normalize = cfg->norm_topk,
                              .groups = (int)cfg->groups,
                              .topk_groups = (int)cfg->topk_groups,
                              .route_scale = (float)cfg->route_scale};
    ep->gemm = (enum moe_gemm_kind)cfg->gemm;
    ep->link.ranks_per_node = cfg->ranks_per_node > 0 ? (int)cfg->ranks_per_node : comm->ranks;
    moe_status ignored; /* validated by moe_config_validate */
    moe_link_parse(&ep->link, cfg->link, &ignored);
    ep->local_experts = moe_placement_local_experts(&ep->placement, comm->rank);
    ep->first_expert = ep->placement.first_expert[comm->rank];

    const moe_index d = cfg->hidden, f = cfg->ffn, S = cfg->shared_experts;
    const size_t w1_size = (size_t)moe_expert_w1_floats(ep->gemm, d, f);
    const size_t w2_size = (size_t)moe_expert_w2_floats(ep->gemm, d, f);
    moe_status local = {0};
    ep->w1 = moe_try_malloc(sizeof(float) * w1_size * (size_t)ep->local_experts, "expert W1", comm->rank, &local);
    ep->w2 = moe_try_malloc(sizeof(float) * w2_size * (size_t)ep->local_experts, "expert W2", comm->rank, &local);
    ep->shared_w1 = moe_try_malloc(sizeof(float) * w1_size * (size_t)S, "shared W1", comm->rank, &local);
    ep->shared_w2 = moe_try_malloc(sizeof(float) * w2_size * (size_t)S, "shared W2", comm->rank, &local);
    ep->gate = moe_try_malloc(sizeof(float) * (size_t)(cfg->experts * d), "the gate", comm->rank, &local);
    ep->work = moe_xcalloc(1, sizeof *ep->work);
    moe_fault_here(comm, "generate", &local);
    if (moe_comm_agree(comm, &local)) {
        *st = local;
        moe_ep_free(ep);
        return st->code;
    }
    float *w1 = moe_xmalloc(sizeof(float) * (size_t)(2 * f * d));
    float *w2 = moe_xmalloc(sizeof(float) * (size_t)(d * f));
    for (int n = 0; n < ep->local_experts + (int)S; n++) {
        const bool shared = n >= ep->local_experts;
        float *dst1 = shared ? ep->shared_w1 + (n - ep->local_experts) * w1_size : ep->w1 + n * w1_size;
        float *dst2 = shared ? ep->shared_w2 + (n - ep->local_experts) * w2_size : ep->w2 + n * w2_size;
        if (shared)
            moe_shared_expert_generate(cfg->seed, n - ep->local_experts, d, f, w1, w2);
        else
            moe_expert_generate(cfg->seed, ep->first_expert + n, d, f, w1, w2);
        moe_precision_weights(cfg->param_dtype, w1, 2 * f * d);
        moe_precision_weights(cfg->param_dtype, w2, d * f);
        moe_expert_layout(ep->gemm, d, f, w1, w2, dst1, dst2);
    }
    free(w2);
    free(w1);
    moe_synth_fill(cfg->seed, MOE_TENSOR_GATE, 0, 0, cfg->experts * d,
                   moe_synth_weight_scale(d), ep->gate);
    moe_precision_weights(cfg->param_dtype, ep->gate, cfg->experts * d);
    if (cfg->router == MOE_ROUTER_DEEPSEEK_V3 && cfg->bias_scale > 0) {
        ep->bias = moe_xmalloc(sizeof(float) * (size_t)cfg->experts);
        moe_synth_fill(cfg->seed, MOE_TENSOR_BIAS, 0, 0, cfg->experts, (float)cfg->bias_scale,
                       ep->bias);
        ep->router.bias = ep->bias;
    }
    if (cfg->skew[0]) {
        ep->skew = moe_xmalloc(sizeof(float) * (size_t)cfg->experts);
        moe_skew_parse(cfg->skew, (int)cfg->experts, ep->skew, &ignored);
        ep->router.skew = ep->skew;
    }
    return MOE_EXIT_OK;
}

void moe_ep_free(moe_ep *ep)
{
    free(ep->w1);
    free(ep->w2);
    free(ep->shared_w1);
    free(ep->shared_w2);
    free(ep->gate);
    free(ep->bias);
    free(ep->skew);
    moe_placement_free(&ep->placement);
    if (ep->work) {
        moe_ep_workspace *work = ep->work;
        for (int n = 0; n < work->waves * MOE_WAVE_BUFFERS; n++)
            moe_buffer_free(&work->wave[n]);
        free(work->wave);
        moe_buffer_free(&work->expert_in);
        moe_buffer_free(&work->scratch);
        moe_buffer_free(&work->slot_rows);
        moe_buffer_free(&work->x_scratch);
        free(work);
        ep->work = NULL;
    }
    ep->w1 = ep->w2 = ep->shared_w1 = ep->shared_w2 = ep->gate = ep->bias = ep->skew = NULL;
}

void moe_ep_generate_tokens(const moe_ep *ep, float *x)
{
    const moe_index T = ep->cfg->tokens, d = ep->cfg->hidden;
    const uint64_t first_token = (uint64_t)ep->comm.rank * (uint64_t)T;
    moe_synth_tokens(ep->cfg->seed, first_token, T, d, (float)ep->cfg->init_scale, x);
    moe_precision_weights(ep->cfg->param_dtype, x, T * d);
}

void moe_ep_route(const moe_ep *ep, const float *x, float *logits, float *scores, int32_t *ids,
                  float *weights)
{
    const moe_index T = ep->cfg->tokens;
    moe_router_logits(x, ep->gate, T, ep->cfg->hidden, (int)ep->cfg->experts, logits);
    moe_router_select(&ep->router, logits, T, scores, ids, weights);
}


static moe_expert_weights weights_at(const moe_ep *ep, const float *w1, const float *w2, int n)
{
    const size_t size1 = (size_t)moe_expert_w1_floats(ep->gemm, ep->cfg->hidden, ep->cfg->ffn);
    const size_t size2 = (size_t)moe_expert_w2_floats(ep->gemm, ep->cfg->hidden, ep->cfg->ffn);
    return (moe_expert_weights){w1 + (size_t)n * size1, w2 + (size_t)n * size2};
}

const float *moe_ep_dispatched_tokens(const moe_ep *ep, const float *x, float *scratch)
{
    if (ep->cfg->dispatch_dtype == MOE_DTYPE_FP32)
        return x;
    moe_precision_dispatch(ep->cfg->dispatch_dtype, ep->cfg->fp8_scale == 1, x, ep->cfg->tokens,
                           ep->cfg->hidden, scratch);
    return scratch;
}

moe_expert_weights moe_ep_expert(const moe_ep *ep, int local)
{
    return weights_at(ep, ep->w1, ep->w2, local);
}

moe_expert_weights moe_ep_shared_expert(const moe_ep *ep, int shared)
{
    return weights_at(ep, ep->shared_w1, ep->shared_w2, shared);
}

void moe_ep_run_expert(const moe_ep *ep, const moe_recv_plan *recv, int l,
                       const float *const *row_at, const int32_t *recv_meta, float *work,
                       float *scratch, float *expert_out, const moe_ffn_hooks *hooks)
{
    const moe_index d = ep->cfg->hidden, f = ep->cfg->ffn;
    const int k = (int)ep->cfg->topk;
    const moe_index first = recv->expert_offset[l], n = recv->expert_offset[l + 1] - first;
    if (n == 0)
        return;
    const moe_expert_weights w = moe_ep_expert(ep, l);
    float *in = work, *out = work, *scale = NULL; /* (n, d): the rows, then their outputs; (n) */
    if (ep->cfg->weight_at == MOE_WEIGHT_AT_ACTIVATION) {
        scale = work + n * d;
        for (moe_index m = 0; m < n; m++)
            scale[m] = moe_meta_weight(recv_meta + recv->expert_row[first + m] * MOE_META_WORDS(k),
                                       k, recv->expert_slot[first + m]);
    }
    moe_gather_row_ptrs(row_at, d, recv->expert_row + first, n, in);
    moe_expert_forward(&w, ep->gemm, in, n, d, f, scratch, out, scale, hooks);
    moe_precision_combine(ep->cfg->combine_dtype, out, n * d);
    moe_scatter_rows(out, d, recv->expert_pair + first, n, expert_out);
}

void moe_ep_shared_forward(const moe_ep *ep, const float *x, float *y, float *scratch, float *out)
{
    const moe_index T = ep->cfg->tokens, d = ep->cfg->hidden, f = ep->cfg->ffn;
    for (int s = 0; s < (int)ep->cfg->shared_experts; s++) {
        const moe_expert_weights w = moe_ep_shared_expert(ep, s);
        for (moe_index first = 0; first < T; first += MOE_SHARED_ROW_BLOCK) {
            moe_index rows = T - first < MOE_SHARED_ROW_BLOCK ? T - first : MOE_SHARED_ROW_BLOCK;
            moe_expert_forward(&w, ep->gemm, x + first * d, rows, d, f, scratch, out, NULL, NULL);
            for (moe_index n = 0; n < rows * d; n++)
                y[first * d + n] += out[n];
        }
    }
}

void moe_ep_capture_free(moe_ep_capture *capture)
{
    free(capture->recv_x);
    free(capture->recv_token);
    free(capture->out);
    free(capture->pair);
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
    capture->pair = moe_xmalloc(sizeof(int32_t) * (size_t)(2 * recv->pairs));
    for (int l = 0; l < recv->local_experts; l++)
        for (moe_index m = recv->expert_offset[l]; m < recv->expert_offset[l + 1]; m++) {
            const moe_index p = recv->expert_pair[m];
            capture->pair[2 * p] = capture->recv_token[recv->expert_row[m]];
            capture->pair[2 * p + 1] = first_expert + l;
        }
}

int moe_ep_forward_ref(const moe_ep *ep, const float *x, const int32_t *ids,
                       const float *weights, float *y, moe_forward_stats *stats,
                       moe_ep_capture *capture, moe_status *st)
{
    const moe_config *cfg = ep->cfg;
    const moe_comm *c = &ep->comm;
    const int G = c->ranks, k = (int)cfg->topk, EL = ep->local_experts;
    const moe_index T = cfg->tokens, d = cfg->hidden, f = cfg->ffn;
    memset(stats, 0, sizeof *stats);

    MPI_Datatype row_type, meta_type; /* one token row (d floats); its meta (2k words) */
    MPI_Type_contiguous((int)d, MPI_FLOAT, &row_type);
    MPI_Type_commit(&row_type);
    MPI_Type_contiguous(MOE_META_WORDS(k), MPI_INT32_T, &meta_type);
    MPI_Type_commit(&meta_type);
    int *send_counts = moe_xmalloc(sizeof(int) * (size_t)G), *send_displs = moe_xmalloc(sizeof(int) * (size_t)G);
    int *recv_counts = moe_xmalloc(sizeof(int) * (size_t)G), *recv_displs = moe_xmalloc(sizeof(int) * (size_t)G);
    moe_index *rows_from = moe_xmalloc(sizeof(moe_index) * (size_t)G); /* (G) */
    moe_status local = {0};

    /* Plan: what goes where, and how much comes in. */
    double t = MPI_Wtime();
    moe_send_plan send;
    moe_send_plan_build(&send, &ep->placement, ids, T, k, NULL, 0);
    moe_to_counts(send.row_count, G, send_counts, send_displs);
    MPI_Alltoall(send_counts, 1, MPI_INT, recv_counts, 1, MPI_INT, c->comm);
    moe_index rows_in = 0;
    for (int r = 0; r < G; r++) {
        rows_from[r] = recv_counts[r];
        rows_in += recv_counts[r];
    }
    moe_to_counts(rows_from, G, recv_counts, recv_displs);
    const moe_index rows_out = send.row_offset[G];
    float *send_rows = moe_try_malloc(sizeof(float) * (size_t)(rows_out * d), "the dispatch send buffer", c->rank, &local);
    int32_t *send_meta = moe_try_malloc(sizeof(int32_t) * (size_t)(rows_out * MOE_META_WORDS(k)), "the dispatch ids", c->rank, &local);
    float *recv_rows = moe_try_malloc(sizeof(float) * (size_t)(rows_in * d), "the dispatch receive buffer", c->rank, &local);
    int32_t *recv_meta = moe_try_malloc(sizeof(int32_t) * (size_t)(rows_in * MOE_META_WORDS(k)), "the received ids", c->rank, &local);
    float *back = moe_try_malloc(sizeof(float) * (size_t)(send.pair_offset[G] * d), "the combine receive buffer", c->rank, &local);
    stats->seconds[MOE_STAGE_PLAN] = MPI_Wtime() - t;

    float *x_scratch = cfg->dispatch_dtype == MOE_DTYPE_FP32
                           ? NULL
                           : moe_try_malloc(sizeof(float) * (size_t)(T * d), "the quantised tokens", c->rank, &local);
    moe_fault_here(c, "plan", &local);

    /* Dispatch: each row once per destination (quantised as --dispatch-dtype
     * says), with the token's full top-k and weights. */
    t = MPI_Wtime();
    if (moe_comm_agree(c, &local) == MOE_EXIT_OK) {
        moe_gather_rows(moe_ep_dispatched_tokens(ep, x, x_scratch), d, send.row_token, rows_out,
                        send_rows);
        moe_pack_meta(ids, weights, k, send.row_token, rows_out, (moe_index)c->rank * T, send_meta);
        MPI_Alltoallv(send_rows, send_counts, send_displs, row_type, recv_rows, recv_counts,
                      recv_displs, row_type, c->comm);
        MPI_Alltoallv(send_meta, send_counts, send_displs, meta_type, recv_meta, recv_counts,
                      recv_displs, meta_type, c->comm);
    }
    stats->seconds[MOE_STAGE_DISPATCH] = MPI_Wtime() - t;
    stats->rows_sent = rows_out;
    stats->rows_sent_remote = rows_out - send.row_count[c->rank];
    stats->rows_received = rows_in;
    stats->bytes_dispatched = (double)rows_out * (double)(d * 4 + MOE_META_WORDS(k) * 4);

    moe_recv_plan recv = {0};
    float *expert_out = NULL, *expert_in = NULL, *scratch = NULL;
    if (local.code == MOE_EXIT_OK) {
        t = MPI_Wtime();
        moe_recv_plan_build(&recv, &ep->placement, c->rank, recv_meta, rows_in, k, rows_from,
                            NULL, 0);
        stats->seconds[MOE_STAGE_PLAN] += MPI_Wtime() - t;
        moe_index most = MOE_SHARED_ROW_BLOCK; /* the shared experts reuse the scratch */
        for (int l = 0; l < EL; l++)
            if (recv.expert_offset[l + 1] - recv.expert_offset[l] > most)
                most = recv.expert_offset[l + 1] - recv.expert_offset[l];
        expert_out = moe_try_malloc(sizeof(float) * (size_t)(recv.pairs * d), "the combine send buffer", c->rank, &local);
        expert_in = moe_try_malloc(sizeof(float) * (size_t)(most * MOE_EXPERT_WORK_FLOATS(d)), "expert rows", c->rank, &local);
        scratch = moe_try_malloc(sizeof(float) * (size_t)(most * 2 * f), "expert activations", c->rank, &local);
        moe_fault_here(c, "dispatch", &local);
    }

    if (moe_comm_agree(c, &local) == MOE_EXIT_OK) {
        /* Experts: one FFN call per local expert, rows in global token order. */
        t = MPI_Wtime();
        moe_gemm_reset_flops();
        const float **row_at = moe_xmalloc(sizeof(float *) * (size_t)rows_in + 1);
        for (moe_index m = 0; m < rows_in; m++)
            row_at[m] = recv_rows + m * d;
        for (int l = 0; l < EL; l++)
            moe_ep_run_expert(ep, &recv, l, row_at, recv_meta, expert_in, scratch, expert_out,
                              NULL);
        free(row_at);
        stats->expert_flops = moe_gemm_sflops();
        stats->pairs_received = recv.pairs;
        if (capture)
            capture_rank(&recv, recv_rows, recv_meta, expert_out, ep->first_expert, d, k, capture);
        stats->expert_start = t;
        stats->expert_end = MPI_Wtime();
        stats->seconds[MOE_STAGE_EXPERTS] = stats->expert_end - t;
    }
    /* A rank that failed in its experts (an injected fault stands for it)
     * stops every rank here, before the combine. */
    if (local.code == MOE_EXIT_OK)
        moe_fault_here(c, "experts", &local);
    if (moe_comm_agree(c, &local) == MOE_EXIT_OK) {
        /* Combine: outputs go back to the rows' home ranks. */
        t = MPI_Wtime();
        moe_to_counts(recv.source_pairs, G, send_counts, send_displs);
        moe_to_counts(send.pair_count, G, recv_counts, recv_displs);
        MPI_Alltoallv(expert_out, send_counts, send_displs, row_type, back, recv_counts,
                      recv_displs, row_type, c->comm);
        stats->seconds[MOE_STAGE_COMBINE] = MPI_Wtime() - t;
        stats->bytes_combined = (double)recv.pairs * (double)(d * 4);
        stats->pairs_back_remote = send.pair_offset[G] - send.pair_count[c->rank];
        moe_fault_here(c, "combine", &local);
    }
    if (moe_comm_agree(c, &local) == MOE_EXIT_OK) {
        t = MPI_Wtime();
        const float **slot_rows = moe_xmalloc(sizeof(float *) * (size_t)(T * k)); /* (T, k) */
        const float **from = moe_xmalloc(sizeof(float *) * (size_t)G);
        for (int r = 0; r < G; r++)
            from[r] = back + send.pair_offset[r] * d;
        moe_combine_locate(&send, from, d, slot_rows);
        free(from);
        moe_combine_reduce(slot_rows, cfg->weight_at == MOE_WEIGHT_AT_OUTPUT ? weights : NULL, T,
                           k, d, y);
        free(slot_rows);
        stats->seconds[MOE_STAGE_REDUCE] = MPI_Wtime() - t;

        t = MPI_Wtime();
        moe_ep_shared_forward(ep, x, y, scratch, expert_in);
        stats->done = MPI_Wtime();
        stats->seconds[MOE_STAGE_SHARED] = stats->done - t;
    }

    free(scratch);
    free(expert_in);
    free(expert_out);
    free(x_scratch);
    moe_recv_plan_free(&recv);
    free(back);
    free(recv_meta);
    free(recv_rows);
    free(send_meta);
    free(send_rows);
    moe_send_plan_free(&send);
    free(rows_from);
    free(recv_displs);
    free(recv_counts);
    free(send_displs);
    free(send_counts);
    MPI_Type_free(&meta_type);
    MPI_Type_free(&row_type);
    if (local.code)
        *st = local;
    return local.code;
}
