/* SPDX-License-Identifier: MIT */
/* context.c — the set-up and the timed forwards that run and bench share
 * (see context.h). */
#define _POSIX_C_SOURCE 200809L
#include "moe/clock.h"
#include "moe/context.h"
#include "moe/wire.h"

#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "moe/files.h"
#include "moe/gemm.h"
#include "moe/golden.h"
#include "moe/path.h"
#include "moe/routing.h"
#include "moe/settle.h"
#include "moe/watchdog.h"
#include "moe/workload.h"

/* Every output path can be written, and no two name the same place (nor a
 * file inside the dump's directory, which the dump replaces). Rank 0. */
static int check_outputs(const moe_config *cfg, moe_status *st)
{
    const struct {
        const char *flag, *path;
    } out[] = {{"--dump", cfg->dump}, {"--trace", cfg->trace}, {"--timeline", cfg->timeline},
               {"--csv", cfg->csv}, {"--plot", cfg->plot}, {"--report", cfg->report},
               {"--steps-csv", cfg->steps_csv}, {"--steps-plot", cfg->steps_plot},
               {"--placement-svg", cfg->placement_svg}};
    enum { N = sizeof out / sizeof out[0] };
    char where[N][PATH_MAX + 8];
    for (int n = 0; n < N; n++) {
        where[n][0] = '\0';
        if (!out[n].path[0])
            continue;
        if (n == 0 ? moe_check_output_dir(out[n].flag, out[n].path, st) ||
                         moe_golden_check_target(out[n].path, st)
                   : moe_check_output_path(out[n].flag, out[n].path, st))
            return st->code;
        moe_path_identity(out[n].path, where[n], sizeof where[n]);
        for (int m = 0; m < n; m++) {
            const size_t len = strlen(where[m]);
            if (where[m][0] && !strcmp(where[n], where[m]))
                return moe_fail(st, MOE_EXIT_USAGE, "%s and %s name the same path '%s'",
                                out[m].flag, out[n].flag, out[n].path);
            if (m == 0 && where[m][0] && !strncmp(where[n], where[m], len) && where[n][len] == '/')
                return moe_fail(st, MOE_EXIT_USAGE,
                                "%s '%s' is inside the --dump directory, which the dump replaces",
                                out[n].flag, out[n].path);
        }
    }
    return MOE_EXIT_OK;
}

/* What run and bench check beyond the config itself (moe_config_settle's
 * checks): the output paths (rank 0), and the flags whose combination
 * only the command knows. */
static int command_checks(const moe_config *cfg, const moe_path *path, const moe_comm *c,
                          void *arg, moe_status *st)
{
    const enum moe_command command = *(const enum moe_command *)arg;
    if ((c->rank == 0 && check_outputs(cfg, st)) || moe_fault_validate_writer(cfg->dump[0], st))
        return st->code;
    if (command == MOE_CMD_RUN && path->training && cfg->waves_count > 1)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--waves W1,W2,... sweeps the forward's wave pipeline, and run --backward "
                        "runs one schedule (the blocking forward, its backward in W waves): give "
                        "one --waves, or sweep them with moe-ep bench --backward");
    if (command == MOE_CMD_BENCH && cfg->schedule == MOE_SCHEDULE_DUALPIPE && !path->training)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--schedule dualpipe pairs one micro-batch's forward with another's "
                        "backward: add --backward");
    if (command == MOE_CMD_BENCH && cfg->schedule == MOE_SCHEDULE_DUALPIPE && cfg->plot[0])
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--plot draws the wave sweep of one micro-batch; with --schedule dualpipe "
                        "write the table with --csv");
    if (command == MOE_CMD_BENCH && path->reference_run)
        return moe_fail(st, MOE_EXIT_USAGE, "moe-ep bench sweeps the wave pipeline; drop --blocking");
    if (cfg->workload == MOE_WORKLOAD_ALL && command != MOE_CMD_BENCH)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--workload all is bench's table (one row per workload): name one workload");
    if (cfg->workload == MOE_WORKLOAD_ALL && (path->low_latency || cfg->schedule == MOE_SCHEDULE_DUALPIPE ||
                                              path->training))
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--workload all times the normal forward: drop --mode low-latency, --schedule "
                        "dualpipe and --backward");
    if (cfg->compare_serial && !cfg->timeline[0])
        return moe_fail(st, MOE_EXIT_USAGE, "--compare-serial needs --timeline FILE.svg");
    if (path->reference_run && (cfg->trace[0] || cfg->timeline[0]))
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--trace and --timeline show the wave pipeline; drop --blocking");
    return MOE_EXIT_OK;
}

/* Parse `command`'s arguments on every rank and settle the config
 * (settle.h): validated, the command's checks, the memory estimate, one
 * verdict, the same config everywhere. */
static int set_up(const moe_comm *c, moe_config *cfg, enum moe_command command, int argc,
                  char **argv, moe_status *st)
{
    moe_config_defaults(cfg);
    if (command == MOE_CMD_BENCH) { /* bench sweeps W unless told otherwise */
        static const int64_t sweep[] = {1, 2, 4, 8};
        memcpy(cfg->waves_list, sweep, sizeof sweep);
        cfg->waves_count = 4;
        cfg->iters = 5;
    }
    if (moe_fault_validate(c->ranks, st) == MOE_EXIT_OK)
        moe_config_parse(cfg, command, argc, argv, st);
    return moe_config_settle(cfg, c, command, command_checks, &command, st);
}

/* The routing and traffic figures of one forward, reduced over ranks. */
static void summarize_traffic(const moe_comm *c, const moe_ep *ep, const moe_forward_stats *f,
                              moe_run_summary *s)
{
    const double rows = (double)f->rows_received, pairs = (double)f->pairs_received;
    s->rows_received = (moe_spread){moe_comm_min(c, rows), moe_comm_sum(c, rows) / c->ranks,
                                    moe_comm_max(c, rows)};
    s->pairs_received = (moe_spread){moe_comm_min(c, pairs), moe_comm_sum(c, pairs) / c->ranks,
                                     moe_comm_max(c, pairs)};
    s->layout_slots = moe_comm_sum(c, (double)f->layout_slots);
    s->rows_sent = moe_comm_sum(c, (double)f->rows_sent);
    s->rows_sent_remote = moe_comm_sum(c, (double)f->rows_sent_remote);
    s->pairs_back_remote = moe_comm_sum(c, (double)f->pairs_back_remote);
    s->bytes_dispatched = moe_comm_sum(c, f->bytes_dispatched);
    for (int t = 0; t < 2; t++)
        s->tier_bytes[t] = moe_comm_sum(c, f->tier_bytes[t]);
    s->rows_inter = moe_comm_sum(c, (double)f->rows_inter);
    s->rows_intra = moe_comm_sum(c, (double)f->rows_intra);
    s->bytes_combined = moe_comm_sum(c, f->bytes_combined);
    s->expert_flops = moe_comm_sum(c, f->expert_flops);
    s->fill_flops = moe_comm_sum(c, f->fill_flops);
    s->pad_rows = moe_comm_sum(c, (double)f->pad_rows);
    s->local_experts_min = (int)moe_comm_min(c, ep->local_experts);
    s->local_experts_max = (int)moe_comm_max(c, ep->local_experts);
}

/* Per forward, each rank's figures; reduced with max over ranks. The expert
 * window is max(end) - min(start): -start goes in as COL_WINDOW. */
enum {
    COL_LAYER = MOE_STAGES, COL_EXPERTS, COL_WINDOW, COL_PIPELINE, COL_COMPUTE, COL_FILL, COL_TEST,
    COL_EXPERT_END, COLS
};

static void iteration_row(const moe_forward_stats *f, double layer, double *row)
{
    memcpy(row, f->seconds, sizeof f->seconds);
    row[COL_LAYER] = layer;
    row[COL_EXPERTS] = f->seconds[MOE_STAGE_EXPERTS];
    row[COL_WINDOW] = -f->expert_start;
    row[COL_PIPELINE] = f->pipeline_seconds;
    row[COL_COMPUTE] = f->compute_seconds;
    row[COL_FILL] = f->fill_seconds;
    row[COL_TEST] = f->test_seconds;
    row[COL_EXPERT_END] = f->expert_end;
}

/* Medians over forwards of the per-forward maxima. */
static void summarize_times(double *per_iter, int iters, moe_run_summary *s)
{
    double column[iters], m[COLS];
    for (int n = 0; n < COLS; n++) {
        for (int it = 0; it < iters; it++)
            column[it] = per_iter[(size_t)it * COLS + n];
        m[n] = moe_median(column, iters);
    }
    memcpy(s->stage_seconds, m, sizeof s->stage_seconds);
    s->layer_seconds = m[COL_LAYER];
    s->layer_min = s->layer_max = per_iter[COL_LAYER];
    for (int it = 1; it < iters; it++) {
        s->layer_min = fmin(s->layer_min, per_iter[(size_t)it * COLS + COL_LAYER]);
        s->layer_max = fmax(s->layer_max, per_iter[(size_t)it * COLS + COL_LAYER]);
    }
    s->expert_seconds = m[COL_EXPERTS];
    s->expert_window = m[COL_WINDOW];
    s->pipeline_seconds = m[COL_PIPELINE];
    s->compute_seconds = m[COL_COMPUTE];
    s->fill_seconds = m[COL_FILL];
    s->test_seconds = m[COL_TEST];
}

/* --backward: per step, each rank's backward stages and the step's time
 * (origin to the gradients complete), reduced with max over ranks. */
enum { BWD_STEP = MOE_BWD_STAGES, BWD_COLS };

static uint64_t grads_digest(const moe_run_context *ctx)
{
    const float *v[MOE_EP_GRAD_TENSORS];
    moe_index n[MOE_EP_GRAD_TENSORS];
    moe_ep_grads_tensors(&ctx->ep, &ctx->grads, v, n);
    uint64_t digest = 0;
    for (int t = 0; t < MOE_EP_GRAD_TENSORS; t++)
        digest = digest * 1000003u ^ moe_digest64(v[t], sizeof(float) * (size_t)n[t]);
    return digest;
}

static void backward_row(moe_run_context *ctx, int it, double origin, bool *identical)
{
    double *row = ctx->per_iter_bwd + (size_t)it * BWD_COLS;
    memcpy(row, ctx->last_bwd.seconds, sizeof ctx->last_bwd.seconds);
    row[BWD_STEP] = moe_stage_since(origin);
    moe_comm_max_array(ctx->comm, row, BWD_COLS);
    const uint64_t digest = grads_digest(ctx);
    if (it == 0)
        ctx->grads_digest = digest;
    else if (digest != ctx->grads_digest)
        *identical = false;
}

static void summarize_backward(moe_run_context *ctx, int iters, bool identical)
{
    const moe_comm *c = ctx->comm;
    moe_run_summary *s = &ctx->summary;
    double column[iters];
    for (int n = 0; n < BWD_COLS; n++) {
        for (int it = 0; it < iters; it++)
            column[it] = ctx->per_iter_bwd[(size_t)it * BWD_COLS + n];
        const double m = moe_median(column, iters);
        if (n == BWD_STEP) {
            s->step_seconds = m;
            s->step_min = s->step_max = column[0];
            for (int it = 1; it < iters; it++) {
                s->step_min = fmin(s->step_min, column[it]);
                s->step_max = fmax(s->step_max, column[it]);
            }
        } else
            s->bwd_seconds[n] = m;
    }
    s->backward = true;
    s->bwd_bytes_combine = moe_comm_sum(c, ctx->last_bwd.bytes_combine);
    s->bwd_bytes_dispatch = moe_comm_sum(c, ctx->last_bwd.bytes_dispatch);
    s->dgrad_flops = moe_comm_sum(c, ctx->last_bwd.dgrad_flops);
    s->wgrad_flops = moe_comm_sum(c, ctx->last_bwd.wgrad_flops);
    s->grads_identical = moe_comm_min(c, identical ? 1.0 : 0.0) > 0.0;
    s->bwd_overlapped = !ctx->ep.path->reference_run;
    s->bwd_one_pass = s->bwd_overlapped && moe_ep_backward_one_pass(&ctx->ep, &ctx->schedule);
    for (int op = 0; op < 2; op++)
        s->bwd_in_flight[op] = moe_comm_max(c, ctx->last_bwd.in_flight[op]);
}

/* One run of the context's path on its buffers, under its schedule (with
 * the trace recorded from `origin`). */
static int forward(moe_run_context *ctx, double origin)
{
    ctx->schedule.trace = &ctx->trace;
    ctx->schedule.origin = origin;
    const moe_path_args a = {.sched = &ctx->schedule, .x = ctx->x, .logits = ctx->logits,
                             .dy = ctx->dy, .ids = ctx->placed, .weights = ctx->weights,
                             .y = ctx->y, .grads = &ctx->grads, .fwd = &ctx->last,
                             .bwd = &ctx->last_bwd};
    return moe_path_run(ctx->ep.path, &ctx->ep, &a, &ctx->status);
}

int moe_context_timed_forwards(moe_run_context *ctx, int iters)
{
    const moe_comm *c = ctx->comm;
    const moe_index n = ctx->cfg.tokens * ctx->cfg.hidden;
    const bool progress = c->rank == 0 && iters > 1 && isatty(STDERR_FILENO);
    moe_run_summary *s = &ctx->summary;
    bool identical = true, grads_identical = true;
    int rc = MOE_EXIT_OK;
    free(ctx->per_iter);
    free(ctx->per_iter_bwd);
    ctx->per_iter_bwd = ctx->ep.path->training ? moe_xmalloc(sizeof(double) * (size_t)(iters * BWD_COLS))
                                          : NULL;
    ctx->per_iter = moe_xmalloc(sizeof(double) * (size_t)(iters * COLS));
    moe_index mask_dropped = 0;
    for (int it = 0; it < iters && rc == MOE_EXIT_OK; it++) {
        if (ctx->between)
            ctx->between(ctx->between_arg);
        moe_trace_clear(&ctx->trace);
        moe_watch_wait(MOE_WATCH_START, -1);
        moe_comm_barrier(c);
        moe_watch_done();
        const double origin = moe_clock_now();
        mask_dropped = moe_ep_route(&ctx->ep, ctx->x, ctx->logits, ctx->scores, ctx->ids, ctx->weights);
        moe_ep_place(&ctx->ep, ctx->ids, ctx->weights, ctx->placed);
        const double route = moe_stage_since(origin);
        rc = forward(ctx, origin);
        const double layer = ctx->last.done - origin; /* to y complete */
        ctx->last.seconds[MOE_STAGE_ROUTE] = route;
        double *row = ctx->per_iter + (size_t)it * COLS;
        iteration_row(&ctx->last, layer, row);
        moe_watch_wait(MOE_WATCH_END, -1);
        moe_comm_max_array(c, row, COLS);
        moe_watch_done();
        row[COL_WINDOW] += row[COL_EXPERT_END];
        const uint64_t digest = moe_digest64(ctx->y, sizeof(float) * (size_t)n);
        if (it == 0)
            ctx->y_digest = digest;
        else if (digest != ctx->y_digest)
            identical = false;
        if (ctx->ep.path->training && rc == MOE_EXIT_OK)
            backward_row(ctx, it, origin, &grads_identical);
        if (progress)
            fprintf(stderr, "\rmoe-ep: W=%d forward %d/%d", ctx->schedule.waves, it + 1, iters);
    }
    if (progress)
        fprintf(stderr, "\r\033[K");
    if (rc)
        return rc;
    if (ctx->between)
        ctx->between(ctx->between_arg);
    summarize_times(ctx->per_iter, iters, s);
    summarize_traffic(c, &ctx->ep, &ctx->last, s);
    s->mask_dropped = moe_comm_sum(c, (double)mask_dropped);
    ctx->last_expert_seconds = ctx->last.seconds[MOE_STAGE_EXPERTS];
    s->waves = ctx->last.waves;
    s->wave_kind = ctx->last.wave_kind;
    s->progress = ctx->schedule.progress;
    s->iterations_identical = moe_comm_min(c, identical ? 1.0 : 0.0) > 0.0;
    if (ctx->ep.path->training)
        summarize_backward(ctx, iters, grads_identical);
    return MOE_EXIT_OK;
}

void moe_context_time_alltoalls(moe_run_context *ctx, int iters)
{
    const moe_path *path = ctx->ep.path;
    if (!path->time_alltoalls)
        return;
    double seconds[iters];
    for (int it = 0; it < iters; it++)
        seconds[it] = moe_comm_max(ctx->comm, path->time_alltoalls(&ctx->ep, &ctx->schedule));
    ctx->summary.comm_seconds = moe_median(seconds, iters);
}

/* --link cb=RATIO: B = C / RATIO with C a rank's expert FLOP/s (summed
 * FLOPs over summed compute seconds of all ranks), the faster of the
 * second and third of three untimed forwards without the link model: the
 * first touches the buffers for the first time, and its experts ran at
 * half the rate of the timed forwards (laptop, np = 2), which made every
 * link twice as slow as RATIO says; and one forward alone, stalled (a
 * two-core VM stalls a pass now and then: choose_waves), did the same in
 * two runs of twelve at cb = 1131 and 3640 (C = 92-94 against 170-195
 * GFLOP/s). Collective. */
static int calibrate_link(moe_run_context *ctx)
{
    moe_ep *ep = &ctx->ep;
    moe_schedule unlinked = ctx->schedule;
    unlinked.link = false;
    moe_ep_route(ep, ctx->x, ctx->logits, ctx->scores, ctx->ids, ctx->weights);
    moe_ep_place(ep, ctx->ids, ctx->weights, ctx->placed);
    moe_forward_stats f;
    const moe_path_args a = {.sched = &unlinked, .x = ctx->x, .ids = ctx->placed,
                             .weights = ctx->weights, .y = ctx->y, .fwd = &f};
    ctx->summary.rank_flops = 0.0;
    for (int pass = 0; pass < 3; pass++) {
        const int rc = moe_path_run(ep->path->waves, ep, &a, &ctx->status);
        if (rc)
            return rc;
        if (pass == 0) /* the first touch of the buffers */
            continue;
        const double flops = moe_comm_sum(ctx->comm, f.expert_flops);
        const double seconds = moe_comm_sum(ctx->comm, f.seconds[MOE_STAGE_EXPERTS]);
        if (seconds > 0)
            ctx->summary.rank_flops = fmax(ctx->summary.rank_flops, flops / seconds);
    }
    for (int t = 0; t < MOE_TIERS; t++) {
        const double ratio = t == MOE_TIER_INTER && ep->link.cb_ratio_inter > 0 ? ep->link.cb_ratio_inter
                                                                               : ep->link.cb_ratio;
        const double bandwidth = ctx->summary.rank_flops / ratio;
        ep->link.bandwidth[t] = bandwidth > 0 ? bandwidth : INFINITY;
    }
    return MOE_EXIT_OK;
}

/* --wave-by auto under --link: for each --waves entry W > 1, the grouping
 * the two-resource estimate finds faster (moe_waves_choose), with the
 * experts timed here at each grouping's batches: whole ones (T G k / E
 * rows, expert slots) and W chunks of them (token chunks); the shared
 * experts at the whole batches' rate a row. The same choice on every rank
 * (the times are the slowest rank's). Only where the choice keeps the bits
 * (GEMMs whose rows are independent) and every expert's batch may be split
 * (not --pad-to-capacity). Collective. */
static void choose_waves(moe_run_context *ctx)
{
    moe_ep *ep = &ctx->ep;
    const moe_config *cfg = &ctx->cfg;
    const moe_path *path = ep->path;
    if (cfg->wave_by != MOE_WAVE_BY_AUTO || !ep->link.enabled || !path->pipelined ||
        !path->linked || path->two_stage || path->training || cfg->pad_to_capacity ||
        !moe_gemm_rows_independent(ep->gemm))
        return;
    bool split = false;
    for (int n = 0; n < cfg->waves_count; n++)
        split |= cfg->waves_list[n] > 1;
    if (!split)
        return;
    const moe_index G = ctx->comm->ranks;
    const double batch = (double)(cfg->tokens * G * cfg->topk) / ep->placement.experts;
    const moe_index rows = batch < 1.0 ? 1 : (moe_index)lround(batch);
    /* In TIMING_ROUNDS rounds, each timing every batch shape in turn; each
     * shape's least time over the rounds. A stall or a slow phase of the
     * machine then falls on one round of every shape, not on one shape:
     * on a two-core VM a single timing of each, the whole batches before
     * and after the chunked ones, stalled in two runs of six (two timings
     * of thirty: passes of 50 and 75 ms at `laptop`, np = 2, timed at 148
     * and 180), and at cb = 1131 one run in three chose token chunks at
     * W = 8, 0.80 times as fast as one wave. */
    enum { TIMING_ROUNDS = 3 };
    double whole = INFINITY;
    double *chunked = moe_xmalloc(sizeof(double) * (size_t)cfg->waves_count);
    for (int n = 0; n < cfg->waves_count; n++)
        chunked[n] = cfg->waves_list[n] > 1 ? INFINITY : 0.0;
    for (int round = 0; round < TIMING_ROUNDS; round++) {
        whole = fmin(whole, moe_ep_time_experts(ep, ctx->x, rows, 1));
        for (int n = 0; n < cfg->waves_count; n++)
            if (cfg->waves_list[n] > 1)
                chunked[n] = fmin(chunked[n],
                                  moe_ep_time_experts(ep, ctx->x, rows, (int)cfg->waves_list[n]));
    }
    /* the shared experts (the same d and f) on T rows at the whole
     * batches' rate a row: whole covers T k rows */
    const double shared = whole * (double)cfg->shared_experts / (double)cfg->topk;
    ep->wave_choices = moe_xcalloc((size_t)cfg->waves_count, sizeof *ep->wave_choices);
    for (int n = 0; n < cfg->waves_count; n++) {
        moe_wave_choice *choice = &ep->wave_choices[n];
        const moe_wave_traffic t = {.placement = &ep->placement, .link = &ep->link,
                                    .tokens = cfg->tokens, .topk = (int)cfg->topk,
                                    .waves = (int)cfg->waves_list[n],
                                    .reduced = cfg->combine == MOE_COMBINE_REDUCED,
                                    .dispatch_row_bytes = moe_dispatch_row_bytes(cfg),
                                    .combine_row_bytes = moe_combine_row_bytes(cfg),
                                    .compute_whole = whole, .compute_chunked = chunked[n],
                                    .compute_shared = shared};
        choice->waves = t.waves;
        choice->by = t.waves > 1 ? moe_waves_choose(&t, choice->estimate) : MOE_WAVE_BY_EXPERTS;
    }
    free(chunked);
    ctx->summary.wave_choices = ep->wave_choices;
}

static void buffers_init(moe_run_context *ctx)
{
    const moe_config *cfg = &ctx->cfg;
    const moe_index T = cfg->tokens, d = cfg->hidden, E = cfg->experts, k = cfg->topk;
    ctx->x = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    ctx->logits = moe_xmalloc(sizeof(float) * (size_t)(T * E));
    ctx->scores = moe_xmalloc(sizeof(float) * (size_t)(T * E));
    ctx->ids = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k));
    ctx->placed = cfg->redundant_experts > 0 || cfg->capacity_factor > 0 ? moe_xmalloc(sizeof(int32_t) * (size_t)(T * k)) : ctx->ids;
    ctx->weights = moe_xmalloc(sizeof(float) * (size_t)(T * k));
    ctx->y = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    if (ctx->ep.path->training) {
        ctx->dy = moe_xmalloc(sizeof(float) * (size_t)(T * d));
        moe_ep_generate_grad_output(&ctx->ep, ctx->dy);
        moe_ep_grads_init(&ctx->ep, &ctx->grads);
    }
}

void moe_context_close(moe_run_context *ctx)
{
    moe_watchdog_stop();
    moe_trace_free(&ctx->trace);
    free(ctx->per_iter);
    free(ctx->per_iter_bwd);
    free(ctx->dy);
    moe_ep_grads_free(&ctx->grads);
    free(ctx->y);
    free(ctx->weights);
    if (ctx->placed != ctx->ids)
        free(ctx->placed);
    free(ctx->ids);
    free(ctx->expert_load);
    free(ctx->steps_bias);
    free(ctx->steps_load);
    free(ctx->scores);
    free(ctx->logits);
    free(ctx->x);
    moe_ep_free(&ctx->ep);
    memset(ctx, 0, sizeof *ctx);
}

/* --redundant-experts: EPLB's load, from --expert-load (every rank reads
 * and checks the whole file: one verdict) or the --eplb-window batches,
 * and the copies placed by it. On failure the error is printed and ep freed. */
static int place_replicas(moe_run_context *ctx)
{
    const moe_comm *c = ctx->comm;
    ctx->expert_load = moe_xmalloc(sizeof(double) * (size_t)ctx->cfg.experts);
    if (ctx->cfg.expert_load[0]) {
        moe_expert_load_read(ctx->cfg.expert_load, (int)ctx->cfg.experts, ctx->expert_load, &ctx->status);
        if (moe_comm_agree(c, &ctx->status)) {
            moe_comm_print_error(c, &ctx->status);
            free(ctx->expert_load);
            ctx->expert_load = NULL;
            moe_ep_free(&ctx->ep);
            return ctx->status.code;
        }
    } else {
        moe_ep_window_load(&ctx->ep, ctx->expert_load);
    }
    moe_ep_place_replicas(&ctx->ep, ctx->expert_load);
    return MOE_EXIT_OK;
}

void moe_context_workload(moe_run_context *ctx, int workload)
{
    const moe_comm *c = ctx->comm;
    const moe_index T = ctx->cfg.tokens, k = ctx->cfg.topk;
    if (!ctx->ep.replay_ids) {
        ctx->ep.replay_ids = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k));
        ctx->ep.replay_weights = moe_xmalloc(sizeof(float) * (size_t)(T * k));
    }
    moe_placement logical;
    moe_placement_init(&logical, (int)ctx->cfg.experts, c->ranks);
    moe_workload_route(workload, ctx->cfg.seed, ctx->cfg.workload_step, &logical, T, c->rank, (int)k,
                       ctx->ep.replay_ids, ctx->ep.replay_weights);
    moe_placement_free(&logical);
}

void moe_context_replace_replicas(moe_run_context *ctx)
{
    moe_ep_window_load(&ctx->ep, ctx->expert_load);
    moe_ep_place_replicas(&ctx->ep, ctx->expert_load);
}

int moe_context_open(moe_run_context *ctx, moe_comm *c, enum moe_command command,
                     int argc, char **argv)
{
    memset(ctx, 0, sizeof *ctx);
    ctx->comm = c;
    int rc = set_up(c, &ctx->cfg, command, argc, argv, &ctx->status);
    if (rc == MOE_EXIT_OK) {
        moe_comm_start(c); /* started alone: MPI from here on (comm.h) */
        rc = moe_ep_init(&ctx->ep, &ctx->cfg, c, &ctx->status);
    }
    if (rc) {
        moe_comm_print_error(c, &ctx->status);
        return rc;
    }
    if (ctx->cfg.routing[0]) { /* every rank reads and checks the whole file: one verdict */
        const moe_index T = ctx->cfg.tokens, k = ctx->cfg.topk;
        ctx->ep.replay_ids = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k));
        ctx->ep.replay_weights = moe_xmalloc(sizeof(float) * (size_t)(T * k));
        moe_routing_load(ctx->cfg.routing, (moe_index)c->ranks * T, (int)k, (int)ctx->cfg.experts,
                         (moe_index)c->rank * T, T, ctx->ep.replay_ids, ctx->ep.replay_weights,
                         &ctx->status);
        if (moe_comm_agree(c, &ctx->status)) {
            moe_comm_print_error(c, &ctx->status);
            moe_ep_free(&ctx->ep);
            return ctx->status.code;
        }
    }
    if (ctx->cfg.workload != MOE_WORKLOAD_NONE)
        moe_context_workload(ctx, ctx->cfg.workload == MOE_WORKLOAD_ALL ? MOE_WORKLOAD_BALANCED
                                                                        : ctx->cfg.workload);
    if (ctx->cfg.redundant_experts > 0 && place_replicas(ctx))
        return ctx->status.code;
    const int threads = moe_comm_threads_for(c, ctx->ep.gemm);
    buffers_init(ctx);
    if (ctx->cfg.grad_output[0]) { /* every rank reads and checks the whole file: one verdict */
        const moe_index T = ctx->cfg.tokens;
        moe_grad_output_load(ctx->cfg.grad_output, (moe_index)c->ranks * T, ctx->cfg.hidden,
                             (moe_index)c->rank * T, T, ctx->dy, &ctx->status);
        if (moe_comm_agree(c, &ctx->status)) {
            moe_comm_print_error(c, &ctx->status);
            const int code = ctx->status.code;
            moe_context_close(ctx);
            return code;
        }
    }
    moe_ep_generate_tokens(&ctx->ep, ctx->x);
    ctx->schedule = moe_schedule_default(&ctx->ep);
    ctx->summary = (moe_run_summary){.cfg = &ctx->cfg, .path = ctx->ep.path, .ranks = c->ranks,
                                     .ranks_on_host = c->ranks_on_host, .cores = c->cores,
                                     .bound = c->bound, .threads = threads,
                                     .blas_threads = moe_gemm_threads(), .link = &ctx->ep.link,
                                     .progress = ctx->schedule.progress};
    moe_watchdog_start(c, ctx->cfg.watchdog);
    if (ctx->ep.path->linked && ctx->ep.link.enabled && ctx->ep.link.cb_ratio > 0)
        rc = calibrate_link(ctx);
    if (!rc)
        choose_waves(ctx);
    if (rc) {
        moe_comm_print_error(c, &ctx->status);
        moe_context_close(ctx);
    }
    return rc;
}
