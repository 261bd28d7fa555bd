/* SPDX-License-Identifier: MIT */
/* timeline.c — Chrome trace JSON and the SVG Gantt chart (see timeline.h). */
#define _POSIX_C_SOURCE 200809L
#include "moe/timeline.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "moe/link.h"

/* Stage colours: comm in blues, compute in warm tones. */
static const char *const colours[MOE_EVENT_KINDS] = {
    "#4e79a7", /* dispatch */
    "#f28e2b", /* L1 */
    "#edc948", /* activation */
    "#e15759", /* L2 */
    "#76b7b2", /* combine */
    "#bab0ac", /* forward (a step's, blocking) */
    "#b07aa1", /* shared bwd */
    "#ff9da7", /* dgrad */
    "#9c755f", /* wgrad */
    "#59a14f", /* combine bwd */
    "#8cd17d", /* dispatch bwd */
    "#d4a6c8", /* shared */
};

/* The earliest event of a panel: pictures start there. */
static double first_start(const moe_timeline_panel *panel)
{
    double t0 = 0.0;
    for (int n = 0; n < panel->offset[panel->ranks]; n++)
        if (n == 0 || panel->events[n].start < t0)
            t0 = panel->events[n].start;
    return t0;
}

static bool is_comm(int kind) { return moe_event_is_comm(kind); }

/* The forward experts' stages, which the compute lane merges per wave past 4 ranks. */
static bool is_expert_stage(int kind)
{
    return kind == MOE_EVENT_L1 || kind == MOE_EVENT_ACTIVATION || kind == MOE_EVENT_L2;
}

/* Back-to-back expert stages of one wave on one rank (wave -1: none yet). */
typedef struct {
    double start, end;
    int wave;
} expert_run;

static void draw_run(FILE *out, const expert_run *run, int rank, int left, double t0, double scale,
                     int y, int h)
{
    if (run->wave < 0)
        return;
    const double x = left + (run->start - t0) * scale;
    const double w = fmax((run->end - run->start) * scale, 0.5);
    fprintf(out, "<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" fill=\"%s\" "
                 "stroke=\"white\" stroke-width=\"0.5\"><title>rank %d experts w%d (L1, activation, "
                 "L2): %.3f-%.3f ms</title></rect>\n",
            x, y + 1, w, h - 2, colours[MOE_EVENT_L1], rank, run->wave, 1e3 * (run->start - t0),
            1e3 * (run->end - t0));
    if (w > 10)
        fprintf(out, "<text x=\"%.2f\" y=\"%.1f\" text-anchor=\"middle\" font-size=\"%d\" "
                     "fill=\"#222\">%d</text>\n",
                x + w / 2, y + h / 2.0 + 3.5, h >= 14 ? 10 : 8, run->wave);
}

/* " w3" for wave 3; nothing for a stage of the whole step (wave -1). */
static const char *wave_suffix(int wave, char *text, size_t size)
{
    if (wave < 0)
        return "";
    snprintf(text, size, " w%d", wave);
    return text;
}

void moe_write_chrome_trace(FILE *out, const moe_timeline_panel *panel)
{
    const double t0 = first_start(panel);
    char suffix[24];
    fprintf(out, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
    const char *sep = "";
    for (int r = 0; r < panel->ranks; r++) {
        fprintf(out, "%s{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": {\"name\": \"rank %d\"}},\n", sep, r, r);
        fprintf(out, "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": 0, \"args\": {\"name\": \"comm\"}},\n", r);
        fprintf(out, "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": 1, \"args\": {\"name\": \"compute\"}},\n", r);
        fprintf(out, "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": 2, \"args\": {\"name\": \"comm inter-node\"}}", r);
        sep = ",\n";
        for (int n = panel->offset[r]; n < panel->offset[r + 1]; n++) {
            const moe_event *e = &panel->events[n];
            fprintf(out,
                    ",\n{\"name\": \"%s%s\", \"cat\": \"%s\", \"ph\": \"X\", \"pid\": %d, "
                    "\"tid\": %d, \"ts\": %.3f, \"dur\": %.3f, \"args\": {\"wave\": %d, "
                    "\"rows\": %lld, \"bytes\": %.0f}}",
                    moe_event_names[e->kind], wave_suffix(e->wave, suffix, sizeof suffix),
                    is_comm(e->kind) ? "comm" : "compute", r,
                    !is_comm(e->kind) ? 1 : e->tier == MOE_TIER_INTER ? 2 : 0, 1e6 * (e->start - t0), 1e6 * (e->end - e->start), e->wave,
                    (long long)e->rows, e->bytes);
        }
    }
    fprintf(out, "\n]}\n");
}

/* A "nice" tick step (1, 2 or 5 times a power of ten) giving about n ticks. */
static double tick_step(double span, int n)
{
    double raw = span / n, power = pow(10.0, floor(log10(raw)));
    double steps[] = {1, 2, 5, 10};
    for (int s = 0; s < 4; s++)
        if (raw <= steps[s] * power)
            return steps[s] * power;
    return 10 * power;
}

enum { CURVE_HEIGHT = 230 };

/* The curve: pipeline time against W, measured and bound, on a plot of
 * `plot` pixels at (left, top). */
static void write_curve(FILE *out, const moe_timeline_curve *curve, int left, int top, int plot)
{
    double most = 0.0;
    for (int n = 0; n < curve->count; n++)
        most = fmax(most, fmax(curve->measured[n], curve->bound[n]));
    const int height = CURVE_HEIGHT - 70, width = plot / 2, y0 = top + 30;
    const double step = tick_step(1e3 * most, 4);
    const double top_ms = ceil(1e3 * most / step) * step;
    fprintf(out, "<text x=\"%d\" y=\"%d\" font-size=\"14\" font-weight=\"bold\">pipeline time "
                 "against W: measured, and the bound max(T_comm, T_compute + T_comm/W)</text>\n",
            left, top + 16);
    for (double t = 0.0; t <= top_ms + 1e-9; t += step) {
        const double y = y0 + height - t / top_ms * height;
        fprintf(out, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#ddd\"/>\n", left,
                y, left + width, y);
        fprintf(out, "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%g ms</text>\n", left - 6,
                y + 4, t);
    }
    const char *const colour[2] = {"#222", "#e15759"};
    for (int line = 0; line < 2; line++) {
        const double *v = line ? curve->bound : curve->measured;
        fprintf(out, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s points=\"",
                colour[line], line ? " stroke-dasharray=\"6 4\"" : "");
        for (int n = 0; n < curve->count; n++)
            fprintf(out, "%.1f,%.1f ", left + (n + 0.5) * width / curve->count,
                    y0 + height - 1e3 * v[n] / top_ms * height);
        fprintf(out, "\"/>\n");
        for (int n = 0; n < curve->count; n++)
            fprintf(out, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"%s\"><title>W = %d: %.2f ms</title></circle>\n",
                    left + (n + 0.5) * width / curve->count,
                    y0 + height - 1e3 * v[n] / top_ms * height, colour[line], curve->waves[n],
                    1e3 * v[n]);
    }
    for (int n = 0; n < curve->count; n++) {
        const double x = left + (n + 0.5) * width / curve->count;
        fprintf(out, "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">W = %d</text>\n", x,
                y0 + height + 16, curve->waves[n]);
        fprintf(out, "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\" fill=\"#555\">%.2fx</text>\n",
                x, y0 + height + 30, curve->measured[0] / curve->measured[n]);
    }
    const int lx = left + width + 30;
    fprintf(out, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#222\" stroke-width=\"2\"/>"
                 "<text x=\"%d\" y=\"%d\">measured (speed-up under each W)</text>\n",
            lx, y0 + 10, lx + 24, y0 + 10, lx + 30, y0 + 14);
    fprintf(out, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#e15759\" stroke-width=\"2\" "
                 "stroke-dasharray=\"6 4\"/><text x=\"%d\" y=\"%d\">lower bound</text>\n",
            lx, y0 + 30, lx + 24, y0 + 30, lx + 30, y0 + 34);
}

/* Whether any event of the panels is one hop of the two-stage dispatch. */
static bool has_tiers(const moe_timeline_panel *panels, int n_panels)
{
    for (int p = 0; p < n_panels; p++)
        for (int n = 0; n < panels[p].offset[panels[p].ranks]; n++)
            if (panels[p].events[n].tier >= 0)
                return true;
    return false;
}

/* A comm lane's height: the compute lane's, or with the two-stage
 * dispatch's four hops enough for each quarter to show a bar of 4 px. */
static int comm_lane(int lane, bool tiers) { return tiers && lane < 24 ? 24 : lane; }

/* One event of rank r as a rectangle in its lanes (y0: the comm lane's
 * top, `comm` high; the compute lane below it, `lane` high), with its wave
 * number when it is wide enough. The comm lane holds dispatch above and
 * combine below: wave w+1's dispatch and wave w-1's combine overlap in
 * time. The two-stage dispatch's hops take a quarter each, the inter-node
 * ones at the lane's edges: D1, D2, C2, C1. */
static void draw_event(FILE *out, const moe_event *e, int r, int left, double t0, double scale,
                       int y0, int comm, int lane)
{
    char suffix[24];
    const double x = left + (e->start - t0) * scale;
    double w = (e->end - e->start) * scale;
    if (w < 0.5)
        w = 0.5;
    const int half = comm / 2, quarter = comm / 4;
    const bool dispatch = moe_event_goes_out(e->kind), inter = e->tier == MOE_TIER_INTER;
    int y = y0 + comm, h = lane;
    if (is_comm(e->kind) && e->tier < 0)
        y = y0 + (dispatch ? 0 : half), h = half;
    else if (is_comm(e->kind))
        y = y0 + quarter * (dispatch ? (inter ? 0 : 1) : (inter ? 3 : 2)), h = quarter;
    fprintf(out, "<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" fill=\"%s\" "
                 "stroke=\"white\" stroke-width=\"0.5\"%s><title>rank %d %s%s%s: "
                 "%.3f-%.3f ms, %lld rows</title></rect>\n",
            x, y + 1, w, h - 2, colours[e->kind],
            e->tier == MOE_TIER_INTRA ? " fill-opacity=\"0.6\"" : "",
            r, moe_event_names[e->kind], e->tier < 0 ? "" : inter ? " inter-node" : " intra-node",
            wave_suffix(e->wave, suffix, sizeof suffix), 1e3 * (e->start - t0),
            1e3 * (e->end - t0), (long long)e->rows);
    if (w > 16 && h >= 10 && e->wave >= 0)
        fprintf(out, "<text x=\"%.2f\" y=\"%.1f\" text-anchor=\"middle\" "
                     "font-size=\"%d\" fill=\"#222\">%d</text>\n",
                x + w / 2, y + h / 2.0 + 4, h >= 20 ? 11 : 9, e->wave);
}

/* The legend under the panels, at height ly: each kind of event drawn,
 * then what the numbers and the comm lane's quarters mean. */
static void draw_legend(FILE *out, const moe_timeline_panel *panels, int n_panels, bool merge,
                        int left, int ly)
{
    bool shown[MOE_EVENT_KINDS] = {false}; /* the legend names the kinds drawn */
    for (int p = 0; p < n_panels; p++)
        for (int n = 0; n < panels[p].offset[panels[p].ranks]; n++)
            shown[panels[p].events[n].kind] = true;
    if (merge) /* drawn as one block in L1's colour */
        shown[MOE_EVENT_ACTIVATION] = shown[MOE_EVENT_L2] = false;
    int x = left; /* each entry as wide as its label (about 6.5 px a character at 11 px) */
    for (int kind = 0; kind < MOE_EVENT_KINDS; kind++) {
        if (!shown[kind])
            continue;
        char label[64];
        snprintf(label, sizeof label, "%s%s",
                 merge && kind == MOE_EVENT_L1 ? "experts (L1, act., L2)" : moe_event_names[kind],
                 is_comm(kind) ? " (comm)" : "");
        fprintf(out, "<rect x=\"%d\" y=\"%d\" width=\"14\" height=\"14\" fill=\"%s\"/>\n", x, ly,
                colours[kind]);
        fprintf(out, "<text x=\"%d\" y=\"%d\">%s</text>\n", x + 20, ly + 11, label);
        x += 20 + (int)(6.5 * (double)strlen(label)) + 30;
    }
    fprintf(out, "<text x=\"%d\" y=\"%d\" fill=\"#555\">numbers: wave</text>\n", x, ly + 11);
    if (has_tiers(panels, n_panels)) /* on a line of its own: it is longer than the room left */
        fprintf(out, "<text x=\"%d\" y=\"%d\" fill=\"#555\">comm lane, top to bottom: inter-node dispatch, "
                     "intra-node dispatch (pale), intra-node combine (pale), inter-node combine</text>\n",
                left, ly + 28);
}

void moe_write_timeline_svg(FILE *out, const moe_timeline_panel *panels, int n_panels,
                            const moe_timeline_curve *curve)
{
    double span = 0.0;
    int ranks = 1;
    for (int p = 0; p < n_panels; p++) {
        const double t0 = first_start(&panels[p]);
        ranks = panels[p].ranks > ranks ? panels[p].ranks : ranks;
        for (int n = 0; n < panels[p].offset[panels[p].ranks]; n++)
            span = panels[p].events[n].end - t0 > span ? panels[p].events[n].end - t0 : span;
    }
    if (span <= 0.0)
        span = 1e-3;
    /* Lanes shrink with the rank count so that 16 ranks still fit a screen;
     * the comm lane keeps room for the two-stage dispatch's four hops. */
    const int lane = ranks <= 4 ? 22 : ranks <= 8 ? 16 : 11;
    const int comm = comm_lane(lane, has_tiers(panels, n_panels));
    const int gap = lane / 2, left = 92, right = 24, plot = 960;
    bool summaries = false; /* a second header line in any panel */
    for (int p = 0; p < n_panels; p++)
        summaries = summaries || (panels[p].summary && panels[p].summary[0]);
    const int panel_head = summaries ? 46 : 34, axis = 30;
    /* Past 4 ranks the lanes are too thin for every expert's L1, activation
     * and L2: a wave's back-to-back expert stages are drawn as one block. */
    const bool merge = ranks > 4;
    const int panel_height = panel_head + ranks * (comm + lane + gap) + axis;
    const int width = left + plot + right, legend = has_tiers(panels, n_panels) ? 51 : 34;
    const bool with_curve = curve && curve->count > 1;
    const int height = n_panels * panel_height + legend + 10 + (with_curve ? CURVE_HEIGHT : 0);
    const double scale = plot / span; /* pixels per second */
    const double step = tick_step(1e3 * span, 8); /* in ms */

    fprintf(out, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
                 "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"11\">\n",
            width, height, width, height);
    fprintf(out, "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n");
    for (int p = 0; p < n_panels; p++) {
        const moe_timeline_panel *panel = &panels[p];
        const double t0 = first_start(panel);
        const int top = p * panel_height;
        double end = t0;
        for (int n = 0; n < panel->offset[panel->ranks]; n++)
            end = panel->events[n].end > end ? panel->events[n].end : end;
        fprintf(out, "<text x=\"%d\" y=\"%d\" font-size=\"14\" font-weight=\"bold\">%s"
                     "<tspan font-weight=\"normal\">&#160; · &#160;%.2f ms first event to last</tspan></text>\n",
                left, top + 20, panel->title, 1e3 * (end - t0));
        if (panel->summary && panel->summary[0])
            fprintf(out, "<text x=\"%d\" y=\"%d\" fill=\"#333\">%s</text>\n", left, top + 36,
                    panel->summary);
        for (int r = 0; r < panel->ranks; r++) {
            const int y0 = top + panel_head + r * (comm + lane + gap);
            const bool slow = panel->has_slow && panel->slow_rank == r;
            fprintf(out, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\"%s>rank %d comm</text>\n",
                    left - 6, y0 + comm - 6, slow ? " fill=\"#b71c1c\" font-weight=\"bold\"" : "", r);
            fprintf(out, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\"%s>%s</text>\n",
                    left - 6, y0 + comm + lane - 6, slow ? " fill=\"#b71c1c\" font-weight=\"bold\"" : "",
                    slow ? "slow rank" : "compute");
            fprintf(out, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"%s\">%s</rect>\n",
                    left, y0, plot, comm + lane, slow ? "#fbe3e3" : "#f4f4f4",
                    slow ? "<title>the slow rank: the others waited longest for its rows</title>" : "");
            expert_run run = {.wave = -1};
            for (int n = panel->offset[r]; n < panel->offset[r + 1]; n++) {
                const moe_event *e = &panel->events[n];
                if (merge && is_expert_stage(e->kind)) {
                    /* a wave's L1, activation and L2 back to back: one block */
                    if (run.wave == e->wave && (e->start - run.end) * scale < 1.0) {
                        run.end = e->end;
                        continue;
                    }
                    draw_run(out, &run, r, left, t0, scale, y0 + comm, lane);
                    run = (expert_run){e->start, e->end, e->wave};
                    continue;
                }
                draw_event(out, e, r, left, t0, scale, y0, comm, lane);
            }
            draw_run(out, &run, r, left, t0, scale, y0 + comm, lane);
        }
        const int axis_y = top + panel_head + panel->ranks * (comm + lane + gap);
        fprintf(out, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#444\"/>\n", left,
                axis_y, left + plot, axis_y);
        for (double t = 0.0; t <= 1e3 * span + 1e-9; t += step) {
            const double x = left + t * 1e-3 * scale;
            fprintf(out, "<line x1=\"%.2f\" y1=\"%d\" x2=\"%.2f\" y2=\"%d\" stroke=\"#444\"/>\n",
                    x, axis_y, x, axis_y + 4);
            fprintf(out, "<text x=\"%.2f\" y=\"%d\" text-anchor=\"middle\">%g ms</text>\n", x,
                    axis_y + 16, t);
        }
    }
    const int ly = n_panels * panel_height + 12;
    draw_legend(out, panels, n_panels, merge, left, ly);
    if (with_curve)
        write_curve(out, curve, left, ly + legend, plot);
    fprintf(out, "</svg>\n");
}

