/* check_experts.c — the SwiGLU FFN against a naive loop, and the comparison. */
#include <math.h>
#include <stdlib.h>

#include "moe/experts.h"
#include "moe/truth.h"
#include "suites.h"

START_TEST(ffn_matches_the_definition)
{
    enum { ROWS = 5, D = 12, F = 7 };
    float w1[2 * F * D], w2[D * F], x[ROWS * D], y[ROWS * D], scratch[ROWS * 3 * F];
    moe_expert_generate(3, 2, D, F, w1, w2);
    for (int n = 0; n < ROWS * D; n++)
        x[n] = (float)((n * 37) % 11 - 5) / 4.0f;
    const moe_expert_weights w = {w1, w2};
    moe_expert_forward(&w, x, ROWS, D, F, scratch, y);
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
    moe_compare(got, ref, 4, tol, &st);
    ck_assert_int_eq(st.worst, 2);
    ck_assert_double_eq_tol(st.max_abs, 0.001, 1e-9);
    ck_assert_double_eq_tol(st.max_rel, 0.001, 1e-9); /* against the floor, not |0| */
    ck_assert_double_eq_tol(st.max_used, 1.0, 1e-4);
    ck_assert_int_eq(st.first_nonfinite, -1);
    got[3] = NAN;
    got[1] = INFINITY;
    moe_compare(got, ref, 4, tol, &st);
    ck_assert_int_eq(st.first_nonfinite, 1);
    ck_assert_int_eq(st.worst, 1);
    ck_assert(isinf(st.max_used));
}
END_TEST

Suite *make_experts_suite(void)
{
    Suite *s = suite_create("experts");
    TCase *tc = tcase_create("ffn");
    tcase_add_test(tc, ffn_matches_the_definition);
    tcase_add_test(tc, compare_reports_worst_and_nonfinite);
    suite_add_tcase(s, tc);
    return s;
}
