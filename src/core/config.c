/* SPDX-License-Identifier: MIT */
/* config.c — parsing, presets and validation of a run (see config.h).
 *
 * One table describes every flag (flags.c): its name (also the preset key),
 * type, allowed range, default and help. Parsing and preset loading here
 * read it; so do --help and the canonical config (flags.c). Validation
 * checks what spans features here and calls each feature's own rules
 * (router.c, eplb.c, capacity.c, layout.c, wire.c, backward.c, link.c).
 */
#define _POSIX_C_SOURCE 200809L
#include "moe/config.h"
#include "moe/backward.h"
#include "moe/capacity.h"
#include "moe/eplb.h"
#include "moe/layout.h"
#include "moe/link.h"
#include "moe/mask.h"
#include "moe/router.h"
#include "moe/wire.h"
#include "moe/workload.h"

#include "flags.h"

#include <ctype.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

bool moe_config_truth_shares(const moe_config *cfg)
{
    return !(cfg->combine == MOE_COMBINE_REDUCED && cfg->dispatch == MOE_DISPATCH_HIERARCHICAL);
}

bool moe_config_norm_topk(const moe_config *cfg)
{
    if (cfg->norm_topk != MOE_NORM_TOPK_AUTO)
        return cfg->norm_topk == MOE_NORM_TOPK_ON;
    return cfg->router == MOE_ROUTER_SOFTMAX || cfg->bias_scale > 0;
}

/* `where` is "--tokens" for a flag or "FILE:LINE: tokens" for a preset key. */
static int set_value(moe_config *cfg, const flag_spec *flag, const char *value, const char *where,
                     moe_status *st)
{
    const size_t index = (size_t)(flag - moe_flags);
    if (!strncmp(where, "--", 2) && index < 128) /* the command line's, not a preset's or the default */
        cfg->given[index / 64] |= 1ull << (index % 64);
    char *base = (char *)cfg + flag->offset;
    char *end = NULL;
    switch (flag->kind) {
    case FLAG_INT: {
        if (moe_flag_takes_auto(flag) && !strcmp(value, "auto")) {
            *(int64_t *)base = -1;
            return MOE_EXIT_OK;
        }
        errno = 0;
        long long v = strtoll(value, &end, 10);
        if (!moe_number_start(value, true) || *end != '\0' || errno == ERANGE || v < flag->min ||
            v > flag->max)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "%s must be an integer in [%lld, %lld], got '%s'", where,
                            (long long)flag->min, (long long)flag->max, value);
        *(int64_t *)base = v;
        return MOE_EXIT_OK;
    }
    case FLAG_SEED: {
        errno = 0;
        const bool hex = value[0] == '0' && (value[1] == 'x' || value[1] == 'X');
        unsigned long long v = strtoull(value, &end, hex ? 16 : 10); /* decimal, or 0x hex */
        if (!moe_number_start(value, false) || *end != '\0' || errno == ERANGE)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "%s must be an integer in [0, 18446744073709551615], got '%s'", where,
                            value);
        *(uint64_t *)base = v;
        return MOE_EXIT_OK;
    }
    case FLAG_BOOL:
        if (!strcmp(value, "true") || !strcmp(value, "yes") || !strcmp(value, "1"))
            *(bool *)base = true;
        else if (!strcmp(value, "false") || !strcmp(value, "no") || !strcmp(value, "0"))
            *(bool *)base = false;
        else
            return moe_fail(st, MOE_EXIT_USAGE, "%s must be true or false, got '%s'", where,
                            value);
        return MOE_EXIT_OK;
    case FLAG_PRESET:
    case FLAG_CLUSTER:
        return moe_fail(st, MOE_EXIT_USAGE, "%s: a .conf file cannot name another", where);
    case FLAG_WAVES: {
        const int count =
            moe_parse_int_list(value, flag->min, flag->max, cfg->waves_list, MOE_MAX_WAVE_RUNS);
        if (count == -1)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "%s must be an integer in [%lld, %lld] or a list of them, got '%s'",
                            where, (long long)flag->min, (long long)flag->max, value);
        if (count < 0)
            return moe_fail(st, MOE_EXIT_USAGE, "%s lists at most %d wave counts, got '%s'",
                            where, MOE_MAX_WAVE_RUNS, value);
        cfg->waves_count = count;
        return MOE_EXIT_OK;
    }
    case FLAG_REAL: {
        if (moe_flag_takes_none(flag) && !strcmp(value, "none")) {
            *(double *)base = 0.0;
            return MOE_EXIT_OK;
        }
        errno = 0;
        double v = strtod(value, &end);
        if (!moe_number_start(value, true) || strpbrk(value, "xX") || *end != '\0' || errno == ERANGE ||
            !(moe_flag_min_open(flag) ? v > (double)flag->min : v >= (double)flag->min) ||
            !(v <= (double)flag->max))
            return moe_fail(st, MOE_EXIT_USAGE, "%s must be a number in %c%lld, %lld]%s, got '%s'",
                            where, moe_flag_min_open(flag) ? '(' : '[', (long long)flag->min,
                            (long long)flag->max, moe_flag_takes_none(flag) ? " or none" : "", value);
        *(double *)base = v;
        return MOE_EXIT_OK;
    }
    case FLAG_TEXT:
        if (!*value && strcmp(flag->value_name, "SPEC")) /* an output or input path, given empty */
            return moe_fail(st, MOE_EXIT_USAGE, "%s needs a %s, got ''", where, flag->value_name);
        if (strlen(value) >= MOE_NAME_MAX)
            return moe_fail(st, MOE_EXIT_USAGE, "%s: %s longer than %d characters", where,
                            strcmp(flag->value_name, "SPEC") ? "path" : "value",
                            MOE_NAME_MAX - 1);
        if (!moe_utf8_valid(value)) /* the golden manifest records it as JSON text */
            return moe_fail(st, MOE_EXIT_USAGE, "%s must be UTF-8 text", where);
        snprintf(base, MOE_NAME_MAX, "%s", value);
        return MOE_EXIT_OK;
    case FLAG_CHOICE: {
        const int chosen = moe_flag_choice_value(flag, value);
        if (chosen >= 0) {
            *(int *)base = chosen;
            return MOE_EXIT_OK;
        }
        char names[128];
        return moe_fail(st, MOE_EXIT_USAGE, "%s must be one of %s, got '%s'", where,
                        moe_flag_choice_names(flag, names, sizeof names), value);
    }
    }
    return MOE_EXIT_OK;
}

void moe_config_defaults(moe_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    for (size_t n = 0; n < moe_flag_count; n++)
        if (moe_flags[n].default_value && *moe_flags[n].default_value) { /* "" is memset's already */
            moe_status st = {0};
            set_value(cfg, &moe_flags[n], moe_flags[n].default_value, "default", &st);
            MOE_ASSERT(st.code == MOE_EXIT_OK);
        }
}

static char *trim(char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    char *end = s + strlen(s);
    while (end > s && isspace((unsigned char)end[-1]))
        *--end = '\0';
    return s;
}

/* Apply a .conf file: keys of `command` are set; keys of the other command
 * are skipped (a model preset serves run and plan alike); others fail. */
static int load_conf(moe_config *cfg, enum moe_command command, const char *flag,
                     const char *kind, const char *name, moe_status *st)
{
    char file[PATH_MAX];
    FILE *fp = moe_config_open_conf(flag, kind, name, file, sizeof file, st);
    if (!fp)
        return st->code;
    char *line = NULL;
    size_t capacity = 0;
    int number = 0, rc = MOE_EXIT_OK;
    for (ssize_t got; rc == MOE_EXIT_OK && (got = getline(&line, &capacity, fp)) >= 0;) {
        if (++number == 1 && !strncmp(line, "\xef\xbb\xbf", 3)) /* a UTF-8 byte-order mark */
            memmove(line, line + 3, (size_t)(got -= 3) + 1);
        if (strlen(line) != (size_t)got) { /* text stops at a NUL; the rest would be lost */
            rc = moe_fail(st, MOE_EXIT_USAGE, "%s:%d: a NUL byte: not a text file", file, number);
            break;
        }
        char *hash = strchr(line, '#');
        if (hash)
            *hash = '\0';
        char *text = trim(line);
        if (!*text)
            continue;
        char *equals = strchr(text, '=');
        if (!equals) {
            rc = moe_fail(st, MOE_EXIT_USAGE, "%s:%d: expected 'key = value', got '%s'", file,
                          number, text);
            break;
        }
        *equals = '\0';
        char *key = trim(text), *value = trim(equals + 1);
        const flag_spec *spec = moe_flag_find(key, strlen(key));
        char where[PATH_MAX + 64];
        snprintf(where, sizeof where, "%s:%d: %s", file, number, key);
        if (!spec)
            rc = moe_fail(st, MOE_EXIT_USAGE, "%s:%d: unknown key '%s'", file, number, key);
        else if (spec->kind == FLAG_PRESET || spec->kind == FLAG_CLUSTER)
            rc = moe_fail(st, MOE_EXIT_USAGE, "%s: a .conf file cannot name another", where);
        else if (spec->commands & (1u << command))
            rc = set_value(cfg, spec, value, where, st);
    }
    if (rc == MOE_EXIT_OK && ferror(fp))
        rc = moe_fail(st, MOE_EXIT_USAGE, "--%s: cannot read '%s': %s", flag, file, strerror(errno));
    free(line);
    fclose(fp);
    return rc;
}

int moe_config_load_preset(moe_config *cfg, enum moe_command command, const char *name,
                           moe_status *st)
{
    if (load_conf(cfg, command, "preset", "presets", name, st))
        return st->code;
    snprintf(cfg->preset, sizeof cfg->preset, "%s", name);
    return MOE_EXIT_OK;
}

/* Is next the value of a switch (a bool, or a choice that has true) rather
 * than the next argument? */
static bool switch_value(const flag_spec *flag, const char *next)
{
    if (flag->kind == FLAG_CHOICE)
        return moe_flag_choice_value(flag, next) >= 0;
    static const char *const words[] = {"true", "false", "yes", "no", "1", "0"};
    for (size_t n = 0; n < sizeof words / sizeof words[0]; n++)
        if (!strcmp(next, words[n]))
            return true;
    return false;
}

/* Splits "--name=value" / "--name value"; returns the flag or sets st. */
static const flag_spec *parse_flag(enum moe_command command, int argc, char **argv, int *at,
                                   const char **value, moe_status *st)
{
    const char *arg = argv[*at];
    if (strncmp(arg, "--", 2) != 0) {
        moe_fail(st, MOE_EXIT_USAGE, "unexpected argument '%s' (flags start with --)", arg);
        return NULL;
    }
    const char *name = arg + 2, *equals = strchr(name, '=');
    size_t len = equals ? (size_t)(equals - name) : strlen(name);
    const flag_spec *flag = moe_flag_find(name, len);
    if (!flag || !(flag->commands & (1u << command))) {
        moe_fail(st, MOE_EXIT_USAGE, "unknown flag '--%.*s' for moe-ep %s (see moe-ep %s --help)",
                 (int)len, name, moe_command_names[command], moe_command_names[command]);
        return NULL;
    }
    const bool switch_like = flag->kind == FLAG_BOOL ||
                             (flag->kind == FLAG_CHOICE && moe_flag_choice_value(flag, "true") >= 0);
    if (equals)
        *value = equals + 1;
    else if (switch_like && *at + 1 < argc && switch_value(flag, argv[*at + 1]))
        *value = argv[++*at]; /* --check false, as --check=false */
    else if (switch_like)
        *value = "true"; /* a switch, or a choice that has true, may stand alone */
    else if (*at + 1 < argc)
        *value = argv[++*at];
    else {
        char names[128];
        moe_fail(st, MOE_EXIT_USAGE, "--%s needs a value (%s)", flag->name,
                 moe_flag_value_text(flag, names, sizeof names));
        return NULL;
    }
    return flag;
}

int moe_config_parse(moe_config *cfg, enum moe_command command, int argc, char **argv,
                     moe_status *st)
{
    /* Pass 1: the preset and the cluster, so that flags override them
     * whatever their order. */
    const char *preset = NULL, *cluster = NULL;
    for (int at = 0; at < argc; at++) {
        const char *value = NULL;
        const flag_spec *flag = parse_flag(command, argc, argv, &at, &value, st);
        if (!flag)
            return st->code;
        if (flag->kind == FLAG_PRESET)
            preset = value;
        if (flag->kind == FLAG_CLUSTER)
            cluster = value;
    }
    if (preset && moe_config_load_preset(cfg, command, preset, st))
        return st->code;
    if (cluster) {
        if (load_conf(cfg, command, "cluster", "clusters", cluster, st))
            return st->code;
        snprintf(cfg->cluster, sizeof cfg->cluster, "%s", cluster);
    }
    for (int at = 0; at < argc; at++) {
        const char *value = NULL;
        const flag_spec *flag = parse_flag(command, argc, argv, &at, &value, st);
        if (flag->kind == FLAG_PRESET || flag->kind == FLAG_CLUSTER)
            continue;
        char where[64];
        snprintf(where, sizeof where, "--%s", flag->name);
        if (set_value(cfg, flag, value, where, st))
            return st->code;
    }
    return MOE_EXIT_OK;
}

int64_t moe_config_most_local_experts(const moe_config *cfg, int ranks)
{
    return (cfg->experts + cfg->redundant_experts + ranks - 1) / ranks;
}

bool moe_config_given(const moe_config *cfg, const char *flag)
{
    const flag_spec *spec = moe_flag_find(flag, strlen(flag));
    MOE_ASSERT(spec != NULL);
    const size_t index = (size_t)(spec - moe_flags);
    return index < 128 && (cfg->given[index / 64] >> (index % 64) & 1);
}

void moe_config_fit(moe_config *cfg)
{
    if (moe_config_given(cfg, "waves"))
        return;
    int kept = 0;
    for (int n = 0; n < cfg->waves_count; n++) {
        int64_t W = cfg->waves_list[n];
        if (W > cfg->tokens) {
            cfg->waves_fitted_from = W > cfg->waves_fitted_from ? W : cfg->waves_fitted_from;
            W = cfg->tokens;
        }
        if (kept == 0 || cfg->waves_list[kept - 1] != W)
            cfg->waves_list[kept++] = W;
    }
    cfg->waves_count = kept;
}

int moe_config_validate(const moe_config *cfg, int ranks, moe_status *st)
{
    if (cfg->topk > cfg->experts)
        return moe_fail(st, MOE_EXIT_USAGE, "--topk must be in [1, %lld] (at most --experts), got %lld",
                        (long long)cfg->experts, (long long)cfg->topk);
    for (int n = 0; n < cfg->waves_count; n++)
        if (cfg->waves_list[n] > cfg->tokens)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--waves must be in [1, %lld] (at most --tokens), got %lld",
                            (long long)cfg->tokens, (long long)cfg->waves_list[n]);
    if (moe_router_validate(cfg, st))
        return st->code;
    /* The largest value the layer can make: |h| <= S sqrt(d) (a row of W1
     * has norm <= 1 at scale 1/sqrt(d)), the activation <= |h|^2, an output
     * <= sqrt(f) times that. Past FLT_MAX (bf16's range too) fp32 turns
     * into Inf and NaN; say so before running. --input-dist activations
     * scales a token by up to 2 and an outlier channel by 16 (rng.h). */
    const double peak = cfg->input_dist == MOE_INPUT_ACTIVATIONS ? 32.0 : 1.0;
    const double reach = peak * peak * cfg->init_scale * cfg->init_scale * (double)cfg->hidden *
                         sqrt((double)cfg->ffn);
    if (reach > FLT_MAX / 16)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--init-scale %g could overflow fp32%s: activations may reach %.1e, past "
                        "FLT_MAX/16 = %.1e (room for the sums); use at most %.3g",
                        cfg->init_scale, cfg->param_dtype != MOE_DTYPE_FP32 ? " and bf16" : "", reach,
                        (double)FLT_MAX / 16,
                        sqrt(FLT_MAX / 16 / ((double)cfg->hidden * sqrt((double)cfg->ffn))) / peak);
    if (cfg->gate_ties >= cfg->experts)
        return moe_fail(st, MOE_EXIT_USAGE, "--gate-ties must be in [0, %lld] (below --experts), got %lld",
                        (long long)cfg->experts - 1, (long long)cfg->gate_ties);
    if (cfg->combine_dtype == MOE_DTYPE_FP8)
        return moe_fail(st, MOE_EXIT_USAGE, "--combine-dtype must be fp32 or bf16 for moe-ep run, got fp8");
    if (cfg->output_dtype == MOE_DTYPE_FP8)
        return moe_fail(st, MOE_EXIT_USAGE, "--output-dtype must be fp32 or bf16, got fp8");
    if (cfg->gemm_out_dtype == MOE_DTYPE_FP8)
        return moe_fail(st, MOE_EXIT_USAGE, "--gemm-out-dtype must be fp32 or bf16, got fp8");
    if ((cfg->act_dtype != MOE_DTYPE_FP32 || cfg->gemm_out_dtype != MOE_DTYPE_FP32) &&
        cfg->weight_at == MOE_WEIGHT_AT_ACTIVATION)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--gemm-out-dtype and --act-dtype round inside the expert, where --weight-at "
                        "activation would scale by the gate weight first: use --weight-at output "
                        "(DeepSeek-V3's), or fp32 for both");
    if (cfg->topk_weights_dtype == MOE_DTYPE_FP8)
        return moe_fail(st, MOE_EXIT_USAGE, "--topk-weights-dtype must be fp32 or bf16, got fp8");
    if (cfg->dump[0] && cfg->gemm == MOE_GEMM_BLAS)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--dump needs --gemm packed or exact (default packed), got blas: OpenBLAS's "
                        "bits depend on the CPU and the thread count, and a golden set is the same "
                        "bytes on every machine");
    if (cfg->dump[0] && cfg->dispatch == MOE_DISPATCH_HIERARCHICAL && cfg->combine == MOE_COMBINE_REDUCED &&
        (cfg->act_dtype != MOE_DTYPE_FP32 || cfg->gemm_out_dtype != MOE_DTYPE_FP32))
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--dump of the two-stage dispatch's relay sums holds no allowance for rounding "
                        "inside the experts: with --gemm-out-dtype or --act-dtype, use --combine pairs "
                        "or --dispatch flat");
    if (cfg->dispatch == MOE_DISPATCH_HIERARCHICAL && cfg->wave_by == MOE_WAVE_BY_EXPERTS)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--dispatch hierarchical runs waves of tokens (a relay forwards a token once "
                        "per wave): drop --wave-by experts");
    /* local experts of the rank with the fewest */
    const int64_t fewest = (cfg->experts + cfg->redundant_experts) / ranks;
    for (int n = 0; n < cfg->waves_count && cfg->wave_by == MOE_WAVE_BY_EXPERTS; n++)
        if (cfg->waves_list[n] > fewest)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--wave-by experts needs every rank to hold at least W experts (the fewest "
                            "hold %lld at %d ranks), got --waves %lld; use --wave-by tokens or fewer waves",
                            (long long)fewest, ranks, (long long)cfg->waves_list[n]);
    const int64_t R = cfg->ranks_per_node > 0 ? cfg->ranks_per_node : ranks;
    if (cfg->dispatch == MOE_DISPATCH_HIERARCHICAL && ranks % R != 0)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--dispatch hierarchical needs nodes of equal size: --ranks-per-node must "
                        "divide the %d ranks, got %lld", ranks, (long long)R);
    /* Each feature's own rules, beside the feature. */
    if (moe_backward_validate(cfg, st) || moe_eplb_validate(cfg, ranks, "ranks", st) ||
        moe_router_validate_steps(cfg, st) || moe_capacity_validate(cfg, ranks, st) ||
        moe_layout_validate(cfg, st) || moe_ll_validate(cfg, st) ||
        moe_workload_validate(cfg, ranks, st) || moe_mask_validate(cfg, ranks, st))
        return st->code;
    moe_link link = {.ranks_per_node = 1};
    if (moe_link_parse(&link, cfg->link, st))
        return st->code;
    const double latency = link.latency[MOE_TIER_INTRA] > link.latency[MOE_TIER_INTER]
                               ? link.latency[MOE_TIER_INTRA] : link.latency[MOE_TIER_INTER];
    if (cfg->watchdog > 0 && cfg->watchdog <= 2 * latency)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--watchdog must be 0 (off) or above two of --link's latencies (%g s: a pull "
                        "waits two rounds), got %g", 2 * latency, cfg->watchdog);
    /* Every rank may receive every pair: G*T*k rows must fit an MPI count. */
    double pairs = (double)ranks * (double)cfg->tokens * (double)cfg->topk;
    if (pairs > (double)INT_MAX && (double)ranks * (double)cfg->topk > (double)INT_MAX)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "%d ranks with --topk %lld leave no room for one token: ranks*tokens*topk "
                        "must fit a 32-bit MPI count (at most %lld ranks)", ranks,
                        (long long)cfg->topk, (long long)(INT_MAX / cfg->topk));
    if (pairs > (double)INT_MAX)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--tokens must be at most %lld for %d ranks and --topk %lld "
                        "(ranks*tokens*topk must fit a 32-bit MPI count), got %lld",
                        (long long)(INT_MAX / ((double)ranks * (double)cfg->topk)), ranks,
                        (long long)cfg->topk, (long long)cfg->tokens);
    return MOE_EXIT_OK;
}

int moe_config_resolve_nodes(moe_config *cfg, int node_ranks, int ranks, moe_status *st)
{
    if (cfg->ranks_per_node != MOE_RANKS_PER_NODE_AUTO)
        return MOE_EXIT_OK;
    if (node_ranks <= 0)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--ranks-per-node auto: the %d ranks are not on machines of equal size holding "
                        "consecutive ranks; give --ranks-per-node R", ranks);
    cfg->ranks_per_node = node_ranks == ranks ? 0 : node_ranks; /* one machine: one node */
    return MOE_EXIT_OK;
}

int moe_config_layout(const moe_config *cfg)
{
    if (cfg->expert_layout != MOE_LAYOUT_AUTO)
        return cfg->expert_layout;
    return cfg->mode == MOE_MODE_LOW_LATENCY ? MOE_LAYOUT_MASKED : MOE_LAYOUT_ROWS;
}

int64_t moe_config_max_tokens(const moe_config *cfg)
{
    return cfg->max_tokens_per_rank > 0 ? cfg->max_tokens_per_rank : cfg->tokens;
}
