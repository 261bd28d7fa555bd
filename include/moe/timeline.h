/* SPDX-License-Identifier: MIT */
/* timeline.h — pictures of a forward: Chrome trace JSON and an SVG Gantt chart.
 *
 * Pure formatting of events already gathered on one rank (no MPI). Both
 * outputs have one comm lane and one compute lane per rank, events coloured
 * by stage and labelled with their wave, like the seed's Figure 7-1.
 */
#ifndef MOE_TIMELINE_H
#define MOE_TIMELINE_H

#include <stdio.h>

#include "moe/common.h"
#include "moe/files.h"
#include <stdbool.h>

#include "moe/stats.h"

/* One run's events: events of rank r are events[offset[r] .. offset[r+1]). */
typedef struct {
    const char *title;      /* e.g. "W = 4 waves, progress poll" */
    const char *summary;    /* a second header line (layer time, speed-up, ...); NULL: none */
    int ranks;
    const int *offset;      /* (G+1) */
    const moe_event *events;
    bool has_slow;          /* the slow-rank finder named a rank (moe_waits_analyze): */
    int slow_rank;          /* its lanes are drawn on red */
} moe_timeline_panel;

/* The speed-up curve of a --waves list, drawn under the panels. */
typedef struct {
    int count;
    const int *waves;        /* (count) W of each point */
    const double *measured;  /* (count) pipeline seconds */
    const double *bound;     /* (count) its lower bound, seconds */
} moe_timeline_curve;

/* Chrome trace events (chrome://tracing, Perfetto): one process per rank,
 * thread 0 the comm lane, thread 1 the compute lane; times in microseconds. */
void moe_write_chrome_trace(FILE *out, const moe_timeline_panel *panel);

/* A self-contained SVG: one panel per entry (e.g. the run, then the same at
 * W = 1), sharing one time axis, with a legend; then the curve when it has
 * two points or more (curve may be NULL). */
void moe_write_timeline_svg(FILE *out, const moe_timeline_panel *panels, int n_panels,
                            const moe_timeline_curve *curve);

#endif
