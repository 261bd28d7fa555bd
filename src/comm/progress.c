/* progress.c — driving nonblocking collectives: polling or a thread (see progress.h). */
#define _POSIX_C_SOURCE 200809L
#include "moe/progress.h"

#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "moe/common.h"

int moe_progress_thread_level = MPI_THREAD_SINGLE;

/* One MPI_Test round over the active operations; the caller holds the lock
 * in thread mode. Returns true when any operation is still in flight. */
static bool test_round(moe_progress *p)
{
    bool pending = false;
    for (int n = 0; n < p->n_ops; n++) {
        moe_comm_op *op = &p->ops[n];
        if (!op->active)
            continue;
        int done = 0;
        double t = MPI_Wtime();
        MPI_Testall(op->count, op->requests, &done, MPI_STATUSES_IGNORE);
        double now = MPI_Wtime();
        p->test_seconds += now - t;
        p->tests++;
        if (done) {
            op->active = false;
            op->completed = now;
        } else {
            pending = true;
        }
    }
    return pending;
}

static void *progress_thread(void *arg)
{
    moe_progress *p = arg;
    pthread_mutex_lock(&p->lock);
    while (!p->stop) {
        bool before = test_round(p);
        pthread_cond_broadcast(&p->changed);
        if (before) {
            /* Let the compute thread take the lock to post or to read. */
            pthread_mutex_unlock(&p->lock);
            sched_yield();
            pthread_mutex_lock(&p->lock);
        } else {
            pthread_cond_wait(&p->changed, &p->lock);
        }
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

void moe_progress_init(moe_progress *p, enum moe_progress_kind kind, int n_ops)
{
    memset(p, 0, sizeof *p);
    p->kind = kind;
    p->n_ops = n_ops;
    p->ops = moe_xcalloc((size_t)n_ops, sizeof *p->ops);
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->changed, NULL);
    if (kind == MOE_PROGRESS_THREAD) {
        MOE_ASSERT(moe_progress_thread_level >= MPI_THREAD_SERIALIZED);
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

void moe_progress_track(moe_progress *p, int op)
{
    p->ops[op].active = true;
    p->ops[op].posted = MPI_Wtime();
    if (p->kind == MOE_PROGRESS_THREAD)
        pthread_cond_broadcast(&p->changed); /* the caller holds the lock */
}

void moe_progress_poll(moe_progress *p)
{
    if (p->kind == MOE_PROGRESS_POLL)
        test_round(p);
}

void moe_progress_wait(moe_progress *p, int op)
{
    if (p->kind == MOE_PROGRESS_POLL) {
        /* Nothing to compute until op is in: poll, and yield the core to a
         * rank that shares it (oversubscribed runs would starve otherwise). */
        while (test_round(p) && p->ops[op].active)
            sched_yield();
        return;
    }
    pthread_mutex_lock(&p->lock);
    while (p->ops[op].active)
        pthread_cond_wait(&p->changed, &p->lock);
    pthread_mutex_unlock(&p->lock);
}
