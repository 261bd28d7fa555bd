/* SPDX-License-Identifier: MIT */
/* golden_kinds.c — the tensors of a golden set, one row a kind, in the
 * order docs/golden.md lists them (its "The tensors" and "Tolerances"
 * tables are this one). */
#include "moe/golden.h"

#define U 0x1p-24 /* fp32 unit roundoff */

#define EXACT(name, stage, dtype) {name, stage, dtype, MOE_RULE_EXACT, MOE_CHAIN_NONE, 0, 0, 0, 0, 0}
/* a tolerance over an fp32 chain of cd d + ce E + ck k + cf f + c0 steps */
#define CHAIN(name, stage, cd, ce, ck, cf, c0) \
    {name, stage, MOE_ST_F32, MOE_RULE_TOLERANCE, MOE_CHAIN_FP32, cd, ce, ck, cf, c0}

const moe_golden_kind_spec moe_golden_kinds[MOE_GOLDEN_KINDS] = {
    /* inputs: regenerated bits */
    [MOE_GK_TOKENS] = EXACT("tokens.x", MOE_GOLDEN_INPUTS, MOE_ST_F32),
    [MOE_GK_GATE_WEIGHT] = EXACT("gate.weight", MOE_GOLDEN_INPUTS, MOE_ST_F32),
    [MOE_GK_GATE_BIAS] = EXACT("gate.bias", MOE_GOLDEN_INPUTS, MOE_ST_F32),
    [MOE_GK_ROUTER_SKEW] = EXACT("router.skew", MOE_GOLDEN_INPUTS, MOE_ST_F32),
    [MOE_GK_EXPERTS_W1] = EXACT("experts.w1", MOE_GOLDEN_INPUTS, MOE_ST_F32),
    [MOE_GK_EXPERTS_W2] = EXACT("experts.w2", MOE_GOLDEN_INPUTS, MOE_ST_F32),
    [MOE_GK_SHARED_W1] = EXACT("shared.w1", MOE_GOLDEN_INPUTS, MOE_ST_F32),
    [MOE_GK_SHARED_W2] = EXACT("shared.w2", MOE_GOLDEN_INPUTS, MOE_ST_F32),
    /* --dtype fp8: the same weights as their E4M3 bytes and 128 x 128 block scales */
    [MOE_GK_EXPERTS_W1_FP8] = EXACT("experts.w1.fp8", MOE_GOLDEN_INPUTS, MOE_ST_F8_E4M3),
    [MOE_GK_EXPERTS_W1_SCALE] = EXACT("experts.w1.fp8.scale", MOE_GOLDEN_INPUTS, MOE_ST_F32),
    [MOE_GK_EXPERTS_W2_FP8] = EXACT("experts.w2.fp8", MOE_GOLDEN_INPUTS, MOE_ST_F8_E4M3),
    [MOE_GK_EXPERTS_W2_SCALE] = EXACT("experts.w2.fp8.scale", MOE_GOLDEN_INPUTS, MOE_ST_F32),
    [MOE_GK_SHARED_W1_FP8] = EXACT("shared.w1.fp8", MOE_GOLDEN_INPUTS, MOE_ST_F8_E4M3),
    [MOE_GK_SHARED_W1_SCALE] = EXACT("shared.w1.fp8.scale", MOE_GOLDEN_INPUTS, MOE_ST_F32),
    [MOE_GK_SHARED_W2_FP8] = EXACT("shared.w2.fp8", MOE_GOLDEN_INPUTS, MOE_ST_F8_E4M3),
    [MOE_GK_SHARED_W2_SCALE] = EXACT("shared.w2.fp8.scale", MOE_GOLDEN_INPUTS, MOE_ST_F32),
    /* router: one dot product over d; the softmax or sigmoid over E more;
     * the bias added once; normalised over k */
    [MOE_GK_LOGITS] = CHAIN("router.logits", MOE_GOLDEN_ROUTER, 1, 0, 0, 0, 0),
    [MOE_GK_SCORES] = CHAIN("router.scores", MOE_GOLDEN_ROUTER, 1, 1, 0, 0, 0),
    [MOE_GK_SELECTION] = CHAIN("router.selection", MOE_GOLDEN_ROUTER, 1, 1, 0, 0, 1),
    [MOE_GK_TOPK_IDS] = {"router.topk_ids", MOE_GOLDEN_ROUTER, MOE_ST_I32, MOE_RULE_TOPK,
                         MOE_CHAIN_NONE, 0, 0, 0, 0, 0},
    [MOE_GK_TOPK_WEIGHTS] = CHAIN("router.topk_weights", MOE_GOLDEN_ROUTER, 1, 1, 1, 0, 0),
    /* layout: integers from the ids and the placement */
    [MOE_GK_TOKENS_PER_RANK] = EXACT("layout.tokens_per_rank", MOE_GOLDEN_LAYOUT, MOE_ST_I32),
    [MOE_GK_TOKENS_PER_EXPERT] = EXACT("layout.tokens_per_expert", MOE_GOLDEN_LAYOUT, MOE_ST_I32),
    [MOE_GK_TOKENS_PER_NODE] = EXACT("layout.tokens_per_node", MOE_GOLDEN_LAYOUT, MOE_ST_I32),
    [MOE_GK_TOKEN_IN_RANK] = EXACT("layout.is_token_in_rank", MOE_GOLDEN_LAYOUT, MOE_ST_BOOL),
    [MOE_GK_SEND_COUNTS] = EXACT("layout.send_counts", MOE_GOLDEN_LAYOUT, MOE_ST_I32),
    [MOE_GK_KEPT_IDS] = EXACT("layout.kept_ids", MOE_GOLDEN_LAYOUT, MOE_ST_I32), /* --capacity-factor */
    /* --redundant-experts: the copy each pair went to; each physical expert's logical one */
    [MOE_GK_PHYSICAL_IDS] = EXACT("layout.physical_ids", MOE_GOLDEN_LAYOUT, MOE_ST_I32),
    [MOE_GK_REPLICA_OF] = EXACT("layout.replica_of", MOE_GOLDEN_LAYOUT, MOE_ST_I32),
    /* --steps: each step's load and the bias after its update (integers, and
     * fp32 sums of +-gamma) */
    [MOE_GK_STEPS_LOAD] = EXACT("router.steps.load", MOE_GOLDEN_ROUTER, MOE_ST_I32),
    [MOE_GK_STEPS_BIAS] = EXACT("router.steps.bias", MOE_GOLDEN_ROUTER, MOE_ST_F32),
    /* dispatch: the rows as they arrived (deterministic quantisation) */
    [MOE_GK_DISPATCH_X] = EXACT("dispatch.rank%d.x", MOE_GOLDEN_DISPATCH, MOE_ST_F32),
    [MOE_GK_DISPATCH_TOKEN] = EXACT("dispatch.rank%d.token", MOE_GOLDEN_DISPATCH, MOE_ST_I32),
    [MOE_GK_LAYOUT_X] = EXACT("dispatch.rank%d.layout.x", MOE_GOLDEN_DISPATCH, MOE_ST_F32),
    [MOE_GK_LAYOUT_SCALE] = EXACT("dispatch.rank%d.layout.x.scale", MOE_GOLDEN_DISPATCH, MOE_ST_F32),
    [MOE_GK_LAYOUT_SRC] = EXACT("dispatch.rank%d.layout.src", MOE_GOLDEN_DISPATCH, MOE_ST_I32),
    [MOE_GK_LAYOUT_EXPERT] = EXACT("dispatch.rank%d.layout.expert", MOE_GOLDEN_DISPATCH, MOE_ST_I32),
    [MOE_GK_LAYOUT_COUNT] = EXACT("dispatch.rank%d.layout.count", MOE_GOLDEN_DISPATCH, MOE_ST_I32),
    /* experts: L1 over d, L2 over f; a reduced row's sum over at most k pairs */
    [MOE_GK_EXPERT_OUT] = CHAIN("experts.rank%d.out", MOE_GOLDEN_EXPERTS, 1, 0, 0, 1, 0),
    [MOE_GK_EXPERT_PAIR] = EXACT("experts.rank%d.pair", MOE_GOLDEN_EXPERTS, MOE_ST_I32),
    [MOE_GK_EXPERT_SUM] = CHAIN("experts.rank%d.sum", MOE_GOLDEN_EXPERTS, 1, 0, 1, 1, 0),
    /* with rounding points inside the experts: how far apart two correct
     * computations of each value can lie (truth.h) */
    [MOE_GK_EXPERT_OUT_ALLOW] = EXACT("experts.rank%d.out_allow", MOE_GOLDEN_EXPERTS, MOE_ST_F64),
    [MOE_GK_EXPERT_SUM_ALLOW] = EXACT("experts.rank%d.sum_allow", MOE_GOLDEN_EXPERTS, MOE_ST_F64),
    /* the two-stage dispatch's relay sums: a node's ranks' sums added once
     * more (the dump adds R to the chain) */
    [MOE_GK_NODE_SUM] = CHAIN("experts.node%d.sum", MOE_GOLDEN_EXPERTS, 1, 0, 1, 1, 0),
    [MOE_GK_NODE_TOKEN] = EXACT("experts.node%d.token", MOE_GOLDEN_EXPERTS, MOE_ST_I32),
    /* output: --check's contract, per element (truth.h) */
    [MOE_GK_OUTPUT_Y] = {"output.y", MOE_GOLDEN_OUTPUT, MOE_ST_F32, MOE_RULE_TOLERANCE,
                         MOE_CHAIN_OUTPUT, 0, 0, 0, 0, 0},
    [MOE_GK_OUTPUT_TRUTH] = {"output.truth", MOE_GOLDEN_OUTPUT, MOE_ST_F64, MOE_RULE_TOLERANCE,
                             MOE_CHAIN_OUTPUT, 0, 0, 0, 0, 0},
    [MOE_GK_OUTPUT_ALLOW] = EXACT("output.allow", MOE_GOLDEN_OUTPUT, MOE_ST_F64),
    /* backward (docs/backward.md): a pair's chain is h over d, dA over d,
     * dH, dx over 2f: 2d + 2f + 8; a reduced row's dx summed over k more */
    [MOE_GK_GRAD_OUTPUT] = EXACT("backward.dy", MOE_GOLDEN_BACKWARD, MOE_ST_F32),
    [MOE_GK_BACKWARD_DY] = EXACT("backward.rank%d.dy", MOE_GOLDEN_BACKWARD, MOE_ST_F32),
    [MOE_GK_BACKWARD_DX] = CHAIN("backward.rank%d.dx", MOE_GOLDEN_BACKWARD, 2, 0, 0, 2, 8),
    [MOE_GK_BACKWARD_DWEIGHT] = CHAIN("backward.rank%d.dweight", MOE_GOLDEN_BACKWARD, 2, 0, 0, 2, 8),
    [MOE_GK_BACKWARD_DX_SUM] = CHAIN("backward.rank%d.dx_sum", MOE_GOLDEN_BACKWARD, 2, 0, 1, 2, 8),
    /* the gradients and their truths: u times the chain of docs/backward.md
     * over the truth's rms, the same on both */
    [MOE_GK_GRADIENT] = {NULL, MOE_GOLDEN_BACKWARD, MOE_ST_F32, MOE_RULE_TOLERANCE,
                         MOE_CHAIN_GRADIENT, 0, 0, 0, 0, 0},
    [MOE_GK_GRADIENT_TRUTH] = {NULL, MOE_GOLDEN_BACKWARD, MOE_ST_F64, MOE_RULE_TOLERANCE,
                               MOE_CHAIN_GRADIENT, 0, 0, 0, 0, 0},
};

double moe_golden_chain_rel(const moe_golden_kind_spec *kind, int64_t d, int64_t experts,
                            int64_t topk, int64_t ffn)
{
    const int64_t steps = kind->cd * d + kind->ce * experts + kind->ck * topk + kind->cf * ffn + kind->c0;
    return U * (double)steps;
}
