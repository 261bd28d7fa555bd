/* SPDX-License-Identifier: MIT */
/* ep.c — the EP object (weights, placement, router, link model) and the
 * stages every path shares: route, pack, experts, reduce, shared (see
 * ep.h and ep_stages.h). The paths themselves are ep_ref.c, ep_waves.c,
 * ep_hier.c, ep_ll.c and ep_backward.c, chosen through path.c.
 */
#include "moe/ep.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "moe/backward.h"
#include "moe/capacity.h"
#include "moe/clock.h"
#include "moe/gemm.h"
#include "moe/experts.h"
#include "moe/mask.h"
#include "moe/model.h"
#include "moe/path.h"
#include "moe/progress.h"
#include "moe/quant.h"
#include "moe/rng.h"
#include "moe/watchdog.h"
#include "ep_stages.h"

const char *const moe_stage_names[MOE_STAGES] = {
    "route", "plan", "dispatch", "experts", "combine", "reduce", "shared",
};

const char *const moe_bwd_stage_names[MOE_BWD_STAGES] = {
    "combine backward", "experts dgrad", "experts wgrad", "dispatch backward",
    "reduce", "shared", "router", "allreduce",
};

moe_schedule moe_schedule_default(const moe_ep *ep)
{
    const moe_config *cfg = ep->cfg;
    return (moe_schedule){
        .waves = (int)cfg->waves_list[0],
        .lookahead = (int)cfg->lookahead,
        /* the two-stage dispatch runs waves of tokens (ep_hier.c) */
        .wave_by = cfg->dispatch == MOE_DISPATCH_HIERARCHICAL ? MOE_WAVE_BY_TOKENS : cfg->wave_by,
        .progress = moe_progress_granted(&ep->comm, (enum moe_progress_kind)cfg->progress),
        .link = true,
        .trace = NULL,
        .origin = 0.0};
}

int moe_ep_wave_by(const moe_ep *ep, const moe_schedule *sched)
{
    for (int n = 0; sched->wave_by == MOE_WAVE_BY_AUTO && ep->wave_choices && n < ep->cfg->waves_count; n++)
        if (ep->wave_choices[n].waves == sched->waves)
            return ep->wave_choices[n].by;
    return sched->wave_by;
}

double moe_ep_time_experts(const moe_ep *ep, const float *x, moe_index rows, int chunks)
{
    const moe_config *cfg = ep->cfg;
    const moe_index T = cfg->tokens, d = cfg->hidden, f = cfg->ffn;
    float *in = moe_xmalloc(sizeof(float) * (size_t)(rows * d));   /* (rows, d) */
    float *out = moe_xmalloc(sizeof(float) * (size_t)(rows * d));  /* (rows, d) */
    float *scratch = moe_xmalloc(sizeof(float) * (size_t)(rows * 2 * f) + 1); /* (rows, 2f) */
    for (moe_index i = 0; i < rows; i++)
        memcpy(in + i * d, x + (i % T) * d, sizeof(float) * (size_t)d);
    moe_comm_barrier(&ep->comm);
    const double begun = moe_clock_now();
    for (int c = 0; c < chunks; c++) { /* wave by wave: each streams every expert's weights */
        const moe_index first = c * rows / chunks, n = (c + 1) * rows / chunks - first;
        for (int l = 0; l < ep->local_experts && n > 0; l++) {
            const moe_expert_weights w = moe_ep_weights(ep, false, l);
            moe_expert_forward(&w, ep->gemm, in + first * d, n, d, f, scratch, out + first * d, NULL, NULL);
        }
    }
    const double seconds = moe_clock_now() - begun;
    free(in);
    free(out);
    free(scratch);
    return moe_comm_max(&ep->comm, seconds);
}

void moe_ep_types_create(const moe_ep *ep, moe_ep_types *types)
{
    MOE_MPI(MPI_Type_contiguous((int)moe_wire_dispatch(ep->cfg).bytes, MPI_BYTE, &types->dispatch));
    MOE_MPI(MPI_Type_commit(&types->dispatch));
    MOE_MPI(MPI_Type_contiguous(MOE_META_WORDS((int)ep->cfg->topk), MPI_INT32_T, &types->meta));
    MOE_MPI(MPI_Type_commit(&types->meta));
    MOE_MPI(MPI_Type_contiguous((int)moe_wire_combine(ep->cfg).bytes, MPI_BYTE, &types->combine));
    MOE_MPI(MPI_Type_commit(&types->combine));
}

void moe_ep_types_free(moe_ep_types *types)
{
    MOE_MPI(MPI_Type_free(&types->combine));
    MOE_MPI(MPI_Type_free(&types->meta));
    MOE_MPI(MPI_Type_free(&types->dispatch));
}

float *moe_ep_wire_values(const moe_wire *w, uint8_t *wire, moe_index rows, float *values)
{
    if (w->dtype == MOE_DTYPE_FP32)
        return (float *)wire;
    moe_wire_decode(w, wire, rows, values);
    return values;
}

bool moe_ep_agreed(const moe_ep *ep, const char *stage, moe_status *local)
{
    const moe_comm *c = &ep->comm;
    if (local->code == MOE_EXIT_OK)
        moe_fault_here(c, stage, local);
    struct moe_ep_workspace *work = ep->work;
    if (work && work->arrivals < MOE_ARRIVALS_MAX) { /* a slow fault's rank arrives late */
        work->arrived_at[work->arrivals] = stage;
        work->arrived[work->arrivals++] = moe_clock_now();
    }
    moe_watch_wait(moe_watch_place_named(stage), -1);
    const bool agreed = moe_comm_agree(c, local) == MOE_EXIT_OK;
    moe_watch_done();
    return agreed;
}

/* The weights of this rank's experts n = from .. to-1, laid out for
 * ep->gemm: routed n < EL (each slot the logical expert it copies), then
 * shared. */
static void generate_experts(moe_ep *ep, int from, int to)
{
    const moe_config *cfg = ep->cfg;
    const moe_index d = cfg->hidden, f = cfg->ffn;
    const size_t w1_size = (size_t)moe_expert_w1_floats(ep->gemm, d, f);
    const size_t w2_size = (size_t)moe_expert_w2_floats(ep->gemm, d, f);
    float *w1 = moe_xmalloc(sizeof(float) * (size_t)(2 * f * d));
    float *w2 = moe_xmalloc(sizeof(float) * (size_t)(d * f));
    for (int n = from; n < to; n++) {
        const bool shared = n >= ep->local_experts;
        float *dst1 = shared ? ep->shared_w1 + (n - ep->local_experts) * w1_size : ep->w1 + n * w1_size;
        float *dst2 = shared ? ep->shared_w2 + (n - ep->local_experts) * w2_size : ep->w2 + n * w2_size;
        const int slot = ep->first_expert + n;
        moe_model_expert(cfg, shared,
                         shared ? n - ep->local_experts
                                : ep->replicas.physical ? ep->replicas.phy2log[slot] : slot,
                         w1, w2);
        moe_expert_layout(ep->gemm, d, f, w1, w2, dst1, dst2);
    }
    free(w2);
    free(w1);
}

int moe_ep_init(moe_ep *ep, const moe_config *cfg, const moe_comm *comm, moe_status *st)
{
    memset(ep, 0, sizeof *ep);
    ep->cfg = cfg;
    ep->comm = *comm;
    ep->path = moe_path_choose(cfg);
    const int physical = (int)(cfg->experts + cfg->redundant_experts);
    moe_placement_init(&ep->placement, physical, comm->ranks);
    ep->gemm = (enum moe_gemm_kind)cfg->gemm;
    moe_sgemm_packed_force((enum moe_isa)cfg->packed_isa);
    ep->link.ranks_per_node = cfg->ranks_per_node > 0 ? (int)cfg->ranks_per_node : comm->ranks;
    moe_status ignored; /* validated by moe_config_validate */
    moe_link_parse(&ep->link, cfg->link, &ignored);
    ep->local_experts = moe_placement_local_experts(&ep->placement, comm->rank);
    ep->first_expert = ep->placement.first_expert[comm->rank];

    const moe_index d = cfg->hidden, f = cfg->ffn, S = cfg->shared_experts;
    const size_t w1_size = (size_t)moe_expert_w1_floats(ep->gemm, d, f);
    const size_t w2_size = (size_t)moe_expert_w2_floats(ep->gemm, d, f);
    moe_status local = {0};
    ep->w1 = moe_try_malloc_huge(sizeof(float) * w1_size * (size_t)ep->local_experts, "expert W1", comm->rank, &local);
    ep->w2 = moe_try_malloc_huge(sizeof(float) * w2_size * (size_t)ep->local_experts, "expert W2", comm->rank, &local);
    ep->shared_w1 = moe_try_malloc_huge(sizeof(float) * w1_size * (size_t)S, "shared W1", comm->rank, &local);
    ep->shared_w2 = moe_try_malloc_huge(sizeof(float) * w2_size * (size_t)S, "shared W2", comm->rank, &local);
    ep->gate = moe_try_malloc(sizeof(float) * (size_t)(cfg->experts * d), "the gate", comm->rank, &local);
    ep->work = moe_xcalloc(1, sizeof *ep->work);
    moe_fault_here(comm, "generate", &local);
    if (moe_comm_agree(comm, &local)) {
        *st = local;
        moe_ep_free(ep);
        return st->code;
    }
    /* with --redundant-experts the routed ones wait for moe_ep_place_replicas */
    generate_experts(ep, cfg->redundant_experts > 0 ? ep->local_experts : 0,
                     ep->local_experts + (int)S);
    moe_model_gate(cfg, ep->gate);
    ep->bias = moe_xmalloc(sizeof(float) * (size_t)cfg->experts);
    ep->skew = moe_xmalloc(sizeof(float) * (size_t)cfg->experts);
    ep->router = moe_model_router(cfg, ep->bias, ep->skew);
    if (!ep->router.bias) { /* NULL says "no bias" to the dump, explain and --steps */
        free(ep->bias);
        ep->bias = NULL;
    }
    if (!ep->router.skew) {
        free(ep->skew);
        ep->skew = NULL;
    }
    if (cfg->mask_ranks[0]) { /* validated by moe_config_validate */
        ep->lost_ranks = moe_xmalloc(sizeof(bool) * (size_t)comm->ranks);
        moe_mask_parse(cfg->mask_ranks, comm->ranks, ep->lost_ranks, &ignored);
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
    free(ep->replay_ids);
    free(ep->replay_weights);
    free(ep->lost_ranks);
    free(ep->wave_choices);
    moe_placement_free(&ep->placement);
    moe_replicas_free(&ep->replicas);
    if (ep->work) {
        struct moe_ep_workspace *work = ep->work;
        moe_path_release(work);
        for (int n = 0; n < work->waves * MOE_WAVE_BUFFERS; n++)
            moe_buffer_free(&work->wave[n]);
        free(work->wave);
        moe_buffer_free(&work->expert_in);
        moe_buffer_free(&work->scratch);
        moe_buffer_free(&work->slot_rows);
        moe_buffer_free(&work->x_scratch);
        moe_buffer_free(&work->shared_out);
        moe_pool_free(&work->pool);
        free(work);
        ep->work = NULL;
    }
    ep->w1 = ep->w2 = ep->shared_w1 = ep->shared_w2 = ep->gate = ep->bias = ep->skew = NULL;
    ep->replay_ids = NULL;
    ep->replay_weights = NULL;
    ep->lost_ranks = NULL;
    ep->wave_choices = NULL;
}

void moe_ep_window_load(const moe_ep *ep, double *load)
{
    const moe_config *cfg = ep->cfg;
    const moe_index T = cfg->tokens, d = cfg->hidden, E = cfg->experts, k = cfg->topk;
    float *x = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    float *logits = moe_xmalloc(sizeof(float) * (size_t)(T * E));
    float *scores = moe_xmalloc(sizeof(float) * (size_t)(T * E));
    int32_t *ids = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k));
    float *weights = moe_xmalloc(sizeof(float) * (size_t)(T * k));
    memset(load, 0, sizeof(double) * (size_t)E);
    for (int64_t s = 1; s <= cfg->eplb_window; s++) {
        moe_ep_generate_batch(ep, (uint64_t)(cfg->steps + s - 1), x); /* after every --steps batch */
        moe_router_logits(x, ep->gate, T, d, (int)E, logits);
        moe_router_select(&ep->router, logits, T, scores, ids, weights);
        for (moe_index n = 0; n < T * k; n++)
            load[ids[n]] += 1.0;
    }
    moe_comm_sum_array(&ep->comm, load, (int)E);
    free(weights);
    free(ids);
    free(scores);
    free(logits);
    free(x);
}

void moe_ep_place_replicas(moe_ep *ep, const double *load)
{
    const moe_config *cfg = ep->cfg;
    const int G = ep->comm.ranks, R = ep->link.ranks_per_node;
    double *window = NULL;
    if (!load) {
        load = window = moe_xmalloc(sizeof(double) * (size_t)cfg->experts);
        moe_ep_window_load(ep, window);
    }
    moe_replicas_free(&ep->replicas); /* a placement before this one */
    moe_eplb_place(load, (int)cfg->experts, ep->placement.experts, (int)cfg->groups,
                   G % R == 0 ? G / R : 1, G, &ep->replicas);
    free(window);
    generate_experts(ep, 0, ep->local_experts);
}

void moe_ep_round_output(const moe_ep *ep, float *y)
{
    if (ep->cfg->output_dtype == MOE_DTYPE_BF16)
        moe_precision_combine(MOE_DTYPE_BF16, y, ep->cfg->tokens * ep->cfg->hidden);
}

void moe_ep_place(const moe_ep *ep, const int32_t *ids, const float *weights, int32_t *placed)
{
    const moe_config *cfg = ep->cfg;
    const moe_index T = cfg->tokens, k = cfg->topk;
    if (cfg->capacity_factor > 0 && weights)
        moe_capacity_apply(cfg, ids, weights, T, placed);
    else if (placed != ids)
        memcpy(placed, ids, sizeof(int32_t) * (size_t)(T * k));
    if (!ep->replicas.physical)
        return;
    const int R = ep->link.ranks_per_node, node = ep->comm.rank / R;
    const uint64_t first = (uint64_t)ep->comm.rank * (uint64_t)T;
    for (moe_index i = 0; i < T; i++) {
        if (cfg->replica_choice == MOE_REPLICA_DEDUP) {
            moe_replicas_of_token(&ep->replicas, placed + i * k, (int)k, first + (uint64_t)i, node,
                                  R, placed + i * k);
            continue;
        }
        for (moe_index s = 0; s < k; s++)
            if (placed[i * k + s] != MOE_DROPPED)
                placed[i * k + s] = moe_replica_of(&ep->replicas, placed[i * k + s],
                                                   first + (uint64_t)i, node, R);
    }
}

void moe_ep_generate_batch(const moe_ep *ep, uint64_t batch, float *x)
{
    const uint64_t T = (uint64_t)ep->cfg->tokens;
    moe_model_tokens(ep->cfg, (batch * (uint64_t)ep->comm.ranks + (uint64_t)ep->comm.rank) * T, x);
}

void moe_ep_generate_tokens(const moe_ep *ep, float *x)
{
    moe_ep_generate_batch(ep, 0, x);
}

void moe_ep_generate_grad_output(const moe_ep *ep, float *dy)
{
    const moe_index T = ep->cfg->tokens, d = ep->cfg->hidden;
    moe_synth_fill(ep->cfg->seed, MOE_TENSOR_GRAD_OUTPUT, 0, (uint64_t)ep->comm.rank * (uint64_t)(T * d),
                   T * d, 1.0f, dy);
}

int moe_ep_arrivals(const moe_ep *ep, double *at, const char **stage)
{
    const struct moe_ep_workspace *work = ep->work;
    for (int n = 0; work && n < work->arrivals; n++)
        at[n] = work->arrived[n], stage[n] = work->arrived_at[n];
    return work ? work->arrivals : 0;
}

moe_index moe_ep_route(const moe_ep *ep, const float *x, float *logits, float *scores, int32_t *ids,
                       float *weights)
{
    const moe_index T = ep->cfg->tokens;
    moe_router_logits(x, ep->gate, T, ep->cfg->hidden, (int)ep->cfg->experts, logits);
    moe_router_select(&ep->router, logits, T, scores, ids, weights);
    if (ep->replay_ids) {
        const size_t pairs = (size_t)(T * ep->cfg->topk);
        memcpy(ids, ep->replay_ids, sizeof(int32_t) * pairs);
        memcpy(weights, ep->replay_weights, sizeof(float) * pairs);
    }
    if (!ep->lost_ranks)
        return 0;
    return moe_mask_apply(ep->lost_ranks, &ep->placement, ep->comm.rank, T, (int)ep->cfg->topk, ids,
                          weights);
}


moe_expert_weights moe_ep_weights(const moe_ep *ep, bool shared, int n)
{
    const size_t size1 = (size_t)moe_expert_w1_floats(ep->gemm, ep->cfg->hidden, ep->cfg->ffn);
    const size_t size2 = (size_t)moe_expert_w2_floats(ep->gemm, ep->cfg->hidden, ep->cfg->ffn);
    /* the rounding points are the routed experts' (the grouped GEMMs'); the
     * shared experts stay fp32 */
    return (moe_expert_weights){(shared ? ep->shared_w1 : ep->w1) + (size_t)n * size1,
                                (shared ? ep->shared_w2 : ep->w2) + (size_t)n * size2,
                                shared ? (moe_expert_rounding){0} : moe_expert_rounding_of(ep->cfg)};
}

moe_index moe_ep_grad_weights_floats(const moe_ep *ep)
{
    if (ep->gemm == MOE_GEMM_PACKED)
        return 1;
    return moe_expert_grad_w1_floats(ep->gemm, ep->cfg->hidden, ep->cfg->ffn) +
           moe_expert_grad_w2_floats(ep->gemm, ep->cfg->hidden, ep->cfg->ffn);
}

moe_expert_grad_weights moe_ep_grad_weights(const moe_ep *ep, bool shared, int n, float *scratch)
{
    if (ep->gemm == MOE_GEMM_PACKED) /* read from the forward's panels */
        return (moe_expert_grad_weights){NULL, NULL};
    const moe_index d = ep->cfg->hidden, f = ep->cfg->ffn;
    const moe_expert_weights fw = moe_ep_weights(ep, shared, n);
    float *w2g = scratch + moe_expert_grad_w1_floats(ep->gemm, d, f);
    moe_expert_grad_layout_from_forward(ep->gemm, d, f, &fw, scratch, w2g);
    return (moe_expert_grad_weights){scratch, w2g};
}

const float *moe_ep_dispatched_tokens(const moe_ep *ep, const float *x, float *scratch)
{
    return moe_wire_dispatched(ep->cfg, x, ep->cfg->tokens, scratch);
}

void moe_ep_pack(const moe_ep *ep, const float *x, const int32_t *ids, const float *weights,
                 const moe_send_plan *plan, int stay, uint8_t *send_rows, int32_t *send_meta)
{
    const moe_index rows = plan->row_offset[plan->ranks];
    const moe_wire wire = moe_wire_dispatch(ep->cfg);
    if (stay < 0) {
        moe_wire_encode(&wire, x, plan->row_token, rows, send_rows);
    } else { /* rows by destination: before `stay`, after it */
        moe_wire_encode(&wire, x, plan->row_token, plan->row_offset[stay], send_rows);
        moe_wire_encode(&wire, x, plan->row_token + plan->row_offset[stay + 1],
                        rows - plan->row_offset[stay + 1],
                        send_rows + (size_t)plan->row_offset[stay] * wire.bytes);
    }
    moe_pack_meta(ids, weights, (int)ep->cfg->topk, plan->row_token, rows,
                  (moe_index)ep->comm.rank * ep->cfg->tokens, send_meta);
}

void moe_ep_layout_open(const moe_ep *ep, const moe_recv_plan *recv, moe_ep_layout *t)
{
    const moe_config *cfg = ep->cfg;
    const moe_index C = (moe_index)ep->comm.ranks * moe_config_max_tokens(cfg);
    moe_expert_slots_build(&t->slots, moe_config_layout(cfg), recv->local_experts,
                           recv->expert_offset, C, cfg->expert_alignment);
    t->x = NULL;
    if (t->slots.kind != MOE_LAYOUT_ROWS) /* pages only where rows land */
        t->x = moe_xmalloc(sizeof(float) * (size_t)(t->slots.slots * cfg->hidden) + 1);
}

float *moe_ep_layout_block(const moe_ep *ep, const moe_ep_layout *t, int l)
{
    return t->x ? t->x + t->slots.start[l] * ep->cfg->hidden : NULL;
}

void moe_ep_layout_close(moe_ep_layout *t)
{
    moe_expert_slots_free(&t->slots);
    free(t->x);
    t->x = NULL;
}

moe_index moe_ep_padded_rows(const moe_ep *ep)
{
    const moe_config *cfg = ep->cfg;
    if (!cfg->pad_to_capacity)
        return 0;
    return (moe_index)ep->comm.ranks *
           moe_expert_capacity(cfg->capacity_factor, cfg->tokens, (int)cfg->topk, (int)cfg->experts);
}

moe_index moe_ep_pad_rows(const moe_ep *ep, moe_index pairs)
{
    if (!ep->cfg->pad_to_capacity)
        return 0;
    return (moe_index)moe_placement_local_experts(&ep->placement, ep->comm.rank) *
               moe_ep_padded_rows(ep) - pairs;
}

/* --pad-to-capacity: after an expert's n rows, the zero rows that fill it
 * to G C, as batches of at most max(n, MOE_SHARED_ROW_BLOCK) rows in work
 * (what work and scratch hold). A zero row's output is zero and goes
 * nowhere; the expert's own rows were computed without them, so their bits
 * are those of the run without padding, with every --gemm. */
static void pad_expert(const moe_ep *ep, const moe_expert_weights *w, moe_index n, float *work,
                       float *scratch, const moe_ffn_hooks *hooks)
{
    const moe_index d = ep->cfg->hidden, f = ep->cfg->ffn;
    const moe_index batch = n > MOE_SHARED_ROW_BLOCK ? n : MOE_SHARED_ROW_BLOCK;
    moe_index left = moe_ep_padded_rows(ep) - n;
    MOE_ASSERT(left >= 0); /* the drops keep at most C pairs of each rank's */
    while (left > 0) {
        const moe_index rows = left < batch ? left : batch;
        memset(work, 0, sizeof(float) * (size_t)(rows * d));
        moe_expert_forward(w, ep->gemm, work, rows, d, f, scratch, work, NULL, hooks);
        left -= rows;
    }
}

/* moe_ep_expert's own rows, n > 0 of them. */
static void expert_rows(const moe_ep *ep, const moe_recv_plan *recv, int l,
                        const float *const *row_at, const int32_t *recv_meta, float *block,
                        float *work, float *scratch, float *expert_out, const moe_ffn_hooks *hooks)
{
    const moe_index d = ep->cfg->hidden, f = ep->cfg->ffn;
    const int k = (int)ep->cfg->topk;
    const moe_index first = recv->expert_offset[l], n = recv->expert_offset[l + 1] - first;
    const moe_expert_weights w = moe_ep_weights(ep, false, l);
    /* the rows (n, d) in the expert's block of the layout, or in work; their
     * outputs (n, d) in work; the gate weights (n) */
    float *in = block ? block : work, *out = work, *scale = NULL;
    if (ep->cfg->weight_at == MOE_WEIGHT_AT_ACTIVATION) {
        scale = work + n * d;
        for (moe_index m = 0; m < n; m++)
            scale[m] = moe_meta_weight(recv_meta + recv->expert_row[first + m] * MOE_META_WORDS(k),
                                       k, recv->expert_slot[first + m]);
    }
    const bool pairs = ep->cfg->combine == MOE_COMBINE_PAIRS; /* reduced: the sums are rounded instead */
    if (!block && ep->gemm == MOE_GEMM_PACKED) {
        /* the rows read where they arrived, the outputs written to their pairs' rows */
        const moe_index *pair = recv->expert_pair + first;
        moe_expert_forward_rows(&w, row_at, recv->expert_row + first, n, d, f, scratch, expert_out,
                                pair, scale, hooks);
        for (moe_index m = 0; m < n && pairs; m++)
            moe_precision_combine(ep->cfg->combine_dtype, expert_out + pair[m] * d, d);
        return;
    }
    moe_gather_row_ptrs(row_at, d, recv->expert_row + first, n, in);
    moe_expert_forward(&w, ep->gemm, in, n, d, f, scratch, out, scale, hooks);
    if (pairs)
        moe_precision_combine(ep->cfg->combine_dtype, out, n * d);
    moe_scatter_rows(out, d, recv->expert_pair + first, n, expert_out);
}

void moe_ep_expert(const moe_ep *ep, const moe_recv_plan *recv, int l,
                   const float *const *row_at, const int32_t *recv_meta, float *block, float *work,
                   float *scratch, float *expert_out, const moe_ffn_hooks *hooks)
{
    const moe_index n = recv->expert_offset[l + 1] - recv->expert_offset[l];
    if (n > 0)
        expert_rows(ep, recv, l, row_at, recv_meta, block, work, scratch, expert_out, hooks);
    if (ep->cfg->pad_to_capacity && l >= recv->wave_first && l < recv->wave_end) {
        const moe_expert_weights w = moe_ep_weights(ep, false, l);
        pad_expert(ep, &w, n, work, scratch, hooks);
    }
}

/* sum[j] += w * row[j] for j < d: a multiply then an add a lane, so
 * vectors change no bit (-O2 alone left these loops scalar). */
__attribute__((target_clones("avx2", "default")))
static void add_scaled_row(moe_index d, float w, const float *restrict row, float *restrict sum)
{
#pragma omp simd
    for (moe_index j = 0; j < d; j++)
        sum[j] += w * row[j];
}

__attribute__((target_clones("avx2", "default")))
void moe_ep_add_row(moe_index d, const float *restrict row, float *restrict sum)
{
#pragma omp simd
    for (moe_index j = 0; j < d; j++)
        sum[j] += row[j];
}

void moe_ep_sum_slots(const moe_ep *ep, const int32_t *row_meta, const float *const *out, float *sum)
{
    const moe_index d = ep->cfg->hidden;
    const int k = (int)ep->cfg->topk;
    const bool weighted = row_meta && ep->cfg->weight_at == MOE_WEIGHT_AT_OUTPUT;
    memset(sum, 0, sizeof(float) * (size_t)d);
    for (int s = 0; s < k; s++) {
        if (!out[s])
            continue;
        const float w = weighted ? moe_meta_weight(row_meta, k, s) : 1.0f;
        add_scaled_row(d, w, out[s], sum);
    }
}

void moe_ep_reduce_at_source(const moe_ep *ep, const moe_recv_plan *recv, const int32_t *recv_meta,
                             const float *expert_out, float *sums)
{
    const moe_index d = ep->cfg->hidden;
    const int k = (int)ep->cfg->topk;
    const float **slot_out = moe_xcalloc((size_t)(recv->rows * k) + 1, sizeof(float *)); /* (rows, k) */
    for (moe_index m = 0; m < recv->pairs; m++)
        slot_out[recv->expert_row[m] * k + recv->expert_slot[m]] = expert_out + recv->expert_pair[m] * d;
    for (moe_index row = 0; row < recv->rows; row++)
        moe_ep_sum_slots(ep, recv_meta ? recv_meta + row * MOE_META_WORDS(k) : NULL, slot_out + row * k,
                         sums + row * d);
    moe_precision_combine(ep->cfg->combine_dtype, sums, recv->rows * d);
    free(slot_out);
}

void moe_ep_reduce_rows(const moe_ep *ep, const moe_placement *to, const int32_t *ids,
                        const moe_waves *waves, const float *const *from, int count, float *y)
{
    const moe_index d = ep->cfg->hidden, T = ep->cfg->tokens;
    const int k = (int)ep->cfg->topk, D = to->ranks;
    moe_index *cursor = moe_xcalloc((size_t)(count * D), sizeof(moe_index));
    int dest[k > 0 ? k : 1], wave[k > 0 ? k : 1];
    memset(y, 0, sizeof(float) * (size_t)(T * d));
    for (moe_index i = 0; i < T; i++) {
        const int n = moe_token_destinations(to, waves, ids, k, i, dest, wave);
        float *yi = y + i * d;
        for (int m = 0; m < n; m++) {
            const int slot = wave[m] * D + dest[m];
            moe_ep_add_row(d, from[slot] + cursor[slot]++ * d, yi);
        }
    }
    free(cursor);
}

void moe_ep_reduce(const moe_ep *ep, const float *const *slot_rows, const float *weights,
                   float *y)
{
    const moe_config *cfg = ep->cfg;
    moe_combine_reduce(slot_rows, cfg->weight_at == MOE_WEIGHT_AT_OUTPUT ? weights : NULL,
                       cfg->tokens, (int)cfg->topk, cfg->hidden, y);
}

void moe_ep_shared_outputs(const moe_ep *ep, const float *x, moe_index rows, float *out)
{
    const moe_index d = ep->cfg->hidden, f = ep->cfg->ffn;
    float *scratch = moe_xmalloc(sizeof(float) * (size_t)(rows * 2 * f) + 1);
    for (int s = 0; s < (int)ep->cfg->shared_experts; s++) {
        const moe_expert_weights w = moe_ep_weights(ep, true, s);
        moe_expert_forward(&w, ep->gemm, x, rows, d, f, scratch, out + (moe_index)s * rows * d, NULL,
                           NULL);
    }
    free(scratch);
}

/* Shared expert s on the block of tokens from `first` (MOE_SHARED_ROW_BLOCK
 * or the rest): its rows of o (rows, d). Returns the rows. */
static moe_index shared_piece(const moe_ep *ep, int s, moe_index first, const float *x,
                              float *scratch, float *o, const moe_ffn_hooks *hooks)
{
    const moe_index T = ep->cfg->tokens, d = ep->cfg->hidden, f = ep->cfg->ffn;
    const moe_index rows = T - first < MOE_SHARED_ROW_BLOCK ? T - first : MOE_SHARED_ROW_BLOCK;
    const moe_expert_weights w = moe_ep_weights(ep, true, s);
    moe_expert_forward(&w, ep->gemm, x + first * d, rows, d, f, scratch, o, NULL, hooks);
    return rows;
}

void moe_ep_shared(const moe_ep *ep, const float *x, float *y, float *scratch, float *out,
                   moe_forward_stats *stats)
{
    const moe_index T = ep->cfg->tokens, d = ep->cfg->hidden;
    const double start = moe_stage_begin();
    if (y) {
        for (int s = 0; s < (int)ep->cfg->shared_experts; s++)
            for (moe_index first = 0, rows; first < T; first += rows) {
                rows = shared_piece(ep, s, first, x, scratch, out, NULL);
                for (moe_index n = 0; n < rows * d; n++)
                    y[first * d + n] += out[n];
            }
    } else { /* every piece into its place in out */
        moe_shared_work w;
        moe_shared_work_init(&w, ep, x, scratch, out, NULL, 0.0);
        while (moe_shared_work_step(&w, NULL))
            ;
    }
    stats->done = moe_stage_end(&stats->seconds[MOE_STAGE_SHARED], start);
}

void moe_ep_shared_add(const moe_ep *ep, const float *out, float *y)
{
    const moe_index T = ep->cfg->tokens, d = ep->cfg->hidden;
    for (moe_index s = 0; s < ep->cfg->shared_experts; s++) /* as moe_ep_shared adds them */
        moe_ep_add_row(T * d, out + s * T * d, y);
}

void moe_shared_work_init(moe_shared_work *w, const moe_ep *ep, const float *x, float *scratch,
                          float *out, moe_trace *trace, double origin)
{
    const moe_index blocks = (ep->cfg->tokens + MOE_SHARED_ROW_BLOCK - 1) / MOE_SHARED_ROW_BLOCK;
    *w = (moe_shared_work){ep, x, scratch, out, 0, (int)(ep->cfg->shared_experts * blocks),
                           0.0, 0.0, trace, origin};
}

void moe_shared_work_finish(moe_shared_work *w, float *y, moe_forward_stats *stats)
{
    const double rest = moe_stage_begin();
    while (moe_shared_work_step(w, NULL))
        ;
    moe_ep_shared_add(w->ep, w->out, y);
    stats->seconds[MOE_STAGE_SHARED] = stats->fill_seconds; /* the pieces in the waits */
    stats->done = moe_stage_end(&stats->seconds[MOE_STAGE_SHARED], rest);
}

bool moe_shared_work_step(moe_shared_work *w, const moe_ffn_hooks *hooks)
{
    if (w->next == w->pieces)
        return false;
    const moe_index T = w->ep->cfg->tokens, d = w->ep->cfg->hidden;
    const int blocks = w->pieces / (int)w->ep->cfg->shared_experts, s = w->next / blocks;
    const moe_index first = (moe_index)(w->next % blocks) * MOE_SHARED_ROW_BLOCK;
    w->next++;
    const double flops = moe_gemm_sflops(), start = moe_stage_begin();
    const moe_index rows = shared_piece(w->ep, s, first, w->x, w->scratch,
                                        w->out + (s * T + first) * d, hooks);
    const double end = moe_stage_event(w->trace, w->origin, start,
                                       (moe_event){.wave = -1, .kind = MOE_EVENT_SHARED, .rows = rows,
                                                   .tier = -1});
    w->seconds += end - start;
    w->flops += moe_gemm_sflops() - flops;
    return true;
}

