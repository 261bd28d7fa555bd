/* SPDX-License-Identifier: MIT */
/* backward.h — the gradients of the MoE layer's pieces: the SwiGLU expert
 * (fp32 on the EP path, fp64 for the truth) and the router.
 *
 * For an upstream gradient dy of the layer output y, one routed pair
 * (token i, expert e, gate weight g) with h = x W1^T, a = silu(h_gate) * h_up:
 *
 *   weight at output      y_i += g * (a W2^T)      dO = g * dy_i,  a' = a
 *                                                  dg = <dy_i, a W2^T>
 *   weight at activation  y_i += (g * a) W2^T      dO = dy_i,      a' = g * a
 *                                                  dg = <dy_i W2, a>
 *   then, both:   dW2 += dO^T a'     dA = dO W2 (times g at activation)
 *                 dH  = [dA * u * silu'(h_gate), dA * silu(h_gate)]
 *                 dW1 += dH^T x      dx_pair = dH W1
 *   silu(v) = v s,  silu'(v) = s + silu(v) (1 - s),  s = 1 / (1 + e^-v).
 *
 * Saved from the forward: the rows x as the expert received them and (weight
 * at output) its outputs a W2^T. Recomputed: h (one L1 GEMM) and a.
 *
 * The router's weights are a function of the logits only; the top-k choice,
 * the group limit with its -inf mask and the correction bias pick which
 * experts, and pass no gradient (the function is piecewise; at an exact tie
 * the choice is the lower index, as in the forward, and the gradient is that
 * of the piece the forward took). Pure: no MPI.
 */
#ifndef MOE_BACKWARD_H
#define MOE_BACKWARD_H

#include <stdbool.h>
#include <stdint.h>

#include "moe/dims.h"
#include "moe/experts.h"
#include "moe/router.h"
#include "moe/config.h"

/* An expert's weights as the backward's data GEMMs take them, in the layout
 * of the GEMM kind: W1 (2f, d) as the operand (K = 2f, N = d) of dx = dH W1,
 * W2 (d, f) as the operand (K = d, N = f) of dA = dO W2. Both NULL with
 * --gemm packed: the products read the forward's panels
 * (moe_sgemm_packed_t), with the same bits. */
typedef struct {
    const float *w1; /* moe_expert_grad_w1_floats */
    const float *w2; /* moe_expert_grad_w2_floats */
} moe_expert_grad_weights;

moe_index moe_expert_grad_w1_floats(enum moe_gemm_kind gemm, moe_index hidden, moe_index ffn);
moe_index moe_expert_grad_w2_floats(enum moe_gemm_kind gemm, moe_index hidden, moe_index ffn);

/* Lay generated weights w1 (2f, d), w2 (d, f) out for the backward. */
void moe_expert_grad_layout(enum moe_gemm_kind gemm, moe_index hidden, moe_index ffn,
                            const float *w1, const float *w2, float *w1g, float *w2g);

/* The same floats from the forward's layout of them (moe_expert_layout):
 * the backward's copy need not be kept, one expert's is made when its data
 * gradient runs (blas and exact; packed needs none). */
void moe_expert_grad_layout_from_forward(enum moe_gemm_kind gemm, moe_index hidden, moe_index ffn,
                                         const moe_expert_weights *fw, float *w1g, float *w2g);

/* What a batch keeps between its data and weight gradients, row i of each
 * for row i of the batch: dH (n, 2f) and a' (n, f). The output's gradient
 * dO (n, d) is not kept: the weight gradient makes it again from dy and the
 * gate, with the same bits (one fp32 product per element). */
typedef struct {
    float *dH, *act;
} moe_expert_grad_work;

/* Work for n rows (moe_xmalloc, one block; moe_expert_grad_work_free). */
moe_expert_grad_work moe_expert_grad_work_alloc(moe_index n, moe_index hidden, moe_index ffn);
void moe_expert_grad_work_free(moe_expert_grad_work *w);

/* The same work in a block of moe_expert_grad_work_bytes the caller holds
 * (its dH is the block). */
static inline size_t moe_expert_grad_work_bytes(moe_index n, moe_index ffn)
{
    return sizeof(float) * (size_t)(n * 3 * ffn) + 1;
}

static inline moe_expert_grad_work moe_expert_grad_work_in(float *block, moe_index n, moe_index ffn)
{
    return (moe_expert_grad_work){block, block + n * 2 * ffn};
}

/* The same arrays from row `first` on: a block's or an expert's part of a
 * larger batch. */
static inline moe_expert_grad_work moe_expert_grad_work_rows(const moe_expert_grad_work *w,
                                                             moe_index first, moe_index hidden,
                                                             moe_index ffn)
{
    (void)hidden;
    return (moe_expert_grad_work){w->dH + first * 2 * ffn, w->act + first * ffn};
}

/* The data gradient (the backward's B) of one expert on n rows: dx (n, d)
 * and, when gate (n) is given, dgate (n) = dL/dg per row; work receives
 * dH and a' for moe_expert_backward_weights. gate NULL: an ungated expert
 * (the shared ones). out (n, d), the forward's outputs a W2^T, is read only
 * with a gate and weight at output (NULL: recomputed). The products are
 * fp32 GEMMs of kind gemm; the dot product of dg is summed in fp64 over j
 * ascending and rounded once. With packed and exact a row's dx and dg
 * depend on nothing but that row. */
void moe_expert_backward_data(const moe_expert_weights *fw, const moe_expert_grad_weights *bw,
                              enum moe_gemm_kind gemm, const float *x, const float *dy,
                              const float *gate, const float *out, int weight_at, moe_index n,
                              moe_index hidden, moe_index ffn, const moe_expert_grad_work *work,
                              float *dx, float *dgate);

/* The same on rows read where they are: row r of x and of dy at x[r] and
 * dy[r], of out at out[r] (out NULL: recomputed, as above), hidden floats
 * each; the packed kernel reads x's rows in place, as the forward's does
 * (moe_sgemm_packed_rows). The same bits as moe_expert_backward_data on the
 * rows gathered. */
void moe_expert_backward_data_rows(const moe_expert_weights *fw,
                                   const moe_expert_grad_weights *bw, enum moe_gemm_kind gemm,
                                   const float *const *x, const float *const *dy,
                                   const float *gate, const float *const *out, int weight_at,
                                   moe_index n, moe_index hidden, moe_index ffn,
                                   const moe_expert_grad_work *work, float *dx, float *dgate);

/* The weight gradient (the backward's W) of the same batch, given its x,
 * dy and gate (NULL: ungated) as the data gradient had them, the batch's
 * row r at row rows[r] of x and dy (rows NULL: row r; rows lets an expert
 * read its rows in place in the rank's received ones): dw1 (2f, d) =
 * dH^T x and dw2 (d, f) = dO^T a', overwritten. The sum over rows runs in
 * row order; with packed and exact every element is one chain over the rows
 * ascending (fma steps, or rounded products then additions), so a caller
 * that passes an expert's rows in global token order gets the same bits
 * whichever ranks the rows came from. n = 0 gives zeros. */
void moe_expert_backward_weights(enum moe_gemm_kind gemm, const float *x, const float *dy,
                                 const moe_index *rows, const float *gate, int weight_at,
                                 moe_index n, moe_index hidden, moe_index ffn,
                                 const moe_expert_grad_work *work, float *dw1, float *dw2);

/* Both gradients of the fp64 truth: w1 (2f, d), w2 (d, f), x and dy (n, d);
 * gate (n) or NULL as above; dx (n, d), dgate (n) (with a gate), dw1 (2f, d)
 * and dw2 (d, f), each may be NULL when not wanted. GEMMs as `gemm` says,
 * exp as moe_exp_fp64. */
void moe_expert_backward_f64(enum moe_truth_gemm gemm, const double *w1, const double *w2,
                             const double *x, const double *dy, const double *gate, int weight_at,
                             moe_index n, moe_index hidden, moe_index ffn, double *dx,
                             double *dgate, double *dw1, double *dw2);

/* dlogits (T, E) of the router r at logits (T, E) (before --skew, which
 * is added here), the selection ids (T, k) the forward made and dweights
 * (T, k) = dL/dweight per slot; fp64 throughout, the scores recomputed from
 * the logits. dlogits may be logits (rows are read before written). With weights w_s = c * p_s / sum_sel p (or
 * c * p_s without renormalisation), c = route_scale:
 *   dp_j = c * (dw_j / S - sum_s dw_s p_s / S^2) on the selected j, 0 elsewhere
 *   softmax:   dlogit_e = p_e * (dp_e - sum_j p_j dp_j)   over all E logits
 *   sigmoid:   dlogit_e = dp_e * p_e * (1 - p_e)          (zero where unselected)
 * An expert the group limit masked with -inf is never selected: dp_e = 0. */
void moe_router_backward(const moe_router *r, const double *logits, const int32_t *ids,
                         const double *dweights, moe_index tokens, double *dlogits);

/* Through the gate's product logits = x W_g^T, fp64, fixed order:
 *   dx (T, d)     += sum over e ascending of dlogits[i][e] * W_g[e]     (dx may be NULL)
 *   dgate_w (E, d) += sum over tokens ascending of dlogits[i][e] * x[i]  (may be NULL) */
void moe_gate_backward(const double *dlogits, const float *gate, const float *x, moe_index tokens,
                       moe_index hidden, int experts, double *dx, double *dgate_w);

/* Both for one batch: dlogits of logits (T, E) as moe_router_logits gave
 * them (fp32), then dx += through the gate and dgate_w = the batch's share
 * of W_g's gradient (overwritten). The EP path and the truth call this. */
void moe_router_gate_backward(const moe_router *r, const float *gate, const float *x,
                              const float *logits, const int32_t *ids, const double *dweights,
                              moe_index tokens, moe_index hidden, double *dx, double *dgate_w);

/* The same with dx in fp32: dx += the router's share, each element's fp64
 * sum (from zero, the order above) rounded once; the fp64 sums are held a
 * few tokens at a time, not the batch's (T, d). */
void moe_router_gate_backward_rounded(const moe_router *r, const float *gate, const float *x,
                                      const float *logits, const int32_t *ids,
                                      const double *dweights, moe_index tokens, moe_index hidden,
                                      float *dx, double *dgate_w);

/* --backward and --grad-output: the training step mirrors the flat
 * dispatch, fp32 both ways, in waves of tokens, through the router's own
 * weights. MOE_EXIT_OK or MOE_EXIT_USAGE with st set. */
int moe_backward_validate(const moe_config *cfg, moe_status *st);

/* Bytes a training step adds to a rank's peak (moe_config_memory_per_rank):
 * the gradients, the step's buffers, with --check and --dump the truth's
 * and rank 0's gathered backward stage. */
double moe_backward_memory(const moe_config *cfg, int ranks);

#endif
