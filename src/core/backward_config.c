/* SPDX-License-Identifier: MIT */
/* backward_config.c — the training step's flags (--backward,
 * --grad-output): the rules moe_config_validate calls and the bytes
 * moe_config_memory_per_rank adds (backward.h). Apart from backward.c so
 * that what reads a config needs none of the gradients' kernels.
 */
#include "moe/backward.h"

#include <math.h>

/* --backward: the blocking forward, its mirror in fp32 on the wire in waves
 * of token chunks, through the router's own weights (ep.h,
 * moe_ep_backward_step). */
int moe_backward_validate(const moe_config *cfg, moe_status *st)
{
    if (!cfg->backward)
        return cfg->grad_output[0] ? moe_fail(st, MOE_EXIT_USAGE, "--grad-output is the gradient "
                                                                  "of a training step: add --backward")
                                   : MOE_EXIT_OK;
    if (cfg->wave_by == MOE_WAVE_BY_EXPERTS)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--backward splits its waves by tokens (a token's rows and pairs in one "
                        "wave, the dedup kept): --wave-by must be auto or tokens, got experts");
    if (cfg->dispatch == MOE_DISPATCH_HIERARCHICAL)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--backward mirrors the flat dispatch: --dispatch must be flat, got hierarchical");
    if (cfg->dispatch_dtype != MOE_DTYPE_FP32 || cfg->combine_dtype != MOE_DTYPE_FP32)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--backward moves fp32 rows both ways: --dispatch-dtype and --combine-dtype "
                        "must be fp32, got %s and %s",
                        moe_config_choice_name("dispatch-dtype", cfg->dispatch_dtype),
                        moe_config_choice_name("combine-dtype", cfg->combine_dtype));
    if (cfg->gemm_out_dtype != MOE_DTYPE_FP32 || cfg->act_dtype != MOE_DTYPE_FP32)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--backward differentiates fp32 experts: --gemm-out-dtype and --act-dtype "
                        "must be fp32, got %s and %s",
                        moe_config_choice_name("gemm-out-dtype", cfg->gemm_out_dtype),
                        moe_config_choice_name("act-dtype", cfg->act_dtype));
    if (cfg->output_dtype != MOE_DTYPE_FP32 || cfg->topk_weights_dtype != MOE_DTYPE_FP32)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--backward differentiates the fp32 output through the fp32 top-k weights: "
                        "--output-dtype and --topk-weights-dtype must be fp32, got %s and %s",
                        moe_config_choice_name("output-dtype", cfg->output_dtype),
                        moe_config_choice_name("topk-weights-dtype", cfg->topk_weights_dtype));
    if (cfg->routing[0])
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--backward differentiates the router's weights: replayed ones (--routing) "
                        "have no router behind them");
    return MOE_EXIT_OK;
}

double moe_backward_memory(const moe_config *cfg, int ranks)
{
    const double G = ranks, T = (double)cfg->tokens, d = (double)cfg->hidden, f = (double)cfg->ffn;
    const double E = (double)cfg->experts, k = (double)cfg->topk, S = (double)cfg->shared_experts;
    const double N = G * T;
    const double EL = (double)moe_config_most_local_experts(cfg, ranks);
    const double expert_bytes = 3.0 * f * d * 4.0; /* W1 (2f,d) + W2 (d,f), fp32 */
    /* One expert's weights laid out for the backward, the gradients
     * (routed, shared, gate, dx) and dy; the step's buffers: dy received, dx per
     * pair and back home, an expert batch's temporaries (dx, dO, h, dA) and
     * every pair's backward work (dH, a'), the wgrad operands, the shared
     * experts' work on T rows, the fp64 sums over ranks, the router's
     * fp64 gradient. */
    double bytes = (EL + S + 1.0) * expert_bytes + E * d * 4.0 + 2.0 * T * d * 4.0;
    bytes += 3.0 * T * k * d * 4.0 + T * k * (2.0 * d + 3.0 * f) * 4.0 +
             2.0 * T * k * (d + 2.0 * f) * 4.0 + T * (2.0 * d + 3.0 * f) * 4.0 + T * d * 4.0;
    bytes += fmax(E * d, S * 2.0 * f * d) * 8.0 + (65536.0 * G) * 8.0 + T * (E + d) * 8.0;
    if (cfg->check || cfg->dump[0]) /* every token's x, dy, ids and weights; the fp64 truth */
        bytes += N * (2.0 * d + 2.0 * k) * 4.0 + T * d * 8.0 * 4.0 + E * d * 8.0 +
                 fmax(S, 1.0) * expert_bytes * 2.0 + N * (d * 8.0 * 3.0) +
                 (cfg->dump[0] ? (EL + S) * expert_bytes * 2.0 : 0.0);
    if (cfg->check) /* this rank's share of every token's dx and gate-weight gradients, the sums' chunks */
        bytes += N * (d + k) * 8.0 + 2.0 * 65536.0 * G * 8.0;
    if (cfg->dump[0]) /* rank 0 gathers the backward stage: dy, per-pair rows, dx, dW */
        bytes += N * d * (4.0 + 4.0 + 8.0) + 3.0 * N * k * (d + 1.0) * 4.0 + E * expert_bytes * 3.0;
    return bytes;
}
