/* SPDX-License-Identifier: MIT */
/* layout.h — expert placement and the dispatch/combine plan of one rank.
 *
 * Pure: no MPI. Given the routing of a rank's T tokens, this module says which
 * rows go to which rank (dispatch, deduplicated: a token is sent to a rank
 * once however many of its experts live there), which expert each received
 * row must visit, and where each expert output lands on the way back
 * (combine). The comm layer only moves the buffers this module lays out.
 *
 * Orders, fixed so that every path issues the same GEMMs:
 *   dispatch rows to a destination: ascending local token;
 *   received rows: by source rank, then as sent — i.e. ascending global id;
 *   pairs of a received row: in the token's top-k slot order;
 *   rows of one expert: ascending received row, i.e. ascending global id.
 *
 * Waves split one forward into W independent rounds of the same plan: a
 * (token, slot) pair belongs to exactly one wave, and the plan of wave w is
 * the plan above restricted to its pairs (dedup per rank per wave).
 */
#ifndef MOE_LAYOUT_H
#define MOE_LAYOUT_H

#include <stdint.h>

#include "moe/dims.h"
#include "moe/config.h"

typedef struct {
    int ranks;           /* G */
    int experts;         /* E */
    int *first_expert;   /* (G+1) rank r holds experts [first_expert[r], first_expert[r+1]) */
    int *expert_rank;    /* (E) the rank holding expert e */
} moe_placement;

/* Contiguous blocks; when G does not divide E the first E%G ranks hold one
 * more expert, so blocks differ by at most one. With E < G the last G-E
 * ranks hold none (they route and combine, and receive nothing). */
void moe_placement_init(moe_placement *p, int experts, int ranks);
void moe_placement_free(moe_placement *p);
static inline int moe_placement_local_experts(const moe_placement *p, int rank)
{
    return p->first_expert[rank + 1] - p->first_expert[rank];
}

/* The most nodes (of ranks_per_node ranks each) one token can reach when
 * the router keeps cfg->topk_groups of cfg->groups expert groups (groups
 * of E/groups consecutive experts): the nodes of the topk_groups groups
 * that span the most, at most all of them. DeepSeek-V3's node limit
 * (groups = nodes, keep 4) makes it topk_groups; groups that do not map
 * onto nodes may leave it at every node. */
int moe_group_node_limit(const moe_placement *p, int groups, int topk_groups, int ranks_per_node);

enum moe_wave_kind {
    MOE_WAVES_EXPERT_SLOTS, /* wave = a group of each rank's local expert slots */
    MOE_WAVES_TOKEN_CHUNKS, /* wave = a chunk of each rank's tokens, all experts */
};

typedef struct {
    enum moe_wave_kind kind;
    int waves;         /* W */
    moe_index tokens;  /* T */
    int *expert_wave;  /* (E) expert slots: the wave of expert e */
} moe_waves;

/* Expert-slot waves when every rank holds at least W experts: local slot l of
 * a rank with EL experts is in wave floor(l*W/EL), so every wave of every
 * rank has EL/W experts, give or take one. Otherwise token chunks: wave w is
 * local tokens [floor(w*T/W), floor((w+1)*T/W)). Cannot fail.
 * moe_waves_init_by chooses as `by` (enum moe_wave_by) says: auto as above,
 * tokens always token chunks, experts expert slots (every rank must hold at
 * least W experts). Expert slots send a token once per wave that holds one
 * of its experts on a rank, token chunks once per rank, as one wave does. */
void moe_waves_init(moe_waves *w, const moe_placement *p, int waves, moe_index tokens);
void moe_waves_init_by(moe_waves *w, const moe_placement *p, int waves, moe_index tokens, int by);
void moe_waves_free(moe_waves *w);
moe_index moe_wave_first_token(const moe_waves *w, int wave);
static inline int moe_wave_of(const moe_waves *w, moe_index token, int expert)
{
    if (w->kind == MOE_WAVES_EXPERT_SLOTS)
        return w->expert_wave[expert];
    if (w->tokens == 0)
        return 0;
    /* the largest wave whose first token is <= token */
    int wave = (int)(((token + 1) * w->waves - 1) / w->tokens);
    return wave < w->waves ? wave : w->waves - 1;
}

/* The send side of one rank: dispatch rows out, combine rows back. */
typedef struct {
    int ranks;                /* G */
    int topk;                 /* k */
    moe_index tokens;         /* T */
    moe_index *row_count;     /* (G) dispatch rows to each destination */
    moe_index *row_offset;    /* (G+1) prefix sums of row_count */
    moe_index *row_token;     /* (row_offset[G]) local token of each dispatch row */
    moe_index *pair_count;    /* (G) combine rows coming back from each destination */
    moe_index *pair_offset;   /* (G+1) prefix sums of pair_count */
    moe_index *slot_pair;     /* (T, k) combine receive row holding token i, slot s;
                                 -1 for a slot of another wave */
} moe_send_plan;

/* The plan of wave `wave` of `waves`, or of the whole forward when waves is NULL. */
void moe_send_plan_build(moe_send_plan *plan, const moe_placement *p, const int32_t *ids,
                         moe_index tokens, int topk, const moe_waves *waves, int wave);
void moe_send_plan_free(moe_send_plan *plan);

/* What travels with each dispatched row besides its d values, each in the
 * smallest type that holds it: the token's top-k ids as int16 (two to a
 * word; E <= MOE_META_MAX_EXPERTS), its k gate weights as fp32 bits (the
 * receiver weights the outputs it sums, or the activation before L2), and
 * its global token id as int32 (the payload identifies itself, as DeepEP's
 * tests do): ceil(k/2) + k + 1 int32 words. */
#define MOE_META_MAX_EXPERTS 32767
#define MOE_META_ID_WORDS(topk) (((topk) + 1) / 2)
#define MOE_META_WORDS(topk) (MOE_META_ID_WORDS(topk) + (topk) + 1)

/* The bytes rows put on the wire: wire.h. */

/* meta (rows, MOE_META_WORDS(k)) for the tokens row_token[0 .. rows-1] of
 * ids/weights (T, k), whose global ids start at first_token. */
void moe_pack_meta(const int32_t *ids, const float *weights, int topk, const moe_index *row_token,
                   moe_index rows, moe_index first_token, int32_t *meta);

/* The expert id of slot s in a row's meta. */
static inline int32_t moe_meta_id(const int32_t *row_meta, int slot)
{
    int16_t id;
    __builtin_memcpy(&id, (const char *)row_meta + 2 * slot, sizeof id);
    return id;
}

/* The global token id in a row's meta. */
static inline int32_t moe_meta_token(const int32_t *row_meta, int topk)
{
    return row_meta[MOE_META_ID_WORDS(topk) + topk];
}

/* The gate weight of slot s in a row's meta. */
static inline float moe_meta_weight(const int32_t *row_meta, int topk, int slot)
{
    float w;
    __builtin_memcpy(&w, &row_meta[MOE_META_ID_WORDS(topk) + slot], sizeof w);
    return w;
}

/* The receive side of one rank: which received row visits which local expert,
 * and where the output goes in the combine send buffer. */
typedef struct {
    int local_experts;         /* EL */
    moe_index rows;            /* received rows */
    moe_index pairs;           /* (row, local expert) pairs = combine send rows */
    moe_index *expert_offset;  /* (EL+1) pairs of local expert l: [expert_offset[l], [l+1]) */
    moe_index *expert_row;     /* (pairs) received row of each pair, grouped by expert */
    moe_index *expert_pair;    /* (pairs) combine send row of each pair, grouped by expert */
    int *expert_slot;          /* (pairs) top-k slot of each pair in its row */
    moe_index *source_pairs;   /* (G) combine rows going back to each source rank */
    int wave_first, wave_end;  /* the local experts of this wave: [wave_first, wave_end) */
} moe_recv_plan;

/* meta_in (rows, 2k): the meta of each received row, as sent with it;
 * rows_from (G): rows received from each source. Only ids held by `rank` and
 * in wave `wave` (all, when waves is NULL) are used. */
void moe_recv_plan_build(moe_recv_plan *plan, const moe_placement *p, int rank,
                         const int32_t *meta_in, moe_index rows, int topk,
                         const moe_index *rows_from, const moe_waves *waves, int wave);
void moe_recv_plan_free(moe_recv_plan *plan);

/* Where each local expert's rows sit in the tensor the expert GEMMs read
 * (--expert-layout, config.h), built from a receive plan: slot j of local
 * expert l holds the receive plan's pair expert_offset[l] + j, so an expert's rows
 * keep ascending global token order in every layout.
 *   rows        no tensor: each expert's rows are gathered from the
 *               received rows into a work buffer (start[] = expert_offset)
 *   masked      (EL, C, d): expert l's block starts at slot l*C, its first
 *               count[l] slots hold rows, the rest is empty; C = G*N slots,
 *               room for every token of every rank (DeepEP's low-latency
 *               receive buffer, DeepGEMM's masked grouped-GEMM input)
 *   contiguous  (M, d): the experts' blocks back to back, each padded to a
 *               multiple of the alignment A; M = the sum of the padded
 *               counts (DeepGEMM's contiguous grouped-GEMM input)
 * Empty and padding slots are never computed and never reach the output. */
typedef struct {
    int kind;           /* enum moe_layout_kind (config.h), never auto */
    int experts;        /* EL */
    moe_index slots;    /* rows of the tensor: EL*C, M, or the pairs (rows) */
    moe_index *start;   /* (EL+1) first slot of each expert's block; start[EL] = slots */
    moe_index *count;   /* (EL) rows of each expert */
} moe_expert_slots;

/* offset (EL+1): expert l's rows are [offset[l], offset[l+1]) of the pairs
 * (a receive plan's expert_offset); capacity: C (masked); alignment: A
 * (contiguous). */
void moe_expert_slots_build(moe_expert_slots *s, int kind, int experts, const moe_index *offset,
                            moe_index capacity, moe_index alignment);
void moe_expert_slots_free(moe_expert_slots *s);

/* out (rows, width) = src (, width) rows at index[0 .. rows-1]. */
void moe_gather_rows(const float *src, moe_index width, const moe_index *index, moe_index rows,
                     float *out);
/* out (rows, width) = the rows row_at[index[0 .. rows-1]] points to: rows
 * that may lie in several buffers (a rank's own never leave its tokens). */
void moe_gather_row_ptrs(const float *const *row_at, moe_index width, const moe_index *index,
                         moe_index rows, float *out);

/* dst (, width) rows at index[0 .. rows-1] = src (rows, width). */
void moe_scatter_rows(const float *src, moe_index width, const moe_index *index, moe_index rows,
                      float *dst);

/* nodes = p's experts by node of ranks_per_node consecutive ranks: expert
 * e on node expert_rank[e] / R, of G / R nodes (expert_rank allocated;
 * moe_placement_free frees it). */
void moe_placement_by_node(const moe_placement *p, int ranks_per_node, moe_placement *nodes);

/* rows (G): dispatch rows this rank sends to each rank in one forward, the
 * sum over the waves of their deduplicated plans (waves NULL: one plan). */
void moe_rows_per_destination(const moe_placement *p, const int32_t *ids, moe_index tokens,
                              int topk, const moe_waves *waves, double *rows);

/* The distinct ranks p places token `token`'s k experts (ids (T, k)) on, in
 * ascending order, into dest, each with the last wave (of waves; NULL: 0)
 * holding one of the token's experts there, into last. Returns how many
 * (at most k). */
int moe_token_destinations(const moe_placement *p, const moe_waves *waves, const int32_t *ids,
                           int topk, moe_index token, int *dest, int *last);

/* hist (nodes + 1) += the number of tokens of ids (T, k) whose experts sit on
 * exactly n distinct virtual nodes of ranks_per_node ranks. */
void moe_nodes_per_token(const moe_placement *p, const int32_t *ids, moe_index tokens, int topk,
                         int ranks_per_node, double *hist);

/* The rows a rank's tokens (home rank `home`) put on each tier, added to
 * rows: the flat dispatch sends a token once per destination rank (inter:
 * ranks on other nodes; intra: other ranks of its node); the two-stage
 * dispatch once per other node reached (inter), then from each node's relay
 * (the rank of home's local index there) once per other rank holding one
 * of its experts (intra). Nodes of ranks_per_node consecutive ranks. */
typedef struct {
    double flat_inter, flat_intra, two_stage_inter, two_stage_intra;
} moe_node_rows;
void moe_node_copies(const moe_placement *p, const int32_t *ids, moe_index tokens, int topk,
                     int ranks_per_node, int home, moe_node_rows *rows);

/* slot_rows (T, k): for every (token, slot) of `plan`, the address of its
 * expert output row: from[r] is where the pairs coming back from rank r
 * start (the combine receive buffer, or for this rank's own pairs the
 * combine send buffer, which they never leave). */
void moe_combine_locate(const moe_send_plan *plan, const float *const *from, moe_index hidden,
                        const float **slot_rows);

/* y (T, d) = sum over slots s = 0 .. k-1, in that order, of
 * weights[i,s] * slot_rows[i,s][0 .. d), fp32; weights NULL: plain sum (the
 * weights were applied before L2). A NULL row (a dropped pair) adds nothing. */
void moe_combine_reduce(const float *const *slot_rows, const float *weights, moe_index tokens,
                        int topk, moe_index hidden, float *y);

/* --expert-layout and --expert-alignment: A a power of two; the
 * low-latency mode receives into a slot layout, the backward reads the
 * received rows. MOE_EXIT_OK or MOE_EXIT_USAGE with st set. */
int moe_layout_validate(const moe_config *cfg, moe_status *st);

/* Bytes of the layout tensor (--expert-layout), fp32, on a rank: a
 * masked one whole, a contiguous one's rows and padding, none for rows. */
double moe_layout_memory(const moe_config *cfg, int ranks);

#endif
