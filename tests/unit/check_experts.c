/* SPDX-License-Identifier: MIT */
/* check_experts.c — the SwiGLU FFN against a naive loop, and the comparison. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <float.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "moe/comm.h"
#include "moe/exp.h"
#include "moe/experts.h"
#include "moe/gemm.h"
#include "moe/peak.h"
#include "moe/rng.h"
#include "moe/router.h"
#include "moe/truth.h"
#include "suites.h"

START_TEST(ffn_matches_the_definition)
{
    enum { ROWS = 5, D = 12, F = 19 }; /* F: two 8-lane blocks and a tail */
    const enum moe_gemm_kind kind = (enum moe_gemm_kind)_i;
    float w1[2 * F * D], w2[D * F], x[ROWS * D], y[ROWS * D], scratch[ROWS * 3 * F];
    moe_expert_generate(3, 2, D, F, w1, w2);
    for (int n = 0; n < ROWS * D; n++)
        x[n] = (float)((n * 37) % 11 - 5) / 4.0f;
    float *w1t = malloc(sizeof(float) * moe_expert_w1_floats(kind, D, F));
    float *w2t = malloc(sizeof(float) * moe_expert_w2_floats(kind, D, F));
    moe_expert_layout(kind, D, F, w1, w2, w1t, w2t);
    const moe_expert_weights w = {.w1t = w1t, .w2t = w2t};
    moe_expert_forward(&w, kind, x, ROWS, D, F, scratch, y, NULL, NULL);
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
    free(w2t);
    free(w1t);
}
END_TEST

/* The rounding points inside an expert (--gemm-out-dtype bf16, --act-dtype
 * fp8 or bf16): the fp32 forward with each --gemm lies within the truth's
 * interval of every fp32 computation (width, plus one bf16 step where the
 * output is rounded, plus the fp32 chain of L2 the contract's rel allows),
 * the width is below 1 % of the rms on most values, and the same fp32
 * forward without the rounding points lies outside it on 5 % or more. */
START_TEST(rounded_expert_lies_within_the_truths_interval)
{
    enum { ROWS = 24, D = 256, F = 160 }; /* F: a full FP8 block and a partial one */
    const enum moe_gemm_kind kind = (enum moe_gemm_kind)(_i % 3);
    const moe_expert_rounding r = {.h_bf16 = true, .out_bf16 = true,
                                   .act_dtype = _i < 3 ? MOE_DTYPE_FP8 : MOE_DTYPE_BF16,
                                   .fmt = {MOE_FP8_RECIPE_DEEPGEMM, true}};
    float *w1 = malloc(sizeof(float) * 2 * F * D), *w2 = malloc(sizeof(float) * D * F);
    float *x = malloc(sizeof(float) * ROWS * D), *y = malloc(sizeof(float) * ROWS * D);
    float *plain = malloc(sizeof(float) * ROWS * D), *scratch = malloc(sizeof(float) * ROWS * 3 * F);
    double *w1_64 = malloc(sizeof(double) * 2 * F * D), *w2_64 = malloc(sizeof(double) * D * F);
    double *x64 = malloc(sizeof(double) * ROWS * D), *y64 = malloc(sizeof(double) * ROWS * D);
    double *width = malloc(sizeof(double) * ROWS * D);
    moe_expert_generate(5, 1, D, F, w1, w2);
    moe_synth_tokens(5, 0, ROWS, D, 1.0f, MOE_INPUT_ACTIVATIONS, x);
    for (int n = 0; n < 2 * F * D; n++)
        w1_64[n] = w1[n];
    for (int n = 0; n < D * F; n++)
        w2_64[n] = w2[n];
    for (int n = 0; n < ROWS * D; n++)
        x64[n] = x[n];
    float *w1t = malloc(sizeof(float) * moe_expert_w1_floats(kind, D, F));
    float *w2t = malloc(sizeof(float) * moe_expert_w2_floats(kind, D, F));
    moe_expert_layout(kind, D, F, w1, w2, w1t, w2t);
    const moe_expert_weights w = {.w1t = w1t, .w2t = w2t, .rounding = r};
    const moe_expert_weights w_plain = {.w1t = w1t, .w2t = w2t};
    moe_expert_forward(&w, kind, x, ROWS, D, F, scratch, y, NULL, NULL);
    moe_expert_forward(&w_plain, kind, x, ROWS, D, F, scratch, plain, NULL, NULL);
    moe_expert_forward_f64_rounded(MOE_TRUTH_EXACT, &r, w1_64, w2_64, x64, ROWS, D, F, y64, width);
    double rms = 0.0;
    for (int n = 0; n < ROWS * D; n++)
        rms += y64[n] * y64[n];
    rms = sqrt(rms / (ROWS * D));
    const double rel = 0x1p-24 * (D + F);
    int narrow = 0, plain_outside = 0;
    for (int n = 0; n < ROWS * D; n++) {
        const double bound = width[n] + moe_bf16_step(y64[n]) + rel * (rms + fabs(y64[n]));
        ck_assert_msg(fabs(y[n] - y64[n]) <= bound, "value %d: %g, truth %g, width %g", n, y[n], y64[n], width[n]);
        narrow += width[n] < 0.01 * rms;
        plain_outside += fabs(plain[n] - y64[n]) > bound;
    }
    ck_assert_int_gt(narrow, ROWS * D * 9 / 10);
    ck_assert_int_gt(plain_outside, ROWS * D / 20);
    free(w2t);
    free(w1t);
    free(width);
    free(y64);
    free(x64);
    free(w2_64);
    free(w1_64);
    free(scratch);
    free(plain);
    free(y);
    free(x);
    free(w2);
    free(w1);
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

/* C[m][n] as moe_sgemm_packed defines it: one fmaf chain, k ascending. */
static float fma_chain(const float *A, const float *Bt, int N, int K, int m, int n)
{
    float acc = 0.0f;
    for (int k = 0; k < K; k++)
        acc = fmaf(A[m * K + k], Bt[k * N + n], acc);
    return acc;
}

/* The packed kernel is its definition bit for bit, on either instruction
 * set, for any M, N, K (short tiles, column tails, several row blocks) and
 * any subset of rows; the data is such that a kernel without fused
 * multiply-adds would differ (checked). */
START_TEST(packed_gemm_is_the_fma_chain)
{
    /* the last tiles of a block 1 to 6 rows high, on whole panel pairs and on a lone panel */
    static const int shapes[][3] = {{1, 1, 1},    {7, 37, 19},  {70, 64, 33}, {5, 95, 128},
                                    {66, 31, 8},  {13, 16, 1},  {260, 20, 4096},
                                    {13, 70, 1100}, {8, 32, 21}, {9, 80, 5}, {11, 48, 30},
                                    {200, 40, 96}}; /* the last: short K, blocks of 96 rows at most */
    long fused_shows = 0;
    for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
        const int M = shapes[c][0], N = shapes[c][1], K = shapes[c][2];
        float *A = malloc(sizeof(float) * M * K), *B = malloc(sizeof(float) * N * K);
        float *Bt = malloc(sizeof(float) * K * N);
        float *Bp = malloc(sizeof(float) * moe_sgemm_packed_floats(K, N));
        float *C = malloc(sizeof(float) * M * N), *part = malloc(sizeof(float) * M * N);
        moe_synth_fill(5, MOE_TENSOR_TOKENS, 0, 0, M * K, 1.0f, A);
        moe_synth_fill(5, MOE_TENSOR_GATE, 0, 0, N * K, 0.3f, B);
        moe_transpose(N, K, B, Bt);
        moe_sgemm_pack(N, K, B, Bp);
        for (int isa = MOE_ISA_WIDEST; isa <= MOE_ISA_PORTABLE; isa++) {
            moe_sgemm_packed_force((enum moe_isa)isa);
            memset(C, 0xff, sizeof(float) * M * N);
            moe_sgemm_packed(M, N, K, A, K, Bp, C, N);
            for (int m = 0; m < M; m++)
                for (int n = 0; n < N; n++) {
                    const float want = fma_chain(A, Bt, N, K, m, n);
                    ck_assert_msg(memcmp(&want, &C[m * N + n], sizeof want) == 0,
                                  "%s, shape %dx%dx%d at (%d, %d): %a vs %a", moe_sgemm_packed_isa(),
                                  M, N, K, m, n, want, C[m * N + n]);
                    if (isa == MOE_ISA_WIDEST) {
                        float plain = 0.0f;
                        for (int k = 0; k < K; k++)
                            plain += A[m * K + k] * Bt[k * N + n];
                        fused_shows += memcmp(&plain, &want, sizeof want) != 0;
                    }
                }
            if (M > 3) { /* rows 3.. alone, at another position */
                moe_sgemm_packed(M - 3, N, K, A + 3 * K, K, Bp, part, N);
                ck_assert_int_eq(memcmp(part, C + 3 * N, sizeof(float) * (M - 3) * N), 0);
            }
            { /* the rows read in place from anywhere: here stored in reverse, K + 5 apart */
                float *far = malloc(sizeof(float) * M * (K + 5));
                const float **rows = malloc(sizeof(float *) * M);
                for (int m = 0; m < M; m++) {
                    memcpy(far + (M - 1 - m) * (K + 5), A + m * K, sizeof(float) * K);
                    rows[m] = far + (M - 1 - m) * (K + 5);
                }
                memset(part, 0xff, sizeof(float) * M * N);
                moe_sgemm_packed_rows(M, N, K, rows, NULL, Bp, part, N);
                ck_assert_int_eq(memcmp(part, C, sizeof(float) * M * N), 0);
                free(rows);
                free(far);
            }
            { /* C's rows written anywhere: here in reverse, N + 3 apart, with
               * the floats between them left alone */
                const int ldc = N + 3;
                float *scattered = malloc(sizeof(float) * M * ldc);
                moe_index *at = malloc(sizeof(moe_index) * M);
                for (int m = 0; m < M; m++)
                    at[m] = M - 1 - m;
                memset(scattered, 0xff, sizeof(float) * M * ldc);
                moe_sgemm_packed_to(M, N, K, A, K, Bp, scattered, ldc, at);
                for (int m = 0; m < M; m++) {
                    const float *row = scattered + at[m] * ldc;
                    ck_assert_int_eq(memcmp(row, C + m * N, sizeof(float) * N), 0);
                    for (int j = N; j < ldc; j++)
                        ck_assert_uint_eq(((const uint32_t *)row)[j], 0xffffffffu);
                }
                free(at);
                free(scattered);
            }
        }
        moe_sgemm_packed_force(MOE_ISA_WIDEST);
        free(part);
        free(C);
        free(Bp);
        free(Bt);
        free(B);
        free(A);
    }
    ck_assert_int_gt(fused_shows, 100);
}
END_TEST

/* The transpose, in blocks, is the element-by-element one at shapes that
 * are and are not multiples of its block; packing the panels from Bt (K, N)
 * gives the floats that packing its transpose (N, K) does. */
START_TEST(transpose_and_row_packing_are_the_definitions)
{
    static const int shapes[][2] = {{1, 1}, {5, 37}, {16, 16}, {24, 21}, {33, 64}, {96, 1024}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int K = shapes[s][0], N = shapes[s][1];
        float *Bt = malloc(sizeof(float) * K * N), *B = malloc(sizeof(float) * K * N);
        float *p1 = malloc(sizeof(float) * moe_sgemm_packed_floats(K, N));
        float *p2 = malloc(sizeof(float) * moe_sgemm_packed_floats(K, N));
        moe_synth_fill(7, MOE_TENSOR_TOKENS, 0, 0, (uint64_t)K * N, 1.0f, Bt);
        moe_transpose(K, N, Bt, B); /* (N, K) */
        for (int k = 0; k < K; k++)
            for (int n = 0; n < N; n++)
                ck_assert_msg(B[n * K + k] == Bt[k * N + n], "transpose %dx%d at (%d, %d)", K, N, k, n);
        moe_sgemm_pack(N, K, B, p1);
        moe_sgemm_pack_rows(K, N, Bt, p2);
        ck_assert_msg(!memcmp(p1, p2, sizeof(float) * moe_sgemm_packed_floats(K, N)),
                      "pack_rows %dx%d", K, N);
        /* Rows read in place through an index: the rows of Bt reversed,
         * packed and transposed from where they lie, as from a gathered copy */
        moe_index *at = malloc(sizeof(moe_index) * K);
        float *reversed = malloc(sizeof(float) * K * N), *t1 = malloc(sizeof(float) * K * N);
        for (int k = 0; k < K; k++) {
            at[k] = K - 1 - k;
            memcpy(reversed + k * N, Bt + (K - 1 - k) * N, sizeof(float) * N);
        }
        moe_sgemm_pack_rows(K, N, reversed, p1);
        moe_sgemm_pack_rows_at(K, N, Bt, at, p2);
        ck_assert_msg(!memcmp(p1, p2, sizeof(float) * moe_sgemm_packed_floats(K, N)),
                      "pack_rows_at %dx%d", K, N);
        moe_transpose(K, N, reversed, B);
        moe_transpose_rows_at(K, N, Bt, at, t1);
        ck_assert_msg(!memcmp(B, t1, sizeof(float) * K * N), "transpose_rows_at %dx%d", K, N);
        free(t1);
        free(reversed);
        free(at);
        free(p2);
        free(p1);
        free(B);
        free(Bt);
    }
}
END_TEST

/* moe_sgemm_packed_t (C = A B read from B's forward panels) against
 * moe_sgemm_packed on B laid out as its operand, bit for bit, at every row
 * count from `first` to `most`, on the tiles from the widest down to
 * `narrowest`; with padded leading dimensions, and values where an
 * unfused multiply-add would round differently (A and B of mixed
 * magnitudes), so that a kernel without FMA would differ. */
static void check_packed_t(int first, int most, int N, int K, enum moe_isa narrowest)
{
    const int lda = N + 3, ldc = K + 2;
    float *A = malloc(sizeof(float) * most * lda), *B = malloc(sizeof(float) * N * K);
    float *fwd = malloc(sizeof(float) * moe_sgemm_packed_floats(K, N));
    float *bwd = malloc(sizeof(float) * moe_sgemm_packed_floats(N, K));
    float *want = malloc(sizeof(float) * most * ldc), *got = malloc(sizeof(float) * most * ldc);
    moe_synth_fill(8, MOE_TENSOR_TOKENS, 0, 0, (uint64_t)most * lda, 1.0f, A);
    moe_synth_fill(8, MOE_TENSOR_GATE, 0, 0, (uint64_t)N * K, 0.3f, B);
    for (int n = 0; n < N * K; n += 3)
        B[n] *= 4096.0f;
    moe_sgemm_pack(N, K, B, fwd);      /* as the forward holds B */
    moe_sgemm_pack_rows(N, K, B, bwd); /* B as the operand Bt of C = A B */
    for (int isa = MOE_ISA_WIDEST; isa <= (int)narrowest; isa++) {
        moe_sgemm_packed_force((enum moe_isa)isa);
        for (int M = first; M <= most; M++) {
            memset(want, 0, sizeof(float) * M * ldc);
            memset(got, 0, sizeof(float) * M * ldc);
            moe_sgemm_packed(M, K, N, A, lda, bwd, want, ldc);
            moe_sgemm_packed_t(M, N, K, A, lda, fwd, got, ldc);
            ck_assert_msg(!memcmp(got, want, sizeof(float) * M * ldc), "%dx%dx%d, %s", M, N, K,
                          moe_sgemm_packed_isa());
        }
    }
    moe_sgemm_packed_force(MOE_ISA_WIDEST);
    free(got);
    free(want);
    free(bwd);
    free(fwd);
    free(B);
    free(A);
}

/* On every tile, at shapes with partial tiles and panels every way (rows
 * past the last whole panel padded, in one tail tile and with the panel
 * before them in two, K across the tail's chunks of 48). */
START_TEST(packed_t_is_packed_on_the_transposed_operand)
{
    static const int shapes[][3] = {{1, 1, 1},     {7, 5, 13},    {16, 16, 6},  {33, 40, 17},
                                    {45, 19, 9},   {96, 64, 50},  {80, 24, 30}, {40, 33, 23},
                                    {104, 21, 12}, {71, 37, 101}, {77, 35, 53}, {46, 16, 64},
                                    {53, 29, 70}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        check_packed_t(shapes[s][0], shapes[s][0], shapes[s][1], shapes[s][2], MOE_ISA_PORTABLE);
}
END_TEST

/* On the widest tiles at every row count from 1 to 130: packed_t_full's
 * every case (none to eight whole panels, an even or odd number of them,
 * each remainder, padded or in tail tiles), K across two of the tail's
 * chunks of 48. */
START_TEST(packed_t_is_packed_at_every_row_count)
{
    check_packed_t(1, 130, 37, 53, MOE_ISA_WIDEST);
}
END_TEST

#ifdef _OPENMP
/* A library call borrows the caller's thread counts (moe_comm_threads_borrow;
 * only the comm's share is read, no MPI): set to the share where the
 * environment does not name them, OpenMP on one thread beside a
 * multithreaded OpenBLAS, and given back as they were. */
START_TEST(library_calls_borrow_the_threads_and_give_them_back)
{
    const moe_comm c = {.threads = 2};
    unsetenv("OMP_NUM_THREADS");
    unsetenv("OPENBLAS_NUM_THREADS");
    moe_gemm_set_threads(1); /* first: an OpenMP OpenBLAS sets OpenMP's count too */
    omp_set_num_threads(5);
    moe_thread_settings was = moe_comm_threads_borrow(&c, MOE_GEMM_PACKED);
    ck_assert_int_eq(omp_get_max_threads(), 2);
    ck_assert_int_eq(moe_gemm_threads(), 2);
    moe_comm_threads_return(&was);
    ck_assert_int_eq(omp_get_max_threads(), 5);
    ck_assert_int_eq(moe_gemm_threads(), 1);
    was = moe_comm_threads_borrow(&c, MOE_GEMM_BLAS); /* OpenBLAS's threads do the GEMMs */
    ck_assert_int_eq(omp_get_max_threads(), 1);
    moe_comm_threads_return(&was);
    ck_assert_int_eq(omp_get_max_threads(), 5);
    setenv("OMP_NUM_THREADS", "3", 1); /* the environment's word stands */
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    was = moe_comm_threads_borrow(&c, MOE_GEMM_PACKED);
    ck_assert_int_eq(omp_get_max_threads(), 5);
    ck_assert_int_eq(moe_gemm_threads(), 1);
    moe_comm_threads_return(&was);
    ck_assert_int_eq(omp_get_max_threads(), 5);
}
END_TEST

/* Threads split the columns; the bits do not change. */
START_TEST(packed_gemm_is_thread_independent)
{
    enum { M = 39, N = 200, K = 70 }; /* the transposed product's last 7 rows a tail */
    float *A = malloc(sizeof(float) * M * K), *B = malloc(sizeof(float) * N * K);
    float *Bp = malloc(sizeof(float) * moe_sgemm_packed_floats(K, N));
    float *C1 = malloc(sizeof(float) * M * N), *C3 = malloc(sizeof(float) * M * N);
    moe_synth_fill(6, MOE_TENSOR_TOKENS, 0, 0, M * K, 1.0f, A);
    moe_synth_fill(6, MOE_TENSOR_GATE, 0, 0, N * K, 0.3f, B);
    moe_sgemm_pack(N, K, B, Bp);
    omp_set_num_threads(1);
    moe_sgemm_packed(M, N, K, A, K, Bp, C1, N);
    omp_set_num_threads(3);
    moe_sgemm_packed(M, N, K, A, K, Bp, C3, N);
    omp_set_num_threads(1);
    ck_assert_int_eq(memcmp(C1, C3, sizeof(float) * M * N), 0);
    /* and the transposed product on the same panels: C (M, K) = A' (M, N) B */
    float *A2 = malloc(sizeof(float) * M * N), *D1 = malloc(sizeof(float) * M * K),
          *D3 = malloc(sizeof(float) * M * K);
    moe_synth_fill(6, MOE_TENSOR_TOKENS, 1, 0, M * N, 1.0f, A2);
    moe_sgemm_packed_t(M, N, K, A2, N, Bp, D1, K);
    omp_set_num_threads(3);
    moe_sgemm_packed_t(M, N, K, A2, N, Bp, D3, K);
    omp_set_num_threads(1);
    ck_assert_int_eq(memcmp(D1, D3, sizeof(float) * M * K), 0);
    free(D3);
    free(D1);
    free(A2);
    free(C3);
    free(C1);
    free(Bp);
    free(B);
    free(A);
}
END_TEST
#endif

/* exact and packed: the FFN of a batch is the same in chunks of 7 rows
 * (packed: also with the rows read in place). */
START_TEST(row_independent_ffn_is_chunk_independent)
{
    enum { ROWS = 45, D = 48, F = 24 };
    const enum moe_gemm_kind kind = _i ? MOE_GEMM_PACKED : MOE_GEMM_EXACT;
    float w1[2 * F * D], w2[D * F], w1t[2 * F * D], w2t[D * F], x[ROWS * D];
    float y[ROWS * D], y_chunked[ROWS * D], scratch[ROWS * 3 * F];
    moe_expert_generate(9, 1, D, F, w1, w2);
    /* D and 2F are multiples of 16: the packed layout takes no more room */
    moe_expert_layout(kind, D, F, w1, w2, w1t, w2t);
    moe_synth_fill(9, MOE_TENSOR_TOKENS, 0, 0, ROWS * D, 1.0f, x);
    const moe_expert_weights w = {.w1t = w1t, .w2t = w2t};
    moe_expert_forward(&w, kind, x, ROWS, D, F, scratch, y, NULL, NULL);
    const moe_ffn_hooks hooks = {NULL, NULL, 7};
    moe_expert_forward(&w, kind, x, ROWS, D, F, scratch, y_chunked, NULL, &hooks);
    ck_assert_int_eq(memcmp(y, y_chunked, sizeof y), 0);
    if (kind == MOE_GEMM_PACKED) {
        /* the rows read in place, in chunks, through a row table and an index:
         * row n stored in reverse order, every other row of far */
        float far[2 * ROWS * D];
        const float *row_at[ROWS];
        moe_index index[ROWS];
        for (int n = 0; n < ROWS; n++) {
            row_at[n] = far + 2 * n * D;
            index[n] = ROWS - 1 - n;
            memcpy(far + 2 * index[n] * D, x + n * D, sizeof(float) * D);
        }
        memset(y_chunked, 0xff, sizeof y_chunked);
        moe_expert_forward_rows(&w, row_at, index, ROWS, D, F, scratch, y_chunked, NULL, NULL,
                                &hooks);
        ck_assert_int_eq(memcmp(y, y_chunked, sizeof y), 0);
        /* the outputs written through an index: row n at every other row, in reverse */
        float spread[2 * ROWS * D];
        moe_index dest[ROWS];
        for (int n = 0; n < ROWS; n++)
            dest[n] = 2 * (ROWS - 1 - n) + 1;
        memset(spread, 0xff, sizeof spread);
        moe_expert_forward_rows(&w, row_at, index, ROWS, D, F, scratch, spread, dest, NULL, &hooks);
        for (int n = 0; n < ROWS; n++)
            ck_assert_int_eq(memcmp(spread + dest[n] * D, y + n * D, sizeof(float) * D), 0);
        /* and without an index, the table in row order */
        const float *in_order[ROWS];
        for (int n = 0; n < ROWS; n++)
            in_order[n] = row_at[index[n]];
        memset(y_chunked, 0xff, sizeof y_chunked);
        moe_expert_forward_rows(&w, in_order, NULL, ROWS, D, F, scratch, y_chunked, NULL, NULL,
                                &hooks);
        ck_assert_int_eq(memcmp(y, y_chunked, sizeof y), 0);
    }
    /* and it computes the FFN: close to the blas path */
    float y_blas[ROWS * D];
    moe_expert_layout(MOE_GEMM_BLAS, D, F, w1, w2, w1t, w2t);
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

/* The truth's fixed-order fp64 GEMM is its definition bit for bit, for
 * short row blocks and column tails, any subset of rows and any thread
 * count. */
START_TEST(exact_dgemm_is_the_scalar_loop)
{
    static const int shapes[][3] = {{1, 1, 1}, {7, 37, 19}, {70, 64, 33}, {5, 95, 128}, {131, 9, 8}};
    for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
        const int M = shapes[c][0], N = shapes[c][1], K = shapes[c][2];
        float *a32 = malloc(sizeof(float) * M * K), *b32 = malloc(sizeof(float) * N * K);
        double *A = malloc(sizeof(double) * M * K), *B = malloc(sizeof(double) * N * K);
        double *C = malloc(sizeof(double) * M * N), *again = malloc(sizeof(double) * M * N);
        moe_synth_fill(7, MOE_TENSOR_TOKENS, 0, 0, M * K, 1.0f, a32);
        moe_synth_fill(7, MOE_TENSOR_GATE, 0, 0, N * K, 0.3f, b32);
        for (int n = 0; n < M * K; n++)
            A[n] = a32[n] / 3.0; /* full 53-bit mantissas, so the order shows */
        for (int n = 0; n < N * K; n++)
            B[n] = b32[n] / 7.0;
        moe_dgemm_nt_exact(M, N, K, A, K, B, K, C, N);
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                double acc = 0.0;
                for (int k = 0; k < K; k++)
                    acc += A[m * K + k] * B[n * K + k];
                ck_assert_msg(memcmp(&acc, &C[m * N + n], sizeof acc) == 0,
                              "shape %dx%dx%d at (%d, %d): %a vs %a", M, N, K, m, n, acc, C[m * N + n]);
            }
        if (M > 3) { /* rows 3.. alone, at another position */
            moe_dgemm_nt_exact(M - 3, N, K, A + 3 * K, K, B, K, again, N);
            ck_assert_int_eq(memcmp(again, C + 3 * N, sizeof(double) * (M - 3) * N), 0);
        }
#ifdef _OPENMP
        omp_set_num_threads(3);
        moe_dgemm_nt_exact(M, N, K, A, K, B, K, again, N);
        omp_set_num_threads(1);
        ck_assert_int_eq(memcmp(again, C, sizeof(double) * M * N), 0);
#endif
        free(again);
        free(C);
        free(B);
        free(A);
        free(b32);
        free(a32);
    }
}
END_TEST

/* Units in the last place of double v's binade. */
static double ulp_of_double(double v)
{
    return nextafter(fabs(v), INFINITY) - fabs(v);
}

/* The largest error of moe_exp_fp64 in ulps on [from, to] in steps of
 * step, against expl; *count receives the points tried. */
static double exp_fp64_worst_ulps(double from, double to, double step, long *count)
{
    double worst = 0.0;
    for (double x = from; x <= to; x += step, ++*count) {
        const long double exact = expl((long double)x);
        const double err = (double)fabsl((long double)moe_exp_fp64(x) - exact) / ulp_of_double((double)exact);
        worst = err > worst ? err : worst;
    }
    return worst;
}

START_TEST(exp_fp64_is_within_2_ulp_and_handles_the_edges)
{
    const double lo = -708.3964185322641, hi = 709.782712893384;
    long n = 0;
    const double worst = fmax(exp_fp64_worst_ulps(lo, hi, 0.000731, &n),
                              /* the router's and SwiGLU's range, densely */
                              exp_fp64_worst_ulps(-2.0, 2.0, 0.0000131, &n));
    ck_assert_int_gt(n, 2000000);
    ck_assert_double_le(worst, 2.0);
    ck_assert_double_eq(moe_exp_fp64(0.0), 1.0);
    ck_assert_double_eq(moe_exp_fp64(-0.0), 1.0);
    const double e = 2.718281828459045; /* the double nearest e */
    ck_assert_double_le(fabs(moe_exp_fp64(1.0) - e), ulp_of_double(e));
    ck_assert_double_eq(moe_exp_fp64(710.0), INFINITY);
    ck_assert_double_eq(moe_exp_fp64(INFINITY), INFINITY);
    ck_assert_double_eq(moe_exp_fp64(-709.0), 0.0);
    ck_assert_double_eq(moe_exp_fp64(-INFINITY), 0.0);
    ck_assert(isnan(moe_exp_fp64(NAN)));
    ck_assert(isfinite(moe_exp_fp64(hi)) && moe_exp_fp64(hi) > 1.79e308);
    ck_assert(moe_exp_fp64(lo) >= DBL_MIN); /* never subnormal */
}
END_TEST

/* The eight-lane form gives moe_exp_fp64's bits: every tail length, the
 * edges, NaN payloads and the routers' and SwiGLU's range. */
START_TEST(exp_fp64_lanes_give_the_same_bits)
{
    enum { N = 4099 };
    double *x = malloc(sizeof(double) * N), *y = malloc(sizeof(double) * N);
    const double edges[] = {0.0, -0.0, 1.0, -1.0, 709.782712893384, nextafter(709.782712893384, 800),
                            -708.3964185322641, nextafter(-708.3964185322641, -800), 710.0, -709.0,
                            INFINITY, -INFINITY, NAN, -NAN, 1e-300, -1e-300, 4.9e-324, 0.5, -0.5,
                            0.34657359027997264, 700.0, -700.0};
    const int E = (int)(sizeof edges / sizeof *edges);
    uint64_t payload = 0x7ff4000000000123u;
    for (int i = 0; i < N; i++)
        x[i] = i < E ? edges[i] : -30.0 + 60.0 * (double)(i * 7919 % N) / N + 1e-9 * i;
    memcpy(&x[E], &payload, sizeof payload); /* a NaN with a payload */
    for (long n = 0; n <= 17; n++) { /* every tail, out of place */
        moe_exp_fp64_n(x, y, n);
        for (long i = 0; i < n; i++)
            ck_assert_mem_eq(&y[i], &(double){moe_exp_fp64(x[i])}, sizeof(double));
    }
    for (int i = E + 1; i < N; i++) /* the whole range, in place */
        x[i] = -745.0 + 1460.0 * (double)(i * 104729 % N) / N;
    memcpy(y, x, sizeof(double) * N);
    moe_exp_fp64_n(y, y, N);
    for (int i = 0; i < N; i++)
        ck_assert_mem_eq(&y[i], &(double){moe_exp_fp64(x[i])}, sizeof(double));
    free(x);
    free(y);
}
END_TEST

/* The expert forward's SwiGLU gives the same bits at 16 lanes as at 8: f
 * with and without tails at both widths, gates past exp's edges (x scaled
 * up), and the gate weight applied inside. */
START_TEST(activation_lanes_give_the_same_bits)
{
    enum { ROWS = 7, D = 24 };
    static const int ffns[] = {1, 7, 8, 15, 16, 17, 40, 64};
    static const float scales[] = {1.0f, 400.0f};
    for (size_t i = 0; i < sizeof ffns / sizeof *ffns; i++)
        for (size_t s = 0; s < sizeof scales / sizeof *scales; s++) {
            const int F = ffns[i];
            float *w1 = malloc(sizeof(float) * 2 * F * D), *w2 = malloc(sizeof(float) * D * F);
            float *x = malloc(sizeof(float) * ROWS * D), *scratch = malloc(sizeof(float) * ROWS * 3 * F);
            float *y[2] = {malloc(sizeof(float) * ROWS * D), malloc(sizeof(float) * ROWS * D)};
            float *w1t = malloc(sizeof(float) * moe_expert_w1_floats(MOE_GEMM_PACKED, D, F));
            float *w2t = malloc(sizeof(float) * moe_expert_w2_floats(MOE_GEMM_PACKED, D, F));
            const float gate_weight[ROWS] = {1.0f, 0.5f, 0.25f, 2.0f, 0.125f, 1.5f, 0.75f};
            moe_expert_generate(3, 2, D, F, w1, w2);
            moe_expert_layout(MOE_GEMM_PACKED, D, F, w1, w2, w1t, w2t);
            moe_synth_fill(5, MOE_TENSOR_TOKENS, 0, 0, (uint64_t)(ROWS * D), scales[s], x);
            const moe_expert_weights w = {.w1t = w1t, .w2t = w2t};
            const enum moe_isa isas[2] = {MOE_ISA_WIDEST, MOE_ISA_AVX2};
            for (int k = 0; k < 2; k++) {
                moe_expert_activation_force(isas[k]);
                moe_expert_forward(&w, MOE_GEMM_PACKED, x, ROWS, D, F, scratch, y[k],
                                   s ? gate_weight : NULL, NULL);
            }
            moe_expert_activation_force(MOE_ISA_WIDEST);
            ck_assert_msg(!memcmp(y[0], y[1], sizeof(float) * ROWS * D), "f = %d, scale %g", F,
                          (double)scales[s]);
            free(w2t);
            free(w1t);
            free(y[1]);
            free(y[0]);
            free(scratch);
            free(x);
            free(w2);
            free(w1);
        }
}
END_TEST

/* The guard the golden dump sets: a BLAS call under it stops the process. */
START_TEST(forbidden_blas_stops_the_process)
{
    double a = 1.0, b = 2.0, c = 0.0;
    moe_gemm_forbid_blas("a test");
    moe_dgemm_nt_exact(1, 1, 1, &a, 1, &b, 1, &c, 1); /* ours: allowed */
    ck_assert_double_eq(c, 2.0);
    moe_dgemm_nt(1, 1, 1, &a, 1, &b, 1, &c, 1);
}
END_TEST

/* The truth evaluates each expert on the tokens that selected it: the same
 * bits as the literal dense sum (every expert on every token, zero-gate
 * terms added), values and allowance, for both combines and bf16; and with
 * a non-finite token row, non-finite in exactly the rows the literal sum is.
 * _i: 0 pairs, 1 reduced (on 3 ranks), 2 reduced bf16 weighted before L2. */
START_TEST(truth_on_selected_tokens_is_the_dense_sum)
{
    moe_config cfg;
    moe_config_defaults(&cfg);
    cfg.tokens = 24, cfg.hidden = 16, cfg.ffn = 8, cfg.experts = 7, cfg.topk = 2;
    cfg.shared_experts = 1;
    cfg.combine = _i == 0 ? MOE_COMBINE_PAIRS : MOE_COMBINE_REDUCED;
    cfg.combine_dtype = _i == 2 ? MOE_DTYPE_BF16 : MOE_DTYPE_FP32;
    cfg.weight_at = _i == 2 ? MOE_WEIGHT_AT_ACTIVATION : MOE_WEIGHT_AT_OUTPUT;
    const moe_index T = cfg.tokens, d = cfg.hidden, k = cfg.topk;
    float *x = malloc(sizeof(float) * (size_t)(T * d));
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(T * k));
    float *weights = malloc(sizeof(float) * (size_t)(T * k));
    double *y[2], *allow[2];
    for (int n = 0; n < 2; n++) {
        y[n] = malloc(sizeof(double) * (size_t)(T * d));
        allow[n] = malloc(sizeof(double) * (size_t)(T * d));
    }
    moe_synth_tokens(cfg.seed, 0, T, d, 1.0f, MOE_INPUT_UNIFORM, x);
    for (moe_index i = 0; i < T; i++) /* experts 5 and 6 never selected */
        for (int s = 0; s < (int)k; s++) {
            ids[i * k + s] = (int32_t)((i + 2 * s) % 5);
            weights[i * k + s] = 0.25f + 0.5f * (float)s;
        }
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1)
            x[5 * d + 3] = INFINITY;
        moe_truth_forward(&cfg, MOE_TRUTH_EXACT, x, x, ids, weights, T, 3, y[0], allow[0]);
        moe_truth_forward_literal(&cfg, MOE_TRUTH_EXACT, x, x, ids, weights, T, 3, y[1], allow[1]);
        for (moe_index m = 0; m < T * d; m++) {
            const bool row5 = m / d == 5;
            if (pass == 0 || !row5) {
                ck_assert_msg(!memcmp(&y[0][m], &y[1][m], sizeof(double)), "y[%lld]: %a vs %a",
                              (long long)m, y[0][m], y[1][m]);
                ck_assert(!memcmp(&allow[0][m], &allow[1][m], sizeof(double)));
                ck_assert(isfinite(y[0][m]));
            } else {
                ck_assert_msg(!isfinite(y[0][m]) && !isfinite(y[1][m]), "row 5 [%lld]: %g vs %g",
                              (long long)(m % d), y[0][m], y[1][m]);
            }
        }
    }
    for (int n = 0; n < 2; n++) {
        free(y[n]);
        free(allow[n]);
    }
    free(weights);
    free(ids);
    free(x);
}
END_TEST

/* The truth split by rank (what run --check sums over ranks): every rank's
 * share of every token, summed in rank order, plus the shared experts, is
 * moe_truth_forward_placed on all the tokens. With --combine reduced a
 * share is the rank's one sum per token, so the bits are the same (values
 * and allowance); with --combine pairs the terms are summed by rank first,
 * so within fp64 roundings. Each expert sees more than a rank's tokens (its
 * rows go in blocks of cfg.tokens). _i: 0 reduced, 1 reduced bf16 weighted
 * before L2 with pairs placed off the placement, 2 pairs bf16, 3 pairs. */
START_TEST(truth_shares_sum_to_the_truth)
{
    enum { G = 3 };
    moe_config cfg;
    moe_config_defaults(&cfg);
    cfg.tokens = 10, cfg.hidden = 16, cfg.ffn = 8, cfg.experts = 7, cfg.topk = 2;
    cfg.shared_experts = 1;
    cfg.combine = _i < 2 ? MOE_COMBINE_REDUCED : MOE_COMBINE_PAIRS;
    cfg.combine_dtype = _i == 1 || _i == 2 ? MOE_DTYPE_BF16 : MOE_DTYPE_FP32;
    cfg.weight_at = _i == 1 ? MOE_WEIGHT_AT_ACTIVATION : MOE_WEIGHT_AT_OUTPUT;
    ck_assert(moe_config_truth_shares(&cfg));
    const moe_index N = G * cfg.tokens, d = cfg.hidden, k = cfg.topk;
    float *x = malloc(sizeof(float) * (size_t)(N * d));
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(N * k));
    int32_t *at = malloc(sizeof(int32_t) * (size_t)(N * k));
    float *weights = malloc(sizeof(float) * (size_t)(N * k));
    double *want = malloc(sizeof(double) * (size_t)(N * d));
    double *want_allow = malloc(sizeof(double) * (size_t)(N * d));
    double *got = calloc((size_t)(N * d), sizeof(double));
    double *got_allow = calloc((size_t)(N * d), sizeof(double));
    double *share = malloc(sizeof(double) * (size_t)(N * d));
    double *share_allow = malloc(sizeof(double) * (size_t)(N * d));
    moe_synth_tokens(cfg.seed, 0, N, d, 1.0f, MOE_INPUT_UNIFORM, x);
    for (moe_index i = 0; i < N; i++)
        for (int s = 0; s < (int)k; s++) {
            ids[i * k + s] = (int32_t)((i + (moe_index)s) % 4); /* N / 2 rows each; 4 to 6 none */
            weights[i * k + s] = 0.25f + 0.5f * (float)s;
            at[i * k + s] = (int32_t)((i + (moe_index)s) % G);
        }
    const int32_t *pair_rank = _i == 1 ? at : NULL;
    moe_truth_forward_placed(&cfg, MOE_TRUTH_EXACT, x, x, ids, weights, N, G, pair_rank, want,
                             want_allow);
    for (int r = 0; r < G; r++) {
        moe_truth_forward_share(&cfg, MOE_TRUTH_EXACT, x, ids, weights, N, G, pair_rank, r, share,
                                share_allow);
        for (moe_index m = 0; m < N * d; m++) {
            got[m] += share[m];
            got_allow[m] += share_allow[m];
        }
    }
    moe_truth_add_shared(&cfg, MOE_TRUTH_EXACT, x, N, got);
    const double rms = sqrt(moe_sum_squares(want, N * d) / (double)(N * d));
    ck_assert(rms > 0.0);
    for (moe_index m = 0; m < N * d; m++) {
        if (_i < 2) {
            ck_assert_msg(!memcmp(&got[m], &want[m], sizeof(double)), "y[%lld]: %a vs %a",
                          (long long)m, got[m], want[m]);
            ck_assert(!memcmp(&got_allow[m], &want_allow[m], sizeof(double)));
        } else {
            ck_assert_msg(fabs(got[m] - want[m]) <= 1e-14 * rms, "y[%lld]: %a vs %a",
                          (long long)m, got[m], want[m]);
            ck_assert(fabs(got_allow[m] - want_allow[m]) <= 1e-14 * rms);
        }
    }
    free(share_allow);
    free(share);
    free(got_allow);
    free(got);
    free(want_allow);
    free(want);
    free(weights);
    free(at);
    free(ids);
    free(x);
}
END_TEST

/* The backward's truth split by rank (what run --backward --check does):
 * each rank runs its own experts (contiguous blocks) on every token, the
 * dx and gate-weight shares are summed in rank order, then the router's and
 * the shared experts' terms are added; that is moe_truth_backward_tokens
 * on all the tokens. A token's routed terms are summed in expert order
 * either way, grouped by rank in the split: with k = 2 the two terms are
 * one addition, so the bits are the same; with k = 3 within fp64
 * roundings. Each expert's dW is the same whether its dx is wanted or not.
 * _i: 0 k = 2, 1 k = 3. */
START_TEST(backward_truth_shares_sum_to_the_truth)
{
    enum { G = 3 };
    moe_config cfg;
    moe_config_defaults(&cfg);
    cfg.tokens = 10, cfg.hidden = 16, cfg.ffn = 8, cfg.experts = 7, cfg.topk = 2 + _i;
    cfg.shared_experts = 1;
    const moe_index N = G * cfg.tokens, d = cfg.hidden, f = cfg.ffn, k = cfg.topk;
    const int E = (int)cfg.experts, EL = (E + G - 1) / G;
    const moe_router router = {.kind = MOE_ROUTER_SOFTMAX, .experts = E, .topk = (int)k,
                               .normalize = true, .groups = 1, .topk_groups = 1,
                               .route_scale = 1.0f};
    float *x = malloc(sizeof(float) * (size_t)(N * d));
    float *dy = malloc(sizeof(float) * (size_t)(N * d));
    float *gate = malloc(sizeof(float) * (size_t)(E * d));
    float *logits = malloc(sizeof(float) * (size_t)(N * E));
    float *scores = malloc(sizeof(float) * (size_t)(N * E));
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(N * k));
    float *weights = malloc(sizeof(float) * (size_t)(N * k));
    double *want[4], *got[4]; /* dx, dgate, dshared_w1, dshared_w2 */
    const moe_index sizes[4] = {N * d, E * d, 2 * f * d, d * f};
    for (int t = 0; t < 4; t++) {
        want[t] = malloc(sizeof(double) * (size_t)sizes[t]);
        got[t] = malloc(sizeof(double) * (size_t)sizes[t]);
    }
    double *dx_share = malloc(sizeof(double) * (size_t)(N * d));
    double *dw_share = malloc(sizeof(double) * (size_t)(N * k));
    double *dweights = calloc((size_t)(N * k), sizeof(double));
    double *dw1[2], *dw2[2];
    for (int n = 0; n < 2; n++) {
        dw1[n] = malloc(sizeof(double) * (size_t)(2 * f * d));
        dw2[n] = malloc(sizeof(double) * (size_t)(d * f));
    }
    moe_synth_tokens(cfg.seed, 0, N, d, 1.0f, MOE_INPUT_UNIFORM, x);
    moe_synth_tokens(cfg.seed, 1, N, d, 1.0f, MOE_INPUT_UNIFORM, dy);
    moe_synth_fill(cfg.seed, MOE_TENSOR_GATE, 0, 0, E * d, 2.0f, gate);
    moe_router_logits(x, gate, N, d, E, logits);
    moe_router_select(&router, logits, N, scores, ids, weights);
    moe_truth_backward_tokens(&cfg, &router, MOE_TRUTH_EXACT, gate, x, ids, weights, logits, dy, N,
                              want[0], want[1], want[2], want[3]);
    memset(got[0], 0, sizeof(double) * (size_t)(N * d));
    for (int r = 0; r < G; r++) {
        memset(dx_share, 0, sizeof(double) * (size_t)(N * d));
        memset(dw_share, 0, sizeof(double) * (size_t)(N * k));
        for (int e = r * EL; e < E && e < (r + 1) * EL; e++) {
            const moe_index rows = moe_truth_backward_expert(&cfg, MOE_TRUTH_EXACT, e, x, dy, ids,
                                                             weights, N, dx_share, dw_share,
                                                             dw1[0], dw2[0]);
            ck_assert_int_eq(moe_truth_backward_expert(&cfg, MOE_TRUTH_EXACT, e, x, dy, ids,
                                                       weights, N, NULL, NULL, dw1[1], dw2[1]),
                             rows);
            ck_assert(!memcmp(dw1[0], dw1[1], sizeof(double) * (size_t)(2 * f * d)));
            ck_assert(!memcmp(dw2[0], dw2[1], sizeof(double) * (size_t)(d * f)));
        }
        for (moe_index m = 0; m < N * d; m++)
            got[0][m] += dx_share[m];
        for (moe_index m = 0; m < N * k; m++)
            dweights[m] += dw_share[m];
    }
    moe_truth_backward_rest(&cfg, &router, MOE_TRUTH_EXACT, gate, x, ids, logits, dy, N, dweights,
                            got[0], got[1], got[2], got[3]);
    for (int t = 0; t < 4; t++) {
        const double rms = sqrt(moe_sum_squares(want[t], sizes[t]) / (double)sizes[t]);
        ck_assert(rms > 0.0);
        for (moe_index m = 0; m < sizes[t]; m++)
            if (_i == 0)
                ck_assert_msg(!memcmp(&got[t][m], &want[t][m], sizeof(double)),
                              "tensor %d [%lld]: %a vs %a", t, (long long)m, got[t][m], want[t][m]);
            else
                ck_assert_msg(fabs(got[t][m] - want[t][m]) <= 1e-14 * rms,
                              "tensor %d [%lld]: %a vs %a", t, (long long)m, got[t][m], want[t][m]);
    }
    for (int n = 0; n < 2; n++) {
        free(dw2[n]);
        free(dw1[n]);
    }
    free(dweights);
    free(dw_share);
    free(dx_share);
    for (int t = 0; t < 4; t++) {
        free(got[t]);
        free(want[t]);
    }
    free(weights);
    free(ids);
    free(scores);
    free(logits);
    free(gate);
    free(dy);
    free(x);
}
END_TEST

/* The FMA peak: a rate at each width the CPU has (at least the 100 MFLOP/s
 * of any core made since FMA units exist, and finite), nothing at the
 * others; the CPU and the BLAS kernel have names. */
START_TEST(fma_peak_is_measured_where_the_width_exists)
{
    for (int w = 0; w < MOE_FMA_WIDTHS; w++) {
        const double rate = moe_fma_rate(moe_fma_bits[w], 0.01);
        if (moe_fma_supported(moe_fma_bits[w]))
            ck_assert_msg(isfinite(rate) && rate > 1e8, "%d-bit: %g FLOP/s", moe_fma_bits[w], rate);
        else
            ck_assert_msg(rate == 0.0, "%d-bit is not on this CPU: %g", moe_fma_bits[w], rate);
    }
    char cpu[128];
    moe_cpu_model(cpu, sizeof cpu);
    ck_assert(cpu[0] != '\0');
    ck_assert(moe_blas_corename() && moe_blas_corename()[0]);
}
END_TEST

Suite *make_experts_suite(void)
{
    Suite *s = suite_create("experts");
    TCase *tc = tcase_create("ffn");
    tcase_add_loop_test(tc, ffn_matches_the_definition, MOE_GEMM_BLAS, MOE_GEMM_PACKED + 1);
    tcase_add_loop_test(tc, rounded_expert_lies_within_the_truths_interval, 0, 6);
    tcase_add_test(tc, compare_reports_worst_and_nonfinite);
    tcase_add_test(tc, fma_peak_is_measured_where_the_width_exists);
    tcase_add_test(tc, exact_gemm_is_the_scalar_loop);
    tcase_add_test(tc, packed_gemm_is_the_fma_chain);
    tcase_add_test(tc, transpose_and_row_packing_are_the_definitions);
    tcase_add_test(tc, packed_t_is_packed_on_the_transposed_operand);
    tcase_add_test(tc, packed_t_is_packed_at_every_row_count);
#ifdef _OPENMP
    tcase_add_test(tc, packed_gemm_is_thread_independent);
    tcase_add_test(tc, library_calls_borrow_the_threads_and_give_them_back);
#endif
    tcase_add_loop_test(tc, row_independent_ffn_is_chunk_independent, 0, 2);
    tcase_add_test(tc, exp_fp32_is_within_2_ulp_and_handles_the_edges);
    tcase_add_test(tc, exact_dgemm_is_the_scalar_loop);
    tcase_add_test(tc, exp_fp64_is_within_2_ulp_and_handles_the_edges);
    tcase_add_test(tc, exp_fp64_lanes_give_the_same_bits);
    tcase_add_test(tc, activation_lanes_give_the_same_bits);
    tcase_add_test_raise_signal(tc, forbidden_blas_stops_the_process, SIGABRT);
    tcase_add_loop_test(tc, truth_on_selected_tokens_is_the_dense_sum, 0, 3);
    tcase_add_loop_test(tc, truth_shares_sum_to_the_truth, 0, 4);
    tcase_add_loop_test(tc, backward_truth_shares_sum_to_the_truth, 0, 2);
    suite_add_tcase(s, tc);
    return s;
}
