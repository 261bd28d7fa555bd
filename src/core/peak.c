/* SPDX-License-Identifier: MIT */
/* peak.c — the cores' fp32 FMA rate at each vector width (see peak.h). */
#define _POSIX_C_SOURCE 200809L
#include "moe/peak.h"
#include "moe/common.h"

#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86_FMA 1
#endif

const int moe_fma_bits[MOE_FMA_WIDTHS] = {128, 256, 512};

double moe_monotonic_seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Each chain is acc = acc * m + a with m just below one: it settles near
 * a / (1 - m), so no value overflows or turns subnormal, and every FMA
 * depends on the one before it in its chain only. */
#define CHAIN_M 0.999999f
#define CHAIN_A 1e-6f

#ifdef HAVE_X86_FMA
/* Not instrumented in a sanitizer build: checks on the accumulators would
 * keep them in memory, and the rate would be the checks', not the cores'. */
#define PEAK_LOOP __attribute__((no_sanitize("address", "undefined"), optimize("unroll-loops")))

/* 12 chains of 4 or 8 lanes (16 registers: 12 accumulators, m and a), 16
 * of 16 lanes (32 registers); the latency of an FMA (4 or 5 cycles) times
 * two units is at most 10 in flight. Returns the chains' sum, so that the
 * compiler keeps them. */
#define CHAINS(type, set1, fma, add, lanes, n)                                          \
    {                                                                                   \
        const type m = set1(CHAIN_M), a = set1(CHAIN_A);                                \
        type acc[n];                                                                    \
        for (int c = 0; c < n; c++)                                                     \
            acc[c] = set1((float)c);                                                    \
        for (long i = 0; i < iterations; i++)                                           \
            for (int c = 0; c < n; c++) /* unrolled: n independent chains */            \
                acc[c] = fma(acc[c], m, a);                                             \
        for (int c = 1; c < n; c++)                                                     \
            acc[0] = add(acc[0], acc[c]);                                               \
        float out[lanes];                                                               \
        memcpy(out, &acc[0], sizeof out);                                               \
        float sum = 0.0f;                                                               \
        for (int l = 0; l < lanes; l++)                                                 \
            sum += out[l];                                                              \
        return sum;                                                                     \
    }

__attribute__((target("fma"))) PEAK_LOOP
static float chains128(long iterations)
CHAINS(__m128, _mm_set1_ps, _mm_fmadd_ps, _mm_add_ps, 4, 12)

__attribute__((target("avx2,fma"))) PEAK_LOOP
static float chains256(long iterations)
CHAINS(__m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps, 8, 12)

__attribute__((target("avx512f"))) PEAK_LOOP
static float chains512(long iterations)
CHAINS(__m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps, 16, 16)
#endif

bool moe_fma_supported(int bits)
{
#ifdef HAVE_X86_FMA
    switch (bits) {
    case 128:
        return __builtin_cpu_supports("fma");
    case 256:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case 512:
        return __builtin_cpu_supports("avx512f");
    }
#else
    (void)bits;
#endif
    return false;
}

int moe_fma_widest_bits(void)
{
    int bits = 0;
    for (int w = 0; w < MOE_FMA_WIDTHS; w++)
        if (moe_fma_supported(moe_fma_bits[w]))
            bits = moe_fma_bits[w] > bits ? moe_fma_bits[w] : bits;
    return bits;
}

/* FMAs (lanes) one iteration of the width's chains issues. */
static double fmas_per_iteration(int bits)
{
    return bits == 512 ? 16.0 * 16.0 : 12.0 * (double)(bits / 32);
}

static volatile float peak_sink; /* the chains' sums land here */

/* The median FLOP/s of each width `want` names (rate[w] for moe_fma_bits[w]:
 * 0 where not wanted or not supported), their batches taken in turn, one of
 * each width after another, so that every width sees the same clock. */
static void fma_medians(const bool want[MOE_FMA_WIDTHS], double seconds,
                        double rate[MOE_FMA_WIDTHS])
{
    bool run[MOE_FMA_WIDTHS], any = false;
    for (int w = 0; w < MOE_FMA_WIDTHS; w++) {
        rate[w] = 0.0;
        run[w] = want[w] && moe_fma_supported(moe_fma_bits[w]);
        any |= run[w];
    }
    if (!any)
        return;
#ifdef HAVE_X86_FMA
    float (*const chains[MOE_FMA_WIDTHS])(long) = {chains128, chains256, chains512};
    const long iterations = 1L << 16; /* about 0.2-0.5 ms at any width */
    enum { MAX_BATCHES = 1 << 14 };
    double *batch[MOE_FMA_WIDTHS] = {NULL};
    for (int w = 0; w < MOE_FMA_WIDTHS; w++)
        if (run[w]) {
            batch[w] = moe_xmalloc(sizeof(double) * MAX_BATCHES);
            chains[w](iterations / 16); /* warm-up: the wide units power on */
        }
    int batches = 0;
    const double start = moe_monotonic_seconds();
    while (batches < MAX_BATCHES && (batches < 3 || moe_monotonic_seconds() - start < seconds)) {
        for (int w = 0; w < MOE_FMA_WIDTHS; w++)
            if (run[w]) {
                const double t = moe_monotonic_seconds();
                peak_sink = chains[w](iterations);
                batch[w][batches] = 2.0 * fmas_per_iteration(moe_fma_bits[w]) * (double)iterations /
                                    (moe_monotonic_seconds() - t);
            }
        batches++;
    }
    for (int w = 0; w < MOE_FMA_WIDTHS; w++)
        if (run[w]) {
            rate[w] = moe_median(batch[w], batches);
            free(batch[w]);
        }
#else
    (void)seconds;
#endif
}

double moe_fma_rate(int bits, double seconds)
{
    bool want[MOE_FMA_WIDTHS];
    double rate[MOE_FMA_WIDTHS];
    int at = -1;
    for (int w = 0; w < MOE_FMA_WIDTHS; w++) {
        want[w] = moe_fma_bits[w] == bits;
        at = want[w] ? w : at;
    }
    fma_medians(want, seconds, rate);
    return at < 0 ? 0.0 : rate[at];
}

void moe_fma_rates(double seconds, double rate[MOE_FMA_WIDTHS])
{
    const bool all[MOE_FMA_WIDTHS] = {true, true, true};
    fma_medians(all, seconds, rate);
}

static volatile float bandwidth_sink; /* the sums, kept */

/* The sum of the n floats at v (n a multiple of READ_STEP) in READ_SUMS
 * vectors of 16 sums, held in registers: at 512 bits one add a 64-byte
 * line, so the loads set the pace. (16 sums in an array, as the compiler
 * kept them, took an SSE add and a store every 16 bytes, and read 17.5
 * GB/s on a Zen 5 core that reads 35.) */
typedef float read_lanes __attribute__((vector_size(64)));
enum { READ_LANES = 16, READ_SUMS = 4, READ_STEP = READ_LANES * READ_SUMS,
       READ_BLOCK = 1 << 14 /* floats a call */ };

__attribute__((target_clones("avx512f", "avx2", "default")))
static float sum_floats(const float *v, size_t n)
{
    read_lanes s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, x;
    for (size_t i = 0; i < n; i += READ_STEP) {
        memcpy(&x, v + i, sizeof x);
        s0 += x;
        memcpy(&x, v + i + READ_LANES, sizeof x);
        s1 += x;
        memcpy(&x, v + i + 2 * READ_LANES, sizeof x);
        s2 += x;
        memcpy(&x, v + i + 3 * READ_LANES, sizeof x);
        s3 += x;
    }
    const read_lanes s = (s0 + s1) + (s2 + s3);
    float total = 0.0f;
    for (int j = 0; j < READ_LANES; j++)
        total += s[j];
    return total;
}

double moe_read_bandwidth(size_t bytes, int passes)
{
    const size_t blocks = bytes / sizeof(float) / READ_BLOCK, n = blocks * READ_BLOCK;
    float *v = moe_xmalloc_lines(sizeof(float) * n + 1); /* a load a line, not two */
    const int slots = moe_thread_slots();
    float *sums = moe_xcalloc((size_t)slots, sizeof(float));
    for (size_t i = 0; i < n; i++) /* real pages, small values */
        v[i] = (float)(i % 61) * (1.0f / 64.0f);
    double best = 0.0;
    for (int pass = 0; pass < passes; pass++) {
        const double t = moe_monotonic_seconds();
#pragma omp parallel
        {
            float acc = 0.0f;
#pragma omp for schedule(static)
            for (size_t b = 0; b < blocks; b++)
                acc += sum_floats(v + b * READ_BLOCK, READ_BLOCK);
            sums[moe_thread_slot()] += acc;
        }
        const double rate = (double)(n * sizeof(float)) / (moe_monotonic_seconds() - t);
        best = rate > best ? rate : best;
    }
    bandwidth_sink = sums[0];
    free(sums);
    free(v);
    return best;
}

void moe_cpu_model(char *name, size_t size)
{
    /* The first processor's lines: its model name, family and model number */
    static const char *const keys[] = {"model name", "cpu family", "model\t"};
    char value[3][128] = {"", "", ""};
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    while (f && fgets(line, sizeof line, f) && line[0] != '\n') {
        const char *colon = strchr(line, ':');
        for (int n = 0; colon && n < 3; n++)
            if (strncmp(line, keys[n], strlen(keys[n])) == 0) {
                const char *v = colon + 1 + (colon[1] == ' ');
                snprintf(value[n], sizeof value[n], "%.*s", (int)strcspn(v, "\n"), v);
            }
    }
    if (f)
        fclose(f);
    if (!value[0][0])
        snprintf(name, size, "unknown CPU");
    else if (value[1][0] && value[2][0])
        snprintf(name, size, "%s (family %s, model %s)", value[0], value[1], value[2]);
    else
        snprintf(name, size, "%s", value[0]);
}

/* The first line of `path`, or false. */
static bool read_line(const char *path, char *line, size_t size)
{
    FILE *f = fopen(path, "r");
    const bool got = f && fgets(line, (int)size, f);
    if (f)
        fclose(f);
    return got;
}

/* The CPUs a sysfs CPU list names ("0-1", "0-7,64-71"). */
static long cpus_in_list(const char *list)
{
    long n = 0;
    for (const char *c = list; *c >= '0' && *c <= '9';) {
        char *end;
        const long first = strtol(c, &end, 10);
        long last = first;
        if (*end == '-')
            last = strtol(end + 1, &end, 10);
        n += last >= first ? last - first + 1 : 0;
        c = *end == ',' ? end + 1 : end;
    }
    return n;
}

size_t moe_l2_bytes(void)
{
    long bytes = 0;
#ifdef _SC_LEVEL2_CACHE_SIZE
    bytes = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return bytes > 0 ? (size_t)bytes : 0;
}

size_t moe_llc_share_bytes(void)
{
    size_t best = 0;
    int best_level = 0;
    for (int index = 0; index < 16; index++) {
        char path[96], line[256];
        const char *dir = "/sys/devices/system/cpu/cpu0/cache/index";
        snprintf(path, sizeof path, "%s%d/level", dir, index);
        if (!read_line(path, line, sizeof line))
            break;
        const int level = atoi(line);
        snprintf(path, sizeof path, "%s%d/type", dir, index);
        if (level <= best_level || !read_line(path, line, sizeof line) ||
            strncmp(line, "Unified", 7) != 0)
            continue;
        snprintf(path, sizeof path, "%s%d/size", dir, index);
        char *unit;
        if (!read_line(path, line, sizeof line))
            continue;
        const double bytes = strtod(line, &unit) * (*unit == 'K'   ? 1024.0
                                                    : *unit == 'M' ? 1048576.0
                                                    : *unit == 'G' ? 1073741824.0
                                                                   : 1.0);
        snprintf(path, sizeof path, "%s%d/shared_cpu_list", dir, index);
        const long sharing = read_line(path, line, sizeof line) ? cpus_in_list(line) : 0;
        if (bytes > 0 && sharing > 0) {
            best = (size_t)(bytes / (double)sharing);
            best_level = level;
        }
    }
    return best;
}

const char *moe_blas_corename(void)
{
    return openblas_get_corename();
}
