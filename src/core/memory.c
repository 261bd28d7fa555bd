/* SPDX-License-Identifier: MIT */
/* memory.c — the bytes a rank holds at its peak (moe_config_memory_per_rank,
 * config.h): the forward's own, plus what each feature says it adds
 * (layout.h, wire.h, backward.h), the truth's, a dump's and bench's.
 */
#include "moe/config.h"

#include <math.h>

#include "moe/backward.h"
#include "moe/layout.h"
#include "moe/wire.h"

double moe_config_memory_per_rank(const moe_config *cfg, enum moe_command command, int ranks)
{
    const double G = ranks, T = (double)cfg->tokens, d = (double)cfg->hidden, f = (double)cfg->ffn;
    const double E = (double)cfg->experts, k = (double)cfg->topk, S = (double)cfg->shared_experts;
    const double N = G * T;                                   /* all ranks' tokens */
    const double EL = (double)moe_config_most_local_experts(cfg, ranks);
    const double expert_bytes = 3.0 * f * d * 4.0;            /* W1 (2f,d) + W2 (d,f), fp32 */
    const double meta = 4.0 * (2.0 * k + 1.0);                /* a row's ids and weights */
    double W = 1.0;                                           /* the most waves of one forward */
    for (int n = 0; n < cfg->waves_count && !cfg->blocking; n++)
        W = fmax(W, (double)cfg->waves_list[n]);
    double bytes = MOE_MEMORY_RUNTIME;                        /* MPI, BLAS, the program */
    bytes += (EL + S) * expert_bytes + E * d * 4.0;           /* experts, shared experts, gate */
    bytes += 3.0 * T * d * 4.0;                               /* tokens, output, quantised copy */
    bytes += 2.0 * T * E * 4.0 + T * k * 8.0;                 /* logits, scores, ids and weights */
    /* One forward, the routed rows at their mean (T*k rows and pairs in and
     * out): rows and ids sent and received, expert outputs sent and
     * received back, the experts' inputs and activations, the tables. */
    bytes += 2.0 * T * k * (4.0 * d + meta) + 2.0 * T * k * d * 4.0;
    bytes += T * k * (d + 1.0 + 2.0 * f) * 4.0 + 3.0 * T * k * 8.0;
    /* bf16 or fp8 on the wire: the rows decoded beside their wire copies */
    bytes += (cfg->dispatch_dtype != MOE_DTYPE_FP32 ? 1.0 : 0.0) * T * k * d * 4.0 +
             (cfg->combine_dtype != MOE_DTYPE_FP32 ? 2.0 : 0.0) * T * k * d * 4.0;
    /* The two-stage dispatch adds the relay's hop: the rows and ids it
     * receives and forwards, its table of their ids, the outputs it collects
     * and those it returns home. */
    if (cfg->dispatch == MOE_DISPATCH_HIERARCHICAL)
        bytes += 2.0 * T * k * (4.0 * d + meta) + T * k * k * 4.0 + 2.0 * T * k * d * 4.0;
    /* The low-latency mode's window, batch and shared outputs (wire.h). */
    if (cfg->mode == MOE_MODE_LOW_LATENCY)
        bytes += moe_ll_memory(cfg, ranks);
    /* The wave pipelines run the shared experts in their waits, their
     * outputs kept apart until the reduce (a training step's forward is
     * the blocking one). */
    else if (!cfg->blocking && !cfg->backward)
        bytes += S * T * d * 4.0;
    bytes += moe_layout_memory(cfg, ranks); /* the layout tensor (layout.h) */
    /* Per wave: a slot-to-pair map of every (token, slot), the counts. */
    bytes += W * (T * k * 8.0 + G * (64.0 + 8.0 * (1.0 + EL)));
    if (cfg->check) /* the truth: fp64 tokens, outputs, activations, one expert's weights, the reference output */
        bytes += T * (3.0 * d + 3.0 * f + 1.0) * 8.0 + 2.0 * T * d * 8.0 + 3.0 * f * d * 12.0 + T * d * 4.0;
    if (cfg->check && moe_config_truth_shares(cfg)) /* every rank's tokens, this rank's share of their truth (and allowance), the sums' chunks */
        bytes += N * (d * 4.0 + k * 12.0 + 16.0 + d * 8.0 * (cfg->combine_dtype != MOE_DTYPE_FP32 ? 2.0 : 1.0)) +
                 2.0 * 65536.0 * G * 8.0;
    if (cfg->backward)
        bytes += moe_backward_memory(cfg, ranks);
    if (cfg->dump[0]) /* rank 0: every rank's routing, output and truth, the tokens, one
                         expert's weights; every rank its captured rows and outputs, and
                         rank 0 one other rank's beside its own while it writes them */
        bytes += N * (3.0 * E * 4.0 + k * 8.0 + d * (4.0 + 8.0 + 8.0 + 4.0 + 8.0) + G) +
                 2.0 * 2.0 * T * k * (d * 4.0 + 8.0) + 3.0 * f * d * 4.0 * 2.0;
    if (cfg->dump[0] && moe_config_layout(cfg) != MOE_LAYOUT_ROWS) {
        /* the layout tensor as it travelled, who each slot holds: this
         * rank's, and on rank 0 one other rank's, all slots, empty ones
         * too; and one expert's slots decoded as they are written */
        const double C = moe_config_layout(cfg) == MOE_LAYOUT_MASKED ? G * (double)moe_config_max_tokens(cfg) : 0.0;
        const double slots = C > 0 ? EL * C : T * k + EL * (double)(cfg->expert_alignment - 1);
        bytes += 2.0 * slots * ((double)moe_wire_dispatch(cfg).bytes + 8.0) + (C > 0 ? C : 1.0) * d * 4.0;
    }
    if (command == MOE_CMD_BENCH) /* the anchors: cache eviction, one sgemm, two all-to-alls */
        bytes += 64.0 * 1048576.0 + (T * k + S * T) * (d + 6.0 * f) * 4.0 + 3.0 * f * d * 4.0 +
                 4.0 * T * k * d * 4.0;
    return bytes;
}
