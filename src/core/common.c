/* SPDX-License-Identifier: MIT */
/* common.c — status, invariant and allocation helpers (see common.h). */
#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* madvise, MADV_HUGEPAGE */
#include "moe/common.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

int moe_message_rank = -1;

int moe_fail(moe_status *st, int code, const char *fmt, ...)
{
    char raw[MOE_MESSAGE_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(raw, sizeof raw, fmt, ap);
    va_end(ap);
    /* One line whatever the values echoed in it hold: controls are escaped. */
    size_t at = 0;
    for (const unsigned char *c = (const unsigned char *)raw; *c && at + 5 < sizeof st->message; c++) {
        if (*c == '\n')
            at += (size_t)snprintf(st->message + at, sizeof st->message - at, "\\n");
        else if (*c < 0x20 || *c == 0x7f)
            at += (size_t)snprintf(st->message + at, sizeof st->message - at, "\\x%02x", *c);
        else
            st->message[at++] = (char)*c;
    }
    st->message[at] = '\0';
    st->code = code;
    return code;
}

void moe_assert_fail(const char *expr, const char *file, int line)
{
    fprintf(stderr, "moe-ep: internal error on rank %d at %s:%d: assertion `%s' failed\n",
            moe_message_rank, file, line, expr);
    fflush(stderr);
    abort();
}

int moe_thread_slots(void)
{
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

int moe_thread_slot(void)
{
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static _Thread_local moe_recovery recovery;
static _Thread_local moe_status lost;

moe_recovery moe_recovery_set(moe_recovery r)
{
    const moe_recovery was = recovery;
    recovery = r;
    return was;
}

const moe_status *moe_recovery_lost(void) { return &lost; }

/* Until the comm layer installs its own (which ends the job with MPI_Abort):
 * this thread's recovery when it has one (a library call's), else the
 * message, then exit status 3. */
static void exit_runtime(const moe_status *st)
{
#ifdef _OPENMP
    const bool parallel = omp_in_parallel();
#else
    const bool parallel = false;
#endif
    if (recovery.point && !parallel) {
        lost = *st;
        longjmp(*recovery.point, 1);
    }
    if (recovery.end)
        recovery.end(st, recovery.arg);
    fprintf(stderr, "moe-ep: error: %s\n", st->message);
    fflush(stderr);
    exit(MOE_EXIT_RUNTIME);
}

void (*moe_fatal)(const moe_status *st) = exit_runtime;

static void out_of_memory(size_t bytes, const char *file, int line)
{
    char text[32];
    moe_status st = {0};
    moe_fail(&st, MOE_EXIT_RUNTIME,
             "cannot allocate %s at %s:%d (use fewer --tokens or a smaller model, or fewer ranks "
             "per machine)",
             moe_format_bytes((double)bytes, text, sizeof text), file, line);
    moe_fatal(&st);
    abort(); /* moe_fatal does not return */
}

void *moe_malloc_check(size_t bytes, const char *file, int line)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p)
        out_of_memory(bytes, file, line);
    return p;
}

void *moe_malloc_lines_check(size_t bytes, const char *file, int line)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 1) != 0)
        out_of_memory(bytes, file, line);
    return p;
}

void *moe_calloc_check(size_t count, size_t size, const char *file, int line)
{
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p)
        out_of_memory(count * size, file, line);
    return p;
}

char *moe_format_bytes(double bytes, char *buf, size_t size)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    int u = 0;
    while (bytes >= 1024.0 && u < 6) {
        bytes /= 1024.0;
        u++;
    }
    snprintf(buf, size, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
    return buf;
}

double moe_memory_available(void)
{
    FILE *fp = fopen("/proc/meminfo", "r");
    char line[256];
    double kib = -1.0;
    while (fp && fgets(line, sizeof line, fp))
        if (strncmp(line, "MemAvailable:", 13) == 0 && sscanf(line + 13, "%lf", &kib) == 1)
            break;
    if (fp)
        fclose(fp);
    if (kib > 0)
        return kib * 1024.0;
    return (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
}

/* moe_try_malloc's failure: recorded in st (a first failure is kept); NULL. */
static void *failed(size_t bytes, const char *what, int rank, moe_status *st)
{
    if (st->code == MOE_EXIT_OK) {
        char text[32];
        moe_fail(st, MOE_EXIT_RUNTIME, "cannot allocate %s for %s on rank %d",
                 moe_format_bytes((double)bytes, text, sizeof text), what, rank);
    }
    return NULL;
}

/* Whether b's block serves a need of `bytes`: big enough, and not more
 * than a third larger. */
static bool keeps(const moe_buffer *b, size_t bytes)
{
    return b->data && bytes <= b->bytes && b->bytes - b->bytes / 4 <= bytes;
}

void *moe_buffer_fit(moe_buffer *b, size_t bytes, const char *what, int rank, moe_status *st)
{
    if (keeps(b, bytes))
        return b->data;
    moe_buffer_free(b); /* first, so old and new never coexist */
    b->data = moe_try_malloc(bytes, what, rank, st);
    b->bytes = b->data ? bytes : 0;
    return b->data;
}

void moe_buffer_free(moe_buffer *b)
{
    free(b->data);
    b->data = NULL;
    b->bytes = 0;
}

void *moe_pool_take(moe_pool *pool, size_t bytes, const char *what, int rank, moe_status *st)
{
    if (!pool)
        return moe_try_malloc(bytes, what, rank, st);
    moe_pool_block *best = NULL, *empty = NULL;
    for (int n = 0; n < pool->n; n++) {
        moe_pool_block *b = &pool->block[n];
        if (!b->busy && keeps(&b->buffer, bytes) && (!best || b->buffer.bytes < best->buffer.bytes))
            best = b;
    }
    if (!best) {
        for (int n = 0; n < pool->n; n++) {
            moe_pool_block *b = &pool->block[n];
            if (!b->busy && b->buffer.data && b->buffer.bytes < bytes)
                moe_buffer_free(&b->buffer);
            if (!b->busy && !b->buffer.data && !empty)
                empty = b;
        }
        if (!empty) {
            moe_pool_block *grown = realloc(pool->block, sizeof *grown * (size_t)(pool->n + 1));
            if (!grown)
                return failed(bytes, what, rank, st);
            pool->block = grown;
            empty = &pool->block[pool->n++];
            *empty = (moe_pool_block){0};
        }
        if (!moe_buffer_fit(&empty->buffer, bytes, what, rank, st))
            return NULL;
        best = empty;
    }
    best->busy = true;
    return best->buffer.data;
}

void *moe_pool_take_check(moe_pool *pool, size_t bytes, const char *file, int line)
{
    moe_status st = {0};
    void *p = moe_pool_take(pool, bytes, "", 0, &st);
    if (!p)
        out_of_memory(bytes, file, line);
    return p;
}

void moe_pool_give(moe_pool *pool, void *data)
{
    if (!data)
        return;
    for (int n = 0; pool && n < pool->n; n++)
        if (pool->block[n].buffer.data == data) {
            MOE_ASSERT(pool->block[n].busy); /* given twice: the double free it stands for */
            pool->block[n].busy = false;
            return;
        }
    free(data);
}

void moe_pool_free(moe_pool *pool)
{
    for (int n = 0; n < pool->n; n++)
        moe_buffer_free(&pool->block[n].buffer);
    free(pool->block);
    *pool = (moe_pool){0};
}

uint64_t moe_digest64(const void *data, size_t n)
{
    const unsigned char *p = data;
    const uint64_t prime = 0x100000001b3u;
    /* four chains, each over every fourth word: one chain waits on its
     * multiply for every word (7 GB/s on a Zen 5 core, 29 ms for a training
     * step's 200 MiB of gradients a rank at `laptop`); four keep the
     * multiplier busy (27 GB/s, 8 ms) */
    uint64_t h0 = 0xcbf29ce484222325u, h1 = 0x84222325cbf29ce4u, h2 = 0xcbf29ce4u, h3 = 0x84222325u;
    for (; n >= 32; n -= 32, p += 32) {
        uint64_t w[4];
        memcpy(w, p, sizeof w);
        h0 = (h0 ^ w[0]) * prime;
        h1 = (h1 ^ w[1]) * prime;
        h2 = (h2 ^ w[2]) * prime;
        h3 = (h3 ^ w[3]) * prime;
    }
    uint64_t d = (((h0 ^ h1) * prime ^ h2) * prime ^ h3) * prime;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t w;
        memcpy(&w, p, sizeof w);
        d = (d ^ w) * prime;
    }
    for (; n > 0; n--, p++)
        d = (d ^ *p) * prime;
    return d;
}

void *moe_try_malloc(size_t bytes, const char *what, int rank, moe_status *st)
{
    void *p = malloc(bytes ? bytes : 1);
    return p ? p : failed(bytes, what, rank, st);
}

void *moe_try_malloc_huge(size_t bytes, const char *what, int rank, moe_status *st)
{
#ifdef MADV_HUGEPAGE
    enum { HUGE_PAGE = 2 << 20 };
    void *p = NULL;
    if (bytes >= HUGE_PAGE && posix_memalign(&p, HUGE_PAGE, bytes) == 0) {
        (void)madvise(p, bytes / HUGE_PAGE * HUGE_PAGE, MADV_HUGEPAGE); /* a hint: may be refused */
        return p;
    }
#endif
    return moe_try_malloc(bytes, what, rank, st);
}

void moe_to_counts(const moe_index *count, int n, int *counts, int *displs)
{
    moe_index offset = 0;
    for (int r = 0; r < n; r++) {
        counts[r] = (int)count[r];
        displs[r] = (int)offset;
        offset += count[r];
    }
}

const char *const moe_fault_stages[] = {"generate", "plan", "dispatch", "experts", "combine",
                                        "dump", "mpi", "write", "kill", "term", NULL};

/* The stages a slow fault may delay: those the forward passes each time. */
static const char *const slow_stages[] = {"plan", "dispatch", "experts", "combine", NULL};

/* MOE_EP_FAULT=RANK:STAGE or RANK:slow=MS@STAGE: a rank in [0, 2^20), a
 * known stage (for slow, one of slow_stages, and MS in [1, 60000]), nothing
 * else. *delay is the slow fault's seconds, 0 for a failing one. */
static bool fault_spec_delay(long *rank, const char **stage, double *delay)
{
    const char *spec = getenv("MOE_EP_FAULT");
    if (!spec || !*spec)
        return false;
    char *end;
    errno = 0;
    *rank = (spec[0] >= '0' && spec[0] <= '9') ? strtol(spec, &end, 10) : -1;
    if (*rank < 0 || *rank >= (1 << 20) || errno || *end != ':')
        return false;
    const char *name = end + 1;
    const char *const *known = moe_fault_stages;
    *delay = 0.0;
    if (!strncmp(name, "stall@", 6)) { /* slow for ever */
        *delay = INFINITY;
        name += 6;
        known = slow_stages;
    } else if (!strncmp(name, "slow=", 5)) {
        const char *ms = name + 5;
        const long v = (ms[0] >= '0' && ms[0] <= '9') ? strtol(ms, &end, 10) : -1;
        if (v < 1 || v > 60000 || errno || *end != '@')
            return false;
        *delay = (double)v * 1e-3;
        name = end + 1;
        known = slow_stages;
    }
    for (const char *const *s = known; *s; s++)
        if (!strcmp(name, *s)) {
            *stage = *s;
            return true;
        }
    return false;
}

static bool fault_spec(long *rank, const char **stage)
{
    double delay;
    return fault_spec_delay(rank, stage, &delay) && delay == 0.0;
}

int moe_fault_validate(int ranks, moe_status *st)
{
    long rank;
    const char *stage, *spec = getenv("MOE_EP_FAULT");
    if (!spec || !*spec)
        return MOE_EXIT_OK;
    double delay;
    if (fault_spec_delay(&rank, &stage, &delay))
        return rank < ranks ? MOE_EXIT_OK
                            : moe_fail(st, MOE_EXIT_USAGE,
                                       "MOE_EP_FAULT names rank %ld, but the job has %d rank%s "
                                       "(0..%d): the fault would never fire", rank, ranks,
                                       ranks == 1 ? "" : "s", ranks - 1);
    char names[160] = "";
    for (const char *const *s = moe_fault_stages; *s; s++)
        snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", *s, s[1] ? "|" : "");
    return moe_fail(st, MOE_EXIT_USAGE,
                    "MOE_EP_FAULT must be RANK:STAGE, STAGE one of %s, or RANK:slow=MS@STAGE or "
                    "RANK:stall@STAGE, MS in [1, 60000] and STAGE one of plan|dispatch|experts|combine, "
                    "got '%.60s'",
                    names, spec);
}

int moe_fault_validate_writer(bool dumping, moe_status *st)
{
    long rank;
    const char *stage;
    if (!fault_spec(&rank, &stage))
        return MOE_EXIT_OK;
    const bool writer = !strcmp(stage, "write") || !strcmp(stage, "kill") || !strcmp(stage, "term");
    if ((!writer && strcmp(stage, "dump")) || (dumping && (!writer || rank == 0)))
        return MOE_EXIT_OK;
    return moe_fail(st, MOE_EXIT_USAGE, "MOE_EP_FAULT=%ld:%s fires in %s: it would never fire here",
                    rank, stage, !writer ? "a run with --dump"
                                 : dumping ? "the golden set's writer, rank 0"
                                           : "the golden set's writer, rank 0 of a run with --dump");
}

double moe_fault_delay(int rank, const char *stage)
{
    long want;
    const char *armed;
    double delay;
    return fault_spec_delay(&want, &armed, &delay) && want == rank && !strcmp(armed, stage) ? delay
                                                                                             : 0.0;
}

bool moe_fault_armed(int rank, const char *stage)
{
    long want;
    const char *armed;
    return fault_spec(&want, &armed) && want == rank && !strcmp(armed, stage);
}

FILE *moe_open_input(const char *what, const char *path, moe_status *st)
{
    /* Non-blocking, so that a FIFO without a writer cannot stall the open. */
    const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        moe_fail(st, MOE_EXIT_USAGE, "%scannot read '%s': %s", what, path, strerror(errno));
        return NULL;
    }
    struct stat info;
    const char *wrong = fstat(fd, &info) != 0          ? "cannot stat it"
                        : S_ISDIR(info.st_mode)         ? "it is a directory"
                        : !S_ISREG(info.st_mode)        ? "it is not a regular file (a FIFO, device or socket)"
                                                        : NULL;
    FILE *fp = wrong ? NULL : (fcntl(fd, F_SETFL, 0), fdopen(fd, "rb"));
    if (!fp) {
        close(fd);
        moe_fail(st, MOE_EXIT_USAGE, "%scannot read '%s': %s", what, path, wrong ? wrong : strerror(errno));
    }
    return fp;
}

void moe_peak_rss_reset(void)
{
    /* The heap never shrinks by itself (main.c turns trimming off): give
     * back what is free now, so the peak from here is what is held from
     * here, not what earlier work left resident. */
#ifdef __GLIBC__
    malloc_trim(0);
#endif
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (f) {
        fputs("5", f);
        fclose(f);
    }
}

double moe_peak_rss(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    double kib = -1.0;
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "VmHWM:", 6) == 0)
            kib = strtod(line + 6, NULL);
    if (f)
        fclose(f);
    if (kib < 0) {
        struct rusage usage;
        getrusage(RUSAGE_SELF, &usage);
        kib = (double)usage.ru_maxrss;
    }
    return kib * 1024.0;
}

double moe_max_over_mean(const double *v, int n)
{
    double max = 0.0, sum = 0.0;
    for (int i = 0; i < n; i++) {
        max = v[i] > max ? v[i] : max;
        sum += v[i];
    }
    return sum > 0 ? max * n / sum : 0.0;
}

bool moe_isa_avx2(enum moe_isa limit)
{
#ifdef MOE_X86_KERNELS
    return limit != MOE_ISA_PORTABLE && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma");
#else
    (void)limit;
    return false;
#endif
}

bool moe_isa_avx512(enum moe_isa limit)
{
#ifdef MOE_X86_KERNELS
    return limit == MOE_ISA_WIDEST && moe_isa_avx2(limit) && __builtin_cpu_supports("avx512f");
#else
    (void)limit;
    return false;
#endif
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double moe_median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, compare_doubles);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

bool moe_utf8_valid(const char *text)
{
    for (const unsigned char *c = (const unsigned char *)text; *c;) {
        int extra = *c < 0x80 ? 0 : (*c & 0xe0) == 0xc0 ? 1 : (*c & 0xf0) == 0xe0 ? 2
                  : (*c & 0xf8) == 0xf0 ? 3 : -1;
        if (extra < 0)
            return false;
        uint32_t point = extra ? *c & (0x3f >> extra) : *c;
        c++;
        for (int n = 0; n < extra; n++, c++) {
            if ((*c & 0xc0) != 0x80)
                return false;
            point = point << 6 | (*c & 0x3f);
        }
        static const uint32_t least[] = {0, 0x80, 0x800, 0x10000};
        if (point < least[extra] || point > 0x10ffff || (point >= 0xd800 && point <= 0xdfff))
            return false;
    }
    return true;
}

bool moe_number_start(const char *value, bool sign)
{
    const char *c = value;
    if (sign && (*c == '-' || *c == '+'))
        c++;
    if (*c == '.')
        c++;
    return isdigit((unsigned char)*c);
}

int moe_parse_int_list(const char *text, int64_t min, int64_t max, int64_t *out, int capacity)
{
    int count = 0;
    for (const char *item = text;; item++) {
        char *end;
        errno = 0;
        const long long v = strtoll(item, &end, 10);
        if (!moe_number_start(item, false) || (*end != ',' && *end != '\0') || errno == ERANGE ||
            v < min || v > max)
            return -1;
        if (count == capacity)
            return -2;
        out[count++] = v;
        if (*end == '\0')
            return count;
        item = end;
    }
}
