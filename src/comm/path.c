/* SPDX-License-Identifier: MIT */
/* path.c — the path table (path.h): each path's run, the all-to-alls it
 * can time alone, its twins, chosen once from the validated config. */
#include "moe/path.h"
#include "ep_stages.h"

static int run_reference(const moe_ep *ep, const moe_path_args *a, moe_status *st)
{
    return moe_ep_forward_ref(ep, a->x, a->ids, a->weights, a->y, a->fwd, NULL, st);
}

/* A pipelined path run without a schedule follows the config's. */
static moe_schedule schedule_of(const moe_ep *ep, const moe_path_args *a)
{
    return a->sched ? *a->sched : moe_schedule_default(ep);
}

static int run_waves(const moe_ep *ep, const moe_path_args *a, moe_status *st)
{
    const moe_schedule sched = schedule_of(ep, a);
    return moe_ep_forward_waves(ep, &sched, a->x, a->ids, a->weights, a->y, a->fwd, st);
}

static int run_two_stage_reference(const moe_ep *ep, const moe_path_args *a, moe_status *st)
{
    return moe_ep_forward_hier(ep, a->x, a->ids, a->weights, a->y, a->fwd, st);
}

static int run_two_stage(const moe_ep *ep, const moe_path_args *a, moe_status *st)
{
    const moe_schedule sched = schedule_of(ep, a);
    return moe_ep_hier_forward(ep, &sched, a->x, a->ids, a->weights, a->y, a->fwd, st);
}

static int run_low_latency(const moe_ep *ep, const moe_path_args *a, moe_status *st)
{
    return moe_ep_forward_ll(ep, a->x, a->ids, a->weights, a->y, a->fwd, st);
}

static int run_training(const moe_ep *ep, const moe_path_args *a, moe_status *st)
{
    const moe_schedule sched = schedule_of(ep, a);
    return moe_ep_backward_step(ep, &sched, a->x, a->logits, a->ids, a->weights, a->dy, a->y,
                                a->grads, a->fwd, a->bwd, st);
}

static int run_training_reference(const moe_ep *ep, const moe_path_args *a, moe_status *st)
{
    return moe_ep_backward_step(ep, NULL, a->x, a->logits, a->ids, a->weights, a->dy, a->y,
                                a->grads, a->fwd, a->bwd, st);
}

static const moe_path reference, waves, two_stage_reference, two_stage, low_latency, training,
    training_reference;

static const moe_path reference = {
    .name = "reference", .reference_run = true,
    .run = run_reference, .waves = &waves, .blocking = &reference};
static const moe_path waves = {
    .name = "waves", .pipelined = true, .linked = true,
    .run = run_waves, .time_alltoalls = moe_ep_time_alltoalls,
    .waves = &waves, .blocking = &reference};
static const moe_path two_stage_reference = {
    .name = "two-stage reference", .reference_run = true, .two_stage = true,
    .run = run_two_stage_reference, .waves = &two_stage, .blocking = &two_stage_reference};
static const moe_path two_stage = {
    .name = "two-stage", .pipelined = true, .two_stage = true, .linked = true,
    .run = run_two_stage, .time_alltoalls = moe_ep_hier_time_alltoalls,
    .waves = &two_stage, .blocking = &two_stage_reference};
/* Its bits are the reference path's with --combine pairs (ep.h); its
 * normal counterpart the wave forward. */
static const moe_path low_latency = {
    .name = "low-latency", .low_latency = true, .linked = true,
    .run = run_low_latency, .waves = &waves, .blocking = &reference};
/* A training step's forward is the reference one; its waves are the
 * backward's. */
static const moe_path training = {
    .name = "training step", .pipelined = true, .training = true, .linked = true,
    .run = run_training, .waves = &waves, .blocking = &reference};
static const moe_path training_reference = {
    .name = "training step, blocking", .reference_run = true, .training = true,
    .run = run_training_reference, .waves = &waves, .blocking = &reference};

const moe_path *moe_path_choose(const moe_config *cfg)
{
    if (cfg->mode == MOE_MODE_LOW_LATENCY)
        return &low_latency;
    if (cfg->backward)
        return cfg->blocking ? &training_reference : &training;
    if (cfg->dispatch == MOE_DISPATCH_HIERARCHICAL)
        return cfg->blocking ? &two_stage_reference : &two_stage;
    return cfg->blocking ? &reference : &waves;
}

int moe_path_run(const moe_path *p, const moe_ep *ep, const moe_path_args *a, moe_status *st)
{
    if (ep->work)
        ep->work->arrivals = 0;
    const int rc = p->run(ep, a, st);
    if (rc == MOE_EXIT_OK && a->y)
        moe_ep_round_output(ep, a->y);
    return rc;
}

void moe_path_release(struct moe_ep_workspace *work)
{
    moe_ep_forget_waves(work);
    moe_ep_forget_hier(work);
    moe_ep_ll_close(work);
}
