/* SPDX-License-Identifier: MIT */
/* trace.c — a rank's list of timeline events (see stats.h). */
#include <stdlib.h>

#include "moe/common.h"
#include "moe/stats.h"

const char *const moe_event_names[MOE_EVENT_KINDS] = {
    "dispatch", "L1", "activation", "L2", "combine",
    "forward", "shared bwd", "dgrad", "wgrad", "combine bwd", "dispatch bwd",
    "shared",
};

void moe_trace_add(moe_trace *t, moe_event e)
{
    if (t->count == t->capacity) {
        int capacity = t->capacity ? 2 * t->capacity : 64;
        moe_event *grown = realloc(t->events, sizeof(moe_event) * (size_t)capacity);
        MOE_ASSERT(grown != NULL);
        t->events = grown;
        t->capacity = capacity;
    }
    t->events[t->count++] = e;
}

void moe_trace_clear(moe_trace *t) { t->count = 0; }

void moe_trace_free(moe_trace *t)
{
    free(t->events);
    t->events = NULL;
    t->count = t->capacity = 0;
}
