/* SPDX-License-Identifier: MIT */
/* run.c — `moe-ep run`: one EP forward per iteration, the report, the check.
 *
 * Phases, as HPCG runs them: set-up (parse, validate, agree), generation,
 * timed forwards (the wave pipeline, or the blocking reference path with
 * --blocking), pictures, validation against the dense truth and the blocking
 * path, the golden dump, the --waves curve, report. Every rank runs every
 * phase; only rank 0 prints.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe/clock.h"
#include "moe/check.h"
#include "moe/cli.h"
#include "moe/dump.h"
#include "moe/context.h"
#include "moe/ep.h"
#include "moe/gemm.h"
#include "moe/path.h"
#include "moe/quant.h"
#include "moe/report.h"
#include "moe/rng.h"
#include "moe/timeline.h"
#include "moe/truth.h"
#include "moe/wire.h"

static void print_usage(FILE *out)
{
    fprintf(out,
            "usage: mpirun -np G moe-ep run [--preset NAME] [flags]\n"
            "\n"
            "Runs the MoE layer with expert parallelism on G ranks (one rank plays one GPU):\n"
            "route, dispatch (MPI_Alltoallv), SwiGLU experts, combine, gate-weighted sum.\n"
            "Flags override the preset, whatever their order.\n"
            "\n");
    moe_config_print_flags(out, MOE_CMD_RUN);
    fprintf(out,
            "  --help                 this text\n"
            "\n"
            "Presets are searched in: %s\n"
            "Exit status: 0 ok, 1 check failed, 2 bad flag or config, 3 runtime error.\n",
            moe_config_data_path("presets"));
}

/* max |y - ref| over all ranks, and over the rms of ref. Collective. */
static void error_against(const moe_comm *c, const float *y, const double *ref, moe_index n,
                          double *max_abs, double *rel_rms)
{
    double local = 0.0;
    for (moe_index m = 0; m < n; m++)
        local = fmax(local, fabs((double)y[m] - ref[m]));
    const double rms = sqrt(moe_comm_sum(c, moe_sum_squares(ref, n)) / ((double)c->ranks * (double)n));
    *max_abs = moe_comm_max(c, local);
    *rel_rms = rms > 0 ? *max_abs / rms : 0.0;
}

/* The dense truth with the run's rounding and drops, then (with
 * --capacity-factor) the truth of every pair, for what the drops cost, and
 * (when the run emulates a lower precision) the fp32 truth, for what the
 * precision itself costs. Collective. */
static void check_against_truth(moe_run_context *ctx)
{
    const moe_comm *c = ctx->comm;
    const moe_config *cfg = &ctx->cfg;
    const float *x = ctx->x, *weights = ctx->weights, *y = ctx->y;
    const int32_t *ids = ctx->ids;
    moe_run_summary *s = &ctx->summary;
    const moe_index T = cfg->tokens, d = cfg->hidden, n = T * d, k = cfg->topk;
    double *truth = moe_xmalloc(sizeof(double) * (size_t)n); /* (T, d) */
    double *allow = moe_truth_rounds(cfg) ? moe_xmalloc(sizeof(double) * (size_t)n) : NULL;
    float *scratch = moe_xmalloc(sizeof(float) * (size_t)n);
    int32_t *kept = NULL;
    if (cfg->capacity_factor > 0) { /* the drops, decided again from the routing alone */
        kept = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k));
        moe_capacity_apply(cfg, ids, weights, T, kept);
    }
    const float *dispatched = moe_ep_dispatched_tokens(&ctx->ep, x, scratch);
    int32_t *pair_rank = NULL; /* with copies, the rank of each pair's copy: where it is summed */
    if (ctx->ep.replicas.physical) {
        pair_rank = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k));
        for (moe_index m = 0; m < T * k; m++)
            pair_rank[m] = ctx->placed[m] == MOE_DROPPED ? -1
                                                         : ctx->ep.placement.expert_rank[ctx->placed[m]];
    }
    moe_truth_collective(c, cfg, x, dispatched, kept ? kept : ids, weights, pair_rank, truth, allow);
    free(pair_rank);
    moe_check_collective(c, cfg, y, truth, allow, s);
    if (kept) {
        moe_truth_collective(c, cfg, x, dispatched, ids, weights, NULL, truth, NULL);
        error_against(c, y, truth, n, &s->drop_max_abs, &s->drop_max_rel_rms);
        s->drop_error_measured = true;
    }
    s->quantised = cfg->param_dtype != MOE_DTYPE_FP32 || cfg->dispatch_dtype != MOE_DTYPE_FP32 ||
                   moe_truth_rounds(cfg);
    if (s->quantised) {
        moe_config full = *cfg;
        full.param_dtype = full.dispatch_dtype = full.combine_dtype = full.output_dtype = MOE_DTYPE_FP32;
        full.gemm_out_dtype = full.act_dtype = MOE_DTYPE_FP32;
        moe_synth_tokens(cfg->seed, (uint64_t)c->rank * (uint64_t)T, T, d, (float)cfg->init_scale,
                         cfg->input_dist, scratch);
        moe_truth_collective(c, &full, scratch, scratch, kept ? kept : ids, weights, NULL, truth,
                             NULL);
        error_against(c, y, truth, n, &s->quant_max_abs, &s->quant_max_rel_rms);
    }
    free(kept);
    free(scratch);
    free(allow);
    free(truth);
}

/* One gradient tensor got (n) against its truth (n): the tolerance is
 * moe_tolerance_of_length (the forward's rule with `length`), over the
 * rms of the truth (of every rank's part when distributed, which makes
 * this collective; else of this rank's tensor alone). Folds the result into
 * check (maxima; moe_grad_checks_reduce takes them over ranks). */
static void grad_compare(const moe_comm *c, const float *got, const double *truth, moe_index n,
                         bool distributed, double length, moe_grad_check *check)
{
    double squares = moe_sum_squares(truth, n), count = (double)n;
    if (distributed) {
        squares = moe_comm_sum(c, squares);
        count = moe_comm_sum(c, count);
    }
    const double rms = count > 0 ? sqrt(squares / count) : 0.0;
    const moe_tolerance tol = moe_tolerance_of_length(length, rms);
    moe_compare_stats st;
    moe_compare(got, truth, NULL, n, tol, &st);
    check->checked = true;
    check->length = fmax(check->length, length); /* a tensor split by expert: its longest chain */
    check->rms = fmax(check->rms, rms);
    check->max_abs = fmax(check->max_abs, st.max_abs);
    check->max_used = fmax(check->max_used, st.max_used);
    check->nonfinite = check->nonfinite || st.first_nonfinite >= 0;
}

/* --backward --check: every gradient tensor against the fp64 truth
 * (truth.h). Each tolerance counts the fp32 accumulation lengths its values
 * went through, one rounding per step at most (as moe_tolerance_for): the
 * chains every backward value depends on (moe_truth_backward_length),
 * plus, for a weight gradient, the rows its wgrad
 * GEMM sums in fp32 (the expert's tokens; a shared expert's, the rank's T,
 * ranks then added in fp64). The gate's gradient is summed in fp64.
 * Collective. */
static void check_backward(moe_run_context *ctx)
{
    const moe_comm *c = ctx->comm;
    const moe_config *cfg = &ctx->cfg;
    const moe_ep *ep = &ctx->ep;
    moe_run_summary *s = &ctx->summary;
    const moe_ep_grads *g = &ctx->grads;
    const int G = c->ranks, k = (int)cfg->topk;
    const moe_index T = cfg->tokens, d = cfg->hidden, ff = cfg->ffn, E = cfg->experts;
    const moe_index S = cfg->shared_experts, N = (moe_index)G * T;
    const double base = moe_truth_backward_length(cfg);
    moe_grad_check *checks = s->grad_check;
    memset(checks, 0, sizeof(moe_grad_check) * MOE_GRAD_TENSORS);

    /* Every rank's tokens: each rank runs its own experts' backward on all
     * of them, which gives their dW whole and its share of every token's dx
     * and gate-weight gradients; each token's rank sums the shares in rank
     * order, then adds the router's and the shared experts' terms. */
    moe_layer_tokens all;
    moe_gather_layer_tokens(c, cfg, ctx->x, ctx->dy, ctx->ids, ctx->weights, &all);
    double *dx_share = moe_xcalloc((size_t)(N * d), sizeof(double));        /* (N, d) */
    double *dweights_share = moe_xcalloc((size_t)(N * k), sizeof(double));  /* (N, k) */
    double *dw1 = moe_xmalloc(sizeof(double) * (size_t)((S > 1 ? S : 1) * 2 * ff * d));
    double *dw2 = moe_xmalloc(sizeof(double) * (size_t)((S > 1 ? S : 1) * d * ff));
    for (int l = 0; l < ep->local_experts; l++) {
        const int e = ep->first_expert + l;
        const double rows = (double)moe_truth_backward_expert(
            cfg, MOE_TRUTH_BLAS, e, all.x, all.dy, all.ids, all.weights, N, dx_share,
            dweights_share, dw1, dw2);
        grad_compare(c, g->dw1 + l * 2 * ff * d, dw1, 2 * ff * d, false, base + rows,
                     &checks[MOE_GRAD_DW1]);
        grad_compare(c, g->dw2 + l * d * ff, dw2, d * ff, false, base + rows, &checks[MOE_GRAD_DW2]);
    }
    moe_layer_tokens_free(&all);
    double *dx = moe_xmalloc(sizeof(double) * (size_t)(T * d));
    double *dweights = moe_xmalloc(sizeof(double) * (size_t)(T * k) + 1);
    moe_comm_sum_scattered(c, dx_share, T * d, dx);
    moe_comm_sum_scattered(c, dweights_share, T * k, dweights);
    free(dweights_share);
    free(dx_share);
    double *dgate = moe_xmalloc(sizeof(double) * (size_t)(E * d));
    moe_truth_backward_rest(cfg, &ep->router, MOE_TRUTH_BLAS, ep->gate, ctx->x, ctx->ids,
                            ctx->logits, ctx->dy, T, dweights, dx, dgate, dw1, dw2);
    grad_compare(c, g->dx, dx, T * d, true, base, &checks[MOE_GRAD_DX]);
    moe_comm_sum_ordered(c, dgate, E * d);
    grad_compare(c, g->dgate, dgate, E * d, false, base, &checks[MOE_GRAD_GATE]);
    if (S > 0) {
        moe_comm_sum_ordered(c, dw1, S * 2 * ff * d);
        moe_comm_sum_ordered(c, dw2, S * d * ff);
        for (moe_index sh = 0; sh < S; sh++) {
            grad_compare(c, g->dshared_w1 + sh * 2 * ff * d, dw1 + sh * 2 * ff * d, 2 * ff * d,
                         false, base + (double)T, &checks[MOE_GRAD_SHARED_W1]);
            grad_compare(c, g->dshared_w2 + sh * d * ff, dw2 + sh * d * ff, d * ff, false,
                         base + (double)T, &checks[MOE_GRAD_SHARED_W2]);
        }
    }
    for (int t = 0; t < MOE_GRAD_TENSORS; t++) {
        moe_grad_check *check = &checks[t];
        check->checked = moe_comm_max(c, check->checked) > 0;
        check->length = moe_comm_max(c, check->length);
        check->rms = moe_comm_max(c, check->rms);
        check->max_abs = moe_comm_max(c, check->max_abs);
        check->max_used = moe_comm_max(c, check->max_used);
        check->nonfinite = moe_comm_max(c, check->nonfinite) > 0;
    }
    free(dgate);
    free(dweights);
    free(dx);
    free(dw2);
    free(dw1);
}

/* The wave pipeline against the blocking reference path on the same ranks:
 * bitwise expected unless blas GEMMs run on token-chunk waves. */
static int compare_with_reference(moe_run_context *ctx)
{
    const moe_ep *ep = &ctx->ep;
    const float *y = ctx->y;
    moe_run_summary *s = &ctx->summary;
    const moe_index n = ep->cfg->tokens * ep->cfg->hidden;
    float *y_ref = moe_xmalloc(sizeof(float) * (size_t)n); /* (T, d) */
    moe_forward_stats f;
    /* The two-stage dispatch reduces at the relay too: its own blocking run
     * sums in its order (ep_hier.c); the flat reference otherwise. */
    const bool two_stage_sums = ep->cfg->combine == MOE_COMBINE_REDUCED && ep->path->two_stage;
    s->ref_two_stage = two_stage_sums;
    const moe_path_args a = {.x = ctx->x, .ids = ctx->placed, .weights = ctx->weights, .y = y_ref,
                             .fwd = &f};
    int rc = two_stage_sums ? moe_path_run(ep->path->blocking, ep, &a, &ctx->status)
                            : moe_ep_forward_ref(ep, ctx->x, ctx->placed, ctx->weights, y_ref, &f,
                                                 NULL, &ctx->status);
    if (rc == MOE_EXIT_OK && !two_stage_sums)
        moe_ep_round_output(ep, y_ref);
    double differ = 0.0, max_diff = 0.0;
    for (moe_index m = 0; rc == MOE_EXIT_OK && m < n; m++)
        if (memcmp(&y[m], &y_ref[m], sizeof(float)) != 0) {
            differ += 1.0;
            double diff = fabs((double)y[m] - (double)y_ref[m]);
            max_diff = diff > max_diff || diff != diff ? diff : max_diff;
        }
    s->ref_compared = rc == MOE_EXIT_OK;
    s->ref_differ = moe_comm_sum(ctx->comm, differ);
    s->ref_max_diff = moe_comm_max(ctx->comm, max_diff);
    s->ref_bitwise_expected =
        ep->path->low_latency /* sums per pair at home, as --combine pairs */
            ? moe_gemm_rows_independent(ep->gemm)
            : moe_gemm_rows_independent(ep->gemm) || s->wave_kind == MOE_WAVES_EXPERT_SLOTS;
    free(y_ref);
    return rc;
}

/* --backward with its all-to-alls in flight against the blocking backward
 * on the same ranks: the same computations in the same order, bitwise,
 * unless blas GEMMs see each expert's rows in W > 1 batches (the gradients
 * are checked against the truth all the same). */
static int compare_backward_with_reference(moe_run_context *ctx)
{
    const moe_ep *ep = &ctx->ep;
    moe_run_summary *s = &ctx->summary;
    const moe_index n = ep->cfg->tokens * ep->cfg->hidden;
    float *y = moe_xmalloc(sizeof(float) * (size_t)n);
    moe_ep_grads ref;
    moe_ep_grads_init(ep, &ref);
    moe_forward_stats fwd;
    moe_backward_stats bwd;
    const int rc = moe_ep_backward_ref(ep, ctx->x, ctx->logits, ctx->ids, ctx->weights, ctx->dy,
                                       y, &ref, &fwd, &bwd, &ctx->status);
    double differ = 0.0;
    const float *got[MOE_EP_GRAD_TENSORS], *want[MOE_EP_GRAD_TENSORS];
    moe_index count[MOE_EP_GRAD_TENSORS];
    moe_ep_grads_tensors(ep, &ctx->grads, got, count);
    moe_ep_grads_tensors(ep, &ref, want, count);
    for (int t = 0; rc == MOE_EXIT_OK && t < MOE_EP_GRAD_TENSORS; t++)
        for (moe_index m = 0; m < count[t]; m++)
            differ += memcmp(&got[t][m], &want[t][m], sizeof(float)) != 0;
    s->bwd_ref_compared = rc == MOE_EXIT_OK;
    s->bwd_ref_bitwise_expected = moe_gemm_rows_independent(ep->gemm) || ctx->schedule.waves == 1;
    s->bwd_ref_differ = moe_comm_sum(ctx->comm, differ);
    moe_ep_grads_free(&ref);
    free(y);
    return rc;
}

/* --trace and --timeline: the last forward of the largest W of --waves
 * from every rank (panel 0) and beside it W = 1's, when the list has it
 * (panel 1), or with --compare-serial the same forward at W = 1, gathered
 * on rank 0 until they are written. */
typedef struct {
    moe_timeline_panel panels[2];
    int *offset[2];
    moe_event *events[2];
    char titles[2][160];
    int count;
    int shown;        /* the W of panel 0 */
    moe_run_summary s; /* its run's summary (the first panel's header) */
} pictures;

/* The last forward's trace, gathered into panel `slot`. Collective. */
static void gather_panel(moe_run_context *ctx, pictures *p, int slot)
{
    static const char *const progress_names[] = {"poll", "thread"};
    const moe_comm *c = ctx->comm;
    moe_comm_gather_events(c, ctx->trace.events, ctx->trace.count, &p->offset[slot], &p->events[slot]);
    char *title = p->titles[slot];
    if (ctx->ep.path->training)
        snprintf(title, sizeof p->titles[slot],
                 "a training step: the blocking forward, the backward in W = %d waves%s, "
                 "progress %s, %d ranks", ctx->schedule.waves,
                 moe_ep_backward_one_pass(&ctx->ep, &ctx->schedule)
                     ? " (their data gradients in one pass)" : "",
                 progress_names[ctx->schedule.progress], c->ranks);
    else
        snprintf(title, sizeof p->titles[slot], "%sW = %d, progress %s, %d ranks",
                 slot ? "for comparison, " : "", ctx->schedule.waves,
                 progress_names[ctx->schedule.progress], c->ranks);
    if (c->ranks_on_host > c->host_cores) { /* what shared cores do is no EP effect */
        const size_t at = strlen(title);
        if (c->ranks_on_host == c->ranks)
            snprintf(title + at, sizeof p->titles[slot] - at, " on %d cores: they take turns, "
                     "unlike GPUs", c->host_cores);
        else
            snprintf(title + at, sizeof p->titles[slot] - at, ", %d a host on %d cores: they "
                     "take turns, unlike GPUs", c->ranks_on_host, c->host_cores);
    }
    p->panels[slot] = (moe_timeline_panel){
        .title = title, .ranks = c->ranks, .offset = p->offset[slot], .events = p->events[slot]};
    p->count = slot + 1 > p->count ? slot + 1 : p->count;
    if (slot == 0) {
        p->shown = ctx->schedule.waves;
        p->s = ctx->summary;
    }
}

/* Panel 0 from the run just timed, then (--compare-serial, when the
 * --waves list has no W = 1 of its own for panel 1) the same forward at
 * W = 1. Collective. */
static int collect_pictures(moe_run_context *ctx, pictures *p, bool list_has_one)
{
    const moe_comm *c = ctx->comm;
    gather_panel(ctx, p, 0);
    if (!ctx->cfg.compare_serial || list_has_one)
        return MOE_EXIT_OK;
    moe_trace serial = {0};
    moe_schedule one_wave = ctx->schedule;
    one_wave.waves = 1;
    one_wave.trace = &serial;
    moe_forward_stats f;
    moe_comm_barrier(c);
    one_wave.origin = moe_clock_now();
    float *y = moe_xmalloc(sizeof(float) * (size_t)(ctx->cfg.tokens * ctx->cfg.hidden));
    moe_ep_grads g = {0}; /* a training step's: the same step, its backward in one wave */
    moe_backward_stats bwd;
    if (ctx->ep.path->training)
        moe_ep_grads_init(&ctx->ep, &g);
    const moe_path_args a = {.sched = &one_wave, .x = ctx->x, .logits = ctx->logits, .dy = ctx->dy,
                             .ids = ctx->placed, .weights = ctx->weights, .y = y, .grads = &g,
                             .fwd = &f, .bwd = &bwd};
    const int rc = moe_path_run(ctx->ep.path, &ctx->ep, &a, &ctx->status);
    moe_ep_grads_free(&g);
    free(y);
    if (rc == MOE_EXIT_OK) {
        moe_comm_gather_events(c, serial.events, serial.count, &p->offset[1], &p->events[1]);
        snprintf(p->titles[1], sizeof p->titles[1],
                 ctx->ep.path->training ? "the same step with the backward in W = 1 (its all-to-alls "
                                     "behind the shared experts and the weight gradients only)"
                                   : "the same forward at W = 1 (no overlap)");
        p->panels[1] = (moe_timeline_panel){
            .title = p->titles[1], .ranks = c->ranks, .offset = p->offset[1], .events = p->events[1]};
        p->count = 2;
    }
    moe_trace_free(&serial);
    return rc;
}

typedef struct {
    const pictures *pictures;
    const moe_timeline_panel *panels; /* the pictures' panels, the first with its summary */
    const moe_timeline_curve *curve;
    const moe_run_summary *summary;
} picture_files;

/* The first panel's second header line: the forward's time and overlap,
 * the speed-up against W = 1 when the --waves list has it, and the rows
 * that waves of expert slots send beyond one wave's (the dedup they lose). */
static void picture_summary(const moe_run_summary *s, char *text, size_t size)
{
    int at = snprintf(text, size, "layer %.2f ms (median) · overlap %.0f%%",
                      1e3 * s->layer_seconds,
                      100.0 * moe_overlap(s->pipeline_seconds, s->compute_seconds, s->comm_seconds));
    for (int n = 0; n < s->curve_count; n++)
        if (s->curve[n].waves == 1 && s->curve_count > 1 && s->layer_seconds > 0)
            at += snprintf(text + at, size - (size_t)at, " · %.2fx the speed of W = 1",
                           s->curve[n].layer_seconds / s->layer_seconds);
    const double extra = moe_report_wave_extra_rows(s);
    if (extra > 0)
        snprintf(text + at, size - (size_t)at,
                 " · %.0f rows more than one wave (+%.1f%%): the dedup expert-slot waves lose",
                 extra, 100.0 * extra / s->rows_one_wave);
}

static void write_trace(FILE *out, const void *arg)
{
    moe_write_chrome_trace(out, &((const picture_files *)arg)->panels[0]);
}

static void write_svg(FILE *out, const void *arg)
{
    const picture_files *files = arg;
    moe_write_timeline_svg(out, files->panels, files->pictures->count, files->curve);
}

static void write_html(FILE *out, const void *arg)
{
    const picture_files *files = arg;
    moe_report_write_html(out, files->summary, files->panels, files->pictures->count, files->curve);
}

/* The slow-rank finder on a panel's own forward (its every rank's comm
 * events, W waves; sends, the dispatch bytes rank to rank): the rank the
 * others waited for longest is drawn on red and named in the summary. */
static void mark_slow_rank(moe_timeline_panel *panel, int W, const double *sends, char *summary,
                           size_t size)
{
    const int G = panel->ranks;
    double *posted = moe_xmalloc(sizeof(double) * 2 * (size_t)W * (size_t)G);
    double *waits = moe_xmalloc(sizeof(double) * 2 * (size_t)G * (size_t)G);
    int *last = moe_xmalloc(sizeof(int) * (size_t)G);
    for (int r = 0; r < G; r++) {
        const moe_trace mine = {(moe_event *)panel->events + panel->offset[r],
                                panel->offset[r + 1] - panel->offset[r], 0};
        moe_trace_posts(&mine, W, posted + (size_t)r * 2 * W);
    }
    const int slow = moe_waits_analyze(G, W, 0, NULL, posted, sends, waits, last);
    if (slow >= 0 && G > 1) {
        double waited[2];
        moe_waits_slow(G, waits, waited, NULL);
        panel->has_slow = true;
        panel->slow_rank = slow;
        const size_t at = strlen(summary);
        snprintf(summary + at, size - at, "%sslow rank %d: the others waited %.2f ms for its rows",
                 at ? " · " : "", slow, 1e3 * waited[0]);
    }
    free(last);
    free(waits);
    free(posted);
}

/* Rank 0 writes the files (the curve under the timeline); all agree. */
static int write_pictures(const moe_comm *c, const moe_config *cfg, const pictures *p,
                          const moe_run_summary *s, moe_status *st)
{
    int waves[MOE_MAX_WAVE_RUNS];
    double measured[MOE_MAX_WAVE_RUNS], bound[MOE_MAX_WAVE_RUNS];
    for (int n = 0; n < s->curve_count; n++) {
        waves[n] = s->curve[n].waves;
        measured[n] = s->curve[n].pipeline_seconds;
        bound[n] = moe_curve_bound(&s->curve[n]);
    }
    const moe_timeline_curve curve = {s->curve_count, waves, measured, bound};
    moe_timeline_panel panels[2];
    memcpy(panels, p->panels, sizeof panels);
    char summary[320] = "";
    moe_run_summary shown = p->count ? p->s : *s; /* panel 0's run, with the whole curve */
    memcpy(shown.curve, s->curve, sizeof s->curve);
    shown.curve_count = s->curve_count;
    if (!s->path->training)
        picture_summary(&shown, summary, sizeof summary);
    if (c->rank == 0 && p->count && s->matrix && !s->path->training)
        mark_slow_rank(&panels[0], p->shown, s->matrix, summary, sizeof summary);
    panels[0].summary = summary;
    const picture_files files = {p, panels, &curve, s};
    moe_status local = {0};
    if (c->rank == 0) {
        if (cfg->trace[0])
            moe_write_file_atomic(cfg->trace, write_trace, &files, &local);
        if (cfg->timeline[0] && local.code == MOE_EXIT_OK)
            moe_write_file_atomic(cfg->timeline, write_svg, &files, &local);
        if (cfg->report[0] && local.code == MOE_EXIT_OK)
            moe_write_file_atomic(cfg->report, write_html, &files, &local);
    }
    if (moe_comm_agree(c, &local))
        *st = local;
    return local.code;
}

/* The routing and traffic of the last forward, in the arrays (owned by the
 * caller, allocated here) that the report points to. Collective. */
typedef struct {
    double *matrix;       /* (G, G) on rank 0 */
    double *wire;         /* (G, G) the two-stage dispatch's, as it crosses the links */
    double *nodes_hist;   /* (nodes + 1) */
    double *rank_seconds; /* (G) on rank 0 */
    double *per_expert;   /* (E) */
    double *rank_pairs;   /* (2, G) --redundant-experts: pairs per rank without and with copies */
    double *drops;        /* (E + 2G) --capacity-factor: pairs dropped per expert, then pairs
                             per rank routed and kept */
    double *posted;       /* (G, 2W) on rank 0: when each rank posted each all-to-all */
} traffic_detail;

/* The two-stage dispatch's bytes from rank to rank as they cross the
 * links: each token's row from its home to each other node's relay (the
 * rank of the home's local index there) over IB, from the relay to the
 * other ranks of that node holding its experts, and within the home's
 * node from the home (one row to itself where it holds one). Collective;
 * every rank's tokens summed. */
static double *two_stage_wire(const moe_run_context *ctx, const int32_t *ids, double row_bytes)
{
    const moe_comm *c = ctx->comm;
    const moe_placement *p = &ctx->ep.placement;
    const int G = c->ranks, R = ctx->ep.link.ranks_per_node, k = (int)ctx->cfg.topk, home = c->rank;
    double *wire = moe_xcalloc((size_t)G * (size_t)G, sizeof(double));
    bool *hit = moe_xmalloc(sizeof(bool) * (size_t)G);
    for (moe_index i = 0; i < ctx->cfg.tokens; i++) {
        memset(hit, 0, sizeof(bool) * (size_t)G);
        for (int s = 0; s < k; s++)
            if (ids[i * k + s] != MOE_DROPPED)
                hit[p->expert_rank[ids[i * k + s]]] = true;
        for (int node = 0; node < G / R; node++) {
            const int relay = node * R + home % R;
            bool reached = false;
            for (int r = node * R; r < (node + 1) * R; r++) {
                if (!hit[r])
                    continue;
                reached = true;
                const int from = node == home / R ? home : relay;
                if (from != r || from == home)
                    wire[(size_t)from * (size_t)G + (size_t)r] += row_bytes;
            }
            if (reached && node != home / R)
                wire[(size_t)home * (size_t)G + (size_t)relay] += row_bytes;
        }
    }
    free(hit);
    moe_comm_sum_array(c, wire, G * G);
    return wire;
}

/* min, mean and max of v (n > 0). */
static moe_spread spread_of(const double *v, int n)
{
    moe_spread s = {v[0], 0.0, v[0]};
    for (int i = 0; i < n; i++) {
        s.min = fmin(s.min, v[i]);
        s.max = fmax(s.max, v[i]);
        s.mean += v[i] / n;
    }
    return s;
}

/* --redundant-experts: pairs per rank with E/G logical experts a rank and
 * with the copies, and per physical expert, for the same routing. */
static void replica_detail(moe_run_context *ctx, traffic_detail *out)
{
    const moe_comm *c = ctx->comm;
    const moe_ep *ep = &ctx->ep;
    const moe_config *cfg = &ctx->cfg;
    moe_run_summary *s = &ctx->summary;
    const int G = c->ranks, P = ep->replicas.physical;
    const moe_index pairs = cfg->tokens * cfg->topk;
    moe_placement logical;
    moe_placement_init(&logical, (int)cfg->experts, G);
    double *per_physical = moe_xcalloc((size_t)P, sizeof(double));
    out->rank_pairs = moe_xcalloc(2 * (size_t)G, sizeof(double));
    for (moe_index n = 0; n < pairs; n++) {
        if (ctx->placed[n] == MOE_DROPPED) /* both counts: the pairs computed */
            continue;
        out->rank_pairs[logical.expert_rank[ctx->ids[n]]] += 1.0;
        out->rank_pairs[G + ep->placement.expert_rank[ctx->placed[n]]] += 1.0;
        per_physical[ctx->placed[n]] += 1.0;
    }
    moe_comm_sum_array(c, out->rank_pairs, 2 * G);
    moe_comm_sum_array(c, per_physical, P);
    s->tokens_per_physical = spread_of(per_physical, P);
    s->replicas = &ep->replicas;
    s->expert_load = ctx->expert_load;
    s->rank_pairs[0] = out->rank_pairs;
    s->rank_pairs[1] = out->rank_pairs + G;
    s->expert_bytes = 4.0 * 3.0 * (double)cfg->hidden * (double)cfg->ffn;
    free(per_physical);
    moe_placement_free(&logical);
}

/* --capacity-factor: the pairs dropped per logical expert, the pairs per
 * rank routed and kept, and the dispatch rows (as this forward sends them:
 * waves, a row per pair with --mode low-latency, both hops of the two-stage
 * dispatch) without the drops. */
static void drop_detail(moe_run_context *ctx, const moe_waves *waves, traffic_detail *out)
{
    const moe_comm *c = ctx->comm;
    const moe_ep *ep = &ctx->ep;
    const moe_config *cfg = &ctx->cfg;
    moe_run_summary *s = &ctx->summary;
    const int G = c->ranks, E = (int)cfg->experts, k = (int)cfg->topk;
    const moe_index T = cfg->tokens;
    int32_t *every = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k)); /* the pairs undropped */
    moe_ep_place(ep, ctx->ids, NULL, every);
    double *dropped = out->drops = moe_xcalloc((size_t)(E + 2 * G), sizeof(double));
    double *routed = dropped + E, *kept = routed + G;
    for (moe_index n = 0; n < T * k; n++) {
        if (every[n] == MOE_DROPPED) /* masked in --routing: never routed */
            continue;
        routed[ep->placement.expert_rank[every[n]]] += 1.0;
        if (ctx->placed[n] == MOE_DROPPED)
            dropped[ctx->ids[n]] += 1.0;
        else
            kept[ep->placement.expert_rank[ctx->placed[n]]] += 1.0;
    }
    double *rows = moe_xmalloc(sizeof(double) * (size_t)G), undropped = (double)(T * k);
    if (!ep->path->low_latency) {
        moe_rows_per_destination(&ep->placement, every, T, k, waves, rows);
        undropped = 0.0;
        for (int r = 0; r < G; r++)
            undropped += rows[r];
    }
    if (ep->path->two_stage) { /* its first hop's rows too, one per (token, node), as rows_sent counts */
        moe_placement by_node;
        moe_placement_by_node(&ep->placement, ep->link.ranks_per_node, &by_node);
        moe_rows_per_destination(&by_node, every, T, k, NULL, rows);
        for (int n = 0; n < by_node.ranks; n++)
            undropped += rows[n];
        moe_placement_free(&by_node);
    }
    moe_comm_sum_array(c, dropped, E + 2 * G);
    s->rows_undropped = moe_comm_sum(c, undropped);
    s->capacity = moe_expert_capacity(cfg->capacity_factor, T, k, E);
    s->pairs_dropped = 0.0;
    for (int e = 0; e < E; e++)
        s->pairs_dropped += dropped[e];
    s->expert_dropped = dropped;
    s->rank_pairs_routed = routed;
    s->rank_pairs_kept = kept;
    free(rows);
    free(every);
}

static void routing_detail(moe_run_context *ctx, traffic_detail *out)
{
    const moe_comm *c = ctx->comm;
    const moe_ep *ep = &ctx->ep;
    const moe_config *cfg = &ctx->cfg;
    const int32_t *ids = ctx->placed; /* the physical experts: where the rows go */
    moe_run_summary *s = &ctx->summary;
    const int G = c->ranks, E = (int)cfg->experts, k = (int)cfg->topk;
    const moe_index T = cfg->tokens;
    const int R = ep->link.ranks_per_node, nodes = (G + R - 1) / R;
    const double row_bytes = moe_dispatch_row_bytes(cfg);

    double *rows = moe_xmalloc(sizeof(double) * (size_t)G);
    const moe_path *path = ep->path;
    moe_waves waves;
    if (!path->reference_run)
        moe_waves_init_by(&waves, &ep->placement, ctx->schedule.waves, T, moe_ep_wave_by(ep, &ctx->schedule));
    moe_rows_per_destination(&ep->placement, ids, T, k, NULL, rows); /* one wave */
    s->rows_one_wave = 0.0;
    for (int r = 0; r < G; r++)
        s->rows_one_wave += rows[r];
    s->rows_one_wave = moe_comm_sum(c, s->rows_one_wave);
    if (path->low_latency) { /* a row per pair, with its own meta */
        memset(rows, 0, sizeof(double) * (size_t)G);
        for (moe_index n = 0; n < T * k; n++)
            if (ids[n] != MOE_DROPPED)
                rows[ep->placement.expert_rank[ids[n]]] += 1.0;
    } else {
        moe_rows_per_destination(&ep->placement, ids, T, k, path->reference_run ? NULL : &waves, rows);
    }
    if (cfg->capacity_factor > 0)
        drop_detail(ctx, path->reference_run ? NULL : &waves, out);
    if (!path->reference_run)
        moe_waves_free(&waves);
    const double ll_row = moe_ll_row_bytes(cfg);
    for (int r = 0; r < G; r++)
        rows[r] *= path->low_latency ? ll_row : row_bytes;
    out->matrix = c->rank == 0 ? moe_xmalloc(sizeof(double) * (size_t)G * (size_t)G) : NULL;
    moe_comm_gather_doubles(c, rows, G, out->matrix);
    free(rows);
    out->wire = path->two_stage ? two_stage_wire(ctx, ids, row_bytes) : NULL;

    s->node_rows = (moe_node_rows){0};
    moe_node_copies(&ep->placement, ids, T, k, R, c->rank, &s->node_rows);
    moe_comm_sum_array(c, &s->node_rows.flat_inter, 4);
    out->nodes_hist = moe_xcalloc((size_t)nodes + 1, sizeof(double));
    moe_nodes_per_token(&ep->placement, ids, T, k, R, out->nodes_hist);
    moe_comm_sum_array(c, out->nodes_hist, nodes + 1);

    double *per_expert = moe_xcalloc((size_t)E, sizeof(double));
    for (moe_index n = 0; n < T * k; n++)
        if (ctx->ids[n] != MOE_DROPPED) /* a masked pair of --routing */
            per_expert[ctx->ids[n]] += 1.0; /* per logical expert */
    moe_comm_sum_array(c, per_expert, E);
    s->tokens_per_expert = spread_of(per_expert, E);
    out->per_expert = per_expert;

    out->rank_seconds = c->rank == 0 ? moe_xmalloc(sizeof(double) * (size_t)G) : NULL;
    moe_comm_gather_doubles(c, &ctx->last_expert_seconds, 1, out->rank_seconds);
    /* The slow-rank finder: when each rank posted each wave's all-to-alls
     * and reached each agreement of the last forward, from its start. */
    const int W = ctx->last.waves > 0 ? ctx->last.waves : 1;
    double arrived[MOE_ARRIVALS_MAX];
    const char *stage[MOE_ARRIVALS_MAX];
    const int A = moe_ep_arrivals(ep, arrived, stage);
    double *mine = moe_xmalloc(sizeof(double) * (size_t)(2 * W + A));
    moe_trace_posts(&ctx->trace, W, mine);
    for (int n = 0; n < A; n++) {
        mine[2 * W + n] = arrived[n] - ctx->schedule.origin;
        s->posted_side[n] = !strcmp(stage[n], "experts") || !strcmp(stage[n], "combine");
    }
    out->posted = c->rank == 0 ? moe_xmalloc(sizeof(double) * (size_t)(2 * W + A) * (size_t)G) : NULL;
    moe_comm_gather_doubles(c, mine, 2 * W + A, out->posted);
    free(mine);
    s->posted = out->posted;
    s->posted_waves = W;
    s->posted_agreements = A;
    s->ranks_per_node = R;
    s->nodes = nodes;
    s->matrix = out->matrix;
    s->wire = out->wire;
    s->nodes_hist = out->nodes_hist;
    s->rank_expert_seconds = out->rank_seconds;
    s->tokens_expert = out->per_expert;
    if (ep->replicas.physical)
        replica_detail(ctx, out);
}

int moe_cli_run(moe_comm *c, int argc, char **argv)
{
    if (moe_cli_help(c, argc, argv, print_usage))
        return MOE_EXIT_OK;
    moe_run_context ctx;
    int rc = moe_context_open(&ctx, c, MOE_CMD_RUN, argc, argv);
    if (rc)
        return rc;
    const moe_config *cfg = &ctx.cfg;
    const moe_path *path = ctx.ep.path;
    moe_run_summary *s = &ctx.summary;

    if (cfg->steps > 1 || cfg->bias_update > 0)
        rc = moe_run_steps(&ctx);
    if (rc == MOE_EXIT_OK && cfg->bias_update > 0 && cfg->redundant_experts > 0 && !cfg->expert_load[0])
        moe_context_replace_replicas(&ctx);
    /* The first wave count: report, pictures, check. */
    if (rc == MOE_EXIT_OK)
        rc = moe_context_timed_forwards(&ctx, (int)cfg->iters);
    if (rc == MOE_EXIT_OK)
        moe_context_time_alltoalls(&ctx, (int)cfg->iters);
    traffic_detail detail = {0};
    if (rc == MOE_EXIT_OK)
        routing_detail(&ctx, &detail);
    pictures pics = {.count = 0};
    /* the report draws the timeline where the forward records one */
    const bool drawing = cfg->trace[0] || cfg->timeline[0] ||
                         (cfg->report[0] && path->pipelined);
    /* The pictures show the largest W of --waves, and its W = 1 beside it. */
    const bool waves = path->pipelined && !path->training;
    int largest = 0, one = -1;
    for (int n = 1; waves && n < cfg->waves_count; n++)
        largest = cfg->waves_list[n] > cfg->waves_list[largest] ? n : largest;
    for (int n = 0; waves && n < cfg->waves_count; n++)
        one = cfg->waves_list[n] == 1 && n != largest && one < 0 ? n : one;
    if (rc == MOE_EXIT_OK && drawing && largest == 0)
        rc = collect_pictures(&ctx, &pics, one >= 0);
    if (rc == MOE_EXIT_OK && drawing && one == 0)
        gather_panel(&ctx, &pics, 1);
    if (rc == MOE_EXIT_OK && cfg->check) {
        check_against_truth(&ctx);
        if (path->training)
            check_backward(&ctx);
        if (!path->reference_run)
            rc = compare_with_reference(&ctx);
        if (rc == MOE_EXIT_OK && path->training && !path->reference_run)
            rc = compare_backward_with_reference(&ctx);
    }
    if (rc == MOE_EXIT_OK && cfg->dump[0]) {
        const double t = moe_clock_now();
        const moe_dump_steps steps = {(int)cfg->steps, ctx.steps_bias, ctx.steps_load};
        rc = moe_dump_write(c, &ctx.ep, cfg->dump, ctx.x, ctx.dy, ctx.steps_bias ? &steps : NULL,
                            &s->dump_bytes, &ctx.status);
        s->dump_seconds = moe_stage_since(t);
    }
    /* The curve: every further wave count of --waves W1,W2,...; the report
     * stays that of the first. */
    const moe_run_summary first_summary = *s;
    const moe_schedule first_schedule = ctx.schedule;
    moe_curve_point curve[MOE_MAX_WAVE_RUNS];
    int points = 0;
    for (int n = 0; rc == MOE_EXIT_OK && waves && n < cfg->waves_count; n++) {
        if (n > 0) {
            ctx.schedule.waves = (int)cfg->waves_list[n];
            rc = moe_context_timed_forwards(&ctx, (int)cfg->iters);
            if (rc)
                break;
            moe_context_time_alltoalls(&ctx, (int)cfg->iters);
            if (drawing && n == largest)
                rc = collect_pictures(&ctx, &pics, one >= 0);
            if (drawing && n == one)
                gather_panel(&ctx, &pics, 1);
        }
        curve[points++] = (moe_curve_point){(int)cfg->waves_list[n], s->layer_seconds,
                                            s->pipeline_seconds, s->compute_seconds,
                                            s->comm_seconds, s->fill_seconds, s->wave_kind,
                                            s->rows_sent};
    }
    *s = first_summary;
    ctx.schedule = first_schedule;
    memcpy(s->curve, curve, sizeof(moe_curve_point) * (size_t)points);
    s->curve_count = points;
    if (rc == MOE_EXIT_OK && (drawing || cfg->report[0]))
        rc = write_pictures(c, cfg, &pics, s, &ctx.status);

    if (rc == MOE_EXIT_OK) {
        s->rss_peak = moe_comm_max(c, moe_peak_rss());
        s->memory_estimate = moe_config_memory_per_rank(cfg, MOE_CMD_RUN, c->ranks);
        if (c->rank == 0) {
            moe_report_print(stdout, s);
            fflush(stdout);
        }
        if (cfg->check && !moe_report_check_passed(s))
            rc = MOE_EXIT_CHECK_FAILED;
    } else {
        moe_comm_print_error(c, &ctx.status);
    }

    for (int p = 0; p < 2; p++) {
        free(pics.offset[p]);
        free(pics.events[p]);
    }
    free(detail.matrix);
    free(detail.wire);
    free(detail.nodes_hist);
    free(detail.rank_seconds);
    free(detail.per_expert);
    free(detail.rank_pairs);
    free(detail.drops);
    free(detail.posted);
    moe_context_close(&ctx);
    return rc;
}
