/* SPDX-License-Identifier: MIT */
/* context.h — what `moe-ep run` and `moe-ep bench` both set up, in one
 * value: the validated configuration, the EP object, the schedule of the
 * forwards under way, this rank's buffers, the summary the report prints,
 * and the status of the last failure.
 *
 * Opening a context is every phase before the first timed forward, as HPCG
 * runs them: parse and validate the flags on every rank (one collective
 * verdict), check the output paths and the memory estimate, generate the
 * weights and tokens, and calibrate the link model. The configuration is
 * frozen from then on; what varies between forwards (W, the link model,
 * a trace) is set in ctx->schedule.
 */
#ifndef MOE_CONTEXT_H
#define MOE_CONTEXT_H

#include "moe/ep.h"
#include "moe/path.h"
#include "moe/report.h"

typedef struct {
    const moe_comm *comm;
    moe_config cfg;          /* validated by moe_context_open; never written after */
    moe_ep ep;               /* holds &cfg: a context is not moved once open */
    moe_schedule schedule;   /* the forwards under way (moe_schedule_default at open) */
    /* this rank's buffers */
    float *x;                /* (T, d) */
    float *logits;           /* (T, E) */
    float *scores;           /* (T, E) */
    int32_t *ids;            /* (T, k) the router's logical expert ids */
    int32_t *placed;         /* (T, k) the physical experts the pairs go to (moe_ep_place):
                                ids itself without --redundant-experts and
                                --capacity-factor; MOE_DROPPED for a dropped pair */
    double *expert_load;     /* (E) --redundant-experts: the load EPLB placed by; else NULL */
    float *steps_bias;       /* (steps, E) --steps: the correction bias after each step; else NULL */
    double *steps_load;      /* (steps, E) --steps: each step's pairs per expert, over all ranks */
    float *weights;          /* (T, k) */
    float *y;                /* (T, d) */
    uint64_t y_digest;       /* of the first timed forward's output */
    double *per_iter;        /* (iters, columns) per-forward maxima over ranks */
    /* --backward */
    float *dy;               /* (T, d) the upstream gradient (rng.h, MOE_TENSOR_GRAD_OUTPUT) */
    moe_ep_grads grads;      /* this rank's gradients of the last step */
    moe_backward_stats last_bwd; /* this rank's figures of the last backward */
    uint64_t grads_digest;   /* of the first step's gradients */
    double *per_iter_bwd;    /* (iters, columns) per-step maxima over ranks */
    moe_trace trace;         /* the last forward's events (schedule.trace points here) */
    double last_expert_seconds; /* this rank's, in the last forward */
    moe_forward_stats last;  /* this rank's figures of the last forward */
    moe_run_summary summary; /* what the report prints */
    /* called on every rank outside the forwards' times: before the first
     * and after each of moe_context_timed_forwards (bench's FMA peak beside
     * them); NULL at open: nothing */
    void (*between)(void *arg);
    void *between_arg;
    moe_status status;       /* the last failure, the same on every rank */
} moe_run_context;

/* Open a context for `command` (run, bench or explain) from its arguments:
 * once they are valid, MPI is started on a comm without it
 * (moe_comm_start). On failure rank 0 prints the one error line, nothing
 * stays allocated, and the exit code (the same on every rank) is returned.
 * Collective. */
int moe_context_open(moe_run_context *ctx, moe_comm *c, enum moe_command command,
                     int argc, char **argv);
void moe_context_close(moe_run_context *ctx);

/* --workload: this rank's top-k ids and weights of `workload` (workload.h)
 * at --workload-step, replayed instead of the router from the next forward
 * on (as --routing's). */
void moe_context_workload(moe_run_context *ctx, int workload);
/* --redundant-experts after --steps with --bias-update: EPLB measures its
 * window again, on the batches after the steps' under the final bias, and
 * places the copies again for that load (as a server re-runs EPLB when the
 * load drifts). Collective. */
void moe_context_replace_replicas(moe_run_context *ctx);

/* iters forwards on the path the configuration asks for (the wave pipeline
 * under ctx->schedule, or the blocking reference path with --blocking),
 * each from an aligned start (barrier): route, then the layer; with
 * --backward each a training step (moe_ep_backward_ref). Fills the
 * summary's times (median over the forwards of the max over ranks), traffic
 * and run-to-run identity. Collective. */
int moe_context_timed_forwards(moe_run_context *ctx, int iters);

/* T_comm of the overlap, outside the timed forwards (OSU): the last wave
 * forward's all-to-alls alone, iters times; the median of the max over
 * ranks into summary.comm_seconds. Nothing on the blocking path. Collective. */
void moe_context_time_alltoalls(moe_run_context *ctx, int iters);

/* --steps N and --bias-update (src/cli/steps.c): N forwards on stream
 * batches 0 .. N-1 on the configured path, each followed by the bias update,
 * then the table of the steps' balance on rank 0 and --steps-csv and
 * --steps-plot. ctx->x is the run's batch again afterwards. Collective. */
int moe_run_steps(moe_run_context *ctx);

#endif
