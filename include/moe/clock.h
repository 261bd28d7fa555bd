/* SPDX-License-Identifier: MIT */
/* clock.h — the stage clock: the comm layer's one timer.
 *
 * The algorithm code never reads the time. A stage says where it begins
 * (moe_stage_begin returns the mark) and where it ends: moe_stage_end adds
 * the span to the stage's seconds in the run's stats, and moe_stage_event
 * also appends it to the run's trace as a timeline event. The report, the
 * timeline and bench read what the clock wrote; the link model and the
 * progress engine ask it the time (moe_clock_now) and hold on it
 * (moe_clock_hold). Times are MPI_Wtime seconds; a trace's events count
 * from the run's aligned start, its origin.
 */
#ifndef MOE_CLOCK_H
#define MOE_CLOCK_H

#include "moe/stats.h"

/* Seconds on the clock (MPI_Wtime). */
double moe_clock_now(void);

/* Spin until the clock reads `until` (the link model's modelled arrival). */
void moe_clock_hold(double until);

/* A stage begins: the mark its end is measured from. */
static inline double moe_stage_begin(void) { return moe_clock_now(); }

/* A stage ends: now - begun added to *seconds. Returns now. */
double moe_stage_end(double *seconds, double begun);

/* The seconds since begun: a span timed on its own (bench's passes). */
static inline double moe_stage_since(double begun) { return moe_clock_now() - begun; }

/* A stage the timeline draws ends: e spans begun .. now, relative to
 * origin, appended to trace (nothing without one). Returns now. */
double moe_stage_event(moe_trace *trace, double origin, double begun, moe_event e);

#endif
