/* SPDX-License-Identifier: MIT */
/* router.h — token → experts: gate logits, scores, top-k, weights.
 *
 * Pure C, no MPI. The gate is computed per token with a fixed-order dot
 * product (fp64 accumulation over d, rounded once to fp32), not with BLAS:
 * a token's logits then depend on nothing but its own row, so routing is
 * identical whatever G, the batching or the thread count.
 *
 * Two routers:
 *   softmax      GShard/Mixtral: softmax over all logits, top-k, optionally
 *                renormalised over the k, times route_scale.
 *   deepseek-v3  DeepSeek-V3's gate. With a correction bias: scores =
 *                sigmoid(logits); the bias is added for selection only; the
 *                experts split into `groups` groups whose score is the sum of
 *                their two best biased scores; all but the best `topk_groups`
 *                groups are masked with -inf (never 0: biased scores may be
 *                negative); top-k of the masked biased scores; weights = the
 *                unbiased scores there, divided by their sum, times
 *                route_scale. Without a bias (DeepSeek-V2 style): softmax
 *                scores, group score = the group's best score, no
 *                renormalisation unless asked, times route_scale.
 * Ties go to the lower index everywhere (experts and groups).
 */
#ifndef MOE_ROUTER_H
#define MOE_ROUTER_H

#include <stdbool.h>
#include <stdint.h>

#include "moe/common.h"
#include "moe/dims.h"
#include "moe/config.h"

#define MOE_ROUTER_MAX_EXPERTS 4096 /* the --experts bound */

enum moe_router_kind { MOE_ROUTER_SOFTMAX, MOE_ROUTER_DEEPSEEK_V3 };

typedef struct {
    enum moe_router_kind kind;
    int experts;      /* E */
    int topk;         /* k */
    bool normalize;   /* divide the k weights by their sum (always with a bias) */
    int groups;       /* deepseek-v3: expert groups (1 = no group limit) */
    int topk_groups;  /* deepseek-v3: groups kept per token */
    float route_scale;
    const float *bias; /* (E) deepseek-v3 correction bias, selection only; NULL = none */
    const float *skew; /* (E) added to the logits before scoring (--skew); NULL = none */
    bool bf16_weights; /* the weights rounded to bf16 last (--topk-weights-dtype bf16) */
} moe_router;

/* logits (T, E) = x (T, d) * gate (E, d)^T, each element a fixed-order fp64
 * sum over j = 0 .. d-1 rounded to fp32. OpenMP over batches of tokens. */
void moe_router_logits(const float *x, const float *gate, moe_index tokens, moe_index hidden,
                       int experts, float *logits);

/* The widest registers moe_router_logits may use from now on (for tests;
 * every choice gives the same bits). */
void moe_router_logits_force(enum moe_isa isa);

/* From logits (T, E): scores (T, E) (after skew, before bias: softmax or
 * sigmoid in fp64 rounded to fp32); ids (T, k) in selection order; weights
 * (T, k) (normalised in fp64 in slot order, rounded to fp32, then times
 * route_scale in fp32; then to bf16 with bf16_weights, as DeepSeek-V3's
 * weights.type_as(x)). Cannot fail: the configuration was validated. */
void moe_router_select(const moe_router *r, const float *logits, moe_index tokens, float *scores,
                       int32_t *ids, float *weights);

/* DeepSeek-V3's group limit for one token: group_score (groups) from its
 * biased scores (E; the scores plus the correction bias): the sum of each
 * group's two best with a bias, its best without; keep (groups) 1 for the
 * topk_groups best groups (ties to the lower index), 0 for the others. */
void moe_router_groups(const moe_router *r, const float *biased, float *group_score,
                       unsigned char *keep);

/* --skew: "" (none), "hot:E=+B[,E=B...]" (logit bias B on expert E) or
 * "zipf:S" (bias -S*ln(e+1): expert e chosen about (e+1)^-S as often).
 * skew (E) receives the biases. Returns MOE_EXIT_OK or MOE_EXIT_USAGE naming
 * --skew. */
int moe_skew_parse(const char *spec, int experts, float *skew, moe_status *st);

/* DeepSeek-V3's auxiliary-loss-free balancing, after each step: bias (E)
 * += gamma * sign(mean load - load_i) for load (E), the tokens routed to
 * each expert in the step (0 at the mean): an overloaded expert's bias
 * goes down, an underloaded one's up. Selection only; the weights stay the
 * unbiased scores. fp32, the same on every rank for the same load. */
void moe_router_bias_update(float *bias, const double *load, int experts, float gamma);

/* The balance losses of one batch, as metrics (nothing is trained). A rank
 * adds its tokens' shares into these sums; summed over ranks they give the
 * layer's figures (moe_balance_losses). p'(t, i) is token t's score of
 * expert i over the sum of its scores (the softmax probability itself; V3's
 * normalised sigmoid score). */
typedef struct {
    double tokens;      /* N, summed over ranks */
    double z_sum;       /* sum over tokens of logsumexp(logits)^2 */
    double seq_sum;     /* sum over sequences (a rank's T tokens) of sum_i f_i P_i */
    double sequences;
} moe_balance_sums;

/* pairs (E) += the (token, expert) pairs of ids (T, k); prob (E) += the sum
 * over tokens of p'(t, i); sums as above, for this rank's T tokens as one
 * sequence: f_i = E / (k T) x its pairs of i, P_i = its mean p'(t, i). */
void moe_router_balance(const moe_router *r, const float *logits, const float *scores,
                        const int32_t *ids, moe_index tokens, double *pairs, double *prob,
                        moe_balance_sums *sums);

/* From the layer's sums: the GShard/Switch auxiliary loss E sum_i f_i P_i
 * (f_i = pairs_i / (N k), P_i = prob_i / N), the router z-loss (the mean
 * over tokens of logsumexp(logits)^2), and V3's sequence-wise balance loss
 * sum_i f_i P_i averaged over sequences (to be multiplied by its alpha).
 * Both balance figures are 1 for perfectly even routing. */
void moe_balance_losses(const double *pairs, const double *prob, int experts, int topk,
                        const moe_balance_sums *sums, double *aux, double *z, double *seq);

/* The router's flags checked together (collective errors in moe_config_validate):
 * --groups and --topk-groups for deepseek-v3 only, groups that divide E and
 * keep k experts, the --skew spec. MOE_EXIT_OK or MOE_EXIT_USAGE with st set. */
int moe_router_validate(const moe_config *cfg, moe_status *st);

/* --steps and --bias-update: the bias moved is deepseek-v3's; the steps route
 * fresh batches with the router (no --routing, --backward or --dump). */
int moe_router_validate_steps(const moe_config *cfg, moe_status *st);

#endif
