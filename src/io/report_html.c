/* SPDX-License-Identifier: MIT */
/* report_html.c — `run --report FILE.html`: one self-contained page of a
 * run (see report.h). Inline CSS and SVG only: no script, no network, so
 * the file opens anywhere, mailed or offline.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "moe/config.h"
#include "moe/report.h"
#include "moe/timeline.h"

#define BAR_WIDTH 720 /* pixels of the longest bar */

/* A horizontal bar chart: one labelled bar per value, scaled to the largest,
 * with the value at its end; mean, when not NaN, drawn as a line. */
static void bars(FILE *out, const char *label, const double *v, int n, const char *unit, double mean)
{
    double most = 0.0;
    for (int i = 0; i < n; i++)
        most = fmax(most, v[i]);
    const int row = n <= 32 ? 16 : n <= 128 ? 6 : 3, left = 90, height = n * row + 24;
    fprintf(out, "<svg width=\"%d\" height=\"%d\" font-family=\"sans-serif\" font-size=\"11\">\n",
            left + BAR_WIDTH + 90, height);
    for (int i = 0; i < n; i++) {
        const double w = most > 0 ? BAR_WIDTH * v[i] / most : 0.0;
        fprintf(out, "<rect x=\"%d\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"#4e79a7\">"
                     "<title>%s %d: %.6g %s</title></rect>\n",
                left, i * row, w, row > 4 ? row - 2 : row, label, i, v[i], unit);
        if (row >= 12)
            fprintf(out, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">%s %d</text>"
                         "<text x=\"%.1f\" y=\"%d\">%.4g</text>\n",
                    left - 6, i * row + row - 4, label, i, left + w + 4, i * row + row - 4, v[i]);
    }
    if (!isnan(mean) && most > 0) {
        const double x = left + BAR_WIDTH * mean / most;
        fprintf(out, "<line x1=\"%.1f\" y1=\"0\" x2=\"%.1f\" y2=\"%d\" stroke=\"#e15759\" "
                     "stroke-dasharray=\"4 3\"/><text x=\"%.1f\" y=\"%d\" fill=\"#e15759\">mean %.4g</text>\n",
                x, x, n * row, x + 4, n * row + 14, mean);
    }
    fprintf(out, "</svg>\n");
}

/* text with the characters HTML reserves escaped (a preset may be any path). */
static void html_text(FILE *out, const char *text)
{
    for (const char *c = text; *c; c++) {
        const char *entity = *c == '<' ? "&lt;" : *c == '>' ? "&gt;" : *c == '&' ? "&amp;"
                             : *c == '"' ? "&quot;" : NULL;
        if (entity)
            fputs(entity, out);
        else
            fputc(*c, out);
    }
}

/* The dispatch matrix (bytes) as a table, each cell shaded from the
 * smallest cell (pale) to the largest (dark), so that an uneven row or
 * column stands out even when all cells are of a size. */
static void heat_map(FILE *out, const char *kind, const double *matrix, int G)
{
    double most = matrix[0], least = matrix[0];
    for (int i = 0; i < G * G; i++) {
        most = fmax(most, matrix[i]);
        least = fmin(least, matrix[i]);
    }
    fprintf(out, "<table class=\"%s\"><tr><th>from \\ to</th>", kind);
    for (int q = 0; q < G; q++)
        fprintf(out, "<th>%d</th>", q);
    fprintf(out, "</tr>\n");
    for (int r = 0; r < G; r++) {
        fprintf(out, "<tr><th>%d</th>", r);
        for (int q = 0; q < G; q++) {
            const double v = matrix[r * G + q];
            const double a = 0.08 + 0.92 * (most > least ? (v - least) / (most - least) : 1.0);
            fprintf(out, "<td style=\"background:rgba(78,121,167,%.3f);color:%s\" title=\"rank %d to "
                         "rank %d: %.0f bytes\">%.0f</td>",
                    a, a > 0.55 ? "white" : "black", r, q, v, v / 1024.0);
        }
        fprintf(out, "</tr>\n");
    }
    fprintf(out, "</table>\n");
}

void moe_report_write_html(FILE *out, const moe_run_summary *s, const moe_timeline_panel *panels,
                           int n_panels, const moe_timeline_curve *curve)
{
    const moe_config *cfg = s->cfg;
    const int G = s->ranks, E = (int)cfg->experts;
    fprintf(out,
            "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
            "<title>moe-ep run: G=%d T=%lld d=%lld f=%lld E=%d k=%lld</title>\n"
            "<style>body{font-family:sans-serif;margin:24px;max-width:1150px;color:#222}"
            "h1{font-size:20px}h2{font-size:16px;margin-top:28px}table{border-collapse:collapse}"
            "td,th{padding:3px 8px;text-align:right;font-size:12px}th{color:#555}"
            ".heat td{min-width:34px;border:1px solid white}.note{color:#555;font-size:12px}"
            ".pass{color:#2a7d2a}.fail{color:#c22}</style></head><body>\n",
            G, (long long)cfg->tokens, (long long)cfg->hidden, (long long)cfg->ffn, E,
            (long long)cfg->topk);
    fprintf(out, "<h1>moe-ep run · ");
    html_text(out, cfg->preset[0] ? cfg->preset : "(no preset)");
    fprintf(out, "</h1>\n<p>G = %d ranks · T = %lld tokens per rank · d = %lld · "
                 "f = %lld · E = %d routed experts · k = %lld · S = %lld shared · router %s · "
                 "W = %d · seed %llu</p>\n",
            G, (long long)cfg->tokens,
            (long long)cfg->hidden, (long long)cfg->ffn, E, (long long)cfg->topk,
            (long long)cfg->shared_experts, moe_config_choice_name("router", cfg->router), s->waves,
            (unsigned long long)cfg->seed);
    if (s->checked)
        fprintf(out, "<p class=\"%s\">check against the dense fp64 truth: %s</p>\n",
                moe_report_check_passed(s) ? "pass" : "fail",
                moe_report_check_passed(s) ? "PASS" : "FAIL");

    fprintf(out, "<h2>Stage times</h2>\n<p class=\"note\">ms per forward, median over the "
                 "iterations of the max over ranks; dispatch and combine: in flight, summed over "
                 "waves</p>\n<table><tr>");
    for (int n = 0; n < MOE_STAGES; n++)
        fprintf(out, "<th>%s</th>", moe_stage_names[n]);
    fprintf(out, "<th>layer</th></tr><tr>");
    for (int n = 0; n < MOE_STAGES; n++)
        fprintf(out, "<td>%.2f</td>", 1e3 * s->stage_seconds[n]);
    fprintf(out, "<td>%.2f</td></tr></table>\n", 1e3 * s->layer_seconds);

    if (n_panels > 0) {
        fprintf(out, "<h2>Timeline</h2>\n");
        moe_write_timeline_svg(out, panels, n_panels, curve);
    }
    if (s->matrix) {
        fprintf(out, "<h2>Dispatch traffic, KiB from rank (row) to rank (column)</h2>\n"
                     "<p class=\"note\">the diagonal stays on its rank; shades run from the "
                     "smallest cell (pale) to the largest (dark)</p>\n");
        heat_map(out, "heat", s->matrix, G);
    }
    if (s->wire) {
        fprintf(out, "<h2>Dispatch on the wire, KiB from rank (row) to rank (column)</h2>\n"
                     "<p class=\"note\">the two-stage dispatch as it crosses the links: a token's row "
                     "once over IB to each other node's relay (the rank of its home's local index "
                     "there), then from the relay to the node's ranks that hold its experts; the map "
                     "above is the flat dispatch's, one row a (token, rank)</p>\n");
        heat_map(out, "heat wire", s->wire, G);
    }
    if (s->tokens_expert) {
        fprintf(out, "<h2>Tokens per expert</h2>\n<p class=\"note\">(token, expert) pairs of all "
                     "ranks; imbalance (max / mean) %.2f</p>\n",
                s->tokens_per_expert.mean > 0 ? s->tokens_per_expert.max / s->tokens_per_expert.mean
                                              : 0.0);
        bars(out, "expert", s->tokens_expert, E, "tokens", s->tokens_per_expert.mean);
    }
    if (s->matrix) {
        double *received = moe_xcalloc((size_t)G, sizeof(double)), mean = 0.0;
        for (int q = 0; q < G; q++) {
            for (int r = 0; r < G; r++)
                received[q] += s->matrix[r * G + q] / 1024.0;
            mean += received[q] / G;
        }
        fprintf(out, "<h2>Dispatch KiB received per rank</h2>\n");
        bars(out, "rank", received, G, "KiB", mean);
        free(received);
    }
    if (s->rank_expert_seconds) {
        double *ms = moe_xmalloc(sizeof(double) * (size_t)G);
        for (int r = 0; r < G; r++)
            ms[r] = 1e3 * s->rank_expert_seconds[r];
        fprintf(out, "<h2>Expert time per rank, ms (the last forward)</h2>\n<p class=\"note\">every "
                     "rank waits for the slowest in the all-to-all</p>\n");
        bars(out, "rank", ms, G, "ms", NAN);
        free(ms);
    }
    if (s->nodes_hist && s->nodes > 1) {
        const int n = s->nodes;
        double *share = moe_xmalloc(sizeof(double) * (size_t)(n + 1)), total = 0.0;
        for (int i = 0; i <= n; i++)
            total += s->nodes_hist[i];
        for (int i = 0; i <= n; i++)
            share[i] = total > 0 ? 100.0 * s->nodes_hist[i] / total : 0.0;
        fprintf(out, "<h2>Nodes a token reaches</h2>\n<p class=\"note\">%% of tokens, %d nodes of "
                     "%d ranks</p>\n", s->nodes, s->ranks_per_node);
        bars(out, "nodes", share, n + 1, "%", NAN);
        free(share);
    }
    fprintf(out, "</body></html>\n");
}
