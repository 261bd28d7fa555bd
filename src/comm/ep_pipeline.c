/* SPDX-License-Identifier: MIT */
/* ep_pipeline.c — the plumbing both pipelined forwards share (ep_waves.c,
 * the flat dispatch; ep_hier.c, the two-stage one): the compute clock and
 * its hooks, posting an operation under the link model, the timeline's comm
 * events, a fault inside the pipeline. See ep_stages.h.
 */
#include <stdlib.h>
#include <string.h>

#include "moe/gemm.h"
#include "ep_stages.h"

void moe_pipeline_after_stage(void *arg, enum moe_ffn_stage stage)
{
    moe_stage_clock *clock = arg;
    const double now = moe_stage_event(clock->trace, clock->origin, clock->mark,
                                       (moe_event){.wave = clock->wave,
                                                   .kind = MOE_EVENT_L1 + (int)stage,
                                                   .rows = clock->rows, .tier = -1});
    clock->compute += now - clock->mark;
    moe_progress_poll(clock->progress);
    if (clock->between)
        clock->between(clock->between_arg);
    clock->mark = moe_stage_begin();
}

/* What a shared piece's hooks do between its stages: poll, then the
 * caller's `between` (the two-stage dispatch relays what has landed). */
typedef struct {
    moe_progress *progress;
    void (*between)(void *arg);
    void *arg;
} fill_hooks;

static void poll_between(void *ctx, enum moe_ffn_stage stage)
{
    (void)stage;
    const fill_hooks *h = ctx;
    moe_progress_poll(h->progress);
    if (h->between)
        h->between(h->arg);
}

void moe_pipeline_fill(moe_progress *p, int op, moe_shared_work *w, void (*between)(void *arg),
                       void *arg)
{
    fill_hooks h = {p, between, arg};
    const moe_ffn_hooks hooks = {poll_between, &h, 0};
    for (;;) {
        poll_between(&h, MOE_FFN_L1);
        if (moe_progress_done(p, op) || !moe_shared_work_step(w, &hooks))
            return;
    }
}

const moe_link *moe_schedule_link(const moe_ep *ep, const moe_schedule *sched)
{
    static const moe_link no_link = {.enabled = false};
    return sched->link ? &ep->link : &no_link;
}

void moe_pipeline_link_bytes(const moe_ep *ep, const moe_index *in_rows, const moe_index *out_rows,
                             double row_bytes, double bytes[2][MOE_TIERS])
{
    const int me = ep->comm.rank;
    for (int r = 0; r < ep->comm.ranks; r++)
        if (r != me) {
            const int tier = moe_link_tier(&ep->link, me, r);
            bytes[0][tier] += (double)in_rows[r] * row_bytes;
            bytes[1][tier] += (double)out_rows[r] * row_bytes;
        }
}

/* A modelled wait past MOE_LINK_WAIT_MAX ends the job. */
static void link_bound(double now, double done, MPI_Comm comm)
{
    if (done - now <= MOE_LINK_WAIT_MAX)
        return;
    moe_comm me = {.comm = comm, .rank = moe_message_rank};
    moe_status st = {0};
    moe_fail(&st, MOE_EXIT_RUNTIME, "--link: the emulated links would hold one all-to-all "
             "for %.0f s, past the %.0f s bound; give faster links or a smaller config",
             done - now, MOE_LINK_WAIT_MAX);
    moe_comm_abort(&me, &st);
}

void moe_pipeline_track(moe_progress *p, int op, const moe_link *link, moe_link_state *links,
                        double bytes[2][MOE_TIERS], MPI_Comm comm)
{
    const double now = moe_clock_now(), done = moe_link_schedule(link, links, now, bytes[0], bytes[1]);
    link_bound(now, done, comm);
    moe_progress_track(p, op, now, done);
}

void moe_pipeline_hold(const moe_link *link, moe_link_state *links, double posted,
                       double bytes[2][MOE_TIERS], int rounds, MPI_Comm comm)
{
    if (!link->enabled)
        return;
    double done = moe_link_schedule(link, links, posted, bytes[0], bytes[1]), latency = 0.0;
    for (int t = 0; t < MOE_TIERS; t++)
        if (bytes[0][t] > 0 || bytes[1][t] > 0)
            latency = link->latency[t] > latency ? link->latency[t] : latency;
    done += (rounds - 1) * latency;
    link_bound(moe_clock_now(), done, comm);
    moe_clock_hold(done);
}

void moe_pipeline_count_round(const moe_ep *ep, const moe_link *link, double posted,
                              double bytes_per_rank)
{
    if (!link->enabled)
        return;
    const int G = ep->comm.ranks;
    moe_index *one = moe_xmalloc(sizeof(moe_index) * (size_t)G);
    for (int r = 0; r < G; r++)
        one[r] = 1;
    double bytes[2][MOE_TIERS] = {{0}};
    moe_pipeline_link_bytes(ep, one, one, bytes_per_rank, bytes);
    moe_link_state alone = {{{0}}};
    moe_pipeline_hold(link, &alone, posted, bytes, 1, ep->comm.comm);
    free(one);
}

void moe_pipeline_comm_event(moe_trace *trace, const moe_comm_op *o, const moe_comm_op *previous,
                             double origin, int wave, int kind, int tier, double bytes,
                             moe_index rows)
{
    if (!trace)
        return;
    double start = o->posted;
    if (previous && previous->completed > start)
        start = previous->completed < o->completed ? previous->completed : o->completed;
    moe_trace_add(trace, (moe_event){wave, kind, start - origin, o->completed - origin, bytes, rows, tier,
                                     o->posted - origin});
}

void moe_pipeline_experts(const moe_ep *ep, const moe_recv_plan *recv, const float *const *row_at,
                          const int32_t *recv_meta, float *expert_out, float *sums,
                          float *expert_in, float *scratch, moe_stage_clock *clock)
{
    const moe_ffn_hooks hooks = {moe_pipeline_after_stage, clock,
                                 ep->gemm == MOE_GEMM_EXACT ? MOE_POLL_CHUNK_ROWS : 0};
    moe_ep_layout layout;
    moe_ep_layout_open(ep, recv, &layout);
    for (int l = 0; l < recv->local_experts; l++) {
        clock->rows = recv->expert_offset[l + 1] - recv->expert_offset[l];
        moe_ep_expert(ep, recv, l, row_at, recv_meta, moe_ep_layout_block(ep, &layout, l),
                      expert_in, scratch, expert_out, &hooks);
    }
    clock->slots += layout.slots.slots;
    moe_ep_layout_close(&layout);
    if (sums) /* --combine reduced: one row per (token, rank) */
        moe_ep_reduce_at_source(ep, recv, recv_meta, expert_out, sums);
    const double now = moe_stage_end(&clock->compute, clock->mark); /* the last scatter
                                                                        belongs to the last L2 */
    clock->mark = now;
    if (clock->trace && clock->trace->count > 0 &&
        clock->trace->events[clock->trace->count - 1].kind == MOE_EVENT_L2)
        clock->trace->events[clock->trace->count - 1].end = now - clock->origin;
}

void moe_pipeline_fail_here(const moe_comm *c, const char *stage)
{
    moe_status fault = {0};
    if (moe_fault_here(c, stage, &fault))
        moe_comm_abort(c, &fault);
}

void moe_ep_fit_slots(moe_buffer **slots, int *held, int W, int per_wave)
{
    if (*held < W) {
        *slots = realloc(*slots, sizeof(moe_buffer) * (size_t)(W * per_wave));
        MOE_ASSERT(*slots);
        memset(*slots + *held * per_wave, 0, sizeof(moe_buffer) * (size_t)((W - *held) * per_wave));
        *held = W;
    }
    for (int n = W * per_wave; n < *held * per_wave; n++)
        moe_buffer_free(&(*slots)[n]);
}
