/* SPDX-License-Identifier: MIT */
/* comm.c — MPI start-up, thread settings and collective errors (see comm.h). */
#define _GNU_SOURCE /* sched_getaffinity, dl_iterate_phdr */
#include "config.h"

#include "moe/comm.h"

#ifdef HAVE_DL_ITERATE_PHDR
#include <dlfcn.h>
#include <link.h>
#endif
#include <limits.h>
#include <malloc.h>
#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "moe/gemm.h"
#include "moe/progress.h"
#include "moe/watchdog.h"

/* This process alone: the machine's online cores, and the cores it may run
 * on (its binding), as bound and as the host's. */
static void own_cores(moe_comm *c)
{
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    c->cores = cores > 0 ? (int)cores : 1;
    c->bound = c->host_cores = c->cores;
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) {
        c->bound = CPU_COUNT(&set);
        c->host_cores = c->bound < c->cores ? c->bound : c->cores;
    }
#endif
}

/* Ranks on one machine share its cores: more threads than cores would make
 * the threads fight (and time-slice) instead of adding speed; so would more
 * threads than the cores a rank is bound to. A rank's share: the cores
 * over the host's ranks, at most its binding, at least one. */
static int core_share(const moe_comm *c)
{
    int threads = c->cores / c->ranks_on_host;
    if (threads > c->bound)
        threads = c->bound;
    return threads < 1 ? 1 : threads;
}

/* Whether the environment names a thread count (OMP_NUM_THREADS,
 * OPENBLAS_NUM_THREADS): then it wins over the share. */
static bool env_names(const char *variable)
{
    const char *value = getenv(variable);
    return value && *value;
}

/* The OpenMP team for expert GEMMs of kind gemm (moe_comm_threads_for). */
static int team_for(const moe_comm *c, enum moe_gemm_kind gemm)
{
    return gemm == MOE_GEMM_BLAS && moe_gemm_threads() > 1 ? 1 : c->threads;
}

void moe_comm_attach(moe_comm *c, MPI_Comm comm)
{
    c->comm = comm;
    MOE_MPI(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    MOE_MPI(MPI_Comm_rank(comm, &c->rank));
    MOE_MPI(MPI_Comm_size(comm, &c->ranks));
    MPI_Comm host;
    MOE_MPI(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &host));
    MOE_MPI(MPI_Comm_size(host, &c->ranks_on_host));
    /* Real nodes: equal, of consecutive ranks (rank 0 of each host's group
     * at a multiple of its size), or none to speak of. */
    int host_rank, consecutive, all;
    MOE_MPI(MPI_Comm_rank(host, &host_rank));
    consecutive = c->rank / c->ranks_on_host * c->ranks_on_host + host_rank == c->rank &&
                  c->ranks % c->ranks_on_host == 0;
    MOE_MPI(MPI_Allreduce(&consecutive, &all, 1, MPI_INT, MPI_LAND, comm));
    int sizes[2] = {c->ranks_on_host, -c->ranks_on_host}, extremes[2];
    MOE_MPI(MPI_Allreduce(sizes, extremes, 2, MPI_INT, MPI_MAX, comm));
    c->node_ranks = all && extremes[0] == -extremes[1] ? c->ranks_on_host : 0;
    own_cores(c);
#ifdef __linux__
    cpu_set_t set, any;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) {
        /* every rank takes part, each with its own mask: the host's union */
        MOE_MPI(MPI_Allreduce(&set, &any, (int)sizeof set, MPI_BYTE, MPI_BOR, host));
        c->host_cores = CPU_COUNT(&any) < c->cores ? CPU_COUNT(&any) : c->cores;
    }
#endif
    MOE_MPI(MPI_Comm_free(&host));
    int least;
    MOE_MPI(MPI_Allreduce(&c->bound, &least, 1, MPI_INT, MPI_MIN, comm));
    c->bound = least;
    c->threads = core_share(c);
}

/* The name of the MPI function in a call's text: "MPI_Alltoallv(...)". */
static void call_name(const char *call, char *name, size_t size)
{
    const size_t len = strcspn(call, "(");
    snprintf(name, size, "%.*s", (int)(len < size ? len : size - 1), call);
}

void moe_mpi_check(int rc, const char *call, const char *file, int line)
{
    static bool fault_spent; /* the injected fault fires once */
    char name[64], text[MPI_MAX_ERROR_STRING + 64];
    call_name(call, name, sizeof name);
    moe_status fault = {0};
    if (rc == MPI_SUCCESS) {
        const moe_comm me = {.rank = moe_message_rank};
        if (fault_spent || !strstr(name, "lltoallv") || !moe_fault_here(&me, "mpi", &fault))
            return;
        fault_spent = true;
        snprintf(text, sizeof text, "%.300s", fault.message);
    } else {
        int len = 0;
        if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS)
            snprintf(text, sizeof text, "error code %d", rc);
    }
    moe_status st = {0};
    moe_fail(&st, MOE_EXIT_RUNTIME, "%s failed at %s:%d: %.300s", name, file, line, text);
    const moe_comm world = {.comm = MPI_COMM_WORLD, .rank = moe_message_rank};
    moe_comm_abort(&world, &st);
}

/* moe_fatal under MPI: the rank's message, then the job ends (exit 3).
 * When every rank runs out at once (the same allocation on all), rank 0
 * speaks first and its MPI_Abort ends the others before they print: one
 * line. A rank that fails alone still prints, a moment later: 3 s, since on
 * two loaded cores (three test jobs, their ranks oversubscribed) an abort
 * once took longer than 1 s to reach the other ranks. */
static void abort_world(const moe_status *st)
{
    if (moe_message_rank != 0) {
        const struct timespec moment = {3, 0};
        nanosleep(&moment, NULL);
    }
    const moe_comm world = {.comm = MPI_COMM_WORLD, .rank = moe_message_rank};
    moe_comm_abort(&world, st);
}

void moe_comm_init(int *argc, char ***argv, moe_comm *c)
{
    /* The wave path keeps its large buffers across forwards (ep.h), so a
     * forward neither allocates nor faults pages in. For a process that
     * starts MPI here without the program's main (the MPI test programs),
     * everything else large is mmap'd and handed back when freed, at a
     * fixed threshold (glibc would otherwise raise it as large blocks are
     * freed and keep them in the heap): the resident memory is then what
     * is live. The moe-ep program turns the mappings off before this
     * (main.c: a training step's freed buffers stay in the heap for the
     * next step), so that there this threshold has no effect. A library
     * caller starts MPI itself and keeps its own allocator's settings
     * (moe-ep.h, at moe_ep_context_backward). */
    mallopt(M_MMAP_THRESHOLD, 1 << 20);
    /* The progress thread (--progress thread) serialises its MPI calls with
     * the compute thread's, so SERIALIZED suffices; ask for MULTIPLE, which
     * libraries that grant it also grant as SERIALIZED. */
    MOE_MPI(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &moe_progress_thread_level));
    moe_comm_attach(c, MPI_COMM_WORLD);
    moe_message_rank = c->rank;
    moe_fatal = abort_world;

    /* The process is the program's own: its threads stay set. */
#ifdef _OPENMP
    if (!env_names("OMP_NUM_THREADS"))
        omp_set_num_threads(c->threads);
    c->threads = omp_get_max_threads();
#endif
    if (!env_names("OPENBLAS_NUM_THREADS"))
        moe_gemm_set_threads(c->threads);
}

/* Launchers announce a started process in its environment: Open MPI's
 * mpirun, MPICH's Hydra and Intel MPI (PMI), PMIx-based ones and
 * MVAPICH. */
static bool launched(void)
{
    static const char *const marks[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMI_FD",
                                        "PMIX_RANK", "MV2_COMM_WORLD_SIZE"};
    for (size_t n = 0; n < sizeof marks / sizeof *marks; n++)
        if (getenv(marks[n]))
            return true;
    return false;
}

void moe_comm_init_deferred(int *argc, char ***argv, moe_comm *c)
{
    if (launched()) {
        moe_comm_init(argc, argv, c);
        return;
    }
    *c = (moe_comm){.comm = MPI_COMM_NULL, .rank = 0, .ranks = 1, .ranks_on_host = 1, .node_ranks = 1};
    own_cores(c);
    c->threads = 1;
}

void moe_comm_start(moe_comm *c)
{
    if (c->comm == MPI_COMM_NULL)
        moe_comm_init(NULL, NULL, c);
}

moe_thread_settings moe_comm_threads_borrow(const moe_comm *c, enum moe_gemm_kind gemm)
{
    moe_thread_settings was = {0, 0};
#ifdef _OPENMP
    /* read first: an OpenBLAS built on OpenMP sets OpenMP's count with its own */
    const int omp_before = omp_get_max_threads();
#endif
    if (!env_names("OPENBLAS_NUM_THREADS") && moe_gemm_threads() != c->threads) {
        was.blas = moe_gemm_threads();
        moe_gemm_set_threads(c->threads);
    }
#ifdef _OPENMP
    if (!env_names("OMP_NUM_THREADS")) {
        was.omp = omp_before;
        omp_set_num_threads(team_for(c, gemm));
    }
#else
    (void)gemm;
#endif
    return was;
}

void moe_comm_threads_return(const moe_thread_settings *was)
{
    if (was->blas) /* first, for the same reason */
        moe_gemm_set_threads(was->blas);
#ifdef _OPENMP
    if (was->omp)
        omp_set_num_threads(was->omp);
#endif
}

int moe_comm_threads_for(const moe_comm *c, enum moe_gemm_kind gemm)
{
#ifdef _OPENMP
    if (!env_names("OMP_NUM_THREADS"))
        omp_set_num_threads(team_for(c, gemm));
    return omp_get_max_threads();
#else
    (void)gemm;
    return c->threads;
#endif
}

int moe_comm_agree(const moe_comm *c, moe_status *st)
{
    if (c->ranks == 1) /* alone: its own message, with or without MPI */
        return st->code;
    /* MPI_MAXLOC keeps the highest code and, among equal codes, the lowest
     * rank: that rank's message is the one printed. */
    int mine[2] = {st->code, c->rank}, worst[2];
    MOE_MPI(MPI_Allreduce(mine, worst, 1, MPI_2INT, MPI_MAXLOC, c->comm));
    const int code = worst[0], lowest = worst[1];
    if (code == MOE_EXIT_OK)
        return code;
    char message[MOE_MESSAGE_MAX];
    if (c->rank == lowest)
        snprintf(message, sizeof message, "%s", st->message);
    MOE_MPI(MPI_Bcast(message, sizeof message, MPI_CHAR, lowest, c->comm));
    if (lowest != 0)
        snprintf(st->message, sizeof st->message, "rank %d: %.480s", lowest, message);
    else
        snprintf(st->message, sizeof st->message, "%s", message);
    st->code = code;
    return code;
}

/* A copy of root's text on every rank. */
static char *bcast_text(const moe_comm *c, const char *text, int root)
{
    long len = (long)strlen(text);
    MOE_MPI(MPI_Bcast(&len, 1, MPI_LONG, root, c->comm));
    char *copy = moe_xmalloc((size_t)len + 1);
    if (c->rank == root)
        memcpy(copy, text, (size_t)len);
    MOE_MPI(MPI_Bcast(copy, (int)len, MPI_CHAR, root, c->comm));
    copy[len] = '\0';
    return copy;
}

int moe_comm_same_config(const moe_comm *c, const char *text, moe_status *st)
{
    const int G = c->ranks;
    if (G == 1)
        return MOE_EXIT_OK;
    const uint64_t mine = moe_digest64(text, strlen(text));
    uint64_t *all = moe_xmalloc(sizeof(uint64_t) * (size_t)G);
    MOE_MPI(MPI_Allgather(&mine, 1, MPI_UINT64_T, all, 1, MPI_UINT64_T, c->comm));
    int other = 0;
    while (other < G && all[other] == all[0])
        other++;
    free(all);
    if (other == G)
        return MOE_EXIT_OK;
    /* Every rank learns rank 0's text and that of the first rank that
     * differs from it, and names the same key: one message everywhere. */
    char *zero = bcast_text(c, text, 0), *theirs = bcast_text(c, text, other);
    const char *a = zero, *b = theirs;
    while (*a && *a == *b) { /* to the first differing line */
        a++;
        b++;
    }
    while (a > zero && a[-1] != '\n')
        a--, b--;
    const int la = (int)strcspn(a, "\n"), lb = (int)strcspn(b, "\n");
    moe_fail(st, MOE_EXIT_USAGE,
             "the ranks were started with different configurations: rank 0 has '%.*s', rank %d "
             "has '%.*s' (give every rank the same arguments, presets and files)",
             la > 150 ? 150 : la, a, other, lb > 150 ? 150 : lb, b);
    free(theirs);
    free(zero);
    return st->code;
}

static double posted_bytes;

void moe_comm_count_posted(const int *counts, int G, int self, MPI_Datatype type)
{
    int size;
    MOE_MPI(MPI_Type_size(type, &size));
    for (int r = 0; r < G; r++)
        if (r != self)
            posted_bytes += (double)counts[r] * size;
}

void moe_comm_count_rma(int count, MPI_Datatype type, int peer, int self)
{
    int size;
    MOE_MPI(MPI_Type_size(type, &size));
    if (peer != self)
        posted_bytes += (double)count * size;
}

double moe_comm_posted_bytes(void) { return posted_bytes; }

void moe_comm_print_error(const moe_comm *c, const moe_status *st)
{
    if (c->rank == 0) {
        fprintf(stderr, "moe-ep: error: %s\n", st->message);
        fflush(stderr);
    }
}

double moe_comm_max(const moe_comm *c, double v)
{
    double out;
    MOE_MPI(MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, c->comm));
    return out;
}

double moe_comm_sum(const moe_comm *c, double v)
{
    double out;
    MOE_MPI(MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_SUM, c->comm));
    return out;
}

double moe_comm_min(const moe_comm *c, double v)
{
    double out;
    MOE_MPI(MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MIN, c->comm));
    return out;
}

void moe_comm_max_array(const moe_comm *c, double *v, int n)
{
    MOE_MPI(MPI_Allreduce(MPI_IN_PLACE, v, n, MPI_DOUBLE, MPI_MAX, c->comm));
}

double moe_comm_maxloc(const moe_comm *c, double v, int *rank)
{
    struct {
        double value;
        int rank;
    } in = {v, c->rank}, out;
    MOE_MPI(MPI_Allreduce(&in, &out, 1, MPI_DOUBLE_INT, MPI_MAXLOC, c->comm));
    *rank = out.rank;
    return out.value;
}

void moe_comm_bcast(const moe_comm *c, void *buf, int bytes, int root)
{
    MOE_MPI(MPI_Bcast(buf, bytes, MPI_BYTE, root, c->comm));
}

void moe_comm_barrier(const moe_comm *c) { MOE_MPI(MPI_Barrier(c->comm)); }

void moe_comm_barrier_idle(const moe_comm *c)
{
    MPI_Request request;
    MOE_MPI(MPI_Ibarrier(c->comm, &request));
    for (int done = 0;;) {
        MOE_MPI(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
        if (done)
            return;
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
}

#ifdef HAVE_DL_ITERATE_PHDR
static int keep_component(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size;
    (void)arg;
    if (info->dlpi_name && strstr(info->dlpi_name, "/mca_"))
        (void)dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD | RTLD_NODELETE);
    return 0;
}
#endif

/* Open MPI unloads its components (mca_*.so) in MPI_Finalize, and the
 * leak checkers run after it, at exit: their frames in the components then
 * lie in no module. LeakSanitizer names none of them, and re-reads the
 * process's memory map for every such frame as it matches its
 * suppressions (Open MPI's own leaks): that took about half of each
 * sanitizer build's MPI run (`mpirun -np 2 moe-ep run --preset tiny`:
 * 1.53-1.90 s, 0.82-1.03 s with the components kept). So each loaded
 * component is opened once more first, RTLD_NOLOAD | RTLD_NODELETE:
 * nothing new loads, and what is loaded stays mapped until the process
 * ends. Open MPI 4.1.4 has no parameter for it; MPICH has no components. */
void moe_comm_finalize(void)
{
    int started = 0;
    MPI_Initialized(&started);
    if (!started)
        return;
#ifdef HAVE_DL_ITERATE_PHDR
    dl_iterate_phdr(keep_component, NULL);
#endif
    MOE_MPI(MPI_Finalize());
}

void moe_comm_gather_events(const moe_comm *c, const moe_event *events, int count, int **offset,
                            moe_event **all)
{
    const int G = c->ranks;
    int *counts = c->rank == 0 ? moe_xmalloc(sizeof(int) * (size_t)G) : NULL;
    int *bytes = c->rank == 0 ? moe_xmalloc(sizeof(int) * (size_t)G) : NULL;
    int *displs = c->rank == 0 ? moe_xmalloc(sizeof(int) * (size_t)G) : NULL;
    MOE_MPI(MPI_Gather(&count, 1, MPI_INT, counts, 1, MPI_INT, 0, c->comm));
    *offset = NULL;
    *all = NULL;
    if (c->rank == 0) {
        *offset = moe_xmalloc(sizeof(int) * (size_t)(G + 1));
        (*offset)[0] = 0;
        for (int r = 0; r < G; r++) {
            (*offset)[r + 1] = (*offset)[r] + counts[r];
            bytes[r] = counts[r] * (int)sizeof(moe_event);
            displs[r] = (*offset)[r] * (int)sizeof(moe_event);
        }
        *all = moe_xmalloc(sizeof(moe_event) * (size_t)(*offset)[G]);
    }
    MOE_MPI(MPI_Gatherv(events, count * (int)sizeof(moe_event), MPI_BYTE, *all, bytes, displs, MPI_BYTE,
                        0, c->comm));
    free(displs);
    free(bytes);
    free(counts);
}

void moe_comm_sum_array(const moe_comm *c, double *v, int n)
{
    MOE_MPI(MPI_Allreduce(MPI_IN_PLACE, v, n, MPI_DOUBLE, MPI_SUM, c->comm));
}

/* sum[j] = parts[0][j] + parts[1][j] + ... in rank order, for `ranks`
 * parts of m values each laid out one after another: the same bits on
 * every rank, whatever the MPI library's reduction order. */
static void sum_by_rank(const double *parts, int ranks, int m, double *sum)
{
    for (int j = 0; j < m; j++) {
        double s = 0.0;
        for (int r = 0; r < ranks; r++)
            s += parts[(moe_index)r * m + j];
        sum[j] = s;
    }
}

void moe_comm_sum_ordered(const moe_comm *c, double *v, moe_index n)
{
    const moe_index chunk = (moe_index)1 << 16;
    double *all = moe_xmalloc(sizeof(double) * (size_t)(chunk * c->ranks));
    for (moe_index first = 0; first < n; first += chunk) {
        const int m = (int)(n - first < chunk ? n - first : chunk);
        MOE_MPI(MPI_Allgather(v + first, m, MPI_DOUBLE, all, m, MPI_DOUBLE, c->comm));
        sum_by_rank(all, c->ranks, m, v + first);
    }
    free(all);
}

void moe_comm_sum_scattered(const moe_comm *c, const double *v, moe_index n, double *mine)
{
    const int G = c->ranks;
    const moe_index chunk = (moe_index)1 << 16;
    double *send = moe_xmalloc(sizeof(double) * (size_t)(chunk * G));
    double *recv = moe_xmalloc(sizeof(double) * (size_t)(chunk * G));
    for (moe_index first = 0; first < n; first += chunk) {
        const int m = (int)(n - first < chunk ? n - first : chunk);
        for (int r = 0; r < G; r++)
            memcpy(send + (moe_index)r * m, v + (moe_index)r * n + first, sizeof(double) * (size_t)m);
        MOE_MPI(MPI_Alltoall(send, m, MPI_DOUBLE, recv, m, MPI_DOUBLE, c->comm));
        sum_by_rank(recv, G, m, mine + first);
    }
    free(recv);
    free(send);
}

void moe_comm_gather_doubles(const moe_comm *c, const double *v, int n, double *all)
{
    MOE_MPI(MPI_Gather(v, n, MPI_DOUBLE, all, n, MPI_DOUBLE, 0, c->comm));
}

void moe_comm_gather_bytes(const moe_comm *c, const void *mine, size_t bytes, void *all)
{
    MOE_ASSERT(bytes <= (size_t)INT_MAX);
    MOE_MPI(MPI_Gather(mine, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE, 0, c->comm));
}

void moe_comm_allgather_bytes(const moe_comm *c, const void *mine, size_t bytes, void *all)
{
    MOE_ASSERT(bytes <= (size_t)INT_MAX);
    MOE_MPI(MPI_Allgather(mine, (int)bytes, MPI_BYTE, all, (int)bytes, MPI_BYTE, c->comm));
}

enum { PIECE = 1 << 30, TAG_BYTES = 7 };

void moe_comm_send_bytes(const moe_comm *c, int peer, const void *buf, size_t bytes)
{
    size_t at = 0;
    do { /* one message even for no bytes */
        const size_t n = bytes - at < PIECE ? bytes - at : PIECE;
        MOE_MPI(MPI_Send((const char *)buf + at, (int)n, MPI_BYTE, peer, TAG_BYTES, c->comm));
        at += n;
    } while (at < bytes);
}

void moe_comm_recv_bytes(const moe_comm *c, int peer, void *buf, size_t bytes)
{
    size_t at = 0;
    do {
        const size_t n = bytes - at < PIECE ? bytes - at : PIECE;
        MOE_MPI(MPI_Recv((char *)buf + at, (int)n, MPI_BYTE, peer, TAG_BYTES, c->comm, MPI_STATUS_IGNORE));
        at += n;
    } while (at < bytes);
}

int moe_comm_gatherv_bytes(const moe_comm *c, const void *mine, size_t bytes, void **all,
                           size_t *sizes, moe_status *st)
{
    /* Counts and displacements are ints: every size and the total must fit. */
    const int G = c->ranks;
    long long mine_count = (long long)bytes, *counts = NULL;
    if (c->rank == 0)
        counts = moe_xmalloc(sizeof(long long) * (size_t)G);
    MOE_MPI(MPI_Gather(&mine_count, 1, MPI_LONG_LONG, counts, 1, MPI_LONG_LONG, 0, c->comm));
    moe_status local = {0};
    long long total = 0;
    for (int r = 0; c->rank == 0 && r < G; r++)
        total += counts[r];
    if (total > INT_MAX)
        moe_fail(&local, MOE_EXIT_RUNTIME, "%lld bytes to gather on rank 0, more than one MPI count "
                 "(2 GiB): dump a smaller config", total);
    if (moe_comm_agree(c, &local)) {
        free(counts);
        *st = local;
        return st->code;
    }
    int *icounts = NULL, *displs = NULL;
    *all = NULL;
    if (c->rank == 0) {
        icounts = moe_xmalloc(sizeof(int) * (size_t)G);
        displs = moe_xmalloc(sizeof(int) * (size_t)G);
        for (int r = 0, at = 0; r < G; r++) {
            icounts[r] = (int)counts[r];
            displs[r] = at;
            sizes[r] = (size_t)counts[r];
            at += icounts[r];
        }
        *all = moe_xmalloc((size_t)total + 1);
    }
    MOE_MPI(MPI_Gatherv(mine, (int)bytes, MPI_BYTE, *all, icounts, displs, MPI_BYTE, 0, c->comm));
    free(displs);
    free(icounts);
    free(counts);
    return MOE_EXIT_OK;
}

bool moe_fault_here(const moe_comm *c, const char *stage, moe_status *st)
{
    moe_watch_stage_named(stage);
    const double delay = moe_fault_delay(c->rank, stage);
    if (isinf(delay)) /* a stuck rank: the watchdog's to find */
        for (;;)
            pause();
    if (delay > 0) { /* a slow rank: late, not failing */
        const struct timespec wait = {(time_t)delay, (long)((delay - (double)(time_t)delay) * 1e9)};
        nanosleep(&wait, NULL);
        return false;
    }
    if (!moe_fault_armed(c->rank, stage))
        return false;
    moe_fail(st, MOE_EXIT_RUNTIME, "injected fault at stage %s on rank %d (MOE_EP_FAULT)", stage,
             c->rank);
    return true;
}

void moe_comm_abort(const moe_comm *c, const moe_status *st)
{
    fprintf(stderr, "moe-ep: error: rank %d: %s\n", c->rank, st->message);
    fflush(stderr);
    /* The launcher forwards a rank's output through a pipe; MPICH's kills
     * the job on MPI_Abort without draining it, and the message above was
     * lost about one run in twenty. A moment lets it reach the terminal. */
    const struct timespec moment = {0, 200 * 1000 * 1000};
    nanosleep(&moment, NULL);
    MPI_Abort(c->comm, MOE_EXIT_RUNTIME);
    abort(); /* MPI_Abort does not return */
}

struct moe_alltoallv_anchor {
    MPI_Comm comm;
    MPI_Datatype row;
    int *send, *recv, *send_at, *recv_at; /* (G) each */
    unsigned char *send_buf, *recv_buf;
};

moe_alltoallv_anchor *moe_comm_alltoallv_prepare(const moe_comm *c, const double *rows, double row_bytes)
{
    const int G = c->ranks;
    moe_alltoallv_anchor *a = moe_xcalloc(1, sizeof *a);
    a->comm = c->comm;
    a->send = moe_xmalloc(sizeof(int) * (size_t)G);
    a->recv = moe_xmalloc(sizeof(int) * (size_t)G);
    a->send_at = moe_xmalloc(sizeof(int) * (size_t)G);
    a->recv_at = moe_xmalloc(sizeof(int) * (size_t)G);
    for (int r = 0; r < G; r++)
        a->send[r] = (int)rows[r];
    MOE_MPI(MPI_Alltoall(a->send, 1, MPI_INT, a->recv, 1, MPI_INT, c->comm));
    long long out = 0, in = 0;
    for (int r = 0; r < G; r++) {
        a->send_at[r] = (int)out;
        a->recv_at[r] = (int)in;
        out += a->send[r];
        in += a->recv[r];
    }
    const size_t bytes = (size_t)row_bytes;
    MOE_MPI(MPI_Type_contiguous((int)bytes, MPI_BYTE, &a->row));
    MOE_MPI(MPI_Type_commit(&a->row));
    /* Written, not just allocated: untouched pages all map the one zero page,
     * which a copy reads from cache, faster than any real data. */
    a->send_buf = moe_xmalloc(bytes * (size_t)out + 1);
    a->recv_buf = moe_xmalloc(bytes * (size_t)in + 1);
    for (size_t n = 0; n < bytes * (size_t)out + 1; n++)
        a->send_buf[n] = (unsigned char)(n % 251);
    memset(a->recv_buf, 0, bytes * (size_t)in + 1);
    return a;
}

void moe_comm_alltoallv_run(moe_alltoallv_anchor *a)
{
    MOE_MPI(MPI_Alltoallv(a->send_buf, a->send, a->send_at, a->row, a->recv_buf, a->recv, a->recv_at,
                          a->row, a->comm));
}

void moe_comm_alltoallv_free(moe_alltoallv_anchor *a)
{
    MOE_MPI(MPI_Type_free(&a->row));
    free(a->recv_buf);
    free(a->send_buf);
    free(a->recv_at);
    free(a->send_at);
    free(a->recv);
    free(a->send);
    free(a);
}
