/* SPDX-License-Identifier: MIT */
/* watchdog.h — --watchdog SECONDS: a rank that waits longer than that at
 * one of the forward's collectives or one-sided epochs ends the job with
 * exit status 3 and one report: where it waits (stage and wave), which
 * ranks have arrived there, and where each of the others is.
 *
 * Each rank keeps its place on a board the ranks of its host share (an MPI
 * shared-memory window): the stage it is in (moe_watch_stage) and, while it
 * waits, the wait's number — the ranks pass the same waits in the same
 * order, so a rank whose count is lower has not arrived — and since when. A
 * thread of each rank reads the board every 50 ms and never calls MPI:
 * when its own wait is past the limit it claims the report (the first
 * rank to do so on the host writes it), prints it and ends the process with
 * exit status 3, which makes the launcher end the job. Ranks on other hosts
 * are not on the board: the report says so.
 */
#ifndef MOE_WATCHDOG_H
#define MOE_WATCHDOG_H

#include "moe/comm.h"

/* The places a rank can be: a forward's stages, its start (the barrier
 * that aligns the forwards) and its end (the figures the ranks reduce), and
 * a training step's backward (its all-to-alls). */
enum moe_watch_place {
    MOE_WATCH_START, MOE_WATCH_ROUTE, MOE_WATCH_PLAN, MOE_WATCH_DISPATCH, MOE_WATCH_EXPERTS,
    MOE_WATCH_COMBINE, MOE_WATCH_REDUCE, MOE_WATCH_END, MOE_WATCH_BACKWARD, MOE_WATCH_PLACES
};
extern const char *const moe_watch_place_names[MOE_WATCH_PLACES];

/* Start the watchdog of `seconds` (0: none, and nothing else happens).
 * Collective over c. */
void moe_watchdog_start(const moe_comm *c, double seconds);
/* Stop it (the thread joined, the board freed). Collective over the start's c.
 * Checks the board's rule: a host's ranks entered the same number of waits
 * (an internal error if not). */
void moe_watchdog_stop(void);
/* This rank is now at `place` of wave `wave` (-1: none); or at the stage
 * named `stage` (moe_watch_place_named; none: nothing changes), its wave
 * kept. */
void moe_watch_stage(enum moe_watch_place place, int wave);
void moe_watch_stage_named(const char *stage);
/* This rank begins to wait at `place`, wave `wave`, for the other ranks;
 * moe_watch_done ends the wait. */
void moe_watch_wait(enum moe_watch_place place, int wave);
void moe_watch_done(void);
/* The stage named `stage` (a fault point's: "plan", "dispatch", ...), or
 * MOE_WATCH_PLACES for none. */
enum moe_watch_place moe_watch_place_named(const char *stage);

#endif
