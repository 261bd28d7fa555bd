/* SPDX-License-Identifier: MIT */
/* clock.c — the stage clock (see clock.h). */
#include <mpi.h>

#include "moe/clock.h"

double moe_clock_now(void) { return MPI_Wtime(); }

void moe_clock_hold(double until)
{
    while (MPI_Wtime() < until)
        ;
}

double moe_stage_end(double *seconds, double begun)
{
    const double now = MPI_Wtime();
    *seconds += now - begun;
    return now;
}

double moe_stage_event(moe_trace *trace, double origin, double begun, moe_event e)
{
    const double now = MPI_Wtime();
    if (trace) {
        e.start = begun - origin;
        e.end = now - origin;
        moe_trace_add(trace, e);
    }
    return now;
}
