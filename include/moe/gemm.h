/* SPDX-License-Identifier: MIT */
/* gemm.h — the one place every matrix product goes through: the BLAS calls
 * and the two kernels of our own.
 *
 * Row-major throughout: C (M, N) from A (M, K) and B, either (N, K) (the
 * fp64 truth: (out, in) like nn.Linear), transposed, (K, N) (sgemm and the
 * exact kernel), or that transpose packed into panels once (the packed
 * kernel: OpenBLAS repacks the weights on every call, which at the experts'
 * small M costs it a tenth of its speed). Shapes and leading dimensions are
 * checked here, and the FLOPs are counted (2*M*N*K per call) so that GFLOP/s
 * come for free.
 * Not thread-safe: call it from one thread per rank (BLAS threads inside).
 */
#ifndef MOE_GEMM_H
#define MOE_GEMM_H

#include <stdbool.h>

#include "moe/common.h"
#include "moe/dims.h"

/* C (M, N) = A (M, K) * Bt (K, N), fp32, OpenBLAS sgemm: the experts' layout
 * (weights stored transposed, (in, out)), which OpenBLAS packs faster than
 * (out, in) when M is small (a few percent at M = 96, equal at large M). */
void moe_sgemm_nn(moe_index M, moe_index N, moe_index K, const float *A, moe_index lda,
                  const float *Bt, moe_index ldbt, float *C, moe_index ldc);

/* C (M, N) = A (M, K) * B (N, K)^T in fp64 (dgemm), for the dense truth of
 * --check: fast, but its last bits depend on the BLAS kernel and threads. */
void moe_dgemm_nt(moe_index M, moe_index N, moe_index K, const double *A, moe_index lda,
                  const double *B, moe_index ldb, double *C, moe_index ldc);

/* The same product in a fixed order, for the dense truth of a golden set:
 *   C[m][n] = (...((0 + A[m][0]*B[n][0]) + A[m][1]*B[n][1]) + ...) + A[m][K-1]*B[n][K-1]
 * in fp64, k ascending, every product rounded and then added (no fused
 * multiply-add). An element depends on its row of A and row of B only: the
 * same bits on every CPU, instruction set and thread count. Vectorised
 * across columns (B is repacked into panels of 8 columns), OpenMP across
 * blocks. Not counted in moe_gemm_sflops. */
void moe_dgemm_nt_exact(moe_index M, moe_index N, moe_index K, const double *A, moe_index lda,
                        const double *B, moe_index ldb, double *C, moe_index ldc);

/* While `why` is set (not NULL), a call of moe_sgemm_nn or moe_dgemm_nt is a
 * broken invariant: it stops the process naming the rank, the call and why.
 * The golden dump sets it around its own work, so no BLAS bits can reach a
 * dumped tensor; NULL allows BLAS again. */
void moe_gemm_forbid_blas(const char *why);

/* C (M, N) = A (M, K) * Bt (K, N), the fixed-order kernel of --gemm exact:
 *   C[m][n] = (...((A[m][0]*Bt[0][n]) + A[m][1]*Bt[1][n]) + ...) + A[m][K-1]*Bt[K-1][n]
 * in fp32, k ascending, every product rounded and then added (no fused
 * multiply-add). Each element depends on its row of A and column of Bt only:
 * the bits do not change with M, N, the row's position, the blocking, the
 * vector width or the thread count. Vectorised across columns, OpenMP across
 * blocks of rows. Counted in moe_gemm_sflops like sgemm. */
void moe_sgemm_exact(moe_index M, moe_index N, moe_index K, const float *A, moe_index lda,
                     const float *Bt, moe_index ldbt, float *C, moe_index ldc);

/* C (M, N) = A (M, K) * Bt (K, N), the kernel of --gemm packed, with Bt
 * packed once by moe_sgemm_pack:
 *   C[m][n] = fma(A[m][K-1], Bt[K-1][n], ... fma(A[m][1], Bt[1][n],
 *                 fma(A[m][0], Bt[0][n], 0)) ...)
 * in fp32, k ascending, each step one fused multiply-add (one rounding).
 * Like the exact kernel, an element depends on its row of A and column of Bt
 * only: not on M, N, blocking, threads or the instruction set (AVX2+FMA
 * where the CPU has it, else the same operations through fmaf). Counted in
 * moe_gemm_sflops. */
void moe_sgemm_packed(moe_index M, moe_index N, moe_index K, const float *A, moe_index lda,
                      const float *Bp, float *C, moe_index ldc);

/* The same with A's row m at row_at[index[m]] (K floats each; index NULL:
 * row_at[m]): an expert's dispatched rows read where they arrived, through
 * the row table, without gathering them into one (M, K) block first. The
 * same bits as moe_sgemm_packed on the gathered rows. */
void moe_sgemm_packed_rows(moe_index M, moe_index N, moe_index K, const float *const *row_at,
                           const moe_index *index, const float *Bp, float *C, moe_index ldc);

/* The same with C's row m at C + c_index[m] * ldc (c_index NULL: C + m *
 * ldc): an expert's outputs written straight to its pairs' rows, without
 * a second pass to scatter them. The same bits as moe_sgemm_packed. */
void moe_sgemm_packed_to(moe_index M, moe_index N, moe_index K, const float *A, moe_index lda,
                         const float *Bp, float *C, moe_index ldc, const moe_index *c_index);

/* C (M, K) = A (M, N) * B (N, K), with B given as moe_sgemm_pack(N, K, B)
 * packed it for moe_sgemm_packed's C' = A' B^T: the backward's products
 * with the forward's weight panels, without a copy in another layout. Each
 * element is moe_sgemm_packed's chain over n ascending, so C has the bits
 * moe_sgemm_packed gives with B packed as its Bt (moe_sgemm_pack_rows(N,
 * K, B)). Counted in moe_gemm_sflops. */
void moe_sgemm_packed_t(moe_index M, moe_index N, moe_index K, const float *A, moe_index lda,
                        const float *Bp, float *C, moe_index ldc);

/* Floats that a packed (K, N) operand takes: N rounded up to 16, times K. */
moe_index moe_sgemm_packed_floats(moe_index K, moe_index N);

/* Bp = B (N, K) packed for moe_sgemm_packed as the operand Bt = B^T: panels
 * of 16 columns of Bt, each K rows of 16 floats (zeros past N). */
void moe_sgemm_pack(moe_index N, moe_index K, const float *B, float *Bp);

/* The same panels from Bt (K, N) itself, row-major: no transpose. */
void moe_sgemm_pack_rows(moe_index K, moe_index N, const float *Bt, float *Bp);

/* The same with Bt's row k at Bt + rows[k] * N: packed straight from the
 * rows of a larger array, without gathering them first (rows NULL: k). */
void moe_sgemm_pack_rows_at(moe_index K, moe_index N, const float *Bt, const moe_index *rows,
                            float *Bp);

/* The tiles moe_sgemm_packed and moe_sgemm_packed_t run: the widest the
 * CPU has (AVX-512F: up to 6 x 32 over two panels, where two whole panels
 * are left, and moe_sgemm_packed_t's tail tiles for a few rows past A's
 * last whole panel of 16; AVX2+FMA: up to 6 x 16), or the portable fmaf loop;
 * moe_sgemm_packed splits a row block of M rows into ceil(M / 6) tiles of
 * even heights (25 rows: five of 5). Every tile computes
 * each element as the same fmaf chain, so the bits do not depend on which
 * ran; tests and bench force the narrower ones to compare them. */
/* What runs here: "avx512f+avx2+fma", "avx2+fma" or "portable fmaf". */
const char *moe_sgemm_packed_isa(void);
/* At most `isa` from now on (MOE_ISA_WIDEST: whatever the CPU has). */
void moe_sgemm_packed_force(enum moe_isa isa);
/* Bytes of A in a row block of moe_sgemm_packed, which streams the weights
 * once a block: a quarter of a CPU's share of the last-level cache
 * (moe_llc_share_bytes), within 1 and 4 MiB. Only the speed depends on it. */
size_t moe_sgemm_packed_block_bytes(void);
/* Bytes of A in a row block once A outgrows a core's L2 cache: a quarter of
 * it (moe_l2_bytes), so that a block stays there; 0 where the L2's size is
 * unknown (moe_sgemm_packed_block_bytes then). */
size_t moe_sgemm_packed_l2_block_bytes(void);

/* Bt (K, N) = B (N, K)^T: the experts' weights as generated, transposed. */
void moe_transpose(moe_index rows, moe_index cols, const float *B, float *Bt);

/* The same with B's row r at B + at[r] * cols (at NULL: r). */
void moe_transpose_rows_at(moe_index rows, moe_index cols, const float *B, const moe_index *at,
                           float *Bt);

/* FLOPs issued through moe_sgemm_nn, moe_sgemm_exact and moe_sgemm_packed
 * since the last reset. */
double moe_gemm_sflops(void);
void moe_gemm_reset_flops(void);

/* BLAS threads per rank (OpenBLAS), and the setter used by the comm layer. */
int moe_gemm_threads(void);
void moe_gemm_set_threads(int threads);

#endif
