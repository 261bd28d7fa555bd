/* gemm.c — BLAS wrapper with shape checks and FLOP counting (see gemm.h). */
#include "moe/gemm.h"

#include <cblas.h>
#include <limits.h>
#include <string.h>

#include "moe/common.h"

static double sgemm_flops;

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
    if (M == 0 || N == 0)
        return;
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)N, (int)K, 1.0, A,
                (int)lda, B, (int)ldb, 0.0, C, (int)ldc);
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
        lanes8 acc[EXACT_ROWS][4];
        for (int r = 0; r < EXACT_ROWS; r++)
            for (int v = 0; v < 4; v++)
                acc[r][v] = (lanes8){0};
        for (moe_index k = 0; k < K; k++) {
            const float *b = Bt + k * ldbt + n0;
            const lanes8 b0 = load8(b), b1 = load8(b + 8), b2 = load8(b + 16), b3 = load8(b + 24);
            for (int r = 0; r < EXACT_ROWS; r++) {
                const float a = A[(m + r) * lda + k];
                acc[r][0] += a * b0;
                acc[r][1] += a * b1;
                acc[r][2] += a * b2;
                acc[r][3] += a * b3;
            }
        }
        for (int r = 0; r < EXACT_ROWS; r++)
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

void moe_transpose(moe_index rows, moe_index cols, const float *B, float *Bt)
{
#pragma omp parallel for schedule(static)
    for (moe_index c = 0; c < cols; c++)
        for (moe_index r = 0; r < rows; r++)
            Bt[c * rows + r] = B[r * cols + c];
}

double moe_gemm_sflops(void) { return sgemm_flops; }
void moe_gemm_reset_flops(void) { sgemm_flops = 0.0; }

int moe_gemm_threads(void) { return openblas_get_num_threads(); }
void moe_gemm_set_threads(int threads) { openblas_set_num_threads(threads); }
