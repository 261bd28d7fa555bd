/* SPDX-License-Identifier: MIT */
/* ep_ll.c — the low-latency forward of decode (--mode low-latency).
 *
 * No count exchange and no deduplication: every (token, expert) pair of a
 * source travels as its own row into a fixed slot of the owner's receive
 * buffer, [local expert][source rank * N + i] (N = --max-tokens-per-rank, i
 * the pair's place among the source's pairs for that expert, in token
 * order), the layout DeepEP's low-latency kernels write. A source sends
 * each expert's rows as one contiguous block, so a rank's pairs need no
 * more than E messages; a pair per row costs k rows a token where the
 * deduplicated dispatch sends one per (token, rank), and buys a single
 * round: the sizes are known before anything moves.
 *
 * One MPI window per rank, allocated once (MPI_Win_allocate) and held in
 * a passive-target epoch (MPI_Win_lock_all) for the object's life; every
 * rank lays it out the same way, sized by the fullest rank's experts:
 *
 *   SIGNALS   4 int64: dispatch arrivals, combine arrivals (put), and this
 *             rank's own dispatch-ready and combine-ready marks (get)
 *   TABLE_IN  (G, EL, 2) int32: per source, per local expert, the count of
 *             its rows and where they start in the source's staging
 *   TABLE_OUT (E, 2) int32: the same as this rank sends them, per expert
 *   SEND      (N k) staged rows as the wire carries them, grouped by
 *             expert, then (N k, 3) int32 meta (local token, slot, weight)
 *   RECV      (EL, G, N) rows, then their meta: the receive buffers
 *   OUT       (EL, G, N) expert outputs as the combine wire carries them
 *   BACK      (N k) outputs come home, in this rank's staging order
 *
 * --rma put (push): a source puts each expert's block, its meta and its
 * counts into the owner's RECV and TABLE_IN, flushes, then adds 1 to the
 * owner's dispatch-arrivals counter (MPI_Accumulate, MPI_SUM); an owner
 * waits for G arrivals per forward (the counter only grows: G at the
 * first forward, 2G at the second, ...), reading it with MPI_Fetch_and_op
 * (MPI_NO_OP). The combine is the same, owner to home: each (expert,
 * source) block of outputs lands where the source staged its rows.
 * --rma get (pull): a source stages its rows and table in its own window
 * and marks itself ready (MPI_Fetch_and_op, MPI_REPLACE, with the forward's
 * number); an owner polls the sources' marks and, from each one that is
 * ready, reads the table entries of its experts, then their rows, into its
 * RECV. The combine: owners mark their outputs ready, homes read them.
 *
 * Between posting the dispatch and completing its receive, the shared
 * experts compute (DeepEP's receive hook: the rows arrive while other work
 * runs); their outputs are added after the routed sum, as on the normal
 * path. Under the link model (--link) each stage completes at its modelled
 * time: one latency and the bytes over the link for a push, two latencies
 * (the ready mark, then the rows) for a pull.
 *
 * A slot is not overwritten before it is read: a source starts its next
 * forward only when its combine is complete, which needs every owner to
 * have finished its experts (and so its reads of this forward's rows), and
 * an owner writes its next outputs only after every source's next dispatch.
 *
 * The experts then read their rows from the layout tensor (masked, by
 * default, or contiguous: layout.h): per local expert the rows of source
 * 0, then source 1, ..., each in token order, that is in global token
 * order, as the normal path gives them, decoded from the wire; the home
 * rank reduces a token's outputs in slot order. With packed or exact GEMMs
 * the output is bitwise that of the normal path with --combine pairs, in
 * every layout.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "moe/ep.h"
#include "moe/gemm.h"
#include "moe/quant.h"
#include "moe/watchdog.h"
#include "ep_stages.h"

enum { SIG_DISPATCH, SIG_COMBINE, SIG_DISPATCH_READY, SIG_COMBINE_READY, SIGNALS };
enum { LL_META_WORDS = MOE_LL_META_WORDS };

struct moe_ll_state {
    MPI_Win win;
    uint8_t *base;
    int64_t forwards;      /* forwards run: the arrivals and marks expected */
    int G, EL, E, k;
    moe_index N;
    size_t row, out;       /* bytes of a dispatched row and of an output */
    MPI_Aint signals, table_in, table_out, send, send_meta, recv, recv_meta, out_at, back, size;
    MPI_Datatype row_type, out_type, meta_type;
};

/* Regions start on 64-byte lines: MPICH 4.0.2 (ch4:ucx) delivered wrong
 * bytes into regions that began 8 bytes off a 16-byte boundary (odd E: the
 * table before them 8E bytes long); on lines every case passes. */
static MPI_Aint align_line(MPI_Aint n) { return (n + 63) / 64 * 64; }

static struct moe_ll_state *ll_open(const moe_ep *ep, moe_status *st)
{
    struct moe_ep_workspace *work = ep->work;
    if (work->ll)
        return work->ll;
    const moe_config *cfg = ep->cfg;
    struct moe_ll_state *s = moe_xcalloc(1, sizeof *s);
    const moe_wire dw = moe_wire_dispatch(cfg), cw = moe_wire_combine(cfg);
    s->G = ep->comm.ranks;
    s->E = ep->placement.experts; /* physical */
    s->k = (int)cfg->topk;
    s->EL = (s->E + s->G - 1) / s->G; /* the fullest rank's (layout.h) */
    s->N = moe_config_max_tokens(cfg);
    s->row = dw.bytes;
    s->out = cw.bytes;
    const MPI_Aint slots = (MPI_Aint)s->EL * s->G * s->N, staged = (MPI_Aint)s->N * s->k;
    const MPI_Aint meta = 4 * LL_META_WORDS;
    MPI_Aint at = 0;
    s->signals = at, at += 8 * SIGNALS;
    s->table_in = at, at = align_line(at + 8 * (MPI_Aint)s->G * s->EL);
    s->table_out = at, at = align_line(at + 8 * (MPI_Aint)s->E);
    s->send = at, at = align_line(at + staged * (MPI_Aint)s->row);
    s->send_meta = at, at = align_line(at + staged * meta);
    s->recv = at, at = align_line(at + slots * (MPI_Aint)s->row);
    s->recv_meta = at, at = align_line(at + slots * meta);
    s->out_at = at, at = align_line(at + slots * (MPI_Aint)s->out);
    s->back = at, at = align_line(at + staged * (MPI_Aint)s->out);
    s->size = at;
    /* A library without one-sided support for this communicator (Open MPI's
     * osc pt2pt wants MPI_THREAD_MULTIPLE) refuses the window: one message. */
    moe_status local = {0};
    const int made = MPI_Win_allocate(s->size, 1, MPI_INFO_NULL, ep->comm.comm, &s->base, &s->win);
    int *model = NULL, found = 0;
    if (made == MPI_SUCCESS)
        MOE_MPI(MPI_Win_get_attr(s->win, MPI_WIN_MODEL, &model, &found));
    struct rlimit limit;
    const bool limited = getrlimit(RLIMIT_AS, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY;
    int error_class = MPI_SUCCESS;
    if (made != MPI_SUCCESS)
        MPI_Error_class(made, &error_class);
    /* a shared-memory window maps every local rank's part into each process */
    void *probe = made != MPI_SUCCESS && limited
                      ? malloc((size_t)s->size * (size_t)ep->comm.ranks_on_host) : NULL;
    const bool no_room = made != MPI_SUCCESS && limited && !probe; /* the limit, not MPI, refused it */
    free(probe);
    if (made != MPI_SUCCESS && (no_room || error_class == MPI_ERR_NO_MEM)) {
        char size[32], cap[32] = "";
        if (limited)
            moe_format_bytes((double)limit.rlim_cur, cap, sizeof cap);
        moe_fail(&local, MOE_EXIT_RUNTIME,
                 "--mode low-latency: its one-sided window, %s per rank, could not be allocated%s%s%s; "
                 "raise the limit, or lower --max-tokens-per-rank, --tokens or --hidden",
                 moe_format_bytes((double)s->size, size, sizeof size),
                 limited ? " under an address-space limit (ulimit -v) of " : " (out of memory)", cap,
                 limited ? " per process" : "");
    } else if (made != MPI_SUCCESS || !found || *model != MPI_WIN_UNIFIED) {
        char why[MPI_MAX_ERROR_STRING] = "the window's memory model is not MPI_WIN_UNIFIED";
        int len = 0;
        if (made != MPI_SUCCESS)
            MPI_Error_string(made, why, &len);
        moe_fail(&local, MOE_EXIT_USAGE,
                 "--mode low-latency needs one-sided MPI (MPI_Win_allocate, unified memory "
                 "model), which this MPI library does not give here (%s); use --mode normal", why);
    }
    if (moe_comm_agree(&ep->comm, &local)) {
        *st = local;
        if (made == MPI_SUCCESS)
            MOE_MPI(MPI_Win_free(&s->win));
        free(s);
        return NULL;
    }
    memset(s->base, 0, (size_t)s->size);
    MOE_MPI(MPI_Type_contiguous((int)s->row, MPI_BYTE, &s->row_type));
    MOE_MPI(MPI_Type_contiguous((int)s->out, MPI_BYTE, &s->out_type));
    MOE_MPI(MPI_Type_contiguous(LL_META_WORDS, MPI_INT32_T, &s->meta_type));
    MOE_MPI(MPI_Type_commit(&s->row_type));
    MOE_MPI(MPI_Type_commit(&s->out_type));
    MOE_MPI(MPI_Type_commit(&s->meta_type));
    MOE_MPI(MPI_Barrier(ep->comm.comm)); /* every window zeroed before anyone writes */
    MOE_MPI(MPI_Win_lock_all(MPI_MODE_NOCHECK, s->win));
    work->ll = s;
    return s;
}

void moe_ep_ll_close(struct moe_ep_workspace *work)
{
    struct moe_ll_state *s = work->ll;
    if (!s)
        return;
    MOE_MPI(MPI_Win_unlock_all(s->win));
    MOE_MPI(MPI_Win_free(&s->win));
    MOE_MPI(MPI_Type_free(&s->row_type));
    MOE_MPI(MPI_Type_free(&s->out_type));
    MOE_MPI(MPI_Type_free(&s->meta_type));
    free(s);
    work->ll = NULL;
}

static int32_t *table_in(const struct moe_ll_state *s, int src, int l)
{
    return (int32_t *)(s->base + s->table_in) + ((MPI_Aint)src * s->EL + l) * 2;
}

static int32_t *table_out(const struct moe_ll_state *s, int e)
{
    return (int32_t *)(s->base + s->table_out) + (MPI_Aint)e * 2;
}

/* Displacement of slot (l, src, i) of RECV (row, or meta) and OUT. */
static MPI_Aint slot(const struct moe_ll_state *s, int l, int src, moe_index i)
{
    return ((MPI_Aint)l * s->G + src) * s->N + i;
}

/* The counter `which` of `rank` as it is now (an atomic read). */
static int64_t read_signal(const struct moe_ll_state *s, int rank, int which)
{
    int64_t v = 0;
    MOE_MPI(MPI_Fetch_and_op(NULL, &v, MPI_INT64_T, rank, s->signals + 8 * which, MPI_NO_OP, s->win));
    MOE_MPI(MPI_Win_flush(rank, s->win));
    return v;
}

/* The stage a wait for signal `which` belongs to (the watchdog's board). */
static enum moe_watch_place signal_place(int which)
{
    return which == SIG_DISPATCH || which == SIG_DISPATCH_READY ? MOE_WATCH_DISPATCH : MOE_WATCH_COMBINE;
}

/* Until this rank's counter `which` reaches `want`; then its window's
 * public copy is what this rank reads. */
static void wait_signal(const struct moe_ll_state *s, int me, int which, int64_t want)
{
    moe_watch_wait(signal_place(which), -1);
    while (read_signal(s, me, which) < want)
        ;
    moe_watch_done();
    MOE_MPI(MPI_Win_sync(s->win));
}

/* Add 1 to counter `which` of every rank, after this rank's puts. */
static void signal_all(const struct moe_ll_state *s, int which)
{
    static const int64_t one = 1;
    MOE_MPI(MPI_Win_flush_all(s->win));
    for (int r = 0; r < s->G; r++)
        MOE_MPI(MPI_Accumulate(&one, 1, MPI_INT64_T, r, s->signals + 8 * which, 1, MPI_INT64_T,
                               MPI_SUM, s->win));
    MOE_MPI(MPI_Win_flush_all(s->win));
}

/* This rank's own mark `which` = the forward's number (what it staged is
 * in its window's public copy first). */
static void mark_ready(const struct moe_ll_state *s, int me, int which)
{
    int64_t old;
    MOE_MPI(MPI_Win_sync(s->win));
    MOE_MPI(MPI_Fetch_and_op(&s->forwards, &old, MPI_INT64_T, me, s->signals + 8 * which,
                             MPI_REPLACE, s->win));
    MOE_MPI(MPI_Win_flush(me, s->win));
}

/* Stages plan and pack: the pairs grouped by expert, each expert's in token
 * order (pos: each pair's place, -1 for a dropped one), encoded into SEND
 * with their meta; TABLE_OUT says where each expert's block starts and its
 * length. Returns the pairs packed. */
static moe_index ll_pack(const moe_ep *ep, struct moe_ll_state *s, const float *x,
                         const int32_t *ids, const float *weights, moe_index *pos)
{
    const moe_index T = ep->cfg->tokens, pairs = T * s->k;
    moe_index *start = moe_xcalloc((size_t)s->E + 1, sizeof(moe_index));
    moe_index *token = moe_xmalloc(sizeof(moe_index) * (size_t)pairs + 1);
    for (moe_index n = 0; n < pairs; n++)
        if (ids[n] != MOE_DROPPED)
            start[ids[n] + 1]++;
    for (int e = 0; e < s->E; e++) {
        *table_out(s, e) = (int32_t)start[e + 1];
        start[e + 1] += start[e];
        table_out(s, e)[1] = (int32_t)start[e];
    }
    int32_t *meta = (int32_t *)(s->base + s->send_meta);
    for (moe_index n = 0; n < pairs; n++) {
        pos[n] = -1;
        if (ids[n] == MOE_DROPPED)
            continue;
        const moe_index p = start[ids[n]]++;
        pos[n] = p;
        token[p] = n / s->k;
        meta[p * LL_META_WORDS] = (int32_t)(n / s->k);
        meta[p * LL_META_WORDS + 1] = (int32_t)(n % s->k);
        memcpy(&meta[p * LL_META_WORDS + 2], &weights[n], sizeof(float));
    }
    /* Each token encoded once, its bytes copied to each of its pairs. */
    const moe_wire dw = moe_wire_dispatch(ep->cfg);
    uint8_t *encoded = moe_xmalloc(dw.bytes * (size_t)T + 1);
    moe_wire_encode(&dw, x, NULL, T, encoded);
    const moe_index sent = s->E > 0 ? start[s->E - 1] : 0; /* the pairs not dropped */
    for (moe_index p = 0; p < sent; p++)
        memcpy(s->base + s->send + (MPI_Aint)p * (MPI_Aint)s->row,
               encoded + (size_t)token[p] * dw.bytes, dw.bytes);
    free(encoded);
    free(token);
    free(start);
    return sent;
}

/* Stage dispatch, push: every expert's block, its meta and this rank's
 * counts into the owners' windows; then the arrivals. */
static void ll_dispatch_put(const moe_ep *ep, struct moe_ll_state *s)
{
    const int me = ep->comm.rank;
    const moe_placement *p = &ep->placement;
    for (int r = 0; r < s->G; r++) {
        const int first = p->first_expert[r], EL = moe_placement_local_experts(p, r);
        for (int l = 0; l < EL; l++) {
            const int32_t count = table_out(s, first + l)[0], at = table_out(s, first + l)[1];
            if (count == 0)
                continue;
            MOE_MPI(MPI_Put(s->base + s->send + (MPI_Aint)at * (MPI_Aint)s->row, count,
                            s->row_type, r, s->recv + slot(s, l, me, 0) * (MPI_Aint)s->row, count,
                            s->row_type, s->win));
            MOE_MPI(MPI_Put(s->base + s->send_meta + (MPI_Aint)at * 4 * LL_META_WORDS, count,
                            s->meta_type, r, s->recv_meta + slot(s, l, me, 0) * 4 * LL_META_WORDS,
                            count, s->meta_type, s->win));
            moe_comm_count_rma(count, s->row_type, r, me);
            moe_comm_count_rma(count, s->meta_type, r, me);
        }
        if (EL > 0)
            MOE_MPI(MPI_Put(table_out(s, first), 2 * EL, MPI_INT32_T, r,
                            s->table_in + ((MPI_Aint)me * s->EL) * 8, 2 * EL, MPI_INT32_T, s->win));
    }
    signal_all(s, SIG_DISPATCH);
}

/* For every rank in turn once its mark `which` reaches this forward, pull
 * (its table entries, then its blocks, get_fn of it); then the reads are
 * complete and in this rank's window. */
typedef void pull_fn(const moe_ep *ep, struct moe_ll_state *s, int peer);

static void pull_when_ready(const moe_ep *ep, struct moe_ll_state *s, int which, pull_fn *pull)
{
    bool *done = moe_xcalloc((size_t)s->G, sizeof(bool));
    moe_watch_wait(signal_place(which), -1);
    for (int left = s->G; left > 0;)
        for (int peer = 0; peer < s->G; peer++) {
            if (done[peer] || read_signal(s, peer, which) < s->forwards)
                continue;
            pull(ep, s, peer);
            done[peer] = true;
            left--;
        }
    moe_watch_done();
    MOE_MPI(MPI_Win_flush_all(s->win));
    MOE_MPI(MPI_Win_sync(s->win));
    free(done);
}

/* Stage dispatch, pull, from source src (ready): the table entries of this
 * rank's experts, then their rows and meta into RECV. */
static void dispatch_get_from(const moe_ep *ep, struct moe_ll_state *s, int src)
{
    const int me = ep->comm.rank, first = ep->placement.first_expert[me];
    const int EL = ep->local_experts;
    MOE_MPI(MPI_Get(table_in(s, src, 0), 2 * EL, MPI_INT32_T, src,
                    s->table_out + (MPI_Aint)first * 8, 2 * EL, MPI_INT32_T, s->win));
    MOE_MPI(MPI_Win_flush(src, s->win));
    for (int l = 0; l < EL; l++) {
        const int32_t count = table_in(s, src, l)[0], at = table_in(s, src, l)[1];
        if (count == 0)
            continue;
        MOE_MPI(MPI_Get(s->base + s->recv + slot(s, l, src, 0) * (MPI_Aint)s->row, count,
                        s->row_type, src, s->send + (MPI_Aint)at * (MPI_Aint)s->row, count,
                        s->row_type, s->win));
        MOE_MPI(MPI_Get(s->base + s->recv_meta + slot(s, l, src, 0) * 4 * LL_META_WORDS, count,
                        s->meta_type, src, s->send_meta + (MPI_Aint)at * 4 * LL_META_WORDS,
                        count, s->meta_type, s->win));
        moe_comm_count_rma(count, s->row_type, src, me);
        moe_comm_count_rma(count, s->meta_type, src, me);
    }
}

/* Stage dispatch, pull (this rank's staging marked ready before): from
 * each source as it becomes ready. A rank without experts reads nothing. */
static void ll_dispatch_get(const moe_ep *ep, struct moe_ll_state *s)
{
    if (ep->local_experts > 0)
        pull_when_ready(ep, s, SIG_DISPATCH_READY, dispatch_get_from);
}

/* Stage experts: per local expert, its rows decoded from RECV into its
 * block of the layout tensor (--expert-layout: masked, or contiguous;
 * source by source, each in token order: global token order), the SwiGLU
 * FFN, the outputs rounded and encoded into OUT at their slots. Returns
 * the pairs computed; *slots: the rows of the layout tensor. */
static moe_index ll_experts(const moe_ep *ep, struct moe_ll_state *s, moe_index *slots)
{
    const moe_config *cfg = ep->cfg;
    const moe_index d = cfg->hidden, f = cfg->ffn;
    const int EL = ep->local_experts;
    const moe_wire dw = moe_wire_dispatch(cfg), cw = moe_wire_combine(cfg);
    moe_index *offset = moe_xcalloc((size_t)EL + 1, sizeof(moe_index)), most = 0;
    for (int l = 0; l < EL; l++) {
        moe_index n = 0;
        for (int src = 0; src < s->G; src++)
            n += table_in(s, src, l)[0];
        most = n > most ? n : most;
        offset[l + 1] = offset[l] + n;
    }
    moe_expert_slots layout;
    moe_expert_slots_build(&layout, moe_config_layout(cfg), EL, offset, (moe_index)s->G * s->N,
                           cfg->expert_alignment);
    *slots = layout.slots;
    float *tensor = moe_xmalloc(sizeof(float) * (size_t)(layout.slots * d) + 1);
    float *out = moe_xmalloc(sizeof(float) * (size_t)(most * (d + 1)) + 1);
    float *scale = out + most * d;
    float *scratch = moe_xmalloc(sizeof(float) * (size_t)(most * 2 * f) + 1);
    for (int l = 0; l < EL; l++) {
        float *x = tensor + layout.start[l] * d;
        moe_index n = 0;
        for (int src = 0; src < s->G; src++) {
            const moe_index count = table_in(s, src, l)[0];
            if (count == 0)
                continue;
            const int32_t *meta = (const int32_t *)(s->base + s->recv_meta) +
                                  slot(s, l, src, 0) * LL_META_WORDS;
            moe_wire_decode(&dw, s->base + s->recv + slot(s, l, src, 0) * (MPI_Aint)s->row, count,
                            x + n * d);
            for (moe_index i = 0; i < count; i++)
                memcpy(&scale[n + i], &meta[i * LL_META_WORDS + 2], sizeof(float));
            n += count;
        }
        if (n == 0)
            continue;
        const moe_expert_weights w = moe_ep_weights(ep, false, l);
        const bool at_activation = cfg->weight_at == MOE_WEIGHT_AT_ACTIVATION;
        moe_expert_forward(&w, ep->gemm, x, n, d, f, scratch, out, at_activation ? scale : NULL, NULL);
        moe_precision_combine(cfg->combine_dtype, out, n * d);
        n = 0;
        for (int src = 0; src < s->G; src++) {
            const moe_index count = table_in(s, src, l)[0];
            if (count == 0)
                continue;
            moe_wire_encode(&cw, out + n * d, NULL, count,
                            s->base + s->out_at + slot(s, l, src, 0) * (MPI_Aint)s->out);
            n += count;
        }
    }
    const moe_index pairs = offset[EL];
    moe_expert_slots_free(&layout);
    free(scratch);
    free(out);
    free(tensor);
    free(offset);
    return pairs;
}

/* Stage combine, push: each (local expert, source) block of outputs into
 * the source's BACK where it staged those rows; then the arrivals. */
static void ll_combine_put(const moe_ep *ep, struct moe_ll_state *s)
{
    for (int l = 0; l < ep->local_experts; l++)
        for (int src = 0; src < s->G; src++) {
            const int32_t count = table_in(s, src, l)[0], at = table_in(s, src, l)[1];
            if (count == 0)
                continue;
            MOE_MPI(MPI_Put(s->base + s->out_at + slot(s, l, src, 0) * (MPI_Aint)s->out, count,
                            s->out_type, src, s->back + (MPI_Aint)at * (MPI_Aint)s->out, count,
                            s->out_type, s->win));
            moe_comm_count_rma(count, s->out_type, src, ep->comm.rank);
        }
    signal_all(s, SIG_COMBINE);
}

/* Stage combine, pull, from owner r (ready): the outputs of this rank's
 * pairs for r's experts into BACK. */
static void combine_get_from(const moe_ep *ep, struct moe_ll_state *s, int r)
{
    const int me = ep->comm.rank, first = ep->placement.first_expert[r];
    for (int l = 0; l < moe_placement_local_experts(&ep->placement, r); l++) {
        const int32_t count = table_out(s, first + l)[0], at = table_out(s, first + l)[1];
        if (count == 0)
            continue;
        MOE_MPI(MPI_Get(s->base + s->back + (MPI_Aint)at * (MPI_Aint)s->out, count, s->out_type, r,
                        s->out_at + slot(s, l, me, 0) * (MPI_Aint)s->out, count, s->out_type,
                        s->win));
        moe_comm_count_rma(count, s->out_type, r, me);
    }
}

/* Stage combine, pull: this rank's outputs marked ready; from each owner
 * as it becomes ready (every owner, even those holding none of this
 * rank's pairs: their mark says they have read this forward's tables). */
static void ll_combine_get(const moe_ep *ep, struct moe_ll_state *s)
{
    mark_ready(s, ep->comm.rank, SIG_COMBINE_READY);
    pull_when_ready(ep, s, SIG_COMBINE_READY, combine_get_from);
}

/* Under the link model (--link): the rows this rank staged for each owner
 * (to) and the rows each source sent here (from), G each; the dispatch
 * moves them out and in, the combine the other way round. */
static void ll_rows_per_peer(const moe_ep *ep, const struct moe_ll_state *s, moe_index *to,
                             moe_index *from)
{
    const moe_placement *p = &ep->placement;
    for (int r = 0; r < s->G; r++) {
        for (int l = 0; l < moe_placement_local_experts(p, r); l++)
            to[r] += table_out(s, p->first_expert[r] + l)[0];
        for (int l = 0; l < ep->local_experts; l++)
            from[r] += table_in(s, r, l)[0];
    }
}

/* One forward's state on this rank, stage to stage. */
typedef struct {
    struct moe_ll_state *s;
    moe_index *pos;     /* (T k) each pair's row in the staging buffer, -1: dropped */
    moe_index sent;     /* rows this rank sends (one per kept pair) */
    moe_index computed; /* pairs this rank's experts computed */
    double posted;      /* when the dispatch was posted (clock.h) */
    float *shared;      /* (S, T, d) the shared experts' outputs, added after the routed sum */
    moe_link_state links;
    moe_index *to, *from; /* --link: rows to and from each rank */
} ll_forward;

/* plan + pack: each kept pair a row of its own, in its owner's slot. */
static void ll_plan(const moe_ep *ep, ll_forward *f, const float *x, const int32_t *ids,
                    const float *weights, moe_forward_stats *stats)
{
    const double t = moe_stage_begin();
    f->pos = moe_xmalloc(sizeof(moe_index) * (size_t)(ep->cfg->tokens * f->s->k) + 1);
    f->sent = ll_pack(ep, f->s, x, ids, weights, f->pos);
    moe_stage_end(&stats->seconds[MOE_STAGE_PLAN], t);
}

/* dispatch, posted: put, the rows and the arrivals on their way; get, the
 * staging marked ready for the owners to read. */
static void ll_dispatch_post(const moe_ep *ep, ll_forward *f, moe_forward_stats *stats)
{
    f->posted = moe_stage_begin();
    if (ep->cfg->rma == MOE_RMA_PUT)
        ll_dispatch_put(ep, f->s);
    else
        mark_ready(f->s, ep->comm.rank, SIG_DISPATCH_READY);
    moe_stage_end(&stats->seconds[MOE_STAGE_DISPATCH], f->posted);
}

/* shared: the shared experts compute before the dispatch's receive
 * completes, their outputs kept apart. */
static void ll_shared(const moe_ep *ep, ll_forward *f, const float *x, moe_forward_stats *stats)
{
    const moe_config *cfg = ep->cfg;
    const moe_index values = cfg->shared_experts * cfg->tokens * cfg->hidden;
    f->shared = moe_xmalloc(sizeof(float) * (size_t)values + 1);
    float *scratch = moe_xmalloc(sizeof(float) * (size_t)(MOE_SHARED_ROW_BLOCK * 2 * cfg->ffn));
    moe_ep_shared(ep, x, NULL, scratch, f->shared, stats);
    free(scratch);
}

/* dispatch, received: every source's rows here (put: its counter; get:
 * pulled). --link: the rows arrive at their modelled time, one round after
 * the post (put: the counter follows the rows in order), two for a pull
 * (the ready mark, then the rows); the shared experts ran meanwhile. */
static void ll_dispatch_wait(const moe_ep *ep, ll_forward *f, moe_forward_stats *stats)
{
    const double t = moe_stage_begin();
    const bool put = ep->cfg->rma == MOE_RMA_PUT;
    if (put)
        wait_signal(f->s, ep->comm.rank, SIG_DISPATCH, f->s->forwards * f->s->G);
    else
        ll_dispatch_get(ep, f->s);
    if (ep->link.enabled) {
        double bytes[2][MOE_TIERS] = {{0}};
        f->to = moe_xcalloc((size_t)f->s->G, sizeof(moe_index));
        f->from = moe_xcalloc((size_t)f->s->G, sizeof(moe_index));
        ll_rows_per_peer(ep, f->s, f->to, f->from);
        moe_pipeline_link_bytes(ep, f->from, f->to, moe_ll_row_bytes(ep->cfg), bytes);
        moe_pipeline_hold(&ep->link, &f->links, f->posted, bytes, put ? 1 : 2, ep->comm.comm);
    }
    moe_stage_end(&stats->seconds[MOE_STAGE_DISPATCH], t);
}

/* experts: each local expert on its slots, in the layout --expert-layout asks. */
static void ll_compute(const moe_ep *ep, ll_forward *f, moe_forward_stats *stats)
{
    stats->expert_start = moe_stage_begin();
    moe_gemm_reset_flops();
    f->computed = ll_experts(ep, f->s, &stats->layout_slots);
    stats->expert_flops = moe_gemm_sflops();
    stats->expert_end = moe_stage_end(&stats->seconds[MOE_STAGE_EXPERTS], stats->expert_start);
}

/* combine: each output back to its pair's home slot (put, then wait for
 * every owner's counter; or pulled), under the link model as the dispatch. */
static void ll_combine(const moe_ep *ep, ll_forward *f, moe_forward_stats *stats)
{
    const double t = moe_stage_begin();
    const bool put = ep->cfg->rma == MOE_RMA_PUT;
    if (put) {
        ll_combine_put(ep, f->s);
        wait_signal(f->s, ep->comm.rank, SIG_COMBINE, f->s->forwards * f->s->G);
    } else {
        ll_combine_get(ep, f->s);
    }
    if (ep->link.enabled) {
        double bytes[2][MOE_TIERS] = {{0}};
        moe_pipeline_link_bytes(ep, f->to, f->from, (double)f->s->out, bytes);
        moe_pipeline_hold(&ep->link, &f->links, t, bytes, put ? 1 : 2, ep->comm.comm);
    }
    moe_stage_end(&stats->seconds[MOE_STAGE_COMBINE], t);
}

/* reduce: a token's outputs summed in slot order (as --combine pairs),
 * then its shared experts' added. */
static void ll_reduce(const moe_ep *ep, ll_forward *f, const float *weights, float *y,
                      moe_forward_stats *stats)
{
    const double t = moe_stage_begin();
    const moe_index d = ep->cfg->hidden, pairs = ep->cfg->tokens * f->s->k;
    const moe_wire cw = moe_wire_combine(ep->cfg);
    float *back = moe_xmalloc(sizeof(float) * (size_t)(pairs * d) + 1);
    const float **slot_rows = moe_xmalloc(sizeof(float *) * (size_t)pairs + 1);
    moe_wire_decode(&cw, f->s->base + f->s->back, f->sent, back);
    for (moe_index n = 0; n < pairs; n++)
        slot_rows[n] = f->pos[n] < 0 ? NULL : back + f->pos[n] * d;
    moe_ep_reduce(ep, slot_rows, weights, y);
    moe_ep_shared_add(ep, f->shared, y);
    stats->done = moe_stage_end(&stats->seconds[MOE_STAGE_REDUCE], t);
    free(slot_rows);
    free(back);
}

/* The traffic: every pair a row each way, no deduplication. */
static void ll_traffic(const moe_ep *ep, const ll_forward *f, moe_forward_stats *stats)
{
    moe_index own = 0;
    for (int l = 0; l < ep->local_experts; l++)
        own += table_out(f->s, ep->first_expert + l)[0];
    const double row_bytes = moe_ll_row_bytes(ep->cfg);
    stats->rows_sent = f->sent;
    stats->rows_sent_remote = f->sent - own;
    stats->rows_received = f->computed;
    stats->pairs_received = f->computed;
    stats->pairs_back_remote = f->sent - own;
    stats->bytes_dispatched = (double)f->sent * row_bytes;
    stats->bytes_combined = (double)f->computed * (double)f->s->out;
}

int moe_ep_forward_ll(const moe_ep *ep, const float *x, const int32_t *ids, const float *weights,
                      float *y, moe_forward_stats *stats, moe_status *st)
{
    memset(stats, 0, sizeof *stats);
    ll_forward f = {.s = ll_open(ep, st)};
    if (!f.s)
        return st->code;
    MOE_ASSERT(ep->cfg->tokens <= f.s->N); /* moe_config_validate refuses more */
    f.s->forwards++;
    ll_plan(ep, &f, x, ids, weights, stats);     /* each pair a row, in its owner's slot */
    moe_pipeline_fail_here(&ep->comm, "plan");
    ll_dispatch_post(ep, &f, stats);             /* put, or marked ready to be pulled */
    ll_shared(ep, &f, x, stats);                 /* the shared experts while the rows travel */
    ll_dispatch_wait(ep, &f, stats);             /* every source's rows here */
    moe_pipeline_fail_here(&ep->comm, "dispatch");
    ll_compute(ep, &f, stats);                   /* the local experts on their slots */
    moe_pipeline_fail_here(&ep->comm, "experts");
    ll_combine(ep, &f, stats);                   /* each output to its pair's home slot */
    moe_pipeline_fail_here(&ep->comm, "combine");
    ll_reduce(ep, &f, weights, y, stats);        /* slot order, then the shared experts */
    ll_traffic(ep, &f, stats);
    free(f.from);
    free(f.to);
    free(f.shared);
    free(f.pos);
    return MOE_EXIT_OK;
}
