/* SPDX-License-Identifier: MIT */
/* trace.c — a rank's list of timeline events (see stats.h). */
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

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

void moe_trace_posts(const moe_trace *t, int waves, double *posted)
{
    for (int n = 0; n < 2 * waves; n++)
        posted[n] = NAN;
    for (int n = 0; t && n < t->count; n++) {
        const moe_event *e = &t->events[n];
        if ((e->kind != MOE_EVENT_DISPATCH && e->kind != MOE_EVENT_COMBINE) || e->wave < 0 ||
            e->wave >= waves)
            continue;
        double *p = &posted[(e->kind == MOE_EVENT_COMBINE ? waves : 0) + e->wave];
        if (isnan(*p) || e->posted < *p) /* the two-stage dispatch: its first hop */
            *p = e->posted;
    }
}

int moe_waits_analyze(int G, int W, int A, const int *side, const double *posted, const double *sends,
                      double *waits, int *last)
{
    const int ops = 2 * W + A;
    memset(waits, 0, sizeof(double) * 2 * (size_t)G * (size_t)G);
    memset(last, 0, sizeof(int) * (size_t)G);
    for (int op = 0; op < ops; op++) {
        /* the combine's half: a combine, or an agreement on that side */
        const int half = op < W ? 0 : op < 2 * W ? 1 : side[op - 2 * W];
        const bool agreement = op >= 2 * W; /* every rank waits for every rank */
        int latest = -1;
        for (int r = 0; r < G; r++) {
            const double mine = posted[(size_t)r * ops + op];
            if (isnan(mine))
                continue;
            if (latest < 0 || mine > posted[(size_t)latest * ops + op])
                latest = r;
            for (int s = 0; s < G; s++) {
                const double theirs = posted[(size_t)s * ops + op];
                /* s's rows reach r: dispatch s -> r, combine back along r -> s's dispatch */
                const double rows = agreement ? 1.0 : half ? sends[(size_t)r * G + s] : sends[(size_t)s * G + r];
                if (s != r && rows > 0 && !isnan(theirs) && theirs > mine)
                    waits[((size_t)half * G + r) * G + s] += theirs - mine;
            }
        }
        if (latest >= 0)
            last[latest]++;
    }
    int any = 0;
    for (int s = 0; s < G; s++)
        any += last[s];
    return any ? moe_waits_slow(G, waits, NULL, NULL) : -1;
}

int moe_waits_slow(int G, const double *waits, double *waited, int *ranked)
{
    int slow = 0, second = -1; /* the ranks the others waited for longest, over both sides */
    double most = -1.0, then = 0.0;
    for (int s = 0; s < G; s++) {
        double sum = 0.0;
        for (int half = 0; half < 2; half++)
            for (int r = 0; r < G; r++)
                sum += waits[((size_t)half * G + r) * G + s];
        if (sum > most)
            second = most >= 0 ? slow : -1, then = most >= 0 ? most : 0.0, slow = s, most = sum;
        else if (second < 0 || sum > then)
            second = s, then = sum;
    }
    if (waited)
        waited[0] = most, waited[1] = then;
    if (ranked)
        ranked[0] = slow, ranked[1] = second;
    return most >= MOE_SLOW_MIN_SECONDS && most >= 2.0 * then ? slow : -1;
}
