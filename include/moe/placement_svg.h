/* SPDX-License-Identifier: MIT */
/* placement_svg.h — a picture of who holds which expert, and one token's way.
 *
 * Pure formatting (no MPI): nodes of R ranks, each rank with its experts
 * (copies of an expert marked), the experts a token chose filled, and the
 * token's rows drawn as arrows: red over the inter-node tier (IB), green
 * within a node (NVLink). Flat, the home sends one row to every rank holding
 * one of the token's experts; in two stages (DeepSeek-V3's dispatch) one row
 * to each other node's relay, the rank of the home's local index there,
 * which forwards it within its node.
 */
#ifndef MOE_PLACEMENT_SVG_H
#define MOE_PLACEMENT_SVG_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

typedef struct {
    const char *title;        /* the header line */
    int ranks;                /* G */
    int ranks_per_node;       /* R (G when one node) */
    int experts;              /* physical experts P */
    const int *first_expert;  /* (G+1) rank r holds physical experts [first[r], first[r+1]) */
    const int *logical;       /* (P) each physical expert's logical one; NULL: the same */
    int64_t token;            /* the token followed, < 0 for none */
    int home;                 /* its home rank */
    int k;                    /* its pairs */
    const int *chosen;        /* (k) their physical experts, -1 for a dropped one */
    bool two_stage;           /* --dispatch hierarchical */
} moe_placement_picture;

/* The rows of the token as the picture draws them: (from, to) rank pairs,
 * IB ones first, in ascending order; returns the number of arrows (at most
 * 2 G), *ib of them over IB. */
int moe_placement_arrows(const moe_placement_picture *p, int *from, int *to, int *ib);

void moe_write_placement_svg(FILE *out, const moe_placement_picture *p);

#endif
