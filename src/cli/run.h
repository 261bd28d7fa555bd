/* run.h — what `moe-ep bench` shares with `moe-ep run` (src/cli/run.c):
 * set-up, the run's buffers, timed forwards, the link calibration. */
#ifndef MOE_CLI_RUN_H
#define MOE_CLI_RUN_H

#include "moe/ep.h"
#include "moe/report.h"

/* The buffers of one run on this rank. */
typedef struct {
    float *x;         /* (T, d) */
    float *logits;    /* (T, E) */
    float *scores;    /* (T, E) */
    int32_t *ids;     /* (T, k) */
    float *weights;   /* (T, k) */
    float *y;         /* (T, d) */
    uint64_t y_digest; /* of the first iteration's output */
    double *per_iter; /* (iters, columns) per-iteration maxima over ranks */
    moe_trace trace;  /* the last iteration's events */
    double last_expert_seconds; /* this rank's, in the last forward */
} run_buffers;

/* The median of v (n); sorts v. */
double moe_run_median(double *v, int n);

/* Parse and validate `command`'s arguments on every rank, estimate memory,
 * check output paths; agree. */
int moe_run_set_up(const moe_comm *c, moe_config *cfg, enum moe_command command, int argc,
                   char **argv, moe_status *st);

void moe_run_buffers_init(run_buffers *b, const moe_config *cfg);
void moe_run_buffers_free(run_buffers *b);

/* cfg->iters forwards at the current cfg->waves; fills the times, traffic and
 * run-to-run identity of s. Collective. */
int moe_run_timed_forwards(const moe_comm *c, const moe_ep *ep, run_buffers *b,
                           moe_run_summary *s, moe_status *st);

/* Set-up, the layer's weights, the buffers and tokens, the summary, and the
 * link calibration: everything run and bench do before their forwards.
 * On failure (st set, the same on every rank) nothing stays allocated. */
int moe_run_prepare(const moe_comm *c, enum moe_command command, int argc, char **argv,
                    moe_config *cfg, moe_ep *ep, run_buffers *b, moe_run_summary *s,
                    moe_status *st);

/* --link cb=RATIO: B = C / RATIO with C a rank's measured expert FLOP/s. */
int moe_run_calibrate_link(const moe_comm *c, moe_ep *ep, run_buffers *b, moe_run_summary *s,
                           moe_status *st);

#endif
