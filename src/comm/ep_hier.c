/* SPDX-License-Identifier: MIT */
/* ep_hier.c — the two-stage (hierarchical) dispatch and combine
 * (--dispatch hierarchical), pipelined in waves of tokens.
 *
 * Nodes are groups of R consecutive ranks (ep->link.ranks_per_node; G a
 * multiple of R). Rank g = n·R + l is local index l of node n. Two kinds of
 * sub-communicator carry the hops, as DeepEP's internode kernels do:
 *
 *   index comm  the ranks of local index l, one per node (the inter-node tier)
 *   node comm   the R ranks of node n (the intra-node tier)
 *
 * A wave (a chunk of every rank's tokens) runs four all-to-alls:
 *
 *   D1  index comm  home g sends each token once per node that holds one of
 *                   its experts, to the rank of its local index there (its
 *                   relay; the home node's relay is g itself): rows and meta
 *   D2  node comm   the relay forwards each row it received, as received
 *                   (the wire bytes are not re-quantised), once to every rank
 *                   of its node that holds one of the token's experts
 *       experts     as on the flat path, per local expert
 *   C2  node comm   each pair's output back to the relay it came from
 *   C1  index comm  the relay returns, per row it relayed, the outputs of the
 *                   row's slots on its node, in slot order, to home
 *       reduce      home sums the k slots in slot order, as the flat path does
 *
 * With --combine reduced (DeepEP's order) the outputs are summed before each
 * hop back: a rank sums each received row's pairs in slot order and returns
 * one row per (token, rank) in C2; the relay sums those of each token over
 * its node's ranks in ascending local index and returns one row per (token,
 * node) in C1; home sums them in ascending node order. Each sum is fp32,
 * rounded to --combine-dtype before it travels; the truth rounds the same
 * sums (truth.h).
 *
 * Counts: one MPI_Alltoall over the whole communicator, before anything
 * moves, tells every rank what it will receive in D1 and D2 of every wave
 * (DeepEP's notify step does the same); C2's and C1's counts follow from the
 * plans. Each kind of all-to-all has its own communicator, so that each sees
 * its operations in wave order on every rank whatever order they land in.
 *
 * The relay's work (plan and post D2 once D1 has landed; gather and post C1
 * once C2 has) runs as soon as its input is in: at every stage boundary of
 * the experts, as well as between waves. So while wave w computes, later
 * waves cross the inter-node tier (D1) and the intra-node tier (D2) at once:
 *
 *   post D1(0 .. A)                                  A = lookahead
 *   for w = 0 .. W-1:
 *       post D1(w + A)
 *       until D2(w) is posted: wait D1(w), relay what landed
 *       wait D2(w); experts(w), relaying what lands at each stage end; post C2(w)
 *   until every C1 is posted: wait, relay what landed; wait every C1
 *
 * Every wait first computes shared-expert pieces (moe_shared_work) until
 * what it waits for is in, relaying what lands between a piece's stages;
 * the pieces left run after the reduce, and their outputs are added to y
 * in moe_ep_shared's order, the same bits.
 *
 * --blocking runs the same stages with one wave, each all-to-all waited for
 * as soon as it is posted, no link model, and the shared experts after the
 * reduce.
 *
 * Every expert output travels back unchanged (a bf16 row re-encoded is the
 * same bytes), so y has the same bits as moe_ep_forward_ref with --gemm
 * packed or exact (whose rows' bits depend on nothing but the row), at any
 * W, and is within tolerance with blas (an expert's rows arrive in another
 * order).
 */
#include <stdlib.h>
#include <string.h>

#include "ep_stages.h"
#include "moe/gemm.h"
#include "moe/quant.h"
#include "moe/watchdog.h"

/* The four all-to-alls of a wave, in the order they run. */
enum { D1, D2, C2, C1, HOPS };
static bool between_nodes(int hop) { return hop == D1 || hop == C1; }

/* MPI's four arrays of one all-to-all's counts, in rows. */
enum { SEND, SEND_AT, RECV, RECV_AT, ARRAYS };

/* One wave's plans and buffers on this rank (buffers in ep->work->hier). */
typedef struct moe_hier_wave {
    moe_send_plan p1;    /* home: the wave's tokens by destination node */
    moe_send_plan p2;    /* relay: the rows D1 brought, by rank of this node
                            (place R stands for the experts on other nodes) */
    moe_recv_plan recv;  /* experts: the rows D2 brought, by local expert */
    int posted;          /* its all-to-alls posted so far, D1 .. C1 in order */
    moe_index back2, back1; /* rows C2 and C1 send: a row per pair, or with
                               --combine reduced per (token, rank) and (token, node) */
    int *counts;         /* (HOPS, ARRAYS, S) */
    moe_index rows1, out2, rows2; /* rows D1 brought, D2 sends, D2 brought */
    uint8_t *send1, *recv1, *send2, *recv2, *out_wire, *back2_wire, *ret1, *back1_wire; /* wire rows */
    int32_t *meta1_out, *meta1, *ids1, *meta2_out, *meta2;
    float *expert_out;   /* (recv.pairs, d) */
    const float **row_at; /* (rows2) where each row D2 brought is, decoded */
    double bytes[HOPS][2][MOE_TIERS]; /* over the links: [in, out][tier] */
} hier_wave;

/* One two-stage forward on this rank. */
typedef struct {
    const moe_ep *ep;
    bool blocking;                /* wait for each all-to-all as soon as it is posted */
    bool reduced;                 /* --combine reduced: sums go back, at the rank and the relay */
    bool timing;                  /* moe_ep_hier_time_alltoalls: the bytes were counted */
    int W, nodes, R, node, local; /* local: this rank's index in its node */
    int S;                        /* stride of a wave's counts: max(nodes, R) */
    moe_ep_types types;
    moe_wire in_wire, out_wire;
    moe_placement by_node;        /* expert → node */
    moe_placement in_node;        /* expert → rank in this node, R when elsewhere */
    moe_waves waves;
    const int32_t *ids;           /* (T, k) this rank's tokens' experts */
    hier_wave *hw;                /* (W) */
    moe_index *rows_from;         /* (G) rows D2 brought from each rank of the node */
    moe_progress progress;        /* op w·HOPS + hop */
    moe_link_state links;
    const moe_link *link;
    moe_stage_clock clock;
    int next_relay[2];            /* the next wave whose D2, C1 the relay posts */
    moe_shared_work shared;       /* the shared experts, run in the waits (none: blocking) */
    float *shared_out;            /* (S, T, d) their outputs, or NULL */
} hier_forward;

static int *counts(const hier_forward *f, const hier_wave *h, int hop, int which)
{
    return h->counts + ((size_t)hop * ARRAYS + (size_t)which) * (size_t)f->S;
}
static int hop_size(const hier_forward *f, int hop) { return between_nodes(hop) ? f->nodes : f->R; }
static int hop_self(const hier_forward *f, int hop) { return between_nodes(hop) ? f->node : f->local; }

/* Rows an all-to-all's counts move between this rank and other peers. */
static moe_index remote(const hier_forward *f, const hier_wave *h, int hop, int which)
{
    const int *n = counts(f, h, hop, which);
    moe_index rows = 0;
    for (int p = 0; p < hop_size(f, hop); p++)
        rows += p == hop_self(f, hop) ? 0 : n[p];
    return rows;
}

/* A wave's buffer `which` with room for `bytes`; a failure ends the job
 * (exit 3), as a rank cannot stop the others together inside the pipeline. */
static void *fit(const hier_forward *f, int w, int which, size_t bytes, const char *what)
{
    moe_status st = {0};
    void *p = moe_buffer_fit(&f->ep->work->hier[w * MOE_HIER_BUFFERS + which], bytes, what,
                             f->ep->comm.rank, &st);
    if (!p)
        moe_fatal(&st);
    return p;
}

/* A buffer every wave shares, grown to `bytes` (never shrunk here: waves
 * need different sizes, and a shrink would reallocate between them). */
static void *grow(const hier_forward *f, moe_buffer *b, size_t bytes, const char *what)
{
    if (b->data && b->bytes >= bytes)
        return b->data;
    moe_status st = {0};
    void *p = moe_buffer_fit(b, bytes, what, f->ep->comm.rank, &st);
    if (!p)
        moe_fatal(&st);
    return p;
}

/* values (rows, d) as --combine-dtype's wire rows: in a wave's buffer
 * `which`, or (fp32, whose wire rows are the values) values themselves. */
static uint8_t *encode(const hier_forward *f, int w, int which, const float *values, moe_index rows)
{
    if (f->out_wire.dtype == MOE_DTYPE_FP32)
        return (uint8_t *)values;
    uint8_t *wire = fit(f, w, which, f->out_wire.bytes * (size_t)rows, "outputs on the wire");
    moe_wire_encode(&f->out_wire, values, NULL, rows, wire);
    return wire;
}

/* Post a wave's next all-to-all: displacements from its counts, the bytes
 * it puts on its tier, the MPI calls, the link model's arrival. */
static void post(hier_forward *f, int w, int hop)
{
    hier_wave *h = &f->hw[w];
    MOE_ASSERT(h->posted == hop);
    const int size = hop_size(f, hop), self = hop_self(f, hop), op = w * HOPS + hop;
    int *send = counts(f, h, hop, SEND), *send_at = counts(f, h, hop, SEND_AT);
    int *recv = counts(f, h, hop, RECV), *recv_at = counts(f, h, hop, RECV_AT);
    const double row_bytes = hop == D1 || hop == D2 ? moe_dispatch_row_bytes(f->ep->cfg)
                                                    : moe_combine_row_bytes(f->ep->cfg);
    const int tier = between_nodes(hop) ? MOE_TIER_INTER : MOE_TIER_INTRA;
    int out = 0, in = 0;
    memset(h->bytes[hop], 0, sizeof h->bytes[hop]);
    for (int p = 0; p < size; p++) {
        send_at[p] = out;
        recv_at[p] = in;
        out += send[p];
        in += recv[p];
        if (p != self) {
            h->bytes[hop][0][tier] += recv[p] * row_bytes;
            h->bytes[hop][1][tier] += send[p] * row_bytes;
        }
    }
    const void *from[2] = {h->send1, h->meta1_out};
    void *to[2] = {h->recv1, h->meta1};
    MPI_Datatype type[2] = {f->types.dispatch, f->types.meta};
    int n = 2;
    if (hop == D2) {
        from[0] = h->send2, from[1] = h->meta2_out;
        to[0] = h->recv2, to[1] = h->meta2;
    } else if (hop == C2 || hop == C1) {
        from[0] = hop == C2 ? h->out_wire : h->ret1;
        to[0] = hop == C2 ? h->back2_wire : h->back1_wire;
        type[0] = f->types.combine;
        n = 1;
    }
    const MPI_Comm comm = f->ep->work->hier_comm[hop];
    moe_comm_op *o = &f->progress.ops[op];
    for (int j = 0; j < n && !f->timing; j++)
        moe_comm_count_posted(send, size, self, type[j]);
    moe_progress_lock(&f->progress);
    for (int j = 0; j < n; j++)
        MOE_MPI(MPI_Ialltoallv(from[j], send, send_at, type[j], to[j], recv, recv_at, type[j], comm,
                               &o->requests[j]));
    o->count = n;
    moe_pipeline_track(&f->progress, op, f->link, &f->links, h->bytes[hop], comm);
    moe_progress_unlock(&f->progress);
    h->posted = hop + 1;
    if (f->blocking)
        moe_progress_wait(&f->progress, op);
}

/* Stage plan, every wave: D1's plan, and the one count exchange. Per
 * (rank r, wave): the rows this rank sends r's node when r is its relay
 * there (D1), and the rows r's experts need from it, a token once (what r's
 * relay forwards to r on its behalf in D2). */
static void hier_plan(hier_forward *f, const int32_t *ids)
{
    const moe_ep *ep = f->ep;
    const moe_comm *c = &ep->comm;
    const int G = c->ranks, W = f->W, R = f->R, k = (int)ep->cfg->topk;
    const moe_index T = ep->cfg->tokens;
    int *out = moe_xcalloc((size_t)(G * W * 2), sizeof(int));
    int *in = moe_xmalloc(sizeof(int) * (size_t)(G * W * 2));
    int dest[k > 0 ? k : 1], last[k > 0 ? k : 1];
    for (int w = 0; w < W; w++) {
        hier_wave *h = &f->hw[w];
        moe_send_plan_build(&h->p1, &f->by_node, ids, T, k, &f->waves, w);
        for (int n = 0; n < f->nodes; n++)
            out[((n * R + f->local) * W + w) * 2] = (int)h->p1.row_count[n];
        for (moe_index i = moe_wave_first_token(&f->waves, w); i < moe_wave_first_token(&f->waves, w + 1); i++)
            for (int n = moe_token_destinations(&ep->placement, NULL, ids, k, i, dest, last) - 1; n >= 0; n--)
                out[(dest[n] * W + w) * 2 + 1]++;
    }
    const double counts_posted = moe_stage_begin();
    moe_watch_wait(MOE_WATCH_PLAN, -1);
    MOE_MPI(MPI_Alltoall(out, 2 * W, MPI_INT, in, 2 * W, MPI_INT, c->comm));
    moe_watch_done();
    moe_pipeline_count_round(ep, f->link, counts_posted, sizeof(int) * (double)(2 * W));
    const size_t row = f->in_wire.bytes, meta = sizeof(int32_t) * (size_t)MOE_META_WORDS(k);
    for (int w = 0; w < W; w++) {
        hier_wave *h = &f->hw[w];
        h->counts = moe_xcalloc((size_t)(HOPS * ARRAYS * f->S), sizeof(int));
        int *send1 = counts(f, h, D1, SEND), *recv1 = counts(f, h, D1, RECV);
        int *recv2 = counts(f, h, D2, RECV);
        h->rows1 = h->rows2 = 0;
        for (int n = 0; n < f->nodes; n++) {
            send1[n] = (int)h->p1.row_count[n];
            recv1[n] = in[((n * R + f->local) * W + w) * 2];
            h->rows1 += recv1[n];
            for (int q = 0; q < R; q++) { /* homes of local index q on node n, via relay q */
                recv2[q] += in[((n * R + q) * W + w) * 2 + 1];
                h->rows2 += in[((n * R + q) * W + w) * 2 + 1];
            }
        }
        const moe_index rows_out = h->p1.row_offset[f->nodes];
        h->send1 = fit(f, w, MOE_HIER_SEND1, row * (size_t)rows_out, "dispatch rows");
        h->meta1_out = fit(f, w, MOE_HIER_META1_OUT, meta * (size_t)rows_out, "dispatch ids");
        h->recv1 = fit(f, w, MOE_HIER_RECV1, row * (size_t)h->rows1, "relayed rows");
        h->meta1 = fit(f, w, MOE_HIER_META1, meta * (size_t)h->rows1, "relayed ids");
        h->recv2 = fit(f, w, MOE_HIER_RECV2, row * (size_t)h->rows2, "received rows");
        h->meta2 = fit(f, w, MOE_HIER_META2, meta * (size_t)h->rows2, "received ids");
    }
    free(in);
    free(out);
}

/* The relay, once D1(w) has landed: the rows for this node's ranks, as
 * received, each once to every rank holding one of its experts; post D2. */
static void relay_dispatch(hier_forward *f, int w)
{
    const int k = (int)f->ep->cfg->topk, words = MOE_META_WORDS(k), R = f->R;
    const size_t row = f->in_wire.bytes;
    hier_wave *h = &f->hw[w];
    h->ids1 = fit(f, w, MOE_HIER_IDS1, sizeof(int32_t) * (size_t)(h->rows1 * k), "relayed top-k ids");
    for (moe_index i = 0; i < h->rows1; i++)
        for (int s = 0; s < k; s++)
            h->ids1[i * k + s] = moe_meta_id(h->meta1 + i * words, s);
    moe_send_plan_build(&h->p2, &f->in_node, h->ids1, h->rows1, k, NULL, 0);
    h->out2 = h->p2.row_offset[R];
    int *send2 = counts(f, h, D2, SEND);
    for (int q = 0; q < R; q++)
        send2[q] = (int)h->p2.row_count[q];
    h->send2 = fit(f, w, MOE_HIER_SEND2, row * (size_t)h->out2, "forwarded rows");
    h->meta2_out = fit(f, w, MOE_HIER_META2_OUT, sizeof(int32_t) * (size_t)(h->out2 * words), "forwarded ids");
    for (moe_index j = 0; j < h->out2; j++) {
        const moe_index i = h->p2.row_token[j];
        memcpy(h->send2 + (size_t)j * row, h->recv1 + (size_t)i * row, row);
        memcpy(h->meta2_out + j * words, h->meta1 + i * words, sizeof(int32_t) * (size_t)words);
    }
    post(f, w, D2);
}

/* Stage experts of wave w, once D2(w) has landed; then post C2 (each
 * pair's output to its relay). */
static void wave_experts(hier_forward *f, int w)
{
    const moe_ep *ep = f->ep;
    const int k = (int)ep->cfg->topk, R = f->R;
    const moe_index d = ep->cfg->hidden;
    hier_wave *h = &f->hw[w];
    const bool narrow_in = f->in_wire.dtype != MOE_DTYPE_FP32;
    float *values = moe_ep_wire_values(
        &f->in_wire, h->recv2, h->rows2,
        narrow_in ? fit(f, w, MOE_HIER_VALUES, sizeof(float) * (size_t)(h->rows2 * d), "decoded rows") : NULL);
    const int *from = counts(f, h, D2, RECV);
    for (int q = 0; q < R; q++)
        f->rows_from[q] = from[q];
    moe_recv_plan_build(&h->recv, &ep->placement, ep->comm.rank, h->meta2, h->rows2, k, f->rows_from,
                        NULL, 0);
    h->row_at = fit(f, w, MOE_HIER_ROW_AT, sizeof(float *) * (size_t)h->rows2, "the row table");
    for (moe_index m = 0; m < h->rows2; m++)
        h->row_at[m] = values + m * d;
    const moe_index most = moe_ep_largest_batch(&h->recv);
    float *expert_in = grow(f, &ep->work->expert_in,
                            sizeof(float) * (size_t)(most * MOE_EXPERT_WORK_FLOATS(d)), "expert rows");
    float *scratch = grow(f, &ep->work->scratch, sizeof(float) * (size_t)(most * 2 * ep->cfg->ffn),
                          "expert activations");
    h->expert_out = fit(f, w, MOE_HIER_EXPERT_OUT, sizeof(float) * (size_t)(h->recv.pairs * d), "expert outputs");
    float *sums = f->reduced ? fit(f, w, MOE_HIER_SUMS, sizeof(float) * (size_t)(h->rows2 * d), "sums per (token, rank)")
                             : NULL;
    f->clock.wave = w;
    f->clock.mark = moe_stage_begin();
    moe_pipeline_experts(ep, &h->recv, h->row_at, h->meta2, h->expert_out, sums, expert_in, scratch,
                         &f->clock);
    const float *back = f->reduced ? sums : h->expert_out;
    h->back2 = f->reduced ? h->rows2 : h->recv.pairs;
    h->out_wire = encode(f, w, MOE_HIER_OUT_WIRE, back, h->back2);
    int *send = counts(f, h, C2, SEND), *recv = counts(f, h, C2, RECV);
    const int *got = counts(f, h, D2, RECV);
    for (int q = 0; q < R; q++) {
        send[q] = f->reduced ? got[q] : (int)h->recv.source_pairs[q];
        recv[q] = (int)(f->reduced ? h->p2.row_count[q] : h->p2.pair_count[q]);
    }
    const moe_index at_relay = f->reduced ? h->p2.row_offset[R] : h->p2.pair_offset[R];
    h->back2_wire = fit(f, w, MOE_HIER_BACK2, f->out_wire.bytes * (size_t)at_relay, "outputs at the relay");
    post(f, w, C2);
}

/* The relay, once C2(w) has landed: per row it relayed (in received order,
 * so by home node), the outputs of its slots on this node in slot order, as
 * home's D1 plan expects them back; the wire bytes travel on. Post C1. */
static void relay_combine(hier_forward *f, int w)
{
    const int k = (int)f->ep->cfg->topk, R = f->R;
    const size_t out_row = f->out_wire.bytes;
    hier_wave *h = &f->hw[w];
    int *send = counts(f, h, C1, SEND), *recv = counts(f, h, C1, RECV);
    const int *relayed = counts(f, h, D1, RECV);
    if (f->reduced) { /* one row per (token, node): its ranks' sums, ascending local index */
        const moe_index d = f->ep->cfg->hidden;
        const bool narrow = f->out_wire.dtype != MOE_DTYPE_FP32;
        const float *sums = moe_ep_wire_values(
            &f->out_wire, h->back2_wire, h->p2.row_offset[R],
            narrow ? fit(f, w, MOE_HIER_BACK2_VALUES, sizeof(float) * (size_t)(h->p2.row_offset[R] * d), "decoded sums")
                   : NULL);
        float *node_sums = fit(f, w, MOE_HIER_NODE_SUMS, sizeof(float) * (size_t)(h->rows1 * d), "sums per (token, node)");
        memset(node_sums, 0, sizeof(float) * (size_t)(h->rows1 * d));
        for (moe_index j = 0; j < h->p2.row_offset[R]; j++) { /* by rank of the node, then row */
            float *to = node_sums + h->p2.row_token[j] * d;
            for (moe_index c = 0; c < d; c++)
                to[c] += sums[j * d + c];
        }
        moe_precision_combine(f->ep->cfg->combine_dtype, node_sums, h->rows1 * d);
        h->back1 = h->rows1;
        h->ret1 = encode(f, w, MOE_HIER_RET1, node_sums, h->back1);
        for (int m = 0; m < f->nodes; m++)
            send[m] = relayed[m];
    } else { /* per relayed row, the outputs of its slots on this node, in slot order */
        h->back1 = 0;
        for (moe_index n = 0; n < h->rows1 * k; n++)
            h->back1 += h->ids1[n] != MOE_DROPPED && f->in_node.expert_rank[h->ids1[n]] < R;
        h->ret1 = fit(f, w, MOE_HIER_RET1, out_row * (size_t)h->back1, "outputs for home");
        moe_index at = 0, i = 0;
        for (int m = 0; m < f->nodes; m++) {
            send[m] = 0;
            for (int n = 0; n < relayed[m]; n++, i++)
                for (int s = 0; s < k; s++)
                    if (h->ids1[i * k + s] != MOE_DROPPED &&
                        f->in_node.expert_rank[h->ids1[i * k + s]] < R) {
                        memcpy(h->ret1 + (size_t)at++ * out_row,
                               h->back2_wire + (size_t)h->p2.slot_pair[i * k + s] * out_row, out_row);
                        send[m]++;
                    }
        }
    }
    for (int n = 0; n < f->nodes; n++)
        recv[n] = (int)(f->reduced ? h->p1.row_count[n] : h->p1.pair_count[n]);
    const moe_index home = f->reduced ? h->p1.row_offset[f->nodes] : h->p1.pair_offset[f->nodes];
    h->back1_wire = fit(f, w, MOE_HIER_BACK1, out_row * (size_t)home, "outputs back home");
    post(f, w, C1);
}

/* Relay what has landed, in wave order for each kind (so every rank posts a
 * communicator's operations in the same order). In poll mode the caller has
 * just polled. */
static void relay_landed(void *arg)
{
    hier_forward *f = arg;
    for (int *w = &f->next_relay[0]; *w < f->W && f->hw[*w].posted == D1 + 1 &&
                                     moe_progress_done(&f->progress, *w * HOPS + D1);)
        relay_dispatch(f, (*w)++);
    for (int *w = &f->next_relay[1]; *w < f->W && f->hw[*w].posted == C2 + 1 &&
                                     moe_progress_done(&f->progress, *w * HOPS + C2);)
        relay_combine(f, (*w)++);
}

/* Shared-expert pieces until op has landed, relaying what lands between
 * their stages, so that a piece holds no relay back longer than one stage. */
static void fill(hier_forward *f, int op)
{
    if (f->shared.next == f->shared.pieces)
        return;
    f->shared.scratch = f->ep->work->scratch.data; /* wave_experts may have grown it */
    moe_pipeline_fill(&f->progress, op, &f->shared, relay_landed, f);
}

/* Until wave w has posted `hop` (which the relay posts): wait for the hop
 * before it, relay what landed. The wait is entered on the watchdog's board
 * even when a poll has relayed the wave already (it then returns at once):
 * every rank enters the same waits in the same order, which is how the
 * board tells the ranks arrived from those behind. The earlier waves were
 * relayed by the earlier calls, so one landed hop relays wave w. */
static void relay_until(hier_forward *f, int w, int hop)
{
    fill(f, w * HOPS + hop - 1);
    moe_progress_wait_at(&f->progress, w * HOPS + hop - 1, hop <= D2 ? MOE_WATCH_DISPATCH : MOE_WATCH_COMBINE,
                         w);
    relay_landed(f);
    MOE_ASSERT(f->hw[w].posted > hop);
}

/* Stages dispatch, experts and combine of every wave, overlapped as the
 * diagram at the top of this file shows. */
static void hier_pipeline(hier_forward *f, int lookahead)
{
    const moe_comm *c = &f->ep->comm;
    const int W = f->W;
    for (int w = 0, posted = 0; w < W; w++) {
        for (const int want = w + lookahead + 1 < W ? w + lookahead + 1 : W; posted < want; posted++)
            post(f, posted, D1);
        relay_until(f, w, D2);
        fill(f, w * HOPS + D2);
        moe_progress_wait_at(&f->progress, w * HOPS + D2, MOE_WATCH_DISPATCH, w);
        moe_pipeline_fail_here(c, "dispatch");
        wave_experts(f, w);
        moe_pipeline_fail_here(c, "experts");
        moe_progress_poll(&f->progress);
        relay_landed(f);
    }
    for (int w = 0; w < W; w++)
        relay_until(f, w, C1);
    for (int w = 0; w < W; w++) {
        fill(f, w * HOPS + C1);
        moe_progress_wait_at(&f->progress, w * HOPS + C1, MOE_WATCH_COMBINE, w);
    }
    moe_pipeline_fail_here(c, "combine");
}

/* The traffic figures and the timeline's comm events of the waves. */
static void hier_figures(hier_forward *f, const moe_schedule *sched, moe_forward_stats *stats)
{
    const moe_config *cfg = f->ep->cfg;
    const double row_bytes = moe_dispatch_row_bytes(cfg), out_bytes = moe_combine_row_bytes(cfg);
    static const int kind[HOPS] = {MOE_EVENT_DISPATCH, MOE_EVENT_DISPATCH, MOE_EVENT_COMBINE,
                                   MOE_EVENT_COMBINE};
    for (int w = 0; w < f->W; w++) {
        hier_wave *h = &f->hw[w];
        const moe_index sent[HOPS] = {h->p1.row_offset[f->nodes], h->out2, h->back2, h->back1};
        for (int hop = 0; hop < HOPS; hop++) {
            const moe_comm_op *o = &f->progress.ops[w * HOPS + hop];
            if (sched)
                moe_pipeline_comm_event(sched->trace, o, w ? &f->progress.ops[(w - 1) * HOPS + hop] : NULL,
                                        sched->origin, w, kind[hop],
                                        between_nodes(hop) ? MOE_TIER_INTER : MOE_TIER_INTRA,
                                        (double)sent[hop] * (hop < C2 ? row_bytes : out_bytes), sent[hop]);
            stats->seconds[hop < C2 ? MOE_STAGE_DISPATCH : MOE_STAGE_COMBINE] += o->completed - o->posted;
            for (int t = 0; t < MOE_TIERS; t++)
                stats->tier_bytes[t] += h->bytes[hop][1][t];
        }
        stats->rows_inter += remote(f, h, D1, SEND);
        stats->rows_intra += remote(f, h, D2, SEND);
        stats->rows_sent += sent[D1] + sent[D2];
        stats->rows_received += h->rows2;
        stats->pairs_received += h->recv.pairs;
        stats->pairs_back_remote += remote(f, h, C2, RECV) + remote(f, h, C1, RECV);
        stats->bytes_combined += (double)(sent[C2] + sent[C1]) * out_bytes;
    }
    stats->rows_sent_remote = stats->rows_inter + stats->rows_intra;
    stats->bytes_dispatched = (double)stats->rows_sent * row_bytes;
}

/* Stages reduce and shared: y in slot order (with a reduced combine, in
 * node order), whatever wave each row came back in, then the shared
 * experts on top. */
static void hier_reduce(hier_forward *f, const float *x, const float *weights, float *y,
                        moe_forward_stats *stats)
{
    const moe_ep *ep = f->ep;
    const moe_index T = ep->cfg->tokens, k = ep->cfg->topk, d = ep->cfg->hidden;
    const double t = moe_stage_begin();
    const float **slot_rows = grow(f, &ep->work->slot_rows, sizeof(float *) * (size_t)(T * k),
                                   "the reduce table");
    memset(slot_rows, 0, sizeof(float *) * (size_t)(T * k)); /* a dropped pair's stays NULL */
    const bool narrow = f->out_wire.dtype != MOE_DTYPE_FP32;
    const float **from = moe_xmalloc(sizeof(float *) * (size_t)(f->W * f->nodes));
    for (int w = 0; w < f->W; w++) {
        hier_wave *h = &f->hw[w];
        const moe_index rows = f->reduced ? h->p1.row_offset[f->nodes] : h->p1.pair_offset[f->nodes];
        const float *back = moe_ep_wire_values(
            &f->out_wire, h->back1_wire, rows,
            narrow ? fit(f, w, MOE_HIER_BACK, sizeof(float) * (size_t)(rows * d), "decoded outputs") : NULL);
        for (int n = 0; n < f->nodes; n++) /* --combine reduced: a row per (token, node) */
            from[w * f->nodes + n] = back + h->p1.row_offset[n] * d;
        for (moe_index n = 0; n < T * k && !f->reduced; n++)
            if (h->p1.slot_pair[n] >= 0)
                slot_rows[n] = back + h->p1.slot_pair[n] * d;
    }
    if (f->reduced) /* ascending node order, whatever wave */
        moe_ep_reduce_rows(ep, &f->by_node, f->ids, &f->waves, from, f->W, y);
    else
        moe_ep_reduce(ep, slot_rows, weights, y);
    free(from);
    moe_stage_end(&stats->seconds[MOE_STAGE_REDUCE], t);
    if (f->shared_out) { /* the shared experts ran in the pipeline's waits */
        f->shared.scratch = ep->work->scratch.data;
        moe_shared_work_finish(&f->shared, y, stats);
        return;
    }
    const size_t block = MOE_SHARED_ROW_BLOCK;
    float *scratch = grow(f, &ep->work->scratch, sizeof(float) * block * 2 * (size_t)ep->cfg->ffn,
                          "shared-expert activations");
    float *out = grow(f, &ep->work->expert_in, sizeof(float) * block * (size_t)d, "shared-expert outputs");
    moe_ep_shared(ep, x, y, scratch, out, stats);
}

static void free_hier_waves(hier_wave *hw, int W)
{
    for (int w = 0; w < W; w++) {
        moe_send_plan_free(&hw[w].p1);
        moe_send_plan_free(&hw[w].p2);
        moe_recv_plan_free(&hw[w].recv);
        free(hw[w].counts);
    }
    free(hw);
}

static void forget_last(struct moe_ep_workspace *work)
{
    if (work->hier_last)
        free_hier_waves(work->hier_last, work->hier_last_waves);
    work->hier_last = NULL;
    work->hier_last_waves = 0;
}

void moe_ep_forget_hier(struct moe_ep_workspace *work)
{
    forget_last(work);
    for (int n = 0; n < work->hier_waves * MOE_HIER_BUFFERS; n++)
        moe_buffer_free(&work->hier[n]);
    free(work->hier);
    work->hier = NULL;
    work->hier_waves = 0;
    if (work->hier_comms)
        for (int hop = 0; hop < HOPS; hop++)
            MOE_MPI(MPI_Comm_free(&work->hier_comm[hop]));
    work->hier_comms = false;
}

/* The communicators (at the first forward: collective, as every forward is)
 * and W waves' buffer slots; slots of a larger W before are handed back. */
static void fit_workspace(const moe_ep *ep, int W, int node, int local)
{
    struct moe_ep_workspace *work = ep->work;
    if (!work->hier_comms) {
        MPI_Comm index_comm, node_comm;
        MOE_MPI(MPI_Comm_split(ep->comm.comm, local, node, &index_comm));
        MOE_MPI(MPI_Comm_split(ep->comm.comm, node, local, &node_comm));
        for (int hop = 0; hop < HOPS; hop++)
            MOE_MPI(MPI_Comm_dup(between_nodes(hop) ? index_comm : node_comm, &work->hier_comm[hop]));
        MOE_MPI(MPI_Comm_free(&node_comm));
        MOE_MPI(MPI_Comm_free(&index_comm));
        work->hier_comms = true;
    }
    moe_ep_fit_slots(&work->hier, &work->hier_waves, W, MOE_HIER_BUFFERS);
}

static void hier_run(hier_forward *f, const moe_schedule *sched, const float *x,
                     const float *weights, float *y, moe_forward_stats *stats);

int moe_ep_hier_forward(const moe_ep *ep, const moe_schedule *sched, const float *x,
                        const int32_t *ids, const float *weights, float *y,
                        moe_forward_stats *stats, moe_status *st)
{
    const moe_config *cfg = ep->cfg;
    const moe_comm *c = &ep->comm;
    const int G = c->ranks, R = ep->link.ranks_per_node, E = ep->placement.experts; /* physical */
    MOE_ASSERT(G % R == 0); /* moe_config_validate */
    hier_forward f = {.ep = ep, .blocking = sched == NULL,
                      .reduced = cfg->combine == MOE_COMBINE_REDUCED, .W = sched ? sched->waves : 1,
                      .nodes = G / R, .R = R, .node = c->rank / R, .local = c->rank % R};
    f.S = f.nodes > R ? f.nodes : R;
    f.ids = ids;
    memset(stats, 0, sizeof *stats);
    stats->waves = sched ? f.W : 0;
    stats->wave_kind = MOE_WAVES_TOKEN_CHUNKS;
    forget_last(ep->work);
    fit_workspace(ep, f.W, f.node, f.local);
    moe_ep_types_create(ep, &f.types);
    f.in_wire = moe_wire_dispatch(cfg);
    f.out_wire = moe_wire_combine(cfg);
    moe_placement_by_node(&ep->placement, R, &f.by_node);
    f.in_node = (moe_placement){.experts = E, .ranks = R + 1};
    f.in_node.expert_rank = moe_xmalloc(sizeof(int) * (size_t)E);
    for (int e = 0; e < E; e++) {
        const int r = ep->placement.expert_rank[e];
        f.in_node.expert_rank[e] = r / R == f.node ? r % R : R;
    }
    moe_waves_init_by(&f.waves, &ep->placement, f.W, cfg->tokens, MOE_WAVE_BY_TOKENS);
    f.hw = moe_xcalloc((size_t)f.W, sizeof *f.hw);
    f.rows_from = moe_xcalloc((size_t)G, sizeof(moe_index));

    const double t = moe_stage_begin();
    f.link = sched ? moe_schedule_link(ep, sched) : &(const moe_link){.enabled = false};
    hier_plan(&f, ids);
    for (int w = 0; w < f.W; w++)
        moe_ep_pack(ep, x, ids, weights, &f.hw[w].p1, -1, f.hw[w].send1, f.hw[w].meta1_out);
    moe_stage_end(&stats->seconds[MOE_STAGE_PLAN], t);
    moe_status local = {0};
    if (!moe_ep_agreed(ep, "plan", &local)) { /* an injected fault: every rank stops here */
        *st = local;
        free_hier_waves(f.hw, f.W);
    } else {
        hier_run(&f, sched, x, weights, y, stats);
        ep->work->hier_last = f.hw; /* for moe_ep_time_alltoalls */
        ep->work->hier_last_waves = f.W;
    }
    free(f.rows_from);
    moe_waves_free(&f.waves);
    free(f.in_node.expert_rank);
    free(f.by_node.expert_rank);
    moe_ep_types_free(&f.types);
    return local.code;
}

/* Stages dispatch to shared of a planned forward, and its figures. */
static void hier_run(hier_forward *f, const moe_schedule *sched, const float *x,
                     const float *weights, float *y, moe_forward_stats *stats)
{
    const moe_ep *ep = f->ep;
    moe_progress_init(&f->progress, sched ? sched->progress : MOE_PROGRESS_POLL, HOPS * f->W);
    f->link = sched ? moe_schedule_link(ep, sched) : &(const moe_link){.enabled = false};
    if (sched && ep->cfg->shared_experts > 0) { /* the shared experts run in the waits */
        const moe_index T = ep->cfg->tokens, d = ep->cfg->hidden;
        f->shared_out = grow(f, &ep->work->shared_out,
                             sizeof(float) * (size_t)(ep->cfg->shared_experts * T * d),
                             "shared-expert outputs");
        float *scratch = grow(f, &ep->work->scratch,
                              sizeof(float) * MOE_SHARED_ROW_BLOCK * 2 * (size_t)ep->cfg->ffn,
                              "shared-expert activations");
        moe_shared_work_init(&f->shared, ep, x, scratch, f->shared_out, sched->trace, sched->origin);
    }
    moe_gemm_reset_flops();
    const double start = moe_stage_begin();
    f->clock = (moe_stage_clock){&f->progress, sched ? sched->trace : NULL, sched ? sched->origin : 0.0,
                                 start, 0.0, 0, 0, sched ? relay_landed : NULL, f, 0};
    hier_pipeline(f, sched ? sched->lookahead : 1);
    const double end = moe_stage_end(&stats->pipeline_seconds, start);
    moe_progress_stop(&f->progress);
    stats->fill_seconds = f->shared.seconds;
    stats->fill_flops = f->shared.flops;
    stats->seconds[MOE_STAGE_EXPERTS] = f->clock.compute;
    stats->compute_seconds = f->clock.compute + f->shared.seconds;
    stats->layout_slots = f->clock.slots;
    stats->test_seconds = f->progress.test_seconds;
    stats->expert_start = start;
    stats->expert_end = end;
    stats->expert_flops = moe_gemm_sflops() - f->shared.flops;
    hier_figures(f, sched, stats);
    hier_reduce(f, x, weights, y, stats);
    moe_progress_free(&f->progress);
}

int moe_ep_forward_hier(const moe_ep *ep, const float *x, const int32_t *ids,
                        const float *weights, float *y, moe_forward_stats *stats, moe_status *st)
{
    return moe_ep_hier_forward(ep, NULL, x, ids, weights, y, stats, st);
}

double moe_ep_hier_time_alltoalls(const moe_ep *ep, const moe_schedule *sched)
{
    const struct moe_ep_workspace *work = ep->work;
    const int W = work->hier_last_waves, R = ep->link.ranks_per_node;
    MOE_ASSERT(work->hier_last != NULL);
    hier_forward f = {.ep = ep, .timing = true, .reduced = ep->cfg->combine == MOE_COMBINE_REDUCED, .W = W, .nodes = ep->comm.ranks / R, .R = R,
                      .node = ep->comm.rank / R, .local = ep->comm.rank % R, .hw = work->hier_last};
    f.S = f.nodes > R ? f.nodes : R;
    moe_ep_types_create(ep, &f.types);
    const moe_link *link = moe_schedule_link(ep, sched);
    moe_link_state alone = {{{0}}};
    double modelled = 0.0;
    moe_progress_init(&f.progress, MOE_PROGRESS_POLL, HOPS * W);
    f.link = &(const moe_link){.enabled = false};
    MOE_MPI(MPI_Barrier(ep->comm.comm));
    const double t = moe_stage_begin();
    for (int w = 0; w < W; w++)
        for (int hop = 0; hop < HOPS; hop++) {
            f.hw[w].posted = hop;
            post(&f, w, hop);
            const double done = moe_link_schedule(link, &alone, 0.0, f.hw[w].bytes[hop][0],
                                                  f.hw[w].bytes[hop][1]);
            modelled = done > modelled ? done : modelled;
        }
    for (int op = 0; op < HOPS * W; op++)
        moe_progress_wait(&f.progress, op);
    const double real = moe_stage_since(t);
    moe_progress_free(&f.progress);
    moe_ep_types_free(&f.types);
    return real > modelled ? real : modelled;
}
