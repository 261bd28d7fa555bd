/* gemm.c — BLAS wrapper with shape checks and FLOP counting (see gemm.h). */
#include "moe/gemm.h"

#include <cblas.h>
#include <limits.h>

#include "moe/common.h"

static double sgemm_flops;

static void check_shape(moe_index M, moe_index N, moe_index K, moe_index lda, moe_index ldb,
                        moe_index ldc)
{
    MOE_ASSERT(M >= 0 && N >= 0 && K >= 0);
    MOE_ASSERT(M <= INT_MAX && N <= INT_MAX && K <= INT_MAX);
    MOE_ASSERT(lda >= K && ldb >= K && ldc >= N);
    MOE_ASSERT(lda <= INT_MAX && ldb <= INT_MAX && ldc <= INT_MAX);
}

void moe_sgemm_nt(moe_index M, moe_index N, moe_index K, const float *A, moe_index lda,
                  const float *B, moe_index ldb, float *C, moe_index ldc)
{
    check_shape(M, N, K, lda, ldb, ldc);
    if (M == 0 || N == 0)
        return;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)N, (int)K, 1.0f, A,
                (int)lda, B, (int)ldb, 0.0f, C, (int)ldc);
    sgemm_flops += 2.0 * (double)M * (double)N * (double)K;
}

void moe_dgemm_nt(moe_index M, moe_index N, moe_index K, const double *A, moe_index lda,
                  const double *B, moe_index ldb, double *C, moe_index ldc)
{
    check_shape(M, N, K, lda, ldb, ldc);
    if (M == 0 || N == 0)
        return;
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)N, (int)K, 1.0, A,
                (int)lda, B, (int)ldb, 0.0, C, (int)ldc);
}

double moe_gemm_sflops(void) { return sgemm_flops; }
void moe_gemm_reset_flops(void) { sgemm_flops = 0.0; }

int moe_gemm_threads(void) { return openblas_get_num_threads(); }
void moe_gemm_set_threads(int threads) { openblas_set_num_threads(threads); }
