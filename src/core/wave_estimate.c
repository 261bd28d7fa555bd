/* SPDX-License-Identifier: MIT */
/* wave_estimate.c — the two-resource estimate of a wave grouping (see
 * wave_estimate.h). */
#include "moe/wave_estimate.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe/common.h"
#include "moe/config.h"

double moe_waves_miss(int experts, int topk, int n)
{
    double miss = 1.0;
    for (int i = 0; i < topk; i++)
        miss *= experts - n - i > 0 ? (double)(experts - n - i) / (experts - i) : 0.0;
    return miss;
}

/* Per destination rank q and wave w, the rows one rank's T tokens send to q
 * (dispatch) and get back from it (combine), for waves of `kind`. */
static void rows_per_wave(const moe_wave_traffic *t, int kind, double *dispatch, double *combine)
{
    const moe_placement *p = t->placement;
    const int W = t->waves, E = p->experts, k = t->topk;
    const double T = (double)t->tokens;
    for (int q = 0; q < p->ranks; q++) {
        const int EL = moe_placement_local_experts(p, q);
        int after = 0; /* q's experts in waves after w (from the last wave down) */
        for (int w = W - 1; w >= 0; w--) {
            double *d = &dispatch[q * W + w], *c = &combine[q * W + w];
            if (kind == MOE_WAVES_TOKEN_CHUNKS) {
                const double chunk = (double)((w + 1) * t->tokens / W - w * t->tokens / W);
                *d = chunk * (1.0 - moe_waves_miss(E, k, EL));
                *c = t->reduced ? *d : chunk * k * EL / E;
                continue;
            }
            int n = 0; /* slot l is in wave floor(l W / EL) (moe_waves_init_by) */
            for (int l = 0; l < EL; l++)
                n += (int)((int64_t)l * W / EL) == w;
            *d = T * (1.0 - moe_waves_miss(E, k, n));
            *c = t->reduced ? T * (moe_waves_miss(E, k, after) - moe_waves_miss(E, k, after + n))
                            : T * k * n / E;
            after += n;
        }
    }
}

/* Rank r's estimate: its links' bytes, per tier and direction, over the
 * whole forward and in the first wave's dispatch and the last's combine. */
static void estimate_rank(const moe_wave_traffic *t, int kind, int r, const double *dispatch,
                          const double *combine, moe_wave_estimate *e)
{
    const moe_placement *p = t->placement;
    const int W = t->waves;
    const double db = t->dispatch_row_bytes, cb = t->combine_row_bytes;
    double all[MOE_TIERS][2] = {{0}}, head[MOE_TIERS][2] = {{0}}, tail[MOE_TIERS][2] = {{0}};
    double latency = 0.0;
    e->rows = 0.0;
    for (int q = 0; q < p->ranks; q++) {
        if (q == r) /* rows to itself cross no link */
            continue;
        const int tier = moe_link_tier(t->link, r, q);
        latency = fmax(latency, t->link->latency[tier]);
        for (int w = 0; w < W; w++) {
            /* out: r's tokens to q, and q's tokens' sums computed on r back;
             * in: the same the other way */
            const double out_d = dispatch[q * W + w] * db, out_c = combine[r * W + w] * cb;
            const double in_d = dispatch[r * W + w] * db, in_c = combine[q * W + w] * cb;
            all[tier][0] += out_d + out_c;
            all[tier][1] += in_d + in_c;
            e->rows += dispatch[q * W + w];
            if (w == 0) {
                head[tier][0] += out_d;
                head[tier][1] += in_d;
            }
            if (w == W - 1) {
                tail[tier][0] += out_c;
                tail[tier][1] += in_c;
            }
        }
    }
    e->comm = e->head = e->tail = 0.0;
    for (int tier = 0; tier < MOE_TIERS; tier++)
        for (int x = 0; x < 2; x++) {
            const double B = t->link->bandwidth[tier];
            e->comm = fmax(e->comm, all[tier][x] / B);
            e->head = fmax(e->head, head[tier][x] / B);
            e->tail = fmax(e->tail, tail[tier][x] / B);
        }
    e->head += latency;
    e->tail += latency;
    e->compute = kind == MOE_WAVES_TOKEN_CHUNKS && W > 1 ? t->compute_chunked : t->compute_whole;
    /* the rank computes its shared experts in the waits: in the head and
     * the tail, and in none when the routed experts never wait */
    e->shared = t->compute_shared;
    e->time = fmax(e->comm + latency, fmax(e->head + e->compute + e->tail, e->compute + e->shared));
}

void moe_waves_estimate(const moe_wave_traffic *t, int kind, moe_wave_estimate *out)
{
    const int G = t->placement->ranks, W = t->waves;
    MOE_ASSERT(W >= 1 && G >= 1);
    double *dispatch = moe_xmalloc(sizeof(double) * (size_t)(G * W));
    double *combine = moe_xmalloc(sizeof(double) * (size_t)(G * W));
    rows_per_wave(t, kind, dispatch, combine);
    memset(out, 0, sizeof *out);
    for (int r = 0; r < G; r++) {
        moe_wave_estimate e;
        estimate_rank(t, kind, r, dispatch, combine, &e);
        if (r == 0 || e.time > out->time)
            *out = e;
    }
    free(dispatch);
    free(combine);
}

int moe_waves_choose(const moe_wave_traffic *t, moe_wave_estimate est[2])
{
    int fewest = t->placement->experts;
    for (int r = 0; r < t->placement->ranks; r++)
        if (moe_placement_local_experts(t->placement, r) < fewest)
            fewest = moe_placement_local_experts(t->placement, r);
    moe_waves_estimate(t, MOE_WAVES_TOKEN_CHUNKS, &est[MOE_WAVES_TOKEN_CHUNKS]);
    if (fewest < t->waves) {
        memset(&est[MOE_WAVES_EXPERT_SLOTS], 0, sizeof est[MOE_WAVES_EXPERT_SLOTS]);
        return MOE_WAVE_BY_TOKENS;
    }
    moe_waves_estimate(t, MOE_WAVES_EXPERT_SLOTS, &est[MOE_WAVES_EXPERT_SLOTS]);
    return est[MOE_WAVES_TOKEN_CHUNKS].time < est[MOE_WAVES_EXPERT_SLOTS].time ? MOE_WAVE_BY_TOKENS
                                                                               : MOE_WAVE_BY_EXPERTS;
}
