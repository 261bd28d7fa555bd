/* SPDX-License-Identifier: MIT */
/* api.c — the library's public calls (include/moe-ep/moe-ep.h) over the
 * same config, EP object, paths and truth the CLI runs.
 */
#include "moe-ep/moe-ep.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/capacity.h"
#include "moe/config.h"
#include "moe/dump.h"
#include "moe/ep.h"
#include "moe/files.h"
#include "moe/golden.h"
#include "moe/model.h"
#include "moe/path.h"
#include "moe/settle.h"
#include "moe/truth.h"
#include "moe/wire.h"

struct moe_ep_config {
    moe_config cfg;
    char error[MOE_MESSAGE_MAX];
};

struct moe_ep_context {
    moe_config cfg; /* validated for the communicator; the EP object holds &cfg */
    moe_comm comm;  /* on a duplicate of the caller's communicator */
    moe_ep ep;
    int32_t *placed; /* (T, k) the pairs as placed (capacity drops) */
    moe_forward_stats stats;
    /* --backward: a training step's (moe_ep_context_backward) */
    moe_ep_grads grads;
    moe_backward_stats bwd;
    float *logits; /* (T, E) */
    char error[MOE_MESSAGE_MAX];
};

int moe_ep_api_version(void) { return MOE_EP_API_VERSION; }

/* The call's verdict: st's code, its message kept in `error`. */
static int verdict(const moe_status *st, char *error)
{
    snprintf(error, MOE_MESSAGE_MAX, "%s", st->code ? st->message : "");
    return st->code;
}

/* Running out of memory inside a call (moe_recovery, common.h). A call
 * with no MPI returns it: RECOVER_HERE(error), after the call's object is
 * known, makes the rest of the call resume at its setjmp and return
 * MOE_EP_RUNTIME with the message in `error` (RECOVERY_POINT: the statement
 * after it runs instead, the status in moe_recovery_lost()); what the call
 * had allocated by then is not freed. A collective call cannot return alone while the
 * other ranks wait in it: END_JOB_HERE(comm) ends the job on that
 * communicator (MPI_Abort, exit status 3) with the message, where the
 * process would otherwise exit and leave them waiting. Either is undone when
 * the call returns. */
static void restore(moe_recovery *was) { moe_recovery_set(*was); }

static void end_job(const moe_status *st, void *arg)
{
    moe_comm c = {.comm = *(MPI_Comm *)arg};
    MPI_Comm_rank(c.comm, &c.rank);
    moe_comm_abort(&c, st);
}

#define RECOVERY_POINT                                                                       \
    jmp_buf point_;                                                                          \
    moe_recovery was_ __attribute__((cleanup(restore))) =                                    \
        moe_recovery_set((moe_recovery){.point = &point_});                                  \
    if (setjmp(point_))

#define RECOVER_HERE(error)                                                                  \
    RECOVERY_POINT                                                                           \
    return verdict(moe_recovery_lost(), error)

#define END_JOB_HERE(comm)                                                                   \
    moe_recovery was_ __attribute__((cleanup(restore))) =                                    \
        moe_recovery_set((moe_recovery){.end = end_job, .arg = (void *)&(comm)})

/* A context's collective call runs on the rank's share of the host's
 * cores, the caller's thread counts given back when it returns
 * (moe_comm_threads_borrow). */
static void threads_back(moe_thread_settings *was) { moe_comm_threads_return(was); }

#define THREADS_HERE(ctx)                                                                    \
    moe_thread_settings threads_ __attribute__((cleanup(threads_back))) =                    \
        moe_comm_threads_borrow(&(ctx)->comm, (ctx)->cfg.gemm)

static int bad(char *error, const char *fmt, const char *what)
{
    moe_status st = {0};
    moe_fail(&st, MOE_EXIT_USAGE, fmt, what);
    return verdict(&st, error);
}

moe_ep_config *moe_ep_config_new(void)
{
    moe_ep_config *c = calloc(1, sizeof *c);
    if (c)
        moe_config_defaults(&c->cfg);
    return c;
}

void moe_ep_config_free(moe_ep_config *c) { free(c); }

const char *moe_ep_config_error(const moe_ep_config *c) { return c ? c->error : "no config"; }

int moe_ep_config_set(moe_ep_config *c, const char *flag, const char *value)
{
    if (!c)
        return MOE_EP_BAD_INPUT;
    RECOVER_HERE(c->error);
    if (!flag || !value)
        return bad(c->error, "moe_ep_config_set: %s is NULL", !flag ? "flag" : "value");
    const char *name = strncmp(flag, "--", 2) ? flag : flag + 2;
    if (!*name)
        return bad(c->error, "moe_ep_config_set: %s is empty", "flag");
    /* one argument, --name=value: the value binds to its flag even where
     * the command line would take it for the next argument (a switch's) */
    char *arg = moe_xmalloc(strlen(name) + strlen(value) + 4);
    sprintf(arg, "--%s=%s", name, value);
    moe_status st = {0};
    moe_config_parse(&c->cfg, MOE_CMD_RUN, 1, &arg, &st);
    free(arg);
    return verdict(&st, c->error);
}

/* The flags checked together for `ranks` ranks, the defaults the caller
 * did not set fitted to the input first (moe_config_fit), as
 * moe_config_settle does for a context. */
static int validate(moe_ep_config *c, int ranks, moe_status *st)
{
    moe_config_fit(&c->cfg);
    return moe_config_validate(&c->cfg, ranks, st);
}

/* Every value of a (rows, cols) finite, or a message naming the first
 * that is not. */
static int check_finite(const char *name, const float *a, moe_index rows, moe_index cols,
                        moe_status *st)
{
    for (moe_index i = 0; i < rows * cols; i++)
        if (!isfinite(a[i]))
            return moe_fail(st, MOE_EXIT_USAGE, "%s[%lld][%lld] is not finite", name,
                            (long long)(i / cols), (long long)(i % cols));
    return MOE_EXIT_OK;
}

int moe_ep_config_validate(moe_ep_config *c, int ranks)
{
    if (!c)
        return MOE_EP_BAD_INPUT;
    RECOVER_HERE(c->error);
    moe_status st = {0};
    if (ranks < 1)
        moe_fail(&st, MOE_EXIT_USAGE, "moe_ep_config_validate: ranks must be at least 1, got %d",
                 ranks);
    else
        validate(c, ranks, &st);
    return verdict(&st, c->error);
}

moe_ep_shape moe_ep_config_shape(const moe_ep_config *c)
{
    if (!c)
        return (moe_ep_shape){0};
    const moe_config *cfg = &c->cfg;
    return (moe_ep_shape){cfg->tokens, cfg->hidden, cfg->ffn, cfg->experts, cfg->topk,
                          cfg->shared_experts};
}

int moe_ep_config_tokens(moe_ep_config *c, int rank, float *x)
{
    if (!c)
        return MOE_EP_BAD_INPUT;
    RECOVER_HERE(c->error);
    if (!x)
        return bad(c->error, "moe_ep_config_tokens: %s is NULL", "x");
    if (rank < 0)
        return bad(c->error, "moe_ep_config_tokens: %s must be at least 0", "rank");
    moe_model_tokens(&c->cfg, (uint64_t)rank * (uint64_t)c->cfg.tokens, x);
    c->error[0] = '\0';
    return MOE_EP_OK;
}

int moe_ep_config_expert(moe_ep_config *c, int shared, int n, float *w1, float *w2)
{
    if (!c)
        return MOE_EP_BAD_INPUT;
    RECOVER_HERE(c->error);
    const int64_t count = shared ? c->cfg.shared_experts : c->cfg.experts;
    if (!w1 || !w2)
        return bad(c->error, "moe_ep_config_expert: %s is NULL", !w1 ? "w1" : "w2");
    if (n < 0 || n >= count) {
        moe_status st = {0};
        moe_fail(&st, MOE_EXIT_USAGE, "moe_ep_config_expert: n must be in [0, %lld) (the %s experts), got %d",
                 (long long)count, shared ? "shared" : "routed", n);
        return verdict(&st, c->error);
    }
    moe_model_expert(&c->cfg, shared != 0, n, w1, w2);
    c->error[0] = '\0';
    return MOE_EP_OK;
}

int moe_ep_config_gate(moe_ep_config *c, float *gate)
{
    if (!c)
        return MOE_EP_BAD_INPUT;
    RECOVER_HERE(c->error);
    if (!gate)
        return bad(c->error, "moe_ep_config_gate: %s is NULL", "gate");
    moe_model_gate(&c->cfg, gate);
    c->error[0] = '\0';
    return MOE_EP_OK;
}

int moe_ep_config_use_weights(moe_ep_config *c, const float *w1, const float *w2,
                              const float *shared_w1, const float *shared_w2)
{
    if (!c)
        return MOE_EP_BAD_INPUT;
    if (!w1 != !w2 || !shared_w1 != !shared_w2)
        return bad(c->error, "moe_ep_config_use_weights: %s must be both given or both NULL",
                   !w1 != !w2 ? "w1 and w2" : "shared_w1 and shared_w2");
    c->cfg.given_w1 = w1;
    c->cfg.given_w2 = w2;
    c->cfg.given_shared_w1 = shared_w1;
    c->cfg.given_shared_w2 = shared_w2;
    c->error[0] = '\0';
    return MOE_EP_OK;
}

/* The configured router on x (tokens, d) with `gate` (E, d), or the
 * config's when NULL: ids, weights (tokens, k), and the logits (tokens, E)
 * when `logits` is not NULL (the router's backward reads them). */
static void route(const moe_config *cfg, const float *x, moe_index tokens, const float *gate,
                  int32_t *ids, float *weights, float *logits)
{
    const moe_index E = cfg->experts, d = cfg->hidden;
    float *own = gate ? NULL : moe_xmalloc(sizeof(float) * (size_t)(E * d));
    float *work = moe_xmalloc(sizeof(float) * (size_t)(2 * tokens * E + 2 * E));
    float *scores = work + tokens * E, *bias = scores + tokens * E, *skew = bias + E;
    if (own)
        moe_model_gate(cfg, own);
    const moe_router r = moe_model_router(cfg, bias, skew);
    moe_router_logits(x, gate ? gate : own, tokens, d, (int)E, work);
    moe_router_select(&r, work, tokens, scores, ids, weights);
    if (logits)
        memcpy(logits, work, sizeof(float) * (size_t)(tokens * E));
    free(work);
    free(own);
}

int moe_ep_config_route(moe_ep_config *c, const float *x, int64_t tokens, const float *gate,
                        int32_t *ids, float *weights)
{
    if (!c)
        return MOE_EP_BAD_INPUT;
    RECOVER_HERE(c->error);
    const char *null = !x ? "x" : !ids ? "ids" : !weights ? "weights" : NULL;
    if (null)
        return bad(c->error, "moe_ep_config_route: %s is NULL", null);
    moe_status st = {0};
    if (tokens < 1)
        moe_fail(&st, MOE_EXIT_USAGE, "moe_ep_config_route: tokens must be at least 1, got %lld",
                 (long long)tokens);
    else if (validate(c, 1, &st) == MOE_EXIT_OK &&
             check_finite("x", x, tokens, c->cfg.hidden, &st) == MOE_EXIT_OK &&
             (!gate || check_finite("gate", gate, c->cfg.experts, c->cfg.hidden, &st) == MOE_EXIT_OK))
        route(&c->cfg, x, tokens, gate, ids, weights, NULL);
    return verdict(&st, c->error);
}

/* ids (rows, k) in [-1, E), each expert at most once a token; weights
 * finite. A message naming the first bad pair. */
static int check_routing(const moe_config *cfg, const int32_t *ids, const float *weights,
                         moe_index rows, moe_status *st)
{
    const int k = (int)cfg->topk, E = (int)cfg->experts;
    for (moe_index i = 0; i < rows; i++)
        for (int s = 0; s < k; s++) {
            const int32_t e = ids[i * k + s];
            if (e < MOE_DROPPED || e >= E)
                return moe_fail(st, MOE_EXIT_USAGE, "ids[%lld][%d] must be in [-1, %d), got %d",
                                (long long)i, s, E, e);
            for (int t = 0; t < s; t++)
                if (e >= 0 && ids[i * k + t] == e)
                    return moe_fail(st, MOE_EXIT_USAGE,
                                    "ids[%lld] names expert %d twice (slots %d and %d)",
                                    (long long)i, e, t, s);
            if (!isfinite(weights[i * k + s]))
                return moe_fail(st, MOE_EXIT_USAGE, "weights[%lld][%d] is not finite",
                                (long long)i, s);
        }
    return MOE_EXIT_OK;
}

/* The caller's expert weights (moe_ep_config_use_weights) finite. */
static int check_given_weights(const moe_config *cfg, moe_status *st)
{
    const moe_index E = cfg->experts, S = cfg->shared_experts, d = cfg->hidden, f = cfg->ffn;
    const struct {
        const char *name;
        const float *w;
        moe_index rows, cols;
    } given[] = {{"w1", cfg->given_w1, E * 2 * f, d}, {"w2", cfg->given_w2, E * d, f},
                 {"shared_w1", cfg->given_shared_w1, S * 2 * f, d},
                 {"shared_w2", cfg->given_shared_w2, S * d, f}};
    for (size_t n = 0; n < sizeof given / sizeof given[0]; n++)
        if (given[n].w && check_finite(given[n].name, given[n].w, given[n].rows, given[n].cols, st))
            return st->code;
    return MOE_EXIT_OK;
}

/* The truth's arguments checked (`call` names the function); when they
 * pass, y and allow (tokens, d) and the stages (moe_ep_truth_stages)
 * filled where not NULL. */
static int truth_of(moe_ep_config *c, const char *call, int ranks, const float *x,
                    const int32_t *ids, const float *weights, int64_t tokens, double *y,
                    double *allow, float *dispatched, double *pairs)
{
    moe_status st = {0};
    const char *null = !x ? "x" : !ids ? "ids" : !weights ? "weights" : NULL;
    if (null)
        moe_fail(&st, MOE_EXIT_USAGE, "%s: %s is NULL", call, null);
    else if (tokens < 1 || ranks < 1)
        moe_fail(&st, MOE_EXIT_USAGE, "%s: %s must be at least 1, got %lld", call,
                 tokens < 1 ? "tokens" : "ranks", (long long)(tokens < 1 ? tokens : ranks));
    else if (validate(c, ranks, &st) == MOE_EXIT_OK &&
             check_finite("x", x, tokens, c->cfg.hidden, &st) == MOE_EXIT_OK &&
             check_given_weights(&c->cfg, &st) == MOE_EXIT_OK)
        check_routing(&c->cfg, ids, weights, tokens, &st);
    if (st.code)
        return verdict(&st, c->error);
    const moe_index n = tokens * c->cfg.hidden;
    float *scratch = c->cfg.dispatch_dtype == MOE_DTYPE_FP32
                         ? NULL
                         : moe_xmalloc(sizeof(float) * (size_t)n);
    const float *xd = moe_wire_dispatched(&c->cfg, x, tokens, scratch);
    if (y)
        moe_truth_forward(&c->cfg, MOE_TRUTH_EXACT, x, xd, ids, weights, tokens, ranks, y, allow);
    if (dispatched)
        memcpy(dispatched, xd, sizeof(float) * (size_t)n);
    if (pairs)
        moe_truth_pair_outputs(&c->cfg, MOE_TRUTH_EXACT, xd, ids, tokens, pairs);
    free(scratch);
    return verdict(&st, c->error);
}

int moe_ep_truth(moe_ep_config *c, int ranks, const float *x, const int32_t *ids,
                 const float *weights, int64_t tokens, double *y)
{
    if (!c)
        return MOE_EP_BAD_INPUT;
    RECOVER_HERE(c->error);
    if (!y)
        return bad(c->error, "moe_ep_truth: %s is NULL", "y");
    return truth_of(c, "moe_ep_truth", ranks, x, ids, weights, tokens, y, NULL, NULL, NULL);
}

int moe_ep_truth_stages(moe_ep_config *c, int ranks, const float *x, const int32_t *ids,
                        const float *weights, int64_t tokens, float *dispatched, double *pairs,
                        double *y)
{
    if (!c)
        return MOE_EP_BAD_INPUT;
    RECOVER_HERE(c->error);
    return truth_of(c, "moe_ep_truth_stages", ranks, x, ids, weights, tokens, y, NULL, dispatched,
                    pairs);
}

int moe_ep_check(moe_ep_config *c, int ranks, const float *x, const int32_t *ids,
                 const float *weights, int64_t tokens, const float *y, double *used)
{
    if (!c)
        return MOE_EP_BAD_INPUT;
    RECOVER_HERE(c->error);
    if (!y)
        return bad(c->error, "moe_ep_check: %s is NULL", "y");
    const moe_index n = (tokens > 0 ? tokens : 0) * c->cfg.hidden;
    double *ref = moe_xmalloc(sizeof(double) * (size_t)(2 * n) + 1), *allow = ref + n;
    int rc = truth_of(c, "moe_ep_check", ranks, x, ids, weights, tokens, ref, allow, NULL, NULL);
    if (rc == MOE_EP_OK) {
        const moe_tolerance tol = moe_tolerance_for(&c->cfg, sqrt(moe_sum_squares(ref, n) / (double)n));
        moe_compare_stats s;
        moe_compare(y, ref, allow, n, tol, &s);
        if (used)
            *used = s.max_used;
        if (s.first_nonfinite >= 0 || !(s.max_used <= 1.0)) {
            const moe_index at = s.first_nonfinite >= 0 ? s.first_nonfinite : s.worst;
            snprintf(c->error, sizeof c->error,
                     "y[%lld][%lld] = %.9g, truth %.9g: %.0f %% of the tolerance (%.3e + %.3e |t|)",
                     (long long)(at / c->cfg.hidden), (long long)(at % c->cfg.hidden),
                     (double)y[at], ref[at], 100.0 * s.max_used, tol.abs, tol.rel);
            rc = MOE_EP_FAIL;
        }
    }
    free(ref);
    return rc;
}

/* The whole layer's backward truth, fp64, every member of t (full sizes:
 * moe_ep_truth_gradients) written, for `tokens` tokens x, dy routed by the
 * configured router (ids (tokens, k) kept). Every argument checked first. */
static int backward_truth(moe_ep_config *c, const char *call, const float *x, const float *dy,
                          int64_t tokens, const moe_ep_truth_gradients *t, int32_t **ids)
{
    moe_status st = {0};
    moe_config *cfg = &c->cfg;
    const char *null = !x ? "x" : !dy ? "dy" : NULL;
    if (null)
        moe_fail(&st, MOE_EXIT_USAGE, "%s: %s is NULL", call, null);
    else if (tokens < 1)
        moe_fail(&st, MOE_EXIT_USAGE, "%s: tokens must be at least 1, got %lld", call,
                 (long long)tokens);
    else if (!cfg->backward)
        moe_fail(&st, MOE_EXIT_USAGE, "%s needs --backward true in the config (its checks: fp32 on "
                 "the wire, the router's own routing)", call);
    else if (validate(c, 1, &st) == MOE_EXIT_OK &&
             check_finite("x", x, tokens, cfg->hidden, &st) == MOE_EXIT_OK &&
             check_finite("dy", dy, tokens, cfg->hidden, &st) == MOE_EXIT_OK)
        check_given_weights(cfg, &st);
    if (st.code)
        return verdict(&st, c->error);
    const moe_index N = tokens, d = cfg->hidden, f = cfg->ffn, E = cfg->experts, k = cfg->topk;
    *ids = moe_xmalloc(sizeof(int32_t) * (size_t)(N * k));
    float *weights = moe_xmalloc(sizeof(float) * (size_t)(N * k));
    float *logits = moe_xmalloc(sizeof(float) * (size_t)(N * E));
    float *gate = moe_xmalloc(sizeof(float) * (size_t)(E * d + 2 * E)), *bias = gate + E * d;
    double *dweights = moe_xcalloc((size_t)(N * k), sizeof(double));
    moe_model_gate(cfg, gate); /* once: the routing and the router's backward both read it */
    route(cfg, x, N, gate, *ids, weights, logits);
    const moe_router r = moe_model_router(cfg, bias, bias + E);
    memset(t->dx, 0, sizeof(double) * (size_t)(N * d));
    for (int e = 0; e < (int)E; e++)
        moe_truth_backward_expert(cfg, MOE_TRUTH_EXACT, e, x, dy, *ids, weights, N, t->dx, dweights,
                                  t->dw1 + e * 2 * f * d, t->dw2 + e * d * f);
    moe_truth_backward_rest(cfg, &r, MOE_TRUTH_EXACT, gate, x, *ids, logits, dy, N, dweights, t->dx,
                            t->dgate, t->dshared_w1, t->dshared_w2);
    free(dweights);
    free(gate);
    free(logits);
    free(weights);
    c->error[0] = '\0';
    return MOE_EP_OK;
}

/* The sizes of the members of moe_ep_truth_gradients, in their order. */
static void gradient_sizes(const moe_config *cfg, moe_index tokens, moe_index n[6])
{
    const moe_index d = cfg->hidden, f = cfg->ffn, E = cfg->experts, S = cfg->shared_experts;
    const moe_index sizes[6] = {tokens * d, E * 2 * f * d, E * d * f, S * 2 * f * d, S * d * f, E * d};
    memcpy(n, sizes, sizeof sizes);
}

/* Every member of t allocated at its full size (one block; free t->dx). */
static moe_ep_truth_gradients gradients_alloc(const moe_config *cfg, moe_index tokens)
{
    moe_index n[6], total = 0;
    gradient_sizes(cfg, tokens, n);
    for (int m = 0; m < 6; m++)
        total += n[m];
    double *block = moe_xmalloc(sizeof(double) * (size_t)total), *at = block;
    double *member[6];
    for (int m = 0; m < 6; m++) {
        member[m] = at;
        at += n[m];
    }
    return (moe_ep_truth_gradients){member[0], member[1], member[2], member[3], member[4], member[5]};
}

int moe_ep_truth_backward(moe_ep_config *c, const float *x, const float *dy, int64_t tokens,
                          const moe_ep_truth_gradients *g)
{
    if (!c)
        return MOE_EP_BAD_INPUT;
    RECOVER_HERE(c->error);
    if (!g)
        return bad(c->error, "moe_ep_truth_backward: %s is NULL", "g");
    moe_ep_truth_gradients t = gradients_alloc(&c->cfg, tokens > 0 ? tokens : 0);
    int32_t *ids = NULL;
    const int rc = backward_truth(c, "moe_ep_truth_backward", x, dy, tokens, &t, &ids);
    if (rc == MOE_EP_OK) {
        double *const from[6] = {t.dx, t.dw1, t.dw2, t.dshared_w1, t.dshared_w2, t.dgate};
        double *const to[6] = {g->dx, g->dw1, g->dw2, g->dshared_w1, g->dshared_w2, g->dgate};
        moe_index n[6];
        gradient_sizes(&c->cfg, tokens, n);
        for (int m = 0; m < 6; m++)
            if (to[m] && n[m] > 0)
                memcpy(to[m], from[m], sizeof(double) * (size_t)n[m]);
    }
    free(ids);
    free(t.dx);
    return rc;
}

/* got (n) against truth (n) under moe_tolerance_of_length(length) over
 * truth's rms; the worst share of the tolerance so far in *worst, and when
 * this tensor holds it, its name and index in `where`. */
static void gradient_compare(const char *name, moe_index part, const float *got, const double *truth,
                             moe_index n, moe_index cols, double length, double *worst, char *where,
                             size_t size, double *got_at, double *truth_at)
{
    if (n == 0)
        return;
    const moe_tolerance tol = moe_tolerance_of_length(length, sqrt(moe_sum_squares(truth, n) / (double)n));
    moe_compare_stats s;
    moe_compare(got, truth, NULL, n, tol, &s);
    const double used = s.first_nonfinite >= 0 ? INFINITY : s.max_used;
    if (*where && !(used > *worst)) /* the first tensor checked, or a worse one */
        return;
    *worst = used;
    const moe_index i = s.first_nonfinite >= 0 ? s.first_nonfinite : s.worst;
    char index[48] = "";
    if (part >= 0)
        snprintf(index, sizeof index, "[%lld]", (long long)part);
    snprintf(where, size, "%s%s[%lld][%lld]", name, index, (long long)(i / cols), (long long)(i % cols));
    *got_at = got[i];
    *truth_at = truth[i];
}

int moe_ep_check_backward(moe_ep_config *c, int ranks, const float *x, const float *dy,
                          int64_t tokens, const moe_ep_gradients *g, double *used)
{
    if (!c)
        return MOE_EP_BAD_INPUT;
    RECOVER_HERE(c->error);
    if (!g)
        return bad(c->error, "moe_ep_check_backward: %s is NULL", "g");
    if (ranks < 1 || tokens % (ranks > 0 ? ranks : 1)) {
        moe_status st = {0};
        moe_fail(&st, MOE_EXIT_USAGE, "moe_ep_check_backward: ranks must be at least 1 and divide "
                 "tokens (each rank's share), got %d ranks, %lld tokens", ranks, (long long)tokens);
        return verdict(&st, c->error);
    }
    const moe_config *cfg = &c->cfg;
    moe_ep_truth_gradients t = gradients_alloc(cfg, tokens > 0 ? tokens : 0);
    int32_t *ids = NULL;
    int rc = backward_truth(c, "moe_ep_check_backward", x, dy, tokens, &t, &ids);
    if (rc != MOE_EP_OK) {
        free(t.dx);
        return rc;
    }
    const moe_index d = cfg->hidden, f = cfg->ffn, E = cfg->experts, S = cfg->shared_experts;
    const moe_index k = cfg->topk;
    const double base = moe_truth_backward_length(cfg);
    double worst = 0.0, got_at = 0.0, truth_at = 0.0;
    char where[96] = "";
#define COMPARE(name, part, got, truth, n, cols, length)                                           \
    gradient_compare(name, part, got, truth, n, cols, length, &worst, where, sizeof where, &got_at, \
                     &truth_at)
    if (g->dx)
        COMPARE("dx", -1, g->dx, t.dx, tokens * d, d, base);
    if (g->dgate)
        COMPARE("dgate", -1, g->dgate, t.dgate, E * d, d, base);
    moe_index *rows = moe_xcalloc((size_t)E, sizeof(moe_index)); /* tokens that chose each expert */
    for (moe_index m = 0; m < tokens * k; m++)
        rows[ids[m]]++;
    for (moe_index e = 0; e < E; e++) { /* a routed expert's wgrad sums its tokens in fp32 */
        if (g->dw1)
            COMPARE("dw1", e, g->dw1 + e * 2 * f * d, t.dw1 + e * 2 * f * d, 2 * f * d, d,
                    base + (double)rows[e]);
        if (g->dw2)
            COMPARE("dw2", e, g->dw2 + e * d * f, t.dw2 + e * d * f, d * f, f, base + (double)rows[e]);
    }
    for (moe_index sh = 0; sh < S; sh++) { /* a shared one, a rank's tokens, then ranks in fp64 */
        const double rank_rows = (double)(tokens / ranks);
        if (g->dshared_w1)
            COMPARE("dshared_w1", sh, g->dshared_w1 + sh * 2 * f * d, t.dshared_w1 + sh * 2 * f * d,
                    2 * f * d, d, base + rank_rows);
        if (g->dshared_w2)
            COMPARE("dshared_w2", sh, g->dshared_w2 + sh * d * f, t.dshared_w2 + sh * d * f, d * f,
                    f, base + rank_rows);
    }
    free(rows);
#undef COMPARE
    if (used)
        *used = worst;
    if (!*where)
        rc = bad(c->error, "moe_ep_check_backward: %s", "every member of g is NULL");
    else if (!(worst <= 1.0)) {
        snprintf(c->error, sizeof c->error, "%s = %.9g, truth %.9g: %.0f %% of the tolerance", where,
                 got_at, truth_at, 100.0 * worst);
        rc = MOE_EP_FAIL;
    }
    free(ids);
    free(t.dx);
    return rc;
}

/* The flags that act only through `moe-ep run`'s driver (its output files,
 * its repeated or stepped runs, its check, its own routing): a caller who
 * sets one away from its default would get nothing, or (capacity, copies)
 * an output the truth on its own tokens cannot reproduce. One rule for all:
 * away from its default, refused with what to use instead; --iters only
 * when the caller set it (presets set it for run, and here it does nothing). */
static const struct {
    const char *flag, *instead;
} run_only[] = {
    {"dump", "moe_ep_context_dump"},
    {"trace", NULL},
    {"timeline", NULL},
    {"report", NULL},
    {"routing", "pass ids and weights to moe_ep_context_forward"},
    {"redundant-experts", NULL},
    {"capacity-factor", "drop pairs by passing -1 ids: the drops depend on every rank's tokens, "
                        "which moe_ep_check does not see"},
    {"drop-policy", NULL},
    {"pad-to-capacity", NULL},
    {"steps", "call route and forward once per step"},
    {"bias-update", NULL},
    {"steps-csv", NULL},
    {"steps-plot", NULL},
    {"iters", "call moe_ep_context_forward again"},
    {"check", "moe_ep_check"},
    {"compare-serial", NULL},
    {"grad-output", NULL},
};

/* What the library runs (moe_config_settle's checks): the forward paths,
 * on its caller's buffers, with the caller's weights only in the truth. */
static int library_checks(const moe_config *cfg, const moe_path *path, const moe_comm *c, void *arg,
                          moe_status *st)
{
    (void)c;
    (void)arg;
    if (cfg->given_w1 || cfg->given_shared_w1)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "moe_ep_config_use_weights: a context's ranks generate their weights; "
                        "the caller's are for the truth only");
    (void)path;
    for (size_t n = 0; n < sizeof run_only / sizeof run_only[0]; n++) {
        const char *flag = run_only[n].flag, *instead = run_only[n].instead;
        if (!moe_config_at_default(cfg, flag) &&
            (strcmp(flag, "iters") || moe_config_given(cfg, flag)))
            return moe_fail(st, MOE_EXIT_USAGE, "--%s is moe-ep run's, not the library's: drop it%s%s%s",
                            flag, instead ? " (instead: " : "", instead ? instead : "", instead ? ")" : "");
    }
    return MOE_EXIT_OK;
}

int moe_ep_context_new(moe_ep_config *c, MPI_Comm comm, moe_ep_context **out)
{
    if (!out)
        return c ? bad(c->error, "moe_ep_context_new: %s is NULL", "out") : MOE_EP_BAD_INPUT;
    *out = NULL;
    if (!c)
        return MOE_EP_BAD_INPUT;
    int inter = 0;
    if (comm == MPI_COMM_NULL)
        return bad(c->error, "moe_ep_context_new: %s is MPI_COMM_NULL", "comm");
    MOE_MPI(MPI_Comm_test_inter(comm, &inter));
    if (inter)
        return bad(c->error, "moe_ep_context_new: %s is an inter-communicator; give an "
                   "intra-communicator (MPI_COMM_WORLD or one split from it)", "comm");
    END_JOB_HERE(comm);
    moe_ep_context *ctx = moe_xcalloc(1, sizeof *ctx);
    ctx->cfg = c->cfg;
    MPI_Comm dup;
    MOE_MPI(MPI_Comm_dup(comm, &dup));
    moe_comm_attach(&ctx->comm, dup);
    THREADS_HERE(ctx);
    moe_status st = {0};
    if (moe_config_settle(&ctx->cfg, &ctx->comm, MOE_CMD_RUN, library_checks, NULL, &st) ==
            MOE_EXIT_OK &&
        moe_ep_init(&ctx->ep, &ctx->cfg, &ctx->comm, &st) == MOE_EXIT_OK) {
        ctx->placed = moe_xmalloc(sizeof(int32_t) * (size_t)(ctx->cfg.tokens * ctx->cfg.topk));
        if (ctx->ep.path->training) {
            moe_ep_grads_init(&ctx->ep, &ctx->grads);
            ctx->logits = moe_xmalloc(sizeof(float) * (size_t)(ctx->cfg.tokens * ctx->cfg.experts));
        }
        *out = ctx;
        return verdict(&st, c->error);
    }
    MOE_MPI(MPI_Comm_free(&ctx->comm.comm));
    free(ctx);
    return verdict(&st, c->error);
}

void moe_ep_context_free(moe_ep_context *ctx)
{
    if (!ctx)
        return;
    if (ctx->ep.path && ctx->ep.path->training)
        moe_ep_grads_free(&ctx->grads);
    free(ctx->logits);
    moe_ep_free(&ctx->ep);
    MOE_MPI(MPI_Comm_free(&ctx->comm.comm));
    free(ctx->placed);
    free(ctx);
}

const char *moe_ep_context_error(const moe_ep_context *ctx) { return ctx ? ctx->error : "no context"; }

int moe_ep_context_route(moe_ep_context *ctx, const float *x, int32_t *ids, float *weights)
{
    if (!ctx)
        return MOE_EP_BAD_INPUT;
    RECOVER_HERE(ctx->error);
    const char *null = !x ? "x" : !ids ? "ids" : !weights ? "weights" : NULL;
    if (null)
        return bad(ctx->error, "moe_ep_context_route: %s is NULL", null);
    moe_status st = {0};
    if (check_finite("x", x, ctx->cfg.tokens, ctx->cfg.hidden, &st))
        return verdict(&st, ctx->error);
    THREADS_HERE(ctx);
    const moe_index T = ctx->cfg.tokens, E = ctx->cfg.experts;
    float *logits = moe_xmalloc(sizeof(float) * (size_t)(2 * T * E));
    moe_ep_route(&ctx->ep, x, logits, logits + T * E, ids, weights);
    free(logits);
    ctx->error[0] = '\0';
    return MOE_EP_OK;
}

int moe_ep_context_forward(moe_ep_context *ctx, const float *x, const int32_t *ids,
                           const float *weights, float *y)
{
    if (!ctx)
        return MOE_EP_BAD_INPUT;
    END_JOB_HERE(ctx->comm.comm);
    THREADS_HERE(ctx);
    moe_status st = {0};
    const char *null = !x ? "x" : !ids ? "ids" : !weights ? "weights" : !y ? "y" : NULL;
    if (null)
        moe_fail(&st, MOE_EXIT_USAGE, "moe_ep_context_forward: %s is NULL", null);
    else if (check_finite("x", x, ctx->cfg.tokens, ctx->cfg.hidden, &st) == MOE_EXIT_OK)
        check_routing(&ctx->cfg, ids, weights, ctx->cfg.tokens, &st);
    if (moe_comm_agree(&ctx->comm, &st)) /* one verdict: no rank enters the forward alone */
        return verdict(&st, ctx->error);
    moe_ep_place(&ctx->ep, ids, weights, ctx->placed);
    const moe_path_args a = {.x = x, .ids = ctx->placed, .weights = weights, .y = y,
                             .fwd = &ctx->stats};
    /* a training context's forward is its step's: the blocking reference */
    const moe_path *path = ctx->ep.path->training ? ctx->ep.path->blocking : ctx->ep.path;
    moe_path_run(path, &ctx->ep, &a, &st);
    return verdict(&st, ctx->error);
}

int moe_ep_context_experts(const moe_ep_context *ctx, int *first, int *count)
{
    if (!ctx || !first || !count)
        return MOE_EP_BAD_INPUT;
    *first = ctx->ep.first_expert;
    *count = ctx->ep.local_experts;
    return MOE_EP_OK;
}

/* n floats of src into dst when dst is not NULL. */
static void copy_out(float *dst, const float *src, moe_index n)
{
    if (dst && n > 0)
        memcpy(dst, src, sizeof(float) * (size_t)n);
}

int moe_ep_context_backward(moe_ep_context *ctx, const float *x, const float *dy, int32_t *ids,
                            float *weights, float *y, const moe_ep_gradients *g)
{
    if (!ctx)
        return MOE_EP_BAD_INPUT;
    END_JOB_HERE(ctx->comm.comm);
    THREADS_HERE(ctx);
    moe_status st = {0};
    const moe_config *cfg = &ctx->cfg;
    const moe_index T = cfg->tokens, d = cfg->hidden, f = cfg->ffn, k = cfg->topk;
    const char *null = !x ? "x" : !dy ? "dy" : !g ? "g" : NULL;
    if (!ctx->ep.path->training)
        moe_fail(&st, MOE_EXIT_USAGE, "moe_ep_context_backward needs a context made with "
                 "--backward true (moe_ep_config_set(c, \"--backward\", \"true\"))");
    else if (null)
        moe_fail(&st, MOE_EXIT_USAGE, "moe_ep_context_backward: %s is NULL", null);
    else if (check_finite("x", x, T, d, &st) == MOE_EXIT_OK)
        check_finite("dy", dy, T, d, &st);
    if (moe_comm_agree(&ctx->comm, &st))
        return verdict(&st, ctx->error);
    /* the router's own routing: its gradient flows through these logits */
    int32_t *own_ids = moe_xmalloc(sizeof(int32_t) * (size_t)(T * k) + 1);
    float *own_weights = moe_xmalloc(sizeof(float) * (size_t)(T * k) + 1);
    float *own_y = moe_xmalloc(sizeof(float) * (size_t)(T * d) + 1);
    float *scores = moe_xmalloc(sizeof(float) * (size_t)(T * cfg->experts) + 1);
    moe_ep_route(&ctx->ep, x, ctx->logits, scores, own_ids, own_weights);
    moe_ep_place(&ctx->ep, own_ids, own_weights, ctx->placed);
    const moe_path_args a = {.x = x, .logits = ctx->logits, .dy = dy, .ids = ctx->placed,
                             .weights = own_weights, .y = own_y, .grads = &ctx->grads,
                             .fwd = &ctx->stats, .bwd = &ctx->bwd};
    if (moe_path_run(ctx->ep.path, &ctx->ep, &a, &st) == MOE_EXIT_OK) {
        const moe_index EL = ctx->ep.local_experts, S = cfg->shared_experts;
        copy_out(y, own_y, T * d);
        copy_out(weights, own_weights, T * k);
        if (ids)
            memcpy(ids, own_ids, sizeof(int32_t) * (size_t)(T * k));
        copy_out(g->dx, ctx->grads.dx, T * d);
        copy_out(g->dw1, ctx->grads.dw1, EL * 2 * f * d);
        copy_out(g->dw2, ctx->grads.dw2, EL * d * f);
        copy_out(g->dshared_w1, ctx->grads.dshared_w1, S * 2 * f * d);
        copy_out(g->dshared_w2, ctx->grads.dshared_w2, S * d * f);
        copy_out(g->dgate, ctx->grads.dgate, cfg->experts * d);
    }
    free(scores);
    free(own_y);
    free(own_weights);
    free(own_ids);
    return verdict(&st, ctx->error);
}

const char *moe_ep_verify_stage_name(int stage)
{
    return stage >= 0 && stage < MOE_GOLDEN_STAGES ? moe_golden_stage_names[stage] : NULL;
}

/* moe_ep_context_dump (dy NULL) and moe_ep_context_dump_backward, named
 * by `call`. */
static int dump(moe_ep_context *ctx, const char *call, const float *x, const float *dy,
                const char *dir, double *bytes)
{
    if (!ctx)
        return MOE_EP_BAD_INPUT;
    END_JOB_HERE(ctx->comm.comm);
    THREADS_HERE(ctx);
    moe_status st = {0};
    const bool training = ctx->ep.path->training, backward = strcmp(call, "moe_ep_context_dump");
    const char *null = !x ? "x" : !dir ? "dir" : backward && !dy ? "dy" : NULL;
    if (training != backward)
        moe_fail(&st, MOE_EXIT_USAGE, "%s: the context %s --backward: call %s", call,
                 training ? "was made with" : "was made without",
                 training ? "moe_ep_context_dump_backward" : "moe_ep_context_dump");
    else if (null)
        moe_fail(&st, MOE_EXIT_USAGE, "%s: %s is NULL", call, null);
    else if (ctx->cfg.gemm == MOE_GEMM_BLAS)
        moe_fail(&st, MOE_EXIT_USAGE, "%s needs --gemm packed or exact, got blas: "
                 "OpenBLAS's bits depend on the machine, a golden set's must not", call);
    else if (check_finite("x", x, ctx->cfg.tokens, ctx->cfg.hidden, &st) == MOE_EXIT_OK &&
             (!dy || check_finite("dy", dy, ctx->cfg.tokens, ctx->cfg.hidden, &st) == MOE_EXIT_OK) &&
             ctx->comm.rank == 0) { /* what run --dump checks up front (src/cli/context.c) */
        char what[80];
        snprintf(what, sizeof what, "%s: dir", call);
        if (moe_check_output_dir(what, dir, &st) == MOE_EXIT_OK)
            moe_golden_check_target(dir, &st);
    }
    if (moe_comm_agree(&ctx->comm, &st)) /* one verdict: no rank enters the dump alone */
        return verdict(&st, ctx->error);
    double size = 0.0;
    moe_dump_write(&ctx->comm, &ctx->ep, dir, x, dy, NULL, &size, &st);
    if (bytes)
        *bytes = size;
    return verdict(&st, ctx->error);
}

int moe_ep_context_dump(moe_ep_context *ctx, const float *x, const char *dir, double *bytes)
{
    return dump(ctx, "moe_ep_context_dump", x, NULL, dir, bytes);
}

int moe_ep_context_dump_backward(moe_ep_context *ctx, const float *x, const float *dy,
                                 const char *dir, double *bytes)
{
    return dump(ctx, "moe_ep_context_dump_backward", x, dy, dir, bytes);
}

int moe_ep_verify_with(const char *golden_dir, const char *candidate,
                       const moe_ep_verify_options *options, FILE *table,
                       moe_ep_verify_result *result)
{
    _Static_assert(MOE_EP_VERIFY_STAGES == MOE_GOLDEN_STAGES, "the header's stage count");
    moe_ep_verify_result r = {.first_failing = -1};
    moe_status st = {0};
    FILE *out = table ? table : fopen("/dev/null", "w");
    const unsigned stages = (1u << MOE_GOLDEN_STAGES) - 1u;
    if (!golden_dir || !candidate)
        moe_fail(&st, MOE_EXIT_USAGE, "moe_ep_verify: %s is NULL", !golden_dir ? "golden_dir" : "candidate");
    else if (options && options->require != ~0u && (options->require & ~stages))
        moe_fail(&st, MOE_EXIT_USAGE, "moe_ep_verify_with: options.require 0x%x has bits past the "
                 "last stage (the stages are 0x%x; ~0u requires every one)", options->require, stages);
    else if (!out)
        moe_fail(&st, MOE_EXIT_RUNTIME, "moe_ep_verify: cannot open /dev/null");
    const moe_golden_options opt = {.require = options ? options->require : 0,
                                    .allow_unknown = options && options->allow_unknown};
    moe_golden_result counts;
    memset(&counts, 0, sizeof counts);
    RECOVERY_POINT {
        const moe_status *lost = moe_recovery_lost();
        if (result) {
            *result = (moe_ep_verify_result){.verdict = lost->code, .first_failing = -1};
            snprintf(result->message, sizeof result->message, "%s", lost->message);
        }
        return lost->code;
    }
    const int rc = st.code ? st.code : moe_golden_verify(golden_dir, candidate, &opt, out, &counts, &st);
    if (out && out != table)
        fclose(out);
    for (int s = 0; s < MOE_GOLDEN_STAGES; s++) {
        r.stage_compared[s] = counts.compared[s];
        r.stage_failed[s] = counts.failed[s];
        r.stage_in_set[s] = counts.in_set[s];
        r.compared += counts.compared[s];
        if (counts.failed[s] && r.first_failing < 0)
            r.first_failing = s;
    }
    r.missing_required = counts.missing_required;
    r.verdict = rc == MOE_EXIT_OK ? MOE_EP_OK : rc == MOE_EXIT_CHECK_FAILED ? MOE_EP_FAIL : rc;
    if (st.code)
        snprintf(r.message, sizeof r.message, "%s", st.message);
    else if (r.first_failing >= 0)
        snprintf(r.message, sizeof r.message, "first failing stage: %s",
                 moe_golden_stage_names[r.first_failing]);
    else if (r.missing_required) {
        int used = snprintf(r.message, sizeof r.message, "required stages the candidate holds no tensor of:");
        for (int s = 0; s < MOE_GOLDEN_STAGES; s++)
            if (r.missing_required >> s & 1u)
                used += snprintf(r.message + used, sizeof r.message - (size_t)used, " %s",
                                 moe_golden_stage_names[s]);
    }
    if (result)
        *result = r;
    return r.verdict;
}

int moe_ep_verify(const char *golden_dir, const char *candidate, FILE *table,
                  moe_ep_verify_result *result)
{
    return moe_ep_verify_with(golden_dir, candidate, NULL, table, result);
}
