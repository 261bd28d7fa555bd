/* router.h — token → experts: gate logits, scores, top-k, weights.
 *
 * Pure C, no MPI. The gate is computed per token with a fixed-order dot
 * product (fp64 accumulation over d, rounded once to fp32), not with BLAS:
 * a token's logits then depend on nothing but its own row, so routing is
 * identical whatever G, the batching or the thread count. This version has
 * the softmax top-k router (GShard/Mixtral style); the router kind is a field
 * so that further routers slot in beside it.
 */
#ifndef MOE_ROUTER_H
#define MOE_ROUTER_H

#include <stdbool.h>
#include <stdint.h>

#include "moe/dims.h"

enum moe_router_kind { MOE_ROUTER_SOFTMAX = 0 };

typedef struct {
    enum moe_router_kind kind;
    int experts;    /* E */
    int topk;       /* k */
    bool normalize; /* divide the k selected scores by their sum */
} moe_router;

/* logits (T, E) = x (T, d) * gate (E, d)^T, each element a fixed-order fp64
 * sum over j = 0 .. d-1 rounded to fp32. OpenMP over tokens. */
void moe_router_logits(const float *x, const float *gate, moe_index tokens, moe_index hidden,
                       int experts, float *logits);

/* From logits (T, E): scores (T, E) = softmax in fp64 rounded to fp32; then
 * ids (T, k) = the k best scores in descending order, ties to the lower
 * expert id; weights (T, k) = those scores, divided by their sum in slot
 * order (fp64, rounded to fp32) when r->normalize. Cannot fail. */
void moe_router_select(const moe_router *r, const float *logits, moe_index tokens, float *scores,
                       int32_t *ids, float *weights);

#endif
