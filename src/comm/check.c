/* SPDX-License-Identifier: MIT */
/* check.c — collective comparison with the dense truth (see check.h). */
#include "moe/check.h"

#include <math.h>
#include <stdlib.h>

void moe_check_collective(const moe_comm *c, const moe_config *cfg, const float *y,
                          const double *truth, const double *allow, moe_run_summary *s)
{
    const moe_index T = cfg->tokens, d = cfg->hidden, n = T * d;
    const double count = (double)c->ranks * (double)n;
    s->ref_rms = sqrt(moe_comm_sum(c, moe_sum_squares(truth, n)) / count);
    s->tol = moe_tolerance_for(cfg, s->ref_rms);

    moe_compare_stats mine;
    moe_compare(y, truth, allow, n, s->tol, &mine);
    s->cmp.max_abs = moe_comm_max(c, mine.max_abs);
    s->cmp.max_rel = moe_comm_max(c, mine.max_rel);

    /* The location reported: the first non-finite value if any, else the
     * element that used the most of its tolerance. */
    const bool nonfinite = mine.first_nonfinite >= 0;
    s->nonfinite = moe_comm_max(c, nonfinite ? 1.0 : 0.0) > 0.0;
    double key = s->nonfinite ? (nonfinite ? 1.0 : 0.0) : mine.max_used;
    moe_comm_maxloc(c, key, &s->worst_rank);
    s->cmp.max_used = moe_comm_max(c, mine.max_used);
    long long where[2] = {-1, -1};
    moe_index at = nonfinite ? mine.first_nonfinite : mine.worst;
    if (at >= 0) {
        where[0] = (long long)(c->rank * T + at / d);
        where[1] = (long long)(at % d);
    }
    moe_comm_bcast(c, where, sizeof where, s->worst_rank);
    s->worst_token = where[0];
    s->worst_column = where[1];
    s->checked = true;
}

void moe_truth_collective(const moe_comm *c, const moe_config *cfg, const float *x,
                          const float *x_dispatched, const int32_t *ids, const float *weights,
                          const int32_t *pair_rank, double *truth, double *allow)
{
    const moe_index T = cfg->tokens, d = cfg->hidden, k = cfg->topk;
    const int G = c->ranks;
    if (!moe_config_truth_shares(cfg)) {
        moe_truth_forward_placed(cfg, MOE_TRUTH_BLAS, x, x_dispatched, ids, weights, T, G,
                                 pair_rank, truth, allow);
        return;
    }
    const size_t N = (size_t)G * (size_t)T;
    float *all_x = moe_xmalloc(sizeof(float) * N * (size_t)d + 1);
    int32_t *all_ids = moe_xmalloc(sizeof(int32_t) * N * (size_t)k + 1);
    float *all_weights = moe_xmalloc(sizeof(float) * N * (size_t)k + 1);
    int32_t *all_at = pair_rank ? moe_xmalloc(sizeof(int32_t) * N * (size_t)k + 1) : NULL;
    moe_comm_allgather_bytes(c, x_dispatched, sizeof(float) * (size_t)(T * d), all_x);
    moe_comm_allgather_bytes(c, ids, sizeof(int32_t) * (size_t)(T * k), all_ids);
    moe_comm_allgather_bytes(c, weights, sizeof(float) * (size_t)(T * k), all_weights);
    if (pair_rank)
        moe_comm_allgather_bytes(c, pair_rank, sizeof(int32_t) * (size_t)(T * k), all_at);
    double *share = moe_xmalloc(sizeof(double) * N * (size_t)d + 1);
    double *share_allow = allow ? moe_xmalloc(sizeof(double) * N * (size_t)d + 1) : NULL;
    moe_truth_forward_share(cfg, MOE_TRUTH_BLAS, all_x, all_ids, all_weights, (moe_index)N, G,
                            all_at, c->rank, share, share_allow);
    free(all_at);
    free(all_weights);
    free(all_ids);
    free(all_x);
    moe_comm_sum_scattered(c, share, T * d, truth);
    if (allow)
        moe_comm_sum_scattered(c, share_allow, T * d, allow);
    free(share_allow);
    free(share);
    moe_truth_add_shared(cfg, MOE_TRUTH_BLAS, x, T, truth);
    moe_truth_round_output(cfg, truth, allow, T * d);
}

void moe_gather_layer_tokens(const moe_comm *c, const moe_config *cfg, const float *x,
                             const float *dy, const int32_t *ids, const float *weights,
                             moe_layer_tokens *all)
{
    const size_t T = (size_t)cfg->tokens, d = (size_t)cfg->hidden, k = (size_t)cfg->topk;
    const size_t N = (size_t)c->ranks * T;
    all->x = moe_xmalloc(sizeof(float) * N * d);
    all->dy = moe_xmalloc(sizeof(float) * N * d);
    all->weights = moe_xmalloc(sizeof(float) * N * k);
    all->ids = moe_xmalloc(sizeof(int32_t) * N * k);
    moe_comm_allgather_bytes(c, x, sizeof(float) * T * d, all->x);
    moe_comm_allgather_bytes(c, dy, sizeof(float) * T * d, all->dy);
    moe_comm_allgather_bytes(c, weights, sizeof(float) * T * k, all->weights);
    moe_comm_allgather_bytes(c, ids, sizeof(int32_t) * T * k, all->ids);
}

void moe_layer_tokens_free(moe_layer_tokens *all)
{
    free(all->x);
    free(all->dy);
    free(all->weights);
    free(all->ids);
}
