/* SPDX-License-Identifier: MIT */
/* truth.h — the dense fp64 ground truth and the comparison against it.
 *
 * The truth is the dense sum: every expert applied to every token in fp64,
 * multiplied by the token's gate weight for that expert (zero when not
 * selected), summed over experts in ascending id, then the shared experts
 * added. No placement, no permutation, no all-to-all: it shares only data
 * generation and routing with the EP path. Pure: no MPI; the comm layer
 * reduces the statistics.
 *
 * A term whose gate is zero is exactly zero when the expert's output is
 * finite, so moe_truth_forward evaluates each expert only on the tokens
 * that selected it (and generates only the experts some token selected):
 * the same bits. An output is non-finite only where the token's row is (the
 * inputs and weights are finite and --init-scale is bounded far below fp64
 * overflow), and every token has a selected expert on that row, so the
 * truth is non-finite in exactly the rows the literal sum is
 * (moe_truth_forward_literal, which tests compare it with).
 */
#ifndef MOE_TRUTH_H
#define MOE_TRUTH_H

#include <stdbool.h>
#include <stdint.h>

#include "moe/config.h"
#include "moe/dims.h"
#include "moe/experts.h"
#include "moe/router.h"

/* y (T, d) = dense MoE output for tokens routed to ids/weights (T, k), its
 * GEMMs as `gemm` says (MOE_TRUTH_EXACT: the same bytes on every machine,
 * for golden sets; MOE_TRUTH_BLAS: dgemm, for --check): the
 * routed experts see x_dispatched (T, d) (the rows as the ranks receive
 * them, after --dispatch-dtype), the shared experts x (T, d). Weights are
 * rounded to --dtype and expert outputs to --combine-dtype, as on the EP path.
 * allow (T, d), when not NULL, receives the extra tolerance of the rounding
 * steps the truth cannot replay bit for bit: with --combine-dtype bf16, the
 * EP path rounds an fp32 expert output and the truth an fp64 one, which may
 * land one bf16 step apart; allow is one bf16 step of every rounded term.
 * With --combine reduced the rounded terms are, per token, the sums of the
 * experts of each of `ranks` ranks (the placement of layout.h), as the EP
 * path rounds the sum it sends back, and with --dispatch hierarchical
 * also the sums of each node's ranks (nodes of --ranks-per-node, all ranks
 * when 0), as each node's relay rounds the sum it returns home; ranks is
 * not read otherwise. With --output-dtype bf16 the whole output (shared
 * experts included) is rounded last (moe_truth_round_output). */
void moe_truth_forward(const moe_config *cfg, enum moe_truth_gemm gemm, const float *x,
                       const float *x_dispatched, const int32_t *ids, const float *weights,
                       moe_index tokens, int ranks, double *y, double *allow);

/* Does the truth of cfg carry an allowance (allow, above): a rounding to
 * bf16 the truth cannot replay bit for bit (--combine-dtype, --output-dtype)? */
bool moe_truth_rounds(const moe_config *cfg);

/* y (n) rounded in place to --output-dtype, as the EP path rounds the layer
 * output (moe_ep_round_output): bf16 of the fp64 value, one bf16 step of it
 * added to allow (n, may be NULL). Nothing at fp32. */
void moe_truth_round_output(const moe_config *cfg, double *y, double *allow, moe_index n);

/* The same with --combine reduced's sums per (token, rank) as the pairs
 * were placed: pair_rank (T, k) the rank each pair is computed on (with
 * --redundant-experts a copy's, which the logical placement cannot say);
 * only the rounding of those sums, and allow, read it. */
void moe_truth_forward_placed(const moe_config *cfg, enum moe_truth_gemm gemm, const float *x,
                              const float *x_dispatched, const int32_t *ids, const float *weights,
                              moe_index tokens, int ranks, const int32_t *pair_rank, double *y,
                              double *allow);

/* The same, literally: every expert on every token, its zero-gate terms
 * 0 * output added (E/k times the work). */
void moe_truth_forward_literal(const moe_config *cfg, enum moe_truth_gemm gemm, const float *x,
                               const float *x_dispatched, const int32_t *ids, const float *weights,
                               moe_index tokens, int ranks, double *y, double *allow);

/* The truth's routed terms split by rank, for the comm layer to sum
 * (check.h): the pairs rank `rank` computes (pair_rank (T, k) as in
 * moe_truth_forward_placed, or the placement's expert_rank when NULL), for
 * `tokens` tokens that may be every rank's, into y (T, d) and allow,
 * rounded as moe_truth_forward_placed rounds them: with --combine reduced
 * they are the rank's one sum per token. Every rank's share summed is the
 * routed part of moe_truth_forward_placed, up to the order of the fp64
 * sums; each rank generates only the experts whose pairs it computes. Not
 * when the rounded sums span ranks (moe_config_truth_shares). */
void moe_truth_forward_share(const moe_config *cfg, enum moe_truth_gemm gemm,
                             const float *x_dispatched, const int32_t *ids, const float *weights,
                             moe_index tokens, int ranks, const int32_t *pair_rank, int rank,
                             double *y, double *allow);

/* out (T, k, d) = each pair's routed expert output in fp64 on its row of
 * x_dispatched (T, d), before its gate weight and any rounding of the
 * combine: the v of accumulate's g * v; zero for a -1 id. Weights as
 * moe_truth_forward holds them. */
void moe_truth_pair_outputs(const moe_config *cfg, enum moe_truth_gemm gemm,
                            const float *x_dispatched, const int32_t *ids, moe_index tokens,
                            double *out);

/* width (rows, d) = how far apart two correct fp32 computations of routed
 * expert `expert` (logical) on the rows x (rows, d) can lie, with the
 * rounding points inside the expert (--gemm-out-dtype, --act-dtype; some
 * must be set): moe_expert_forward_f64_rounded's width. */
void moe_truth_expert_widths(const moe_config *cfg, enum moe_truth_gemm gemm, int expert,
                             const float *x, moe_index rows, double *width);

/* y (T, d) += the shared experts on x (T, d), as moe_truth_forward adds them. */
void moe_truth_add_shared(const moe_config *cfg, enum moe_truth_gemm gemm, const float *x,
                          moe_index tokens, double *y);

/* The backward's truth (backward.h), fp64, every expert evaluated on the
 * tokens that selected it (a zero gate passes a zero gradient), weights
 * rounded to --dtype as the EP path holds them. For `tokens` tokens x, dy
 * (T, d) routed by ids/weights (T, k) from logits (T, E) (router r, gate
 * (E, d)): dx (T, d) (routed experts, then the router through the gate,
 * then the shared experts), this share of the gate's gradient dgate_w (E, d)
 * and of the shared experts' dshared_w1 (S, 2f, d) and dshared_w2 (S, d, f)
 * (sums over these tokens; the comm layer adds the ranks' shares). */
void moe_truth_backward_tokens(const moe_config *cfg, const moe_router *r,
                               enum moe_truth_gemm gemm, const float *gate, const float *x,
                               const int32_t *ids, const float *weights, const float *logits,
                               const float *dy, moe_index tokens, double *dx, double *dgate_w,
                               double *dshared_w1, double *dshared_w2);

/* The part of moe_truth_backward_tokens after the routed experts, given
 * dweights (T, k), the gradient of every gate weight, and dx (T, d) holding
 * the routed experts' terms: adds the router's terms through the gate, then
 * the shared experts', into dx, and writes dgate_w, dshared_w1, dshared_w2
 * as there. */
void moe_truth_backward_rest(const moe_config *cfg, const moe_router *r,
                             enum moe_truth_gemm gemm, const float *gate, const float *x,
                             const int32_t *ids, const float *logits, const float *dy,
                             moe_index tokens, const double *dweights, double *dx,
                             double *dgate_w, double *dshared_w1, double *dshared_w2);

/* dw1 (2f, d) and dw2 (d, f) of routed expert e over `tokens` tokens x, dy
 * (T, d) routed by ids/weights (T, k): the whole gradient when they are
 * every token of the layer. With dx (T, d) and dweights (T, k) (else NULL),
 * the same backward also adds e's terms into dx and sets the gradient of
 * each of its gate weights in dweights: a rank that does this for its own
 * experts on every token holds its share of moe_truth_backward_tokens's
 * routed part. Returns the rows summed (the tokens that chose e). */
moe_index moe_truth_backward_expert(const moe_config *cfg, enum moe_truth_gemm gemm, int e,
                                    const float *x, const float *dy, const int32_t *ids,
                                    const float *weights, moe_index tokens, double *dx,
                                    double *dweights, double *dw1, double *dw2);

/* The fp32 chains every backward value goes through, in steps
 * (docs/backward.md): 2d + 2f + k + S + 8 (h recomputed over d, dA = dO W2
 * over d, the SwiGLU's derivative and the gate's products, 8 steps at most,
 * dx = dH W1 over 2f, dx summed over k routed and S shared experts). A
 * weight gradient adds the rows its GEMM sums in fp32. */
double moe_truth_backward_length(const moe_config *cfg);

/* Tolerance of the EP output against the truth: |got - ref| <= abs + rel*|ref|. */
typedef struct {
    double abs, rel;
} moe_tolerance;

/* rel = u * (d + f + k + S), u = 2^-24 the fp32 unit roundoff: the
 * accumulation lengths of the EP path in fp32 (L1 sums over d, L2 over f, the
 * combine over k routed and S shared outputs), each step adding at most one
 * rounding of the running sum. abs = rel * rms(ref): outputs are sums of
 * terms of both signs, so an element may be much smaller than the terms that
 * made it; its error scales with the terms, which the rms measures. */
moe_tolerance moe_tolerance_for(const moe_config *cfg, double ref_rms);

/* The same rule for any value that went through fp32 chains of `length`
 * steps in all: rel = u * length, abs = rel * ref_rms (the backward's
 * tensors, docs/backward.md). */
moe_tolerance moe_tolerance_of_length(double length, double ref_rms);

typedef struct {
    double max_abs;          /* max |got - ref| */
    double max_rel;          /* max |got - ref| / max(|ref|, rms floor) */
    double max_used;         /* max |got - ref| / (abs + rel*|ref|); <= 1 passes */
    moe_index worst;         /* index of max_used, -1 if n == 0 */
    moe_index first_nonfinite; /* first index where got is NaN/Inf, -1 if none */
} moe_compare_stats;

/* Sum of ref[n]^2, for the rms that sets the tolerance. */
double moe_sum_squares(const double *ref, moe_index n);

/* allow (n), when not NULL, is added to each element's tolerance. */
void moe_compare(const float *got, const double *ref, const double *allow, moe_index n,
                 moe_tolerance tol, moe_compare_stats *stats);

#endif
