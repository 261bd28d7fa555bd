/* SPDX-License-Identifier: MIT */
/* comm.h — the MPI side of moe-ep: start-up, collective errors, reductions.
 *
 * Only src/comm calls MPI. Errors are decided collectively: every rank says
 * whether it failed, all ranks learn the worst exit code, and rank 0 prints
 * one message (the lowest failing rank's), so the job ends with one line and
 * the same exit status everywhere, and never hangs on a rank that left.
 */
#ifndef MOE_COMM_H
#define MOE_COMM_H

#include <mpi.h>
#include <stdbool.h>

#include "moe/common.h"
#include "moe/dims.h"
#include "moe/experts.h"
#include "moe/stats.h"

/* Every MPI call of moe-ep goes through MOE_MPI. Communicators return
 * errors (MPI_ERRORS_RETURN) instead of aborting inside the library, and a
 * call that fails ends the job by the exit-3 path: one line
 * "moe-ep: error: rank R: MPI_Name failed at FILE:LINE: the library's
 * message", then MPI_Abort with exit status 3. A failed MPI call leaves no
 * state the ranks could agree on, so there is no collective recovery.
 * MOE_EP_FAULT=RANK:mpi (see moe_fault_here) makes the first all-to-all of
 * rows on that rank report a failure, as a broken link would. */
#define MOE_MPI(call) moe_mpi_check((call), #call, __FILE__, __LINE__)
void moe_mpi_check(int rc, const char *call, const char *file, int line);

typedef struct {
    MPI_Comm comm;
    int rank, ranks;   /* r, G */
    int ranks_on_host; /* ranks sharing this machine */
    int node_ranks;    /* R when every machine holds R consecutive ranks, else 0 */
    int cores;         /* online cores of this machine */
    int host_cores;    /* cores this machine's ranks may run on: the union of their bindings */
    int bound;         /* cores this rank may run on (its binding), the least over ranks */
    int threads;       /* OpenMP and BLAS threads per rank */
} moe_comm;

/* MPI_Init, then one thread per core share (and no more than the cores a
 * rank is bound to, so that its threads do not time-slice one core) unless
 * OMP_NUM_THREADS / OPENBLAS_NUM_THREADS say otherwise. */
void moe_comm_init(int *argc, char ***argv, moe_comm *c);

/* The binary's start: under an MPI launcher, moe_comm_init. Started alone
 * (no mpirun), a one-rank comm without MPI (comm MPI_COMM_NULL) instead: a
 * command that never communicates (verify, plan, a --help) or whose
 * arguments are refused then ends without starting MPI, which saves a
 * singleton's start-up (0.05-0.2 s, and a daemon with some MPIs) and works
 * where MPI cannot start; one that runs calls moe_comm_start first. */
void moe_comm_init_deferred(int *argc, char ***argv, moe_comm *c);

/* For a comm that moe_comm_init_deferred left without MPI: moe_comm_init
 * (c then holds MPI_COMM_WORLD of one rank). Nothing for one with MPI. */
void moe_comm_start(moe_comm *c);

/* The OpenMP threads for expert GEMMs of kind `gemm`, set and returned:
 * c->threads, except with blas, whose GEMMs run on OpenBLAS's own threads;
 * an OpenMP team on the same cores would spin between its parallel regions
 * while they work, so the OpenMP regions then run on one thread. An
 * OMP_NUM_THREADS in the environment wins. */
int moe_comm_threads_for(const moe_comm *c, enum moe_gemm_kind gemm);

/* A library call's threads: the caller's process is not the library's,
 * so its OpenMP and BLAS thread counts are borrowed for the call and given
 * back after it. moe_comm_threads_borrow sets them as the program would,
 * to c->threads (the rank's share of the host's cores, moe_comm_attach)
 * and the OpenMP team as moe_comm_threads_for does, each unless its
 * environment variable is set, and returns the caller's counts it set (0:
 * one it left alone) for moe_comm_threads_return. Unset, every rank's
 * OpenMP team and OpenBLAS took all the host's cores: with two ranks on
 * two cores a training step ran 3-5 times as long. */
typedef struct {
    int omp, blas;
} moe_thread_settings;
moe_thread_settings moe_comm_threads_borrow(const moe_comm *c, enum moe_gemm_kind gemm);
void moe_comm_threads_return(const moe_thread_settings *was);

/* MPI_Finalize, when MPI was started; the MPI library's loaded components
 * (Open MPI's mca_*.so) stay mapped until the process ends, so that leak
 * checkers at exit name their frames. */
void moe_comm_finalize(void);

/* Describe `comm` (a duplicate is not made; the caller owns it).
 * Collective over comm. */
void moe_comm_attach(moe_comm *c, MPI_Comm comm);

/* Collective: returns the highest exit code any rank passed in st; if it is
 * not MOE_EXIT_OK, st on rank 0 holds the message of the lowest rank with
 * that code, prefixed with "rank N: " when N != 0. */
int moe_comm_agree(const moe_comm *c, moe_status *st);

/* Fault injection for the tests: with MOE_EP_FAULT=RANK:STAGE in the
 * environment, rank RANK fails at STAGE (generate, plan, dispatch, experts,
 * combine, dump) as an allocation or I/O failure would (and at mpi as
 * MOE_MPI says). Returns true, with
 * st set to a runtime error, when this rank is to fail here. */
bool moe_fault_here(const moe_comm *c, const char *stage, moe_status *st);

/* For a failure where the ranks cannot agree (inside the wave pipeline):
 * print "moe-ep: error: rank R: MESSAGE" and end the job with MPI_Abort
 * (exit status 3). Does not return. Rank 0's own collective errors name no
 * rank; others' are prefixed "rank R: " by moe_comm_agree. */
void moe_comm_abort(const moe_comm *c, const moe_status *st) __attribute__((noreturn));

/* Collective, the first of a command: do all ranks hold the same canonical
 * configuration text (moe_config_canonical, plus the identity of the input
 * files)? A mismatch is a usage error on every rank; on rank 0, st names the
 * first rank that differs and the first differing line. Exchanges fixed-size
 * digests first, so ranks that disagree cannot mismatch its messages. */
int moe_comm_same_config(const moe_comm *c, const char *text, moe_status *st);

/* The bytes this process has posted to other ranks in all-to-alls of rows
 * and their meta: each call adds counts[r] (r != self) times the size of
 * type. What MPI was asked to move, against which the reported traffic is
 * checked (tests/mpi/ep_forward_test). */
void moe_comm_count_posted(const int *counts, int G, int self, MPI_Datatype type);
/* The same for one-sided transfers (ep_ll.c): count items of type between
 * this rank and rank `peer`, put or got, counted when peer != self. */
void moe_comm_count_rma(int count, MPI_Datatype type, int peer, int self);
double moe_comm_posted_bytes(void);

/* Rank 0 prints "moe-ep: error: MESSAGE" to stderr. */
void moe_comm_print_error(const moe_comm *c, const moe_status *st);

/* Collective: the maximum of v over ranks, on every rank. */
double moe_comm_max(const moe_comm *c, double v);
double moe_comm_min(const moe_comm *c, double v);
double moe_comm_sum(const moe_comm *c, double v);
/* Element-wise sum of v (n) over ranks, in place on every rank. */
void moe_comm_sum_array(const moe_comm *c, double *v, int n);
/* v (n) = the sum of every rank's v in rank order (0 + v_0 + v_1 + ...), the
 * same bits on every rank and in every run with the same G (MPI_Allreduce
 * promises neither); chunks of v travel by MPI_Allgather. */
void moe_comm_sum_ordered(const moe_comm *c, double *v, moe_index n);
/* mine (n) = the sum over ranks of their v[rank * n, rank * n + n), v
 * (G, n), in rank order as moe_comm_sum_ordered sums (chunks travel by
 * MPI_Alltoall). */
void moe_comm_sum_scattered(const moe_comm *c, const double *v, moe_index n, double *mine);
/* all (G, n) on rank 0 = every rank's v (n); all is ignored elsewhere. */
void moe_comm_gather_doubles(const moe_comm *c, const double *v, int n, double *all);
/* all on rank 0 = every rank's `bytes` bytes of mine, in rank order (all is
 * ignored elsewhere). Collective. */
void moe_comm_gather_bytes(const moe_comm *c, const void *mine, size_t bytes, void *all);
/* The same on every rank (MPI_Allgather). */
void moe_comm_allgather_bytes(const moe_comm *c, const void *mine, size_t bytes, void *all);
/* The same with a size per rank: rank 0 receives a malloc'd *all and the
 * sizes (G), NULL elsewhere. Returns MOE_EXIT_RUNTIME on every rank when a
 * size passes what one MPI count can say (2 GiB). Collective. */
int moe_comm_gatherv_bytes(const moe_comm *c, const void *mine, size_t bytes, void **all,
                           size_t *sizes, moe_status *st);
/* Point to point: `bytes` bytes to or from rank `peer` (blocking; in
 * pieces of at most 1 GiB, so any size travels). */
void moe_comm_send_bytes(const moe_comm *c, int peer, const void *buf, size_t bytes);
void moe_comm_recv_bytes(const moe_comm *c, int peer, void *buf, size_t bytes);
/* The plain all-to-all anchor of moe-ep bench: a blocking MPI_Alltoallv
 * sending rows[r] rows of row_bytes bytes to each rank r, buffers and counts set up
 * once (prepare, collective) so that run times the call alone. */
typedef struct moe_alltoallv_anchor moe_alltoallv_anchor;
moe_alltoallv_anchor *moe_comm_alltoallv_prepare(const moe_comm *c, const double *rows, double row_bytes);
void moe_comm_alltoallv_run(moe_alltoallv_anchor *a);
void moe_comm_alltoallv_free(moe_alltoallv_anchor *a);
/* Element-wise maximum of v (n) over ranks, in place. */
void moe_comm_max_array(const moe_comm *c, double *v, int n);
/* The maximum of v over ranks and the lowest rank holding it. */
double moe_comm_maxloc(const moe_comm *c, double v, int *rank);
/* Broadcast n bytes from `root`. */
void moe_comm_bcast(const moe_comm *c, void *buf, int bytes, int root);
void moe_comm_barrier(const moe_comm *c);
/* A barrier that sleeps between polls (a millisecond) instead of spinning:
 * the ranks that wait leave their cores to one that measures them. */
void moe_comm_barrier_idle(const moe_comm *c);

/* Gather every rank's events on rank 0: offset (G+1) and events there
 * (caller frees both), NULL elsewhere. Collective. */
void moe_comm_gather_events(const moe_comm *c, const moe_event *events, int count, int **offset,
                            moe_event **all);

#endif
