/* SPDX-License-Identifier: MIT */
/* progress.h — who makes nonblocking collectives move while experts compute.
 *
 * Most MPI libraries (Open MPI 4.1 among them) move a nonblocking collective
 * only inside MPI calls. Two ways to make those calls:
 *   poll    the compute thread calls MPI_Test on every operation in flight at
 *           each stage boundary of the expert FFN (moe_progress_poll);
 *   thread  a progress thread does nothing else (the CPU analogue of the SMs
 *           DeepSeek reserves for communication). MPI calls of the two
 *           threads are serialised by one lock, so MPI_THREAD_SERIALIZED is
 *           all it needs from the library.
 * An operation is one or two requests posted together (a wave's dispatch of
 * rows and ids, or its combine), with its post and completion times. With a
 * link model (link.h) an operation completes at max(MPI completion, post +
 * modelled duration); waiting for that time sleeps, it does not spin.
 */
#ifndef MOE_PROGRESS_H
#define MOE_PROGRESS_H

#include <mpi.h>
#include <pthread.h>
#include <stdbool.h>

#include "moe/comm.h"
#include "moe/config.h"
#include "moe/watchdog.h"

typedef struct {
    MPI_Request requests[2];
    int count;         /* requests in use */
    bool active;       /* posted and not yet complete */
    bool mpi_done;     /* MPI has completed the requests */
    double posted;     /* clock time (clock.h) at post */
    double ready_at;   /* posted + the modelled link duration */
    double completed;  /* max(MPI completion seen, ready_at) */
} moe_comm_op;

typedef struct {
    enum moe_progress_kind kind;
    moe_comm_op *ops;
    int n_ops;
    double test_seconds; /* inside MPI_Test, by whichever thread */
    long tests;
    pthread_mutex_t lock;
    pthread_cond_t changed;
    pthread_t thread;
    bool thread_running, stop;
} moe_progress;

/* The thread level the library granted at start-up (MPI_Init_thread). */
extern int moe_progress_thread_level;

/* The progress kind this MPI library can give for `requested`: thread needs
 * MPI_THREAD_SERIALIZED, and falls back to poll without it. Rank 0 of c
 * says so once, as a note on stderr. */
enum moe_progress_kind moe_progress_granted(const moe_comm *c, enum moe_progress_kind requested);

void moe_progress_init(moe_progress *p, enum moe_progress_kind kind, int n_ops);
/* Stop the progress thread, if any: its counters and the ops are final. */
void moe_progress_stop(moe_progress *p);
void moe_progress_free(moe_progress *p);

/* Around MPI calls of the compute thread while the progress thread runs. */
void moe_progress_lock(moe_progress *p);
void moe_progress_unlock(moe_progress *p);

/* Mark op as posted at `posted` (its requests filled in, under the lock); its
 * data counts as arrived no earlier than ready_at (clock.h; <= posted when
 * there is no link model). */
void moe_progress_track(moe_progress *p, int op, double posted, double ready_at);

/* Poll mode: one MPI_Test round over the operations in flight. Thread mode:
 * nothing (the thread polls). Cheap when nothing is in flight. */
void moe_progress_poll(moe_progress *p);

/* Until op has completed. */
void moe_progress_wait(moe_progress *p, int op);

/* The same, on the watchdog's board as a wait at `place` of wave `wave`
 * (-1: none). */
void moe_progress_wait_at(moe_progress *p, int op, enum moe_watch_place place, int wave);

/* Whether op, posted, has completed as far as the last test round saw (poll
 * mode: call moe_progress_poll first). Does not block. */
bool moe_progress_done(moe_progress *p, int op);

#endif
