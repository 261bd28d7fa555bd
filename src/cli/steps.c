/* SPDX-License-Identifier: MIT */
/* steps.c — `moe-ep run --steps N [--bias-update GAMMA]`: the load over
 * steps, and DeepSeek-V3's auxiliary-loss-free balancing.
 *
 * Step s routes stream batch s (the run's own batch first, then fresh ones:
 * moe_ep_generate_batch) and runs the forward on it, on the path the run
 * is configured for; after it, with --bias-update, every rank moves the
 * correction bias by the layer's load (moe_router_bias_update: the same
 * load on every rank, so the same bias). The timed forwards and --check
 * that follow run on the run's batch with the final bias.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe/cli.h"
#include "moe/context.h"
#include "moe/files.h"

typedef struct {
    double expert_imbalance; /* max / mean (token, expert) pairs over experts */
    double rank_imbalance;   /* the same over ranks */
    double slowest;          /* the slowest rank's expert stage, seconds */
    double aux, z, seq;      /* moe_balance_losses */
} step_row;

typedef struct {
    const moe_config *cfg;
    const step_row *rows;
    const float *bias; /* (steps, E) after each step's update */
} steps_record;

static void write_csv(FILE *out, const void *arg)
{
    const steps_record *r = arg;
    const int E = (int)r->cfg->experts;
    fprintf(out, "step,experts_max_over_mean,ranks_max_over_mean,slowest_expert_ms,aux_loss,z_loss,"
                 "seq_balance");
    for (int e = 0; e < E; e++)
        fprintf(out, ",bias_%d", e);
    fprintf(out, "\n");
    for (int64_t s = 0; s < r->cfg->steps; s++) {
        const step_row *row = &r->rows[s];
        fprintf(out, "%lld,%.6f,%.6f,%.4f,%.6f,%.6f,%.6f", (long long)s, row->expert_imbalance,
                row->rank_imbalance, 1e3 * row->slowest, row->aux, row->z, row->seq);
        for (int e = 0; e < E; e++)
            fprintf(out, ",%.9g", (double)r->bias[s * E + e]);
        fprintf(out, "\n");
    }
}

/* max/mean per expert and per rank against the step. */
static void write_plot(FILE *out, const void *arg)
{
    const steps_record *r = arg;
    const int n = (int)r->cfg->steps;
    double top = 1.0;
    for (int s = 0; s < n; s++)
        top = fmax(top, fmax(r->rows[s].expert_imbalance, r->rows[s].rank_imbalance));
    top = ceil(top);
    const int left = 70, y0 = 40, width = 600, height = 300;
    fprintf(out, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"760\" height=\"420\" "
                 "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
    fprintf(out, "<text x=\"%d\" y=\"24\" font-size=\"15\" font-weight=\"bold\">moe-ep run --steps %d "
                 "--bias-update %g: load max/mean against the step</text>\n",
            left, n, r->cfg->bias_update);
    for (int t = 0; t <= (int)top; t++) {
        const double y = y0 + height - t * height / top;
        fprintf(out, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                     "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%d</text>\n",
                left, y, left + width, y, left - 6, y + 4, t);
    }
    for (int line = 0; line < 2; line++) {
        fprintf(out, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" points=\"",
                line ? "#e15759" : "#4e79a7");
        for (int s = 0; s < n; s++) {
            const double v = line ? r->rows[s].rank_imbalance : r->rows[s].expert_imbalance;
            fprintf(out, "%.1f,%.1f ", left + (n > 1 ? s * (double)width / (n - 1) : 0.0),
                    y0 + height - v * height / top);
        }
        fprintf(out, "\"/>\n");
    }
    fprintf(out, "<text x=\"%d\" y=\"%d\">step 0</text><text x=\"%d\" y=\"%d\" text-anchor=\"end\">step %d</text>\n",
            left, y0 + height + 18, left + width, y0 + height + 18, n - 1);
    fprintf(out, "<text x=\"%d\" y=\"%d\" fill=\"#4e79a7\">per expert</text>"
                 "<text x=\"%d\" y=\"%d\" fill=\"#e15759\">per rank</text>\n</svg>\n",
            left, y0 + height + 44, left + 160, y0 + height + 44);
}

static void print_steps(const moe_config *cfg, const step_row *rows, const float *final_bias)
{
    const int n = (int)cfg->steps, E = (int)cfg->experts;
    if (cfg->bias_update > 0)
        printf("steps     %d steps on fresh batches, the correction bias moved by %g x sign(mean load - "
               "load) after each (DeepSeek-V3's auxiliary-loss-free balancing)\n", n, cfg->bias_update);
    else
        printf("steps     %d steps on fresh batches, the bias fixed\n", n);
    printf("          %5s %18s %16s %18s %10s %10s %12s\n", "step", "experts max/mean",
           "ranks max/mean", "slowest experts", "aux loss", "z-loss", "seq balance");
    const int every = n <= 20 ? 1 : (n + 19) / 20;
    for (int s = 0; s < n; s++)
        if (s % every == 0 || s == n - 1)
            printf("          %5d %18.2f %16.2f %15.2f ms %10.4f %10.4f %12.4f\n", s,
                   rows[s].expert_imbalance, rows[s].rank_imbalance, 1e3 * rows[s].slowest,
                   rows[s].aux, rows[s].z, rows[s].seq);
    int lo = 0, hi = 0;
    for (int e = 1; e < E; e++) {
        lo = final_bias[e] < final_bias[lo] ? e : lo;
        hi = final_bias[e] > final_bias[hi] ? e : hi;
    }
    printf("          aux loss: GShard/Switch E sum f_i P_i; seq balance: V3's sequence-wise sum f_i P_i "
           "(a rank's batch a sequence; the loss is alpha times it); both 1 when even\n");
    printf("          final bias: min %.6g (expert %d), max %.6g (expert %d)\n", (double)final_bias[lo],
           lo, (double)final_bias[hi], hi);
}

int moe_run_steps(moe_run_context *ctx)
{
    const moe_comm *c = ctx->comm;
    const moe_config *cfg = &ctx->cfg;
    moe_ep *ep = &ctx->ep;
    const int G = c->ranks, E = (int)cfg->experts, n = (int)cfg->steps;
    const moe_index T = cfg->tokens, d = cfg->hidden, k = cfg->topk;
    float *run_batch = ctx->x;
    float *batch = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    step_row *rows = moe_xcalloc((size_t)n, sizeof *rows);
    float *bias = moe_xcalloc((size_t)n * (size_t)E, sizeof(float));
    double *steps_load = moe_xcalloc((size_t)n * (size_t)E, sizeof(double));
    double *load = moe_xmalloc(sizeof(double) * (size_t)(2 * E + G));
    double *prob = load + E, *rank_pairs = prob + E;
    int rc = MOE_EXIT_OK;
    for (int s = 0; s < n && rc == MOE_EXIT_OK; s++) {
        if (s > 0)
            moe_ep_generate_batch(ep, (uint64_t)s, batch);
        ctx->x = s > 0 ? batch : run_batch;
        rc = moe_context_timed_forwards(ctx, 1);
        if (rc)
            break;
        memset(load, 0, sizeof(double) * (size_t)(2 * E + G));
        moe_balance_sums sums = {0};
        moe_router_balance(&ep->router, ctx->logits, ctx->scores, ctx->ids, T, load, prob, &sums);
        for (moe_index p = 0; p < T * k; p++)
            if (ctx->placed[p] != MOE_DROPPED)
                rank_pairs[ep->placement.expert_rank[ctx->placed[p]]] += 1.0;
        moe_comm_sum_array(c, load, 2 * E + G);
        moe_comm_sum_array(c, &sums.tokens, 4);
        step_row *row = &rows[s];
        row->expert_imbalance = moe_max_over_mean(load, E);
        row->rank_imbalance = moe_max_over_mean(rank_pairs, G);
        row->slowest = moe_comm_max(c, ctx->last.seconds[MOE_STAGE_EXPERTS]);
        moe_balance_losses(load, prob, E, (int)k, &sums, &row->aux, &row->z, &row->seq);
        memcpy(steps_load + (size_t)s * (size_t)E, load, sizeof(double) * (size_t)E);
        if (cfg->bias_update > 0)
            moe_router_bias_update(ep->bias, load, E, (float)cfg->bias_update);
        if (ep->bias)
            memcpy(bias + (size_t)s * (size_t)E, ep->bias, sizeof(float) * (size_t)E);
    }
    ctx->x = run_batch;
    moe_status local = {0};
    if (rc == MOE_EXIT_OK && c->rank == 0) {
        print_steps(cfg, rows, bias + (size_t)(n - 1) * (size_t)E);
        fflush(stdout);
        const steps_record record = {cfg, rows, bias};
        if (cfg->steps_csv[0])
            moe_write_file_atomic(cfg->steps_csv, write_csv, &record, &local);
        if (cfg->steps_plot[0] && local.code == MOE_EXIT_OK)
            moe_write_file_atomic(cfg->steps_plot, write_plot, &record, &local);
    }
    if (rc == MOE_EXIT_OK && moe_comm_agree(c, &local)) {
        ctx->status = local;
        rc = local.code;
    }
    free(load);
    /* kept for --dump: the trajectory beside the set */
    ctx->steps_bias = bias;
    ctx->steps_load = steps_load;
    free(rows);
    free(batch);
    return rc;
}
