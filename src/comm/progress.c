/* SPDX-License-Identifier: MIT */
/* progress.c — driving nonblocking collectives: polling or a thread (see progress.h). */
#define _POSIX_C_SOURCE 200809L
#include "moe/progress.h"

#include <math.h>
#include <stdio.h>
#include <sched.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>

#include "moe/clock.h"
#include "moe/common.h"

int moe_progress_thread_level = MPI_THREAD_SINGLE;

/* Longest sleep while an operation waits for its modelled arrival: other
 * operations in flight still need MPI calls to move. */
#define ARRIVAL_SLICE 100e-6

/* One MPI_Test round over the active operations; the caller holds the lock
 * in thread mode. Returns true when an operation still needs MPI calls;
 * *next_ready is the earliest arrival of those that only wait for it. */
static bool test_round(moe_progress *p, double *next_ready)
{
    bool needs_mpi = false;
    *next_ready = INFINITY;
    for (int n = 0; n < p->n_ops; n++) {
        moe_comm_op *op = &p->ops[n];
        if (!op->active)
            continue;
        if (!op->mpi_done) {
            int done = 0;
            MPI_Status statuses[2];
            const double t = moe_stage_begin();
            MOE_MPI(MPI_Testall(op->count, op->requests, &done, statuses));
            const double now = moe_stage_end(&p->test_seconds, t);
            p->tests++;
            if (done) {
                op->mpi_done = true;
                op->completed = now > op->ready_at ? now : op->ready_at;
            } else {
                needs_mpi = true;
            }
        }
        if (op->mpi_done) {
            if (moe_clock_now() >= op->ready_at)
                op->active = false;
            else if (op->ready_at < *next_ready)
                *next_ready = op->ready_at;
        }
    }
    return needs_mpi;
}

static void sleep_for(double seconds)
{
    if (seconds <= 0)
        return;
    struct timespec ts = {(time_t)seconds, (long)((seconds - floor(seconds)) * 1e9)};
    nanosleep(&ts, NULL);
}

static void *progress_thread(void *arg)
{
    moe_progress *p = arg;
    pthread_mutex_lock(&p->lock);
    while (!p->stop) {
        double next_ready;
        bool needs_mpi = test_round(p, &next_ready);
        pthread_cond_broadcast(&p->changed);
        if (needs_mpi) {
            /* Let the compute thread take the lock to post or to read. */
            pthread_mutex_unlock(&p->lock);
            sched_yield();
            pthread_mutex_lock(&p->lock);
        } else if (isfinite(next_ready)) {
            /* Only arrivals to wait for: sleep until the first, or a post. */
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            double wait = next_ready - moe_clock_now();
            double abs_time = (double)until.tv_sec + until.tv_nsec * 1e-9 + (wait > 0 ? wait : 0);
            until.tv_sec = (time_t)abs_time;
            until.tv_nsec = (long)((abs_time - floor(abs_time)) * 1e9);
            pthread_cond_timedwait(&p->changed, &p->lock, &until);
        } else {
            pthread_cond_wait(&p->changed, &p->lock);
        }
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

enum moe_progress_kind moe_progress_granted(const moe_comm *c, enum moe_progress_kind requested)
{
    static bool noted;
    if (requested != MOE_PROGRESS_THREAD || moe_progress_thread_level >= MPI_THREAD_SERIALIZED)
        return requested;
    if (c->rank == 0 && !noted)
        fprintf(stderr, "moe-ep: note: --progress thread needs MPI_THREAD_SERIALIZED, which this "
                        "MPI library does not grant; polling instead\n");
    noted = true;
    return MOE_PROGRESS_POLL;
}

void moe_progress_init(moe_progress *p, enum moe_progress_kind kind, int n_ops)
{
    memset(p, 0, sizeof *p);
    p->kind = kind;
    p->n_ops = n_ops;
    p->ops = moe_xcalloc((size_t)n_ops, sizeof *p->ops);
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->changed, NULL);
    /* Without MPI_THREAD_SERIALIZED (or a thread) the compute thread polls;
     * moe_progress_granted says so. */
    if (kind == MOE_PROGRESS_THREAD && moe_progress_thread_level < MPI_THREAD_SERIALIZED)
        p->kind = MOE_PROGRESS_POLL;
    if (p->kind == MOE_PROGRESS_THREAD) {
        p->thread_running = pthread_create(&p->thread, NULL, progress_thread, p) == 0;
        if (!p->thread_running)
            p->kind = MOE_PROGRESS_POLL; /* no thread: the compute thread polls */
    }
}

void moe_progress_stop(moe_progress *p)
{
    if (p->thread_running) {
        pthread_mutex_lock(&p->lock);
        p->stop = true;
        pthread_cond_broadcast(&p->changed);
        pthread_mutex_unlock(&p->lock);
        pthread_join(p->thread, NULL);
        p->thread_running = false;
    }
}

void moe_progress_free(moe_progress *p)
{
    moe_progress_stop(p);
    pthread_cond_destroy(&p->changed);
    pthread_mutex_destroy(&p->lock);
    free(p->ops);
    p->ops = NULL;
}

void moe_progress_lock(moe_progress *p)
{
    if (p->kind == MOE_PROGRESS_THREAD)
        pthread_mutex_lock(&p->lock);
}

void moe_progress_unlock(moe_progress *p)
{
    if (p->kind == MOE_PROGRESS_THREAD)
        pthread_mutex_unlock(&p->lock);
}

void moe_progress_track(moe_progress *p, int op, double posted, double ready_at)
{
    p->ops[op].active = true;
    p->ops[op].mpi_done = false;
    p->ops[op].posted = posted;
    p->ops[op].ready_at = ready_at;
    if (p->kind == MOE_PROGRESS_THREAD)
        pthread_cond_broadcast(&p->changed); /* the caller holds the lock */
}

void moe_progress_poll(moe_progress *p)
{
    double next_ready;
    if (p->kind == MOE_PROGRESS_POLL)
        test_round(p, &next_ready);
}

void moe_progress_wait(moe_progress *p, int op)
{
    if (p->kind == MOE_PROGRESS_POLL) {
        /* Nothing to compute until op is in: poll, and give the core away
         * meanwhile (to a rank that shares it), in slices short enough to
         * keep the other operations in flight moving. */
        for (;;) {
            double next_ready;
            bool needs_mpi = test_round(p, &next_ready);
            if (!p->ops[op].active)
                return;
            if (p->ops[op].mpi_done) {
                double wait = p->ops[op].ready_at - moe_clock_now();
                sleep_for(needs_mpi && wait > ARRIVAL_SLICE ? ARRIVAL_SLICE : wait);
            } else {
                sched_yield();
            }
        }
    }
    pthread_mutex_lock(&p->lock);
    while (p->ops[op].active)
        pthread_cond_wait(&p->changed, &p->lock);
    pthread_mutex_unlock(&p->lock);
}

void moe_progress_wait_at(moe_progress *p, int op, enum moe_watch_place place, int wave)
{
    moe_watch_wait(place, wave);
    moe_progress_wait(p, op);
    moe_watch_done();
}

bool moe_progress_done(moe_progress *p, int op)
{
    moe_progress_lock(p);
    const bool done = !p->ops[op].active;
    moe_progress_unlock(p);
    return done;
}
