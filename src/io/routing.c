/* SPDX-License-Identifier: MIT */
/* routing.c — reading and validating a routing file (see routing.h). */
#include "moe/routing.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/safetensors.h"

/* Tensor name of file f, (tokens, topk), of integer or real dtype; read
 * whole into *data (caller frees). */
static int read_tensor(const char *path, const moe_st_file *f, const char *name, bool integer,
                       moe_index tokens, int topk, void **data, moe_st_entry *entry,
                       moe_status *st)
{
    const moe_st_entry *e = moe_st_find(f, name);
    if (!e)
        return moe_fail(st, MOE_EXIT_USAGE, "--routing: '%s' has no tensor %s", path, name);
    if (e->ndim != 2 || e->shape[0] != tokens || e->shape[1] != topk)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--routing: %s in '%s' must be (%lld, %d): all ranks' tokens by --topk",
                        name, path, (long long)tokens, topk);
    if (moe_st_dtype_is_integer(e->dtype) != integer)
        return moe_fail(st, MOE_EXIT_USAGE, "--routing: %s in '%s' must hold %s, not %s", name,
                        path, integer ? "integers" : "reals", moe_st_dtype_name(e->dtype));
    *data = moe_xmalloc((size_t)(e->end - e->begin) + 1);
    *entry = *e;
    return moe_st_read(f, e, *data, st);
}

int moe_routing_load(const char *path, moe_index tokens, int topk, int experts, moe_index first,
                     moe_index count, int32_t *ids, float *weights, moe_status *st)
{
    moe_st_file f;
    if (moe_st_open(path, &f, st)) {
        char why[MOE_MESSAGE_MAX];
        snprintf(why, sizeof why, "%s", st->message);
        return moe_fail(st, MOE_EXIT_USAGE, "--routing: %.480s", why);
    }
    void *id_data = NULL, *weight_data = NULL;
    moe_st_entry id_entry, weight_entry;
    int rc = read_tensor(path, &f, "router.topk_ids", true, tokens, topk, &id_data, &id_entry, st);
    if (rc == MOE_EXIT_OK)
        rc = read_tensor(path, &f, "router.topk_weights", false, tokens, topk, &weight_data,
                         &weight_entry, st);
    for (moe_index i = 0; rc == MOE_EXIT_OK && i < tokens; i++)
        for (int s = 0; rc == MOE_EXIT_OK && s < topk; s++) {
            const double id = moe_st_element(id_data, id_entry.dtype, i * topk + s);
            const double w = moe_st_element(weight_data, weight_entry.dtype, i * topk + s);
            if (!(id >= -1 && id < experts)) /* -1: a masked pair (DeepEP's topk_idx) */
                rc = moe_fail(st, MOE_EXIT_USAGE,
                              "--routing: token %lld slot %d has expert id %.0f, outside [-1, %d) "
                              "(-1: masked)", (long long)i, s, id, experts);
            else if (!isfinite(w))
                rc = moe_fail(st, MOE_EXIT_USAGE, "--routing: token %lld slot %d has weight %g",
                              (long long)i, s, w);
            for (int before = 0; rc == MOE_EXIT_OK && id >= 0 && before < s; before++)
                if (moe_st_element(id_data, id_entry.dtype, i * topk + before) == id)
                    rc = moe_fail(st, MOE_EXIT_USAGE,
                                  "--routing: token %lld picks expert %.0f twice (slots %d and %d)",
                                  (long long)i, id, before, s);
            if (rc == MOE_EXIT_OK && i >= first && i < first + count) {
                ids[(i - first) * topk + s] = (int32_t)id;
                weights[(i - first) * topk + s] = (float)w;
            }
        }
    free(weight_data);
    free(id_data);
    moe_st_close(&f);
    return rc;
}

int moe_grad_output_load(const char *path, moe_index tokens, moe_index hidden, moe_index first,
                         moe_index count, float *dy, moe_status *st)
{
    moe_st_file f;
    if (moe_st_open(path, &f, st)) {
        char why[MOE_MESSAGE_MAX];
        snprintf(why, sizeof why, "%s", st->message);
        return moe_fail(st, MOE_EXIT_USAGE, "--grad-output: %.480s", why);
    }
    const moe_st_entry *e = moe_st_find(&f, "backward.dy");
    int rc = MOE_EXIT_OK;
    if (!e)
        rc = moe_fail(st, MOE_EXIT_USAGE, "--grad-output: '%s' has no tensor backward.dy", path);
    else if (e->ndim != 2 || e->shape[0] != tokens || e->shape[1] != hidden)
        rc = moe_fail(st, MOE_EXIT_USAGE,
                      "--grad-output: backward.dy in '%s' must be (%lld, %lld): all ranks' tokens "
                      "by --hidden",
                      path, (long long)tokens, (long long)hidden);
    else if (moe_st_dtype_is_integer(e->dtype))
        rc = moe_fail(st, MOE_EXIT_USAGE, "--grad-output: backward.dy in '%s' must hold reals, not %s",
                      path, moe_st_dtype_name(e->dtype));
    void *data = NULL;
    if (rc == MOE_EXIT_OK) {
        data = moe_xmalloc((size_t)(e->end - e->begin) + 1);
        rc = moe_st_read(&f, e, data, st);
    }
    for (moe_index m = 0; rc == MOE_EXIT_OK && m < tokens * hidden; m++) {
        const double v = moe_st_element(data, e->dtype, m);
        if (!isfinite(v))
            rc = moe_fail(st, MOE_EXIT_USAGE, "--grad-output: backward.dy of token %lld column %lld is %g",
                          (long long)(m / hidden), (long long)(m % hidden), v);
        else if (m / hidden >= first && m / hidden < first + count)
            dy[m - first * hidden] = (float)v;
    }
    free(data);
    moe_st_close(&f);
    return rc;
}

/* How many of the n bytes at p are printable ASCII before the first that is not. */
static size_t printable(const char *p, size_t n)
{
    size_t m = 0;
    while (m < n && p[m] >= 0x20 && p[m] < 0x7f)
        m++;
    return m;
}

int moe_expert_load_read(const char *path, int experts, double *load, moe_status *st)
{
    FILE *file = moe_open_input("--expert-load: ", path, st); /* a regular file: no FIFO to block on */
    if (!file)
        return st->code;
    char line[4096];
    int count = 0, line_no = 0, rc = MOE_EXIT_OK;
    while (rc == MOE_EXIT_OK && fgets(line, sizeof line, file)) {
        line_no++;
        if (!strchr(line, '\n') && !feof(file)) {
            rc = moe_fail(st, MOE_EXIT_USAGE, "--expert-load: line %d of '%s' is longer than %zu bytes",
                          line_no, path, sizeof line - 2);
            break;
        }
        line[strcspn(line, "#")] = '\0';
        for (char *p = line; rc == MOE_EXIT_OK;) {
            p += strspn(p, " \t\r\n,");
            if (!*p)
                break;
            char *end;
            errno = 0;
            const double v = strtod(p, &end);
            const size_t len = strcspn(p, " \t\r\n,");
            const size_t shown = len < 40 ? len : 40, text = printable(p, shown);
            if (text < shown) /* a binary file: name the byte, do not echo it */
                rc = moe_fail(st, MOE_EXIT_USAGE,
                              "--expert-load: line %d of '%s' holds the byte 0x%02x: not a text file of loads",
                              line_no, path, (unsigned char)p[text]);
            else if (end != p + len || errno == ERANGE || !isfinite(v) || v < 0)
                rc = moe_fail(st, MOE_EXIT_USAGE,
                              "--expert-load: line %d of '%s': '%.*s' is not a load (a finite number >= 0)",
                              line_no, path, (int)shown, p);
            else if (count >= experts)
                rc = moe_fail(st, MOE_EXIT_USAGE,
                              "--expert-load: '%s' holds more than the %d numbers of --experts (line %d)",
                              path, experts, line_no);
            else
                load[count++] = v;
            p = end;
        }
    }
    if (rc == MOE_EXIT_OK && ferror(file))
        rc = moe_fail(st, MOE_EXIT_USAGE, "--expert-load: cannot read '%s'", path);
    if (rc == MOE_EXIT_OK && count != experts)
        rc = moe_fail(st, MOE_EXIT_USAGE, "--expert-load: '%s' holds %d numbers, --experts is %d",
                      path, count, experts);
    fclose(file);
    return rc;
}
