/* SPDX-License-Identifier: MIT */
/* routing.h — inputs replayed from files: top-k ids and weights
 * (`moe-ep run --routing FILE.safetensors`) instead of the synthetic router,
 * the upstream gradient of a training step (`--grad-output`), and the
 * load of redundant experts (`--expert-load`).
 *
 * The file holds router.topk_ids (N, k), any integer dtype, and
 * router.topk_weights (N, k), any real dtype, for all N = G·T tokens in
 * global token order: the router.safetensors of a golden set is one, and so
 * is what a port records from a real model. Pure I/O: no MPI.
 */
#ifndef MOE_ROUTING_H
#define MOE_ROUTING_H

#include <stdint.h>

#include "moe/common.h"
#include "moe/dims.h"

/* Validate the whole file against tokens (N), topk (k) and experts (E) —
 * shapes, ids in [0, E) and distinct within a row, finite weights — then
 * read rows [first, first + count) into ids (count, k) and weights
 * (count, k). Returns MOE_EXIT_OK, or MOE_EXIT_USAGE with a message naming
 * --routing, the tensor and the first bad row. */
int moe_routing_load(const char *path, moe_index tokens, int topk, int experts, moe_index first,
                     moe_index count, int32_t *ids, float *weights, moe_status *st);

/* The same for `--grad-output FILE.safetensors`: backward.dy (N, d), any
 * real dtype, every value finite (a golden set's backward.safetensors is
 * such a file); rows [first, first + count) into dy (count, d). Returns
 * MOE_EXIT_OK, or MOE_EXIT_USAGE naming --grad-output and what is wrong. */
int moe_grad_output_load(const char *path, moe_index tokens, moe_index hidden, moe_index first,
                         moe_index count, float *dy, moe_status *st);

/* `--expert-load FILE`: EPLB's load, a text file of E numbers (tokens
 * routed to each expert, in expert order) separated by spaces, commas or
 * newlines, '#' starting a comment to the end of its line; each finite and
 * >= 0. Into load (E). Returns MOE_EXIT_OK, or MOE_EXIT_USAGE naming
 * --expert-load, the file and what is wrong (with its line). */
int moe_expert_load_read(const char *path, int experts, double *load, moe_status *st);

#endif
