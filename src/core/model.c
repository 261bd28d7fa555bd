/* SPDX-License-Identifier: MIT */
/* model.c — the layer's parameters from a configuration (see model.h). */
#include "moe/model.h"

#include <string.h>

#include "moe/experts.h"
#include "moe/quant.h"
#include "moe/rng.h"

moe_router moe_model_router(const moe_config *cfg, float *bias, float *skew)
{
    moe_router r = {.kind = (enum moe_router_kind)cfg->router,
                    .experts = (int)cfg->experts,
                    .topk = (int)cfg->topk,
                    .normalize = moe_config_norm_topk(cfg),
                    .groups = (int)cfg->groups,
                    .topk_groups = (int)cfg->topk_groups,
                    .route_scale = (float)cfg->route_scale,
                    .bf16_weights = cfg->topk_weights_dtype == MOE_DTYPE_BF16};
    if (cfg->router == MOE_ROUTER_DEEPSEEK_V3 && cfg->bias_scale > 0) {
        moe_synth_fill(cfg->seed, MOE_TENSOR_BIAS, 0, 0, cfg->experts, (float)cfg->bias_scale, bias);
        r.bias = bias;
    }
    if (cfg->skew[0]) {
        moe_status ignored; /* validated by moe_config_validate */
        moe_skew_parse(cfg->skew, (int)cfg->experts, skew, &ignored);
        r.skew = skew;
    }
    return r;
}

void moe_model_gate(const moe_config *cfg, float *gate)
{
    const moe_index d = cfg->hidden;
    moe_synth_fill(cfg->seed, MOE_TENSOR_GATE, 0, 0, cfg->experts * d, moe_synth_weight_scale(d), gate);
    moe_precision_weights(cfg->param_dtype, gate, cfg->experts * d);
    for (int64_t e = 1; e <= cfg->gate_ties; e++) /* --gate-ties: exact ties on every token */
        memcpy(gate + e * d, gate, sizeof(float) * (size_t)d);
}

void moe_model_tokens(const moe_config *cfg, uint64_t first_token, float *x)
{
    moe_synth_tokens(cfg->seed, first_token, cfg->tokens, cfg->hidden, (float)cfg->init_scale,
                     cfg->input_dist, x);
    moe_precision_weights(cfg->param_dtype, x, cfg->tokens * cfg->hidden);
}

void moe_model_expert(const moe_config *cfg, bool shared, int n, float *w1, float *w2)
{
    const moe_index d = cfg->hidden, f = cfg->ffn;
    if (shared)
        moe_shared_expert_generate(cfg->seed, n, d, f, w1, w2);
    else
        moe_expert_generate(cfg->seed, n, d, f, w1, w2);
    moe_precision_expert(cfg->param_dtype, cfg->fp8_scale == MOE_FP8_SCALE_UE8M0, w1, w2, d, f);
}
