/* SPDX-License-Identifier: MIT */
/* eplb.c — redundant experts placed by DeepSeek's EPLB algorithm (eplb.h). */
#include "moe/eplb.h"
#include "moe/layout.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

const char *moe_eplb_unplaceable(int logical, int physical, int ranks)
{
    if (physical < logical)
        return "fewer physical experts than logical ones";
    if (physical % ranks != 0)
        return "the physical experts (E + N) must be a multiple of the ranks, each rank the same number of slots";
    return NULL;
}

/* order (n) = 0 .. n-1 sorted by descending w, equal weights in ascending
 * index (a stable insertion sort: n is a few hundred at most). */
static void sort_descending(const float *w, int n, int *order)
{
    for (int i = 0; i < n; i++) {
        int j = i;
        while (j > 0 && w[order[j - 1]] < w[i]) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = i;
    }
}

/* Balanced packing of n items of weight w into m packs of n/m items: pack
 * (n) and rank_in_pack (n) of each item. */
static void balanced_packing(const float *w, int n, int m, int *pack, int *rank_in_pack)
{
    const int per_pack = n / m;
    if (per_pack == 1) {
        for (int i = 0; i < n; i++) {
            pack[i] = i;
            rank_in_pack[i] = 0;
        }
        return;
    }
    int *order = moe_xmalloc(sizeof(int) * (size_t)n);
    float *weight = moe_xcalloc((size_t)m, sizeof(float));
    int *items = moe_xcalloc((size_t)m, sizeof(int));
    sort_descending(w, n, order);
    for (int o = 0; o < n; o++) {
        const int item = order[o];
        int best = -1;
        for (int p = 0; p < m; p++)
            if (items[p] < per_pack && (best < 0 || weight[p] < weight[best]))
                best = p;
        pack[item] = best;
        rank_in_pack[item] = items[best]++;
        weight[best] += w[item];
    }
    free(items);
    free(weight);
    free(order);
}

/* Replicate n logical items of load w onto n_phy physical slots: slot i < n
 * holds item i, each further slot the item with the largest load per copy
 * so far (the lowest index on a tie). phy2log (n_phy), replica (n_phy),
 * count (n). */
static void replicate(const float *w, int n, int n_phy, int *phy2log, int *replica, int *count)
{
    for (int i = 0; i < n; i++) {
        phy2log[i] = i;
        replica[i] = 0;
        count[i] = 1;
    }
    for (int i = n; i < n_phy; i++) {
        int best = 0;
        float best_w = w[0] / (float)count[0];
        for (int e = 1; e < n; e++) {
            const float per_copy = w[e] / (float)count[e];
            if (per_copy > best_w) {
                best = e;
                best_w = per_copy;
            }
        }
        phy2log[i] = best;
        replica[i] = count[best]++;
    }
}

static void replicas_alloc(moe_replicas *r, int logical, int physical, int ranks)
{
    r->logical = logical;
    r->physical = physical;
    r->ranks = ranks;
    r->phy2log = moe_xmalloc(sizeof(int) * (size_t)physical);
    r->replica = moe_xmalloc(sizeof(int) * (size_t)physical);
    r->copies = moe_xcalloc((size_t)logical, sizeof(int));
    r->log2phy = NULL;
}

/* copies, max_copies and log2phy from phy2log and replica. */
static void replicas_index(moe_replicas *r)
{
    memset(r->copies, 0, sizeof(int) * (size_t)r->logical);
    for (int p = 0; p < r->physical; p++)
        r->copies[r->phy2log[p]]++;
    r->max_copies = 0;
    for (int e = 0; e < r->logical; e++)
        r->max_copies = r->copies[e] > r->max_copies ? r->copies[e] : r->max_copies;
    r->log2phy = moe_xmalloc(sizeof(int) * (size_t)r->logical * (size_t)r->max_copies);
    for (size_t n = 0; n < (size_t)r->logical * (size_t)r->max_copies; n++)
        r->log2phy[n] = -1;
    for (int p = 0; p < r->physical; p++)
        r->log2phy[(size_t)r->phy2log[p] * (size_t)r->max_copies + (size_t)r->replica[p]] = p;
}

void moe_replicas_free(moe_replicas *r)
{
    free(r->phy2log);
    free(r->replica);
    free(r->copies);
    free(r->log2phy);
    memset(r, 0, sizeof *r);
}

void moe_eplb_place(const double *load, int logical, int physical, int groups, int nodes, int ranks,
                    moe_replicas *out)
{
    MOE_ASSERT(moe_eplb_unplaceable(logical, physical, ranks) == NULL);
    const int E = logical, P = physical, G = ranks;
    const bool hierarchical = groups >= 1 && nodes >= 1 && E % groups == 0 &&
                              groups % nodes == 0 && G % nodes == 0 && P % nodes == 0;
    if (!hierarchical)
        groups = nodes = 1;
    const int group_size = E / groups, groups_per_node = groups / nodes;
    const int per_node = E / nodes, phy_per_node = P / nodes, ranks_per_node = G / nodes;
    const int per_rank = P / G;
    replicas_alloc(out, E, P, G);
    out->hierarchical = hierarchical && nodes > 1;

    float *w = moe_xmalloc(sizeof(float) * (size_t)(2 * E + 2 * P));
    float *scratch = w + E; /* groups, or a node's experts then its physical experts */
    for (int e = 0; e < E; e++)
        w[e] = (float)load[e];
    int *ints = moe_xmalloc(sizeof(int) * (size_t)(4 * E + 6 * P));
    int *log2mlog = ints, *mlog2log = log2mlog + E, *pack = mlog2log + E, *rank_in = pack + E;
    int *phy2mlog = rank_in + E, *phy_replica = phy2mlog + P, *mlog_count = phy_replica + P;
    int *phy_pack = mlog_count + P, *phy_rank_in = phy_pack + P, *pphy2phy = phy_rank_in + P;

    /* 1: the groups onto the nodes; "mlog" numbers experts node by node */
    for (int g = 0; g < groups; g++) {
        scratch[g] = 0.0f;
        for (int j = 0; j < group_size; j++)
            scratch[g] += w[g * group_size + j];
    }
    balanced_packing(scratch, groups, nodes, pack, rank_in);
    for (int e = 0; e < E; e++) {
        const int g = e / group_size;
        log2mlog[e] = (pack[g] * groups_per_node + rank_in[g]) * group_size + e % group_size;
        mlog2log[log2mlog[e]] = e;
    }
    for (int n = 0; n < nodes; n++) {
        const int *node_mlog2log = mlog2log + n * per_node;
        float *node_w = scratch; /* (per_node) then (phy_per_node) */
        /* 2: copies within the node */
        for (int j = 0; j < per_node; j++)
            node_w[j] = w[node_mlog2log[j]];
        int *p2m = phy2mlog + n * phy_per_node, *rep = phy_replica + n * phy_per_node;
        int *cnt = mlog_count + n * per_node;
        replicate(node_w, per_node, phy_per_node, p2m, rep, cnt);
        /* 3: the node's physical experts onto its ranks */
        float *phy_w = scratch + per_node;
        for (int i = 0; i < phy_per_node; i++)
            phy_w[i] = node_w[p2m[i]] / (float)cnt[p2m[i]];
        balanced_packing(phy_w, phy_per_node, ranks_per_node, phy_pack, phy_rank_in);
        for (int i = 0; i < phy_per_node; i++)
            pphy2phy[phy_pack[i] * per_rank + phy_rank_in[i]] = i;
        for (int q = 0; q < phy_per_node; q++) {
            const int i = pphy2phy[q];
            out->phy2log[n * phy_per_node + q] = node_mlog2log[p2m[i]];
            out->replica[n * phy_per_node + q] = rep[i];
        }
    }
    free(ints);
    free(w);
    replicas_index(out);
}

void moe_replicas_of_token(const moe_replicas *r, const int32_t *ids, int topk, uint64_t token,
                           int node, int ranks_per_node, int32_t *placed)
{
    const int per_rank = r->physical / r->ranks;
    int visited[topk > 0 ? topk : 1], n = 0; /* ranks the token's rows go to so far */
    int32_t logical[topk > 0 ? topk : 1];    /* placed may be ids */
    memcpy(logical, ids, sizeof(int32_t) * (size_t)topk);
    ids = logical;
    for (int s = 0; s < topk; s++) {
        placed[s] = ids[s] < 0 ? ids[s] : -2; /* -2: a pair with copies, still open */
        if (ids[s] >= 0 && r->copies[ids[s]] == 1)
            visited[n++] = (placed[s] = r->log2phy[(size_t)ids[s] * (size_t)r->max_copies]) / per_rank;
    }
    for (int s = 0; s < topk; s++) {
        if (placed[s] != -2)
            continue;
        const int *copy = r->log2phy + (size_t)ids[s] * (size_t)r->max_copies;
        const int copies = r->copies[ids[s]];
        int on_node = 0;
        for (int c = 0; c < copies; c++)
            on_node += copy[c] / per_rank / ranks_per_node == node;
        int shared[copies], m = 0; /* the candidates on a visited rank */
        for (int c = 0; c < copies; c++) {
            const int rank = copy[c] / per_rank;
            bool seen = false;
            for (int v = 0; v < n && !seen; v++)
                seen = visited[v] == rank;
            if (seen && (on_node == 0 || rank / ranks_per_node == node))
                shared[m++] = copy[c];
        }
        placed[s] = m > 0 ? shared[token % (uint64_t)m]
                          : moe_replica_of(r, ids[s], token, node, ranks_per_node);
        visited[n++] = placed[s] / per_rank;
    }
}

int moe_replica_of(const moe_replicas *r, int expert, uint64_t token, int node, int ranks_per_node)
{
    const int *copy = r->log2phy + (size_t)expert * (size_t)r->max_copies;
    const int copies = r->copies[expert];
    if (copies == 1)
        return copy[0];
    const int per_rank = r->physical / r->ranks;
    int local = 0;
    for (int c = 0; c < copies; c++)
        local += copy[c] / per_rank / ranks_per_node == node;
    if (local == 0)
        return copy[token % (uint64_t)copies];
    int pick = (int)(token % (uint64_t)local);
    for (int c = 0; c < copies; c++)
        if (copy[c] / per_rank / ranks_per_node == node && pick-- == 0)
            return copy[c];
    MOE_ASSERT(0);
    return -1;
}

int moe_eplb_validate(const moe_config *cfg, int ranks, const char *group, moe_status *st)
{
    const int64_t N = cfg->redundant_experts, E = cfg->experts, P = E + N;
    if (N == 0) {
        if (cfg->replica_choice != MOE_REPLICA_SPREAD)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--replica-choice chooses among the copies of --redundant-experts: add "
                            "--redundant-experts N");
        if (cfg->expert_load[0] || cfg->eplb_window != 1)
            return moe_fail(st, MOE_EXIT_USAGE, "--%s is the load of redundant experts: add --redundant-experts N",
                            cfg->expert_load[0] ? "expert-load" : "eplb-window");
        return MOE_EXIT_OK;
    }
    if (P % ranks != 0) {
        const int64_t next = (P + ranks - 1) / ranks * ranks - E;
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--redundant-experts %lld: the %lld + %lld = %lld physical experts must be a "
                        "multiple of the %d %s (each the same number of slots): the next N that fits "
                        "is %lld", (long long)N, (long long)E, (long long)N, (long long)P, ranks,
                        group, (long long)next);
    }
    if (P > MOE_META_MAX_EXPERTS)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--redundant-experts must be at most %lld (E + N physical ids travel as 16 bits), got %lld",
                        (long long)(MOE_META_MAX_EXPERTS - E), (long long)N);
    if (cfg->backward)
        return moe_fail(st, MOE_EXIT_USAGE, "--redundant-experts serves inference: drop --backward (the "
                        "copies' weight gradients would need summing)");
    return MOE_EXIT_OK;
}
