/* SPDX-License-Identifier: MIT */
/* backward.c — gradients of the SwiGLU expert and of the router (see
 * backward.h). */
#include "moe/backward.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe/common.h"
#include "moe/config.h"
#include "moe/exp.h"
#include "moe/gemm.h"
#include "moe/layout.h"

#include "lanes8.h"

moe_index moe_expert_grad_w1_floats(enum moe_gemm_kind gemm, moe_index hidden, moe_index ffn)
{
    return gemm == MOE_GEMM_PACKED ? moe_sgemm_packed_floats(2 * ffn, hidden) : 2 * ffn * hidden;
}

moe_index moe_expert_grad_w2_floats(enum moe_gemm_kind gemm, moe_index hidden, moe_index ffn)
{
    return gemm == MOE_GEMM_PACKED ? moe_sgemm_packed_floats(hidden, ffn) : hidden * ffn;
}

/* dst = src (K, N) as the operand Bt (K, N) of gemm: itself, or packed
 * into panels; its row k at src + rows[k] * N (rows NULL: k). */
static void operand(enum moe_gemm_kind gemm, moe_index K, moe_index N, const float *src,
                    const moe_index *rows, float *dst)
{
    if (gemm == MOE_GEMM_PACKED)
        moe_sgemm_pack_rows_at(K, N, src, rows, dst);
    else if (rows)
        moe_gather_rows(src, N, rows, K, dst);
    else
        memcpy(dst, src, sizeof(float) * (size_t)(K * N));
}

void moe_expert_grad_layout(enum moe_gemm_kind gemm, moe_index hidden, moe_index ffn,
                            const float *w1, const float *w2, float *w1g, float *w2g)
{
    operand(gemm, 2 * ffn, hidden, w1, NULL, w1g);
    operand(gemm, hidden, ffn, w2, NULL, w2g);
}

/* Bp = B (N, K) as the operand Bt (K' = N, N' = K) of gemm, from fwd, its
 * layout as the forward's operand (experts.c: B transposed, or packed by
 * moe_sgemm_pack). Packed, both are panels of 16: the forward's panel p
 * holds B's rows 16p..16p+15 as [k][row], the backward's panel q B's
 * columns 16q..16q+15 as [row][column], so each 16 x 16 block of B is one
 * contiguous kilobyte in both, transposed. */
enum { GRAD_P = 16 }; /* moe_sgemm_pack's panel width */

__attribute__((target_clones("avx2", "default")))
static void operand_from_forward(enum moe_gemm_kind gemm, moe_index N, moe_index K, const float *fwd,
                                 float *Bp)
{
    if (gemm != MOE_GEMM_PACKED) {
        moe_transpose(K, N, fwd, Bp);
        return;
    }
    const moe_index P = GRAD_P, panels = (K + P - 1) / P;
    for (moe_index q = 0; q < panels; q++) {
        const moe_index cols = K - q * P < P ? K - q * P : P;
        for (moe_index r0 = 0; r0 < N; r0 += P) {
            const moe_index rows = N - r0 < P ? N - r0 : P;
            const float *src = fwd + r0 / P * K * P + q * P * P; /* [column][row] */
            float *dst = Bp + q * N * P + r0 * P;                /* [row][column] */
            float block[GRAD_P][GRAD_P] = {{0}};
            for (moe_index c = 0; c < cols; c++)
                for (moe_index r = 0; r < P; r++)
                    block[r][c] = src[c * P + r];
            memcpy(dst, block, sizeof(float) * (size_t)(rows * P));
        }
    }
}

void moe_expert_grad_layout_from_forward(enum moe_gemm_kind gemm, moe_index hidden, moe_index ffn,
                                         const moe_expert_weights *fw, float *w1g, float *w2g)
{
    operand_from_forward(gemm, 2 * ffn, hidden, fw->w1t, w1g);
    operand_from_forward(gemm, hidden, ffn, fw->w2t, w2g);
}

moe_expert_grad_work moe_expert_grad_work_alloc(moe_index n, moe_index hidden, moe_index ffn)
{
    (void)hidden;
    return moe_expert_grad_work_in(moe_xmalloc(moe_expert_grad_work_bytes(n, ffn)), n, ffn);
}

void moe_expert_grad_work_free(moe_expert_grad_work *w)
{
    free(w->dH);
    w->dH = w->act = NULL;
}

/* Whether dO = g dy (weight at output) rather than dy. */
static bool gated_output(const float *gate, int weight_at)
{
    return gate && weight_at != MOE_WEIGHT_AT_ACTIVATION;
}

/* The SwiGLU's backward on n rows of h (n, 2f) = [gate, up]: act (n, f),
 * when not NULL, receives the activation silu(gate) * up with the
 * forward's bits (times scale[n] when scale is given, as the forward scales
 * it); with da (n, f), the activation's gradient, dh (n, 2f) receives
 * [dA * up * silu'(gate), dA * silu(gate)] (da NULL: the activation only).
 * Every step one fp32 operation per lane: the bits do not depend on the
 * vector width. */
#define SWIGLU_BACKWARD_ROWS(N)                                                    \
    _Pragma("omp parallel for schedule(static)")                                   \
    for (moe_index r = 0; r < n; r++) {                                            \
        const float *gate = h + r * 2 * ffn, *up = gate + ffn;                     \
        for (moe_index c0 = 0; c0 < ffn; c0 += N) {                                \
            const int w = ffn - c0 < N ? (int)(ffn - c0) : N;                      \
            lanes##N g = {0}, u = {0}, dv = {0};                                   \
            if (w == N) {                                                          \
                g = *(const lanes##N##_unaligned *)(gate + c0);                    \
                u = *(const lanes##N##_unaligned *)(up + c0);                      \
                if (da)                                                            \
                    dv = *(const lanes##N##_unaligned *)(da + r * ffn + c0);       \
            } else {                                                               \
                for (int i = 0; i < w; i++) {                                      \
                    g[i] = gate[c0 + i];                                           \
                    u[i] = up[c0 + i];                                             \
                    dv[i] = da ? da[r * ffn + c0 + i] : 0.0f;                      \
                }                                                                  \
            }                                                                      \
            const lanes##N e = exp##N(-g);                                         \
            const lanes##N silu = g / (1.0f + e);                                  \
            const lanes##N sig = 1.0f / (1.0f + e);                                \
            const lanes##N a = scale ? silu * u * scale[r] : silu * u;             \
            const lanes##N dgate = dv * u * (sig + silu * (1.0f - sig));           \
            const lanes##N dup = dv * silu;                                        \
            if (w == N) {                                                          \
                if (act)                                                           \
                    *(lanes##N##_unaligned *)(act + r * ffn + c0) = a;             \
                if (da) {                                                          \
                    *(lanes##N##_unaligned *)(dh + r * 2 * ffn + c0) = dgate;      \
                    *(lanes##N##_unaligned *)(dh + r * 2 * ffn + ffn + c0) = dup;  \
                }                                                                  \
                continue;                                                          \
            }                                                                      \
            for (int i = 0; i < w; i++) {                                          \
                if (act)                                                           \
                    act[r * ffn + c0 + i] = a[i];                                  \
                if (da) {                                                          \
                    dh[r * 2 * ffn + c0 + i] = dgate[i];                           \
                    dh[r * 2 * ffn + ffn + c0 + i] = dup[i];                       \
                }                                                                  \
            }                                                                      \
        }                                                                          \
    }

__attribute__((target_clones("avx2", "default")))
static void swiglu_backward_8(const float *h, const float *da, moe_index n, moe_index ffn,
                              float *dh, float *act, const float *scale)
{
    SWIGLU_BACKWARD_ROWS(8)
}

#ifdef MOE_X86_KERNELS
__attribute__((target("avx512f")))
static void swiglu_backward_16(const float *h, const float *da, moe_index n, moe_index ffn,
                               float *dh, float *act, const float *scale)
{
    SWIGLU_BACKWARD_ROWS(16)
}
#endif
#undef SWIGLU_BACKWARD_ROWS

static void swiglu_backward(const float *h, const float *da, moe_index n, moe_index ffn,
                            float *dh, float *act, const float *scale)
{
#ifdef MOE_X86_KERNELS
    if (moe_expert_activation_lanes() == 16) {
        swiglu_backward_16(h, da, n, ffn, dh, act, scale);
        return;
    }
#endif
    swiglu_backward_8(h, da, n, ffn, dh, act, scale);
}

/* n rows of d floats: row r at at[r], or (at NULL) at base + r * d. */
typedef struct {
    const float *base;
    const float *const *at;
} rows_in;

static inline const float *row_in(rows_in a, moe_index r, moe_index d)
{
    return a.at ? a.at[r] : a.base + r * d;
}

/* sum over j ascending of a[j] * b[j] in fp64, rounded once. */
static float dot(const float *a, const float *b, moe_index n)
{
    double sum = 0.0;
    for (moe_index j = 0; j < n; j++)
        sum += (double)a[j] * (double)b[j];
    return (float)sum;
}

/* out[r] = dot(a's row r, b's row r, len) for n rows: four rows at a time,
 * each its own chain of adds (one row's adds wait on each other; four keep
 * the adder busy), so each sum is dot's. */
static void row_dots(moe_index n, moe_index len, rows_in a, rows_in b, float *out)
{
    moe_index r = 0;
    for (; r + 4 <= n; r += 4) {
        const float *a0 = row_in(a, r, len), *a1 = row_in(a, r + 1, len),
                    *a2 = row_in(a, r + 2, len), *a3 = row_in(a, r + 3, len);
        const float *b0 = row_in(b, r, len), *b1 = row_in(b, r + 1, len),
                    *b2 = row_in(b, r + 2, len), *b3 = row_in(b, r + 3, len);
        double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
        for (moe_index j = 0; j < len; j++) {
            s0 += (double)a0[j] * (double)b0[j];
            s1 += (double)a1[j] * (double)b1[j];
            s2 += (double)a2[j] * (double)b2[j];
            s3 += (double)a3[j] * (double)b3[j];
        }
        out[r] = (float)s0;
        out[r + 1] = (float)s1;
        out[r + 2] = (float)s2;
        out[r + 3] = (float)s3;
    }
    for (; r < n; r++)
        out[r] = dot(row_in(a, r, len), row_in(b, r, len), len);
}

/* dst[r][j] = s[r] * src's row r [j] for n rows of len floats (dst may be
 * src): one fp32 product a lane; s NULL: a copy. */
__attribute__((target_clones("avx2", "default")))
static void scale_rows(moe_index n, moe_index len, const float *s, rows_in src, float *dst)
{
    for (moe_index r = 0; r < n; r++) {
        const float *from = row_in(src, r, len);
        if (!s) {
            if (from != dst + r * len)
                memcpy(dst + r * len, from, sizeof(float) * (size_t)len);
            continue;
        }
        const float g = s[r];
#pragma omp simd
        for (moe_index j = 0; j < len; j++)
            dst[r * len + j] = g * from[j];
    }
}

/* C (n, K) = A (n, N) B, B (N, K) one of the expert's weight matrices: from
 * the backward's layout bwd, or with bwd NULL (packed) straight from the
 * forward's panels fwd. */
static void data_gemm(enum moe_gemm_kind gemm, moe_index n, moe_index N, moe_index K,
                      const float *A, const float *fwd, const float *bwd, float *C)
{
    if (bwd) {
        moe_expert_gemm(gemm, n, K, N, A, N, bwd, C, K);
        return;
    }
    MOE_ASSERT(gemm == MOE_GEMM_PACKED);
    moe_sgemm_packed_t(n, N, K, A, N, fwd, C, K);
}

/* moe_expert_backward_data on rows wherever they are. */
static void backward_data(const moe_expert_weights *fw, const moe_expert_grad_weights *bw,
                          enum moe_gemm_kind gemm, rows_in x, rows_in dy, const float *gate,
                          rows_in out, int weight_at, moe_index n, moe_index hidden,
                          moe_index ffn, const moe_expert_grad_work *work, float *dx,
                          float *dgate)
{
    if (n == 0)
        return;
    const moe_index d = hidden, f = ffn;
    const bool at_activation = gate && weight_at == MOE_WEIGHT_AT_ACTIVATION;
    float *dH = work->dH, *act = work->act; /* (n, 2f), (n, f) */
    float *h = moe_xmalloc(sizeof(float) * (size_t)(n * 2 * f)); /* (n, 2f) */
    float *da = moe_xmalloc(sizeof(float) * (size_t)(n * f));    /* (n, f) */
    float *dO = moe_xmalloc(sizeof(float) * (size_t)(n * d));    /* (n, d) */
    /* h = x W1^T, recomputed: the packed kernel reads x's rows in place */
    if (!x.at)
        moe_expert_gemm(gemm, n, 2 * f, d, x.base, d, fw->w1t, h, 2 * f);
    else if (gemm == MOE_GEMM_PACKED)
        moe_sgemm_packed_rows(n, 2 * f, d, x.at, NULL, fw->w1t, h, 2 * f);
    else { /* the others on the rows gathered (dO holds them until it is needed) */
        scale_rows(n, d, NULL, x, dO);
        moe_expert_gemm(gemm, n, 2 * f, d, dO, d, fw->w1t, h, 2 * f);
    }
    if (gated_output(gate, weight_at)) {
        rows_in o = out;
        float *recomputed = NULL;
        if (!out.base && !out.at) { /* o = a W2^T, the forward's output, recomputed */
            recomputed = moe_xmalloc(sizeof(float) * (size_t)(n * d));
            swiglu_backward(h, NULL, n, f, NULL, act, NULL);
            moe_expert_gemm(gemm, n, d, f, act, f, fw->w2t, recomputed, d);
            o = (rows_in){recomputed, NULL};
        }
        row_dots(n, d, dy, o, dgate);
        scale_rows(n, d, gate, dy, dO);
        free(recomputed);
    } else {
        scale_rows(n, d, NULL, dy, dO);
    }
    data_gemm(gemm, n, d, f, dO, fw->w2t, bw->w2, da); /* dA' = dO W2 */
    if (at_activation) {
        /* the activation unscaled, for dg = <dA', a>; then dA = g dA' */
        swiglu_backward(h, NULL, n, f, NULL, act, NULL);
        row_dots(n, f, (rows_in){da, NULL}, (rows_in){act, NULL}, dgate);
        scale_rows(n, f, gate, (rows_in){da, NULL}, da);
    }
    swiglu_backward(h, da, n, f, dH, act, at_activation ? gate : NULL); /* act = a' */
    data_gemm(gemm, n, 2 * f, d, dH, fw->w1t, bw->w1, dx); /* dx = dH W1 */
    free(dO);
    free(da);
    free(h);
}

void moe_expert_backward_data(const moe_expert_weights *fw, const moe_expert_grad_weights *bw,
                              enum moe_gemm_kind gemm, const float *x, const float *dy,
                              const float *gate, const float *out, int weight_at, moe_index n,
                              moe_index hidden, moe_index ffn, const moe_expert_grad_work *work,
                              float *dx, float *dgate)
{
    backward_data(fw, bw, gemm, (rows_in){x, NULL}, (rows_in){dy, NULL}, gate,
                  (rows_in){out, NULL}, weight_at, n, hidden, ffn, work, dx, dgate);
}

void moe_expert_backward_data_rows(const moe_expert_weights *fw,
                                   const moe_expert_grad_weights *bw, enum moe_gemm_kind gemm,
                                   const float *const *x, const float *const *dy,
                                   const float *gate, const float *const *out, int weight_at,
                                   moe_index n, moe_index hidden, moe_index ffn,
                                   const moe_expert_grad_work *work, float *dx, float *dgate)
{
    backward_data(fw, bw, gemm, (rows_in){NULL, x}, (rows_in){NULL, dy}, gate,
                  (rows_in){NULL, out}, weight_at, n, hidden, ffn, work, dx, dgate);
}

/* a[j][r] *= s[r] for a (rows, cols): one fp32 product a lane. */
__attribute__((target_clones("avx2", "default")))
static void scale_columns(moe_index rows, moe_index cols, const float *s, float *a)
{
    for (moe_index j = 0; j < rows; j++) {
        float *row = a + j * cols;
#pragma omp simd
        for (moe_index r = 0; r < cols; r++)
            row[r] *= s[r];
    }
}

void moe_expert_backward_weights(enum moe_gemm_kind gemm, const float *x, const float *dy,
                                 const moe_index *rows, const float *gate, int weight_at,
                                 moe_index n, moe_index hidden, moe_index ffn,
                                 const moe_expert_grad_work *work, float *dw1, float *dw2)
{
    const moe_index d = hidden, f = ffn;
    if (n == 0) {
        memset(dw1, 0, sizeof(float) * (size_t)(2 * f * d));
        memset(dw2, 0, sizeof(float) * (size_t)(d * f));
        return;
    }
    const float *dH = work->dH, *act = work->act;
    /* A operands transposed, (out, rows); B operands (rows, in) in gemm's layout */
    const moe_index most = d > 2 * f ? d : 2 * f;
    float *at = moe_xmalloc(sizeof(float) * (size_t)(most * n));
    const moe_index b_floats = gemm == MOE_GEMM_PACKED ? moe_sgemm_packed_floats(n, most) : n * most;
    float *b = moe_xmalloc(sizeof(float) * (size_t)b_floats);
    moe_transpose_rows_at(n, d, dy, rows, at); /* dO^T (d, n): dy^T, times the gates as the data gradient */
    if (gated_output(gate, weight_at))
        scale_columns(d, n, gate, at);
    operand(gemm, n, f, act, NULL, b);
    moe_expert_gemm(gemm, d, f, n, at, n, b, dw2, f);
    moe_transpose(n, 2 * f, dH, at); /* dH^T (2f, n) */
    operand(gemm, n, d, x, rows, b);
    moe_expert_gemm(gemm, 2 * f, d, n, at, n, b, dw1, d);
    free(b);
    free(at);
}

/* dst (cols, rows) = src (rows, cols)^T, fp64. */
static void transpose_f64(moe_index rows, moe_index cols, const double *src, double *dst)
{
    for (moe_index r = 0; r < rows; r++)
        for (moe_index c = 0; c < cols; c++)
            dst[c * rows + r] = src[r * cols + c];
}

void moe_expert_backward_f64(enum moe_truth_gemm gemm, const double *w1, const double *w2,
                             const double *x, const double *dy, const double *gate, int weight_at,
                             moe_index n, moe_index hidden, moe_index ffn, double *dx,
                             double *dgate, double *dw1, double *dw2)
{
    const moe_index d = hidden, f = ffn;
    void (*product)(moe_index, moe_index, moe_index, const double *, moe_index, const double *,
                    moe_index, double *, moe_index) =
        gemm == MOE_TRUTH_EXACT ? moe_dgemm_nt_exact : moe_dgemm_nt;
    if (n == 0) {
        if (dw1)
            memset(dw1, 0, sizeof(double) * (size_t)(2 * f * d));
        if (dw2)
            memset(dw2, 0, sizeof(double) * (size_t)(d * f));
        return;
    }
    const bool at_activation = gate && weight_at == MOE_WEIGHT_AT_ACTIVATION;
    const moe_index most = d > 2 * f ? d : 2 * f;
    double *h = moe_xmalloc(sizeof(double) * (size_t)(n * 2 * f));  /* (n, 2f), then dH */
    double *a = moe_xmalloc(sizeof(double) * (size_t)(n * f));      /* (n, f): a' */
    double *da = moe_xmalloc(sizeof(double) * (size_t)(n * f));     /* (n, f) */
    double *dO = moe_xmalloc(sizeof(double) * (size_t)(n * d));     /* (n, d), also o */
    double *t1 = moe_xmalloc(sizeof(double) * (size_t)(most * n));  /* transposes */
    double *t2 = moe_xmalloc(sizeof(double) * (size_t)(most * most > most * n ? most * most : most * n));
    product(n, 2 * f, d, x, d, w1, d, h, 2 * f);
    for (moe_index m = 0; m < n * f; m++) {
        const double g = h[(m / f) * 2 * f + m % f], u = h[(m / f) * 2 * f + f + m % f];
        a[m] = g / (1.0 + moe_exp_fp64(-g)) * u;
    }
    if (gate && !at_activation) {
        product(n, d, f, a, f, w2, f, dO, d); /* o = a W2^T */
        for (moe_index r = 0; r < n; r++) {
            double sum = 0.0;
            for (moe_index j = 0; j < d; j++)
                sum += dy[r * d + j] * dO[r * d + j];
            if (dgate)
                dgate[r] = sum;
            for (moe_index j = 0; j < d; j++)
                dO[r * d + j] = gate[r] * dy[r * d + j];
        }
    } else {
        memcpy(dO, dy, sizeof(double) * (size_t)(n * d));
    }
    transpose_f64(d, f, w2, t2); /* W2^T (f, d): dA = dO W2 */
    product(n, f, d, dO, d, t2, d, da, f);
    if (at_activation)
        for (moe_index r = 0; r < n; r++) {
            double sum = 0.0;
            for (moe_index c = 0; c < f; c++)
                sum += da[r * f + c] * a[r * f + c];
            if (dgate)
                dgate[r] = sum;
            for (moe_index c = 0; c < f; c++) {
                da[r * f + c] *= gate[r];
                a[r * f + c] *= gate[r]; /* a' */
            }
        }
    for (moe_index m = 0; m < n * f; m++) {
        double *g = h + (m / f) * 2 * f + m % f, *u = g + f;
        const double s = 1.0 / (1.0 + moe_exp_fp64(-*g)), silu = *g * s;
        const double dgv = da[m] * *u * (s + silu * (1.0 - s)), duv = da[m] * silu;
        *g = dgv;
        *u = duv;
    }
    if (dx) {
        transpose_f64(2 * f, d, w1, t2); /* W1^T (d, 2f): dx = dH W1 */
        product(n, d, 2 * f, h, 2 * f, t2, 2 * f, dx, d);
    }
    if (dw2) {
        transpose_f64(n, d, dO, t1); /* dO^T (d, n) */
        transpose_f64(n, f, a, t2);  /* a'^T (f, n) */
        product(d, f, n, t1, n, t2, n, dw2, f);
    }
    if (dw1) {
        transpose_f64(n, 2 * f, h, t1); /* dH^T (2f, n) */
        double *xt = moe_xmalloc(sizeof(double) * (size_t)(d * n));
        transpose_f64(n, d, x, xt);
        product(2 * f, d, n, t1, n, xt, n, dw1, d);
        free(xt);
    }
    free(t2);
    free(t1);
    free(dO);
    free(da);
    free(a);
    free(h);
}

void moe_router_backward(const moe_router *r, const double *logits, const int32_t *ids,
                         const double *dweights, moe_index tokens, double *dlogits)
{
    const int E = r->experts, k = r->topk;
    const bool sigmoid = r->kind == MOE_ROUTER_DEEPSEEK_V3 && r->bias;
    const bool normalize = r->normalize || sigmoid;
    const double c = (double)r->route_scale;
#pragma omp parallel for schedule(static)
    for (moe_index i = 0; i < tokens; i++) {
        double p[4096], dp[4096]; /* E <= 4096 (the --experts bound) */
        const double *logit = logits + i * E;
        double *dl = dlogits + i * E;
        double max = -INFINITY;
        for (int e = 0; e < E; e++) {
            p[e] = logit[e] + (r->skew ? (double)r->skew[e] : 0.0);
            max = p[e] > max ? p[e] : max;
            dp[e] = 0.0;
        }
        if (sigmoid) {
            for (int e = 0; e < E; e++)
                p[e] = 1.0 / (1.0 + moe_exp_fp64(-p[e]));
        } else {
            double sum = 0.0;
            for (int e = 0; e < E; e++)
                sum += (p[e] = moe_exp_fp64(p[e] - max));
            for (int e = 0; e < E; e++)
                p[e] /= sum;
        }
        const int32_t *id = ids + i * k;
        const double *dw = dweights + i * k;
        double S = 0.0, weighted = 0.0;
        for (int s = 0; s < k; s++) {
            S += p[id[s]];
            weighted += dw[s] * p[id[s]];
        }
        for (int s = 0; s < k; s++)
            dp[id[s]] += normalize ? c * (dw[s] / S - weighted / (S * S)) : c * dw[s];
        if (sigmoid) {
            for (int e = 0; e < E; e++)
                dl[e] = dp[e] * p[e] * (1.0 - p[e]);
        } else {
            double mean = 0.0;
            for (int e = 0; e < E; e++)
                mean += p[e] * dp[e];
            for (int e = 0; e < E; e++)
                dl[e] = p[e] * (dp[e] - mean);
        }
    }
}

/* Both products in blocks of GATE_COLS columns of d by GATE_ROWS rows of
 * the result (tokens for dx, experts for dgate_w): the block's partial sums
 * stay in registers over the whole sum (over e for dx, over tokens for
 * dgate_w), and each operand row, converted to fp64 once, serves the
 * block's GATE_ROWS sums. Every element's terms are added in the order of the
 * definition in backward.h, a multiply then an add (no contraction: the
 * product of an fp64 and an fp32 value is not exact), so the bits depend
 * neither on the blocking nor on the ISA. */
enum { GATE_COLS = 16, GATE_ROWS = 4 };

/* A whole block, GATE_ROWS x GATE_COLS, its sums in registers: eight fp64
 * lanes a vector (two AVX2 registers, one AVX-512 register), a row's
 * sixteen columns two vectors. */
typedef double gate_lanes __attribute__((vector_size(64)));
typedef float gate_floats __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) gate_lanes gate_row_half(const float *src)
{
    gate_floats f;
    memcpy(&f, src, sizeof f);
    return __builtin_convertvector(f, gate_lanes);
}

/* out[t][j .. j + GATE_COLS) (rows of ld doubles) for t < GATE_ROWS: plus
 * the sum over m < count of g[m * g_step + t * g_row] * src[m * src_step +
 * j ..], added in m order. */
static inline __attribute__((always_inline)) void gate_block_whole(
    double *out, moe_index ld, moe_index j, moe_index count, const double *g, moe_index g_step,
    moe_index g_row, const float *src, moe_index src_step)
{
    gate_lanes acc[GATE_ROWS][2];
#pragma GCC unroll 4
    for (int t = 0; t < GATE_ROWS; t++)
        memcpy(acc[t], out + t * ld + j, sizeof acc[t]);
    for (moe_index m = 0; m < count; m++) {
        const gate_lanes s0 = gate_row_half(src + m * src_step + j);
        const gate_lanes s1 = gate_row_half(src + m * src_step + j + GATE_COLS / 2);
#pragma GCC unroll 4
        for (int t = 0; t < GATE_ROWS; t++) {
            const double gt = g[m * g_step + t * g_row];
            acc[t][0] += gt * s0;
            acc[t][1] += gt * s1;
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < GATE_ROWS; t++)
        memcpy(out + t * ld + j, acc[t], sizeof acc[t]);
}

/* The same for rows <= GATE_ROWS and n <= GATE_COLS columns (the edges),
 * one element at a time. */
static void gate_block_edge(double *out, moe_index ld, int rows, moe_index j, int n,
                            moe_index count, const double *g, moe_index g_step, moe_index g_row,
                            const float *src, moe_index src_step)
{
    for (int t = 0; t < rows; t++)
        for (int c = 0; c < n; c++) {
            double acc = out[t * ld + j + c];
            for (moe_index m = 0; m < count; m++)
                acc += g[m * g_step + t * g_row] * (double)src[m * src_step + j + c];
            out[t * ld + j + c] = acc;
        }
}

static inline __attribute__((always_inline)) void gate_block(
    double *out, moe_index ld, int rows, moe_index j, int n, moe_index count, const double *g,
    moe_index g_step, moe_index g_row, const float *src, moe_index src_step)
{
    if (rows == GATE_ROWS && n == GATE_COLS)
        gate_block_whole(out, ld, j, count, g, g_step, g_row, src, src_step);
    else
        gate_block_edge(out, ld, rows, j, n, count, g, g_step, g_row, src, src_step);
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void moe_gate_backward(const double *dlogits, const float *gate, const float *x, moe_index tokens,
                       moe_index hidden, int experts, double *dx, double *dgate_w)
{
    const moe_index d = hidden, E = experts;
    const moe_index column_blocks = (d + GATE_COLS - 1) / GATE_COLS;
    if (dx) { /* dx[i] += sum over e of dlogits[i][e] gate[e]: GATE_ROWS tokens a block */
        const moe_index row_blocks = (tokens + GATE_ROWS - 1) / GATE_ROWS;
#pragma omp parallel for schedule(static)
        for (moe_index b = 0; b < row_blocks * column_blocks; b++) {
            const moe_index i = b / column_blocks * GATE_ROWS, j = b % column_blocks * GATE_COLS;
            const int rows = tokens - i < GATE_ROWS ? (int)(tokens - i) : GATE_ROWS;
            const int n = d - j < GATE_COLS ? (int)(d - j) : GATE_COLS;
            gate_block(dx + i * d, d, rows, j, n, E, dlogits + i * E, 1, E, gate, d);
        }
    }
    if (dgate_w) { /* dgate_w[e] += sum over i of dlogits[i][e] x[i]: GATE_ROWS experts a block */
        const moe_index row_blocks = (E + GATE_ROWS - 1) / GATE_ROWS;
#pragma omp parallel for schedule(static)
        for (moe_index b = 0; b < row_blocks * column_blocks; b++) {
            const moe_index e = b % row_blocks * GATE_ROWS, j = b / row_blocks * GATE_COLS;
            const int rows = E - e < GATE_ROWS ? (int)(E - e) : GATE_ROWS;
            const int n = d - j < GATE_COLS ? (int)(d - j) : GATE_COLS;
            gate_block(dgate_w + e * d, d, rows, j, n, tokens, dlogits + e, E, 1, x, d);
        }
    }
}

/* The batch's dlogits (tokens, E) from its logits as moe_router_logits gave
 * them (fp32) and dL/dweight per slot; the caller frees it. */
static double *router_dlogits(const moe_router *r, const float *logits, const int32_t *ids,
                              const double *dweights, moe_index tokens)
{
    const moe_index E = r->experts;
    double *dlogits = moe_xmalloc(sizeof(double) * (size_t)(tokens * E) + 1);
    for (moe_index n = 0; n < tokens * E; n++)
        dlogits[n] = logits[n];
    moe_router_backward(r, dlogits, ids, dweights, tokens, dlogits);
    return dlogits;
}

void moe_router_gate_backward(const moe_router *r, const float *gate, const float *x,
                              const float *logits, const int32_t *ids, const double *dweights,
                              moe_index tokens, moe_index hidden, double *dx, double *dgate_w)
{
    double *dlogits = router_dlogits(r, logits, ids, dweights, tokens);
    memset(dgate_w, 0, sizeof(double) * (size_t)(r->experts * hidden));
    moe_gate_backward(dlogits, gate, x, tokens, hidden, r->experts, dx, dgate_w);
    free(dlogits);
}

/* Tokens of the rounded dx's fp64 sums at a time. */
enum { GATE_TOKEN_BLOCK = 64 };

void moe_router_gate_backward_rounded(const moe_router *r, const float *gate, const float *x,
                                      const float *logits, const int32_t *ids,
                                      const double *dweights, moe_index tokens, moe_index hidden,
                                      float *dx, double *dgate_w)
{
    const moe_index d = hidden, E = r->experts;
    double *dlogits = router_dlogits(r, logits, ids, dweights, tokens);
    memset(dgate_w, 0, sizeof(double) * (size_t)(E * d));
    moe_gate_backward(dlogits, gate, x, tokens, d, r->experts, NULL, dgate_w);
    double *block = moe_xmalloc(sizeof(double) * (size_t)(GATE_TOKEN_BLOCK * d) + 1);
    for (moe_index i0 = 0; i0 < tokens; i0 += GATE_TOKEN_BLOCK) {
        const moe_index n = tokens - i0 < GATE_TOKEN_BLOCK ? tokens - i0 : GATE_TOKEN_BLOCK;
        memset(block, 0, sizeof(double) * (size_t)(n * d));
        moe_gate_backward(dlogits + i0 * E, gate, x, n, d, r->experts, block, NULL);
        for (moe_index m = 0; m < n * d; m++)
            dx[i0 * d + m] += (float)block[m];
    }
    free(block);
    free(dlogits);
}
