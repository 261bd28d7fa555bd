/* SPDX-License-Identifier: MIT */
/* gemm.c — the BLAS wrapper and the exact and packed kernels, with shape
 * checks and FLOP counting (see gemm.h). */
#include "moe/gemm.h"

#include <cblas.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "moe/common.h"
#include "moe/peak.h"
#ifdef MOE_X86_KERNELS
#include <immintrin.h>
#endif

static double sgemm_flops;
static const char *blas_forbidden; /* why BLAS may not be called now, or NULL */

void moe_gemm_forbid_blas(const char *why) { blas_forbidden = why; }

/* A BLAS call while moe_gemm_forbid_blas holds is a bug of the caller. */
static void blas_allowed(const char *call)
{
    if (!blas_forbidden)
        return;
    fprintf(stderr, "moe-ep: internal error on rank %d: %s called while BLAS is forbidden (%s)\n",
            moe_message_rank, call, blas_forbidden);
    fflush(stderr);
    abort();
}

/* ldb_min: K when B is (N, K), N when it is (K, N). */
static void check_shape(moe_index M, moe_index N, moe_index K, moe_index lda, moe_index ldb,
                        moe_index ldc, moe_index ldb_min)
{
    MOE_ASSERT(M >= 0 && N >= 0 && K >= 0);
    MOE_ASSERT(M <= INT_MAX && N <= INT_MAX && K <= INT_MAX);
    MOE_ASSERT(lda >= K && ldb >= ldb_min && ldc >= N);
    MOE_ASSERT(lda <= INT_MAX && ldb <= INT_MAX && ldc <= INT_MAX);
}

void moe_sgemm_nn(moe_index M, moe_index N, moe_index K, const float *A, moe_index lda,
                  const float *Bt, moe_index ldbt, float *C, moe_index ldc)
{
    check_shape(M, N, K, lda, ldbt, ldc, N);
    blas_allowed("cblas_sgemm");
    if (M == 0 || N == 0)
        return;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, (int)N, (int)K, 1.0f, A,
                (int)lda, Bt, (int)ldbt, 0.0f, C, (int)ldc);
    sgemm_flops += 2.0 * (double)M * (double)N * (double)K;
}

void moe_dgemm_nt(moe_index M, moe_index N, moe_index K, const double *A, moe_index lda,
                  const double *B, moe_index ldb, double *C, moe_index ldc)
{
    check_shape(M, N, K, lda, ldb, ldc, K);
    blas_allowed("cblas_dgemm");
    if (M == 0 || N == 0)
        return;
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)N, (int)K, 1.0, A,
                (int)lda, B, (int)ldb, 0.0, C, (int)ldc);
}

/* Four fp64 lanes (two SSE registers on plain x86-64, one AVX register in
 * the avx2 clone); lanes never mix, so the width changes no bit. */
typedef double lanes4 __attribute__((vector_size(32)));
typedef double lanes4_unaligned __attribute__((vector_size(32), aligned(8), may_alias));

enum { DEXACT_COLS = 8, DEXACT_ROWS = 4, DEXACT_ROW_BLOCK = 64 };

/* Rows [m0, m1) of C, columns [n0, n0 + cols) (cols <= 8), from the packed
 * panel bp (K, 8): 4 x 8 accumulators, each adding its own terms in k order. */
__attribute__((target_clones("avx2", "default")))
static void dexact_panel(moe_index m0, moe_index m1, moe_index n0, moe_index cols, moe_index K,
                         const double *A, moe_index lda, const double *bp, double *C, moe_index ldc)
{
    for (moe_index m = m0; m < m1; m += DEXACT_ROWS) {
        const int rows = m1 - m < DEXACT_ROWS ? (int)(m1 - m) : DEXACT_ROWS;
        /* the loops over r unrolled, so that the sums stay in registers
         * (a loop over r kept them in memory, each add waiting on a store) */
        lanes4 acc[DEXACT_ROWS][2];
#pragma GCC unroll 4
        for (int r = 0; r < DEXACT_ROWS; r++)
            acc[r][0] = acc[r][1] = (lanes4){0};
        const double *a[DEXACT_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < DEXACT_ROWS; r++) /* a short block repeats its last row */
            a[r] = A + (m + (r < rows ? r : rows - 1)) * lda;
        for (moe_index k = 0; k < K; k++) {
            const lanes4 b0 = *(const lanes4_unaligned *)(bp + k * DEXACT_COLS);
            const lanes4 b1 = *(const lanes4_unaligned *)(bp + k * DEXACT_COLS + 4);
#pragma GCC unroll 4
            for (int r = 0; r < DEXACT_ROWS; r++) {
                acc[r][0] += a[r][k] * b0;
                acc[r][1] += a[r][k] * b1;
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < DEXACT_ROWS; r++) {
            double row[DEXACT_COLS];
            memcpy(row, &acc[r][0], sizeof acc[r][0]);
            memcpy(row + 4, &acc[r][1], sizeof acc[r][1]);
            if (r < rows)
                memcpy(C + (m + r) * ldc + n0, row, sizeof(double) * (size_t)cols);
        }
    }
}

void moe_dgemm_nt_exact(moe_index M, moe_index N, moe_index K, const double *A, moe_index lda,
                        const double *B, moe_index ldb, double *C, moe_index ldc)
{
    check_shape(M, N, K, lda, ldb, ldc, K);
    if (M == 0 || N == 0)
        return;
    const moe_index panels = (N + DEXACT_COLS - 1) / DEXACT_COLS;
    double *bp = moe_xmalloc(sizeof(double) * (size_t)(panels * DEXACT_COLS * K)); /* (panels, K, 8) */
#pragma omp parallel for schedule(static)
    for (moe_index p = 0; p < panels; p++)
        for (moe_index k = 0; k < K; k++)
            for (int j = 0; j < DEXACT_COLS; j++) {
                const moe_index n = p * DEXACT_COLS + j;
                bp[(p * K + k) * DEXACT_COLS + j] = n < N ? B[n * ldb + k] : 0.0;
            }
    const moe_index blocks = (M + DEXACT_ROW_BLOCK - 1) / DEXACT_ROW_BLOCK;
    /* Tiles of 64 rows (cache-sized) by one panel, a block's panels in a
     * row, split among the threads in contiguous shares. */
#pragma omp parallel for schedule(static)
    for (moe_index tile = 0; tile < blocks * panels; tile++) {
        const moe_index m0 = tile / panels * DEXACT_ROW_BLOCK, p = tile % panels;
        const moe_index m1 = M - m0 < DEXACT_ROW_BLOCK ? M : m0 + DEXACT_ROW_BLOCK;
        const moe_index n0 = p * DEXACT_COLS;
        const moe_index cols = N - n0 < DEXACT_COLS ? N - n0 : DEXACT_COLS;
        dexact_panel(m0, m1, n0, cols, K, A, lda, bp + p * K * DEXACT_COLS, C, ldc);
    }
    free(bp);
}

/* Eight fp32 lanes; GCC lowers it to two SSE registers on plain x86-64 and to
 * one AVX register in the avx2 clone. Lanes never mix, so the width does not
 * change any bit. */
typedef float lanes8 __attribute__((vector_size(32)));
/* The same at any float address, for loads and stores. */
typedef float lanes8_unaligned __attribute__((vector_size(32), aligned(4), may_alias));
#define load8(p) (*(const lanes8_unaligned *)(p))
#define store8(p, v) (*(lanes8_unaligned *)(p) = (v))

enum { EXACT_ROWS = 4, EXACT_COLS = 32, EXACT_ROW_BLOCK = 64 };

/* Rows [m0, m1) of C, columns [n0, n0 + EXACT_COLS): 4 x 32 accumulators. */
__attribute__((target_clones("avx2", "default")))
static void exact_panel(moe_index m0, moe_index m1, moe_index n0, moe_index K, const float *A,
                        moe_index lda, const float *Bt, moe_index ldbt, float *C, moe_index ldc)
{
    moe_index m = m0;
    for (; m + EXACT_ROWS <= m1; m += EXACT_ROWS) {
        lanes8 acc[EXACT_ROWS][4]; /* in registers: every loop over r and v unrolled */
#pragma GCC unroll 4
        for (int r = 0; r < EXACT_ROWS; r++)
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++)
                acc[r][v] = (lanes8){0};
        for (moe_index k = 0; k < K; k++) {
            const float *b = Bt + k * ldbt + n0;
            const lanes8 b0 = load8(b), b1 = load8(b + 8), b2 = load8(b + 16), b3 = load8(b + 24);
#pragma GCC unroll 4
            for (int r = 0; r < EXACT_ROWS; r++) {
                const float a = A[(m + r) * lda + k];
                acc[r][0] += a * b0;
                acc[r][1] += a * b1;
                acc[r][2] += a * b2;
                acc[r][3] += a * b3;
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < EXACT_ROWS; r++)
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++)
                store8(C + (m + r) * ldc + n0 + 8 * v, acc[r][v]);
    }
    for (; m < m1; m++) {
        lanes8 acc[4] = {(lanes8){0}, (lanes8){0}, (lanes8){0}, (lanes8){0}};
        for (moe_index k = 0; k < K; k++) {
            const float *b = Bt + k * ldbt + n0;
            const float a = A[m * lda + k];
            for (int v = 0; v < 4; v++)
                acc[v] += a * load8(b + 8 * v);
        }
        for (int v = 0; v < 4; v++)
            store8(C + m * ldc + n0 + 8 * v, acc[v]);
    }
}

void moe_sgemm_exact(moe_index M, moe_index N, moe_index K, const float *A, moe_index lda,
                     const float *Bt, moe_index ldbt, float *C, moe_index ldc)
{
    check_shape(M, N, K, lda, ldbt, ldc, N);
    const moe_index full = N - N % EXACT_COLS;
    /* A block of rows sweeps column panels of Bt (K x 32 floats, L2-sized)
     * and reuses each panel for all its rows. */
#pragma omp parallel for schedule(static)
    for (moe_index m0 = 0; m0 < M; m0 += EXACT_ROW_BLOCK) {
        const moe_index m1 = m0 + EXACT_ROW_BLOCK < M ? m0 + EXACT_ROW_BLOCK : M;
        for (moe_index n0 = 0; n0 < full; n0 += EXACT_COLS)
            exact_panel(m0, m1, n0, K, A, lda, Bt, ldbt, C, ldc);
        for (moe_index m = m0; m < m1; m++) /* the last N % 32 columns, same order */
            for (moe_index n = full; n < N; n++) {
                float acc = 0.0f;
                for (moe_index k = 0; k < K; k++)
                    acc += A[m * lda + k] * Bt[k * ldbt + n];
                C[m * ldc + n] = acc;
            }
    }
    sgemm_flops += 2.0 * (double)M * (double)N * (double)K;
}

/* ---- The packed kernel ----
 *
 * Bt (K, N) lives in panels of PACK_COLS columns: panel p holds, for k
 * ascending, the 16 floats Bt[k][16p .. 16p + 15] (zeros past N). A tile is
 * TILE_ROWS rows of C by one panel, 6 x 16 accumulators in 12 AVX registers,
 * one fused multiply-add chain per element over the whole of K. The weights
 * stream from memory once per block of rows; a block (block_a_floats() of
 * A) is re-read from cache for every panel. While a block's tiles walk
 * one panel, they prefetch the next, each tile its share of its K lines
 * spread evenly over its k steps, so the weights arrive at the pace they are
 * used (all in the first tile, as before, came too fast for memory: on a
 * Zen 5 core 96 rows went from 80 to 91 % of the FMA peak, 24 rows from 70
 * to 81 %). Splitting K as well, to keep a panel in L1, measured no faster:
 * the partial sums' trips through C cost what the L2 reads save. */
enum { PACK_COLS = 16, TILE_ROWS = 6, BLOCK_A_FLOATS = 1 << 20, BLOCK_A_LEAST = 1 << 18 };

/* *slot, from read() at its first use (-1 until then): a cache's size,
 * asked of sysfs or the C library once rather than at every product (the
 * last-level cache's share reads several sysfs files). Threads that race
 * on the first use read the same size. */
static moe_index read_once(moe_index *slot, moe_index (*read)(void))
{
    moe_index v = __atomic_load_n(slot, __ATOMIC_RELAXED);
    if (v < 0) {
        v = read();
        __atomic_store_n(slot, v, __ATOMIC_RELAXED);
    }
    return v;
}

/* Floats of A in a row block: a quarter of a CPU's share of the last-level
 * cache (moe_llc_share_bytes), so that the block stays there beside the
 * weights streaming through, within 1 and 4 MiB (BLOCK_A_LEAST,
 * BLOCK_A_FLOATS). On a Zen 1 guest (8 MiB for its two CPUs) 4 MiB blocks
 * on both at once did not stay: at 1,536 rows an expert the two GEMMs read
 * 34-35 GFLOP/s a core, and 37-38 in 1 MiB blocks. With 16 MiB a CPU or
 * more the block is 4 MiB, as it was everywhere before; smaller ones
 * measured no faster on Zen 4 (below 1 MiB, 5 % slower). */
static moe_index llc_block_floats(void)
{
    const size_t share = moe_llc_share_bytes();
    const moe_index f = share ? (moe_index)(share / 4 / sizeof(float)) : BLOCK_A_FLOATS;
    return f < BLOCK_A_LEAST ? BLOCK_A_LEAST : f > BLOCK_A_FLOATS ? BLOCK_A_FLOATS : f;
}

static moe_index block_a_floats(void)
{
    static moe_index floats = -1;
    return read_once(&floats, llc_block_floats);
}

size_t moe_sgemm_packed_block_bytes(void) { return sizeof(float) * (size_t)block_a_floats(); }

/* Floats of A in a row block once A outgrows a core's L2 cache: a quarter
 * of it, so that a block stays in L2 beside the panel its tiles read
 * (0: the L2's size unknown). */
static moe_index l2_block_floats(void) { return (moe_index)(moe_l2_bytes() / 4 / sizeof(float)); }

static moe_index block_l2_floats(void)
{
    static moe_index floats = -1;
    return read_once(&floats, l2_block_floats);
}

size_t moe_sgemm_packed_l2_block_bytes(void) { return sizeof(float) * (size_t)block_l2_floats(); }

/* The rows of a row block, for A of M rows of K floats: at most
 * block_a_floats() of A while A fits in a core's L2 cache (or its size is
 * unknown), at most block_l2_floats() past it; the rows split evenly
 * between the blocks, in whole tiles. The weights then stream once a
 * block, from the last-level cache after the first, while the tiles read
 * their rows of A from L2 rather than from the last-level cache. On a Zen
 * 5 core (1 MiB of L2), blocks of 256 KiB against the one block of 4 MiB,
 * `bench/kernel R 1024 1024 8`'s expert FFN on rows read through a row
 * table, medians of five alternated runs: 72.4 -> 82.7 % of the FMA peak
 * at 384 rows, 78.6 -> 81.9 at 768, 72.2 -> 74.7 at 1,536; `bench --preset
 * laptop --tokens 8192 --waves 1` (768 rows an expert), three alternated
 * pairs: 1099.7 -> 1068.2, 1213.8 -> 1118.0, 1097.6 -> 1034.0 ms. At 97
 * rows two blocks of 48 read what one of 97 did and three at 130 rows
 * 2.5 % less, so A that fits in L2 stays one block.
 *
 * With K <= SHORT_K (the weight gradients' products: K is an expert's
 * rows) a block takes at most SHORT_K_ROWS rows. A tile's stores to C
 * then weigh against its few FMAs, and a panel pair's strip of C, a
 * row's 128 bytes in each of the block's rows, has rows 4 KiB apart at
 * N = 1024: all in one sixty-fourth of the L2's sets. A strip of 1,024
 * rows overflows their ways before it is written back; one of 96 rows
 * stays. On a Zen 5 core, C (1024, N) over 16 or 32 fresh outputs in
 * turn, the two block sizes alternated in one process, fifteen pairs:
 * 1.049 times as fast at N = 1024 and K = 96 (48 to 120 rows a block:
 * 1.049-1.065), 1.066 at N = 512, 1.070 at K = 72, 1.034 at K = 128;
 * 1.004-1.015 at K = 160 to 256, and 1.011-1.020 at N = 1008 and 1040,
 * whose rows do not alias. */
enum { SHORT_K = 128, SHORT_K_ROWS = 96 };

static moe_index block_rows(moe_index M, moe_index K)
{
    const moe_index l2 = block_l2_floats();
    moe_index most = (l2 > 0 && M * K > 4 * l2 ? l2 : block_a_floats()) / K;
    if (K <= SHORT_K && most > SHORT_K_ROWS)
        most = SHORT_K_ROWS;
    most = most < TILE_ROWS ? TILE_ROWS : most / TILE_ROWS * TILE_ROWS;
    const moe_index blocks = (M + most - 1) / most, rows = (M + blocks - 1) / blocks;
    return (rows + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
}

/* The lines of the next panel (or panel pair) that a tile prefetches:
 * `lines` cache lines from `at` and as many from `at + half` (and from
 * `at2`, `at2 + half`), a line from each every `every` steps of k. The
 * tiles of a row block share the next panel between them, so that its
 * prefetches spread over the whole walk of the current one, and each
 * panel is fetched from both its halves at once: four streams for a pair
 * (the hardware's prefetcher runs ahead of each stream it sees, so four
 * keep more lines in flight than two). On a Zen 5 core, 32 experts'
 * weights from memory, medians of five alternated runs, two streams
 * against four: 75.5 and 79.6 % of the FMA peak at 24 rows, 82.8 and 85.4
 * at 48, 83.9 and 86.8 at 97; six streams were slower than four. A
 * tile takes it by address: by value its 32 bytes went to the stack at
 * every call, written in 8-byte halves and read back 16 bytes at a time,
 * a load that waits for the stores (on a Zen 5 the calling loop took 2 %
 * of the layer's samples, half of them at that load; 1 % by address). */
typedef struct {
    const float *at, *at2;
    moe_index lines, every, half;
} prefetch_share;

/* The rows of c (6, 16), row r at c[r], = the rows a[0..5] (K floats
 * each) times the panel b, prefetching pf.at's lines. A tile is given
 * its rows of C one by one, so that they may lie anywhere: an expert's
 * outputs go straight to its pairs' rows. */
typedef void tile_fn(moe_index K, const float *const a[TILE_ROWS], const float *b,
                     float *const c[TILE_ROWS], const prefetch_share *pf);

/* The definition of the result for the first R rows of a, one fmaf at a
 * time (the tiles below built on it drop pf, only a hint). */
static inline void portable_rows(const int R, moe_index K, const float *const a[TILE_ROWS],
                                 const float *b, float *const c[TILE_ROWS])
{
    float acc[TILE_ROWS][PACK_COLS] = {{0}};
    for (moe_index k = 0; k < K; k++)
        for (int r = 0; r < R; r++)
            for (int j = 0; j < PACK_COLS; j++)
                acc[r][j] = fmaf(a[r][k], b[k * PACK_COLS + j], acc[r][j]);
    for (int r = 0; r < R; r++)
        memcpy(c[r], acc[r], sizeof acc[r]);
}

#ifdef MOE_X86_KERNELS
/* The 6 x 16 tile's 12 accumulators, named so that they stay in registers;
 * a step adds one element of each of the six rows times 16 of b (b0, b1). */
#define TILE_ACCUMULATORS                                                                   \
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00; \
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00
#define TILE_ROW(x, acc0, acc1)              \
    acc0 = _mm256_fmadd_ps(x, b0, acc0);     \
    acc1 = _mm256_fmadd_ps(x, b1, acc1);
#define TILE_STEP(p0, p1, p2, p3, p4, p5, i)                                         \
    TILE_ROW(_mm256_broadcast_ss(p0 + (i)), c00, c01)                                \
    TILE_ROW(_mm256_broadcast_ss(p1 + (i)), c10, c11)                                \
    TILE_ROW(_mm256_broadcast_ss(p2 + (i)), c20, c21)                                \
    TILE_ROW(_mm256_broadcast_ss(p3 + (i)), c30, c31)                                \
    TILE_ROW(_mm256_broadcast_ss(p4 + (i)), c40, c41)                                \
    TILE_ROW(_mm256_broadcast_ss(p5 + (i)), c50, c51)
#define TILE_STORE(c, ldc)                                                            \
    do {                                                                              \
        __m256 acc[TILE_ROWS][2] = {{c00, c01}, {c10, c11}, {c20, c21},               \
                                    {c30, c31}, {c40, c41}, {c50, c51}};              \
        for (int r = 0; r < TILE_ROWS; r++) {                                         \
            _mm256_storeu_ps((c) + r * (ldc), acc[r][0]);                             \
            _mm256_storeu_ps((c) + r * (ldc) + 8, acc[r][1]);                         \
        }                                                                             \
    } while (0)

/* The same operations for the first R rows, 8 lanes at a time (R
 * constant: each R its own function below, its accumulators in registers). */
__attribute__((target("avx2,fma"), always_inline))
static inline void narrow_rows(const int R, moe_index K, const float *const a[TILE_ROWS],
                               const float *b, float *const c[TILE_ROWS],
                               const prefetch_share *share)
{
    prefetch_share pf = *share;
    __m256 acc[TILE_ROWS][2];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    moe_index due = 0;
    for (moe_index k = 0; k < K; k++) {
        const __m256 b0 = _mm256_loadu_ps(b + k * PACK_COLS);
        const __m256 b1 = _mm256_loadu_ps(b + k * PACK_COLS + 8);
        if (pf.lines && k == due) {
            _mm_prefetch((const char *)pf.at, _MM_HINT_T0);
            _mm_prefetch((const char *)(pf.at + pf.half), _MM_HINT_T0);
            pf.at += PACK_COLS;
            pf.lines--;
            due += pf.every;
        }
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m256 x = _mm256_broadcast_ss(a[r] + k);
            acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(c[r], acc[r][0]);
        _mm256_storeu_ps(c[r] + 8, acc[r][1]);
    }
}
#endif

/* The one-panel tiles by height, each computing exactly its rows (a block
 * of 26 rows runs 26 rows' FMAs, not 30; on a Zen 3 core the laptop layer
 * 1.16 times faster), the block split into tiles of even heights
 * (packed_columns). */
#define NARROW_TILE(R)                                                                      \
    static void tile_portable_##R(moe_index K, const float *const a[TILE_ROWS],            \
                                  const float *b, float *const c[TILE_ROWS],            \
                                  const prefetch_share *pf)                              \
    {                                                                                      \
        (void)pf;                                                                          \
        portable_rows(R, K, a, b, c);                                                      \
    }                                                                                      \
    NARROW_TILE_AVX2(R)
#ifdef MOE_X86_KERNELS
#define NARROW_TILE_AVX2(R)                                                                 \
    __attribute__((target("avx2,fma"))) static void tile_avx2_##R(                          \
        moe_index K, const float *const a[TILE_ROWS], const float *b,                        \
        float *const c[TILE_ROWS], const prefetch_share *pf)                                 \
    {                                                                                      \
        narrow_rows(R, K, a, b, c, pf);                                                    \
    }
#else
#define NARROW_TILE_AVX2(R)
#endif
NARROW_TILE(1)
NARROW_TILE(2)
NARROW_TILE(3)
NARROW_TILE(4)
NARROW_TILE(5)
NARROW_TILE(6)
#undef NARROW_TILE
#undef NARROW_TILE_AVX2

static tile_fn *const portable_tiles[TILE_ROWS + 1] = {
    NULL, tile_portable_1, tile_portable_2, tile_portable_3,
    tile_portable_4, tile_portable_5, tile_portable_6};
#ifdef MOE_X86_KERNELS
static tile_fn *const avx2_tiles[TILE_ROWS + 1] = {
    NULL, tile_avx2_1, tile_avx2_2, tile_avx2_3, tile_avx2_4, tile_avx2_5, tile_avx2_6};
#endif

/* The rows of c (6, 32), row r at c[r], = the rows a[0..5] times two
 * panels side by side, b and b2 (K rows of 16 each), prefetching pf.at's
 * and pf.at2's lines. */
typedef void tile2_fn(moe_index K, const float *const a[TILE_ROWS], const float *b,
                      const float *b2, float *const c[TILE_ROWS], const prefetch_share *pf);

#ifdef MOE_X86_KERNELS
/* The 6 x 16 tile's operations on two panels at once, 16 lanes at a time:
 * each element the same fma chain over k ascending from zero. */
#define WIDE_ACCUMULATORS                                                                   \
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00; \
    __m512 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00
#define WIDE_ROW(x, acc0, acc1)              \
    acc0 = _mm512_fmadd_ps(x, b0, acc0);     \
    acc1 = _mm512_fmadd_ps(x, b1, acc1);
#define WIDE_STEP(p0, p1, p2, p3, p4, p5, i)                          \
    WIDE_ROW(_mm512_set1_ps((p0)[i]), c00, c01)                       \
    WIDE_ROW(_mm512_set1_ps((p1)[i]), c10, c11)                       \
    WIDE_ROW(_mm512_set1_ps((p2)[i]), c20, c21)                       \
    WIDE_ROW(_mm512_set1_ps((p3)[i]), c30, c31)                       \
    WIDE_ROW(_mm512_set1_ps((p4)[i]), c40, c41)                       \
    WIDE_ROW(_mm512_set1_ps((p5)[i]), c50, c51)
#define WIDE_STORE(c, ldc)                                                            \
    do {                                                                              \
        const __m512 acc[TILE_ROWS][2] = {{c00, c01}, {c10, c11}, {c20, c21},         \
                                          {c30, c31}, {c40, c41}, {c50, c51}};        \
        for (int r = 0; r < TILE_ROWS; r++) {                                         \
            _mm512_storeu_ps((c) + r * (ldc), acc[r][0]);                             \
            _mm512_storeu_ps((c) + r * (ldc) + PACK_COLS, acc[r][1]);                 \
        }                                                                             \
    } while (0)

/* The two-panel tile for the first R rows of a (R constant, 1 to 6: each
 * R its own function below, its accumulators in registers), as the
 * one-panel tiles: a tile computes exactly its rows instead of repeating
 * one, which at 24 rows an expert wasted a tenth of the FMAs. */
__attribute__((target("avx512f"), always_inline))
static inline void wide_rows(const int R, moe_index K, const float *const a[TILE_ROWS],
                             const float *b, const float *b2, float *const c[TILE_ROWS],
                             const prefetch_share *share)
{
    prefetch_share pf = *share;
    __m512 acc[TILE_ROWS][2];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    moe_index due = 0;
    for (moe_index k = 0; k < K; k++) {
        const __m512 b0 = _mm512_loadu_ps(b + k * PACK_COLS);
        const __m512 b1 = _mm512_loadu_ps(b2 + k * PACK_COLS);
        if (pf.lines && k == due) {
            _mm_prefetch((const char *)pf.at, _MM_HINT_T0);
            _mm_prefetch((const char *)(pf.at + pf.half), _MM_HINT_T0);
            _mm_prefetch((const char *)pf.at2, _MM_HINT_T0);
            _mm_prefetch((const char *)(pf.at2 + pf.half), _MM_HINT_T0);
            pf.at += PACK_COLS;
            pf.at2 += PACK_COLS;
            pf.lines--;
            due += pf.every;
        }
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m512 x = _mm512_set1_ps(a[r][k]);
            acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(c[r], acc[r][0]);
        _mm512_storeu_ps(c[r] + PACK_COLS, acc[r][1]);
    }
}

#define WIDE_TILE(R)                                                                        \
    __attribute__((target("avx512f"))) static void tile_avx512_##R(                          \
        moe_index K, const float *const a[TILE_ROWS], const float *b, const float *b2,       \
        float *const c[TILE_ROWS], const prefetch_share *pf)                                 \
    {                                                                                        \
        wide_rows(R, K, a, b, b2, c, pf);                                                    \
    }
WIDE_TILE(1)
WIDE_TILE(2)
WIDE_TILE(3)
WIDE_TILE(4)
WIDE_TILE(5)
WIDE_TILE(6)
#undef WIDE_TILE

/* The two-panel tiles by height: wide_tiles[r] computes r rows. */
static tile2_fn *const wide_tiles[TILE_ROWS + 1] = {
    NULL, tile_avx512_1, tile_avx512_2, tile_avx512_3, tile_avx512_4, tile_avx512_5, tile_avx512_6};
#endif

static enum moe_isa packed_forced = MOE_ISA_WIDEST;

void moe_sgemm_packed_force(enum moe_isa isa) { packed_forced = isa; }

/* The one-panel tiles by height: tiles[r] computes r rows. */
static tile_fn *const *packed_tiles(void)
{
#ifdef MOE_X86_KERNELS
    if (moe_isa_avx2(packed_forced))
        return avx2_tiles;
#endif
    return portable_tiles;
}

/* The two-panel tiles by height, or NULL: none on this CPU, or a narrower
 * one forced. */
static tile2_fn *const *packed_wide_tiles(void)
{
#ifdef MOE_X86_KERNELS
    if (moe_isa_avx512(packed_forced))
        return wide_tiles;
#endif
    return NULL;
}

const char *moe_sgemm_packed_isa(void)
{
    return packed_wide_tiles() ? "avx512f+avx2+fma"
                               : packed_tiles() == portable_tiles ? "portable fmaf" : "avx2+fma";
}

moe_index moe_sgemm_packed_floats(moe_index K, moe_index N)
{
    return (N + PACK_COLS - 1) / PACK_COLS * PACK_COLS * K;
}

void moe_sgemm_pack(moe_index N, moe_index K, const float *B, float *Bp)
{
    const moe_index panels = (N + PACK_COLS - 1) / PACK_COLS;
#pragma omp parallel for schedule(static)
    for (moe_index p = 0; p < panels; p++)
        for (int j = 0; j < PACK_COLS; j++) {
            const moe_index n = p * PACK_COLS + j;
            float *dst = Bp + p * K * PACK_COLS + j;
            for (moe_index k = 0; k < K; k++)
                dst[k * PACK_COLS] = n < N ? B[n * K + k] : 0.0f;
        }
}

void moe_sgemm_pack_rows(moe_index K, moe_index N, const float *Bt, float *Bp)
{
    moe_sgemm_pack_rows_at(K, N, Bt, NULL, Bp);
}

void moe_sgemm_pack_rows_at(moe_index K, moe_index N, const float *Bt, const moe_index *rows,
                            float *Bp)
{
    const moe_index panels = (N + PACK_COLS - 1) / PACK_COLS;
#pragma omp parallel for schedule(static)
    for (moe_index p = 0; p < panels; p++) {
        const moe_index n0 = p * PACK_COLS, cols = N - n0 < PACK_COLS ? N - n0 : PACK_COLS;
        float *dst = Bp + p * K * PACK_COLS;
        for (moe_index k = 0; k < K; k++) {
            const float *src = Bt + (rows ? rows[k] : k) * N + n0;
            if (cols == PACK_COLS) { /* a copy of constant size: inlined, not a call */
                memcpy(dst + k * PACK_COLS, src, sizeof(float) * PACK_COLS);
                continue;
            }
            memcpy(dst + k * PACK_COLS, src, sizeof(float) * (size_t)cols);
            memset(dst + k * PACK_COLS + cols, 0, sizeof(float) * (size_t)(PACK_COLS - cols));
        }
    }
}

/* A's row m: row_at[index[m]] (index NULL: row_at[m]), or A + m * lda when
 * row_at is NULL. */
typedef struct {
    const float *A;
    moe_index lda;
    const float *const *row_at;
    const moe_index *index;
} rows_of_a;

static const float *row_of(const rows_of_a *a, moe_index m)
{
    if (!a->row_at)
        return a->A + m * a->lda;
    return a->row_at[a->index ? a->index[m] : m];
}

/* C's row m: C + c_index[m] * ldc (c_index NULL: C + m * ldc). */
static inline float *row_of_c(float *C, moe_index ldc, const moe_index *c_index, moe_index m)
{
    return C + (c_index ? c_index[m] : m) * ldc;
}

/* Panels [p0, p1) of C, all rows: two whole panels at a time with the wide
 * tiles (when not NULL; wide[r] for r rows), else one (tile[r]). */
static void packed_columns(tile_fn *const *tile, tile2_fn *const *wide, moe_index M, moe_index N,
                           moe_index K, const rows_of_a *A, const float *Bp, float *C,
                           moe_index ldc, const moe_index *c_index, moe_index p0, moe_index p1)
{
    const moe_index block_m = block_rows(M, K);
    float part[TILE_ROWS * 2 * PACK_COLS]; /* a tile that C cannot hold whole */
    const moe_index whole = N / PACK_COLS; /* panels without padding */
    /* the block's rows of A, found once for all its panels (a tile's rows
     * looked up again for every panel took 1 % of a layer's samples) */
    const float **row = moe_xmalloc(sizeof(const float *) * (size_t)(M < block_m ? M : block_m));
    for (moe_index m0 = 0; m0 < M; m0 += block_m) {
        const moe_index m1 = M - m0 < block_m ? M : m0 + block_m;
        for (moe_index m = m0; m < m1; m++)
            row[m - m0] = row_of(A, m);
        /* As few tiles as TILE_ROWS allows, their heights even (25 rows:
         * five of 5, not four of 6 and one of 1): a tile of 1 to 3 rows has
         * too few FMA chains to cover the FMA latency and takes as long as
         * one of 4. The block's tiles share the K / 2 lines of each next
         * panel's halves: `share` each (K odd: its last line is not
         * prefetched). */
        const moe_index height = m1 - m0, tiles = (height + TILE_ROWS - 1) / TILE_ROWS;
        const moe_index half = K / 2, share = (half + tiles - 1) / tiles;
        for (moe_index p = p0, span; p < p1; p += span) {
            span = wide && p + 1 < p1 && p + 1 < whole ? 2 : 1;
            const float *b = Bp + p * K * PACK_COLS;
            const moe_index n0 = p * PACK_COLS, width = span * PACK_COLS;
            const moe_index cols = N - n0 < width ? N - n0 : width;
            const float *next = p + span < p1 ? b + span * K * PACK_COLS : NULL;
            const float *next2 = next && p + span + 1 < p1 ? next + K * PACK_COLS : next;
            for (moe_index i = 0, m = m0, rows; i < tiles; i++, m += rows) {
                rows = height / tiles + (i < height % tiles ? 1 : 0);
                const float *const *a = row + (m - m0); /* a tile of `rows` rows reads no more */
                /* a panel pair is whole (no padding); a tile writes only its rows */
                const bool full = span == 2 || cols == width;
                float *c[TILE_ROWS];
                for (moe_index r = 0; r < rows; r++)
                    c[r] = full ? row_of_c(C, ldc, c_index, m + r) + n0 : part + r * width;
                const moe_index first = i * share;
                prefetch_share pf = {NULL, NULL, 0, share ? K / share : 1, half * PACK_COLS};
                if (next && first < half) {
                    pf.at = next + first * PACK_COLS;
                    pf.at2 = next2 + first * PACK_COLS;
                    pf.lines = half - first < share ? half - first : share;
                }
                /* the next tile's rows of C, for writing: a C that is
                 * not in the caches (the weight gradients' 1024 x 1024 of
                 * an expert) would otherwise be read from memory at each
                 * tile's stores, while nothing computes; not rows written
                 * through c_index, an expert's outputs to its pairs' rows,
                 * where the prefetches waited on their misses (0.8 % of a
                 * layer's samples) */
                const bool ahead = full && !c_index && i + 1 < tiles;
                for (moe_index r = 0; ahead && r < TILE_ROWS && m + rows + r < m1; r++)
                    for (moe_index l = 0; l < span; l++)
                        __builtin_prefetch(C + (m + rows + r) * ldc + n0 + l * PACK_COLS, 1, 3);
                if (span == 2)
                    wide[rows](K, a, b, b + K * PACK_COLS, c, &pf);
                else
                    tile[rows](K, a, b, c, &pf);
                if (!full)
                    for (moe_index r = 0; r < rows; r++)
                        memcpy(row_of_c(C, ldc, c_index, m + r) + n0, part + r * width,
                               sizeof(float) * (size_t)cols);
            }
        }
    }
    free(row);
}

/* The calling thread's share [lo, hi) of n items, in thread order. */
static void thread_share(moe_index n, moe_index *lo, moe_index *hi)
{
    *lo = 0;
    *hi = n;
#ifdef _OPENMP
    const moe_index t = omp_get_thread_num(), threads = omp_get_num_threads();
    *lo = n * t / threads;
    *hi = n * (t + 1) / threads;
#endif
}

/* moe_sgemm_packed on the rows A names. */
static void sgemm_packed(moe_index M, moe_index N, moe_index K, const rows_of_a *A,
                         const float *Bp, float *C, moe_index ldc, const moe_index *c_index)
{
    if (M == 0 || N == 0)
        return;
    if (K == 0) {
        for (moe_index m = 0; m < M; m++)
            memset(row_of_c(C, ldc, c_index, m), 0, sizeof(float) * (size_t)N);
        return;
    }
    tile_fn *const *tile = packed_tiles();
    tile2_fn *const *wide = packed_wide_tiles();
    const moe_index panels = (N + PACK_COLS - 1) / PACK_COLS;
    /* Threads split the panels, each keeping its share for the whole call. */
#pragma omp parallel
    {
        moe_index p0, p1;
        thread_share(panels, &p0, &p1);
        packed_columns(tile, wide, M, N, K, A, Bp, C, ldc, c_index, p0, p1);
    }
    sgemm_flops += 2.0 * (double)M * (double)N * (double)K;
}

void moe_sgemm_packed(moe_index M, moe_index N, moe_index K, const float *A, moe_index lda,
                      const float *Bp, float *C, moe_index ldc)
{
    moe_sgemm_packed_to(M, N, K, A, lda, Bp, C, ldc, NULL);
}

void moe_sgemm_packed_to(moe_index M, moe_index N, moe_index K, const float *A, moe_index lda,
                         const float *Bp, float *C, moe_index ldc, const moe_index *c_index)
{
    check_shape(M, N, K, lda, N, ldc, N);
    const rows_of_a rows = {A, lda, NULL, NULL};
    sgemm_packed(M, N, K, &rows, Bp, C, ldc, c_index);
}

void moe_sgemm_packed_rows(moe_index M, moe_index N, moe_index K, const float *const *row_at,
                           const moe_index *index, const float *Bp, float *C, moe_index ldc)
{
    check_shape(M, N, K, K, N, ldc, N);
    MOE_ASSERT(row_at || M == 0);
    const rows_of_a rows = {NULL, K, row_at, index};
    sgemm_packed(M, N, K, &rows, Bp, C, ldc, NULL);
}

/* ---- Transposes ----
 *
 * In blocks of 8 x 8, each in registers: eight rows' 8-float runs loaded,
 * shuffled, stored as eight columns' runs (a transpose one float at a time
 * took a sixth of the weight gradients' stage). The blocks walk B eight
 * rows at a time, TRANSPOSE_CHUNK columns of them before the next eight
 * rows: each row read in runs of eight lines, which the hardware
 * prefetcher follows (a square of 16 x 16 at a time read one line of
 * every row in turn; 96 rows of 1024 floats on a Zen 5 core, alternated:
 * 72-78 us from memory and 25 from L2 that way, 63-72 and 16 this way),
 * while a whole column of B at once would read rows a power of two apart
 * (4 KiB at 1024 floats), all in one set of the L1 cache. */
enum { TRANSPOSE_CHUNK = 128, T8 = 8 };
typedef int32_t shuffle8 __attribute__((vector_size(32)));

/* dst[c * ldd + r] = src[r][c] for the nr rows (NULL: zeros) and nc columns
 * of a block of at most 8 x 8. */
static inline __attribute__((always_inline)) void transpose8(int nr, int nc,
                                                             const float *const src[T8],
                                                             float *dst, moe_index ldd)
{
    if (nr < T8 || nc < T8) {
        for (int c = 0; c < nc; c++)
            for (int r = 0; r < nr; r++)
                dst[c * ldd + r] = src[r] ? src[r][c] : 0.0f;
        return;
    }
    lanes8 a[T8];
#pragma GCC unroll 8
    for (int r = 0; r < T8; r++) {
        a[r] = (lanes8){0};
        if (src[r])
            a[r] = load8(src[r]);
    }
    /* pairs of rows interleaved, then pairs of pairs, then the halves */
    const shuffle8 lo = {0, 8, 1, 9, 4, 12, 5, 13}, hi = {2, 10, 3, 11, 6, 14, 7, 15};
    const shuffle8 lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const shuffle8 lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    const lanes8 t0 = __builtin_shuffle(a[0], a[1], lo), t1 = __builtin_shuffle(a[0], a[1], hi);
    const lanes8 t2 = __builtin_shuffle(a[2], a[3], lo), t3 = __builtin_shuffle(a[2], a[3], hi);
    const lanes8 t4 = __builtin_shuffle(a[4], a[5], lo), t5 = __builtin_shuffle(a[4], a[5], hi);
    const lanes8 t6 = __builtin_shuffle(a[6], a[7], lo), t7 = __builtin_shuffle(a[6], a[7], hi);
    const lanes8 u0 = __builtin_shuffle(t0, t2, lo2), u1 = __builtin_shuffle(t0, t2, hi2);
    const lanes8 u2 = __builtin_shuffle(t1, t3, lo2), u3 = __builtin_shuffle(t1, t3, hi2);
    const lanes8 u4 = __builtin_shuffle(t4, t6, lo2), u5 = __builtin_shuffle(t4, t6, hi2);
    const lanes8 u6 = __builtin_shuffle(t5, t7, lo2), u7 = __builtin_shuffle(t5, t7, hi2);
    store8(dst, __builtin_shuffle(u0, u4, lo4));
    store8(dst + ldd, __builtin_shuffle(u1, u5, lo4));
    store8(dst + 2 * ldd, __builtin_shuffle(u2, u6, lo4));
    store8(dst + 3 * ldd, __builtin_shuffle(u3, u7, lo4));
    store8(dst + 4 * ldd, __builtin_shuffle(u0, u4, hi4));
    store8(dst + 5 * ldd, __builtin_shuffle(u1, u5, hi4));
    store8(dst + 6 * ldd, __builtin_shuffle(u2, u6, hi4));
    store8(dst + 7 * ldd, __builtin_shuffle(u3, u7, hi4));
}

/* ---- The packed kernel on the forward's panels, transposed ----
 *
 * C (M, K) = A (M, N) B with B (N, K) only as moe_sgemm_pack(N, K, B) holds
 * it, the operand of the forward's C' = A' B^T: the backward's data GEMMs
 * read the weights where the forward does. Computed as C^T = B^T A^T: a
 * tile is six columns of B (six rows of C^T) by sixteen rows of A. The six
 * columns sit side by side in each panel (panel p: B's rows 16p..16p+15,
 * [column][row], K * 16 floats), so the tile walks n in steps of 16, each
 * step's 6 x 16 floats one contiguous run; A is packed into panels of 16
 * rows, [n][row]. Each element is fmaf(B[n][k], A[m][n], acc) over n
 * ascending from 0: moe_sgemm_packed's chain on B laid out for it (the
 * factors of a fused product commute exactly), so the bits are the same. */

/* t (6, 16) = the columns a[0..5] (element n at a[r][n / 16 * step + n % 16])
 * times the panel b (N rows of 16); next, when not NULL, the columns of a
 * later tile to prefetch. */
typedef void tile_t_fn(moe_index N, const float *const a[TILE_ROWS], moe_index step,
                       const float *b, float *t, const float *next);

static void tile_t_portable(moe_index N, const float *const a[TILE_ROWS], moe_index step,
                            const float *b, float *t, const float *next)
{
    float acc[TILE_ROWS][PACK_COLS] = {{0}};
    for (moe_index n = 0; n < N; n++)
        for (int r = 0; r < TILE_ROWS; r++)
            for (int j = 0; j < PACK_COLS; j++)
                acc[r][j] = fmaf(a[r][n / PACK_COLS * step + n % PACK_COLS], b[n * PACK_COLS + j],
                                 acc[r][j]);
    memcpy(t, acc, sizeof acc);
}

#ifdef MOE_X86_KERNELS
__attribute__((target("avx2,fma")))
static void tile_t_avx2(moe_index N, const float *const a[TILE_ROWS], moe_index step,
                        const float *b, float *t, const float *next)
{
    TILE_ACCUMULATORS;
    for (moe_index n0 = 0; n0 < N; n0 += PACK_COLS) {
        const moe_index at = n0 / PACK_COLS * step, run = N - n0 < PACK_COLS ? N - n0 : PACK_COLS;
        const float *a0 = a[0] + at, *a1 = a[1] + at, *a2 = a[2] + at, *a3 = a[3] + at,
                    *a4 = a[4] + at, *a5 = a[5] + at, *bb = b + n0 * PACK_COLS;
        if (next) /* the next tile's six columns here: 6 x 16 floats, 6 lines */
            for (int l = 0; l < TILE_ROWS; l++)
                _mm_prefetch((const char *)(next + at + l * PACK_COLS), _MM_HINT_T0);
        for (moe_index n = 0; n < run; n++) {
            const __m256 b0 = _mm256_loadu_ps(bb + n * PACK_COLS);
            const __m256 b1 = _mm256_loadu_ps(bb + n * PACK_COLS + 8);
            TILE_STEP(a0, a1, a2, a3, a4, a5, n)
        }
    }
    TILE_STORE(t, PACK_COLS);
}
#undef TILE_ACCUMULATORS
#undef TILE_ROW
#undef TILE_STEP
#undef TILE_STORE

/* t (6, 32) = the same columns times two panels of A's rows side by side,
 * b and b2 (N rows of 16 each), 16 lanes at a time. */
__attribute__((target("avx512f")))
static void tile_t_avx512(moe_index N, const float *const a[TILE_ROWS], moe_index step,
                          const float *b, const float *b2, float *t, const float *next)
{
    WIDE_ACCUMULATORS;
    for (moe_index n0 = 0; n0 < N; n0 += PACK_COLS) {
        const moe_index at = n0 / PACK_COLS * step, run = N - n0 < PACK_COLS ? N - n0 : PACK_COLS;
        const float *a0 = a[0] + at, *a1 = a[1] + at, *a2 = a[2] + at, *a3 = a[3] + at,
                    *a4 = a[4] + at, *a5 = a[5] + at, *bb = b + n0 * PACK_COLS,
                    *bb2 = b2 + n0 * PACK_COLS;
        if (next)
            for (int l = 0; l < TILE_ROWS; l++)
                _mm_prefetch((const char *)(next + at + l * PACK_COLS), _MM_HINT_T0);
        for (moe_index n = 0; n < run; n++) {
            const __m512 b0 = _mm512_loadu_ps(bb + n * PACK_COLS);
            const __m512 b1 = _mm512_loadu_ps(bb2 + n * PACK_COLS);
            WIDE_STEP(a0, a1, a2, a3, a4, a5, n)
        }
    }
    WIDE_STORE(t, 2 * PACK_COLS);
}
#undef WIDE_ACCUMULATORS
#undef WIDE_ROW
#undef WIDE_STEP
#undef WIDE_STORE

/* t (6, 16) = the same columns times one panel, 16 lanes at a time: A's
 * last panel when their number is odd (its six FMA chains keep a core's
 * two 512-bit pipes three quarters busy, the 6 x 16 AVX2 tile half). */
__attribute__((target("avx512f")))
static void tile_t_avx512_one(moe_index N, const float *const a[TILE_ROWS], moe_index step,
                              const float *b, float *t, const float *next)
{
    __m512 acc[TILE_ROWS];
#pragma GCC unroll 6
    for (int r = 0; r < TILE_ROWS; r++)
        acc[r] = _mm512_setzero_ps();
    for (moe_index n0 = 0; n0 < N; n0 += PACK_COLS) {
        const moe_index at = n0 / PACK_COLS * step, run = N - n0 < PACK_COLS ? N - n0 : PACK_COLS;
        const float *bb = b + n0 * PACK_COLS;
        if (next)
            for (int l = 0; l < TILE_ROWS; l++)
                _mm_prefetch((const char *)(next + at + l * PACK_COLS), _MM_HINT_T0);
        for (moe_index n = 0; n < run; n++) {
            const __m512 b0 = _mm512_loadu_ps(bb + n * PACK_COLS);
#pragma GCC unroll 6
            for (int r = 0; r < TILE_ROWS; r++)
                acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r][at + n]), b0, acc[r]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < TILE_ROWS; r++)
        _mm512_storeu_ps(t + r * PACK_COLS, acc[r]);
}
#endif

/* ---- The rows past A's last whole panel ----
 *
 * A last panel of r < 16 rows costs what a whole one does, its rows in the
 * lanes (at 97 rows the seventh panel's one row took a sixth of the
 * product). On the AVX-512 tiles the rows past the last whole panel (and
 * at times the panel before them: packed_t_full) are computed the other
 * way round, in tiles of at most TAIL_MOST rows: C's columns in the lanes
 * and the rows' elements broadcast. A block of B's panel, 16 columns
 * by its 16 n (16 runs of 16 floats, one contiguous 1 KiB), is transposed
 * in registers into 16 runs of 16 columns, one for each n, and each row
 * adds A[m][n] times the run for n ascending: each element the same fmaf
 * chain from zero, so the same bits. A block costs its transpose, 64
 * shuffles, and 16 fused multiply-adds a row, against 256 for a padded
 * panel. */
enum {
    TAIL_MOST = 13,     /* rows a tail tile, its accumulators beside the block's 16 */
    TAIL_AFTER_ODD = 6, /* rows past an odd number of whole panels a tail takes */
    /* columns a chunk: eight tiles of six, then the tail's three blocks of
     * 16 on the same columns of B (48 x N floats: 192 KiB at N = 1024),
     * which the tiles have just brought into L2 */
    TAIL_CHUNK = 48
};

/* Columns [k0, k0 + kn) (kn <= 16) of the rows c[r] = the rows a[r] (N
 * floats each) times B from its forward panels Bp (K columns); one
 * function for each number of rows. */
typedef void tail_fn(moe_index N, moe_index K, const float *const *a, const float *Bp,
                     moe_index k0, int kn, float *const *c);

#ifdef MOE_X86_KERNELS
/* v[j] (16 floats) = column j of the 16 x 16 block whose row i is v[i]. */
__attribute__((target("avx512f"), always_inline))
static inline void transpose16(__m512 v[PACK_COLS])
{
    __m512 t[PACK_COLS];
#pragma GCC unroll 8
    for (int i = 0; i < PACK_COLS; i += 2) { /* pairs of rows interleaved */
        t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < PACK_COLS; i += 4) { /* fours of rows, a column in each 128 bits */
        v[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        v[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
        v[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        v[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) { /* eights of rows: 128-bit quarters paired */
        t[i] = _mm512_shuffle_f32x4(v[i], v[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(v[i], v[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(v[i + 8], v[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(v[i + 8], v[i + 12], 0xdd);
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) { /* all sixteen rows */
        v[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        v[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

/* The tail_fn of R rows (R constant: each R its own function below, its
 * accumulators in registers). */
__attribute__((target("avx512f"), always_inline))
static inline void tail_rows(const int R, moe_index N, moe_index K, const float *const *a,
                             const float *Bp, moe_index k0, int kn, float *const *c)
{
    __m512 acc[TAIL_MOST];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
        acc[r] = _mm512_setzero_ps();
    for (moe_index n0 = 0; n0 < N; n0 += PACK_COLS) {
        const float *block = Bp + n0 * K + k0 * PACK_COLS; /* panel n0 / 16 */
        const int run = N - n0 < PACK_COLS ? (int)(N - n0) : PACK_COLS;
        __m512 v[PACK_COLS];
#pragma GCC unroll 16
        for (int j = 0; j < PACK_COLS; j++)
            v[j] = j < kn ? _mm512_loadu_ps(block + j * PACK_COLS) : _mm512_setzero_ps();
        transpose16(v);
#pragma GCC unroll 16
        for (int i = 0; i < PACK_COLS; i++)
            if (i < run)
#pragma GCC unroll 16
                for (int r = 0; r < R; r++)
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r][n0 + i]), v[i], acc[r]);
    }
    const __mmask16 keep = (__mmask16)((1u << kn) - 1);
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
        _mm512_mask_storeu_ps(c[r] + k0, keep, acc[r]);
}

#define TAIL_TILE(R)                                                                          \
    __attribute__((target("avx512f"))) static void tail_avx512_##R(                             \
        moe_index N, moe_index K, const float *const *a, const float *Bp, moe_index k0, int kn, \
        float *const *c)                                                                        \
    {                                                                                           \
        tail_rows(R, N, K, a, Bp, k0, kn, c);                                                   \
    }
TAIL_TILE(1)
TAIL_TILE(2)
TAIL_TILE(3)
TAIL_TILE(4)
TAIL_TILE(5)
TAIL_TILE(6)
TAIL_TILE(7)
TAIL_TILE(8)
TAIL_TILE(9)
TAIL_TILE(10)
TAIL_TILE(11)
TAIL_TILE(12)
TAIL_TILE(13)
#undef TAIL_TILE

/* tail_tiles[r] computes r rows. */
static tail_fn *const tail_tiles[TAIL_MOST + 1] = {
    NULL, tail_avx512_1, tail_avx512_2, tail_avx512_3, tail_avx512_4, tail_avx512_5,
    tail_avx512_6, tail_avx512_7, tail_avx512_8, tail_avx512_9, tail_avx512_10,
    tail_avx512_11, tail_avx512_12, tail_avx512_13};
#endif

/* The one-panel tile of moe_sgemm_packed_t. */
static tile_t_fn *packed_t_tile(void)
{
#ifdef MOE_X86_KERNELS
    if (packed_wide_tiles())
        return tile_t_avx512_one;
    if (packed_tiles() != portable_tiles)
        return tile_t_avx2;
#endif
    return tile_t_portable;
}

/* The two-panel tile of moe_sgemm_packed_t, or NULL. */
typedef void tile_t2_fn(moe_index N, const float *const a[TILE_ROWS], moe_index step,
                        const float *b, const float *b2, float *t, const float *next);

static tile_t2_fn *packed_t_wide_tile(void)
{
#ifdef MOE_X86_KERNELS
    if (packed_wide_tiles())
        return tile_t_avx512;
#endif
    return NULL;
}

/* The rows of C (M, K) moe_sgemm_packed_t computes in panels of A; the
 * rest, in tail tiles of at most TAIL_MOST rows, are the r = M % 16 past
 * the last whole panel, or those and the last whole panel. The tail pays
 * where the whole panels before it come in pairs and have brought B's
 * chunk into the cache: after an odd number, the padded panel pairs with
 * the last whole one in a two-panel tile, and the tail takes both (two
 * tiles' transposes) only for a few rows past it; with no whole panels
 * before it, it reads B from memory unprefetched. On a Zen 5 core, 32
 * experts' weights, both products of the data gradient at N = 1024,
 * padded against tail, alternated: 1.16 times as fast at 97 rows, 1.13 at
 * 100, 1.07 at 106, 1.03 at 108 and 109, 0.99 at 110; after an odd
 * number, 1.07-1.08 at 113, 1.04 at 116 and 118, 1.00 at 119 and 0.92 at
 * 120; with none, 0.35 at 8 rows. */
static moe_index packed_t_full(moe_index M)
{
    const moe_index r = M % PACK_COLS, whole = M / PACK_COLS;
#ifdef MOE_X86_KERNELS
    if (packed_wide_tiles() && r > 0 && whole > 0) {
        if (whole % 2 == 0 && r <= TAIL_MOST)
            return M - r;
        if (whole > 1 && r <= TAIL_AFTER_ODD)
            return M - r - PACK_COLS;
    }
#endif
    (void)r;
    (void)whole;
    return M;
}

/* Columns [k0, k1) of C in tiles of six, the M rows of A in its panels At,
 * two panels of rows at a time with wide (when not NULL), in chunks of
 * TAIL_CHUNK columns, each followed by the `rest` rows tail_a (into
 * tail_c) on its columns, in tail tiles. A tile's first
 * panels prefetch the columns of the tile two ahead: B's columns are 16
 * floats a panel, K * 16 apart, which the hardware does not follow, and
 * the tile one ahead was too close. Zen 5, 32 experts' weights from
 * memory, against the forward kernel on the same shapes, three alternated
 * pairs: at 96 rows 0.81-0.85 one ahead, 0.85-0.91 two ahead, with both
 * cores at once 0.87-0.88 and 0.89-0.91; at 25 rows 0.74 and 0.84. */
static void packed_t_columns(tile_t_fn *tile, tile_t2_fn *wide, moe_index M, moe_index N,
                             moe_index K, const float *At, const float *Bp, float *C,
                             moe_index ldc, moe_index k0, moe_index k1, moe_index rest,
                             const float *const *tail_a, float *const *tail_c)
{
    const moe_index step = K * PACK_COLS, panels = (M + PACK_COLS - 1) / PACK_COLS;
    float t[TILE_ROWS * 2 * PACK_COLS];
    for (moe_index kc = k0; kc < k1; kc += TAIL_CHUNK) {
        const moe_index kc1 = k1 - kc < TAIL_CHUNK ? k1 : kc + TAIL_CHUNK;
        for (moe_index k = kc; k < kc1; k += TILE_ROWS) {
            const moe_index cols = kc1 - k < TILE_ROWS ? kc1 - k : TILE_ROWS;
            const float *a[TILE_ROWS];
            for (int r = 0; r < TILE_ROWS; r++) /* a short tile repeats its last column */
                a[r] = Bp + (k + (r < cols ? r : cols - 1)) * PACK_COLS;
            const float *next =
                k + 2 * TILE_ROWS < k1 ? Bp + (k + 2 * TILE_ROWS) * PACK_COLS : NULL;
            for (moe_index p = 0, span; p < panels; p += span) {
                span = wide && p + 1 < panels ? 2 : 1; /* At's padding rows are zeros */
                const float *b = At + p * N * PACK_COLS;
                if (span == 2)
                    wide(N, a, step, b, b + N * PACK_COLS, t, p == 0 ? next : NULL);
                else
                    tile(N, a, step, b, t, p == 0 ? next : NULL);
                const moe_index m0 = p * PACK_COLS, width = span * PACK_COLS;
                const moe_index rows = M - m0 < width ? M - m0 : width;
                for (moe_index j = 0; j < rows; j++)
                    for (moe_index r = 0; r < cols; r++)
                        C[(m0 + j) * ldc + k + r] = t[r * width + j];
            }
        }
#ifdef MOE_X86_KERNELS /* the tail on the chunk's columns of B, still in the cache */
        for (moe_index g = 0, done = 0, groups = (rest + TAIL_MOST - 1) / TAIL_MOST; g < groups;
             g++) {
            const moe_index n = (rest - done) / (groups - g); /* even groups */
            for (moe_index kb = kc; kb < kc1; kb += PACK_COLS)
                tail_tiles[n](N, K, tail_a + done, Bp, kb,
                              kc1 - kb < PACK_COLS ? (int)(kc1 - kb) : PACK_COLS, tail_c + done);
            done += n;
        }
#else
        (void)rest;
        (void)tail_a;
        (void)tail_c;
#endif
    }
}

/* At = A (M, N) in panels of 16 rows, each [n][row], N * 16 floats (the
 * rows past M, to the last panel's end, zeros: transpose8's NULL rows). */
__attribute__((target_clones("avx2", "default")))
static void pack_a_panels(moe_index M, moe_index N, const float *A, moe_index lda, float *At)
{
    const moe_index padded = (M + PACK_COLS - 1) / PACK_COLS * PACK_COLS;
    for (moe_index m0 = 0; m0 < padded; m0 += T8) {
        const float *src[T8];
        for (int r = 0; r < T8; r++)
            src[r] = m0 + r < M ? A + (m0 + r) * lda : NULL;
        float *dst = At + m0 / PACK_COLS * N * PACK_COLS + m0 % PACK_COLS;
        for (moe_index n = 0; n < N; n += T8) {
            transpose8(T8, N - n < T8 ? (int)(N - n) : T8, src, dst + n * PACK_COLS, PACK_COLS);
            for (int r = 0; r < T8; r++)
                if (src[r])
                    src[r] += T8;
        }
    }
}

void moe_sgemm_packed_t(moe_index M, moe_index N, moe_index K, const float *A, moe_index lda,
                        const float *Bp, float *C, moe_index ldc)
{
    check_shape(M, K, N, lda, K, ldc, K);
    if (M == 0 || K == 0)
        return;
    if (N == 0) {
        for (moe_index m = 0; m < M; m++)
            memset(C + m * ldc, 0, sizeof(float) * (size_t)K);
        return;
    }
    /* the rows past the panels by tail tiles, when it pays */
    const moe_index full = packed_t_full(M), panels = (full + PACK_COLS - 1) / PACK_COLS;
    const float *tail_a[2 * PACK_COLS]; /* at most 16 + TAIL_AFTER_ODD rows */
    float *tail_c[2 * PACK_COLS];
    for (moe_index r = 0; full + r < M; r++) {
        tail_a[r] = A + (full + r) * lda;
        tail_c[r] = C + (full + r) * ldc;
    }
    float *At = moe_xmalloc(sizeof(float) * (size_t)(panels * N * PACK_COLS));
    pack_a_panels(full, N, A, lda, At);
    tile_t_fn *tile = packed_t_tile();
    tile_t2_fn *wide = packed_t_wide_tile();
    const moe_index tiles = (K + TILE_ROWS - 1) / TILE_ROWS;
    /* Threads split the columns of C, in whole tiles. */
#pragma omp parallel
    {
        moe_index t0, t1;
        thread_share(tiles, &t0, &t1);
        const moe_index k1 = t1 * TILE_ROWS < K ? t1 * TILE_ROWS : K;
        if (t0 * TILE_ROWS < k1)
            packed_t_columns(tile, wide, full, N, K, At, Bp, C, ldc, t0 * TILE_ROWS, k1, M - full,
                             tail_a, tail_c);
    }
    free(At);
    sgemm_flops += 2.0 * (double)M * (double)N * (double)K;
}


void moe_transpose(moe_index rows, moe_index cols, const float *B, float *Bt)
{
    moe_transpose_rows_at(rows, cols, B, NULL, Bt);
}

__attribute__((target_clones("avx2", "default")))
static void transpose_rows_at(moe_index rows, moe_index cols, const float *B, const moe_index *at,
                              float *Bt)
{
#pragma omp parallel for schedule(static)
    for (moe_index c0 = 0; c0 < cols; c0 += TRANSPOSE_CHUNK)
        for (moe_index r0 = 0; r0 < rows; r0 += T8) {
            const int nr = rows - r0 < T8 ? (int)(rows - r0) : T8;
            const moe_index c1 = cols - c0 < TRANSPOSE_CHUNK ? cols : c0 + TRANSPOSE_CHUNK;
            for (moe_index c = c0; c < c1; c += T8) {
                const float *src[T8];
                for (int r = 0; r < nr; r++)
                    src[r] = B + (at ? at[r0 + r] : r0 + r) * cols + c;
                transpose8(nr, c1 - c < T8 ? (int)(c1 - c) : T8, src, Bt + c * rows + r0, rows);
            }
        }
}

void moe_transpose_rows_at(moe_index rows, moe_index cols, const float *B, const moe_index *at,
                           float *Bt)
{
    transpose_rows_at(rows, cols, B, at, Bt);
}

double moe_gemm_sflops(void) { return sgemm_flops; }
void moe_gemm_reset_flops(void) { sgemm_flops = 0.0; }

int moe_gemm_threads(void) { return openblas_get_num_threads(); }
void moe_gemm_set_threads(int threads) { openblas_set_num_threads(threads); }
