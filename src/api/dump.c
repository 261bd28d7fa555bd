/* SPDX-License-Identifier: MIT */
/* dump.c — the golden set of a forward (dump.h): `moe-ep run --dump DIR`
 * and the library's moe_ep_context_dump.
 *
 * The tokens are routed again and one more forward on the blocking
 * reference path captures what each rank received and sent back; the truth
 * is the fixed-order one (MOE_TRUTH_EXACT). BLAS is forbidden throughout, so
 * no bit of the set depends on the CPU, the BLAS kernel or the threads. Rank 0
 * gathers the routing and the output, and writes the set (src/io/golden.c),
 * pulling each rank's received rows, expert outputs and layout tensor from
 * it as the file reaches them: never more than one rank's. Inputs and weights
 * are not gathered: rank 0 regenerates them from the seed (they are a pure
 * function of it, docs/data.md). Collective.
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/capacity.h"
#include "moe/check.h"
#include "moe/dump.h"
#include "moe/ep.h"
#include "moe/gemm.h"
#include "moe/golden.h"
#include "moe/path.h"
#include "moe/quant.h"
#include "moe/rng.h"
#include "moe/truth.h"
#include "moe/wire.h"

typedef struct {
    uint64_t seed;
    moe_index d, f;
    int dtype;
    bool pow2;           /* --fp8-scale ue8m0 (for --dtype fp8) */
    bool shared, second; /* shared experts; W2 rather than W1 */
    int part;            /* enum weight_part */
} weight_source;

/* What a weight tensor holds: the values (rounded to --dtype), or with
 * --dtype fp8 their E4M3 bytes or their blocks' scales. */
enum weight_part { WEIGHT_VALUES, WEIGHT_BYTES, WEIGHT_SCALES };

/* One expert's W1 (2f, d) or W2 (d, f), regenerated and rounded to
 * --dtype, as the source's part says. */
static void fill_weight(const void *ctx, int64_t expert, void *out)
{
    const weight_source *w = ctx;
    const moe_index d = w->d, f = w->f, fb = moe_fp8_blocks(f), db = moe_fp8_blocks(d);
    float *w1 = moe_xmalloc(sizeof(float) * (size_t)(2 * f * d));
    float *w2 = moe_xmalloc(sizeof(float) * (size_t)(d * f));
    uint8_t *q = w->part == WEIGHT_BYTES ? moe_xmalloc((size_t)(2 * f * d)) : NULL;
    float *s = w->part == WEIGHT_SCALES ? moe_xmalloc(sizeof(float) * (size_t)(2 * fb * db)) : NULL;
    if (w->shared)
        moe_shared_expert_generate(w->seed, (int)expert, d, f, w1, w2);
    else
        moe_expert_generate(w->seed, (int)expert, d, f, w1, w2);
    if (w->part == WEIGHT_VALUES)
        moe_precision_expert(w->dtype, w->pow2, w1, w2, d, f);
    else if (w->second)
        moe_fp8_expert_blocks(w1, w2, d, f, w->pow2, NULL, NULL, q, s);
    else
        moe_fp8_expert_blocks(w1, w2, d, f, w->pow2, q, s, NULL, NULL);
    const moe_index n = w->second ? d * f : 2 * f * d;
    if (q)
        memcpy(out, q, (size_t)n);
    else if (s)
        memcpy(out, s, sizeof(float) * (size_t)(w->second ? db * fb : 2 * fb * db));
    else
        memcpy(out, w->second ? w2 : w1, sizeof(float) * (size_t)n);
    free(s);
    free(q);
    free(w2);
    free(w1);
}

static double rms_f32(const float *v, int64_t n)
{
    double sum = 0.0;
    for (int64_t m = 0; m < n; m++)
        sum += (double)v[m] * v[m];
    return n ? sqrt(sum / (double)n) : 0.0;
}

typedef struct {
    moe_golden_tensor *items;
    int count, capacity;
    int64_t d, experts, topk, ffn; /* the sizes of the tolerances' fp32 chains */
} tensor_list;

/* A tensor of `kind` (golden.h's table: its stage, dtype and rule) named
 * `name`, with a tolerance kind's chain applied: rel = u times its chain,
 * abs = rel times the tensor's rms. */
static moe_golden_tensor *add_named(tensor_list *l, enum moe_golden_kind kind, const char *name,
                                    const void *data, int ndim, int64_t d0, int64_t d1, int64_t d2)
{
    const moe_golden_kind_spec *spec = &moe_golden_kinds[kind];
    if (l->count == l->capacity) {
        l->capacity = l->capacity ? 2 * l->capacity : 32;
        l->items = realloc(l->items, sizeof *l->items * (size_t)l->capacity);
        MOE_ASSERT(l->items != NULL);
    }
    moe_golden_tensor *g = &l->items[l->count++];
    memset(g, 0, sizeof *g);
    snprintf(g->tensor.name, sizeof g->tensor.name, "%s", name);
    g->tensor.dtype = spec->dtype;
    g->tensor.ndim = ndim;
    const int64_t dims[3] = {d0, d1, d2};
    for (int i = 0; i < ndim; i++)
        g->tensor.shape[i] = dims[i];
    g->tensor.data = data;
    g->stage = spec->stage;
    g->rule = spec->rule;
    if (spec->chain == MOE_CHAIN_FP32) { /* a streamed tensor's abs is set by its caller */
        g->rel = moe_golden_chain_rel(spec, l->d, l->experts, l->topk, l->ffn);
        g->abs = data ? g->rel * rms_f32(data, moe_st_elements(ndim, g->tensor.shape)) : 0.0;
    }
    return g;
}

/* A tensor of `kind` as the table names it, for rank `rank` where the name
 * has one. */
static moe_golden_tensor *add(tensor_list *l, enum moe_golden_kind kind, int rank, const void *data,
                              int ndim, int64_t d0, int64_t d1, int64_t d2)
{
    char name[MOE_ST_NAME_MAX];
    snprintf(name, sizeof name, moe_golden_kinds[kind].name, rank);
    return add_named(l, kind, name, data, ndim, d0, d1, d2);
}

/* The config as a JSON object of strings; where the set was written is not
 * part of what it is, so --dump is left out. */
static void emit_config(void *ctx, const char *name, const char *value)
{
    if (strcmp(name, "dump"))
        json_object_set_new(ctx, name, json_string(value)); /* validated as UTF-8 (config.c) */
}

/* The layout tensors of a set, from all ranks' ids (N, k) and the placement. */
typedef struct {
    int nodes;
    uint8_t *in_rank;     /* (N, G) does token i go to rank r */
    int32_t *per_rank;    /* (G) tokens each rank receives */
    int32_t *send_counts; /* (G, G) tokens source rank r sends to rank q */
    int32_t *per_expert;  /* (E) (token, expert) pairs per expert */
    int32_t *per_node;    /* (nodes) tokens reaching each virtual node */
} layout_counts;

static void count_layout(const moe_ep *ep, const int32_t *ids, int64_t N, moe_index T,
                         layout_counts *lc)
{
    const int G = ep->comm.ranks, E = (int)ep->cfg->experts, k = (int)ep->cfg->topk;
    const int R = ep->link.ranks_per_node;
    lc->nodes = (G + R - 1) / R;
    lc->in_rank = moe_xcalloc((size_t)(N * G), 1);
    lc->per_rank = moe_xcalloc((size_t)G, sizeof(int32_t));
    lc->send_counts = moe_xcalloc((size_t)(G * G), sizeof(int32_t));
    lc->per_expert = moe_xcalloc((size_t)E, sizeof(int32_t));
    lc->per_node = moe_xcalloc((size_t)lc->nodes, sizeof(int32_t));
    uint8_t *node_seen = moe_xmalloc((size_t)lc->nodes);
    for (int64_t i = 0; i < N; i++) {
        memset(node_seen, 0, (size_t)lc->nodes);
        for (int s = 0; s < k; s++) {
            const int e = ids[i * k + s]; /* a physical expert: a copy with --redundant-experts */
            if (e == MOE_DROPPED) /* --capacity-factor: neither sent nor computed */
                continue;
            const int r = ep->placement.expert_rank[e];
            lc->per_expert[ep->replicas.phy2log ? ep->replicas.phy2log[e] : e]++;
            lc->in_rank[i * G + r] = 1;
            node_seen[r / R] = 1;
        }
        for (int r = 0; r < G; r++) {
            lc->per_rank[r] += lc->in_rank[i * G + r];
            lc->send_counts[i / T * G + r] += lc->in_rank[i * G + r];
        }
        for (int n = 0; n < lc->nodes; n++)
            lc->per_node[n] += node_seen[n];
    }
    free(node_seen);
}

static void layout_counts_free(layout_counts *lc)
{
    free(lc->per_node);
    free(lc->per_expert);
    free(lc->send_counts);
    free(lc->per_rank);
    free(lc->in_rank);
}

/* --dump --backward: this rank's share of the backward stages, then what
 * rank 0 gathers of them. */
typedef struct {
    moe_ep_bwd_capture cap; /* this rank's received dy rows, dx and dL/dweight per pair */
    moe_ep_grads g;         /* this rank's gradients */
    double *dx_truth;       /* (T, d) */
    double *dw1_truth, *dw2_truth;             /* (EL, 2f, d), (EL, d, f) */
    double *dgate_truth;                       /* (E, d) over every rank's tokens */
    double *dshared_w1_truth, *dshared_w2_truth; /* (S, ...) likewise */
    double most_rows;       /* the most rows one expert's wgrad sums */
    /* rank 0: gathered, rank order (per-rank ones) or token and expert order */
    void *dy, *dx, *dweight, *sums; /* per rank, concatenated */
    size_t *sizes[4];
    float *all_dx, *all_dw1, *all_dw2;
    double *all_dx_truth, *all_dw1_truth, *all_dw2_truth;
    const float *dy_rank; /* (T, d) this rank's dy (not owned) */
    float *grad_output;   /* (N, d) every rank's, on rank 0 */
} backward_share;

static void backward_share_free(backward_share *b)
{
    moe_ep_bwd_capture_free(&b->cap);
    if (b->g.dx)
        moe_ep_grads_free(&b->g);
    void *owned[] = {b->dx_truth, b->dw1_truth, b->dw2_truth, b->dgate_truth, b->dshared_w1_truth,
                     b->dshared_w2_truth, b->dy, b->dx, b->dweight, b->sums, b->all_dx, b->all_dw1,
                     b->all_dw2, b->all_dx_truth, b->all_dw1_truth, b->all_dw2_truth,
                     b->grad_output, b->sizes[0], b->sizes[1], b->sizes[2], b->sizes[3]};
    for (size_t n = 0; n < sizeof owned / sizeof owned[0]; n++)
        free(owned[n]);
    memset(b, 0, sizeof *b);
}

/* A blocking training step with both captures, and the fixed-order truth
 * of every gradient (truth.h). Collective. */
static int backward_step(const moe_comm *c, const moe_ep *ep, const float *x, const float *dy,
                         const int32_t *ids, const float *weights, const float *logits, float *y,
                         moe_ep_capture *cap, backward_share *b, moe_status *st)
{
    const moe_config *cfg = ep->cfg;
    const moe_index T = cfg->tokens, d = cfg->hidden, f = cfg->ffn, E = cfg->experts;
    const moe_index S = cfg->shared_experts, EL = ep->local_experts, N = (moe_index)c->ranks * T;
    const int k = (int)cfg->topk;
    moe_ep_grads_init(ep, &b->g);
    const int rc = moe_ep_backward_capture(ep, x, logits, ids, weights, dy, y, &b->g, cap, &b->cap, st);
    if (rc)
        return rc;
    b->dx_truth = moe_xmalloc(sizeof(double) * (size_t)(T * d));
    b->dgate_truth = moe_xmalloc(sizeof(double) * (size_t)(E * d));
    b->dshared_w1_truth = moe_xmalloc(sizeof(double) * (size_t)(S * 2 * f * d) + 1);
    b->dshared_w2_truth = moe_xmalloc(sizeof(double) * (size_t)(S * d * f) + 1);
    moe_truth_backward_tokens(cfg, &ep->router, MOE_TRUTH_EXACT, ep->gate, x, ids, weights, logits,
                              dy, T, b->dx_truth, b->dgate_truth, b->dshared_w1_truth,
                              b->dshared_w2_truth);
    moe_comm_sum_ordered(c, b->dgate_truth, E * d);
    moe_comm_sum_ordered(c, b->dshared_w1_truth, S * 2 * f * d);
    moe_comm_sum_ordered(c, b->dshared_w2_truth, S * d * f);
    moe_layer_tokens all;
    moe_gather_layer_tokens(c, cfg, x, dy, ids, weights, &all);
    b->dw1_truth = moe_xmalloc(sizeof(double) * (size_t)(EL * 2 * f * d) + 1);
    b->dw2_truth = moe_xmalloc(sizeof(double) * (size_t)(EL * d * f) + 1);
    for (int l = 0; l < ep->local_experts; l++)
        moe_truth_backward_expert(cfg, MOE_TRUTH_EXACT, ep->first_expert + l, all.x, all.dy,
                                  all.ids, all.weights, N, NULL, NULL, b->dw1_truth + l * 2 * f * d,
                                  b->dw2_truth + l * d * f);
    double rows[E > 0 ? E : 1];
    memset(rows, 0, sizeof rows);
    for (moe_index m = 0; m < N * k; m++)
        if (all.ids[m] != MOE_DROPPED)
            rows[all.ids[m]] += 1.0;
    for (int e = 0; e < (int)E; e++)
        b->most_rows = fmax(b->most_rows, rows[e]);
    moe_layer_tokens_free(&all);
    b->dy_rank = dy;
    return MOE_EXIT_OK;
}

/* Rank 0 gathers every rank's backward share. Collective. */
static int gather_backward(const moe_comm *c, const moe_ep *ep, backward_share *b, moe_status *st)
{
    const moe_config *cfg = ep->cfg;
    const moe_index T = cfg->tokens, d = cfg->hidden, f = cfg->ffn, EL = ep->local_experts;
    const bool root = c->rank == 0;
    const moe_index N = (moe_index)c->ranks * T;
    for (int n = 0; n < 4; n++)
        b->sizes[n] = root ? moe_xcalloc((size_t)c->ranks, sizeof(size_t)) : NULL;
    const moe_ep_bwd_capture *cap = &b->cap;
    int rc = moe_comm_gatherv_bytes(c, cap->dy, sizeof(float) * (size_t)(cap->rows * d), &b->dy, b->sizes[0], st);
    if (!rc)
        rc = moe_comm_gatherv_bytes(c, cap->dx, sizeof(float) * (size_t)(cap->pairs * d), &b->dx, b->sizes[1], st);
    if (!rc)
        rc = moe_comm_gatherv_bytes(c, cap->dweight, sizeof(float) * (size_t)cap->pairs, &b->dweight, b->sizes[2], st);
    if (!rc && cap->sums)
        rc = moe_comm_gatherv_bytes(c, cap->sums, sizeof(float) * (size_t)(cap->rows * d), &b->sums, b->sizes[3], st);
    /* the routed experts' gradients, in expert order: ranks hold consecutive experts */
    void *parts[4] = {NULL, NULL, NULL, NULL};
    const void *mine[4] = {b->g.dw1, b->g.dw2, b->dw1_truth, b->dw2_truth};
    const size_t bytes[4] = {sizeof(float) * (size_t)(EL * 2 * f * d), sizeof(float) * (size_t)(EL * d * f),
                             sizeof(double) * (size_t)(EL * 2 * f * d), sizeof(double) * (size_t)(EL * d * f)};
    size_t *ignored = root ? moe_xcalloc((size_t)c->ranks, sizeof(size_t)) : NULL;
    for (int n = 0; n < 4 && !rc; n++)
        rc = moe_comm_gatherv_bytes(c, mine[n], bytes[n], &parts[n], ignored, st);
    free(ignored);
    b->all_dw1 = parts[0];
    b->all_dw2 = parts[1];
    b->all_dw1_truth = parts[2];
    b->all_dw2_truth = parts[3];
    b->all_dx = root ? moe_xmalloc(sizeof(float) * (size_t)(N * d)) : NULL;
    b->all_dx_truth = root ? moe_xmalloc(sizeof(double) * (size_t)(N * d)) : NULL;
    moe_comm_gather_bytes(c, b->g.dx, sizeof(float) * (size_t)(T * d), b->all_dx);
    moe_comm_gather_bytes(c, b->dx_truth, sizeof(double) * (size_t)(T * d), b->all_dx_truth);
    b->grad_output = root ? moe_xmalloc(sizeof(float) * (size_t)(N * d)) : NULL; /* synthetic or --grad-output */
    moe_comm_gather_bytes(c, b->dy_rank, sizeof(float) * (size_t)(T * d), b->grad_output);
    return rc;
}

/* --dump streams each rank's share to rank 0 while rank 0 writes the set:
 * part by part, as the writer reaches the tensors made from it (their
 * rows produced by fill_part), so that rank 0 never holds more than one
 * rank's share and no rank's slot tensor is gathered whole. Rank 0's own
 * parts are read where they are. */
enum { RECV_X, RECV_TOKEN, OUT, PAIR, SUMS, LAY_WIRE, LAY_SRC, LAY_EXPERT, LAY_COUNT, OUT_ALLOW, SUM_ALLOW, PARTS };

/* What rank 0 needs of each rank's share before it writes: the parts'
 * sizes, and the rms of its expert outputs and sums (their tolerances'
 * abs is rel times the rms, docs/golden.md). */
typedef struct {
    uint64_t bytes[PARTS];
    double rms_out, rms_sums;
} share_meta;

static void share_parts(const moe_ep_capture *cap, const double *out_allow, const double *sum_allow,
                        const moe_ep *ep, const void *part[PARTS], share_meta *m)
{
    const moe_index d = ep->cfg->hidden;
    const size_t row = moe_wire_dispatch(ep->cfg).bytes;
    const void *p[PARTS] = {cap->recv_x, cap->recv_token, cap->out, cap->pair, cap->sums, cap->layout_wire,
                            cap->layout_src, cap->layout_expert, cap->layout_count, out_allow, sum_allow};
    const size_t b[PARTS] = {sizeof(float) * (size_t)(cap->rows * d), sizeof(int32_t) * (size_t)cap->rows,
                             sizeof(float) * (size_t)(cap->pairs * d), sizeof(int32_t) * (size_t)(2 * cap->pairs),
                             cap->sums ? sizeof(float) * (size_t)(cap->rows * d) : 0,
                             row * (size_t)cap->slots, sizeof(int32_t) * (size_t)cap->slots,
                             sizeof(int32_t) * (size_t)cap->slots, sizeof(int32_t) * (size_t)ep->local_experts,
                             out_allow ? sizeof(double) * (size_t)(cap->pairs * d) : 0,
                             sum_allow ? sizeof(double) * (size_t)(cap->rows * d) : 0};
    for (int n = 0; n < PARTS; n++) {
        part[n] = p[n];
        m->bytes[n] = b[n];
    }
    m->rms_out = rms_f32(cap->out, cap->pairs * d);
    m->rms_sums = cap->sums ? rms_f32(cap->sums, cap->rows * d) : 0.0;
}

/* Rank 0's view of the shares: its own parts, the one other rank's parts it
 * holds now (fetched on first use), every rank's meta. */
typedef struct {
    const moe_comm *c;
    const void *mine[PARTS];
    const share_meta *meta; /* (G) */
    int rank;               /* whose parts are held; -1: none */
    void *held[PARTS];
} share_stream;

static void stream_release(share_stream *s)
{
    for (int n = 0; n < PARTS; n++) {
        free(s->held[n]);
        s->held[n] = NULL;
    }
    s->rank = -1;
}

/* Part `part` of rank r's share: asked for (its index) and received once. */
static const uint8_t *stream_part(share_stream *s, int r, int part)
{
    if (r == 0)
        return s->mine[part];
    if (s->rank != r)
        stream_release(s);
    s->rank = r;
    if (!s->held[part]) {
        const int32_t ask = part;
        const size_t bytes = (size_t)s->meta[r].bytes[part];
        moe_comm_send_bytes(s->c, r, &ask, sizeof ask);
        s->held[part] = moe_xmalloc(bytes + 1);
        moe_comm_recv_bytes(s->c, r, s->held[part], bytes);
    }
    return s->held[part];
}

/* Every rank but 0: send the parts rank 0 asks for until it says stop (-1). */
static void serve_share(const moe_comm *c, const void *const part[PARTS], const share_meta *m)
{
    for (;;) {
        int32_t ask;
        moe_comm_recv_bytes(c, 0, &ask, sizeof ask);
        if (ask < 0 || ask >= PARTS)
            return;
        moe_comm_send_bytes(c, 0, part[ask], (size_t)m->bytes[ask]);
    }
}

/* One tensor made from a part of a rank's share: its rows copied, or, for
 * the layout tensor, its wire rows (`slots` of them per row of the tensor:
 * C of the masked layout's expert, else one) as values as they travelled
 * (E4M3 bytes, bf16 or fp32) or as their scales (none where a slot is
 * empty). */
enum { AS_IS, VALUES, SCALES };
typedef struct {
    share_stream *s;
    const moe_wire *wire;
    int rank, part, how;
    size_t row_bytes;
    int64_t slots;
} part_source;

static void fill_part(const void *ctx, int64_t row, void *out)
{
    const part_source *p = ctx;
    const uint8_t *data = stream_part(p->s, p->rank, p->part);
    if (p->how == AS_IS) {
        memcpy(out, data + (size_t)row * p->row_bytes, p->row_bytes);
        return;
    }
    const uint8_t *wire = data + (size_t)(row * p->slots) * p->wire->bytes;
    if (p->how == VALUES) { /* each wire row begins with its d values */
        const size_t values = p->wire->bytes - p->wire->scale_bytes *
                                                   (size_t)((p->wire->hidden + MOE_FP8_BLOCK - 1) / MOE_FP8_BLOCK);
        for (int64_t m = 0; m < p->slots; m++)
            memcpy((uint8_t *)out + (size_t)m * values, wire + (size_t)m * p->wire->bytes, values);
        return;
    }
    const int32_t *src = (const int32_t *)stream_part(p->s, p->rank, LAY_SRC) + row * p->slots;
    const int64_t blocks = (p->wire->hidden + MOE_FP8_BLOCK - 1) / MOE_FP8_BLOCK;
    moe_wire_scales(p->wire, wire, p->slots, out);
    for (int64_t m = 0; m < p->slots; m++) /* empty slots: no scale */
        if (src[m] < 0)
            memset((float *)out + m * blocks, 0, sizeof(float) * (size_t)blocks);
}

/* The sources of the streamed tensors, one per tensor, kept until written. */
typedef struct {
    part_source *items;
    int count, capacity;
} source_list;

static moe_golden_tensor *add_streamed(tensor_list *l, source_list *sl, part_source from,
                                       enum moe_golden_kind kind, int ndim, int64_t d0, int64_t d1, int64_t d2)
{
    MOE_ASSERT(sl->count < sl->capacity); /* the tensors point into it: sized once, never moved */
    sl->items[sl->count] = from;
    moe_golden_tensor *g = add(l, kind, from.rank, NULL, ndim, d0, d1, d2);
    g->tensor.fill = fill_part;
    g->tensor.ctx = &sl->items[sl->count++];
    const int64_t rest = ndim > 1 ? moe_st_elements(ndim - 1, g->tensor.shape + 1) : 1;
    if (from.how == AS_IS)
        sl->items[sl->count - 1].row_bytes = (size_t)rest * moe_st_dtype_size(g->tensor.dtype);
    return g;
}

/* The layout tensors of each rank (docs/golden.md): its rows as they
 * travelled (F8_E4M3 bytes with their scales beside them, BF16 or F32),
 * who each slot holds, and the counts; masked ones shaped (EL, C, ...). */
static void add_layout(tensor_list *l, source_list *sl, share_stream *s, const moe_wire *w, const moe_ep *ep, int G)
{
    const moe_config *cfg = ep->cfg;
    const moe_index d = cfg->hidden, blocks = (d + MOE_FP8_BLOCK - 1) / MOE_FP8_BLOCK;
    const int kind = moe_config_layout(cfg);
    const bool masked = kind == MOE_LAYOUT_MASKED;
    const int64_t C = (int64_t)G * moe_config_max_tokens(cfg);
    for (int r = 0; r < G; r++) {
        const int64_t slots = (int64_t)(s->meta[r].bytes[LAY_SRC] / sizeof(int32_t));
        const int64_t EL = (int64_t)(s->meta[r].bytes[LAY_COUNT] / sizeof(int32_t));
        /* (slots, ...) or, masked, (EL, C, ...) */
        const int ndim = masked ? 3 : 2;
        const int64_t d0 = masked ? EL : slots, d1 = masked ? C : d, per_row = masked ? C : 1;
        const part_source wire = {s, w, r, LAY_WIRE, VALUES, 0, per_row};
        moe_golden_tensor *x = add_streamed(l, sl, wire, MOE_GK_LAYOUT_X, ndim, d0, d1, d);
        x->tensor.dtype = w->dtype == MOE_DTYPE_FP8 ? MOE_ST_F8_E4M3 : w->dtype == MOE_DTYPE_BF16 ? MOE_ST_BF16
                                                                                                 : MOE_ST_F32;
        if (w->dtype == MOE_DTYPE_FP8)
            add_streamed(l, sl, (part_source){s, w, r, LAY_WIRE, SCALES, 0, per_row}, MOE_GK_LAYOUT_SCALE, ndim,
                         d0, masked ? C : blocks, blocks);
        add_streamed(l, sl, (part_source){s, w, r, LAY_SRC, AS_IS, 0, 1}, MOE_GK_LAYOUT_SRC, ndim - 1, d0, C, 0);
        if (kind == MOE_LAYOUT_CONTIGUOUS)
            add_streamed(l, sl, (part_source){s, w, r, LAY_EXPERT, AS_IS, 0, 1}, MOE_GK_LAYOUT_EXPERT, 1, slots, 0, 0);
        add_streamed(l, sl, (part_source){s, w, r, LAY_COUNT, AS_IS, 0, 1}, MOE_GK_LAYOUT_COUNT, 1, EL, 0, 0);
    }
}

/* A gradient and its truth, the same tolerance on both (docs/backward.md):
 * rel = u * length over the rms of the truth. */
static void add_gradient(tensor_list *l, const char *name, const float *v, const double *truth,
                         int ndim, int64_t d0, int64_t d1, int64_t d2, double length)
{
    char truth_name[MOE_ST_NAME_MAX];
    snprintf(truth_name, sizeof truth_name, "%s.truth", name);
    const int iv = l->count, it = l->count + 1; /* add() may move the list */
    add_named(l, MOE_GK_GRADIENT, name, v, ndim, d0, d1, d2);
    add_named(l, MOE_GK_GRADIENT_TRUTH, truth_name, truth, ndim, d0, d1, d2);
    const int64_t n = d0 * (ndim > 1 ? d1 : 1) * (ndim > 2 ? d2 : 1);
    const double rms = n ? sqrt(moe_sum_squares(truth, n) / (double)n) : 0.0;
    const moe_tolerance tol = moe_tolerance_of_length(length, rms);
    l->items[iv].rel = l->items[it].rel = tol.rel;
    l->items[iv].abs = l->items[it].abs = tol.abs;
}

/* The backward stage's tensors (docs/golden.md), on rank 0. */
static void add_backward(tensor_list *l, const moe_ep *ep, int G, const backward_share *b)
{
    const moe_config *cfg = ep->cfg;
    const moe_index T = cfg->tokens, d = cfg->hidden, f = cfg->ffn, E = cfg->experts;
    const moe_index S = cfg->shared_experts, N = (moe_index)G * T;
    const double base = moe_truth_backward_length(cfg); /* the chains of docs/backward.md */
    add(l, MOE_GK_GRAD_OUTPUT, -1, b->grad_output, 2, N, d, 0);
    size_t at[4] = {0, 0, 0, 0};
    for (int r = 0; r < G; r++) {
        const int64_t rows = (int64_t)(b->sizes[0][r] / (sizeof(float) * (size_t)d));
        const int64_t pairs = (int64_t)(b->sizes[2][r] / sizeof(float));
        add(l, MOE_GK_BACKWARD_DY, r, (char *)b->dy + at[0], 2, rows, d, 0);
        add(l, MOE_GK_BACKWARD_DX, r, (char *)b->dx + at[1], 2, pairs, d, 0);
        add(l, MOE_GK_BACKWARD_DWEIGHT, r, (char *)b->dweight + at[2], 1, pairs, 0, 0);
        if (b->sums)
            add(l, MOE_GK_BACKWARD_DX_SUM, r, (char *)b->sums + at[3], 2, rows, d, 0);
        for (int n = 0; n < 4; n++)
            at[n] += b->sizes[n][r];
    }
    add_gradient(l, "backward.dx", b->all_dx, b->all_dx_truth, 2, N, d, 0, base);
    add_gradient(l, "backward.experts.dw1", b->all_dw1, b->all_dw1_truth, 3, E, 2 * f, d, base + b->most_rows);
    add_gradient(l, "backward.experts.dw2", b->all_dw2, b->all_dw2_truth, 3, E, d, f, base + b->most_rows);
    if (S > 0) {
        add_gradient(l, "backward.shared.dw1", b->g.dshared_w1, b->dshared_w1_truth, 3, S, 2 * f, d, base + (double)T);
        add_gradient(l, "backward.shared.dw2", b->g.dshared_w2, b->dshared_w2_truth, 3, S, d, f, base + (double)T);
    }
    add_gradient(l, "backward.gate.dw", b->g.dgate, b->dgate_truth, 2, E, d, 0, base);
}

/* A rank's routing as the set holds it: the router's logical ids; the
 * pairs kept (--capacity-factor: -1 dropped; else ids); the physical
 * experts they go to (--redundant-experts: the copies; else kept); and the
 * rank each pair is computed on (with copies; NULL without). */
typedef struct {
    const int32_t *ids, *kept, *placed, *pair_rank;
} dump_routing;

/* This rank's share of a set: a captured forward (or training step) and
 * the truth. */
typedef struct {
    float *y, *x_scratch;  /* (T, d) */
    double *truth, *allow; /* (T, d); allow where the truth rounds (moe_truth_rounds) */
    moe_ep_capture cap;
    backward_share bwd;
    double *out_allow, *sum_allow; /* (pairs, d), (rows, d): rounding points inside the experts */
} rank_share;

static void rank_share_free(rank_share *r)
{
    free(r->sum_allow);
    free(r->out_allow);
    moe_ep_capture_free(&r->cap);
    backward_share_free(&r->bwd);
    free(r->allow);
    free(r->truth);
    free(r->x_scratch);
    free(r->y);
}

/* With rounding points inside the routed experts (--gemm-out-dtype,
 * --act-dtype): how far two correct computations of each pair's output can
 * lie apart (moe_truth_expert_widths, each expert's pairs at once) and,
 * with --combine reduced, of each received row's sum: its pairs' widths
 * times their gate weights, with one bf16 step of each output that
 * --gemm-out-dtype bf16 rounded (the sum's own rounding is its bf16_step). */
static void expert_allowances(const moe_ep *ep, const moe_ep_capture *cap, rank_share *r)
{
    const moe_config *cfg = ep->cfg;
    const moe_index d = cfg->hidden, P = cap->pairs;
    float *x = moe_xmalloc(sizeof(float) * (size_t)(P * d) + 1);
    double *width = moe_xmalloc(sizeof(double) * (size_t)(P * d) + 1);
    moe_index *at = moe_xmalloc(sizeof(moe_index) * (size_t)P + 1);
    r->out_allow = moe_xcalloc((size_t)(P * d) + 1, sizeof(double));
    for (int l = 0; l < ep->local_experts; l++) {
        const int e = ep->first_expert + l;
        moe_index n = 0;
        for (moe_index p = 0; p < P; p++)
            if (cap->pair[2 * p + 1] == e) {
                memcpy(x + n * d, cap->recv_x + (moe_index)cap->pair_row[p] * d, sizeof(float) * (size_t)d);
                at[n++] = p;
            }
        if (n == 0)
            continue;
        moe_truth_expert_widths(cfg, MOE_TRUTH_EXACT, ep->replicas.phy2log ? ep->replicas.phy2log[e] : e, x, n,
                                width);
        for (moe_index m = 0; m < n; m++)
            memcpy(r->out_allow + at[m] * d, width + m * d, sizeof(double) * (size_t)d);
    }
    if (cfg->combine == MOE_COMBINE_REDUCED) {
        const bool stepped = cfg->gemm_out_dtype == MOE_DTYPE_BF16;
        r->sum_allow = moe_xcalloc((size_t)(cap->rows * d) + 1, sizeof(double));
        for (moe_index p = 0; p < P; p++)
            for (moe_index j = 0; j < d; j++)
                r->sum_allow[cap->pair_row[p] * d + j] +=
                    fabs(cap->pair_weight[p]) *
                    (r->out_allow[p * d + j] + (stepped ? moe_bf16_step(cap->out[p * d + j]) : 0.0));
    }
    free(at);
    free(width);
    free(x);
}

static int capture_share(const moe_comm *c, const moe_ep *ep, const float *x, const float *dy,
                         const dump_routing *routing, const float *weights, const float *logits,
                         rank_share *r, moe_status *st)
{
    const int32_t *ids = routing->placed;
    const moe_config *cfg = ep->cfg;
    const moe_index T = cfg->tokens, d = cfg->hidden;
    r->y = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    r->x_scratch = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    r->truth = moe_xmalloc(sizeof(double) * (size_t)(T * d));
    if (moe_truth_rounds(cfg))
        r->allow = moe_xmalloc(sizeof(double) * (size_t)(T * d));
    moe_forward_stats stats;
    int rc = ep->path->training
                       ? backward_step(c, ep, x, dy, ids, weights, logits, r->y, &r->cap, &r->bwd, st)
                       : moe_ep_forward_ref(ep, x, ids, weights, r->y, &stats, &r->cap, st);
    /* The two-stage dispatch with the reduced combine sums once more at
     * each node's relay: the output is that path's (its relay sums follow
     * from the ranks' sums, lay_out_nodes). */
    if (rc == MOE_EXIT_OK && !moe_config_truth_shares(cfg))
        rc = moe_ep_forward_hier(ep, x, ids, weights, r->y, &stats, st);
    if (rc == MOE_EXIT_OK)
        moe_ep_round_output(ep, r->y);
    const moe_expert_rounding rounding = moe_expert_rounding_of(cfg);
    if (rc == MOE_EXIT_OK && moe_expert_rounds(&rounding))
        expert_allowances(ep, &r->cap, r);
    if (rc == MOE_EXIT_OK) /* the truth of the logical experts, each pair summed where its copy is */
        moe_truth_forward_placed(cfg, MOE_TRUTH_EXACT, x, moe_ep_dispatched_tokens(ep, x, r->x_scratch),
                                 routing->kept, weights, T, c->ranks, routing->pair_rank, r->truth, r->allow);
    return rc;
}

/* On rank 0 (NULL elsewhere): the routing, the output and truth (N rows)
 * of every rank, gathered, and each rank's share meta; the per-rank parts
 * are streamed as they are written (share_stream). */
typedef struct {
    float *logits, *scores, *weights, *y;
    int32_t *ids, *kept;  /* the router's choice; with --capacity-factor, the pairs kept (-1 dropped) */
    int32_t *physical;    /* with --redundant-experts, the copy each pair went to */
    double *truth, *allow;
    share_meta *meta;
    const void *mine[PARTS];
    share_meta my_meta;
} gathered;

static void gathered_free(gathered *a)
{
    free(a->meta);
    free(a->allow);
    free(a->truth);
    free(a->y);
    free(a->weights);
    free(a->physical);
    free(a->kept);
    free(a->ids);
    free(a->scores);
    free(a->logits);
}

static int gather_shares(const moe_comm *c, const moe_ep *ep, const dump_routing *routing,
                         const float *weights, const float *logits, const float *scores,
                         rank_share *r, gathered *a, moe_status *st)
{
    const int32_t *ids = routing->ids, *kept = routing->kept, *placed = routing->placed;
    const moe_config *cfg = ep->cfg;
    const moe_index T = cfg->tokens, d = cfg->hidden, E = cfg->experts, k = cfg->topk;
    const int64_t N = (int64_t)c->ranks * T;
    const bool root = c->rank == 0;
    a->logits = root ? moe_xmalloc(sizeof(float) * (size_t)(N * E)) : NULL;
    a->scores = root ? moe_xmalloc(sizeof(float) * (size_t)(N * E)) : NULL;
    a->ids = root ? moe_xmalloc(sizeof(int32_t) * (size_t)(N * k)) : NULL;
    a->kept = root && kept != ids ? moe_xmalloc(sizeof(int32_t) * (size_t)(N * k)) : NULL;
    a->physical = root && placed != kept ? moe_xmalloc(sizeof(int32_t) * (size_t)(N * k)) : NULL;
    a->weights = root ? moe_xmalloc(sizeof(float) * (size_t)(N * k)) : NULL;
    a->y = root ? moe_xmalloc(sizeof(float) * (size_t)(N * d)) : NULL;
    a->truth = root ? moe_xmalloc(sizeof(double) * (size_t)(N * d)) : NULL;
    a->allow = root && r->allow ? moe_xmalloc(sizeof(double) * (size_t)(N * d)) : NULL;
    a->meta = root ? moe_xmalloc(sizeof(share_meta) * (size_t)c->ranks) : NULL;
    moe_comm_gather_bytes(c, logits, sizeof(float) * (size_t)(T * E), a->logits);
    moe_comm_gather_bytes(c, scores, sizeof(float) * (size_t)(T * E), a->scores);
    moe_comm_gather_bytes(c, ids, sizeof(int32_t) * (size_t)(T * k), a->ids);
    if (kept != ids)
        moe_comm_gather_bytes(c, kept, sizeof(int32_t) * (size_t)(T * k), a->kept);
    if (placed != kept)
        moe_comm_gather_bytes(c, placed, sizeof(int32_t) * (size_t)(T * k), a->physical);
    moe_comm_gather_bytes(c, weights, sizeof(float) * (size_t)(T * k), a->weights);
    moe_comm_gather_bytes(c, r->y, sizeof(float) * (size_t)(T * d), a->y);
    moe_comm_gather_bytes(c, r->truth, sizeof(double) * (size_t)(T * d), a->truth);
    if (r->allow)
        moe_comm_gather_bytes(c, r->allow, sizeof(double) * (size_t)(T * d), a->allow);
    share_parts(&r->cap, r->out_allow, r->sum_allow, ep, a->mine, &a->my_meta);
    moe_comm_gather_bytes(c, &a->my_meta, sizeof a->my_meta, a->meta);
    return ep->path->training ? gather_backward(c, ep, &r->bwd, st) : MOE_EXIT_OK;
}

/* The inputs: tokens, the gate, and (--dump-weights) the experts' weights,
 * regenerated as the file is written; with --dtype fp8 also as their E4M3
 * bytes and block scales (what an FP8 GEMM loads, as DeepSeek-V3's
 * checkpoint holds them). */
static void lay_out_inputs(tensor_list *l, const moe_ep *ep, int64_t N, float *tokens,
                           weight_source sources[12])
{
    const moe_config *cfg = ep->cfg;
    const moe_index d = cfg->hidden, f = cfg->ffn, E = cfg->experts, S = cfg->shared_experts;
    moe_synth_tokens(cfg->seed, 0, N, d, (float)cfg->init_scale, cfg->input_dist, tokens);
    moe_precision_weights(cfg->param_dtype, tokens, N * d);
    add(l, MOE_GK_TOKENS, -1, tokens, 2, N, d, 0);
    add(l, MOE_GK_GATE_WEIGHT, -1, ep->gate, 2, E, d, 0);
    if (ep->bias)
        add(l, MOE_GK_GATE_BIAS, -1, ep->bias, 1, E, 0, 0);
    if (ep->skew)
        add(l, MOE_GK_ROUTER_SKEW, -1, ep->skew, 1, E, 0, 0);
    if (!cfg->dump_weights)
        return;
    static const enum moe_golden_kind kinds[4] = {MOE_GK_EXPERTS_W1, MOE_GK_EXPERTS_W2,
                                                  MOE_GK_SHARED_W1, MOE_GK_SHARED_W2};
    const bool fp8 = cfg->param_dtype == MOE_DTYPE_FP8;
    const moe_index fb = moe_fp8_blocks(f), db = moe_fp8_blocks(d);
    for (int n = 0; n < 4; n++) {
        const int64_t count = n < 2 ? E : S;
        for (int part = WEIGHT_VALUES; part <= (fp8 ? WEIGHT_SCALES : WEIGHT_VALUES) && count > 0; part++) {
            weight_source *src = &sources[3 * n + part];
            *src = (weight_source){cfg->seed, d, f, cfg->param_dtype, cfg->fp8_scale == MOE_FP8_SCALE_UE8M0,
                                   n >= 2, n % 2, part};
            const enum moe_golden_kind kind =
                part == WEIGHT_VALUES ? kinds[n] : (enum moe_golden_kind)(MOE_GK_EXPERTS_W1_FP8 + 2 * n + (part == WEIGHT_SCALES));
            const int64_t rows = part == WEIGHT_SCALES ? (n % 2 ? db : 2 * fb) : n % 2 ? d : 2 * f;
            const int64_t cols = part == WEIGHT_SCALES ? (n % 2 ? fb : db) : n % 2 ? f : d;
            moe_golden_tensor *g = add(l, kind, -1, NULL, 3, count, rows, cols);
            g->tensor.fill = fill_weight;
            g->tensor.ctx = src;
        }
    }
}

/* Per rank: the rows it received, its experts' outputs and pairs, and
 * (--combine reduced) each row's sum as sent back. */
static void lay_out_ranks(tensor_list *l, source_list *sl, share_stream *s, const moe_config *cfg, int G,
                          char (*allow_names)[MOE_ST_NAME_MAX])
{
    const moe_index d = cfg->hidden;
    const bool bf16_combine = cfg->combine_dtype == MOE_DTYPE_BF16;
    const bool bf16_out = cfg->gemm_out_dtype == MOE_DTYPE_BF16;
    const bool reduced = cfg->combine == MOE_COMBINE_REDUCED;
    for (int r = 0; r < G; r++) {
        const share_meta *m = &s->meta[r];
        const int64_t rows = (int64_t)(m->bytes[RECV_TOKEN] / sizeof(int32_t));
        const int64_t pairs = (int64_t)(m->bytes[PAIR] / (2 * sizeof(int32_t)));
        add_streamed(l, sl, (part_source){s, NULL, r, RECV_X, AS_IS, 0, 1}, MOE_GK_DISPATCH_X, 2, rows, d, 0);
        add_streamed(l, sl, (part_source){s, NULL, r, RECV_TOKEN, AS_IS, 0, 1}, MOE_GK_DISPATCH_TOKEN, 1, rows, 0, 0);
        moe_golden_tensor *g = add_streamed(l, sl, (part_source){s, NULL, r, OUT, AS_IS, 0, 1}, MOE_GK_EXPERT_OUT,
                                            2, pairs, d, 0);
        g->abs = g->rel * m->rms_out;
        g->bf16_step = (bf16_combine && !reduced) || bf16_out; /* each value was rounded to bf16 once */
        const int out_at = l->count - 1; /* add() may move the list: indices, not pointers */
        add_streamed(l, sl, (part_source){s, NULL, r, PAIR, AS_IS, 0, 1}, MOE_GK_EXPERT_PAIR, 2, pairs, 2, 0);
        if (m->bytes[OUT_ALLOW]) { /* rounding points inside the experts: each value's allowance */
            snprintf(allow_names[2 * r], MOE_ST_NAME_MAX, moe_golden_kinds[MOE_GK_EXPERT_OUT_ALLOW].name, r);
            add_streamed(l, sl, (part_source){s, NULL, r, OUT_ALLOW, AS_IS, 0, 1}, MOE_GK_EXPERT_OUT_ALLOW, 2,
                         pairs, d, 0);
            l->items[out_at].allow = allow_names[2 * r];
        }
        if (reduced) { /* per received row, its pairs summed in slot order, as sent back */
            g = add_streamed(l, sl, (part_source){s, NULL, r, SUMS, AS_IS, 0, 1}, MOE_GK_EXPERT_SUM, 2, rows, d, 0);
            g->abs = g->rel * m->rms_sums;
            g->bf16_step = bf16_combine;
            const int sum_at = l->count - 1;
            if (m->bytes[SUM_ALLOW]) {
                snprintf(allow_names[2 * r + 1], MOE_ST_NAME_MAX, moe_golden_kinds[MOE_GK_EXPERT_SUM_ALLOW].name, r);
                add_streamed(l, sl, (part_source){s, NULL, r, SUM_ALLOW, AS_IS, 0, 1}, MOE_GK_EXPERT_SUM_ALLOW, 2,
                             rows, d, 0);
                l->items[sum_at].allow = allow_names[2 * r + 1];
            }
        }
    }
}

/* The two-stage dispatch with the reduced combine: per node, the rows its
 * relays send home, one per token that reached the node (ascending global
 * id): the sums of its ranks' rows for that token (experts.rank{r}.sum, as
 * they travelled) added in ascending local index from zero in fp32, then
 * rounded to --combine-dtype, as ep_hier.c's relay_combine adds them. Home
 * adds them in ascending node order. The rows live in *rows and *tokens
 * until the set is written. */
static void lay_out_nodes(tensor_list *l, share_stream *s, const moe_ep *ep, int G, int64_t N,
                          float **rows, int32_t **tokens)
{
    const moe_config *cfg = ep->cfg;
    const moe_index d = cfg->hidden;
    const int R = ep->link.ranks_per_node, nodes = G / R;
    float *acc = moe_xmalloc(sizeof(float) * (size_t)(N * d));
    uint8_t *reached = moe_xmalloc((size_t)N);
    int64_t total = 0, at = 0;
    for (int r = 0; r < G; r++)
        total += (int64_t)(s->meta[r].bytes[RECV_TOKEN] / sizeof(int32_t));
    *rows = moe_xmalloc(sizeof(float) * (size_t)(total * d) + 1);
    *tokens = moe_xmalloc(sizeof(int32_t) * (size_t)total + 1);
    for (int n = 0; n < nodes; n++) {
        memset(reached, 0, (size_t)N);
        for (int r = n * R; r < (n + 1) * R; r++) { /* ascending local index */
            const int64_t count = (int64_t)(s->meta[r].bytes[RECV_TOKEN] / sizeof(int32_t));
            const int32_t *token = (const int32_t *)stream_part(s, r, RECV_TOKEN);
            const float *sums = (const float *)stream_part(s, r, SUMS);
            for (int64_t j = 0; j < count; j++) {
                float *to = acc + (int64_t)token[j] * d;
                if (!reached[token[j]])
                    memset(to, 0, sizeof(float) * (size_t)d);
                reached[token[j]] = 1;
                for (moe_index c = 0; c < d; c++)
                    to[c] += sums[j * d + c];
            }
        }
        const int64_t first = at;
        for (int64_t t = 0; t < N; t++)
            if (reached[t]) {
                memcpy(*rows + at * d, acc + t * d, sizeof(float) * (size_t)d);
                (*tokens)[at++] = (int32_t)t;
            }
        moe_precision_combine(cfg->combine_dtype, *rows + first * d, (at - first) * d);
        moe_golden_tensor *g = add(l, MOE_GK_NODE_SUM, n, *rows + first * d, 2, at - first, d, 0);
        g->rel += 0x1p-24 * R; /* the ranks' sums added once more */
        g->abs = g->rel * rms_f32(*rows + first * d, (at - first) * d);
        g->bf16_step = cfg->combine_dtype == MOE_DTYPE_BF16;
        add(l, MOE_GK_NODE_TOKEN, n, *tokens + first, 1, at - first, 0, 0);
    }
    free(reached);
    free(acc);
}

/* The output and its truth: --check's contract, per element (truth.h). */
static void lay_out_output(tensor_list *l, const moe_config *cfg, int64_t N, const gathered *a)
{
    const moe_index d = cfg->hidden;
    const double rel_y = moe_tolerance_for(cfg, 0.0).rel;
    const int iy = l->count, it = l->count + 1; /* add() may move the list: indices, not pointers */
    add(l, MOE_GK_OUTPUT_Y, -1, a->y, 2, N, d, 0);
    add(l, MOE_GK_OUTPUT_TRUTH, -1, a->truth, 2, N, d, 0);
    if (a->allow)
        add(l, MOE_GK_OUTPUT_ALLOW, -1, a->allow, 2, N, d, 0);
    l->items[iy].rel = rel_y;
    l->items[iy].abs = rel_y * rms_f32(a->y, N * d);
    l->items[it].rel = rel_y;
    l->items[it].abs = l->items[iy].abs;
    l->items[iy].allow = l->items[it].allow = a->allow ? "output.allow" : NULL;
    l->items[iy].bf16_step = cfg->output_dtype == MOE_DTYPE_BF16; /* each value rounded to bf16 once */
}

/* Rank 0: the set's tensors in the table's order, and the manifest's
 * config; then the set written. */
static void write_set(const moe_comm *c, const moe_ep *ep, const char *dir, gathered *a,
                      const backward_share *bwd, const moe_dump_steps *steps, double *bytes, moe_status *st)
{
    const int G = c->ranks;
    const moe_config *cfg = ep->cfg;
    const moe_index T = cfg->tokens, d = cfg->hidden, E = cfg->experts, k = cfg->topk;
    const int64_t N = (int64_t)G * T;
    tensor_list l = {.d = d, .experts = E, .topk = k, .ffn = cfg->ffn};
    float *tokens = moe_xmalloc(sizeof(float) * (size_t)(N * d));
    weight_source sources[12];
    lay_out_inputs(&l, ep, N, tokens, sources);
    /* router */
    float *selection = moe_xmalloc(sizeof(float) * (size_t)(N * E));
    for (int64_t m = 0; m < N * E; m++)
        selection[m] = ep->bias ? a->scores[m] + ep->bias[m % E] : a->scores[m];
    add(&l, MOE_GK_LOGITS, -1, a->logits, 2, N, E, 0);
    add(&l, MOE_GK_SCORES, -1, a->scores, 2, N, E, 0);
    add(&l, MOE_GK_SELECTION, -1, selection, 2, N, E, 0);
    add(&l, MOE_GK_TOPK_IDS, -1, a->ids, 2, N, k, 0);
    /* --topk-weights-dtype bf16: each weight rounded to bf16 once, last */
    add(&l, MOE_GK_TOPK_WEIGHTS, -1, a->weights, 2, N, k, 0)->bf16_step = cfg->topk_weights_dtype == MOE_DTYPE_BF16;
    int32_t *steps_load = NULL;
    if (steps) { /* the trajectory: each step's pairs per expert, the bias after its update */
        steps_load = moe_xmalloc(sizeof(int32_t) * (size_t)(steps->steps * E));
        for (int64_t m = 0; m < steps->steps * E; m++)
            steps_load[m] = (int32_t)steps->load[m];
        add(&l, MOE_GK_STEPS_LOAD, -1, steps_load, 2, steps->steps, E, 0);
        add(&l, MOE_GK_STEPS_BIAS, -1, steps->bias, 2, steps->steps, E, 0);
    }
    /* layout, from the ids and the placement */
    layout_counts lc;
    count_layout(ep, a->physical ? a->physical : a->kept ? a->kept : a->ids, N, T, &lc);
    add(&l, MOE_GK_TOKENS_PER_RANK, -1, lc.per_rank, 1, G, 0, 0);
    add(&l, MOE_GK_TOKENS_PER_EXPERT, -1, lc.per_expert, 1, E, 0, 0);
    add(&l, MOE_GK_TOKENS_PER_NODE, -1, lc.per_node, 1, lc.nodes, 0, 0);
    add(&l, MOE_GK_TOKEN_IN_RANK, -1, lc.in_rank, 2, N, G, 0);
    add(&l, MOE_GK_SEND_COUNTS, -1, lc.send_counts, 2, G, G, 0);
    if (a->kept)
        add(&l, MOE_GK_KEPT_IDS, -1, a->kept, 2, N, k, 0);
    int32_t *replica_of = NULL;
    if (a->physical) { /* the copies: where each pair went, and whose copy each physical expert is */
        add(&l, MOE_GK_PHYSICAL_IDS, -1, a->physical, 2, N, k, 0);
        replica_of = moe_xmalloc(sizeof(int32_t) * (size_t)ep->replicas.physical);
        for (int p = 0; p < ep->replicas.physical; p++)
            replica_of[p] = ep->replicas.phy2log[p];
        add(&l, MOE_GK_REPLICA_OF, -1, replica_of, 1, ep->replicas.physical, 0, 0);
    }
    share_stream stream = {.c = c, .meta = a->meta, .rank = -1};
    memcpy(stream.mine, a->mine, sizeof stream.mine);
    source_list sources_of = {moe_xcalloc((size_t)(PARTS + 1) * (size_t)G, sizeof(part_source)), 0,
                              (PARTS + 1) * G};
    const moe_wire wire = moe_wire_dispatch(cfg);
    char (*allow_names)[MOE_ST_NAME_MAX] = moe_xcalloc((size_t)(2 * G), MOE_ST_NAME_MAX);
    lay_out_ranks(&l, &sources_of, &stream, cfg, G, allow_names);
    float *node_rows = NULL;
    int32_t *node_tokens = NULL;
    if (!moe_config_truth_shares(cfg))
        lay_out_nodes(&l, &stream, ep, G, N, &node_rows, &node_tokens);
    add_layout(&l, &sources_of, &stream, &wire, ep, G);
    lay_out_output(&l, cfg, N, a);
    if (ep->path->training)
        add_backward(&l, ep, G, bwd);

    /* the config as given, with what "auto" resolved to where it changes
     * the numbers: a port reads the values, not the rule */
    static const char *const layout_names[] = {
        [MOE_LAYOUT_ROWS] = "rows", [MOE_LAYOUT_MASKED] = "masked", [MOE_LAYOUT_CONTIGUOUS] = "contiguous"};
    json_t *config_object = json_object();
    moe_config_describe(cfg, MOE_CMD_RUN, emit_config, config_object);
    json_object_set_new(config_object, "norm-topk", json_string(moe_config_norm_topk(cfg) ? "true" : "false"));
    json_object_set_new(config_object, "expert-layout", json_string(layout_names[moe_config_layout(cfg)]));
    json_object_set_new(config_object, "ranks", json_sprintf("%d", G));
    char *config = json_dumps(config_object, JSON_PRESERVE_ORDER);
    MOE_ASSERT(config != NULL);
    moe_golden_write(dir, l.items, l.count, config, bytes, st);
    stream_release(&stream);
    for (int r = 1; r < G; r++) { /* done, or failed: every other rank stops serving */
        const int32_t stop = -1;
        moe_comm_send_bytes(c, r, &stop, sizeof stop);
    }
    free(sources_of.items);
    free(allow_names);
    free(node_tokens);
    free(node_rows);
    free(config);
    json_decref(config_object);
    layout_counts_free(&lc);
    free(replica_of);
    free(steps_load);
    free(selection);
    free(tokens);
    free(l.items);
}

/* The set: each rank's share captured, the global tensors gathered on
 * rank 0; every rank still well (an injected fault stands for a failure
 * here)? Then rank 0 lays it out and writes it, pulling each rank's parts
 * as it reaches them while the others serve them, and every rank learns
 * how that went. */
static int dump_set(const moe_comm *c, const moe_ep *ep, const char *dir, const float *x, const float *dy,
                    const dump_routing *routing, const float *weights, const float *logits,
                    const float *scores, const moe_dump_steps *steps, double *bytes, moe_status *st)
{
    rank_share share = {0};
    gathered all = {0};
    int rc = capture_share(c, ep, x, dy, routing, weights, logits, &share, st);
    if (rc == MOE_EXIT_OK)
        rc = gather_shares(c, ep, routing, weights, logits, scores, &share, &all, st);
    moe_status local = {0};
    if (rc == MOE_EXIT_OK) {
        moe_fault_here(c, "dump", &local);
        rc = moe_comm_agree(c, &local);
        if (rc)
            *st = local;
    }
    if (c->rank == 0 && rc == MOE_EXIT_OK)
        write_set(c, ep, dir, &all, &share.bwd, steps, bytes, &local);
    else if (rc == MOE_EXIT_OK)
        serve_share(c, all.mine, &all.my_meta);
    gathered_free(&all);
    rank_share_free(&share);
    if (rc)
        return rc;
    if (moe_comm_agree(c, &local))
        *st = local;
    return local.code;
}

int moe_dump_write(const moe_comm *c, const moe_ep *ep, const char *dir, const float *x, const float *dy,
                   const moe_dump_steps *steps, double *bytes, moe_status *st)
{
    const moe_index T = ep->cfg->tokens, E = ep->cfg->experts, k = ep->cfg->topk;
    moe_gemm_forbid_blas("the golden dump, whose tensors are the same bytes on every machine");
    float *logits = moe_xmalloc(sizeof(float) * (size_t)(T * E));  /* (T, E) */
    float *scores = moe_xmalloc(sizeof(float) * (size_t)(T * E));  /* (T, E) */
    int32_t *ids = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k)); /* (T, k) */
    float *weights = moe_xmalloc(sizeof(float) * (size_t)(T * k)); /* (T, k) */
    moe_ep_route(ep, x, logits, scores, ids, weights);
    /* --capacity-factor: the pairs kept (-1 dropped); --redundant-experts:
     * the copies they go to and the ranks of those */
    const moe_config *cfg = ep->cfg;
    int32_t *kept = cfg->capacity_factor > 0 ? moe_xmalloc(sizeof(int32_t) * (size_t)(T * k)) : ids;
    int32_t *placed = ep->replicas.physical ? moe_xmalloc(sizeof(int32_t) * (size_t)(T * k)) : kept;
    int32_t *pair_rank = ep->replicas.physical ? moe_xmalloc(sizeof(int32_t) * (size_t)(T * k)) : NULL;
    if (kept != ids)
        moe_capacity_apply(cfg, ids, weights, T, kept);
    if (placed != kept) /* the copies, after the same drops */
        moe_ep_place(ep, ids, weights, placed);
    for (moe_index m = 0; pair_rank && m < T * k; m++)
        pair_rank[m] = placed[m] == MOE_DROPPED ? -1 : ep->placement.expert_rank[placed[m]];
    const dump_routing routing = {ids, kept, placed, pair_rank};
    const int rc = dump_set(c, ep, dir, x, dy, &routing, weights, logits, scores, steps, bytes, st);
    if (placed != kept)
        free(placed);
    if (kept != ids)
        free(kept);
    free(pair_rank);
    free(weights);
    free(ids);
    free(scores);
    free(logits);
    moe_gemm_forbid_blas(NULL);
    return rc;
}
