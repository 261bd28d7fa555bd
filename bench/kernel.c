/* SPDX-License-Identifier: MIT */
/* kernel.c — the expert GEMM alone on one core: moe-ep's packed kernel at
 * each tile width, OpenBLAS's sgemm and, when built with it, libxsmm's JIT
 * kernels, on the experts' shapes with E experts' weights streaming through
 * the caches as in a layer. Prints GFLOP/s, the fraction of the core's fp32
 * FMA peak (measured here, at the widest vector width, beside each timed
 * batch), and whether each kernel's C is bit for bit the packed kernel's
 * (the per-element fmaf chain of gemm.h). Then the whole expert FFN on the
 * same rows (d = K, f = N / 2, N even): its two GEMMs alone against
 * moe_expert_forward (SwiGLU between), moe_expert_forward_rows (the rows
 * read through a row table from a receive buffer) and that with the
 * outputs written straight to their pairs' rows as the experts stage does, in
 * interleaved rounds, so that the stage's cost over the kernel is measured
 * under the same noise. Not part of moe-ep: `make bench/kernel` builds it,
 * with libxsmm when configure found it (docs/performance.md). Exit 1 when a
 * packed tile's bits differ from the widest tile's, or the row-table FFN's
 * from the FFN on the gathered rows.
 *
 *   bench/kernel [ROWS [K [N [EXPERTS [SECONDS]]]]]   default 96 1024 2048 32 1
 */
#include "config.h"

#include <stdbool.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "moe/common.h"
#include "moe/experts.h"
#include "moe/gemm.h"
#include "moe/layout.h"
#include "moe/peak.h"

#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef HAVE_LIBXSMM
#include <libxsmm.h>
#endif

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static moe_index arg(int argc, char **argv, int i, moe_index fallback)
{
    return argc > i ? (moe_index)strtoll(argv[i], NULL, 10) : fallback;
}

typedef struct {
    moe_index M, K, N;
    int experts;
    const float *A;      /* (M, K) */
    const float *plain;  /* experts x (K, N) row-major */
    const float *packed; /* experts x moe_sgemm_packed_floats(K, N) */
    float *C;            /* (M, N) */
#ifdef HAVE_LIBXSMM
    libxsmm_smmfunction xsmm; /* one block of xsmm_cols columns */
    moe_index xsmm_cols;
    bool xsmm_packed; /* reading the packed panels (xsmm_cols 16) */
#endif
} shape;

typedef void kernel_fn(const shape *s, int e);

static void run_packed(const shape *s, int e)
{
    moe_sgemm_packed(s->M, s->N, s->K, s->A, s->K,
                     s->packed + (size_t)e * (size_t)moe_sgemm_packed_floats(s->K, s->N), s->C,
                     s->N);
}

static void run_blas(const shape *s, int e)
{
    moe_sgemm_nn(s->M, s->N, s->K, s->A, s->K, s->plain + (size_t)e * (size_t)(s->K * s->N), s->N,
                 s->C, s->N);
}

#ifdef HAVE_LIBXSMM
/* Row-major C (M, N) = A (M, K) Bt (K, N) is column-major C' (N, M) =
 * Bt' (N, K) A' (K, M): libxsmm's m is our N, in blocks of s->xsmm_cols
 * columns, its n our M. On the unpacked weights a block reads its columns
 * in place (lda N); on the packed ones a block is one 16-column panel (lda
 * 16), the layout the packed kernel reads. The prefetching kernels are
 * given the next block's operands. */
static void run_xsmm(const shape *s, int e)
{
    const moe_index cols = s->xsmm_cols;
    const float *bt = s->xsmm_packed ? s->packed + (size_t)e * (size_t)moe_sgemm_packed_floats(s->K, s->N)
                                     : s->plain + (size_t)e * (size_t)(s->K * s->N);
    const moe_index step = s->xsmm_packed ? cols * s->K : cols;
    for (moe_index n0 = 0, b = 0; n0 < s->N; n0 += cols, b += step) {
        const moe_index next = n0 + cols < s->N ? b + step : b;
        s->xsmm(bt + b, s->A, s->C + n0, bt + next, s->A, s->C + (n0 + cols < s->N ? n0 + cols : n0));
    }
}
#endif

static int peak_bits; /* the widest FMA width; 0: none (no x86 FMA) */

/* The core's FMA peak (GFLOP/s) measured in 20 ms beside a timed batch or
 * round: a kernel's fraction of the peak is its rate over the larger of the
 * peaks just before and just after it, as a core's clock moves by a few
 * per cent from second to second (and on a Zen 1 guest rises by a fifth for
 * a tenth of a second now and then), and a kernel that runs near the peak
 * read 102-110 % of one measured seconds before it. */
static double peak_beside(void)
{
    return peak_bits ? moe_fma_rate(peak_bits, 0.02) / 1e9 : NAN;
}

/* GFLOP/s of `kernel` cycling over the experts for about `seconds`: the
 * median of five batches (one in a stretch of a higher clock is noise, as
 * one another process slowed down is); in *of_peak the median of each
 * batch's rate over the peak beside it. */
static double rate(kernel_fn *kernel, const shape *s, double seconds, double *of_peak)
{
    const double flops = 2.0 * (double)s->M * (double)s->N * (double)s->K;
    double r[5], q[5], before = peak_beside();
    for (int batch = 0; batch < 5; batch++) {
        const double t0 = now();
        long calls = 0;
        do
            kernel(s, (int)(calls++ % s->experts));
        while (now() - t0 < seconds / 5);
        r[batch] = flops * (double)calls / (now() - t0) / 1e9;
        const double after = peak_beside();
        q[batch] = r[batch] / fmax(before, after);
        before = after;
    }
    *of_peak = moe_median(q, 5);
    return moe_median(r, 5);
}

static void fill(float *v, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        v[i] = (float)((int32_t)seed >> 8) * 0x1p-23f; /* in [-1, 1): every bit in play */
    }
}

/* Prints the rate; returns whether the bits differed from `reference`. */
static bool report(const char *name, kernel_fn *kernel, const shape *s, double seconds,
                   const float *reference)
{
    memset(s->C, 0, sizeof(float) * (size_t)(s->M * s->N));
    kernel(s, 0);
    moe_index differ = 0;
    for (moe_index i = 0; i < s->M * s->N; i++)
        differ += memcmp(&s->C[i], &reference[i], sizeof(float)) != 0;
    double of_peak;
    const double r = rate(kernel, s, seconds, &of_peak);
    printf("%-30s %8.1f GFLOP/s  %5.1f %% of the FMA peak  %s\n", name, r, 100.0 * of_peak,
           differ ? "bits differ from the packed kernel" : "same bits as the packed kernel");
    if (differ)
        printf("%-30s %lld of %lld elements differ\n", "", (long long)differ,
               (long long)(s->M * s->N));
    return differ != 0;
}

static moe_index gcd(moe_index a, moe_index b)
{
    while (b) {
        const moe_index t = a % b;
        a = b, b = t;
    }
    return a;
}

/* The expert FFN on s's rows: x = s->A (M, d), W1 = s->packed (its (d, 2f)
 * panels), W2 (f, d) packed here; a receive buffer of 2 M E rows that the
 * row table draws each expert's M rows from, scattered. */
typedef struct {
    const shape *s;
    moe_index d, f;
    const float *w2;     /* experts x moe_expert_w2_floats */
    const float *const *row_at;
    const moe_index *index; /* experts x M rows of row_at */
    const moe_index *pair;  /* experts x M rows of out */
    float *h, *y, *out;     /* (M, 2f), (M, d), as many rows as the receive buffer */
} ffn_shape;

enum { FFN_GEMMS, FFN_FORWARD, FFN_ROWS, FFN_SCATTER, FFN_MODES };
static const char *const ffn_name[FFN_MODES] = {
    "two GEMMs alone (W1, W2)", "moe_expert_forward", "moe_expert_forward_rows",
    "the same, outputs scattered"};

static moe_expert_weights ffn_weights(const ffn_shape *x, int e)
{
    return (moe_expert_weights){
        x->s->packed + (size_t)e * (size_t)moe_sgemm_packed_floats(x->d, 2 * x->f),
        x->w2 + (size_t)e * (size_t)moe_expert_w2_floats(MOE_GEMM_PACKED, x->d, x->f),
        (moe_expert_rounding){0}}; /* fp32: the kernel's own rate, no rounding points */
}

static void run_ffn(const ffn_shape *x, int mode, int e)
{
    const moe_index M = x->s->M, d = x->d, f = x->f;
    const moe_expert_weights w = ffn_weights(x, e);
    switch (mode) {
    case FFN_GEMMS:
        moe_sgemm_packed(M, 2 * f, d, x->s->A, d, w.w1t, x->h, 2 * f);
        moe_sgemm_packed(M, d, f, x->h, 2 * f, w.w2t, x->y, d);
        return;
    case FFN_FORWARD:
        moe_expert_forward(&w, MOE_GEMM_PACKED, x->s->A, M, d, f, x->h, x->y, NULL, NULL);
        return;
    default: { /* FFN_SCATTER: straight to the pairs' rows, as the experts stage does */
        const bool to_pairs = mode == FFN_SCATTER;
        moe_expert_forward_rows(&w, x->row_at, x->index + (size_t)e * (size_t)M, M, d, f, x->h,
                                to_pairs ? x->out : x->y,
                                to_pairs ? x->pair + (size_t)e * (size_t)M : NULL, NULL, NULL);
    }
    }
}

/* Rounds of every mode over all experts, for about `seconds`. A round
 * interleaves the modes call by call: at step i mode m runs expert (i + m
 * E / FFN_MODES) mod E, so no mode finds the weights another just
 * streamed, and the machine's noise falls on all of them alike. Each mode's
 * median round as GFLOP/s in rate[], the median of its rounds' rates over
 * the peak beside each in of_peak[], and the median over rounds of the
 * GEMMs' time over each mode's in ratio[]. */
static int ffn_rates(const ffn_shape *x, double seconds, double rate[FFN_MODES],
                     double of_peak[FFN_MODES], double ratio[FFN_MODES])
{
    const int E = x->s->experts;
    const double flops = 6.0 * (double)x->s->M * (double)x->d * (double)x->f * E;
    enum { MAX_ROUNDS = 1000 };
    static double over[FFN_MODES][MAX_ROUNDS], took[FFN_MODES][MAX_ROUNDS], q[FFN_MODES][MAX_ROUNDS];
    int rounds = 0;
    double before = peak_beside();
    const double t0 = now();
    do {
        double t[FFN_MODES] = {0};
        for (int i = 0; i < E; i++)
            for (int m = 0; m < FFN_MODES; m++) {
                const double start = now();
                run_ffn(x, m, (i + m * E / FFN_MODES) % E);
                t[m] += now() - start;
            }
        const double after = peak_beside(), peak = fmax(before, after);
        before = after;
        for (int m = 0; m < FFN_MODES; m++) {
            took[m][rounds] = t[m];
            q[m][rounds] = flops / t[m] / 1e9 / peak;
            over[m][rounds] = t[FFN_GEMMS] / t[m];
        }
        rounds++;
    } while (rounds < MAX_ROUNDS && (now() - t0 < seconds || rounds < 3));
    for (int m = 0; m < FFN_MODES; m++) {
        rate[m] = flops / moe_median(took[m], rounds) / 1e9;
        of_peak[m] = moe_median(q[m], rounds);
        ratio[m] = moe_median(over[m], rounds);
    }
    return rounds;
}

/* Prints the FFN's rates; returns whether the row-table FFN's bits differ
 * from the FFN's on the gathered rows. */
static bool report_ffn(const shape *s, double seconds)
{
    const moe_index M = s->M, d = s->K, f = s->N / 2;
    const size_t w2 = (size_t)moe_expert_w2_floats(MOE_GEMM_PACKED, d, f);
    const moe_index received = 2 * M * s->experts;
    float *W2 = malloc(sizeof(float) * w2 * (size_t)s->experts);
    float *plain = malloc(sizeof(float) * (size_t)(f * d));
    float *recv = malloc(sizeof(float) * (size_t)(received * d));
    const float **row_at = malloc(sizeof(float *) * (size_t)received);
    moe_index *index = malloc(sizeof(moe_index) * (size_t)(M * s->experts));
    moe_index *pair = malloc(sizeof(moe_index) * (size_t)(M * s->experts));
    float *out = malloc(sizeof(float) * (size_t)(received * d));
    float *h = malloc(sizeof(float) * (size_t)(M * 2 * f));
    float *y = malloc(sizeof(float) * (size_t)(M * d));
    float *gathered = malloc(sizeof(float) * (size_t)(M * d));
    if (!W2 || !plain || !recv || !row_at || !index || !pair || !out || !h || !y || !gathered) {
        fprintf(stderr, "bench/kernel: out of memory\n");
        exit(1);
    }
    for (int e = 0; e < s->experts; e++) { /* W2 (d, f) packed as its transpose (f, d) */
        fill(plain, (size_t)(f * d), 3 + (uint32_t)e);
        moe_sgemm_pack_rows(f, d, plain, W2 + (size_t)e * w2);
    }
    /* The receive buffer holds x's rows 2 E times over, its slots in a
     * shuffled order (a stride coprime with their count); expert e reads x
     * from the slots of copy 2 e. Its outputs go to out's rows in the
     * order of the slots of copy 2 e + 1. */
    moe_index stride = 7919;
    while (gcd(stride, received) != 1)
        stride += 2;
    for (moe_index r = 0; r < received; r++) {
        float *slot = recv + (size_t)((r * stride) % received) * (size_t)d;
        memcpy(slot, s->A + (size_t)(r % M) * (size_t)d, sizeof(float) * (size_t)d);
        row_at[r] = slot;
    }
    for (int e = 0; e < s->experts; e++)
        for (moe_index m = 0; m < M; m++) {
            index[(size_t)e * (size_t)M + (size_t)m] = (moe_index)e * M * 2 + m;
            pair[(size_t)e * (size_t)M + (size_t)m] = ((e * 2 + 1) * M + m) * stride % received;
        }
    ffn_shape x = {s, d, f, W2, row_at, index, pair, h, y, out};

    run_ffn(&x, FFN_FORWARD, 0);
    memcpy(gathered, y, sizeof(float) * (size_t)(M * d));
    memset(y, 0, sizeof(float) * (size_t)(M * d));
    run_ffn(&x, FFN_ROWS, 0);
    const bool differ = memcmp(gathered, y, sizeof(float) * (size_t)(M * d)) != 0;

    double rate[FFN_MODES], of_peak[FFN_MODES], ratio[FFN_MODES];
    const int rounds = ffn_rates(&x, seconds, rate, of_peak, ratio);
    printf("the expert FFN, d = %lld, f = %lld, on the same %lld rows, %d interleaved rounds over "
           "the %d experts: the median round's rate, and its rate over the two GEMMs'\n",
           (long long)d, (long long)f, (long long)M, rounds, s->experts);
    for (int m = 0; m < FFN_MODES; m++)
        printf("%-30s %8.1f GFLOP/s  %5.1f %% of the FMA peak  %5.3f of the two GEMMs%s\n",
               ffn_name[m], rate[m], 100.0 * of_peak[m], ratio[m],
               m == FFN_ROWS ? (differ ? "  bits differ from moe_expert_forward"
                                       : "  same bits as moe_expert_forward")
                             : "");
    free(W2), free(plain), free(recv), free(row_at), free(index), free(pair), free(out), free(h);
    free(y), free(gathered);
    return differ;
}

int main(int argc, char **argv)
{
    shape s = {.M = arg(argc, argv, 1, 96), .K = arg(argc, argv, 2, 1024),
               .N = arg(argc, argv, 3, 2048), .experts = (int)arg(argc, argv, 4, 32)};
    const double seconds = argc > 5 ? atof(argv[5]) : 1.0;
    if (s.M < 1 || s.K < 1 || s.N < 1 || s.experts < 1 || !(seconds > 0)) {
        fprintf(stderr, "usage: %s [ROWS [K [N [EXPERTS [SECONDS]]]]] (all positive)\n", argv[0]);
        return 2;
    }
    moe_gemm_set_threads(1);
#ifdef _OPENMP
    omp_set_num_threads(1);
#endif
    const size_t plain = (size_t)(s.K * s.N), packed = (size_t)moe_sgemm_packed_floats(s.K, s.N);
    float *A = malloc(sizeof(float) * (size_t)(s.M * s.K));
    float *W = malloc(sizeof(float) * plain * (size_t)s.experts);
    float *P = malloc(sizeof(float) * packed * (size_t)s.experts);
    float *ref = malloc(sizeof(float) * (size_t)(s.M * s.N));
    s.C = malloc(sizeof(float) * (size_t)(s.M * s.N));
    if (!A || !W || !P || !ref || !s.C) {
        fprintf(stderr, "%s: out of memory\n", argv[0]);
        return 1;
    }
    fill(A, (size_t)(s.M * s.K), 1);
    fill(W, plain * (size_t)s.experts, 2);
    for (int e = 0; e < s.experts; e++)
        moe_sgemm_pack_rows(s.K, s.N, W + (size_t)e * plain, P + (size_t)e * packed);
    s.A = A, s.plain = W, s.packed = P;

    char cpu[256];
    moe_cpu_model(cpu, sizeof cpu);
    peak_bits = moe_fma_widest_bits();
    const double peak = peak_bits ? moe_fma_rate(peak_bits, 0.5) / 1e9 : NAN;
    printf("%s, OpenBLAS kernel %s; one core, fp32 FMA peak %.1f GFLOP/s at %d bits (each %% "
           "below: of the peak measured beside each batch)\n",
           cpu, moe_blas_corename(), peak, peak_bits);
    printf("C (%lld, %lld) = A (%lld, %lld) x B (%lld, %lld), %d experts' weights (%.1f MiB) "
           "in turn\n",
           (long long)s.M, (long long)s.N, (long long)s.M, (long long)s.K, (long long)s.K,
           (long long)s.N, s.experts, 4.0 * (double)plain * s.experts / 1048576.0);

    run_packed(&s, 0);
    memcpy(ref, s.C, sizeof(float) * (size_t)(s.M * s.N));
    report("packed, widest tile", run_packed, &s, seconds, ref);
    moe_sgemm_packed_force(MOE_ISA_AVX2);
    const bool tiles_differ = report("packed, 6 x 16 AVX2 tile", run_packed, &s, seconds, ref);
    moe_sgemm_packed_force(MOE_ISA_WIDEST);
    report("OpenBLAS sgemm", run_blas, &s, seconds, ref);
#ifdef HAVE_LIBXSMM
    libxsmm_init();
    printf("libxsmm %s, JIT target %s\n", LIBXSMM_VERSION, libxsmm_get_target_arch());
    static const struct {
        int cols;
        bool packed;
        int prefetch;
        const char *name;
    } variants[] = {
        {16, true, LIBXSMM_GEMM_PREFETCH_NONE, "libxsmm, packed panels"},
        {16, true, LIBXSMM_GEMM_PREFETCH_AL2, "libxsmm, packed, prefetch"},
        {32, false, LIBXSMM_GEMM_PREFETCH_NONE, "libxsmm, 32 columns"},
        {64, false, LIBXSMM_GEMM_PREFETCH_NONE, "libxsmm, 64 columns"},
        {64, false, LIBXSMM_GEMM_PREFETCH_AL2, "libxsmm, 64 columns, prefetch"},
        {128, false, LIBXSMM_GEMM_PREFETCH_NONE, "libxsmm, 128 columns"},
    };
    for (size_t v = 0; v < sizeof variants / sizeof variants[0]; v++) {
        if (s.N % variants[v].cols) {
            printf("%-30s N is not a multiple of %d\n", variants[v].name, variants[v].cols);
            continue;
        }
        const libxsmm_blasint m = variants[v].cols, n = (libxsmm_blasint)s.M;
        const libxsmm_blasint k = (libxsmm_blasint)s.K, ldb = k, ldc = (libxsmm_blasint)s.N;
        const libxsmm_blasint lda = variants[v].packed ? m : ldc;
        const float alpha = 1.0f, beta = 0.0f;
        const int flags = LIBXSMM_GEMM_FLAG_NONE;
        s.xsmm_cols = m;
        s.xsmm_packed = variants[v].packed;
        s.xsmm = libxsmm_smmdispatch(m, n, k, &lda, &ldb, &ldc, &alpha, &beta, &flags,
                                     &variants[v].prefetch);
        if (s.xsmm)
            report(variants[v].name, run_xsmm, &s, seconds, ref);
        else
            printf("%-30s no kernel\n", variants[v].name);
    }
#endif
    const bool rows_differ = s.N % 2 == 0 && report_ffn(&s, seconds);
    if (s.N % 2)
        printf("the expert FFN: N = 2f must be even\n");
    free(A), free(W), free(P), free(ref), free(s.C);
    return tiles_differ || rows_differ ? 1 : 0;
}
