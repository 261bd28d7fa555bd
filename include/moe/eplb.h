/* SPDX-License-Identifier: MIT */
/* eplb.h — redundant experts: DeepSeek's expert-parallel load balancer.
 *
 * Pure: no MPI. Given a load per logical expert (tokens routed to it over
 * some window), place P = E + N physical experts on G ranks, P/G each, so
 * that the most loaded rank carries as little as possible. A physical
 * expert holds a copy of one logical expert's weights; a hot expert gets
 * several copies and its tokens are spread over them.
 *
 * The algorithm is the public deepseek-ai/EPLB (eplb.py, commit 5791971,
 * `rebalance_experts`), ported step for step:
 *
 *   hierarchical (used when the router's expert groups divide by the nodes)
 *     1. pack the expert groups onto the nodes, groups/nodes each, so that
 *        the nodes' loads are balanced (balanced packing, below);
 *     2. within each node, give its E/nodes experts P/nodes physical slots:
 *        each extra slot goes to the expert with the largest load per
 *        replica so far (replicate);
 *     3. within each node, pack its physical experts onto its ranks, P/G
 *        each, each weighing its expert's load over its replica count.
 *   global (otherwise): the same with one group and one node.
 *
 *   balanced packing of n items into m packs of n/m: items in order of
 *   descending weight, each into the pack of least weight so far that still
 *   has room (the lowest such pack on a tie); n/m = 1 keeps item i in pack i.
 *
 * Arithmetic as the reference: loads in fp32, group sums, pack weights and
 * load per replica in fp32. Ties: the reference sorts with torch's unstable
 * sort, so its order among equal loads is not defined; here the sort is
 * stable (equal loads keep ascending index) and the maxima and minima take
 * the lowest index, as torch's do. For loads without ties between different
 * experts the physical-to-logical map is the reference's exactly
 * (tests/unit/check_eplb.c holds cases computed with it); the replica
 * number of one expert's tied copies may differ from it, which does not
 * change the map.
 */
#ifndef MOE_EPLB_H
#define MOE_EPLB_H

#include "moe/common.h"
#include "moe/config.h"

typedef struct {
    int logical;      /* E */
    int physical;     /* P = E + N */
    int ranks;        /* G; physical expert p is on rank p / (P / G) */
    int max_copies;   /* the most copies any expert has */
    int *phy2log;     /* (P) the logical expert physical expert p holds */
    int *replica;     /* (P) which copy of its expert p is: 0 .. copies - 1 */
    int *copies;      /* (E) copies of each logical expert, >= 1 */
    int *log2phy;     /* (E, max_copies) physical id of copy c of expert e; -1 past copies[e] */
    bool hierarchical; /* the policy used */
} moe_replicas;

/* Validity of a placement request, without computing it: NULL when EPLB can
 * place `physical` experts for these sizes, else the reason. */
const char *moe_eplb_unplaceable(int logical, int physical, int ranks);

/* Place physical = E + N experts on `ranks` ranks for load (E), with the
 * hierarchical policy when groups % nodes == 0 (and E % groups == 0,
 * ranks % nodes == 0), the global one otherwise. moe_eplb_unplaceable must
 * have returned NULL. */
void moe_eplb_place(const double *load, int logical, int physical, int groups, int nodes, int ranks,
                    moe_replicas *out);

void moe_replicas_free(moe_replicas *r);

/* --replica-choice: moe_replica_of per pair, or moe_replicas_of_token. */
enum moe_replica_choice { MOE_REPLICA_SPREAD, MOE_REPLICA_DEDUP };

/* The physical expert that serves logical expert `expert` for the token with
 * global id `token` whose home rank is on node `node` (nodes of
 * ranks_per_node consecutive ranks): among the expert's copies on that node,
 * if any, else among all its copies (each list in copy order), the one at
 * token mod its length. Deterministic, from the routing alone. */
int moe_replica_of(const moe_replicas *r, int expert, uint64_t token, int node, int ranks_per_node);

/* The copies of one token's k pairs, sharing its rows: placed (k) for ids
 * (k) (-1: a dropped pair, kept -1; placed may be ids). The pairs of experts with one copy
 * first fix the ranks the token visits anyway; then, in slot order, each
 * pair of an expert with copies goes to a copy on a rank the token already
 * visits, among the candidates of moe_replica_of (the copies on its node if
 * any, else all), the one at token mod their number, and to
 * moe_replica_of's copy when none is on such a rank. A token sends a rank
 * one row whatever pairs it holds there, so a copy where it goes anyway
 * costs no row. Deterministic, from the routing alone. */
void moe_replicas_of_token(const moe_replicas *r, const int32_t *ids, int topk, uint64_t token,
                           int node, int ranks_per_node, int32_t *placed);

/* --redundant-experts, --eplb-window, --expert-load and --replica-choice for `ranks` members
 * of the EP group (`group` names them in the error: "ranks", "GPUs of
 * --ep"): E + N slots, the same number on each, each a 16-bit id on the
 * wire; inference only. Part of moe_config_validate; `plan` calls it for
 * its EP group. Returns MOE_EXIT_OK or MOE_EXIT_USAGE with st set. */
int moe_eplb_validate(const moe_config *cfg, int ranks, const char *group, moe_status *st);

#endif
