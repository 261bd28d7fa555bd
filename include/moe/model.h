/* SPDX-License-Identifier: MIT */
/* model.h — the layer's parameters as a configuration makes them: the
 * router (its kind, correction bias and --skew), the gate and every
 * expert's weights, generated from --seed (docs/data.md) and rounded to
 * --dtype. The EP object, the library's truth and its router all take them
 * from here. Pure: no MPI.
 */
#ifndef MOE_MODEL_H
#define MOE_MODEL_H

#include <stdbool.h>

#include "moe/config.h"
#include "moe/router.h"

/* The router cfg asks for; bias (E) and skew (E) are filled and linked when
 * the config has them (deepseek-v3 with --bias-scale; --skew), else left
 * alone and not linked. cfg validated. */
moe_router moe_model_router(const moe_config *cfg, float *bias, float *skew);

/* gate (E, d): W_g, rounded to --dtype, --gate-ties' rows copied. */
void moe_model_gate(const moe_config *cfg, float *gate);

/* x (T, d): T tokens of the stream from global row first_token (rng.h,
 * --input-dist), rounded to --dtype. */
void moe_model_tokens(const moe_config *cfg, uint64_t first_token, float *x);

/* Routed expert n (shared expert n when `shared`): w1 (2f, d), w2 (d, f),
 * rounded to --dtype. */
void moe_model_expert(const moe_config *cfg, bool shared, int n, float *w1, float *w2);

#endif
