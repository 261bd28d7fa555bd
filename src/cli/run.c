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
#include <unistd.h>

#include "moe/check.h"
#include "moe/cli.h"
#include "moe/ep.h"
#include "moe/gemm.h"
#include "moe/progress.h"
#include "moe/quant.h"
#include "moe/report.h"
#include "moe/rng.h"
#include "moe/timeline.h"
#include "moe/truth.h"
#include "run.h"

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

int moe_run_set_up(const moe_comm *c, moe_config *cfg, enum moe_command command, int argc,
                   char **argv, moe_status *st)
{
    moe_config_defaults(cfg);
    if (command == MOE_CMD_BENCH) { /* bench sweeps W unless told otherwise */
        static const int64_t sweep[] = {1, 2, 4, 8};
        memcpy(cfg->waves_list, sweep, sizeof sweep);
        cfg->waves_count = 4;
        cfg->iters = 5;
    }
    if (moe_config_parse(cfg, command, argc, argv, st) == MOE_EXIT_OK &&
        moe_config_validate(cfg, c->ranks, st) == MOE_EXIT_OK) {
        if (c->rank == 0 && cfg->trace[0])
            moe_check_output_path("--trace", cfg->trace, st);
        if (c->rank == 0 && cfg->timeline[0] && st->code == MOE_EXIT_OK)
            moe_check_output_path("--timeline", cfg->timeline, st);
        if (c->rank == 0 && cfg->dump[0] && st->code == MOE_EXIT_OK)
            moe_check_output_dir("--dump", cfg->dump, st);
        if (c->rank == 0 && cfg->csv[0] && st->code == MOE_EXIT_OK)
            moe_check_output_path("--csv", cfg->csv, st);
        if (c->rank == 0 && cfg->plot[0] && st->code == MOE_EXIT_OK)
            moe_check_output_path("--plot", cfg->plot, st);
        if (command == MOE_CMD_BENCH && cfg->blocking && st->code == MOE_EXIT_OK)
            moe_fail(st, MOE_EXIT_USAGE, "moe-ep bench sweeps the wave pipeline; drop --blocking");
        if (cfg->compare_serial && !cfg->timeline[0] && st->code == MOE_EXIT_OK)
            moe_fail(st, MOE_EXIT_USAGE, "--compare-serial needs --timeline FILE.svg");
        if (cfg->blocking && (cfg->trace[0] || cfg->timeline[0]) && st->code == MOE_EXIT_OK)
            moe_fail(st, MOE_EXIT_USAGE,
                     "--trace and --timeline show the wave pipeline; drop --blocking");
    }
    if (st->code == MOE_EXIT_OK && cfg->progress == MOE_PROGRESS_THREAD &&
        moe_progress_thread_level < MPI_THREAD_SERIALIZED) {
        if (c->rank == 0)
            fprintf(stderr, "moe-ep: note: --progress thread needs MPI_THREAD_SERIALIZED, which this "
                            "MPI library does not grant; polling instead\n");
        cfg->progress = MOE_PROGRESS_POLL;
    }
    if (st->code == MOE_EXIT_OK) {
        const double need = moe_config_memory_per_rank(cfg, c->ranks);
        const double have = moe_memory_available() / c->ranks_on_host;
        if (need > have) {
            char b1[32], b2[32];
            moe_fail(st, MOE_EXIT_USAGE,
                     "this config needs about %s per rank, but %s is available per rank "
                     "(%d ranks on this host); lower --tokens, --hidden, --ffn or --experts",
                     moe_format_bytes(need, b1, sizeof b1), moe_format_bytes(have, b2, sizeof b2),
                     c->ranks_on_host);
        }
    }
    return moe_comm_agree(c, st);
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double moe_run_median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, compare_doubles);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
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
    s->rows_sent = moe_comm_sum(c, (double)f->rows_sent);
    s->rows_sent_remote = moe_comm_sum(c, (double)f->rows_sent_remote);
    s->pairs_back_remote = moe_comm_sum(c, (double)f->pairs_back_remote);
    s->bytes_dispatched = moe_comm_sum(c, f->bytes_dispatched);
    s->bytes_combined = moe_comm_sum(c, f->bytes_combined);
    s->expert_flops = moe_comm_sum(c, f->expert_flops);
    s->local_experts_min = (int)moe_comm_min(c, ep->local_experts);
    s->local_experts_max = (int)moe_comm_max(c, ep->local_experts);
}

/* Per iteration, each rank's figures; reduced with max over ranks. The
 * expert window is max(end) - min(start): -start goes in as COL_WINDOW. */
enum {
    COL_LAYER = MOE_STAGES, COL_EXPERTS, COL_WINDOW, COL_PIPELINE, COL_COMPUTE, COL_COMM,
    COL_TEST, COL_EXPERT_END, COLS
};

static void iteration_row(const moe_forward_stats *f, double layer, double *row)
{
    memcpy(row, f->seconds, sizeof f->seconds);
    row[COL_LAYER] = layer;
    row[COL_EXPERTS] = f->seconds[MOE_STAGE_EXPERTS];
    row[COL_WINDOW] = -f->expert_start;
    row[COL_PIPELINE] = f->pipeline_seconds;
    row[COL_COMPUTE] = f->compute_seconds;
    row[COL_COMM] = f->comm_seconds;
    row[COL_TEST] = f->test_seconds;
    row[COL_EXPERT_END] = f->expert_end;
}

/* Medians over iterations of the per-iteration maxima. */
static void summarize_times(double *per_iter, int iters, moe_run_summary *s)
{
    double column[iters], m[COLS];
    for (int n = 0; n < COLS; n++) {
        for (int it = 0; it < iters; it++)
            column[it] = per_iter[(size_t)it * COLS + n];
        m[n] = moe_run_median(column, iters);
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
    s->comm_seconds = m[COL_COMM];
    s->test_seconds = m[COL_TEST];
}

static int forward(const moe_ep *ep, const float *x, const int32_t *ids, const float *weights,
                   float *y, moe_forward_stats *f, moe_trace *trace, double origin, moe_status *st)
{
    if (!ep->cfg->blocking)
        return moe_ep_forward_waves(ep, x, ids, weights, y, f, trace, origin, st);
    return moe_ep_forward_ref(ep, x, ids, weights, y, f, NULL, st);
}

/* The dense truth with the run's rounding, then (when the run emulates a
 * lower precision) the fp32 truth, for what the precision itself costs.
 * Collective. */
static void check_against_truth(const moe_comm *c, const moe_ep *ep, const float *x,
                                const int32_t *ids, const float *weights, const float *y,
                                moe_run_summary *s)
{
    const moe_config *cfg = ep->cfg;
    const moe_index T = cfg->tokens, d = cfg->hidden, n = T * d;
    double *truth = moe_xmalloc(sizeof(double) * (size_t)n); /* (T, d) */
    double *allow = cfg->combine_dtype == MOE_DTYPE_FP32 ? NULL : moe_xmalloc(sizeof(double) * (size_t)n);
    float *scratch = moe_xmalloc(sizeof(float) * (size_t)n);
    moe_truth_forward(cfg, MOE_TRUTH_BLAS, x, moe_ep_dispatched_tokens(ep, x, scratch), ids,
                      weights, T, truth, allow);
    moe_check_collective(c, cfg, y, truth, allow, s);
    s->quantised = cfg->param_dtype != MOE_DTYPE_FP32 || cfg->dispatch_dtype != MOE_DTYPE_FP32 ||
                   cfg->combine_dtype != MOE_DTYPE_FP32;
    if (s->quantised) {
        moe_config full = *cfg;
        full.param_dtype = full.dispatch_dtype = full.combine_dtype = MOE_DTYPE_FP32;
        moe_synth_tokens(cfg->seed, (uint64_t)c->rank * (uint64_t)T, T, d, (float)cfg->init_scale, scratch);
        moe_truth_forward(&full, MOE_TRUTH_BLAS, scratch, scratch, ids, weights, T, truth, NULL);
        double max_abs = 0.0;
        for (moe_index m = 0; m < n; m++)
            max_abs = fmax(max_abs, fabs((double)y[m] - truth[m]));
        const double rms = sqrt(moe_comm_sum(c, moe_sum_squares(truth, n)) /
                                ((double)c->ranks * (double)n));
        s->quant_max_abs = moe_comm_max(c, max_abs);
        s->quant_max_rel_rms = rms > 0 ? s->quant_max_abs / rms : 0.0;
    }
    free(scratch);
    free(allow);
    free(truth);
}

/* The wave pipeline against the blocking reference path on the same ranks:
 * bitwise expected unless blas GEMMs run on token-chunk waves. */
static int compare_with_reference(const moe_comm *c, const moe_ep *ep, const float *x,
                                  const int32_t *ids, const float *weights, const float *y,
                                  moe_run_summary *s, moe_status *st)
{
    const moe_index n = ep->cfg->tokens * ep->cfg->hidden;
    float *y_ref = moe_xmalloc(sizeof(float) * (size_t)n); /* (T, d) */
    moe_forward_stats f;
    int rc = moe_ep_forward_ref(ep, x, ids, weights, y_ref, &f, NULL, st);
    double differ = 0.0, max_diff = 0.0;
    for (moe_index m = 0; rc == MOE_EXIT_OK && m < n; m++)
        if (memcmp(&y[m], &y_ref[m], sizeof(float)) != 0) {
            differ += 1.0;
            double diff = fabs((double)y[m] - (double)y_ref[m]);
            max_diff = diff > max_diff || diff != diff ? diff : max_diff;
        }
    s->ref_compared = rc == MOE_EXIT_OK;
    s->ref_differ = moe_comm_sum(c, differ);
    s->ref_max_diff = moe_comm_max(c, max_diff);
    s->ref_bitwise_expected =
        moe_gemm_rows_independent(ep->gemm) || s->wave_kind == MOE_WAVES_EXPERT_SLOTS;
    free(y_ref);
    return rc;
}

/* --trace and --timeline: the first wave count's last forward from every
 * rank and, with --compare-serial, the same forward at W = 1, gathered on
 * rank 0 until they are written. */
typedef struct {
    moe_timeline_panel panels[2];
    int *offset[2];
    moe_event *events[2];
    char titles[2][160];
    int count;
} pictures;

static int collect_pictures(const moe_comm *c, const moe_ep *ep, moe_config *cfg, const float *x,
                            const int32_t *ids, const float *weights, const moe_trace *trace,
                            pictures *p, moe_status *st)
{
    static const char *const progress_names[] = {"poll", "thread"};
    moe_comm_gather_events(c, trace->events, trace->count, &p->offset[0], &p->events[0]);
    snprintf(p->titles[0], sizeof p->titles[0], "W = %lld, progress %s, %d ranks",
             (long long)cfg->waves, progress_names[cfg->progress], c->ranks);
    p->panels[p->count++] = (moe_timeline_panel){p->titles[0], c->ranks, p->offset[0], p->events[0]};
    if (!cfg->compare_serial)
        return MOE_EXIT_OK;
    const int64_t waves = cfg->waves;
    moe_trace serial = {0};
    moe_forward_stats f;
    cfg->waves = 1;
    moe_comm_barrier(c);
    float *y = moe_xmalloc(sizeof(float) * (size_t)(cfg->tokens * cfg->hidden));
    int rc = moe_ep_forward_waves(ep, x, ids, weights, y, &f, &serial, moe_comm_time(), st);
    free(y);
    cfg->waves = waves;
    if (rc == MOE_EXIT_OK) {
        moe_comm_gather_events(c, serial.events, serial.count, &p->offset[1], &p->events[1]);
        snprintf(p->titles[1], sizeof p->titles[1], "the same forward at W = 1 (no overlap)");
        p->panels[p->count++] = (moe_timeline_panel){p->titles[1], c->ranks, p->offset[1], p->events[1]};
    }
    moe_trace_free(&serial);
    return rc;
}

typedef struct {
    const pictures *pictures;
    const moe_timeline_curve *curve;
} picture_files;

static void write_trace(FILE *out, const void *arg)
{
    moe_write_chrome_trace(out, &((const picture_files *)arg)->pictures->panels[0]);
}

static void write_svg(FILE *out, const void *arg)
{
    const picture_files *files = arg;
    moe_write_timeline_svg(out, files->pictures->panels, files->pictures->count, files->curve);
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
    const picture_files files = {p, &curve};
    moe_status local = {0};
    if (c->rank == 0) {
        if (cfg->trace[0])
            moe_write_file_atomic(cfg->trace, write_trace, &files, &local);
        if (cfg->timeline[0] && local.code == MOE_EXIT_OK)
            moe_write_file_atomic(cfg->timeline, write_svg, &files, &local);
    }
    if (moe_comm_agree(c, &local))
        *st = local;
    return local.code;
}

/* The routing and traffic of the last forward, in the arrays (owned by the
 * caller, allocated here) that the report points to. Collective. */
typedef struct {
    double *matrix;       /* (G, G) on rank 0 */
    double *nodes_hist;   /* (nodes + 1) */
    double *rank_seconds; /* (G) on rank 0 */
} traffic_detail;

static void routing_detail(const moe_comm *c, const moe_ep *ep, const int32_t *ids,
                           double expert_seconds, moe_run_summary *s, traffic_detail *out)
{
    const moe_config *cfg = ep->cfg;
    const int G = c->ranks, E = (int)cfg->experts, k = (int)cfg->topk;
    const moe_index T = cfg->tokens;
    const int R = ep->link.ranks_per_node, nodes = (G + R - 1) / R;
    const double row_bytes = (double)(cfg->hidden * 4 + MOE_META_WORDS(k) * 4);

    double *rows = moe_xmalloc(sizeof(double) * (size_t)G);
    moe_waves waves;
    if (!cfg->blocking)
        moe_waves_init(&waves, &ep->placement, (int)cfg->waves, T);
    moe_rows_per_destination(&ep->placement, ids, T, k, cfg->blocking ? NULL : &waves, rows);
    if (!cfg->blocking)
        moe_waves_free(&waves);
    for (int r = 0; r < G; r++)
        rows[r] *= row_bytes;
    out->matrix = c->rank == 0 ? moe_xmalloc(sizeof(double) * (size_t)G * (size_t)G) : NULL;
    moe_comm_gather_doubles(c, rows, G, out->matrix);
    free(rows);

    out->nodes_hist = moe_xcalloc((size_t)nodes + 1, sizeof(double));
    moe_nodes_per_token(&ep->placement, ids, T, k, R, out->nodes_hist);
    moe_comm_sum_array(c, out->nodes_hist, nodes + 1);

    double *per_expert = moe_xcalloc((size_t)E, sizeof(double));
    for (moe_index n = 0; n < T * k; n++)
        per_expert[ids[n]] += 1.0;
    moe_comm_sum_array(c, per_expert, E);
    s->tokens_per_expert = (moe_spread){per_expert[0], 0.0, per_expert[0]};
    for (int e = 0; e < E; e++) {
        s->tokens_per_expert.min = per_expert[e] < s->tokens_per_expert.min ? per_expert[e] : s->tokens_per_expert.min;
        s->tokens_per_expert.max = per_expert[e] > s->tokens_per_expert.max ? per_expert[e] : s->tokens_per_expert.max;
        s->tokens_per_expert.mean += per_expert[e] / E;
    }
    free(per_expert);

    out->rank_seconds = c->rank == 0 ? moe_xmalloc(sizeof(double) * (size_t)G) : NULL;
    moe_comm_gather_doubles(c, &expert_seconds, 1, out->rank_seconds);
    s->ranks_per_node = R;
    s->nodes = nodes;
    s->matrix = out->matrix;
    s->nodes_hist = out->nodes_hist;
    s->rank_expert_seconds = out->rank_seconds;
}

void moe_run_buffers_init(run_buffers *b, const moe_config *cfg)
{
    const moe_index T = cfg->tokens, d = cfg->hidden, E = cfg->experts, k = cfg->topk;
    memset(b, 0, sizeof *b);
    b->x = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    b->logits = moe_xmalloc(sizeof(float) * (size_t)(T * E));
    b->scores = moe_xmalloc(sizeof(float) * (size_t)(T * E));
    b->ids = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k));
    b->weights = moe_xmalloc(sizeof(float) * (size_t)(T * k));
    b->y = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    b->per_iter = moe_xmalloc(sizeof(double) * (size_t)(cfg->iters * COLS));
}

void moe_run_buffers_free(run_buffers *b)
{
    moe_trace_free(&b->trace);
    free(b->per_iter);
    free(b->y);
    free(b->weights);
    free(b->ids);
    free(b->scores);
    free(b->logits);
    free(b->x);
}

int moe_run_timed_forwards(const moe_comm *c, const moe_ep *ep, run_buffers *b,
                           moe_run_summary *s, moe_status *st)
{
    const moe_config *cfg = ep->cfg;
    const moe_index n = cfg->tokens * cfg->hidden;
    const int iters = (int)cfg->iters;
    const bool progress = c->rank == 0 && iters > 1 && isatty(STDERR_FILENO);
    moe_forward_stats f;
    bool identical = true;
    int rc = MOE_EXIT_OK;
    for (int it = 0; it < iters && rc == MOE_EXIT_OK; it++) {
        moe_trace_clear(&b->trace);
        moe_comm_barrier(c);
        const double origin = moe_comm_time();
        moe_ep_route(ep, b->x, b->logits, b->scores, b->ids, b->weights);
        const double route = moe_comm_time() - origin;
        rc = forward(ep, b->x, b->ids, b->weights, b->y, &f, &b->trace, origin, st);
        /* to y complete: the wave path's pass that times its all-to-alls
         * alone comes after, and is not the layer's */
        const double layer = f.done - origin;
        f.seconds[MOE_STAGE_ROUTE] = route;
        double *row = b->per_iter + (size_t)it * COLS;
        iteration_row(&f, layer, row);
        moe_comm_max_array(c, row, COLS);
        row[COL_WINDOW] += row[COL_EXPERT_END];
        const uint64_t digest = moe_digest64(b->y, sizeof(float) * (size_t)n);
        if (it == 0)
            b->y_digest = digest;
        else if (digest != b->y_digest)
            identical = false;
        if (progress)
            fprintf(stderr, "\rmoe-ep: W=%lld forward %d/%d", (long long)cfg->waves, it + 1, iters);
    }
    if (progress)
        fprintf(stderr, "\r\033[K");
    if (rc)
        return rc;
    summarize_times(b->per_iter, iters, s);
    summarize_traffic(c, ep, &f, s);
    b->last_expert_seconds = f.seconds[MOE_STAGE_EXPERTS];
    s->waves = f.waves;
    s->wave_kind = f.wave_kind;
    s->iterations_identical = moe_comm_min(c, identical ? 1.0 : 0.0) > 0.0;
    return MOE_EXIT_OK;
}

/* C is measured by one untimed forward without the link model (summed FLOPs
 * over summed compute seconds of all ranks). Collective. */
int moe_run_calibrate_link(const moe_comm *c, moe_ep *ep, run_buffers *b, moe_run_summary *s,
                           moe_status *st)
{
    moe_forward_stats f;
    ep->link.enabled = false;
    moe_ep_route(ep, b->x, b->logits, b->scores, b->ids, b->weights);
    int rc = moe_ep_forward_waves(ep, b->x, b->ids, b->weights, b->y, &f, NULL, 0.0, st);
    ep->link.enabled = true;
    if (rc)
        return rc;
    const double flops = moe_comm_sum(c, f.expert_flops);
    const double seconds = moe_comm_sum(c, f.compute_seconds);
    s->rank_flops = seconds > 0 ? flops / seconds : 0.0;
    const double bandwidth = s->rank_flops / ep->link.cb_ratio;
    for (int t = 0; t < MOE_TIERS; t++)
        ep->link.bandwidth[t] = bandwidth > 0 ? bandwidth : INFINITY;
    return MOE_EXIT_OK;
}

int moe_run_prepare(const moe_comm *c, enum moe_command command, int argc, char **argv,
                    moe_config *cfg, moe_ep *ep, run_buffers *b, moe_run_summary *s,
                    moe_status *st)
{
    if (moe_run_set_up(c, cfg, command, argc, argv, st) || moe_ep_init(ep, cfg, c, st))
        return st->code;
    const int threads = moe_comm_threads_for(c, ep->gemm);
    moe_run_buffers_init(b, cfg);
    moe_ep_generate_tokens(ep, b->x);
    *s = (moe_run_summary){.cfg = cfg, .ranks = c->ranks, .ranks_on_host = c->ranks_on_host,
                           .cores = c->cores, .bound = c->bound, .threads = threads,
                           .blas_threads = moe_gemm_threads(), .link = &ep->link};
    int rc = MOE_EXIT_OK;
    if (!cfg->blocking && ep->link.enabled && ep->link.cb_ratio > 0)
        rc = moe_run_calibrate_link(c, ep, b, s, st);
    if (rc) {
        moe_run_buffers_free(b);
        moe_ep_free(ep);
    }
    return rc;
}

int moe_cli_run(const moe_comm *c, int argc, char **argv)
{
    if (moe_cli_help(c, argc, argv, print_usage))
        return MOE_EXIT_OK;
    moe_config cfg;
    moe_status st = {0};
    moe_ep ep;
    run_buffers b;
    moe_run_summary s;
    int rc = moe_run_prepare(c, MOE_CMD_RUN, argc, argv, &cfg, &ep, &b, &s, &st);
    if (rc) {
        moe_comm_print_error(c, &st);
        return rc;
    }

    /* The first wave count: report, pictures, check. */
    if (rc == MOE_EXIT_OK)
        rc = moe_run_timed_forwards(c, &ep, &b, &s, &st);
    traffic_detail detail = {NULL, NULL, NULL};
    if (rc == MOE_EXIT_OK)
        routing_detail(c, &ep, b.ids, b.last_expert_seconds, &s, &detail);
    pictures pics = {.count = 0};
    const bool drawing = cfg.trace[0] || cfg.timeline[0];
    if (rc == MOE_EXIT_OK && drawing)
        rc = collect_pictures(c, &ep, &cfg, b.x, b.ids, b.weights, &b.trace, &pics, &st);
    if (rc == MOE_EXIT_OK && cfg.check) {
        check_against_truth(c, &ep, b.x, b.ids, b.weights, b.y, &s);
        if (!cfg.blocking)
            rc = compare_with_reference(c, &ep, b.x, b.ids, b.weights, b.y, &s, &st);
    }
    if (rc == MOE_EXIT_OK && cfg.dump[0]) {
        const double t = moe_comm_time();
        rc = moe_cli_dump(c, &ep, b.x, &s.dump_bytes, &st);
        s.dump_seconds = moe_comm_time() - t;
    }
    /* The curve: every further wave count of --waves W1,W2,... */
    s.curve_count = 0;
    for (int n = 0; rc == MOE_EXIT_OK && !cfg.blocking && n < cfg.waves_count; n++) {
        moe_run_summary point = s;
        if (n > 0) {
            cfg.waves = cfg.waves_list[n];
            rc = moe_run_timed_forwards(c, &ep, &b, &point, &st);
        }
        s.curve[s.curve_count++] = (moe_curve_point){
            (int)cfg.waves_list[n], point.layer_seconds, point.pipeline_seconds,
            point.compute_seconds, point.comm_seconds, point.wave_kind};
    }
    cfg.waves = cfg.waves_list[0];
    if (rc == MOE_EXIT_OK && drawing)
        rc = write_pictures(c, &cfg, &pics, &s, &st);

    if (rc == MOE_EXIT_OK) {
        if (c->rank == 0) {
            moe_report_print(stdout, &s);
            fflush(stdout);
        }
        if (cfg.check && !moe_report_check_passed(&s))
            rc = MOE_EXIT_CHECK_FAILED;
    } else {
        moe_comm_print_error(c, &st);
    }

    for (int p = 0; p < 2; p++) {
        free(pics.offset[p]);
        free(pics.events[p]);
    }
    free(detail.matrix);
    free(detail.nodes_hist);
    free(detail.rank_seconds);
    moe_run_buffers_free(&b);
    moe_ep_free(&ep);
    return rc;
}
