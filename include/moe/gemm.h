/* gemm.h — the one wrapper through which every BLAS call goes.
 *
 * All products here are C = A * B^T with row-major A (M, K), B (N, K) and
 * C (M, N): weights are stored (out, in) like nn.Linear, so every layer is
 * this shape. Shapes and leading dimensions are checked here, and the FLOPs
 * are counted (2*M*N*K per call) so that GFLOP/s come for free.
 * Not thread-safe: call it from one thread per rank (BLAS threads inside).
 */
#ifndef MOE_GEMM_H
#define MOE_GEMM_H

#include "moe/dims.h"

/* C (M, N) = A (M, K) * B (N, K)^T, fp32, OpenBLAS sgemm. */
void moe_sgemm_nt(moe_index M, moe_index N, moe_index K, const float *A, moe_index lda,
                  const float *B, moe_index ldb, float *C, moe_index ldc);

/* The same in fp64 (dgemm), for the dense truth. */
void moe_dgemm_nt(moe_index M, moe_index N, moe_index K, const double *A, moe_index lda,
                  const double *B, moe_index ldb, double *C, moe_index ldc);

/* FLOPs issued through moe_sgemm_nt since the last reset. */
double moe_gemm_sflops(void);
void moe_gemm_reset_flops(void);

/* BLAS threads per rank (OpenBLAS), and the setter used by the comm layer. */
int moe_gemm_threads(void);
void moe_gemm_set_threads(int threads);

#endif
