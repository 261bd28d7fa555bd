/* SPDX-License-Identifier: MIT */
/* link.c — the emulated interconnect model (see link.h, docs/link-model.md). */
#define _POSIX_C_SOURCE 200809L
#include "moe/link.h"

#include <ctype.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A plain decimal number: digits first (no sign, space, inf or nan), then
 * the unit at *end. */
static bool number(const char *text, double *v, char **end)
{
    if (!isdigit((unsigned char)text[0]) && !(text[0] == '.' && isdigit((unsigned char)text[1])))
        return false;
    if (text[0] == '0' && (text[1] == 'x' || text[1] == 'X')) /* strtod would read hex */
        return false;
    *v = strtod(text, end);
    return isfinite(*v);
}

/* "900GB/s" → bytes per second, in [MOE_LINK_BW_MIN, MOE_LINK_BW_MAX].
 * B is a byte and b a bit, as network rates are written: 8Gb/s = 1GB/s. */
static bool parse_bandwidth(const char *text, double *out)
{
    char *end;
    double v;
    static const struct {
        const char *unit;
        double scale;
    } units[] = {{"B/s", 1},     {"KB/s", 1e3},     {"MB/s", 1e6},     {"GB/s", 1e9},
                 {"TB/s", 1e12}, {"b/s", 1.0 / 8}, {"Kb/s", 1e3 / 8}, {"Mb/s", 1e6 / 8},
                 {"Gb/s", 1e9 / 8}, {"Tb/s", 1e12 / 8}};
    if (!number(text, &v, &end))
        return false;
    for (size_t u = 0; u < sizeof units / sizeof units[0]; u++)
        if (!strcmp(end, units[u].unit)) {
            *out = v * units[u].scale;
            return *out >= MOE_LINK_BW_MIN && *out <= MOE_LINK_BW_MAX;
        }
    return false;
}

/* "5us" → seconds, in [0, MOE_LINK_LATENCY_MAX]. */
static bool parse_time(const char *text, double *out)
{
    char *end;
    double v;
    static const struct {
        const char *unit;
        double scale;
    } units[] = {{"ns", 1e-9}, {"us", 1e-6}, {"ms", 1e-3}, {"s", 1}};
    if (!number(text, &v, &end))
        return false;
    for (size_t u = 0; u < sizeof units / sizeof units[0]; u++)
        if (!strcmp(end, units[u].unit)) {
            *out = v * units[u].scale;
            return *out <= MOE_LINK_LATENCY_MAX;
        }
    return false;
}

/* "BW[:TIME]" into one tier. */
static bool parse_tier(char *value, double *bandwidth, double *latency)
{
    char *colon = strchr(value, ':');
    if (colon)
        *colon = '\0';
    return parse_bandwidth(value, bandwidth) && (!colon || parse_time(colon + 1, latency));
}

int moe_link_parse(moe_link *link, const char *spec, moe_status *st)
{
    const int ranks_per_node = link->ranks_per_node;
    memset(link, 0, sizeof *link);
    link->ranks_per_node = ranks_per_node;
    for (int t = 0; t < MOE_TIERS; t++)
        link->bandwidth[t] = INFINITY;
    if (!*spec || !strcmp(spec, "off"))
        return MOE_EXIT_OK;
    char text[256];
    if (strlen(spec) >= sizeof text)
        return moe_fail(st, MOE_EXIT_USAGE, "--link spec too long");
    snprintf(text, sizeof text, "%s", spec);
    bool cb = false, tiers = false;
    for (char *item = text, *next; item; item = next) { /* strict: no empty items */
        next = strchr(item, ',');
        if (next)
            *next++ = '\0';
        char *equals = strchr(item, '=');
        if (!equals)
            goto bad;
        *equals = '\0';
        char *key = item, *value = equals + 1;
        if (!strcmp(key, "cb")) {
            char *end;
            if (!number(value, &link->cb_ratio, &end) || *end || !(link->cb_ratio > 0) ||
                link->cb_ratio > MOE_LINK_CB_MAX)
                goto bad;
            cb = true;
        } else if (!strcmp(key, "inter-cb")) {
            char *end;
            if (!number(value, &link->cb_ratio_inter, &end) || *end || !(link->cb_ratio_inter > 0) ||
                link->cb_ratio_inter > MOE_LINK_CB_MAX)
                goto bad;
        } else if (!strcmp(key, "lat")) {
            double latency;
            if (!parse_time(value, &latency))
                goto bad;
            link->latency[MOE_TIER_INTRA] = link->latency[MOE_TIER_INTER] = latency;
        } else if (!strcmp(key, "bw")) {
            if (!parse_tier(value, &link->bandwidth[MOE_TIER_INTRA], &link->latency[MOE_TIER_INTRA]))
                goto bad;
            link->bandwidth[MOE_TIER_INTER] = link->bandwidth[MOE_TIER_INTRA];
            link->latency[MOE_TIER_INTER] = link->latency[MOE_TIER_INTRA];
            tiers = true;
        } else if (!strcmp(key, "intra") || !strcmp(key, "inter")) {
            const int t = !strcmp(key, "intra") ? MOE_TIER_INTRA : MOE_TIER_INTER;
            if (!parse_tier(value, &link->bandwidth[t], &link->latency[t]))
                goto bad;
            tiers = true;
        } else {
            goto bad;
        }
    }
    if (cb && tiers)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--link: cb=RATIO sets the bandwidth itself; do not combine it with bw, intra or inter");
    if (link->cb_ratio_inter > 0 && !cb)
        return moe_fail(st, MOE_EXIT_USAGE, "--link: inter-cb=RATIO goes with cb=RATIO (the intra-node tier's)");
    if (!cb && !tiers)
        goto bad;
    link->enabled = true;
    return MOE_EXIT_OK;
bad:
    return moe_fail(st, MOE_EXIT_USAGE,
                    "--link must be cb=RATIO[,inter-cb=RATIO][,lat=TIME], bw=BW[:TIME] or intra=BW[:TIME],inter=BW[:TIME] "
                    "(RATIO in (0, %g]; BW like 50GB/s or 400Gb/s, in [1MB/s, 1000TB/s]; TIME like "
                    "5us, at most %gs), got '%s'", MOE_LINK_CB_MAX, MOE_LINK_LATENCY_MAX, spec);
}

double moe_link_schedule(const moe_link *link, moe_link_state *state, double t_post,
                         const double *bytes_in, const double *bytes_out)
{
    double done = t_post;
    if (!link->enabled)
        return done;
    for (int t = 0; t < MOE_TIERS; t++) {
        const double bytes[2] = {bytes_in[t], bytes_out[t]};
        for (int dir = 0; dir < 2; dir++) {
            if (bytes[dir] <= 0)
                continue;
            double *free_at = &state->free_at[t][dir];
            const double start = t_post > *free_at ? t_post : *free_at;
            *free_at = start + bytes[dir] / link->bandwidth[t];
            const double arrive = *free_at + link->latency[t];
            done = arrive > done ? arrive : done;
        }
    }
    return done;
}

static void describe_tier(const moe_link *link, int t, char *buf, size_t size)
{
    if (isinf(link->bandwidth[t]))
        snprintf(buf, size, "unlimited");
    else
        snprintf(buf, size, "%.3g GB/s + %.3g us", link->bandwidth[t] * 1e-9, link->latency[t] * 1e6);
}

void moe_link_describe(const moe_link *link, char *buf, size_t size)
{
    char intra[64], inter[64];
    describe_tier(link, MOE_TIER_INTRA, intra, sizeof intra);
    describe_tier(link, MOE_TIER_INTER, inter, sizeof inter);
    snprintf(buf, size, "intra-node %s, inter-node %s, %d ranks per node", intra, inter,
             link->ranks_per_node);
}
