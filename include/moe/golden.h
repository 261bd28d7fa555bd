/* SPDX-License-Identifier: MIT */
/* golden.h — golden sets: stage-by-stage tensors for a GPU port, and the
 * comparison of a port's tensors with them (`moe-ep verify`).
 *
 * A golden set is a directory of safetensors files, one per stage, and a
 * manifest.json (written last) that lists the config, the seed, the moe-ep
 * version, every file's SHA-256, and every tensor's stage, dtype, shape and
 * tolerance contract. docs/golden.md describes each tensor. No MPI here.
 */
#ifndef MOE_GOLDEN_H
#define MOE_GOLDEN_H

#include <stdbool.h>
#include <stdio.h>

#include "moe/common.h"
#include "moe/safetensors.h"

/* The stages, in pipeline order; a tensor's file is "<stage>.safetensors". */
enum moe_stage_file {
    MOE_GOLDEN_INPUTS, MOE_GOLDEN_ROUTER, MOE_GOLDEN_LAYOUT, MOE_GOLDEN_DISPATCH,
    MOE_GOLDEN_EXPERTS, MOE_GOLDEN_OUTPUT, MOE_GOLDEN_BACKWARD, MOE_GOLDEN_STAGES
};
extern const char *const moe_golden_stage_names[MOE_GOLDEN_STAGES];

/* How verify compares a tensor. */
enum moe_golden_rule {
    MOE_RULE_EXACT,     /* every bit (inputs, integers, quantised payloads) */
    MOE_RULE_TOLERANCE, /* |got - ref| <= abs + rel*|ref| */
    MOE_RULE_TOPK,      /* ids exact, or a near-tie (see docs/golden.md) */
};

/* A tolerance tensor's element passes when
 *   |got - ref| <= abs + rel*|ref| + allow[i] + (bf16_step ? moe_bf16_step(ref) : 0)
 * the contract --check applies to the layer's output (truth.h). */
typedef struct {
    moe_st_tensor tensor;
    enum moe_stage_file stage;
    enum moe_golden_rule rule;
    double abs, rel;
    const char *allow; /* an F64 tensor of the set, same shape, of per-element
                          allowances (one bf16 step per rounded term), or NULL */
    bool bf16_step;    /* the value was rounded to bf16 once: allow one step */
} moe_golden_tensor;

/* The tensors a golden set may hold, one table (src/io/golden_kinds.c,
 * docs/golden.md's "The tensors" and "Tolerances"): each kind's name
 * ("%d" stands for the rank), its file, dtype and rule, and for a tolerance
 * the fp32 chain its relative tolerance covers, rel = u (cd d + ce E + ck
 * k + cf f + c0), u = 2^-24, with abs = rel times the tensor's rms. Two
 * rules are the run's, not a chain: the output's (--check's, truth.h) and
 * a gradient's (docs/backward.md). */
enum moe_golden_kind {
    MOE_GK_TOKENS, MOE_GK_GATE_WEIGHT, MOE_GK_GATE_BIAS, MOE_GK_ROUTER_SKEW,
    MOE_GK_EXPERTS_W1, MOE_GK_EXPERTS_W2, MOE_GK_SHARED_W1, MOE_GK_SHARED_W2,
    /* --dtype fp8: each of the four as E4M3 bytes, then its block scales */
    MOE_GK_EXPERTS_W1_FP8, MOE_GK_EXPERTS_W1_SCALE, MOE_GK_EXPERTS_W2_FP8, MOE_GK_EXPERTS_W2_SCALE,
    MOE_GK_SHARED_W1_FP8, MOE_GK_SHARED_W1_SCALE, MOE_GK_SHARED_W2_FP8, MOE_GK_SHARED_W2_SCALE,
    MOE_GK_LOGITS, MOE_GK_SCORES, MOE_GK_SELECTION, MOE_GK_TOPK_IDS, MOE_GK_TOPK_WEIGHTS,
    MOE_GK_TOKENS_PER_RANK, MOE_GK_TOKENS_PER_EXPERT, MOE_GK_TOKENS_PER_NODE,
    MOE_GK_TOKEN_IN_RANK, MOE_GK_SEND_COUNTS, MOE_GK_KEPT_IDS, MOE_GK_PHYSICAL_IDS,
    MOE_GK_REPLICA_OF, MOE_GK_STEPS_LOAD, MOE_GK_STEPS_BIAS,
    MOE_GK_DISPATCH_X, MOE_GK_DISPATCH_TOKEN, MOE_GK_LAYOUT_X, MOE_GK_LAYOUT_SCALE,
    MOE_GK_LAYOUT_SRC, MOE_GK_LAYOUT_EXPERT, MOE_GK_LAYOUT_COUNT,
    MOE_GK_EXPERT_OUT, MOE_GK_EXPERT_PAIR, MOE_GK_EXPERT_SUM, MOE_GK_EXPERT_OUT_ALLOW,
    MOE_GK_EXPERT_SUM_ALLOW, MOE_GK_NODE_SUM, MOE_GK_NODE_TOKEN,
    MOE_GK_OUTPUT_Y, MOE_GK_OUTPUT_TRUTH, MOE_GK_OUTPUT_ALLOW,
    MOE_GK_GRAD_OUTPUT, MOE_GK_BACKWARD_DY, MOE_GK_BACKWARD_DX, MOE_GK_BACKWARD_DWEIGHT,
    MOE_GK_BACKWARD_DX_SUM, MOE_GK_GRADIENT, MOE_GK_GRADIENT_TRUTH,
    MOE_GOLDEN_KINDS
};

enum moe_golden_chain { MOE_CHAIN_NONE, MOE_CHAIN_FP32, MOE_CHAIN_OUTPUT, MOE_CHAIN_GRADIENT };

typedef struct {
    const char *name;  /* NULL: named by the caller (a gradient: backward.dx, ...) */
    enum moe_stage_file stage;
    enum moe_st_dtype dtype;
    enum moe_golden_rule rule;
    enum moe_golden_chain chain;
    int cd, ce, ck, cf, c0; /* MOE_CHAIN_FP32: rel = u (cd d + ce E + ck k + cf f + c0) */
} moe_golden_kind_spec;

extern const moe_golden_kind_spec moe_golden_kinds[MOE_GOLDEN_KINDS];

/* u times the fp32 chain of a MOE_CHAIN_FP32 kind at these sizes. */
double moe_golden_chain_rel(const moe_golden_kind_spec *kind, int64_t d, int64_t experts,
                            int64_t topk, int64_t ffn);

/* Write the set as dir (trailing slashes allowed). The new set is built in
 * dir.partial.HOST.PID beside it, read back against its checksums, and only
 * then swapped in for whatever dir held (atomically where the filesystem
 * can exchange two names); any failure leaves dir as it was and nothing
 * else behind, and debris of dumps killed earlier on this host is removed.
 * config_json: a JSON object for the manifest's "config". *bytes receives
 * the total size. Returns MOE_EXIT_OK or MOE_EXIT_RUNTIME. */
int moe_golden_write(const char *dir, const moe_golden_tensor *tensors, int n,
                     const char *config_json, double *bytes, moe_status *st);

/* Usage check before a run: dir is new, empty or a golden set (a dump
 * replaces all it holds, so a directory with anything else is refused). */
int moe_golden_check_target(const char *dir, moe_status *st);

/* A file's SHA-256 as 64 hex digits; false when it cannot be read. */
bool moe_golden_file_sha256(const char *path, char hex[65]);

/* What verify compared, per stage (enum moe_stage_file): tensors
 * compared, and of those failed; the stages the set holds tensors of. */
typedef struct {
    int compared[MOE_GOLDEN_STAGES];
    int failed[MOE_GOLDEN_STAGES];
    int in_set[MOE_GOLDEN_STAGES];
    unsigned missing_required; /* bit per required stage that nothing was compared in */
} moe_golden_result;

/* How strict verify is beyond the contract (zero: the default). */
typedef struct {
    unsigned require;   /* bit per stage (1u << stage) a candidate must hold a tensor of */
    bool allow_unknown; /* ignore candidate tensors the set does not name, rather than refuse */
} moe_golden_options;

/* Parse --require's value: stage names separated by commas, or "all" (the
 * stages the set holds, resolved by verify: every bit set). */
int moe_golden_parse_require(const char *text, unsigned *require, moe_status *st);

/* Compare the tensors of candidate with the set in dir, in pipeline order,
 * and print the table to out; result (may be NULL) receives the counts
 * per stage. Candidate ids of any integer dtype and values
 * of any real dtype are compared as the golden ones; a shape or kind that
 * differs fails the tensor's stage, or, after a stage that failed already,
 * is shown as following from it. The table ends with the stages checked and
 * those of the set the candidate left out. Returns MOE_EXIT_OK (all within
 * contract), MOE_EXIT_CHECK_FAILED (some not, or a required stage missing;
 * the first failing stage is named), or MOE_EXIT_USAGE for a golden set or
 * candidate that cannot be read, or a candidate tensor the set does not name
 * (st says what). options may be NULL. */
int moe_golden_verify(const char *dir, const char *candidate, const moe_golden_options *options,
                      FILE *out, moe_golden_result *result, moe_status *st);

#endif
