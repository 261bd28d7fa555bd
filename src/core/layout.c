/* SPDX-License-Identifier: MIT */
/* layout.c — placement and the dispatch/combine plan (see layout.h). */
#include "moe/layout.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "moe/capacity.h"
#include "moe/common.h"
#include "moe/config.h"

void moe_placement_init(moe_placement *p, int experts, int ranks)
{
    MOE_ASSERT(experts >= 1 && ranks >= 1);
    p->ranks = ranks;
    p->experts = experts;
    p->first_expert = moe_xmalloc(sizeof(int) * (size_t)(ranks + 1));
    p->expert_rank = moe_xmalloc(sizeof(int) * (size_t)experts);
    const int base = experts / ranks, extra = experts % ranks;
    p->first_expert[0] = 0;
    for (int r = 0; r < ranks; r++) {
        p->first_expert[r + 1] = p->first_expert[r] + base + (r < extra);
        for (int e = p->first_expert[r]; e < p->first_expert[r + 1]; e++)
            p->expert_rank[e] = r;
    }
    MOE_ASSERT(p->first_expert[ranks] == experts);
}

void moe_placement_by_node(const moe_placement *p, int ranks_per_node, moe_placement *nodes)
{
    *nodes = (moe_placement){.experts = p->experts, .ranks = p->ranks / ranks_per_node};
    nodes->expert_rank = moe_xmalloc(sizeof(int) * (size_t)p->experts + 1);
    for (int e = 0; e < p->experts; e++)
        nodes->expert_rank[e] = p->expert_rank[e] / ranks_per_node;
}

void moe_placement_free(moe_placement *p)
{
    free(p->first_expert);
    free(p->expert_rank);
    memset(p, 0, sizeof *p);
}

int moe_group_node_limit(const moe_placement *p, int groups, int topk_groups, int ranks_per_node)
{
    const int nodes = (p->ranks + ranks_per_node - 1) / ranks_per_node;
    int *spans = moe_xcalloc((size_t)groups, sizeof(int)); /* nodes each group's experts lie on */
    for (int g = 0; g < groups; g++) {
        int last = -1;
        for (int e = g * p->experts / groups; e < (g + 1) * p->experts / groups; e++) {
            const int node = p->expert_rank[e] / ranks_per_node; /* ascending with e */
            spans[g] += node != last;
            last = node;
        }
    }
    int reach = 0;
    for (int kept = 0; kept < topk_groups && kept < groups; kept++) { /* the widest first */
        int widest = 0;
        for (int g = 1; g < groups; g++)
            widest = spans[g] > spans[widest] ? g : widest;
        reach += spans[widest];
        spans[widest] = 0;
    }
    free(spans);
    return reach < nodes ? reach : nodes;
}

void moe_waves_init(moe_waves *w, const moe_placement *p, int waves, moe_index tokens)
{
    moe_waves_init_by(w, p, waves, tokens, MOE_WAVE_BY_AUTO);
}

void moe_waves_init_by(moe_waves *w, const moe_placement *p, int waves, moe_index tokens, int by)
{
    MOE_ASSERT(waves >= 1);
    w->waves = waves;
    w->tokens = tokens;
    w->expert_wave = NULL;
    int fewest = p->experts;
    for (int r = 0; r < p->ranks; r++)
        if (moe_placement_local_experts(p, r) < fewest)
            fewest = moe_placement_local_experts(p, r);
    MOE_ASSERT(by != MOE_WAVE_BY_EXPERTS || fewest >= waves);
    if (fewest < waves || by == MOE_WAVE_BY_TOKENS) {
        w->kind = MOE_WAVES_TOKEN_CHUNKS;
        return;
    }
    w->kind = MOE_WAVES_EXPERT_SLOTS;
    w->expert_wave = moe_xmalloc(sizeof(int) * (size_t)p->experts);
    for (int r = 0; r < p->ranks; r++) {
        const int EL = moe_placement_local_experts(p, r);
        for (int l = 0; l < EL; l++)
            w->expert_wave[p->first_expert[r] + l] = (int)((int64_t)l * waves / EL);
    }
}

void moe_waves_free(moe_waves *w)
{
    free(w->expert_wave);
    w->expert_wave = NULL;
}

moe_index moe_wave_first_token(const moe_waves *w, int wave)
{
    return w->kind == MOE_WAVES_TOKEN_CHUNKS ? (moe_index)wave * w->tokens / w->waves : 0;
}

/* Whether pair (token, expert) travels in this wave; a dropped pair
 * (capacity.h) in none. */
static bool in_wave(const moe_waves *w, int wave, moe_index token, int expert)
{
    return expert != MOE_DROPPED && (!w || moe_wave_of(w, token, expert) == wave);
}

static void prefix_sums(const moe_index *count, int n, moe_index *offset)
{
    offset[0] = 0;
    for (int r = 0; r < n; r++)
        offset[r + 1] = offset[r] + count[r];
}

void moe_send_plan_build(moe_send_plan *plan, const moe_placement *p, const int32_t *ids,
                         moe_index tokens, int topk, const moe_waves *waves, int wave)
{
    const int G = p->ranks;
    plan->ranks = G;
    plan->topk = topk;
    plan->tokens = tokens;
    plan->row_count = moe_xcalloc((size_t)G, sizeof(moe_index));
    plan->row_offset = moe_xmalloc(sizeof(moe_index) * (size_t)(G + 1));
    plan->pair_count = moe_xcalloc((size_t)G, sizeof(moe_index));
    plan->pair_offset = moe_xmalloc(sizeof(moe_index) * (size_t)(G + 1));
    plan->slot_pair = moe_xmalloc(sizeof(moe_index) * (size_t)(tokens * topk));

    /* Pass 1: count rows (once per token per destination) and pairs. The last
     * token seen per destination gives the dedup without a scratch set. */
    moe_index *last_token = moe_xmalloc(sizeof(moe_index) * (size_t)G);
    for (int r = 0; r < G; r++)
        last_token[r] = -1;
    for (moe_index i = 0; i < tokens; i++)
        for (int s = 0; s < topk; s++) {
            int32_t e = ids[i * topk + s];
            MOE_ASSERT(e == MOE_DROPPED || (e >= 0 && e < p->experts));
            if (!in_wave(waves, wave, i, e))
                continue;
            int r = p->expert_rank[e];
            plan->pair_count[r]++;
            if (last_token[r] != i) {
                last_token[r] = i;
                plan->row_count[r]++;
            }
        }
    prefix_sums(plan->row_count, G, plan->row_offset);
    prefix_sums(plan->pair_count, G, plan->pair_offset);

    /* Pass 2: fill rows in token order. The receiver emits a row's pairs in
     * slot order, and rows in the order sent, so slot s of token i comes back
     * at the next free combine row of its destination. */
    plan->row_token = moe_xmalloc(sizeof(moe_index) * (size_t)plan->row_offset[G]);
    moe_index *next_row = moe_xmalloc(sizeof(moe_index) * (size_t)G);
    moe_index *next_pair = moe_xmalloc(sizeof(moe_index) * (size_t)G);
    memcpy(next_row, plan->row_offset, sizeof(moe_index) * (size_t)G);
    memcpy(next_pair, plan->pair_offset, sizeof(moe_index) * (size_t)G);
    for (int r = 0; r < G; r++)
        last_token[r] = -1;
    for (moe_index i = 0; i < tokens; i++)
        for (int s = 0; s < topk; s++) {
            const int32_t e = ids[i * topk + s];
            if (!in_wave(waves, wave, i, e)) {
                plan->slot_pair[i * topk + s] = -1;
                continue;
            }
            int r = p->expert_rank[e];
            if (last_token[r] != i) {
                last_token[r] = i;
                plan->row_token[next_row[r]++] = i;
            }
            plan->slot_pair[i * topk + s] = next_pair[r]++;
        }
    free(next_pair);
    free(next_row);
    free(last_token);
}

void moe_send_plan_free(moe_send_plan *plan)
{
    free(plan->row_count);
    free(plan->row_offset);
    free(plan->row_token);
    free(plan->pair_count);
    free(plan->pair_offset);
    free(plan->slot_pair);
    memset(plan, 0, sizeof *plan);
}

/* The local slot of expert e on `rank` if it is computed there in this wave,
 * else -1. Token chunks need no test: a received row is in the wave it came in. */
static int local_slot(const moe_placement *p, int rank, int32_t e, const moe_waves *waves,
                      int wave)
{
    const int local = e - p->first_expert[rank];
    if (local < 0 || local >= moe_placement_local_experts(p, rank))
        return -1;
    if (waves && waves->kind == MOE_WAVES_EXPERT_SLOTS && waves->expert_wave[e] != wave)
        return -1;
    return local;
}

void moe_recv_plan_build(moe_recv_plan *plan, const moe_placement *p, int rank,
                         const int32_t *meta_in, moe_index rows, int topk,
                         const moe_index *rows_from, const moe_waves *waves, int wave)
{
    const int G = p->ranks;
    const int EL = moe_placement_local_experts(p, rank);
    plan->local_experts = EL;
    plan->rows = rows;
    plan->expert_offset = moe_xcalloc((size_t)EL + 1, sizeof(moe_index));
    plan->source_pairs = moe_xcalloc((size_t)G, sizeof(moe_index));
    plan->wave_first = EL; /* a wave's expert slots are consecutive (moe_waves_init_by) */
    plan->wave_end = 0;
    for (int l = 0; l < EL; l++)
        if (local_slot(p, rank, p->first_expert[rank] + l, waves, wave) >= 0) {
            plan->wave_first = l < plan->wave_first ? l : plan->wave_first;
            plan->wave_end = l + 1;
        }

    /* Count pairs per local expert and per source rank. */
    moe_index pairs = 0, row = 0;
    for (int source = 0; source < G; source++)
        for (moe_index n = 0; n < rows_from[source]; n++, row++)
            for (int s = 0; s < topk; s++) {
                int local = local_slot(p, rank, moe_meta_id(meta_in + row * MOE_META_WORDS(topk), s), waves, wave);
                if (local >= 0) {
                    plan->expert_offset[local + 1]++;
                    plan->source_pairs[source]++;
                    pairs++;
                }
            }
    MOE_ASSERT(row == rows);
    for (int l = 0; l < EL; l++)
        plan->expert_offset[l + 1] += plan->expert_offset[l];
    plan->pairs = pairs;

    /* Pairs in row order, slots in order: the combine send row is the running
     * pair number. Each expert's list stays in ascending row order. */
    plan->expert_row = moe_xmalloc(sizeof(moe_index) * (size_t)pairs);
    plan->expert_pair = moe_xmalloc(sizeof(moe_index) * (size_t)pairs);
    plan->expert_slot = moe_xmalloc(sizeof(int) * (size_t)pairs);
    moe_index *next = moe_xmalloc(sizeof(moe_index) * (size_t)(EL + 1));
    memcpy(next, plan->expert_offset, sizeof(moe_index) * (size_t)(EL + 1));
    moe_index pair = 0;
    for (row = 0; row < rows; row++)
        for (int s = 0; s < topk; s++) {
            int local = local_slot(p, rank, moe_meta_id(meta_in + row * MOE_META_WORDS(topk), s), waves, wave);
            if (local >= 0) {
                plan->expert_row[next[local]] = row;
                plan->expert_slot[next[local]] = s;
                plan->expert_pair[next[local]] = pair++;
                next[local]++;
            }
        }
    MOE_ASSERT(pair == pairs);
    free(next);
}

void moe_recv_plan_free(moe_recv_plan *plan)
{
    free(plan->expert_offset);
    free(plan->expert_row);
    free(plan->expert_pair);
    free(plan->expert_slot);
    free(plan->source_pairs);
    memset(plan, 0, sizeof *plan);
}

void moe_expert_slots_build(moe_expert_slots *s, int kind, int experts, const moe_index *offset,
                            moe_index capacity, moe_index alignment)
{
    MOE_ASSERT(kind == MOE_LAYOUT_ROWS || kind == MOE_LAYOUT_MASKED || kind == MOE_LAYOUT_CONTIGUOUS);
    MOE_ASSERT(alignment >= 1);
    const int EL = experts;
    s->kind = kind;
    s->experts = EL;
    s->start = moe_xmalloc(sizeof(moe_index) * (size_t)(EL + 1));
    s->count = moe_xmalloc(sizeof(moe_index) * (size_t)EL + 1);
    s->start[0] = 0;
    for (int l = 0; l < EL; l++) {
        const moe_index n = offset[l + 1] - offset[l];
        s->count[l] = n;
        moe_index room = n; /* rows */
        if (kind == MOE_LAYOUT_MASKED) {
            MOE_ASSERT(n <= capacity); /* moe_config_validate: every token fits */
            room = capacity;
        } else if (kind == MOE_LAYOUT_CONTIGUOUS) {
            room = (n + alignment - 1) / alignment * alignment;
        }
        s->start[l + 1] = s->start[l] + room;
    }
    s->slots = s->start[EL];
}

void moe_expert_slots_free(moe_expert_slots *s)
{
    free(s->start);
    free(s->count);
    memset(s, 0, sizeof *s);
}

void moe_gather_rows(const float *src, moe_index width, const moe_index *index, moe_index rows,
                     float *out)
{
#pragma omp parallel for schedule(static)
    for (moe_index n = 0; n < rows; n++)
        memcpy(out + n * width, src + index[n] * width, sizeof(float) * (size_t)width);
}

void moe_gather_row_ptrs(const float *const *row_at, moe_index width, const moe_index *index,
                         moe_index rows, float *out)
{
#pragma omp parallel for schedule(static)
    for (moe_index n = 0; n < rows; n++)
        memcpy(out + n * width, row_at[index[n]], sizeof(float) * (size_t)width);
}

void moe_pack_meta(const int32_t *ids, const float *weights, int topk, const moe_index *row_token,
                   moe_index rows, moe_index first_token, int32_t *meta)
{
    const int id_words = MOE_META_ID_WORDS(topk);
    for (moe_index n = 0; n < rows; n++) {
        int32_t *out = meta + n * MOE_META_WORDS(topk);
        out[id_words - 1] = 0; /* the unused half of an odd k's last id word */
        for (int s = 0; s < topk; s++) {
            const int32_t e = ids[row_token[n] * topk + s];
            /* --experts is at most 4096; a dropped pair travels as -1, no one's */
            MOE_ASSERT(e >= MOE_DROPPED && e <= MOE_META_MAX_EXPERTS);
            const int16_t id = (int16_t)e;
            memcpy((char *)out + 2 * s, &id, sizeof id);
        }
        memcpy(out + id_words, weights + row_token[n] * topk, sizeof(float) * (size_t)topk);
        out[id_words + topk] = (int32_t)(first_token + row_token[n]);
    }
}

void moe_scatter_rows(const float *src, moe_index width, const moe_index *index, moe_index rows,
                      float *dst)
{
#pragma omp parallel for schedule(static)
    for (moe_index n = 0; n < rows; n++)
        memcpy(dst + index[n] * width, src + n * width, sizeof(float) * (size_t)width);
}

void moe_rows_per_destination(const moe_placement *p, const int32_t *ids, moe_index tokens,
                              int topk, const moe_waves *waves, double *rows)
{
    for (int r = 0; r < p->ranks; r++)
        rows[r] = 0.0;
    for (int w = 0; w < (waves ? waves->waves : 1); w++) {
        moe_send_plan plan;
        moe_send_plan_build(&plan, p, ids, tokens, topk, waves, w);
        for (int r = 0; r < p->ranks; r++)
            rows[r] += (double)plan.row_count[r];
        moe_send_plan_free(&plan);
    }
}

int moe_token_destinations(const moe_placement *p, const moe_waves *waves, const int32_t *ids,
                           int topk, moe_index token, int *dest, int *last)
{
    int n = 0;
    for (int s = 0; s < topk; s++) { /* insertion into the sorted list */
        const int e = ids[token * topk + s];
        if (e == MOE_DROPPED)
            continue;
        const int r = p->expert_rank[e];
        const int v = waves ? moe_wave_of(waves, token, e) : 0;
        int at = 0;
        while (at < n && dest[at] < r)
            at++;
        if (at < n && dest[at] == r) {
            last[at] = v > last[at] ? v : last[at];
            continue;
        }
        memmove(dest + at + 1, dest + at, sizeof(int) * (size_t)(n - at));
        memmove(last + at + 1, last + at, sizeof(int) * (size_t)(n - at));
        dest[at] = r, last[at] = v, n++;
    }
    return n;
}

void moe_nodes_per_token(const moe_placement *p, const int32_t *ids, moe_index tokens, int topk,
                         int ranks_per_node, double *hist)
{
    const int nodes = (p->ranks + ranks_per_node - 1) / ranks_per_node;
    moe_index *last_token = moe_xmalloc(sizeof(moe_index) * (size_t)nodes); /* dedup marks */
    for (int n = 0; n < nodes; n++)
        last_token[n] = -1;
    for (moe_index i = 0; i < tokens; i++) {
        int reached = 0;
        for (int s = 0; s < topk; s++) {
            if (ids[i * topk + s] == MOE_DROPPED)
                continue;
            const int node = p->expert_rank[ids[i * topk + s]] / ranks_per_node;
            if (last_token[node] != i) {
                last_token[node] = i;
                reached++;
            }
        }
        hist[reached] += 1.0;
    }
    free(last_token);
}

void moe_node_copies(const moe_placement *p, const int32_t *ids, moe_index tokens, int topk,
                     int ranks_per_node, int home, moe_node_rows *rows)
{
    const int R = ranks_per_node, home_node = home / R;
    bool *to_rank = moe_xcalloc((size_t)p->ranks, sizeof(bool));
    bool *to_node = moe_xcalloc((size_t)(p->ranks / R + 1), sizeof(bool));
    for (moe_index i = 0; i < tokens; i++) {
        for (int s = 0; s < topk; s++) {
            if (ids[i * topk + s] == MOE_DROPPED)
                continue;
            const int r = p->expert_rank[ids[i * topk + s]];
            to_rank[r] = to_node[r / R] = true;
        }
        for (int s = 0; s < topk; s++) {
            if (ids[i * topk + s] == MOE_DROPPED)
                continue;
            const int r = p->expert_rank[ids[i * topk + s]], n = r / R;
            const int relay = n * R + home % R; /* the rank of the home's local index there */
            if (to_rank[r]) { /* each destination rank once */
                to_rank[r] = false;
                if (n != home_node)
                    rows->flat_inter++;
                else if (r != home)
                    rows->flat_intra++;
                if (r != relay)
                    rows->two_stage_intra++;
            }
            if (to_node[n]) { /* each destination node once */
                to_node[n] = false;
                rows->two_stage_inter += n != home_node;
            }
        }
    }
    free(to_node);
    free(to_rank);
}

void moe_combine_locate(const moe_send_plan *plan, const float *const *from, moe_index hidden,
                        const float **slot_rows)
{
    for (moe_index n = 0; n < plan->tokens * plan->topk; n++) {
        const moe_index pair = plan->slot_pair[n];
        if (pair < 0)
            continue;
        int lo = 0, hi = plan->ranks - 1; /* the rank r with pair_offset[r] <= pair < [r+1] */
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (plan->pair_offset[mid] <= pair)
                lo = mid;
            else
                hi = mid - 1;
        }
        slot_rows[n] = from[lo] + (pair - plan->pair_offset[lo]) * hidden;
    }
}

__attribute__((target_clones("avx2", "default")))
void moe_combine_reduce(const float *const *slot_rows, const float *weights, moe_index tokens,
                        int topk, moe_index hidden, float *y)
{
#pragma omp parallel for schedule(static)
    for (moe_index i = 0; i < tokens; i++) {
        float *out = y + i * hidden; /* (d) */
#pragma omp simd
        for (moe_index j = 0; j < hidden; j++)
            out[j] = 0.0f;
        for (int s = 0; s < topk; s++) {
            const float *row = slot_rows[i * topk + s]; /* (d) */
            if (!row)
                continue;
            if (!weights) {
#pragma omp simd
                for (moe_index j = 0; j < hidden; j++)
                    out[j] += row[j];
                continue;
            }
            const float w = weights[i * topk + s];
#pragma omp simd
            for (moe_index j = 0; j < hidden; j++)
                out[j] += w * row[j];
        }
    }
}

/* --expert-layout: what each layout needs (layout.h). */
int moe_layout_validate(const moe_config *cfg, moe_status *st)
{
    const int64_t A = cfg->expert_alignment;
    if (A & (A - 1))
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--expert-alignment must be a power of two in [1, 1024], got %lld", (long long)A);
    const int layout = moe_config_layout(cfg);
    if (cfg->mode == MOE_MODE_LOW_LATENCY && layout == MOE_LAYOUT_ROWS)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--mode low-latency receives into the masked layout: --expert-layout must "
                        "be auto, masked or contiguous, got rows");
    if (cfg->backward && layout != MOE_LAYOUT_ROWS && cfg->mode == MOE_MODE_NORMAL)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--backward reads the forward's received rows in place: --expert-layout "
                        "must be auto or rows, got %s", moe_config_choice_name("expert-layout", layout));
    return MOE_EXIT_OK;
}

double moe_layout_memory(const moe_config *cfg, int ranks)
{
    const double EL = (double)moe_config_most_local_experts(cfg, ranks);
    const double T = (double)cfg->tokens, k = (double)cfg->topk, d = (double)cfg->hidden;
    if (moe_config_layout(cfg) == MOE_LAYOUT_MASKED) /* whole: its empty slots are never touched,
                                                       but the allocation must succeed */
        return EL * ranks * (double)moe_config_max_tokens(cfg) * d * 4.0;
    if (moe_config_layout(cfg) == MOE_LAYOUT_CONTIGUOUS) /* its rows and padding */
        return (T * k + EL * (double)(cfg->expert_alignment - 1)) * d * 4.0;
    return 0.0;
}
