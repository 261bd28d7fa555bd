/* SPDX-License-Identifier: MIT */
/* moe-ep.h — the moe-ep library: one Mixture-of-Experts layer run with
 * expert parallelism over a caller's MPI communicator, and its dense fp64
 * truth, for a program or a test suite to call.
 *
 *   moe_ep_config   the run's flags: the same table, presets and validation
 *                   as `moe-ep run` (moe_ep_config_set(c, "--tokens", "64"))
 *   moe_ep_context  the layer on a communicator, on the path the config
 *                   chooses (docs/waves.md, docs/low-latency.md): route
 *                   caller tokens with the configured router, or bring
 *                   your own top-k ids and weights; forward into your buffer;
 *                   with --backward, a training step's gradients
 *   moe_ep_truth    the dense fp64 sum of every selected expert on caller
 *                   tokens and routing, no MPI: what a port is checked against
 *                   (its stages: moe_ep_truth_stages; the gradients':
 *                   moe_ep_truth_backward, moe_ep_check_backward)
 *
 * Weights are the configuration's own synthetic ones (docs/data.md: a
 * function of --seed and the shape), the same in the truth and on every
 * rank; moe_ep_config_tokens gives the tokens `moe-ep run` would use.
 * Shapes use the CLI's letters: T tokens per rank, d hidden, k top-k, E
 * experts. Row-major fp32 unless said.
 *
 * Errors: every call returns MOE_EP_OK or a code (MOE_EP_BAD_INPUT: an
 * argument or a flag is wrong; MOE_EP_RUNTIME: the run failed) and keeps
 * one line on its object naming the argument (moe_ep_config_error,
 * moe_ep_context_error). A context's calls are collective: every rank gets
 * the same code and message. No global state for the caller to manage.
 * Running out of memory in a call without MPI (the config's, the truth's,
 * the checks, verify, moe_ep_context_route) returns MOE_EP_RUNTIME with
 * "cannot allocate ..." and the process goes on (what the call had
 * allocated by then is not given back). In a collective call, a rank whose
 * small allocation fails cannot return while the others wait in the
 * collective: the job ends on the context's communicator with the message
 * (MPI_Abort, exit status 3); the large buffers of a forward are agreed on
 * and return MOE_EP_RUNTIME on every rank instead. An MPI error ends the
 * job as the communicator's error handler says (MPI_ERRORS_ARE_FATAL). The
 * library never calls exit.
 */
#ifndef MOE_EP_PUBLIC_H
#define MOE_EP_PUBLIC_H

#include <mpi.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The API this header describes; moe_ep_api_version() is the library's. */
#define MOE_EP_API_VERSION 3

enum { MOE_EP_OK = 0, MOE_EP_FAIL = 1, MOE_EP_BAD_INPUT = 2, MOE_EP_RUNTIME = 3 };

typedef struct moe_ep_config moe_ep_config;
typedef struct moe_ep_context moe_ep_context;

/* The layer's shape (after presets and flags). */
typedef struct {
    int64_t tokens;         /* T, per rank */
    int64_t hidden;         /* d */
    int64_t ffn;            /* f, one expert's */
    int64_t experts;        /* E, routed */
    int64_t topk;           /* k */
    int64_t shared_experts; /* S */
} moe_ep_shape;

int moe_ep_api_version(void);

/* A configuration with the CLI's defaults; NULL when out of memory. */
moe_ep_config *moe_ep_config_new(void);
void moe_ep_config_free(moe_ep_config *c);

/* Set one flag of `moe-ep run` ("--tokens" or "tokens", value as on the
 * command line; a switch takes "true" or "false"); "--preset" loads a
 * preset that later flags override. */
int moe_ep_config_set(moe_ep_config *c, const char *flag, const char *value);

/* Check the flags together for `ranks` ranks, as `moe-ep run` does. */
int moe_ep_config_validate(moe_ep_config *c, int ranks);

/* The shape (all zero for a NULL config). */
moe_ep_shape moe_ep_config_shape(const moe_ep_config *c);

/* The last error's message ("" when none). */
const char *moe_ep_config_error(const moe_ep_config *c);

/* x (T, d): the tokens rank `rank` holds in `moe-ep run` (global ids
 * rank*T .. rank*T + T-1). */
int moe_ep_config_tokens(moe_ep_config *c, int rank, float *x);

/* The weights the config generates (docs/data.md), rounded to --dtype, as
 * every rank and the truth hold them: routed expert n (shared expert n
 * when `shared`) into w1 (2f, d) (rows 0..f-1 the gate projection, f..2f-1
 * the up projection) and w2 (d, f); the router's gate (E, d). */
int moe_ep_config_expert(moe_ep_config *c, int shared, int n, float *w1, float *w2);
int moe_ep_config_gate(moe_ep_config *c, float *gate);

/* The truth (moe_ep_truth, moe_ep_check) on the caller's expert weights
 * instead: w1 (E, 2f, d), w2 (E, d, f), shared_w1 (S, 2f, d), shared_w2
 * (S, d, f), fp32, rounded to --dtype as generated ones are; routed or
 * shared pairs NULL keep the generated ones. Read at each call: keep them
 * alive while the config uses them. Not for a context (its ranks generate
 * their weights). */
int moe_ep_config_use_weights(moe_ep_config *c, const float *w1, const float *w2,
                              const float *shared_w1, const float *shared_w2);

/* ids, weights (tokens, k): the configured router (--router, its bias and
 * groups) on x (tokens, d) with the config's gate, or `gate` (E, d) when
 * not NULL. A token's routing depends on its row only. No MPI. */
int moe_ep_config_route(moe_ep_config *c, const float *x, int64_t tokens, const float *gate,
                        int32_t *ids, float *weights);

/* y (tokens, d), fp64: the dense truth for x (tokens, d) routed by ids
 * and weights (tokens, k; -1 ids contribute nothing), the experts' GEMMs
 * in a fixed order (the same bits on every machine), the roundings the
 * config asks for (--dtype, --dispatch-dtype, --combine-dtype) applied as
 * the EP path applies them, with its combine's sums per rank for `ranks`
 * ranks. No MPI. */
int moe_ep_truth(moe_ep_config *c, int ranks, const float *x, const int32_t *ids,
                 const float *weights, int64_t tokens, double *y);

/* The truth's stages for the same arguments, each written where not NULL:
 * dispatched (tokens, d) fp32, x as the experts' ranks receive it (after
 * --dispatch-dtype: the golden `dispatch` stage); pairs (tokens, k, d)
 * fp64, each pair's expert output on that row before its gate weight and
 * any rounding of the combine (zero for a -1 id: the `experts` stage);
 * y (tokens, d) fp64, moe_ep_truth's (the `output` stage). No MPI. */
int moe_ep_truth_stages(moe_ep_config *c, int ranks, const float *x, const int32_t *ids,
                        const float *weights, int64_t tokens, float *dispatched, double *pairs,
                        double *y);

/* Check y (tokens, d), fp32, from a port or moe_ep_context_forward,
 * against that truth under moe-ep's tolerance (docs/numerics.md: |y - t| <=
 * abs + rel |t|, rel = 2^-24 (d + f + k + S), abs = rel rms(t), plus one
 * bf16 step of each rounded term with --combine-dtype bf16). MOE_EP_OK
 * when every value is within it, MOE_EP_FAIL with the worst value in the
 * message otherwise; *used (may be NULL) is the largest share of the
 * tolerance any value took (<= 1 passes). No MPI. */
int moe_ep_check(moe_ep_config *c, int ranks, const float *x, const int32_t *ids,
                 const float *weights, int64_t tokens, const float *y, double *used);

/* The layer on comm (an intra-communicator, duplicated: the caller's is not
 * touched): the config validated for its size, the weights generated.
 * Flags that act only through `moe-ep run` (its files, --steps, --iters,
 * --check, --routing, --capacity-factor, --redundant-experts, ...) are
 * refused, naming what to call instead. Collective. On failure *out is
 * NULL and the message is the config's. This call and the context's below
 * run on the rank's share of its host's cores, as `moe-ep run` does (the
 * host's cores over its ranks, at most the cores the rank is bound to):
 * OpenMP's and OpenBLAS's thread counts are set for the call, unless
 * OMP_NUM_THREADS or OPENBLAS_NUM_THREADS names them, and the caller's are
 * set back when it returns. */
int moe_ep_context_new(moe_ep_config *c, MPI_Comm comm, moe_ep_context **out);
void moe_ep_context_free(moe_ep_context *ctx);
const char *moe_ep_context_error(const moe_ep_context *ctx);

/* ids, weights (T, k): the configured router on this rank's x (T, d). */
int moe_ep_context_route(moe_ep_context *ctx, const float *x, int32_t *ids, float *weights);

/* y (T, d): the layer on this rank's x (T, d) with routing ids, weights
 * (T, k) (expert ids in [-1, E), -1 a dropped pair, each expert at most once
 * per token; x and weights finite). Collective:
 * a bad argument on any rank fails every rank with that rank's message. */
int moe_ep_context_forward(moe_ep_context *ctx, const float *x, const int32_t *ids,
                           const float *weights, float *y);

/* The routed experts this rank holds: first .. first + count - 1 (E/G each,
 * in rank order). */
int moe_ep_context_experts(const moe_ep_context *ctx, int *first, int *count);

/* The gradients of one training step (docs/backward.md), fp32; a member
 * left NULL is not written. moe_ep_context_backward fills this rank's:
 * dx (T, d) its tokens'; dw1 (EL, 2f, d) and dw2 (EL, d, f) its routed
 * experts' (moe_ep_context_experts), over every rank's tokens; dshared_w1
 * (S, 2f, d), dshared_w2 (S, d, f) and dgate (E, d) summed over ranks (the
 * same on every rank). moe_ep_check_backward reads the whole layer's:
 * dx (tokens, d), dw1 (E, 2f, d), dw2 (E, d, f), the rest as above. */
typedef struct {
    float *dx, *dw1, *dw2, *dshared_w1, *dshared_w2, *dgate;
} moe_ep_gradients;

/* The same in fp64, the whole layer's (moe_ep_truth_backward). */
typedef struct {
    double *dx, *dw1, *dw2, *dshared_w1, *dshared_w2, *dgate;
} moe_ep_truth_gradients;

/* One training step on this rank's x (T, d) with the upstream gradient dy
 * (T, d) of the output: the configured router (the router's gradient flows
 * through its logits, so the routing is its own: into ids, weights (T, k)
 * when not NULL), the forward into y (T, d) when not NULL, then the
 * backward, on the path the config chooses (its all-to-alls in waves, or
 * blocking with --blocking), into g. Needs a context made with --backward
 * true (whose moe_ep_context_forward runs the blocking forward). x and dy
 * finite. Collective. The context keeps the step's large buffers (the
 * forward's and the backward's rows, the experts' gradient work) from one
 * call to the next, freed with it, so that a loop of steps does not fault
 * their pages in again each step (`laptop`, two ranks: 9,200 faults a
 * step before, 0.42-0.47 s a step against 0.29-0.35). The peak moved
 * under 1 % (682 -> 685 MiB a rank there); between calls the context holds
 * the step's buffers (39 MiB a rank there). The library leaves its caller's
 * allocator alone. */
int moe_ep_context_backward(moe_ep_context *ctx, const float *x, const float *dy, int32_t *ids,
                            float *weights, float *y, const moe_ep_gradients *g);

/* The backward's dense fp64 truth for every rank's tokens x, dy (tokens, d),
 * in rank order, routed by the configured router: g's members (the whole
 * layer's; NULL: not written). Needs --backward true. No MPI. */
int moe_ep_truth_backward(moe_ep_config *c, const float *x, const float *dy, int64_t tokens,
                          const moe_ep_truth_gradients *g);

/* Check the whole layer's gradients g (fp32; NULL members not checked),
 * computed by `ranks` ranks of tokens/ranks tokens each, against that truth
 * under `moe-ep run --backward --check`'s tolerance (docs/backward.md: the
 * forward's rule over 2d + 2f + k + S + 8 steps, plus the rows a weight
 * gradient sums in fp32). MOE_EP_OK or MOE_EP_FAIL, the worst element
 * named; *used (may be NULL) the largest share of a tolerance. No MPI. */
int moe_ep_check_backward(moe_ep_config *c, int ranks, const float *x, const float *dy,
                          int64_t tokens, const moe_ep_gradients *g, double *used);

/* Golden sets (docs/golden.md): moe_ep_context_dump (or `moe-ep run --dump
 * DIR`) writes one; verify checks a port's tensors against it. */

/* The golden set of the layer on this rank's x (T, d), routed by the
 * configured router, into dir on rank 0's filesystem: the tensors after
 * every stage, the truth and the contract, the same bytes on every machine
 * (what `moe-ep run --dump dir` writes for the same config). dir must be new,
 * empty or a golden set, which it replaces whole. Needs --gemm packed or
 * exact (BLAS's bits depend on the machine). Collective; *bytes (may be
 * NULL) receives the set's size on rank 0. */
int moe_ep_context_dump(moe_ep_context *ctx, const float *x, const char *dir, double *bytes);

/* The same for a context made with --backward: a training step on x and
 * the upstream gradient dy (T, d), the set holding the backward stage too
 * (what `moe-ep run --backward --dump dir` writes for the same dy). */
int moe_ep_context_dump_backward(moe_ep_context *ctx, const float *x, const float *dy,
                                 const char *dir, double *bytes);
#define MOE_EP_VERIFY_STAGES 7 /* inputs router layout dispatch experts output backward */

typedef struct {
    int verdict;       /* MOE_EP_OK: all within contract; MOE_EP_FAIL: some not;
                          MOE_EP_BAD_INPUT: a file cannot be read (message says which) */
    int compared;      /* tensors compared */
    int first_failing; /* the first stage that failed, -1 when none */
    int stage_compared[MOE_EP_VERIFY_STAGES]; /* per stage: tensors compared */
    int stage_failed[MOE_EP_VERIFY_STAGES];   /* and of those failed or not comparable */
    int stage_in_set[MOE_EP_VERIFY_STAGES];   /* 1 where the golden set holds tensors of the stage */
    unsigned missing_required; /* bit (1u << stage) per required stage the candidate left out */
    char message[512]; /* one line: what failed first, or why nothing could be compared */
} moe_ep_verify_result;

/* How strict verify is beyond the contract; zero is the default. */
typedef struct {
    unsigned require;  /* bit (1u << stage) per stage the candidate must hold a tensor of (a
                          stage the set lacks is not required); ~0u: every stage of the set;
                          other bits past the last stage: MOE_EP_BAD_INPUT */
    int allow_unknown; /* nonzero: ignore candidate tensors the set does not name (default:
                          such a tensor, a misspelt name say, is MOE_EP_BAD_INPUT) */
} moe_ep_verify_options;

/* The name of a stage ("inputs", "router", ...); NULL past the last. */
const char *moe_ep_verify_stage_name(int stage);

/* Compare candidate.safetensors with the golden set in golden_dir, writing
 * the per-tensor table to table (NULL: none); result filled. Returns its
 * verdict: MOE_EP_FAIL also when a required stage is missing. What
 * `moe-ep verify` prints. options may be NULL (the defaults). No MPI. */
int moe_ep_verify_with(const char *golden_dir, const char *candidate,
                       const moe_ep_verify_options *options, FILE *table,
                       moe_ep_verify_result *result);

/* moe_ep_verify_with under the default options. */
int moe_ep_verify(const char *golden_dir, const char *candidate, FILE *table,
                  moe_ep_verify_result *result);

#ifdef __cplusplus
}
#endif

#endif
