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
 * rows and ids, or its combine), with its post and completion times.
 */
#ifndef MOE_PROGRESS_H
#define MOE_PROGRESS_H

#include <mpi.h>
#include <pthread.h>
#include <stdbool.h>

#include "moe/config.h"

typedef struct {
    MPI_Request requests[2];
    int count;         /* requests in use */
    bool active;       /* posted and not yet seen complete */
    double posted;     /* MPI_Wtime at post */
    double completed;  /* MPI_Wtime when a test first saw it complete */
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

void moe_progress_init(moe_progress *p, enum moe_progress_kind kind, int n_ops);
/* Stop the progress thread, if any: its counters and the ops are final. */
void moe_progress_stop(moe_progress *p);
void moe_progress_free(moe_progress *p);

/* Around MPI calls of the compute thread while the progress thread runs. */
void moe_progress_lock(moe_progress *p);
void moe_progress_unlock(moe_progress *p);

/* Mark op as posted (its requests filled in, under the lock). */
void moe_progress_track(moe_progress *p, int op);

/* Poll mode: one MPI_Test round over the operations in flight. Thread mode:
 * nothing (the thread polls). Cheap when nothing is in flight. */
void moe_progress_poll(moe_progress *p);

/* Until op has completed. */
void moe_progress_wait(moe_progress *p, int op);

#endif
