/* SPDX-License-Identifier: MIT */
/* settle.c — a run's configuration settled for a communicator (settle.h):
 * what moe-ep run, bench and the library's contexts share before the
 * weights are made. */
#include "moe/settle.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/common.h"
#include "moe/wire.h"

/* The memory estimate against what this host has free, per rank. */
static int check_memory(const moe_config *cfg, enum moe_command command, const moe_comm *c,
                        const moe_path *path, moe_status *st)
{
    const double need = moe_config_memory_per_rank(cfg, command, c->ranks);
    const double have = moe_memory_available() / c->ranks_on_host;
    if (need <= have)
        return MOE_EXIT_OK;
    char b1[32], b2[32], b3[32] = "";
    const bool ll = path->low_latency;
    if (ll)
        moe_format_bytes(moe_ll_buffer_bytes(cfg, c->ranks), b3, sizeof b3);
    return moe_fail(st, MOE_EXIT_USAGE,
                    "this config needs about %s per rank%s%s%s, but %s is available per rank "
                    "(%d ranks on this host); lower --tokens, --hidden, --ffn%s or --experts",
                    moe_format_bytes(need, b1, sizeof b1), ll ? " (the low-latency buffers " : "",
                    b3, ll ? ")" : "", moe_format_bytes(have, b2, sizeof b2), c->ranks_on_host,
                    ll || moe_config_layout(cfg) == MOE_LAYOUT_MASKED ? ", --max-tokens-per-rank" : "");
}

/* text + "KEY=DIGEST\n", the 64-bit digest of the file at path (nothing
 * when it cannot be read: its loader says why, collectively). */
static char *append_file_digest(char *text, const char *key, const char *path)
{
    moe_status ignored = {0};
    FILE *fp = moe_open_input("", path, &ignored);
    if (!fp)
        return text;
    uint64_t digest = 0;
    char block[1 << 16];
    for (size_t got; (got = fread(block, 1, sizeof block, fp)) > 0;)
        digest = digest * 0x100000001b3u ^ moe_digest64(block, got);
    fclose(fp);
    const size_t len = strlen(text);
    text = realloc(text, len + strlen(key) + 24);
    MOE_ASSERT(text != NULL);
    sprintf(text + len, "%s=%016llx\n", key, (unsigned long long)digest);
    return text;
}

/* A flag given on the command line, away from its default, that this run
 * (or bench) would ignore is refused, by one rule: each flag below acts only
 * through the setting it names. (At its default it changes nothing: a
 * golden set's manifest replays every flag.) */
static bool waves_run(const moe_config *cfg, const moe_path *path, enum moe_command command)
{
    (void)cfg;
    (void)command;
    return path->pipelined || (path->training && !path->reference_run);
}
static bool flat_waves_run(const moe_config *cfg, const moe_path *path, enum moe_command command)
{
    return path->pipelined && !path->two_stage && !path->training && waves_run(cfg, path, command);
}
static bool low_latency_run(const moe_config *cfg, const moe_path *path, enum moe_command command)
{
    (void)cfg;
    (void)command;
    return path->low_latency;
}
static bool normal_run(const moe_config *cfg, const moe_path *path, enum moe_command command)
{
    return !low_latency_run(cfg, path, command);
}
static bool not_bench(const moe_config *cfg, const moe_path *path, enum moe_command command)
{
    (void)cfg;
    (void)path;
    return command != MOE_CMD_BENCH;
}
static bool contiguous_layout(const moe_config *cfg, const moe_path *path, enum moe_command command)
{
    (void)path;
    (void)command;
    return moe_config_layout(cfg) == MOE_LAYOUT_CONTIGUOUS;
}

/* A flag may have more than one row: each must hold. */
static const struct {
    const char *flag;
    bool (*acts)(const moe_config *cfg, const moe_path *path, enum moe_command command);
    const char *through;
} flag_uses[] = {
    {"waves", waves_run, "the wave pipeline, which --blocking and --mode low-latency do not run"},
    {"lookahead", waves_run, "the wave pipeline, which --blocking and --mode low-latency do not run"},
    {"progress", waves_run, "the all-to-alls in flight, which --blocking and --mode low-latency do not have"},
    {"wave-by", flat_waves_run, "the flat dispatch's waves (the two-stage dispatch and --backward "
                                "always split by tokens)"},
    {"rma", low_latency_run, "--mode low-latency"},
    {"rma", not_bench, "moe-ep run (bench --mode low-latency times put and get both)"},
    {"blocking", normal_run, "--mode normal (the low-latency mode has one form)"},
    {"expert-alignment", contiguous_layout, "--expert-layout contiguous"},
};

static int check_flag_uses(const moe_config *cfg, const moe_path *path, enum moe_command command,
                           moe_status *st)
{
    for (size_t n = 0; n < sizeof flag_uses / sizeof flag_uses[0]; n++)
        if (moe_config_given(cfg, flag_uses[n].flag) && !moe_config_at_default(cfg, flag_uses[n].flag) &&
            !flag_uses[n].acts(cfg, path, command))
            return moe_fail(st, MOE_EXIT_USAGE, "--%s acts only through %s: it would do nothing "
                            "here; drop it", flag_uses[n].flag, flag_uses[n].through);
    return MOE_EXIT_OK;
}

int moe_config_settle(moe_config *cfg, const moe_comm *c, enum moe_command command,
                      moe_settle_checks checks, void *arg, moe_status *st)
{
    if (st->code == MOE_EXIT_OK)
        moe_config_fit(cfg);
    if (st->code == MOE_EXIT_OK &&
        moe_config_resolve_nodes(cfg, c->node_ranks, c->ranks, st) == MOE_EXIT_OK &&
        moe_config_validate(cfg, c->ranks, st) == MOE_EXIT_OK) {
        const moe_path *path = moe_path_choose(cfg);
        if (path->low_latency) /* every pair comes home alone (ep_ll.c) */
            cfg->combine = MOE_COMBINE_PAIRS;
        if (command == MOE_CMD_RUN || command == MOE_CMD_BENCH)
            check_flag_uses(cfg, path, command, st);
        if (st->code == MOE_EXIT_OK && (!checks || checks(cfg, path, c, arg, st) == MOE_EXIT_OK) &&
            st->code == MOE_EXIT_OK)
            check_memory(cfg, command, c, path, st);
    }
    if (moe_comm_agree(c, st))
        return st->code;
    char *text = moe_config_canonical(cfg, command);
    if (cfg->routing[0]) /* the file's contents, not just its name */
        text = append_file_digest(text, "routing-file-digest", cfg->routing);
    if (cfg->grad_output[0])
        text = append_file_digest(text, "grad-output-file-digest", cfg->grad_output);
    if (cfg->expert_load[0])
        text = append_file_digest(text, "expert-load-file-digest", cfg->expert_load);
    const int rc = moe_comm_same_config(c, text, st);
    free(text);
    return rc;
}
