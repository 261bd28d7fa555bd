/* check_experts.c — the SwiGLU FFN against a naive loop, and the comparison. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe/experts.h"
#include "moe/gemm.h"
#include "moe/rng.h"
#include "moe/truth.h"
#include "suites.h"

START_TEST(ffn_matches_the_definition)
{
    enum { ROWS = 5, D = 12, F = 19 }; /* F: two 8-lane blocks and a tail */
    float w1[2 * F * D], w2[D * F], x[ROWS * D], y[ROWS * D], scratch[ROWS * 3 * F];
    moe_expert_generate(3, 2, D, F, w1, w2);
    for (int n = 0; n < ROWS * D; n++)
        x[n] = (float)((n * 37) % 11 - 5) / 4.0f;
    float w1t[2 * F * D], w2t[D * F];
    moe_transpose(2 * F, D, w1, w1t);
    moe_transpose(D, F, w2, w2t);
    const moe_expert_weights w = {.w1t = w1t, .w2t = w2t};
    moe_expert_forward(&w, MOE_GEMM_BLAS, x, ROWS, D, F, scratch, y, NULL, NULL);
    for (int i = 0; i < ROWS; i++) {
        double act[F];
        for (int c = 0; c < F; c++) {
            double g = 0, u = 0;
            for (int j = 0; j < D; j++) {
                g += (double)x[i * D + j] * w1[c * D + j];
                u += (double)x[i * D + j] * w1[(F + c) * D + j];
            }
            act[c] = g / (1.0 + exp(-g)) * u;
        }
        for (int j = 0; j < D; j++) {
            double want = 0;
            for (int c = 0; c < F; c++)
                want += act[c] * w2[j * F + c];
            /* fp32 sums over D then F: a few units in the last place. */
            ck_assert_double_eq_tol(y[i * D + j], want, 1e-5);
        }
    }
}
END_TEST

START_TEST(compare_reports_worst_and_nonfinite)
{
    const double ref[4] = {1.0, -2.0, 0.0, 4.0};
    float got[4] = {1.0f, -2.0f, 0.001f, 4.0f};
    const moe_tolerance tol = {1e-3, 1e-3}; /* rms floor = 1 */
    moe_compare_stats st;
    moe_compare(got, ref, NULL, 4, tol, &st);
    ck_assert_int_eq(st.worst, 2);
    ck_assert_double_eq_tol(st.max_abs, 0.001, 1e-9);
    ck_assert_double_eq_tol(st.max_rel, 0.001, 1e-9); /* against the floor, not |0| */
    ck_assert_double_eq_tol(st.max_used, 1.0, 1e-4);
    ck_assert_int_eq(st.first_nonfinite, -1);
    got[3] = NAN;
    got[1] = INFINITY;
    moe_compare(got, ref, NULL, 4, tol, &st);
    ck_assert_int_eq(st.first_nonfinite, 1);
    ck_assert_int_eq(st.worst, 1);
    ck_assert(isinf(st.max_used));
}
END_TEST

/* The exact kernel is the documented scalar loop, bit for bit, for any M, N,
 * K (panels, row blocks and column tails included) and any subset of rows. */
START_TEST(exact_gemm_is_the_scalar_loop)
{
    static const int shapes[][3] = {{1, 1, 1}, {7, 37, 19}, {70, 64, 33}, {5, 95, 128}, {66, 31, 8}};
    for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
        const int M = shapes[c][0], N = shapes[c][1], K = shapes[c][2];
        float *A = malloc(sizeof(float) * M * K), *Bt = malloc(sizeof(float) * K * N);
        float *C = malloc(sizeof(float) * M * N), *part = malloc(sizeof(float) * M * N);
        moe_synth_fill(5, MOE_TENSOR_TOKENS, 0, 0, M * K, 1.0f, A);
        moe_synth_fill(5, MOE_TENSOR_GATE, 0, 0, K * N, 0.3f, Bt);
        moe_sgemm_exact(M, N, K, A, K, Bt, N, C, N);
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                float acc = 0.0f;
                for (int k = 0; k < K; k++)
                    acc += A[m * K + k] * Bt[k * N + n];
                ck_assert_msg(memcmp(&acc, &C[m * N + n], sizeof acc) == 0,
                              "shape %dx%dx%d at (%d, %d): %a vs %a", M, N, K, m, n, acc, C[m * N + n]);
            }
        if (M > 3) { /* rows 3.. alone, at another position */
            moe_sgemm_exact(M - 3, N, K, A + 3 * K, K, Bt, N, part, N);
            ck_assert_int_eq(memcmp(part, C + 3 * N, sizeof(float) * (M - 3) * N), 0);
        }
        free(part);
        free(C);
        free(Bt);
        free(A);
    }
}
END_TEST

START_TEST(exact_ffn_is_chunk_independent)
{
    enum { ROWS = 45, D = 40, F = 24 };
    float w1[2 * F * D], w2[D * F], w1t[2 * F * D], w2t[D * F], x[ROWS * D];
    float y[ROWS * D], y_chunked[ROWS * D], scratch[ROWS * 3 * F];
    moe_expert_generate(9, 1, D, F, w1, w2);
    moe_transpose(2 * F, D, w1, w1t);
    moe_transpose(D, F, w2, w2t);
    moe_synth_fill(9, MOE_TENSOR_TOKENS, 0, 0, ROWS * D, 1.0f, x);
    const moe_expert_weights w = {.w1t = w1t, .w2t = w2t};
    moe_expert_forward(&w, MOE_GEMM_EXACT, x, ROWS, D, F, scratch, y, NULL, NULL);
    const moe_ffn_hooks hooks = {NULL, NULL, 7};
    moe_expert_forward(&w, MOE_GEMM_EXACT, x, ROWS, D, F, scratch, y_chunked, NULL, &hooks);
    ck_assert_int_eq(memcmp(y, y_chunked, sizeof y), 0);
    /* and it computes the FFN: close to the blas path */
    float y_blas[ROWS * D];
    moe_expert_forward(&w, MOE_GEMM_BLAS, x, ROWS, D, F, scratch, y_blas, NULL, NULL);
    for (int n = 0; n < ROWS * D; n++)
        ck_assert_float_eq_tol(y[n], y_blas[n], 1e-5f);
}
END_TEST

/* Units in the last place of float v's binade. */
static double ulp_of(float v)
{
    return (double)nextafterf(fabsf(v), INFINITY) - (double)fabsf(v);
}

START_TEST(exp_fp32_is_within_2_ulp_and_handles_the_edges)
{
    const float lo = -87.3365402f, hi = 88.7228317f;
    double worst = 0.0;
    long n = 0;
    /* every 257th float of either sign up to the ends of the range */
    for (uint32_t bits = 0; bits < 0x42b20000u; bits += 257)
        for (int sign = 0; sign < 2; sign++) {
        const uint32_t b = bits | (uint32_t)sign << 31;
        float x;
        memcpy(&x, &b, sizeof x);
        if (x < lo || x > hi)
            continue;
        n++;
        const float e = moe_exp_fp32(x);
        const double exact = exp((double)x);
        const double err = fabs((double)e - exact) / ulp_of((float)exact);
        if (err > worst)
            worst = err;
        }
    ck_assert_int_gt(n, 1000000);
    ck_assert_double_le(worst, 2.0);
    ck_assert_float_eq(moe_exp_fp32(0.0f), 1.0f);
    ck_assert_float_eq(moe_exp_fp32(-0.0f), 1.0f);
    ck_assert_float_eq(moe_exp_fp32(1.0f), 2.71828175f); /* e to fp32, hand-checked */
    ck_assert_float_eq(moe_exp_fp32(89.0f), INFINITY);
    ck_assert_float_eq(moe_exp_fp32(INFINITY), INFINITY);
    ck_assert_float_eq(moe_exp_fp32(-88.0f), 0.0f);
    ck_assert_float_eq(moe_exp_fp32(-INFINITY), 0.0f);
    ck_assert(isnan(moe_exp_fp32(NAN)));
    ck_assert(isfinite(moe_exp_fp32(hi)) && moe_exp_fp32(hi) > 3.4e38f);
    ck_assert(moe_exp_fp32(lo) >= 1.1754944e-38f); /* FLT_MIN: never subnormal */
}
END_TEST

Suite *make_experts_suite(void)
{
    Suite *s = suite_create("experts");
    TCase *tc = tcase_create("ffn");
    tcase_add_test(tc, ffn_matches_the_definition);
    tcase_add_test(tc, compare_reports_worst_and_nonfinite);
    tcase_add_test(tc, exact_gemm_is_the_scalar_loop);
    tcase_add_test(tc, exact_ffn_is_chunk_independent);
    tcase_add_test(tc, exp_fp32_is_within_2_ulp_and_handles_the_edges);
    suite_add_tcase(s, tc);
    return s;
}
