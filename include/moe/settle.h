/* SPDX-License-Identifier: MIT */
/* settle.h — a run's configuration settled for a communicator, the one way
 * every entry does it (moe-ep run and bench, the library's contexts):
 * --ranks-per-node auto resolved from the machines, the flags validated for
 * the ranks, the path chosen (the low-latency path sends every pair home
 * alone: --combine pairs), the entry's own checks, the memory estimate
 * against what this host has free, one verdict on every rank, then the
 * same configuration on every rank (its canonical text and the digests of
 * the files it reads, so that one path naming different contents is caught).
 */
#ifndef MOE_SETTLE_H
#define MOE_SETTLE_H

#include "moe/comm.h"
#include "moe/config.h"
#include "moe/path.h"

/* An entry's own checks of a validated config on its path; MOE_EXIT_OK or
 * a code with st set. */
typedef int (*moe_settle_checks)(const moe_config *cfg, const moe_path *path, const moe_comm *c,
                                 void *arg, moe_status *st);

/* Settle cfg (parsed; st may already hold the parse's failure, which then
 * only travels to every rank). Collective: the same code on every rank,
 * with the message of the lowest failing rank. */
int moe_config_settle(moe_config *cfg, const moe_comm *c, enum moe_command command,
                      moe_settle_checks checks, void *arg, moe_status *st);

#endif
