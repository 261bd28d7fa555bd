/* SPDX-License-Identifier: MIT */
/* check_backward.c — the layer's gradients against central finite
 * differences of an fp64 forward written out here from the definition
 * (router, experts, shared experts), and the fp32 expert backward against
 * the fp64 one. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/backward.h"
#include "moe/config.h"
#include "moe/gemm.h"
#include "moe/rng.h"
#include "suites.h"

enum { T = 6, D = 8, F = 5, E = 6, K = 2, S = 1 };

/* Every parameter of a small layer in fp64, and its routing (fixed: the
 * selection passes no gradient, and the steps below are too small to change
 * it). */
typedef struct {
    double x[T * D], gate[E * D], w1[E][2 * F * D], w2[E][D * F], sw1[S][2 * F * D],
        sw2[S][D * F], dy[T * D];
    int32_t ids[T * K];
    moe_router router;
    int weight_at;
} layer;

static double uniform(uint32_t tensor, uint64_t n, double scale)
{
    return (double)moe_synth_value(11, (enum moe_tensor)tensor, 0, n, (float)scale);
}

static void fill(double *a, int n, uint32_t tensor, double scale)
{
    for (int m = 0; m < n; m++)
        a[m] = uniform(tensor, (uint64_t)m, scale);
}

/* scores (E) and weights (K) of token i, from the definition. */
static void route(const layer *L, int i, double *p, double *w)
{
    const moe_router *r = &L->router;
    const bool sigmoid = r->kind == MOE_ROUTER_DEEPSEEK_V3 && r->bias;
    double sum = 0.0, logit[E];
    for (int e = 0; e < E; e++) {
        logit[e] = 0.0;
        for (int j = 0; j < D; j++)
            logit[e] += L->x[i * D + j] * L->gate[e * D + j];
        logit[e] += r->skew ? r->skew[e] : 0.0;
        p[e] = sigmoid ? 1.0 / (1.0 + exp(-logit[e])) : exp(logit[e]);
        sum += p[e];
    }
    if (!sigmoid)
        for (int e = 0; e < E; e++)
            p[e] /= sum;
    double sel = 0.0;
    for (int s = 0; s < K; s++)
        sel += p[L->ids[i * K + s]];
    for (int s = 0; s < K; s++)
        w[s] = r->route_scale * p[L->ids[i * K + s]] / (r->normalize || sigmoid ? sel : 1.0);
}

/* out (D) = FFN of row x (D) with w1 (2F, D), w2 (D, F), its activation
 * scaled by `scale` (the gate at activation, or 1). */
static void ffn(const double *w1, const double *w2, const double *x, double scale, double *out)
{
    double a[F];
    for (int c = 0; c < F; c++) {
        double g = 0.0, u = 0.0;
        for (int j = 0; j < D; j++) {
            g += x[j] * w1[c * D + j];
            u += x[j] * w1[(F + c) * D + j];
        }
        a[c] = scale * g / (1.0 + exp(-g)) * u;
    }
    for (int j = 0; j < D; j++) {
        out[j] = 0.0;
        for (int c = 0; c < F; c++)
            out[j] += a[c] * w2[j * F + c];
    }
}

/* L = <dy, y> for the layer's forward. */
static double loss(const layer *L)
{
    double total = 0.0;
    for (int i = 0; i < T; i++) {
        double p[E], w[K], y[D] = {0}, out[D];
        route(L, i, p, w);
        for (int s = 0; s < K; s++) {
            const int e = L->ids[i * K + s];
            const bool at_act = L->weight_at == MOE_WEIGHT_AT_ACTIVATION;
            ffn(L->w1[e], L->w2[e], L->x + i * D, at_act ? w[s] : 1.0, out);
            for (int j = 0; j < D; j++)
                y[j] += (at_act ? 1.0 : w[s]) * out[j];
        }
        for (int sh = 0; sh < S; sh++) {
            ffn(L->sw1[sh], L->sw2[sh], L->x + i * D, 1.0, out);
            for (int j = 0; j < D; j++)
                y[j] += out[j];
        }
        for (int j = 0; j < D; j++)
            total += L->dy[i * D + j] * y[j];
    }
    return total;
}

/* The gradients the library computes, in the layer's shapes. */
typedef struct {
    double x[T * D], gate[E * D], w1[E][2 * F * D], w2[E][D * F], sw1[S][2 * F * D],
        sw2[S][D * F];
} grads;

static void backward(const layer *L, grads *g)
{
    memset(g, 0, sizeof *g);
    double dweights[T * K] = {0}, logits[T * E];
    for (int e = 0; e < E; e++) {
        double xe[T * D], dye[T * D], gate[T], dx[T * D], dgate[T];
        int row[T], slot[T], n = 0;
        for (int i = 0; i < T; i++)
            for (int s = 0; s < K; s++)
                if (L->ids[i * K + s] == e) {
                    double p[E], w[K];
                    route(L, i, p, w);
                    row[n] = i;
                    slot[n] = s;
                    gate[n] = w[s];
                    memcpy(xe + n * D, L->x + i * D, sizeof(double) * D);
                    memcpy(dye + n * D, L->dy + i * D, sizeof(double) * D);
                    n++;
                }
        moe_expert_backward_f64(MOE_TRUTH_EXACT, L->w1[e], L->w2[e], xe, dye, gate, L->weight_at,
                                n, D, F, dx, dgate, g->w1[e], g->w2[e]);
        for (int m = 0; m < n; m++) {
            for (int j = 0; j < D; j++)
                g->x[row[m] * D + j] += dx[m * D + j];
            dweights[row[m] * K + slot[m]] = dgate[m];
        }
    }
    for (int i = 0; i < T; i++)
        for (int e = 0; e < E; e++) {
            logits[i * E + e] = 0.0;
            for (int j = 0; j < D; j++)
                logits[i * E + e] += L->x[i * D + j] * L->gate[e * D + j];
        }
    moe_router_backward(&L->router, logits, L->ids, dweights, T, logits);
    float gate32[E * D], x32[T * D]; /* moe_gate_backward reads fp32 operands */
    double gate_copy[E * D], x_copy[T * D];
    for (int m = 0; m < E * D; m++)
        gate32[m] = (float)(gate_copy[m] = L->gate[m]);
    for (int m = 0; m < T * D; m++)
        x32[m] = (float)(x_copy[m] = L->x[m]);
    for (int m = 0; m < E * D; m++) /* the parameters are fp32 values (setup) */
        ck_assert(gate_copy[m] == (double)gate32[m]);
    for (int m = 0; m < T * D; m++)
        ck_assert(x_copy[m] == (double)x32[m]);
    moe_gate_backward(logits, gate32, x32, T, D, E, g->x, g->gate);
    for (int sh = 0; sh < S; sh++) {
        double dx[T * D];
        moe_expert_backward_f64(MOE_TRUTH_EXACT, L->sw1[sh], L->sw2[sh], L->x, L->dy, NULL,
                                L->weight_at, T, D, F, dx, NULL, g->sw1[sh], g->sw2[sh]);
        for (int m = 0; m < T * D; m++)
            g->x[m] += dx[m];
    }
}

static float skew[E];
static float bias[E];

/* The layer of case c: 0 softmax renormalised, weight at output; 1 softmax
 * not renormalised, at activation, skewed; 2 deepseek-v3 sigmoid with a
 * bias and two groups, route scale 2.5; 3 the same at activation. */
static void make_layer(layer *L, int c)
{
    memset(L, 0, sizeof *L);
    /* fp32 values, so the fp32 operands of moe_gate_backward are exact */
    for (int m = 0; m < T * D; m++)
        L->x[m] = (float)uniform(MOE_TENSOR_TOKENS, (uint64_t)m, 1.0);
    for (int m = 0; m < E * D; m++)
        L->gate[m] = (float)uniform(MOE_TENSOR_GATE, (uint64_t)m, 0.8);
    for (int e = 0; e < E; e++) {
        fill(L->w1[e], 2 * F * D, 100 + e, 0.5);
        fill(L->w2[e], D * F, 200 + e, 0.5);
    }
    fill(L->sw1[0], 2 * F * D, 300, 0.5);
    fill(L->sw2[0], D * F, 301, 0.5);
    fill(L->dy, T * D, 400, 1.0);
    for (int e = 0; e < E; e++) {
        skew[e] = (float)(0.25 * e);
        bias[e] = (float)(0.01 * (e % 3));
    }
    L->router = (moe_router){.kind = c < 2 ? MOE_ROUTER_SOFTMAX : MOE_ROUTER_DEEPSEEK_V3,
                             .experts = E, .topk = K, .normalize = c != 1,
                             .groups = c < 2 ? 1 : 2, .topk_groups = 1,
                             .route_scale = c < 2 ? 1.0f : 2.5f,
                             .bias = c < 2 ? NULL : bias, .skew = c == 1 ? skew : NULL};
    L->weight_at = c % 2 ? MOE_WEIGHT_AT_ACTIVATION : MOE_WEIGHT_AT_OUTPUT;
    /* the selection the library's router makes on these logits */
    float logits[T * E], scores[T * E], weights[T * K], x32[T * D], gate32[E * D];
    for (int m = 0; m < T * D; m++)
        x32[m] = (float)L->x[m];
    for (int m = 0; m < E * D; m++)
        gate32[m] = (float)L->gate[m];
    moe_router_logits(x32, gate32, T, D, E, logits);
    moe_router_select(&L->router, logits, T, scores, L->ids, weights);
}

/* The directional derivative of L along a pseudo-random direction v of the
 * n values at p, by central differences, against <grad, v>. Returns the
 * relative error. */
static double directional_error(layer *L, double *p, int n, const double *grad, uint32_t seed)
{
    double *v = malloc(sizeof(double) * (size_t)n), *saved = malloc(sizeof(double) * (size_t)n);
    fill(v, n, 500 + seed, 1.0);
    memcpy(saved, p, sizeof(double) * (size_t)n);
    const double h = 1e-5;
    for (int m = 0; m < n; m++)
        p[m] = saved[m] + h * v[m];
    const double plus = loss(L);
    for (int m = 0; m < n; m++)
        p[m] = saved[m] - h * v[m];
    const double minus = loss(L);
    memcpy(p, saved, sizeof(double) * (size_t)n);
    const double numeric = (plus - minus) / (2 * h);
    double analytic = 0.0, scale = 0.0;
    for (int m = 0; m < n; m++) {
        analytic += grad[m] * v[m];
        scale += fabs(grad[m] * v[m]);
    }
    free(saved);
    free(v);
    return fabs(numeric - analytic) / scale;
}

START_TEST(gradients_match_finite_differences)
{
    static const char *const cases[] = {"softmax, at output", "softmax, at activation, skew",
                                        "deepseek-v3, at output", "deepseek-v3, at activation"};
    layer *L = malloc(sizeof *L);
    grads *g = malloc(sizeof *g);
    make_layer(L, _i);
    backward(L, g);
    /* Central differences have error O(h^2) ~ 1e-10 here, plus fp64
     * cancellation ~ 1e-16 / 1e-10: a correct gradient lands near 1e-9, a
     * wrong term (a missing Jacobian row, a factor off) near 1e-2 or more. */
    const double limit = 1e-7;
    double worst_w = 0.0;
    double err = directional_error(L, L->x, T * D, g->x, 1);
    printf("finite differences, %s: dx %.1e", cases[_i], err);
    ck_assert_msg(err < limit, "dx: relative error %g", err);
    err = directional_error(L, L->gate, E * D, g->gate, 2);
    printf(", dW_g %.1e", err);
    ck_assert_msg(err < limit, "dW_g: relative error %g", err);
    for (int e = 0; e < E; e++) {
        int used = 0;
        for (int m = 0; m < T * K; m++)
            used |= L->ids[m] == e;
        if (!used)
            continue;
        err = fmax(directional_error(L, L->w1[e], 2 * F * D, g->w1[e], 10 + e),
                   directional_error(L, L->w2[e], D * F, g->w2[e], 20 + e));
        ck_assert_msg(err < limit, "expert %d: relative error %g", e, err);
        worst_w = fmax(worst_w, err);
    }
    printf(", routed dW1/dW2 %.1e", worst_w);
    err = fmax(directional_error(L, L->sw1[0], 2 * F * D, g->sw1[0], 30),
               directional_error(L, L->sw2[0], D * F, g->sw2[0], 31));
    printf(", shared dW1/dW2 %.1e\n", err);
    ck_assert_msg(err < limit, "shared: relative error %g", err);
    free(g);
    free(L);
}
END_TEST

/* The fp32 backward of every GEMM kind against the fp64 one, the rows read
 * in place as gathered, and the row-independence of packed and exact: a
 * row's dx and dg do not depend on the batch it is in, and dW is the same
 * chain over the rows. */
START_TEST(fp32_backward_matches_fp64)
{
    enum { N = 9, DD = 12, FF = 19 };
    const enum moe_gemm_kind kind = (enum moe_gemm_kind)(_i / 2);
    const int weight_at = _i % 2 ? MOE_WEIGHT_AT_ACTIVATION : MOE_WEIGHT_AT_OUTPUT;
    float w1[2 * FF * DD], w2[DD * FF], x[N * DD], dy[N * DD], gate[N];
    moe_expert_generate(5, 1, DD, FF, w1, w2);
    for (int m = 0; m < N * DD; m++) {
        x[m] = moe_synth_value(7, MOE_TENSOR_TOKENS, 0, (uint64_t)m, 1.0f);
        dy[m] = moe_synth_value(7, MOE_TENSOR_TOKENS, 1, (uint64_t)m, 1.0f);
    }
    for (int n = 0; n < N; n++)
        gate[n] = 0.1f + 0.1f * (float)n;
    float *w1t = malloc(sizeof(float) * moe_expert_w1_floats(kind, DD, FF));
    float *w2t = malloc(sizeof(float) * moe_expert_w2_floats(kind, DD, FF));
    float *w1g = malloc(sizeof(float) * moe_expert_grad_w1_floats(kind, DD, FF));
    float *w2g = malloc(sizeof(float) * moe_expert_grad_w2_floats(kind, DD, FF));
    moe_expert_layout(kind, DD, FF, w1, w2, w1t, w2t);
    moe_expert_grad_layout(kind, DD, FF, w1, w2, w1g, w2g);
    const moe_expert_weights fw = {w1t, w2t, {0}};
    const moe_expert_grad_weights bw = {w1g, w2g};
    moe_expert_grad_work work = moe_expert_grad_work_alloc(N, DD, FF);
    float dx[N * DD], dg[N], dw1[2 * FF * DD], dw2[DD * FF];
    moe_expert_backward_data(&fw, &bw, kind, x, dy, gate, NULL, weight_at, N, DD, FF, &work, dx, dg);
    moe_expert_backward_weights(kind, x, dy, NULL, gate, weight_at, N, DD, FF, &work, dw1, dw2);
    { /* the SwiGLU at 8 lanes (16 where the CPU has AVX-512F): the same bits */
        moe_expert_grad_work work8 = moe_expert_grad_work_alloc(N, DD, FF);
        float dx8[N * DD], dg8[N];
        moe_expert_activation_force(MOE_ISA_AVX2);
        moe_expert_backward_data(&fw, &bw, kind, x, dy, gate, NULL, weight_at, N, DD, FF, &work8,
                                 dx8, dg8);
        moe_expert_activation_force(MOE_ISA_WIDEST);
        ck_assert(memcmp(dx8, dx, sizeof dx) == 0);
        ck_assert(memcmp(dg8, dg, sizeof dg) == 0);
        ck_assert(memcmp(work8.dH, work.dH, sizeof(float) * N * 3 * FF) == 0);
        moe_expert_grad_work_free(&work8);
    }
    if (kind == MOE_GEMM_PACKED) { /* the forward's panels read in place: the same bits */
        const moe_expert_grad_weights none = {NULL, NULL};
        moe_expert_grad_work work2 = moe_expert_grad_work_alloc(N, DD, FF);
        float dx2[N * DD], dg2[N];
        moe_expert_backward_data(&fw, &none, kind, x, dy, gate, NULL, weight_at, N, DD, FF, &work2,
                                 dx2, dg2);
        ck_assert(memcmp(dx2, dx, sizeof dx) == 0);
        ck_assert(memcmp(dg2, dg, sizeof dg) == 0);
        ck_assert(memcmp(work2.dH, work.dH, sizeof(float) * N * 3 * FF) == 0);
        moe_expert_grad_work_free(&work2);
    }

    { /* the rows through tables, in the reverse order in memory, with the
       * forward's outputs given and recomputed: the gathered rows' bits */
        float xr[N * DD], dyr[N * DD], y[N * DD], yr[N * DD], scratch[N * 2 * FF];
        moe_expert_forward(&fw, kind, x, N, DD, FF, scratch, y, NULL, NULL);
        const float *xt[N], *dyt[N], *yt[N];
        for (int n = 0; n < N; n++) {
            const int at = (N - 1 - n) * DD;
            memcpy(xr + at, x + n * DD, sizeof(float) * DD);
            memcpy(dyr + at, dy + n * DD, sizeof(float) * DD);
            memcpy(yr + at, y + n * DD, sizeof(float) * DD);
            xt[n] = xr + at;
            dyt[n] = dyr + at;
            yt[n] = yr + at;
        }
        moe_expert_grad_work work3 = moe_expert_grad_work_alloc(N, DD, FF);
        float dx3[N * DD], dg3[N], dx4[N * DD], dg4[N];
        moe_expert_backward_data_rows(&fw, &bw, kind, xt, dyt, gate, NULL, weight_at, N, DD, FF,
                                      &work3, dx3, dg3);
        ck_assert(memcmp(dx3, dx, sizeof dx) == 0);
        ck_assert(memcmp(dg3, dg, sizeof dg) == 0);
        ck_assert(memcmp(work3.dH, work.dH, sizeof(float) * N * 3 * FF) == 0);
        moe_expert_backward_data(&fw, &bw, kind, x, dy, gate, y, weight_at, N, DD, FF, &work3, dx4,
                                 dg4);
        moe_expert_backward_data_rows(&fw, &bw, kind, xt, dyt, gate, yt, weight_at, N, DD, FF,
                                      &work3, dx3, dg3);
        ck_assert(memcmp(dx3, dx4, sizeof dx) == 0);
        ck_assert(memcmp(dg3, dg4, sizeof dg) == 0);
        moe_expert_grad_work_free(&work3);
    }

    double w1d[2 * FF * DD], w2d[DD * FF], xd[N * DD], dyd[N * DD], gd[N];
    double dxd[N * DD], dgd[N], dw1d[2 * FF * DD], dw2d[DD * FF];
    for (int m = 0; m < 2 * FF * DD; m++)
        w1d[m] = w1[m];
    for (int m = 0; m < DD * FF; m++)
        w2d[m] = w2[m];
    for (int m = 0; m < N * DD; m++) {
        xd[m] = x[m];
        dyd[m] = dy[m];
    }
    for (int n = 0; n < N; n++)
        gd[n] = gate[n];
    moe_expert_backward_f64(MOE_TRUTH_EXACT, w1d, w2d, xd, dyd, gd, weight_at, N, DD, FF, dxd, dgd,
                            dw1d, dw2d);
    /* fp32 chains of length DD + 2FF + N, each step at most one rounding of
     * magnitudes ~1: 1e-4 leaves an order of magnitude above that. */
    for (int m = 0; m < N * DD; m++)
        ck_assert_double_eq_tol(dx[m], dxd[m], 1e-4);
    for (int n = 0; n < N; n++)
        ck_assert_double_eq_tol(dg[n], dgd[n], 1e-4);
    for (int m = 0; m < 2 * FF * DD; m++)
        ck_assert_double_eq_tol(dw1[m], dw1d[m], 1e-4);
    for (int m = 0; m < DD * FF; m++)
        ck_assert_double_eq_tol(dw2[m], dw2d[m], 1e-4);

    if (moe_gemm_rows_independent(kind)) { /* row 4 alone: the same bits */
        float dx1[DD], dg1[1];
        moe_expert_backward_data(&fw, &bw, kind, x + 4 * DD, dy + 4 * DD, gate + 4, NULL,
                                 weight_at, 1, DD, FF, &work, dx1, dg1);
        ck_assert(memcmp(dx1, dx + 4 * DD, sizeof dx1) == 0);
        ck_assert(memcmp(dg1, dg + 4, sizeof dg1) == 0);
    }
    moe_expert_grad_work_free(&work);
    free(w2g);
    free(w1g);
    free(w2t);
    free(w1t);
}
END_TEST

/* The backward's layout made from the forward's holds the same floats as the
 * one made from the generated weights, at sizes that leave partial panels
 * both ways (d = 37, f = 21: 2f = 42). */
/* The gate's products in blocks give the definition's bits (backward.h:
 * each element's terms added in order, a multiply then an add), at shapes
 * with every edge: tokens, experts and d past a whole block, and inside one. */
START_TEST(gate_backward_is_the_definition_bit_for_bit)
{
    static const int shapes[][3] = {{1, 1, 1}, {3, 5, 17}, {9, 13, 50}, {8, 8, 32}, {131, 9, 100}};
    const int tokens = shapes[_i][0], experts = shapes[_i][1], d = shapes[_i][2];
    double *dl = malloc(sizeof(double) * tokens * experts), *dx = malloc(sizeof(double) * tokens * d);
    double *dw = malloc(sizeof(double) * experts * d), *want_dx = malloc(sizeof(double) * tokens * d);
    double *want_dw = malloc(sizeof(double) * experts * d);
    float *gate = malloc(sizeof(float) * experts * d), *x = malloc(sizeof(float) * tokens * d);
    for (int m = 0; m < tokens * experts; m++)
        dl[m] = uniform(MOE_TENSOR_GRAD_OUTPUT, (uint64_t)m, 1e-3) * (1.0 + 1e-9 * m);
    for (int m = 0; m < experts * d; m++) {
        gate[m] = (float)uniform(MOE_TENSOR_GATE, (uint64_t)m, 0.8);
        dw[m] = want_dw[m] = uniform(MOE_TENSOR_GATE, (uint64_t)m + 7, 0.1);
    }
    for (int m = 0; m < tokens * d; m++) {
        x[m] = (float)uniform(MOE_TENSOR_TOKENS, (uint64_t)m, 1.0);
        dx[m] = want_dx[m] = uniform(MOE_TENSOR_TOKENS, (uint64_t)m + 3, 0.1);
    }
    for (int i = 0; i < tokens; i++)
        for (int j = 0; j < d; j++)
            for (int e = 0; e < experts; e++)
                want_dx[i * d + j] += dl[i * experts + e] * (double)gate[e * d + j];
    for (int e = 0; e < experts; e++)
        for (int j = 0; j < d; j++)
            for (int i = 0; i < tokens; i++)
                want_dw[e * d + j] += dl[i * experts + e] * (double)x[i * d + j];
    moe_gate_backward(dl, gate, x, tokens, d, experts, dx, dw);
    ck_assert_mem_eq(dx, want_dx, sizeof(double) * tokens * d);
    ck_assert_mem_eq(dw, want_dw, sizeof(double) * experts * d);
    free(x);
    free(gate);
    free(want_dw);
    free(want_dx);
    free(dw);
    free(dx);
    free(dl);
}
END_TEST

START_TEST(grad_layout_from_forward_is_grad_layout)
{
    enum { DD = 37, FF = 21 };
    const enum moe_gemm_kind kind = (enum moe_gemm_kind)_i;
    float w1[2 * FF * DD], w2[DD * FF];
    moe_expert_generate(9, 3, DD, FF, w1, w2);
    const moe_index n1 = moe_expert_grad_w1_floats(kind, DD, FF);
    const moe_index n2 = moe_expert_grad_w2_floats(kind, DD, FF);
    float *w1t = malloc(sizeof(float) * moe_expert_w1_floats(kind, DD, FF));
    float *w2t = malloc(sizeof(float) * moe_expert_w2_floats(kind, DD, FF));
    float *want = malloc(sizeof(float) * (size_t)(n1 + n2));
    float *got = malloc(sizeof(float) * (size_t)(n1 + n2));
    memset(got, 0xff, sizeof(float) * (size_t)(n1 + n2)); /* NaNs where nothing is written */
    moe_expert_layout(kind, DD, FF, w1, w2, w1t, w2t);
    moe_expert_grad_layout(kind, DD, FF, w1, w2, want, want + n1);
    const moe_expert_weights fw = {w1t, w2t, {0}};
    moe_expert_grad_layout_from_forward(kind, DD, FF, &fw, got, got + n1);
    ck_assert(memcmp(got, want, sizeof(float) * (size_t)(n1 + n2)) == 0);
    free(got);
    free(want);
    free(w2t);
    free(w1t);
}
END_TEST

Suite *make_backward_suite(void)
{
    Suite *s = suite_create("backward");
    TCase *tc = tcase_create("core");
    tcase_add_loop_test(tc, gradients_match_finite_differences, 0, 4);
    tcase_add_loop_test(tc, fp32_backward_matches_fp64, 0, 2 * (MOE_GEMM_PACKED + 1));
    tcase_add_loop_test(tc, grad_layout_from_forward_is_grad_layout, 0, MOE_GEMM_PACKED + 1);
    tcase_add_loop_test(tc, gate_backward_is_the_definition_bit_for_bit, 0, 5);
    suite_add_tcase(s, tc);
    return s;
}
