/* SPDX-License-Identifier: MIT */
/* experts.h — the SwiGLU expert FFN, fp32 (EP path) and fp64 (dense truth).
 *
 *   h = x W1^T            (rows, 2f): columns [0, f) gate, [f, 2f) up
 *   a = silu(gate) * up   (rows, f),  silu(g) = g / (1 + exp(-g))
 *   y = a W2^T            (rows, d)
 *
 * exp is moe_exp_fp32 (below), specified to the bit, so a port can match the
 * activation exactly rather than inherit its C library's expf.
 *
 * Pure: no MPI. The fp32 version runs its GEMMs with one of three kinds
 * (enum moe_gemm_kind). With packed and exact a row's output depends on that
 * row only; with blas it issues exactly two sgemm calls for a batch, whatever
 * its rows are, so a caller that passes the same rows in the same order gets
 * the same bits.
 */
#ifndef MOE_EXPERTS_H
#define MOE_EXPERTS_H

#include <stdbool.h>

#include "moe/dims.h"
#include "moe/quant.h"

enum moe_gemm_kind {
    MOE_GEMM_BLAS,   /* OpenBLAS sgemm; bits depend on M, row position, threads */
    MOE_GEMM_EXACT,  /* moe_sgemm_exact: no FMA, slow; bits depend on nothing but the row */
    MOE_GEMM_PACKED, /* moe_sgemm_packed: FMA, fast; bits depend on nothing but the row */
};

/* "blas", "exact", or "packed (ISA)" with the instruction set it runs on. */
const char *moe_gemm_label(enum moe_gemm_kind gemm);

/* Whether a row's bits are the same whatever batch it is computed in. */
static inline int moe_gemm_rows_independent(enum moe_gemm_kind gemm)
{
    return gemm != MOE_GEMM_BLAS;
}

/* The rounding points inside an expert (--gemm-out-dtype, --act-dtype; all
 * zero: none, every intermediate fp32), each applied to the fp32 value:
 *   h_bf16     h = x W1^T rounded to bf16 before the activation
 *   act_dtype  the activation rounded before L2: MOE_DTYPE_BF16, or
 *              MOE_DTYPE_FP8, each row's f values quantised in blocks of
 *              128 as fmt says (moe_quantize_e4m3_row) and dequantised
 *   out_bf16   the output rounded to bf16 */
typedef struct {
    bool h_bf16, out_bf16;
    int act_dtype; /* enum moe_dtype */
    moe_fp8_format fmt;
} moe_expert_rounding;

/* The routed experts' rounding points of a config. */
moe_expert_rounding moe_expert_rounding_of(const moe_config *cfg);

/* Whether r rounds anywhere. */
static inline bool moe_expert_rounds(const moe_expert_rounding *r)
{
    return r->h_bf16 || r->out_bf16 || r->act_dtype != MOE_DTYPE_FP32;
}

/* An expert's weights as its GEMM kind takes them: transposed, (in, out),
 * and for packed, that transpose in moe_sgemm_pack's panels; and the
 * rounding points its forward applies (routed experts only). */
typedef struct {
    const float *w1t; /* (d, 2f) = W1^T: columns [0, f) gate, [f, 2f) up */
    const float *w2t; /* (f, d) = W2^T */
    moe_expert_rounding rounding;
} moe_expert_weights;

/* C (M, N) = A (M, K) * Bt, the operand (K, N) in the layout of gemm
 * (moe_sgemm_nn, moe_sgemm_exact or moe_sgemm_packed). */
void moe_expert_gemm(enum moe_gemm_kind gemm, moe_index M, moe_index N, moe_index K,
                     const float *A, moe_index lda, const float *Bt, float *C, moe_index ldc);

/* The widest registers the fp32 SwiGLU, forward and backward, may use
 * from now on: MOE_ISA_WIDEST 16 lanes where the CPU has AVX-512F, any
 * other 8 (for tests; every choice gives the same bits). And the lanes
 * it uses now. */
void moe_expert_activation_force(enum moe_isa isa);
int moe_expert_activation_lanes(void);

/* Floats one expert's W1^T and W2^T take in the layout of `gemm`. */
moe_index moe_expert_w1_floats(enum moe_gemm_kind gemm, moe_index hidden, moe_index ffn);
moe_index moe_expert_w2_floats(enum moe_gemm_kind gemm, moe_index hidden, moe_index ffn);

/* Lay generated weights, w1 (2f, d) and w2 (d, f), out for `gemm` into w1t
 * and w2t (moe_expert_w1_floats and _w2_floats each). */
void moe_expert_layout(enum moe_gemm_kind gemm, moe_index hidden, moe_index ffn, const float *w1,
                       const float *w2, float *w1t, float *w2t);

/* The three compute stages of an expert, in the seed's names. */
enum moe_ffn_stage { MOE_FFN_L1, MOE_FFN_ACTIVATION, MOE_FFN_L2, MOE_FFN_STAGES };

/* Called after each compute stage (of each row chunk): the comm layer times
 * the stages and drives communication there. NULL `after` means no calls. */
typedef struct {
    void (*after)(void *ctx, enum moe_ffn_stage stage);
    void *ctx;
    moe_index chunk_rows; /* exact and packed: rows per chunk between calls; 0 = all */
} moe_ffn_hooks;

/* y (rows, d) = FFN(x (rows, d)); scratch (rows, 2f) floats. y may be x
 * (each row chunk's output replaces its input after the input is used, and
 * no GEMM call reads and writes the same memory). act_scale
 * (rows), when not NULL, multiplies each row of the activation before L2 (the
 * gate weight applied inside the expert, as fused GPU kernels do). With blas
 * the batch is two whole sgemm calls, whatever the hooks (so the same rows
 * give the same bits); with exact and packed it may run in row chunks (the
 * bits do not change). hooks may be NULL. */
void moe_expert_forward(const moe_expert_weights *w, enum moe_gemm_kind gemm, const float *x,
                        moe_index rows, moe_index hidden, moe_index ffn, float *scratch, float *y,
                        const float *act_scale, const moe_ffn_hooks *hooks);

/* The same with --gemm packed, x's row n at row_at[index[n]] (d floats
 * each; index NULL: row_at[n]): the rows an expert received, read where
 * they arrived through the row table instead of gathered into one block
 * (moe_sgemm_packed_rows); and y's row n at y + y_index[n] * d (y_index
 * NULL: y (rows, d)), the outputs written straight to their pairs' rows
 * (moe_sgemm_packed_to). The same bits as moe_expert_forward with packed
 * on the gathered rows; y is not one of the rows. */
void moe_expert_forward_rows(const moe_expert_weights *w, const float *const *row_at,
                             const moe_index *index, moe_index rows, moe_index hidden,
                             moe_index ffn, float *scratch, float *y, const moe_index *y_index,
                             const float *act_scale, const moe_ffn_hooks *hooks);

/* The fp64 GEMM of the dense truth. */
enum moe_truth_gemm {
    MOE_TRUTH_BLAS,  /* moe_dgemm_nt: fast; the last bits depend on the BLAS kernel (--check) */
    MOE_TRUTH_EXACT, /* moe_dgemm_nt_exact: the same bits on every machine (--dump) */
};

/* The same in fp64, with w1 (2f, d) and w2 (d, f) in fp64, GEMMs as `gemm`
 * says and exp as moe_exp_fp64; scratch (rows, 3f) doubles. */
void moe_expert_forward_f64(enum moe_truth_gemm gemm, const double *w1, const double *w2,
                            const double *x, moe_index rows, moe_index hidden, moe_index ffn,
                            double *scratch, double *y);

/* The same with the rounding points of r (x, w1 and w2 hold fp32 values):
 * each rounding applied to the fp64 value as the fp32 path applies it to
 * its own, into y; and width (rows, d), when not NULL, how far apart the
 * outputs of two fp32 computations of this expert can lie, each with its
 * own summation order and exp, before the output's own rounding to bf16:
 * every intermediate is carried as an interval holding every such
 * computation's value (h within the fp32 dot product's error bound
 * gamma(d+1) sum |x||w| of the fp64 value, the activation within 8 u of
 * silu(g) up over the box of its inputs, the FP8 scale over the block's
 * amax interval), each rounding point maps its interval's ends, and
 * width = |W2| (hi - lo) of the activation. Zero where nothing can flip;
 * a value a rounding boundary lies near widens its row. */
void moe_expert_forward_f64_rounded(enum moe_truth_gemm gemm, const moe_expert_rounding *r,
                                    const double *w1, const double *w2, const double *x,
                                    moe_index rows, moe_index hidden, moe_index ffn, double *y,
                                    double *width);

/* e^x in fp32, every step one IEEE single operation (round to nearest, no
 * fused multiply-add):
 *   x > 88.7228317: +inf;  x < -87.3365402: 0      (the floats nearest
 *       ln FLT_MAX and ln FLT_MIN inside them: results stay finite, normal)
 *   n = (x * 1.44269504 + 1.5*2^23) - 1.5*2^23          round(x / ln 2)
 *   r = (x - n * 0.693359375) - n * -2.12194440e-4      ln 2 in two parts
 *   p = Horner, from the top, of 1/5040, 1/720, 1/120, 1/24, 1/6, 1/2, 1, 1
 *       (the Taylor series of e^r to degree 7, each coefficient rounded)
 *   e^x = p * 2^(n/2) * 2^(n - n/2)                    n/2 truncated
 * NaN gives NaN. Within 2 ulp of e^x over the range (tested). */
float moe_exp_fp32(float x);

/* Generate routed expert e's weights (fp32) into w1 (2f, d) and w2 (d, f). */
void moe_expert_generate(uint64_t seed, int expert, moe_index hidden, moe_index ffn, float *w1,
                         float *w2);
/* The same for shared expert s. */
void moe_shared_expert_generate(uint64_t seed, int shared, moe_index hidden, moe_index ffn,
                                float *w1, float *w2);
/* Routed expert n (shared expert n when `shared`), as the two above make
 * it, rounded to dtype (moe_precision_expert; pow2: UE8M0 scales for fp8),
 * in fp64. */
void moe_expert_generate_f64(uint64_t seed, bool shared, int n, int dtype, bool pow2,
                             moe_index hidden, moe_index ffn, double *w1, double *w2);

/* An expert's fp32 W1 (2f, d) and W2 (d, f) rounded to dtype in place
 * (moe_precision_expert) and widened into w1_64, w2_64. */
void moe_expert_held_f64(int dtype, bool pow2, float *w1, float *w2, moe_index hidden,
                         moe_index ffn, double *w1_64, double *w2_64);

#endif
