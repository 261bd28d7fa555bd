/* gemm.h — the one wrapper through which every BLAS call goes.
 *
 * Row-major throughout: C (M, N) from A (M, K) and B, either (N, K) (the
 * fp64 truth: (out, in) like nn.Linear) or transposed, (K, N) (the experts,
 * sgemm and the exact kernel). Shapes and leading dimensions are checked
 * here, and the FLOPs are counted (2*M*N*K per call) so that GFLOP/s come
 * for free.
 * Not thread-safe: call it from one thread per rank (BLAS threads inside).
 */
#ifndef MOE_GEMM_H
#define MOE_GEMM_H

#include "moe/dims.h"

/* C (M, N) = A (M, K) * Bt (K, N), fp32, OpenBLAS sgemm: the experts' layout
 * (weights stored transposed, (in, out)), which OpenBLAS packs faster than
 * (out, in) when M is small (a few percent at M = 96, equal at large M). */
void moe_sgemm_nn(moe_index M, moe_index N, moe_index K, const float *A, moe_index lda,
                  const float *Bt, moe_index ldbt, float *C, moe_index ldc);

/* C (M, N) = A (M, K) * B (N, K)^T in fp64 (dgemm), for the dense truth. */
void moe_dgemm_nt(moe_index M, moe_index N, moe_index K, const double *A, moe_index lda,
                  const double *B, moe_index ldb, double *C, moe_index ldc);

/* C (M, N) = A (M, K) * Bt (K, N), the fixed-order kernel of --gemm exact:
 *   C[m][n] = (...((A[m][0]*Bt[0][n]) + A[m][1]*Bt[1][n]) + ...) + A[m][K-1]*Bt[K-1][n]
 * in fp32, k ascending, every product rounded and then added (no fused
 * multiply-add). Each element depends on its row of A and column of Bt only:
 * the bits do not change with M, N, the row's position, the blocking, the
 * vector width or the thread count. Vectorised across columns, OpenMP across
 * blocks of rows. Counted in moe_gemm_sflops like sgemm. */
void moe_sgemm_exact(moe_index M, moe_index N, moe_index K, const float *A, moe_index lda,
                     const float *Bt, moe_index ldbt, float *C, moe_index ldc);

/* Bt (K, N) = B (N, K)^T: the experts' weights as generated, transposed. */
void moe_transpose(moe_index rows, moe_index cols, const float *B, float *Bt);

/* FLOPs issued through moe_sgemm_nn and moe_sgemm_exact since the last
 * reset. */
double moe_gemm_sflops(void);
void moe_gemm_reset_flops(void);

/* BLAS threads per rank (OpenBLAS), and the setter used by the comm layer. */
int moe_gemm_threads(void);
void moe_gemm_set_threads(int threads);

#endif
