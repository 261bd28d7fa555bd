/* ep_hier.c — the two-stage (hierarchical) dispatch and combine, blocking.
 *
 * Nodes are groups of R consecutive ranks (ep->link.ranks_per_node; G a
 * multiple of R). Rank g = n·R + l is local index l of node n. Two
 * sub-communicators carry the stages, as DeepEP's internode kernels do:
 *
 *   index comm  the ranks of local index l, one per node (the inter-node tier)
 *   node comm   the R ranks of node n (the intra-node tier)
 *
 *   stage 1  home g sends each token once per node that holds one of its
 *            experts, to the rank of the same local index there (its relay;
 *            the home node's relay is g itself): rows and meta, on the index comm
 *   stage 2  the relay forwards each row it received, as received (the wire
 *            bytes are not re-quantised), once to every rank of its node that
 *            holds one of the token's experts: on the node comm
 *   experts  as on the flat path, per local expert, pairs in received order
 *   combine  stage 2 reversed (each pair's output back to its relay), then
 *            stage 1 reversed (the relay returns, per row it relayed, the
 *            outputs of the row's slots on its node, in slot order, to home)
 *   reduce   home sums the k slots in slot order, as the flat path does
 *
 * Every expert output travels back unchanged (a bf16 row re-encoded is the
 * same bytes), so y has the same bits as moe_ep_forward_ref with --gemm
 * packed or exact (whose rows' bits depend on nothing but the row), and is
 * within tolerance with blas (an expert's rows arrive in another order).
 */
#include <stdlib.h>
#include <string.h>

#include "ep_stages.h"
#include "moe/gemm.h"

/* One tier's all-to-all of rows: counts per peer of the sub-communicator,
 * derived displacements, the peer counts learnt with MPI_Alltoall. */
typedef struct {
    MPI_Comm comm;
    int size, self;
    int *send, *send_at, *recv, *recv_at; /* (size) each */
    moe_index in;                         /* rows received */
} tier;

static void tier_init(tier *t, MPI_Comm parent, int color, int key)
{
    MOE_MPI(MPI_Comm_split(parent, color, key, &t->comm));
    MOE_MPI(MPI_Comm_size(t->comm, &t->size));
    MOE_MPI(MPI_Comm_rank(t->comm, &t->self));
    t->send = moe_xcalloc((size_t)(4 * t->size), sizeof(int));
    t->send_at = t->send + t->size;
    t->recv = t->send + 2 * t->size;
    t->recv_at = t->send + 3 * t->size;
}

static void tier_free(tier *t)
{
    free(t->send);
    MOE_MPI(MPI_Comm_free(&t->comm));
}

/* send[] and recv[] set: displacements, and the rows coming in. */
static void tier_displace(tier *t)
{
    int out = 0, in = 0;
    for (int p = 0; p < t->size; p++) {
        t->send_at[p] = out;
        t->recv_at[p] = in;
        out += t->send[p];
        in += t->recv[p];
    }
    t->in = in;
}

/* send[] set: the peers' counts learnt, then the displacements. */
static void tier_exchange_counts(tier *t)
{
    MOE_MPI(MPI_Alltoall(t->send, 1, MPI_INT, t->recv, 1, MPI_INT, t->comm));
    tier_displace(t);
}

static void tier_alltoallv(tier *t, const void *out, void *in, MPI_Datatype type)
{
    moe_comm_count_posted(t->send, t->size, t->self, type);
    MOE_MPI(MPI_Alltoallv(out, t->send, t->send_at, type, in, t->recv, t->recv_at, type, t->comm));
}

/* Rows to other peers of a tier (what crossed a link). */
static moe_index remote(const int *counts, int size, int self)
{
    moe_index n = 0;
    for (int p = 0; p < size; p++)
        n += p == self ? 0 : counts[p];
    return n;
}

int moe_ep_forward_hier(const moe_ep *ep, const float *x, const int32_t *ids,
                        const float *weights, float *y, moe_forward_stats *stats)
{
    const moe_config *cfg = ep->cfg;
    const moe_comm *c = &ep->comm;
    const int G = c->ranks, me = c->rank, R = ep->link.ranks_per_node, nodes = G / R;
    const int node = me / R, k = (int)cfg->topk, E = (int)cfg->experts, words = MOE_META_WORDS(k);
    const moe_index T = cfg->tokens, d = cfg->hidden;
    MOE_ASSERT(G % R == 0); /* moe_config_validate */
    const moe_wire in_wire = moe_wire_dispatch(cfg), out_wire = moe_wire_combine(cfg);
    const size_t row = in_wire.bytes, out_row = out_wire.bytes;
    memset(stats, 0, sizeof *stats);
    const double t0 = MPI_Wtime();
    moe_ep_types types;
    moe_ep_types_create(ep, &types);
    tier across, within; /* the index comm (one rank per node) and the node comm */
    tier_init(&across, c->comm, me % R, node);
    tier_init(&within, c->comm, node, me % R);

    /* Stage 1 plan: nodes as destinations, a token once per node. */
    moe_placement by_node = {.experts = E, .ranks = nodes};
    by_node.expert_rank = moe_xmalloc(sizeof(int) * (size_t)E);
    for (int e = 0; e < E; e++)
        by_node.expert_rank[e] = ep->placement.expert_rank[e] / R;
    moe_send_plan p1;
    moe_send_plan_build(&p1, &by_node, ids, T, k, NULL, 0);
    for (int n = 0; n < nodes; n++)
        across.send[n] = (int)p1.row_count[n];
    tier_exchange_counts(&across);
    uint8_t *send1 = moe_xmalloc(row * (size_t)p1.row_offset[nodes] + 1);
    int32_t *meta1_out = moe_xmalloc(sizeof(int32_t) * (size_t)(p1.row_offset[nodes] * words) + 1);
    moe_ep_pack(ep, x, ids, weights, &p1, -1, send1, meta1_out);
    const moe_index rows1 = across.in;
    uint8_t *recv1 = moe_xmalloc(row * (size_t)rows1 + 1);
    int32_t *meta1 = moe_xmalloc(sizeof(int32_t) * (size_t)(rows1 * words) + 1);
    stats->seconds[MOE_STAGE_PLAN] = MPI_Wtime() - t0;
    const double t1 = MPI_Wtime();
    tier_alltoallv(&across, send1, recv1, types.dispatch);
    tier_alltoallv(&across, meta1_out, meta1, types.meta);
    const moe_index inter_rows = remote(across.send, nodes, node);

    /* Stage 2 plan at the relay: this node's R ranks, and one more place
     * (index R) standing for every expert on another node, never sent to. */
    moe_placement in_node = {.experts = E, .ranks = R + 1};
    in_node.expert_rank = moe_xmalloc(sizeof(int) * (size_t)E);
    for (int e = 0; e < E; e++) {
        const int r = ep->placement.expert_rank[e];
        in_node.expert_rank[e] = r / R == node ? r - node * R : R;
    }
    int32_t *ids1 = moe_xmalloc(sizeof(int32_t) * (size_t)(rows1 * k) + 1);
    for (moe_index i = 0; i < rows1; i++)
        memcpy(ids1 + i * k, meta1 + i * words, sizeof(int32_t) * (size_t)k);
    moe_send_plan p2;
    moe_send_plan_build(&p2, &in_node, ids1, rows1, k, NULL, 0);
    for (int q = 0; q < R; q++)
        within.send[q] = (int)p2.row_count[q];
    tier_exchange_counts(&within);
    const moe_index out2 = p2.row_offset[R]; /* rows for this node's ranks */
    uint8_t *send2 = moe_xmalloc(row * (size_t)out2 + 1);
    int32_t *meta2_out = moe_xmalloc(sizeof(int32_t) * (size_t)(out2 * words) + 1);
    for (moe_index j = 0; j < out2; j++) { /* forwarded as received */
        const moe_index i = p2.row_token[j];
        memcpy(send2 + (size_t)j * row, recv1 + (size_t)i * row, row);
        memcpy(meta2_out + j * words, meta1 + i * words, sizeof(int32_t) * (size_t)words);
    }
    const moe_index rows2 = within.in;
    uint8_t *recv2 = moe_xmalloc(row * (size_t)rows2 + 1);
    int32_t *meta2 = moe_xmalloc(sizeof(int32_t) * (size_t)(rows2 * words) + 1);
    tier_alltoallv(&within, send2, recv2, types.dispatch);
    tier_alltoallv(&within, meta2_out, meta2, types.meta);
    const moe_index intra_rows = remote(within.send, R, me % R);
    stats->seconds[MOE_STAGE_DISPATCH] = MPI_Wtime() - t1;

    /* Experts: the flat path's stage, on the rows of both stages' sources. */
    const double t2 = MPI_Wtime();
    float *values = moe_xmalloc(sizeof(float) * (size_t)(rows2 * d) + 1);
    moe_wire_decode(&in_wire, recv2, rows2, values);
    moe_index *rows_from = moe_xcalloc((size_t)G, sizeof(moe_index)); /* sources: node ranks */
    for (int q = 0; q < R; q++)
        rows_from[q] = within.recv[q];
    moe_recv_plan recv;
    moe_recv_plan_build(&recv, &ep->placement, me, meta2, rows2, k, rows_from, NULL, 0);
    const moe_index most = moe_ep_largest_batch(&recv);
    float *expert_in = moe_xmalloc(sizeof(float) * (size_t)(most * MOE_EXPERT_WORK_FLOATS(d)));
    float *scratch = moe_xmalloc(sizeof(float) * (size_t)(most * 2 * cfg->ffn));
    float *expert_out = moe_xmalloc(sizeof(float) * (size_t)(recv.pairs * d) + 1);
    const float **row_at = moe_xmalloc(sizeof(float *) * (size_t)rows2 + 1);
    for (moe_index m = 0; m < rows2; m++)
        row_at[m] = values + m * d;
    moe_gemm_reset_flops();
    for (int l = 0; l < ep->local_experts; l++)
        moe_ep_expert(ep, &recv, l, row_at, meta2, expert_in, scratch, expert_out, NULL);
    stats->expert_flops = moe_gemm_sflops();
    stats->expert_start = t2;
    stats->expert_end = MPI_Wtime();
    stats->seconds[MOE_STAGE_EXPERTS] = stats->expert_end - t2;

    /* Combine, stage 2 reversed: each pair's output to its relay. */
    const double t3 = MPI_Wtime();
    uint8_t *out_bytes = moe_xmalloc(out_row * (size_t)recv.pairs + 1);
    moe_wire_encode(&out_wire, expert_out, NULL, recv.pairs, out_bytes);
    for (int q = 0; q < R; q++) {
        within.send[q] = (int)recv.source_pairs[q];
        within.recv[q] = (int)p2.pair_count[q];
    }
    tier_displace(&within);
    const moe_index back2_rows = p2.pair_offset[R];
    uint8_t *back2 = moe_xmalloc(out_row * (size_t)back2_rows + 1);
    tier_alltoallv(&within, out_bytes, back2, types.combine);
    const moe_index back2_remote = remote(within.recv, R, me % R);

    /* Stage 1 reversed: per relayed row (in received order, so by source
     * node), the outputs of its slots on this node in slot order, as the
     * home's stage-1 plan expects them back. The wire bytes travel on. */
    moe_index pairs1 = 0;
    for (moe_index i = 0; i < rows1 * k; i++)
        pairs1 += in_node.expert_rank[ids1[i]] < R;
    uint8_t *ret1 = moe_xmalloc(out_row * (size_t)pairs1 + 1);
    memset(across.send, 0, sizeof(int) * (size_t)nodes);
    moe_index at = 0, i = 0;
    for (int m = 0; m < nodes; m++)
        for (int n = 0; n < across.recv[m]; n++, i++)
            for (int s = 0; s < k; s++)
                if (in_node.expert_rank[ids1[i * k + s]] < R) {
                    memcpy(ret1 + (size_t)at++ * out_row,
                           back2 + (size_t)p2.slot_pair[i * k + s] * out_row, out_row);
                    across.send[m]++;
                }
    for (int n = 0; n < nodes; n++)
        across.recv[n] = (int)p1.pair_count[n];
    tier_displace(&across);
    uint8_t *back1 = moe_xmalloc(out_row * (size_t)p1.pair_offset[nodes] + 1);
    tier_alltoallv(&across, ret1, back1, types.combine);
    const moe_index back1_remote = remote(across.recv, nodes, node);
    stats->seconds[MOE_STAGE_COMBINE] = MPI_Wtime() - t3;

    /* Reduce in slot order, then the shared experts. */
    const double t4 = MPI_Wtime();
    float *back = moe_xmalloc(sizeof(float) * (size_t)(p1.pair_offset[nodes] * d) + 1);
    moe_wire_decode(&out_wire, back1, p1.pair_offset[nodes], back);
    const float **slot_rows = moe_xmalloc(sizeof(float *) * (size_t)(T * k) + 1);
    for (moe_index n = 0; n < T * k; n++)
        slot_rows[n] = back + p1.slot_pair[n] * d;
    moe_ep_reduce(ep, slot_rows, weights, y);
    stats->seconds[MOE_STAGE_REDUCE] = MPI_Wtime() - t4;
    moe_ep_shared(ep, x, y, scratch, expert_in, stats);

    /* What crossed links: stage 1 between nodes, stage 2 within them. */
    stats->rows_sent = p1.row_offset[nodes] + out2;
    stats->rows_sent_remote = inter_rows + intra_rows;
    stats->rows_received = rows2;
    stats->pairs_received = recv.pairs;
    stats->pairs_back_remote = back2_remote + back1_remote;
    stats->rows_inter = inter_rows;
    stats->rows_intra = intra_rows;
    stats->bytes_dispatched = (double)stats->rows_sent * moe_dispatch_row_bytes(cfg);
    stats->bytes_combined = (double)(recv.pairs + pairs1) * moe_combine_row_bytes(cfg);

    free(slot_rows);
    free(back);
    free(back1);
    free(ret1);
    free(back2);
    free(out_bytes);
    free(row_at);
    free(expert_out);
    free(scratch);
    free(expert_in);
    moe_recv_plan_free(&recv);
    free(rows_from);
    free(values);
    free(meta2);
    free(recv2);
    free(meta2_out);
    free(send2);
    moe_send_plan_free(&p2);
    free(ids1);
    free(in_node.expert_rank);
    free(meta1);
    free(recv1);
    free(meta1_out);
    free(send1);
    moe_send_plan_free(&p1);
    free(by_node.expert_rank);
    tier_free(&within);
    tier_free(&across);
    moe_ep_types_free(&types);
    return MOE_EXIT_OK;
}
