/* SPDX-License-Identifier: MIT */
/* watchdog.c — the stuck-rank watchdog (see watchdog.h). */
#define _POSIX_C_SOURCE 200809L
#include "moe/watchdog.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "moe/clock.h"
#include "moe/common.h"

const char *const moe_watch_place_names[MOE_WATCH_PLACES] = {
    "the forward's start", "route", "plan", "dispatch", "experts", "combine", "reduce",
    "the forward's end", "the backward's all-to-alls",
};

/* One rank's place on its host's board; every field is read by the other
 * ranks' watchdog threads and written by its own main thread (atomically). */
typedef struct {
    int rank;          /* in the job */
    int place, wave;   /* where it is (moe_watch_stage) */
    int waiting;       /* 1 while it waits at (wait_place, wait_wave) */
    int wait_place, wait_wave;
    long long waits;   /* waits begun so far: the same sequence on every rank */
    long long since;   /* clock time (clock.h) the wait began, in ns */
    char pad[16];
} board_slot;

typedef struct {
    int claimed; /* the job rank + 1 of the rank writing the report; 0 none */
    int ranks;   /* on this host */
    int job_ranks;
    char pad[52];
} board_head;

static struct {
    bool on;
    double limit;
    MPI_Comm host;
    MPI_Win win;
    board_head *head;
    board_slot *slots; /* (ranks on the host) */
    board_slot *mine;
    pthread_t thread;
    int stop;
} dog;

enum moe_watch_place moe_watch_place_named(const char *stage)
{
    for (int p = 0; p < MOE_WATCH_PLACES; p++)
        if (!strcmp(stage, moe_watch_place_names[p]))
            return (enum moe_watch_place)p;
    return MOE_WATCH_PLACES;
}

static int load(const int *v) { return __atomic_load_n(v, __ATOMIC_ACQUIRE); }

/* The report of this rank's wait, then exit status 3. */
static void report(double waited)
{
    const board_slot *me = dog.mine;
    const long long n = __atomic_load_n(&me->waits, __ATOMIC_ACQUIRE);
    char arrived[512] = "", behind[1024] = "";
    size_t a = 0, b = 0;
    int count = 0; /* ranks arrived */
    /* the ranks behind: first those in no wait (stuck or slow where they
     * are), then those waiting further back (for them, as likely as not) */
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < dog.head->ranks; i++) {
            const board_slot *s = &dog.slots[i];
            if (s == me)
                continue;
            const long long theirs = __atomic_load_n(&s->waits, __ATOMIC_ACQUIRE);
            const int waiting = load(&s->waiting);
            const int place = waiting ? load(&s->wait_place) : load(&s->place);
            const int wave = waiting ? load(&s->wait_wave) : load(&s->wave);
            if (theirs >= n) {
                if (pass == 0 && a < sizeof arrived - 16) {
                    a += (size_t)snprintf(arrived + a, sizeof arrived - a, "%s%d", a ? ", " : "", s->rank);
                    count++;
                }
                continue;
            }
            if (waiting != pass || b >= sizeof behind - 128)
                continue;
            b += (size_t)snprintf(behind + b, sizeof behind - b, "%srank %d %s%s", b ? "; " : "",
                                  s->rank, waiting ? "waiting at " : "at ", moe_watch_place_names[place]);
            if (wave >= 0)
                b += (size_t)snprintf(behind + b, sizeof behind - b, " (wave %d)", wave);
            if (!waiting)
                b += (size_t)snprintf(behind + b, sizeof behind - b, ", in no wait");
        }
    const int place = load(&me->wait_place), wave = load(&me->wait_wave);
    char where[64];
    snprintf(where, sizeof where, "%s", moe_watch_place_names[place]);
    if (wave >= 0)
        snprintf(where + strlen(where), sizeof where - strlen(where), " (wave %d)", wave);
    fprintf(stderr,
            "moe-ep: error: watchdog: rank %d waited %.1f s (--watchdog %g) at %s; arrived there: "
            "%s%s; not arrived: %s%s\n",
            me->rank, waited, dog.limit, where, count > 1 ? "ranks " : count ? "rank " : "",
            count ? arrived : "none but it",
            b ? behind : "none on this host",
            dog.head->ranks < dog.head->job_ranks ? " (ranks on other hosts are not on this host's "
                                                    "board)" : "");
    fflush(stderr);
    _exit(MOE_EXIT_RUNTIME);
}

static void *watch(void *unused)
{
    (void)unused;
    const struct timespec tick = {0, 50 * 1000 * 1000};
    while (!__atomic_load_n(&dog.stop, __ATOMIC_ACQUIRE)) {
        nanosleep(&tick, NULL);
        if (!load(&dog.mine->waiting))
            continue;
        const double waited =
            moe_clock_now() - 1e-9 * (double)__atomic_load_n(&dog.mine->since, __ATOMIC_ACQUIRE);
        int none = 0;
        if (waited > dog.limit && load(&dog.mine->waiting) &&
            __atomic_compare_exchange_n(&dog.head->claimed, &none, dog.mine->rank + 1, false,
                                        __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            report(waited);
    }
    return NULL;
}

void moe_watchdog_start(const moe_comm *c, double seconds)
{
    if (!(seconds > 0) || dog.on)
        return;
    MOE_MPI(MPI_Comm_split_type(c->comm, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &dog.host));
    int host_rank, host_ranks;
    MOE_MPI(MPI_Comm_rank(dog.host, &host_rank));
    MOE_MPI(MPI_Comm_size(dog.host, &host_ranks));
    /* rank 0 of the host holds the head and every slot, contiguous */
    const MPI_Aint bytes = host_rank == 0 ? (MPI_Aint)(sizeof(board_head) + sizeof(board_slot) * (size_t)host_ranks)
                                          : 0;
    void *base;
    MOE_MPI(MPI_Win_allocate_shared(bytes, 1, MPI_INFO_NULL, dog.host, &base, &dog.win));
    MPI_Aint size;
    int unit;
    MOE_MPI(MPI_Win_shared_query(dog.win, 0, &size, &unit, &base));
    dog.head = base;
    dog.slots = (board_slot *)(dog.head + 1);
    dog.mine = &dog.slots[host_rank];
    memset(dog.mine, 0, sizeof *dog.mine);
    dog.mine->rank = c->rank;
    dog.mine->wave = -1;
    if (host_rank == 0) {
        memset(dog.head, 0, sizeof *dog.head);
        dog.head->ranks = host_ranks;
        dog.head->job_ranks = c->ranks;
    }
    MOE_MPI(MPI_Barrier(dog.host)); /* the board written before anyone reads it */
    dog.limit = seconds;
    dog.stop = 0;
    dog.on = pthread_create(&dog.thread, NULL, watch, NULL) == 0;
}

void moe_watchdog_stop(void)
{
    if (!dog.on)
        return;
    __atomic_store_n(&dog.stop, 1, __ATOMIC_RELEASE);
    pthread_join(dog.thread, NULL);
    dog.on = false;
    /* The board's rule, checked at every run's end: the ranks of a host
     * entered the same number of waits (else a rank arrived would read as
     * behind, or one behind as arrived). */
    long long waits[2] = {dog.mine->waits, -dog.mine->waits}; /* max, -min */
    MOE_MPI(MPI_Allreduce(MPI_IN_PLACE, waits, 2, MPI_LONG_LONG, MPI_MAX, dog.host));
    MOE_ASSERT(waits[0] == -waits[1]);
    MOE_MPI(MPI_Win_free(&dog.win));
    MOE_MPI(MPI_Comm_free(&dog.host));
}

void moe_watch_stage(enum moe_watch_place place, int wave)
{
    if (!dog.on)
        return;
    __atomic_store_n(&dog.mine->wave, wave, __ATOMIC_RELEASE);
    __atomic_store_n(&dog.mine->place, (int)place, __ATOMIC_RELEASE);
}

void moe_watch_stage_named(const char *stage)
{
    const enum moe_watch_place place = moe_watch_place_named(stage);
    if (dog.on && place < MOE_WATCH_PLACES)
        __atomic_store_n(&dog.mine->place, (int)place, __ATOMIC_RELEASE);
}

void moe_watch_wait(enum moe_watch_place place, int wave)
{
    if (!dog.on)
        return;
    if (place >= MOE_WATCH_PLACES) /* a stage the board does not name */
        place = MOE_WATCH_START;
    moe_watch_stage(place, wave);
    __atomic_store_n(&dog.mine->wait_place, (int)place, __ATOMIC_RELEASE);
    __atomic_store_n(&dog.mine->wait_wave, wave, __ATOMIC_RELEASE);
    __atomic_store_n(&dog.mine->since, (long long)(1e9 * moe_clock_now()), __ATOMIC_RELEASE);
    __atomic_add_fetch(&dog.mine->waits, 1, __ATOMIC_ACQ_REL);
    __atomic_store_n(&dog.mine->waiting, 1, __ATOMIC_RELEASE);
}

void moe_watch_done(void)
{
    if (dog.on)
        __atomic_store_n(&dog.mine->waiting, 0, __ATOMIC_RELEASE);
}
