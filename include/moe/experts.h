/* experts.h — the SwiGLU expert FFN, fp32 (EP path) and fp64 (dense truth).
 *
 *   h = x W1^T            (rows, 2f): columns [0, f) gate, [f, 2f) up
 *   a = silu(gate) * up   (rows, f),  silu(g) = g / (1 + exp(-g))
 *   y = a W2^T            (rows, d)
 *
 * Pure: no MPI. The fp32 version issues exactly two sgemm calls for a batch,
 * whatever its rows are, so a caller that passes the same rows in the same
 * order gets the same bits.
 */
#ifndef MOE_EXPERTS_H
#define MOE_EXPERTS_H

#include "moe/dims.h"

typedef struct {
    const float *w1; /* (2f, d) */
    const float *w2; /* (d, f) */
} moe_expert_weights;

/* y (rows, d) = FFN(x (rows, d)); scratch (rows, 3f) floats. */
void moe_expert_forward(const moe_expert_weights *w, const float *x, moe_index rows,
                        moe_index hidden, moe_index ffn, float *scratch, float *y);

/* The same in fp64, with w1 (2f, d) and w2 (d, f) in fp64;
 * scratch (rows, 3f) doubles. */
void moe_expert_forward_f64(const double *w1, const double *w2, const double *x, moe_index rows,
                            moe_index hidden, moe_index ffn, double *scratch, double *y);

/* Generate routed expert e's weights (fp32) into w1 (2f, d) and w2 (d, f). */
void moe_expert_generate(uint64_t seed, int expert, moe_index hidden, moe_index ffn, float *w1,
                         float *w2);
/* The same for shared expert s. */
void moe_shared_expert_generate(uint64_t seed, int shared, moe_index hidden, moe_index ffn,
                                float *w1, float *w2);

#endif
