/* dump.c — `moe-ep run --dump DIR`: the golden set of this run.
 *
 * The tokens are routed again and one more forward on the blocking
 * reference path captures what each rank received and sent back; the truth
 * is the fixed-order one (MOE_TRUTH_EXACT). BLAS is forbidden throughout, so
 * no bit of the set depends on the CPU, the BLAS kernel or the threads. Rank 0
 * gathers the rest and writes the set (src/io/golden.c). Inputs and weights
 * are not gathered: rank 0 regenerates them from the seed (they are a pure
 * function of it, docs/data.md). Collective.
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/check.h"
#include "moe/cli.h"
#include "moe/ep.h"
#include "moe/path.h"
#include "moe/gemm.h"
#include "moe/golden.h"
#include "moe/quant.h"
#include "moe/rng.h"
#include "moe/truth.h"
#include "moe/wire.h"

#define UNIT_ROUNDOFF 0x1p-24

typedef struct {
    uint64_t seed;
    moe_index d, f;
    int dtype;
    bool shared, second; /* shared experts; W2 rather than W1 */
} weight_source;

/* One expert's W1 (2f, d) or W2 (d, f), regenerated and rounded to --dtype. */
static void fill_weight(const void *ctx, int64_t expert, void *out)
{
    const weight_source *w = ctx;
    float *w1 = moe_xmalloc(sizeof(float) * (size_t)(2 * w->f * w->d));
    float *w2 = moe_xmalloc(sizeof(float) * (size_t)(w->d * w->f));
    if (w->shared)
        moe_shared_expert_generate(w->seed, (int)expert, w->d, w->f, w1, w2);
    else
        moe_expert_generate(w->seed, (int)expert, w->d, w->f, w1, w2);
    const moe_index n = w->second ? w->d * w->f : 2 * w->f * w->d;
    memcpy(out, w->second ? w2 : w1, sizeof(float) * (size_t)n);
    moe_precision_weights(w->dtype, out, n);
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
} tensor_list;

static moe_golden_tensor *add(tensor_list *l, const char *name, enum moe_st_dtype dtype,
                              enum moe_stage_file stage, enum moe_golden_rule rule, const void *data,
                              int ndim, int64_t d0, int64_t d1, int64_t d2)
{
    if (l->count == l->capacity) {
        l->capacity = l->capacity ? 2 * l->capacity : 32;
        l->items = realloc(l->items, sizeof *l->items * (size_t)l->capacity);
        MOE_ASSERT(l->items != NULL);
    }
    moe_golden_tensor *g = &l->items[l->count++];
    memset(g, 0, sizeof *g);
    snprintf(g->tensor.name, sizeof g->tensor.name, "%s", name);
    g->tensor.dtype = dtype;
    g->tensor.ndim = ndim;
    const int64_t dims[3] = {d0, d1, d2};
    for (int i = 0; i < ndim; i++)
        g->tensor.shape[i] = dims[i];
    g->tensor.data = data;
    g->stage = stage;
    g->rule = rule;
    return g;
}

/* A float tensor compared within rel * (|ref| + rms): the rms floor covers
 * elements much smaller than the terms that made them (truth.h). */
static void tolerate(moe_golden_tensor *g, double rel)
{
    g->rel = rel;
    g->abs = rel * rms_f32(g->tensor.data, moe_st_elements(g->tensor.ndim, g->tensor.shape));
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
            const int e = ids[i * k + s], r = ep->placement.expert_rank[e];
            lc->per_expert[e]++;
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

/* --dump: every rank's layout tensor (--expert-layout), gathered on rank 0,
 * and the arrays made from it for the set. */
typedef struct {
    void *parts[4];   /* wire rows, src, expert, count: every rank's, concatenated */
    size_t *sizes[4];
    void **owned;     /* what add_layout made */
    int owned_count;
} layout_share;

static void layout_share_free(layout_share *s)
{
    for (int n = 0; n < 4; n++) {
        free(s->parts[n]);
        free(s->sizes[n]);
    }
    for (int n = 0; n < s->owned_count; n++)
        free(s->owned[n]);
    free(s->owned);
    memset(s, 0, sizeof *s);
}

static int gather_layout(const moe_comm *c, const moe_ep_capture *cap, const moe_ep *ep,
                         layout_share *s, moe_status *st)
{
    const size_t row = moe_wire_dispatch(ep->cfg).bytes;
    const void *mine[4] = {cap->layout_wire, cap->layout_src, cap->layout_expert, cap->layout_count};
    const size_t bytes[4] = {row * (size_t)cap->slots, sizeof(int32_t) * (size_t)cap->slots,
                             sizeof(int32_t) * (size_t)cap->slots,
                             sizeof(int32_t) * (size_t)ep->local_experts};
    int rc = MOE_EXIT_OK;
    for (int n = 0; n < 4; n++) {
        s->sizes[n] = c->rank == 0 ? moe_xcalloc((size_t)c->ranks, sizeof(size_t)) : NULL;
        if (!rc)
            rc = moe_comm_gatherv_bytes(c, mine[n], bytes[n], &s->parts[n], s->sizes[n], st);
    }
    return rc;
}

static void *owned(layout_share *s, size_t bytes)
{
    s->owned = realloc(s->owned, sizeof(void *) * (size_t)(s->owned_count + 1));
    MOE_ASSERT(s->owned != NULL);
    return s->owned[s->owned_count++] = moe_xcalloc(bytes + 1, 1);
}

/* The layout tensors of each rank (docs/golden.md): its rows decoded to
 * fp32 as the expert GEMMs read them, with their fp8 scales, who each slot
 * holds, and the counts; masked ones shaped (EL, C, ...). */
static void add_layout(tensor_list *l, const moe_ep *ep, int G, layout_share *s)
{
    const moe_config *cfg = ep->cfg;
    const moe_wire w = moe_wire_dispatch(cfg);
    const moe_index d = cfg->hidden, blocks = (d + MOE_FP8_BLOCK - 1) / MOE_FP8_BLOCK;
    const int kind = moe_config_layout(cfg);
    const int64_t C = (int64_t)G * moe_config_max_tokens(cfg);
    size_t at[4] = {0, 0, 0, 0};
    char name[MOE_ST_NAME_MAX];
    for (int r = 0; r < G; r++) {
        const int64_t slots = (int64_t)(s->sizes[1][r] / sizeof(int32_t));
        const int64_t EL = (int64_t)(s->sizes[3][r] / sizeof(int32_t));
        const uint8_t *wire = (const uint8_t *)s->parts[0] + at[0];
        const int32_t *src = (const int32_t *)((char *)s->parts[1] + at[1]);
        /* (slots, ...) or, masked, (EL, C, ...) */
        const int ndim = kind == MOE_LAYOUT_MASKED ? 3 : 2;
        const int64_t d0 = kind == MOE_LAYOUT_MASKED ? EL : slots, d1 = kind == MOE_LAYOUT_MASKED ? C : d;
        float *x = owned(s, sizeof(float) * (size_t)(slots * d));
        moe_wire_decode(&w, wire, slots, x);
        snprintf(name, sizeof name, "dispatch.rank%d.layout.x", r);
        add(l, name, MOE_ST_F32, MOE_GOLDEN_DISPATCH, MOE_RULE_EXACT, x, ndim, d0, d1, d);
        if (w.dtype == MOE_DTYPE_FP8) {
            float *scale = owned(s, sizeof(float) * (size_t)(slots * blocks));
            moe_wire_scales(&w, wire, slots, scale);
            for (int64_t m = 0; m < slots; m++) /* empty slots: no scale */
                if (src[m] < 0)
                    memset(scale + m * blocks, 0, sizeof(float) * (size_t)blocks);
            snprintf(name, sizeof name, "dispatch.rank%d.layout.x.scale", r);
            add(l, name, MOE_ST_F32, MOE_GOLDEN_DISPATCH, MOE_RULE_EXACT, scale, ndim, d0,
                kind == MOE_LAYOUT_MASKED ? C : blocks, blocks);
        }
        snprintf(name, sizeof name, "dispatch.rank%d.layout.src", r);
        add(l, name, MOE_ST_I32, MOE_GOLDEN_DISPATCH, MOE_RULE_EXACT, src, ndim - 1, d0, C, 0);
        if (kind == MOE_LAYOUT_CONTIGUOUS) {
            snprintf(name, sizeof name, "dispatch.rank%d.layout.expert", r);
            add(l, name, MOE_ST_I32, MOE_GOLDEN_DISPATCH, MOE_RULE_EXACT, (char *)s->parts[2] + at[2], 1,
                slots, 0, 0);
        }
        snprintf(name, sizeof name, "dispatch.rank%d.layout.count", r);
        add(l, name, MOE_ST_I32, MOE_GOLDEN_DISPATCH, MOE_RULE_EXACT, (char *)s->parts[3] + at[3], 1, EL, 0, 0);
        for (int n = 0; n < 4; n++)
            at[n] += s->sizes[n][r];
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
    add(l, name, MOE_ST_F32, MOE_GOLDEN_BACKWARD, MOE_RULE_TOLERANCE, v, ndim, d0, d1, d2);
    add(l, truth_name, MOE_ST_F64, MOE_GOLDEN_BACKWARD, MOE_RULE_TOLERANCE, truth, ndim, d0, d1, d2);
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
    const moe_index S = cfg->shared_experts, k = cfg->topk, N = (moe_index)G * T;
    const double u = UNIT_ROUNDOFF;
    /* the fp32 chains of docs/backward.md: h over d, dA over d, dH, dx over 2f */
    const double pair_length = (double)(2 * d + 2 * f + 8);
    const double base = pair_length + (double)(k + S);
    add(l, "backward.dy", MOE_ST_F32, MOE_GOLDEN_BACKWARD, MOE_RULE_EXACT, b->grad_output, 2, N, d, 0);
    char name[MOE_ST_NAME_MAX];
    size_t at[4] = {0, 0, 0, 0};
    for (int r = 0; r < G; r++) {
        const int64_t rows = (int64_t)(b->sizes[0][r] / (sizeof(float) * (size_t)d));
        const int64_t pairs = (int64_t)(b->sizes[2][r] / sizeof(float));
        snprintf(name, sizeof name, "backward.rank%d.dy", r);
        add(l, name, MOE_ST_F32, MOE_GOLDEN_BACKWARD, MOE_RULE_EXACT, (char *)b->dy + at[0], 2, rows, d, 0);
        snprintf(name, sizeof name, "backward.rank%d.dx", r);
        tolerate(add(l, name, MOE_ST_F32, MOE_GOLDEN_BACKWARD, MOE_RULE_TOLERANCE, (char *)b->dx + at[1], 2, pairs, d, 0),
                 u * pair_length);
        snprintf(name, sizeof name, "backward.rank%d.dweight", r);
        tolerate(add(l, name, MOE_ST_F32, MOE_GOLDEN_BACKWARD, MOE_RULE_TOLERANCE, (char *)b->dweight + at[2], 1, pairs, 0, 0),
                 u * pair_length);
        if (b->sums) {
            snprintf(name, sizeof name, "backward.rank%d.dx_sum", r);
            tolerate(add(l, name, MOE_ST_F32, MOE_GOLDEN_BACKWARD, MOE_RULE_TOLERANCE, (char *)b->sums + at[3], 2, rows, d, 0),
                     u * (pair_length + (double)k));
        }
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

static int dump_set(const moe_comm *c, const moe_ep *ep, const float *x, const float *dy, const int32_t *ids,
                    const float *weights, const float *logits, const float *scores, double *bytes,
                    moe_status *st)
{
    const moe_config *cfg = ep->cfg;
    const int G = c->ranks, E = (int)cfg->experts, k = (int)cfg->topk, S = (int)cfg->shared_experts;
    const moe_index T = cfg->tokens, d = cfg->hidden, f = cfg->ffn;
    const int64_t N = (int64_t)G * T;

    /* 1. This rank's share: a captured forward and the truth. */
    float *y = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    float *x_scratch = moe_xmalloc(sizeof(float) * (size_t)(T * d));
    double *truth = moe_xmalloc(sizeof(double) * (size_t)(T * d));
    const bool bf16_combine = cfg->combine_dtype == MOE_DTYPE_BF16;
    double *allow = bf16_combine ? moe_xmalloc(sizeof(double) * (size_t)(T * d)) : NULL; /* (T, d) */
    moe_ep_capture cap = {0};
    moe_forward_stats stats;
    backward_share bwd = {0};
    int rc = ep->path->training ? backward_step(c, ep, x, dy, ids, weights, logits, y, &cap, &bwd, st)
                           : moe_ep_forward_ref(ep, x, ids, weights, y, &stats, &cap, st);
    if (rc) {
        backward_share_free(&bwd);
        free(allow);
        free(truth);
        free(x_scratch);
        free(y);
        return rc;
    }
    moe_truth_forward(cfg, MOE_TRUTH_EXACT, x, moe_ep_dispatched_tokens(ep, x, x_scratch), ids,
                      weights, T, G, truth, allow);

    /* 2. Gathered on rank 0. */
    const bool root = c->rank == 0;
    float *all_logits = root ? moe_xmalloc(sizeof(float) * (size_t)(N * E)) : NULL;
    float *all_scores = root ? moe_xmalloc(sizeof(float) * (size_t)(N * E)) : NULL;
    int32_t *all_ids = root ? moe_xmalloc(sizeof(int32_t) * (size_t)(N * k)) : NULL;
    float *all_weights = root ? moe_xmalloc(sizeof(float) * (size_t)(N * k)) : NULL;
    float *all_y = root ? moe_xmalloc(sizeof(float) * (size_t)(N * d)) : NULL;
    double *all_truth = root ? moe_xmalloc(sizeof(double) * (size_t)(N * d)) : NULL;
    double *all_allow = root && allow ? moe_xmalloc(sizeof(double) * (size_t)(N * d)) : NULL;
    moe_comm_gather_bytes(c, logits, sizeof(float) * (size_t)(T * E), all_logits);
    moe_comm_gather_bytes(c, scores, sizeof(float) * (size_t)(T * E), all_scores);
    moe_comm_gather_bytes(c, ids, sizeof(int32_t) * (size_t)(T * k), all_ids);
    moe_comm_gather_bytes(c, weights, sizeof(float) * (size_t)(T * k), all_weights);
    moe_comm_gather_bytes(c, y, sizeof(float) * (size_t)(T * d), all_y);
    moe_comm_gather_bytes(c, truth, sizeof(double) * (size_t)(T * d), all_truth);
    if (allow)
        moe_comm_gather_bytes(c, allow, sizeof(double) * (size_t)(T * d), all_allow);
    void *recv_x = NULL, *recv_token = NULL, *out = NULL, *pair = NULL, *sums = NULL;
    const bool reduced = cfg->combine == MOE_COMBINE_REDUCED;
    size_t *sizes[5];
    for (int n = 0; n < 5; n++)
        sizes[n] = root ? moe_xcalloc((size_t)G, sizeof(size_t)) : NULL;
    rc = moe_comm_gatherv_bytes(c, cap.recv_x, sizeof(float) * (size_t)(cap.rows * d), &recv_x, sizes[0], st);
    if (!rc)
        rc = moe_comm_gatherv_bytes(c, cap.recv_token, sizeof(int32_t) * (size_t)cap.rows, &recv_token, sizes[1], st);
    if (!rc)
        rc = moe_comm_gatherv_bytes(c, cap.out, sizeof(float) * (size_t)(cap.pairs * d), &out, sizes[2], st);
    if (!rc)
        rc = moe_comm_gatherv_bytes(c, cap.pair, sizeof(int32_t) * (size_t)(2 * cap.pairs), &pair, sizes[3], st);
    if (!rc && reduced)
        rc = moe_comm_gatherv_bytes(c, cap.sums, sizeof(float) * (size_t)(cap.rows * d), &sums, sizes[4], st);
    layout_share lay = {0};
    if (!rc)
        rc = gather_layout(c, &cap, ep, &lay, st);
    if (!rc && ep->path->training)
        rc = gather_backward(c, ep, &bwd, st);

    /* 3. Every rank still well (an injected fault stands for a failure
     * here)? Then rank 0 lays out the set and writes it. */
    moe_status local = {0};
    if (rc == MOE_EXIT_OK) {
        moe_fault_here(c, "dump", &local);
        rc = moe_comm_agree(c, &local);
        if (rc)
            *st = local;
    }
    if (root && rc == MOE_EXIT_OK) {
        tensor_list l = {0};
        const double u = UNIT_ROUNDOFF;
        float *tokens = moe_xmalloc(sizeof(float) * (size_t)(N * d));
        moe_synth_tokens(cfg->seed, 0, N, d, (float)cfg->init_scale, cfg->input_dist, tokens);
        moe_precision_weights(cfg->param_dtype, tokens, N * d);
        add(&l, "tokens.x", MOE_ST_F32, MOE_GOLDEN_INPUTS, MOE_RULE_EXACT, tokens, 2, N, d, 0);
        add(&l, "gate.weight", MOE_ST_F32, MOE_GOLDEN_INPUTS, MOE_RULE_EXACT, ep->gate, 2, E, d, 0);
        if (ep->bias)
            add(&l, "gate.bias", MOE_ST_F32, MOE_GOLDEN_INPUTS, MOE_RULE_EXACT, ep->bias, 1, E, 0, 0);
        if (ep->skew)
            add(&l, "router.skew", MOE_ST_F32, MOE_GOLDEN_INPUTS, MOE_RULE_EXACT, ep->skew, 1, E, 0, 0);
        weight_source sources[4] = {
            {cfg->seed, d, f, cfg->param_dtype, false, false}, {cfg->seed, d, f, cfg->param_dtype, false, true},
            {cfg->seed, d, f, cfg->param_dtype, true, false},  {cfg->seed, d, f, cfg->param_dtype, true, true}};
        if (cfg->dump_weights) {
            static const char *const names[4] = {"experts.w1", "experts.w2", "shared.w1", "shared.w2"};
            for (int n = 0; n < 4; n++) {
                const int64_t count = n < 2 ? E : S;
                if (count == 0)
                    continue;
                moe_golden_tensor *g = add(&l, names[n], MOE_ST_F32, MOE_GOLDEN_INPUTS, MOE_RULE_EXACT,
                                           NULL, 3, count, n % 2 ? d : 2 * f, n % 2 ? f : d);
                g->tensor.fill = fill_weight;
                g->tensor.ctx = &sources[n];
            }
        }
        /* router */
        float *selection = moe_xmalloc(sizeof(float) * (size_t)(N * E));
        for (int64_t m = 0; m < N * E; m++)
            selection[m] = ep->bias ? all_scores[m] + ep->bias[m % E] : all_scores[m];
        tolerate(add(&l, "router.logits", MOE_ST_F32, MOE_GOLDEN_ROUTER, MOE_RULE_TOLERANCE, all_logits, 2, N, E, 0), u * d);
        tolerate(add(&l, "router.scores", MOE_ST_F32, MOE_GOLDEN_ROUTER, MOE_RULE_TOLERANCE, all_scores, 2, N, E, 0), u * (d + E));
        tolerate(add(&l, "router.selection", MOE_ST_F32, MOE_GOLDEN_ROUTER, MOE_RULE_TOLERANCE, selection, 2, N, E, 0), u * (d + E + 1));
        add(&l, "router.topk_ids", MOE_ST_I32, MOE_GOLDEN_ROUTER, MOE_RULE_TOPK, all_ids, 2, N, k, 0);
        tolerate(add(&l, "router.topk_weights", MOE_ST_F32, MOE_GOLDEN_ROUTER, MOE_RULE_TOLERANCE, all_weights, 2, N, k, 0), u * (d + E + k));
        /* layout, from the ids and the placement */
        layout_counts lc;
        count_layout(ep, all_ids, N, T, &lc);
        add(&l, "layout.tokens_per_rank", MOE_ST_I32, MOE_GOLDEN_LAYOUT, MOE_RULE_EXACT, lc.per_rank, 1, G, 0, 0);
        add(&l, "layout.tokens_per_expert", MOE_ST_I32, MOE_GOLDEN_LAYOUT, MOE_RULE_EXACT, lc.per_expert, 1, E, 0, 0);
        add(&l, "layout.tokens_per_node", MOE_ST_I32, MOE_GOLDEN_LAYOUT, MOE_RULE_EXACT, lc.per_node, 1, lc.nodes, 0, 0);
        add(&l, "layout.is_token_in_rank", MOE_ST_BOOL, MOE_GOLDEN_LAYOUT, MOE_RULE_EXACT, lc.in_rank, 2, N, G, 0);
        add(&l, "layout.send_counts", MOE_ST_I32, MOE_GOLDEN_LAYOUT, MOE_RULE_EXACT, lc.send_counts, 2, G, G, 0);
        /* per rank: received rows, expert outputs */
        char name[MOE_ST_NAME_MAX];
        size_t at[5] = {0, 0, 0, 0, 0};
        for (int r = 0; r < G; r++) {
            const int64_t rows = (int64_t)(sizes[1][r] / sizeof(int32_t));
            const int64_t pairs = (int64_t)(sizes[3][r] / (2 * sizeof(int32_t)));
            snprintf(name, sizeof name, "dispatch.rank%d.x", r);
            add(&l, name, MOE_ST_F32, MOE_GOLDEN_DISPATCH, MOE_RULE_EXACT, (char *)recv_x + at[0], 2, rows, d, 0);
            snprintf(name, sizeof name, "dispatch.rank%d.token", r);
            add(&l, name, MOE_ST_I32, MOE_GOLDEN_DISPATCH, MOE_RULE_EXACT, (char *)recv_token + at[1], 1, rows, 0, 0);
            snprintf(name, sizeof name, "experts.rank%d.out", r);
            moe_golden_tensor *g = add(&l, name, MOE_ST_F32, MOE_GOLDEN_EXPERTS, MOE_RULE_TOLERANCE, (char *)out + at[2], 2, pairs, d, 0);
            tolerate(g, u * (d + f));
            g->bf16_step = bf16_combine && !reduced; /* each value was rounded to bf16 once */
            snprintf(name, sizeof name, "experts.rank%d.pair", r);
            add(&l, name, MOE_ST_I32, MOE_GOLDEN_EXPERTS, MOE_RULE_EXACT, (char *)pair + at[3], 2, pairs, 2, 0);
            if (reduced) { /* per received row, its pairs summed in slot order, as sent back */
                snprintf(name, sizeof name, "experts.rank%d.sum", r);
                g = add(&l, name, MOE_ST_F32, MOE_GOLDEN_EXPERTS, MOE_RULE_TOLERANCE, (char *)sums + at[4], 2, rows, d, 0);
                tolerate(g, u * (d + f + k));
                g->bf16_step = bf16_combine;
            }
            for (int n = 0; n < 5; n++)
                at[n] += sizes[n][r];
        }
        add_layout(&l, ep, G, &lay);
        /* output: --check's contract, per element (truth.h) */
        const double rel_y = moe_tolerance_for(cfg, 0.0).rel;
        const int iy = l.count, it = l.count + 1; /* add() may move the list: indices, not pointers */
        add(&l, "output.y", MOE_ST_F32, MOE_GOLDEN_OUTPUT, MOE_RULE_TOLERANCE, all_y, 2, N, d, 0);
        add(&l, "output.truth", MOE_ST_F64, MOE_GOLDEN_OUTPUT, MOE_RULE_TOLERANCE, all_truth, 2, N, d, 0);
        if (all_allow)
            add(&l, "output.allow", MOE_ST_F64, MOE_GOLDEN_OUTPUT, MOE_RULE_EXACT, all_allow, 2, N, d, 0);
        tolerate(&l.items[iy], rel_y);
        l.items[it].rel = rel_y;
        l.items[it].abs = l.items[iy].abs;
        l.items[iy].allow = l.items[it].allow = all_allow ? "output.allow" : NULL;

        if (ep->path->training)
            add_backward(&l, ep, G, &bwd);

        json_t *config_object = json_object();
        moe_config_describe(cfg, MOE_CMD_RUN, emit_config, config_object);
        json_object_set_new(config_object, "ranks", json_sprintf("%d", G));
        char *config = json_dumps(config_object, JSON_PRESERVE_ORDER);
        MOE_ASSERT(config != NULL);
        moe_golden_write(cfg->dump, l.items, l.count, config, bytes, &local);
        free(config);
        json_decref(config_object);
        layout_counts_free(&lc);
        free(selection);
        free(tokens);
        free(l.items);
    }
    for (int n = 0; n < 5; n++)
        free(sizes[n]);
    layout_share_free(&lay);
    free(sums);
    free(pair);
    free(out);
    free(recv_token);
    free(recv_x);
    free(all_allow);
    free(all_truth);
    free(all_y);
    free(all_weights);
    free(all_ids);
    free(all_scores);
    free(all_logits);
    moe_ep_capture_free(&cap);
    backward_share_free(&bwd);
    free(allow);
    free(truth);
    free(x_scratch);
    free(y);
    if (rc)
        return rc;
    if (moe_comm_agree(c, &local))
        *st = local;
    return local.code;
}

int moe_cli_dump(const moe_comm *c, const moe_ep *ep, const float *x, const float *dy,
                 double *bytes,
                 moe_status *st)
{
    const moe_index T = ep->cfg->tokens, E = ep->cfg->experts, k = ep->cfg->topk;
    moe_gemm_forbid_blas("the golden dump, whose tensors are the same bytes on every machine");
    float *logits = moe_xmalloc(sizeof(float) * (size_t)(T * E));  /* (T, E) */
    float *scores = moe_xmalloc(sizeof(float) * (size_t)(T * E));  /* (T, E) */
    int32_t *ids = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k)); /* (T, k) */
    float *weights = moe_xmalloc(sizeof(float) * (size_t)(T * k)); /* (T, k) */
    moe_ep_route(ep, x, logits, scores, ids, weights);
    const int rc = dump_set(c, ep, x, dy, ids, weights, logits, scores, bytes, st);
    free(weights);
    free(ids);
    free(scores);
    free(logits);
    moe_gemm_forbid_blas(NULL);
    return rc;
}
