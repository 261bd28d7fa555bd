/* SPDX-License-Identifier: MIT */
/* common.h — status reporting, invariant checks and checked allocation.
 *
 * Errors that come from user input or the environment are values
 * (moe_status) that the caller reports; broken invariants are bugs and stop
 * the process with the rank, file and line. Nothing here calls MPI: the rank
 * used in messages is set once by the comm layer.
 */
#ifndef MOE_COMMON_H
#define MOE_COMMON_H

#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "moe/dims.h"

/* Exit codes, the same on every rank. */
enum {
    MOE_EXIT_OK = 0,
    MOE_EXIT_CHECK_FAILED = 1,
    MOE_EXIT_USAGE = 2,   /* bad flag, preset or config */
    MOE_EXIT_RUNTIME = 3, /* MPI, I/O or memory failure while running */
};

/* The widest registers a kernel chosen at run time may use (the packed
 * GEMM's tiles, the gate's logits): whatever the CPU has, at most AVX2 with
 * FMA, or no SIMD beyond what every x86-64 (or other) CPU has. Every choice
 * gives the same bits; tests, bench and --packed-isa force the narrower
 * ones to compare them. */
enum moe_isa { MOE_ISA_WIDEST, MOE_ISA_AVX2, MOE_ISA_PORTABLE };

/* Defined where the compiler builds the x86 kernels and the CPU is asked at
 * run time which may run (GCC or Clang on x86-64). */
#if defined(__x86_64__) && defined(__GNUC__)
#define MOE_X86_KERNELS 1
#endif

/* Whether a kernel held to `limit` may use AVX2 with FMA, or AVX-512F (with
 * AVX2 and FMA), on this CPU. */
bool moe_isa_avx2(enum moe_isa limit);
bool moe_isa_avx512(enum moe_isa limit);

#define MOE_MESSAGE_MAX 512

typedef struct {
    int code;                      /* one of MOE_EXIT_*; MOE_EXIT_OK means no error */
    char message[MOE_MESSAGE_MAX]; /* one line, no "moe-ep: error:" prefix */
} moe_status;

/* Set code and a printf-style message; returns code so callers can
 * `return moe_fail(st, MOE_EXIT_USAGE, ...)`. Never fails. */
int moe_fail(moe_status *st, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The rank printed by invariant failures; -1 until the comm layer sets it. */
extern int moe_message_rank;

void moe_assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn));

#define MOE_ASSERT(cond) \
    ((cond) ? (void)0 : moe_assert_fail(#cond, __FILE__, __LINE__))

/* The exit-3 path for failures no caller can recover from (an allocation
 * that fails): prints "moe-ep: error: [rank R: ]MESSAGE" and ends the process
 * (the comm layer installs one that ends the whole job, MPI_Abort with exit
 * status 3). Does not return. */
extern void (*moe_fatal)(const moe_status *st);

/* How the default moe_fatal ends a failure on this thread (the library's
 * calls set it; the CLI installs its own moe_fatal and never does): with
 * `point` set, the call that set it resumes there (longjmp; a call with no
 * MPI in flight, which returns the status, moe_recovery_lost, instead of
 * ending the process); else with `end` set, end(st, arg) (a collective
 * call: the job ends on its communicator, the ranks waiting in it with
 * it). Not from inside an OpenMP parallel region, where the process ends
 * as before. */
typedef struct {
    jmp_buf *point;
    void (*end)(const moe_status *st, void *arg);
    void *arg;
} moe_recovery;

/* Scratch for each thread of a parallel region is allocated before it
 * (a failure inside one cannot be handed back): moe_thread_slots() blocks,
 * the thread's moe_thread_slot() (its number in the region). 1 and 0
 * without OpenMP. */
int moe_thread_slots(void);
int moe_thread_slot(void);

/* Make r this thread's recovery; returns the one it replaces, for
 * moe_recovery_set to put back when the call returns. */
moe_recovery moe_recovery_set(moe_recovery r);

/* The failure the last jump to a recovery point on this thread carried
 * (kept outside the caller's frame, which a longjmp leaves indeterminate). */
const moe_status *moe_recovery_lost(void);

/* malloc that never returns NULL: on failure the size, file and line and a
 * hint go to moe_fatal (one line, exit status 3 on every rank).
 * Large buffers whose failure should be reported collectively are allocated
 * with plain malloc by the comm layer instead. A zero size returns a valid
 * unique pointer. */
void *moe_malloc_check(size_t bytes, const char *file, int line);
void *moe_calloc_check(size_t count, size_t size, const char *file, int line);
#define moe_xmalloc(bytes) moe_malloc_check((bytes), __FILE__, __LINE__)
#define moe_xcalloc(count, size) moe_calloc_check((count), (size), __FILE__, __LINE__)

/* moe_xmalloc starting on a cache line (64 bytes), for a GEMM's output
 * written whole: its rows then do not straddle lines (a 64-byte store
 * across two costs both, and the weight gradients, 1024 x 1024 floats an
 * expert, ran at 68 instead of 86 GFLOP/s a core from malloc's 16-byte
 * alignment). Freed with free(). */
void *moe_malloc_lines_check(size_t bytes, const char *file, int line);
#define moe_xmalloc_lines(bytes) moe_malloc_lines_check((bytes), __FILE__, __LINE__)

/* malloc whose failure is recorded in st (a runtime error naming the size,
 * what it was for and the rank) instead of aborting, so that the ranks can
 * agree on it; a first failure is kept. A zero size gives a valid pointer. */
void *moe_try_malloc(size_t bytes, const char *what, int rank, moe_status *st);

/* moe_try_malloc for a large block that will be touched whole (the experts'
 * weights): from 2 MiB up, 2 MiB-aligned and, on Linux, marked for
 * transparent huge pages (MADV_HUGEPAGE), so that its first touch faults
 * once per 2 MiB rather than once per 4 KiB page. Freed with free(). */
void *moe_try_malloc_huge(size_t bytes, const char *what, int rank, moe_status *st);

/* A buffer kept across calls: moe_buffer_fit gives it at least `bytes`,
 * reusing the block it has when that is big enough and not more than a third
 * larger (so a smaller need hands memory back rather than holding it). The
 * contents are not kept. On failure (recorded in st as moe_try_malloc does)
 * the buffer is empty and NULL is returned. */
typedef struct {
    void *data;
    size_t bytes;
} moe_buffer;

void *moe_buffer_fit(moe_buffer *b, size_t bytes, const char *what, int rank, moe_status *st);
void moe_buffer_free(moe_buffer *b);

/* Blocks kept across calls that take and give back the same sizes each
 * time (a forward's, a training step's large buffers), so that a loop of
 * calls does not hand them to the system and fault them in again.
 * moe_pool_take hands out the smallest idle block moe_buffer_fit would keep
 * for `bytes`, or else a new one, after freeing the idle blocks smaller
 * than `bytes` (their memory goes back to the heap rather than sitting
 * idle beside the new block); failure as moe_try_malloc. moe_pool_give
 * takes a block back, idle (a pointer the pool did not hand out is freed;
 * NULL does nothing; an idle block given again is an internal error, as a
 * double free). pool NULL: moe_try_malloc and free. The contents are not
 * kept. One thread takes and gives. */
typedef struct {
    moe_buffer buffer;
    bool busy;
} moe_pool_block;

typedef struct {
    moe_pool_block *block;
    int n;
} moe_pool;

void *moe_pool_take(moe_pool *pool, size_t bytes, const char *what, int rank, moe_status *st);
/* moe_pool_take that ends the run as moe_xmalloc does when memory runs out. */
#define moe_pool_xtake(pool, bytes) moe_pool_take_check((pool), (bytes), __FILE__, __LINE__)
void *moe_pool_take_check(moe_pool *pool, size_t bytes, const char *file, int line);
void moe_pool_give(moe_pool *pool, void *data);
void moe_pool_free(moe_pool *pool);

/* A 64-bit digest of n bytes (four FNV-1a chains over interleaved 8-byte
 * words, combined, then the tail words and bytes): enough to tell whether
 * two outputs are the same bits. */
uint64_t moe_digest64(const void *data, size_t n);

/* max(v) / mean(v) over n values, 0 when they sum to 0: a load's imbalance. */
double moe_max_over_mean(const double *v, int n);

/* counts (n) and displs (n) as MPI wants them (ints) from row counts count (n). */
void moe_to_counts(const moe_index *count, int n, int *counts, int *displs);

/* Open an input file (a preset, a cluster, a safetensors file, a manifest)
 * for reading; only a regular file will do, so a directory, a FIFO or a
 * device is refused at once instead of read forever. NULL on failure, with
 * a usage error "WHATcannot read 'PATH': why" in st. */
FILE *moe_open_input(const char *what, const char *path, moe_status *st);

/* Fault injection for the tests: MOE_EP_FAULT=RANK:STAGE makes rank RANK
 * fail at STAGE, one of moe_fault_stages (NULL-terminated): the forward's
 * stages and the dump fail as an allocation or I/O failure would (comm.h),
 * mpi fails an MPI call, write fails the golden writer after its first file
 * (as a full disk would), kill ends the writing process with SIGKILL there,
 * term sends it SIGTERM there (as mpirun passes on a Ctrl-C).
 * moe_fault_validate refuses a malformed value, or a rank past the job's
 * `ranks` (a fault that would never fire), with exit 2, and
 * moe_fault_validate_writer a dump's fault in a run that writes no set
 * (`dumping` false) or a writer's (write, kill, term) on a rank but 0;
 * moe_fault_armed says whether `rank` is to fail at `stage`.
 * MOE_EP_FAULT=RANK:slow=MS@STAGE (STAGE plan, dispatch, experts or
 * combine) makes rank RANK sleep MS milliseconds each time the forward
 * passes STAGE (every wave), and fail nowhere: moe_fault_delay gives those
 * seconds for (rank, stage), 0 elsewhere; RANK:stall@STAGE stops it there
 * for good (INFINITY), for the watchdog (watchdog.h) to find. */
extern const char *const moe_fault_stages[];
int moe_fault_validate(int ranks, moe_status *st);
int moe_fault_validate_writer(bool dumping, moe_status *st);
bool moe_fault_armed(int rank, const char *stage);
double moe_fault_delay(int rank, const char *stage);

/* Bytes of memory this machine can still give (MemAvailable), or its
 * physical memory when that is unknown. */
double moe_memory_available(void);

/* Peak resident memory of this process in bytes since the last
 * moe_peak_rss_reset (Linux's VmHWM, which writing 5 to
 * /proc/self/clear_refs resets; elsewhere the lifetime peak, getrusage).
 * The reset first returns the heap's free pages to the system. */
double moe_peak_rss(void);
void moe_peak_rss_reset(void);

/* Human-readable byte count ("1.50 GiB") into buf; returns buf. */
char *moe_format_bytes(double bytes, char *buf, size_t size);

/* The median of v (n); sorts v. */
double moe_median(double *v, int n);

/* Well-formed UTF-8 (no overlong forms, surrogates or code points past
 * U+10FFFF). */
bool moe_utf8_valid(const char *text);

/* A number as moe-ep reads it: a digit first, or a sign then a digit when
 * `sign` (no leading space, "+ 1", "inf" or "nan"), or ".5". */
bool moe_number_start(const char *value, bool sign);

/* A comma-separated list of decimal integers in [min, max], strictly (no
 * spaces, signs or empty items), into out: their count; -1 when an item is
 * not such an integer, -2 when there are more than `capacity`. */
int moe_parse_int_list(const char *text, int64_t min, int64_t max, int64_t *out, int capacity);

#endif
