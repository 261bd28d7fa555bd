/* SPDX-License-Identifier: MIT */
/* verify.c — a candidate's tensors against a golden set, stage by stage
 * (moe_golden_verify, golden.h; docs/golden.md section 4). */
#define _GNU_SOURCE
#include "moe/golden.h"

#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/files.h"
#include "moe/quant.h"

/* Element i as a double; F32, the common case, without the call. */
static inline double element(const void *data, enum moe_st_dtype dtype, int64_t i)
{
    return dtype == MOE_ST_F32 ? (double)((const float *)data)[i] : moe_st_element(data, dtype, i);
}

/* The value of each E4M3 byte (NaN for 0x7F and 0xFF), made once. */
static const float *e4m3_table(void)
{
    static float table[256];
    static bool made;
    for (int q = 0; q < 256 && !made; q++)
        table[q] = moe_e4m3_to_f32((uint8_t)q);
    made = true;
    return table;
}

typedef struct {
    double max_abs, max_rel, max_used;
    int64_t first_bad, bad, near_ties;
    int64_t reordered;            /* tokens whose experts came in another order */
    int64_t toward_zero, away;    /* elements one bf16 step from the golden, by direction */
} verdict;

/* ids (N, k), a token's experts matched as a set: a golden id the
 * candidate holds in another slot is the same choice (slot_of[i] says
 * which candidate slot holds golden slot i, so that the weights follow
 * their ids). A golden id the candidate lacks is paired with a candidate
 * id the golden lacks, in slot order; the pair is a near-tie when their
 * golden selection scores differ by at most the scores' tolerance: the
 * candidate chose a different but equally good expert. */
static void compare_topk(const int32_t *ref, const int32_t *got, int64_t n, int k,
                         const float *selection, int experts, double tol_abs, double tol_rel,
                         uint8_t *tied, int32_t *slot_of, verdict *v)
{
    uint8_t *used = moe_xmalloc((size_t)k + 1);
    for (int64_t token = 0; token < n / k; token++) {
        const int32_t *r = ref + token * k, *g = got + token * k;
        int32_t *to = slot_of + token * k;
        bool moved = false;
        memset(used, 0, (size_t)k);
        for (int s = 0; s < k; s++) {
            to[s] = -1;
            for (int c = 0; c < k && to[s] < 0; c++)
                if (!used[c] && g[c] == r[s])
                    to[s] = c, used[c] = 1, moved |= c != s;
        }
        for (int s = 0; s < k; s++) {
            if (to[s] >= 0)
                continue;
            int c = 0;
            while (used[c])
                c++;
            to[s] = c, used[c] = 1;
            bool tie = selection && r[s] >= 0 && g[c] >= 0 && g[c] < experts; /* -1: masked */
            if (tie) {
                const double a = selection[token * experts + r[s]];
                const double b = selection[token * experts + g[c]];
                tie = fabs(a - b) <= tol_abs + tol_rel * fabs(a);
            }
            if (tie) {
                v->near_ties++;
                tied[token] = 1; /* its later tensors legitimately differ */
            } else if (v->bad++ == 0) {
                v->first_bad = token * k + s;
            }
        }
        v->reordered += moved;
    }
    free(used);
}

/* A tolerance tensor's contract as the manifest gives it (golden.h). */
typedef struct {
    double abs, rel;
    const double *allow; /* per element, or NULL */
    bool bf16_step;
} contract;

/* +1 when g is r's bf16 neighbour away from zero, -1 toward zero, 0 when
 * either is not a bf16 value or they are not neighbours of one sign. */
static int bf16_neighbour(double r, double g)
{
    const float fr = (float)r, fg = (float)g;
    uint32_t br, bg;
    memcpy(&br, &fr, sizeof br);
    memcpy(&bg, &fg, sizeof bg);
    if (fr != r || fg != g || (br & 0xffffu) || (bg & 0xffffu) || ((br ^ bg) & 0x80000000u) ||
        !isfinite(fr) || !isfinite(fg))
        return 0;
    const uint32_t mr = (br & 0x7fffffffu) >> 16, mg = (bg & 0x7fffffffu) >> 16;
    return mg == mr + 1 ? 1 : mr == mg + 1 ? -1 : 0;
}

/* skip_row, when not NULL, leaves out the rows (of width elements) it
 * marks. Under a bf16 step contract, an element one bf16 step from the
 * golden is counted by direction and left out of the share used (the
 * step is allowed whole); the other elements make max_used. */
static void compare_values(const void *ref, enum moe_st_dtype ref_dtype, const void *got,
                           enum moe_st_dtype got_dtype, int64_t n, enum moe_golden_rule rule,
                           const contract *tol, const uint8_t *skip_row, int64_t width, verdict *v)
{
    for (int64_t i = 0; i < n; i++) {
        if (skip_row && skip_row[i / width])
            continue;
        const double r = element(ref, ref_dtype, i), g = element(got, got_dtype, i);
        double err = fabs(g - r);
        if (!isfinite(g) && !(isnan(g) && isnan(r)))
            err = INFINITY;
        if (isnan(g) && isnan(r))
            err = 0.0;
        const double bound = rule == MOE_RULE_EXACT
                                 ? 0.0
                                 : tol->abs + tol->rel * fabs(r) + (tol->allow ? tol->allow[i] : 0.0) +
                                       (tol->bf16_step ? moe_bf16_step(r) : 0.0);
        const double used = bound > 0 ? err / bound : (err > 0 ? INFINITY : 0.0);
        if (err > v->max_abs || err != err)
            v->max_abs = fmax(v->max_abs, err);
        if (fabs(r) > 0 && err > 0)
            v->max_rel = fmax(v->max_rel, err / fabs(r));
        const int step = tol->bf16_step && err > 0 ? bf16_neighbour(r, g) : 0;
        if (step < 0)
            v->toward_zero++;
        else if (step > 0)
            v->away++;
        else if (used > v->max_used)
            v->max_used = used;
        if (err > bound && v->bad++ == 0)
            v->first_bad = i;
    }
}

/* "(2, 3)" */
static void shape_text(int ndim, const int64_t *shape, char *buf, size_t size)
{
    size_t used = (size_t)snprintf(buf, size, "(");
    for (int dim = 0; dim < ndim && used < size; dim++)
        used += (size_t)snprintf(buf + used, size - used, "%s%lld", dim ? ", " : "", (long long)shape[dim]);
    if (used < size)
        snprintf(buf + used, size - used, ")");
}

static void index_text(int64_t flat, int ndim, const int64_t *shape, char *buf, size_t size)
{
    int64_t idx[MOE_ST_MAX_DIMS];
    for (int dim = ndim - 1; dim >= 0; dim--) {
        idx[dim] = shape[dim] ? flat % shape[dim] : 0;
        flat = shape[dim] ? flat / shape[dim] : 0;
    }
    size_t used = (size_t)snprintf(buf, size, "[");
    for (int dim = 0; dim < ndim; dim++)
        used += (size_t)snprintf(buf + used, size - used, "%s%lld", dim ? "," : "", (long long)idx[dim]);
    snprintf(buf + used, size - used, "]");
}

/* One verify: the golden set, the candidate, and the verdict so far. */
typedef struct {
    const char *dir;
    json_t *manifest, *tensors, *files;
    json_t *convention;     /* the contract of convention_golden's tensors */
    moe_st_file cand;
    float *selection;       /* (N, E) router.selection, for the near-tie rule; NULL without */
    int experts;
    double sel_abs, sel_rel;
    FILE *out;
    int first_failing;      /* stage, MOE_GOLDEN_STAGES while none failed */
    int compared;
    moe_golden_result result; /* per stage: tensors compared and failed */
    int64_t ranks, config_tokens, experts_config, topk, hidden; /* the config's G, T, E, k, d */
    uint8_t *tied;          /* (tokens) whose top-k differs only by near-ties; NULL: none yet */
    int64_t tokens, tied_count;
    int32_t *slot_of;       /* (tokens, k): the candidate's slot of each golden slot; NULL: as golden */
    uint8_t *masked;        /* (tokens, k): the golden id is -1 (a masked pair); NULL: none is */
    int64_t topk_count;     /* elements of slot_of */
    moe_golden_options opt;
    json_t *checked;        /* golden files read back against their checksum already */
    int32_t **arrival;      /* per rank, masked layout: the candidate slot of each golden slot */
    uint8_t *arrival_done;  /* per rank: arrival computed (NULL there: golden order) */
} verify_run;

/* Load the golden tensor `name` the manifest lists: its file must match the
 * manifest's SHA-256, and the tensor there the manifest's dtype and shape
 * (validate_manifest checked those against the config). */
static void *load_golden(const verify_run *v, const char *name, moe_st_entry *entry, moe_status *st)
{
    json_t *info = json_object_get(v->tensors, name);
    const char *file = json_string_value(json_object_get(info, "file"));
    if (!file) {
        moe_fail(st, MOE_EXIT_USAGE, "golden manifest lists no tensor '%s'", name);
        return NULL;
    }
    char path[2 * PATH_MAX], hex[65];
    snprintf(path, sizeof path, "%s/%s", v->dir, file);
    const char *want = json_string_value(json_object_get(json_object_get(v->files, file), "sha256"));
    const bool checked = json_object_get(v->checked, file) != NULL; /* each file hashed once */
    if (!checked && (!want || !moe_golden_file_sha256(path, hex) || strcmp(hex, want) != 0)) {
        moe_fail(st, MOE_EXIT_USAGE,
                 "golden file '%s' is missing or differs from its manifest checksum; regenerate the "
                 "set with moe-ep run --dump and the manifest's config", path);
        return NULL;
    }
    json_object_set_new(v->checked, file, json_true());
    moe_st_file f;
    if (moe_st_open(path, &f, st))
        return NULL;
    const moe_st_entry *e = moe_st_find(&f, name);
    void *data = NULL;
    json_t *shape = json_object_get(info, "shape");
    bool as_listed = e && !strcmp(moe_st_dtype_name(e->dtype), json_string_value(json_object_get(info, "dtype"))) &&
                     (size_t)e->ndim == json_array_size(shape);
    for (int dim = 0; as_listed && dim < e->ndim; dim++)
        as_listed = e->shape[dim] == json_integer_value(json_array_get(shape, (size_t)dim));
    if (!e) {
        moe_fail(st, MOE_EXIT_USAGE, "golden file '%s' lacks tensor '%s'", path, name);
    } else if (!as_listed) {
        moe_fail(st, MOE_EXIT_USAGE, "golden tensor '%s' in '%s' is not the dtype and shape its "
                 "manifest lists", name, path);
    } else {
        *entry = *e;
        data = moe_xmalloc((size_t)(e->end - e->begin) + 1);
        if (moe_st_read(&f, e, data, st)) {
            free(data);
            data = NULL;
        }
    }
    moe_st_close(&f);
    return data;
}

/* The scales of an F8_E4M3 tensor of `rows` rows of `blocks` blocks as F32,
 * from any of the forms ports write them in: F32 (rows, blocks); U8 UE8M0
 * exponent bytes (rows, blocks), 2^(byte - 127); or DeepGEMM's packed I32
 * (rows, ceil(blocks / 4)), four exponent bytes per element, block 4i + j in
 * byte j (little end first). s is checked to have e's leading dimensions.
 * NULL (st set) when the form is none of these. */
static float *scales_as_f32(const moe_st_file *cand, const moe_st_entry *e, const moe_st_entry *s,
                            int64_t rows, int64_t blocks, moe_status *st)
{
    const int64_t packed = (blocks + 3) / 4;
    const int64_t last = s ? s->shape[s->ndim - 1] : -1;
    bool same = s && s->ndim == e->ndim &&
                ((s->dtype == MOE_ST_F32 && last == blocks) || (s->dtype == MOE_ST_U8 && last == blocks) ||
                 (s->dtype == MOE_ST_I32 && last == packed));
    for (int dim = 0; same && dim < e->ndim - 1; dim++)
        same = s->shape[dim] == e->shape[dim];
    if (!same) {
        moe_fail(st, MOE_EXIT_USAGE,
                 "candidate tensor '%s' is F8_E4M3 (%lld rows of %lld): it needs its scales as "
                 "'%s.scale' of its shape but for the last dimension: F32 or U8 UE8M0 exponents, "
                 "%lld (one per block of 128), or I32 packed UE8M0, %lld",
                 e->name, (long long)rows, (long long)e->shape[e->ndim - 1], e->name, (long long)blocks,
                 (long long)packed);
        return NULL;
    }
    uint8_t *raw = moe_xmalloc((size_t)(s->end - s->begin) + 1);
    if (moe_st_read(cand, s, raw, st)) {
        free(raw);
        return NULL;
    }
    float *scales = moe_xmalloc(sizeof(float) * (size_t)(rows * blocks) + 1);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t b = 0; b < blocks; b++) {
            float *to = scales + i * blocks + b;
            if (s->dtype == MOE_ST_F32)
                memcpy(to, raw + 4 * (i * blocks + b), sizeof(float));
            else /* an exponent byte: U8 at (i, b), or byte b % 4 of packed element (i, b / 4) */
                *to = ldexpf(1.0f, (s->dtype == MOE_ST_U8 ? raw[i * blocks + b]
                                                           : raw[4 * (i * packed + b / 4) + b % 4]) - 127);
        }
    free(raw);
    return scales;
}

/* Whether a candidate scale tensor e holds the golden F32 scales in an
 * exponent form of scales_as_f32 (U8 of the same shape, or packed I32). */
static bool exponent_scales(const moe_st_entry *e, const moe_st_entry *golden)
{
    const size_t len = strlen(e->name);
    if (len < 6 || strcmp(e->name + len - 6, ".scale") || golden->dtype != MOE_ST_F32 ||
        golden->ndim != e->ndim || e->ndim < 1 || (e->dtype != MOE_ST_U8 && e->dtype != MOE_ST_I32))
        return false;
    const int last = e->ndim - 1;
    bool same = e->shape[last] == (e->dtype == MOE_ST_U8 ? golden->shape[last] : (golden->shape[last] + 3) / 4);
    for (int dim = 0; same && dim < last; dim++)
        same = e->shape[dim] == golden->shape[dim];
    return same;
}

/* An expert weight in --dtype fp8's blocks (experts.w1.fp8, shared.w2.fp8,
 * ...: (count, R, C) E4M3 bytes beside F32 scales (count, SR, ceil(C/128)),
 * one per 128 x 128 block, W1's gate and up projections each blocked from
 * their first row): SR, or 0 when name is not one. */
static int64_t weight_block_rows(const char *name, const int64_t *shape, int ndim)
{
    const size_t len = strlen(name);
    const bool w1 = len > 7 && !strcmp(name + len - 7, ".w1.fp8");
    const bool w2 = len > 7 && !strcmp(name + len - 7, ".w2.fp8");
    if (ndim != 3 || !(w1 || w2))
        return 0;
    return w1 ? 2 * ((shape[1] / 2 + MOE_FP8_BLOCK - 1) / MOE_FP8_BLOCK)
              : (shape[1] + MOE_FP8_BLOCK - 1) / MOE_FP8_BLOCK;
}

/* Such a weight's block scales as one scale per row's block of 128 (count
 * R, blocks), the form the decoders below read; NULL (st set) when the
 * scale tensor is not F32 (count, SR, blocks). */
static float *weight_scales_by_row(const char *name, const int64_t *shape, const moe_st_entry *s,
                                   const float *block, int64_t SR, int64_t blocks, moe_status *st)
{
    const int64_t count = shape[0], R = shape[1];
    if (!s || s->dtype != MOE_ST_F32 || s->ndim != 3 || s->shape[0] != count || s->shape[1] != SR ||
        s->shape[2] != blocks) {
        moe_fail(st, MOE_EXIT_USAGE,
                 "'%s.scale' must be F32 (%lld, %lld, %lld): one scale per 128 x 128 block of '%s'",
                 name, (long long)count, (long long)SR, (long long)blocks, name);
        return NULL;
    }
    const bool w1 = strstr(name, ".w1.fp8") != NULL;
    const int64_t half = R / 2, first_up = (half + MOE_FP8_BLOCK - 1) / MOE_FP8_BLOCK;
    float *rows = moe_xmalloc(sizeof(float) * (size_t)(count * R * blocks) + 1);
    for (int64_t e = 0; e < count; e++)
        for (int64_t r = 0; r < R; r++) {
            const int64_t br = w1 && r >= half ? first_up + (r - half) / MOE_FP8_BLOCK : r / MOE_FP8_BLOCK;
            memcpy(rows + (e * R + r) * blocks, block + (e * SR + br) * blocks, sizeof(float) * (size_t)blocks);
        }
    return rows;
}

/* An F8_E4M3 candidate tensor name (rows, d) as F32 values: each byte's
 * value times its block's scale from the candidate's "name.scale" (rows,
 * ceil(d/128)) in one of scales_as_f32's forms, as DeepEP and DeepGEMM ship
 * them. NULL (st set) when the scales are missing or of another shape. */
static float *fp8_with_scales(const moe_st_file *cand, const moe_st_entry *e, const void *bytes,
                              moe_status *st)
{
    char name[MOE_ST_NAME_MAX + 8];
    snprintf(name, sizeof name, "%s.scale", e->name);
    /* rows: every dimension but the last ((rows, d), or the masked layout's (EL, C, d)) */
    const int64_t width = e->ndim >= 2 ? e->shape[e->ndim - 1] : 0;
    const int64_t rows = width ? moe_st_elements(e->ndim, e->shape) / width : 0;
    const int64_t blocks = (width + MOE_FP8_BLOCK - 1) / MOE_FP8_BLOCK;
    const int64_t SR = weight_block_rows(e->name, e->shape, e->ndim);
    float *scales = NULL;
    if (SR) { /* an expert weight: 128 x 128 blocks */
        const moe_st_entry *s = moe_st_find(cand, name);
        float *block = s && s->dtype == MOE_ST_F32 ? moe_xmalloc((size_t)(s->end - s->begin) + 1) : NULL;
        if (block && moe_st_read(cand, s, block, st)) {
            free(block);
            return NULL;
        }
        scales = weight_scales_by_row(e->name, e->shape, s, block, SR, blocks, st);
        free(block);
    } else {
        scales = e->ndim >= 2 ? scales_as_f32(cand, e, moe_st_find(cand, name), rows, blocks, st)
                              : scales_as_f32(cand, e, NULL, rows, blocks, st);
    }
    if (!scales)
        return NULL;
    float *values = moe_xmalloc(sizeof(float) * (size_t)(rows * width) + 1);
    const float *e4m3 = e4m3_table();
    const uint8_t *q = bytes;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < width; j++)
            values[i * width + j] = e4m3[q[i * width + j]] * scales[i * blocks + j / MOE_FP8_BLOCK];
    free(scales);
    return values;
}

/* A golden tensor stored as it travelled, F8_E4M3 bytes, as F32 values:
 * each byte's value times its block's scale from the set's NAME.scale. */
static void *golden_fp8_values(const verify_run *v, const char *name, moe_st_entry *entry, void *bytes,
                               moe_status *st)
{
    char scale_name[2 * MOE_ST_NAME_MAX];
    snprintf(scale_name, sizeof scale_name, "%s.scale", name);
    moe_st_entry s_entry;
    float *scales = load_golden(v, scale_name, &s_entry, st);
    const int64_t width = entry->ndim >= 2 ? entry->shape[entry->ndim - 1] : 0;
    const int64_t rows = width ? moe_st_elements(entry->ndim, entry->shape) / width : 0;
    const int64_t blocks = (width + MOE_FP8_BLOCK - 1) / MOE_FP8_BLOCK;
    const int64_t SR = weight_block_rows(name, entry->shape, entry->ndim);
    if (scales && SR) { /* an expert weight: its 128 x 128 blocks' scales, one per row's block */
        float *by_row = weight_scales_by_row(name, entry->shape, &s_entry, scales, SR, blocks, st);
        free(scales);
        scales = by_row;
    } else if (scales && (s_entry.dtype != MOE_ST_F32 || moe_st_elements(s_entry.ndim, s_entry.shape) != rows * blocks)) {
        moe_fail(st, MOE_EXIT_USAGE, "golden tensor '%s' is not the F32 scales, (rows, %lld), of F8_E4M3 '%s'",
                 scale_name, (long long)blocks, name);
        free(scales);
        scales = NULL;
    }
    float *values = scales ? moe_xmalloc(sizeof(float) * (size_t)(rows * width) + 1) : NULL;
    const float *e4m3 = e4m3_table();
    const uint8_t *q = bytes;
    for (int64_t i = 0; values && i < rows; i++)
        for (int64_t j = 0; j < width; j++)
            values[i * width + j] = e4m3[q[i * width + j]] * scales[i * blocks + j / MOE_FP8_BLOCK];
    free(scales);
    free(bytes);
    if (values)
        entry->dtype = MOE_ST_F32;
    return values;
}

/* The golden values of a candidate tensor that the manifest does not list
 * under its name but DeepEP's conventions use (per source rank r):
 *   layout.rank{r}.tokens_per_rank   (G)     row r of layout.send_counts
 *   layout.rank{r}.is_token_in_rank  (T, G)  rows r*T .. of layout.is_token_in_rank
 *   layout.rank{r}.tokens_per_expert (E)     rank r's tokens' (token, expert) pairs
 * NULL when the name is none of these. */
static void *convention_golden(const verify_run *v, const char *name, moe_st_entry *entry)
{
    int r;
    char what[64];
    if (sscanf(name, "layout.rank%d.%63s", &r, what) != 2)
        return NULL;
    const int G = (int)v->ranks;
    moe_status ignored = {0};
    moe_st_entry src;
    void *out = NULL;
    memset(entry, 0, sizeof *entry);
    snprintf(entry->name, sizeof entry->name, "%s", name);
    if (G <= 0 || r < 0 || r >= G)
        return NULL;
    if (!strcmp(what, "tokens_per_rank")) {
        int32_t *counts = load_golden(v, "layout.send_counts", &src, &ignored);
        if (counts && src.ndim == 2 && src.shape[0] == G && src.shape[1] == G) {
            out = moe_xmalloc(sizeof(int32_t) * (size_t)G);
            memcpy(out, counts + (size_t)r * (size_t)G, sizeof(int32_t) * (size_t)G);
            *entry = (moe_st_entry){.dtype = MOE_ST_I32, .ndim = 1, .shape = {G}};
        }
        free(counts);
    } else if (!strcmp(what, "is_token_in_rank")) {
        uint8_t *in = load_golden(v, "layout.is_token_in_rank", &src, &ignored);
        if (in && src.ndim == 2 && src.shape[1] == G && src.shape[0] % G == 0) {
            const int64_t T = src.shape[0] / G;
            out = moe_xmalloc((size_t)(T * G) + 1);
            memcpy(out, in + (size_t)(r * T * G), (size_t)(T * G));
            *entry = (moe_st_entry){.dtype = MOE_ST_BOOL, .ndim = 2, .shape = {T, G}};
        }
        free(in);
    } else if (!strcmp(what, "tokens_per_expert")) {
        int32_t *ids = load_golden(v, "router.topk_ids", &src, &ignored);
        const int64_t E = v->experts_config;
        if (ids && E > 0 && src.ndim == 2 && src.shape[0] % G == 0) {
            const int64_t T = src.shape[0] / G, k = src.shape[1];
            int32_t *count = moe_xcalloc((size_t)E, sizeof(int32_t));
            for (int64_t n = r * T * k; n < (r + 1) * T * k; n++)
                if (ids[n] >= 0 && ids[n] < E)
                    count[ids[n]]++;
            out = count;
            *entry = (moe_st_entry){.dtype = MOE_ST_I32, .ndim = 1, .shape = {E}};
        }
        free(ids);
    }
    snprintf(entry->name, sizeof entry->name, "%s", name);
    return out;
}

/* experts.rank{r}.out in another row order (expert-major, as grouped GEMMs
 * lay it out) with experts.rank{r}.row (rows) beside it, any integer dtype:
 * candidate row i is golden row row[i]. Returns the rows in golden order (a
 * new buffer of F32), or NULL with why set when row is not a permutation. */
static float *golden_order(const moe_st_file *cand, const moe_st_entry *e, const void *got,
                           const moe_st_entry *perm_entry, char *why, size_t size)
{
    const int64_t rows = e->shape[0], width = e->ndim == 2 ? e->shape[1] : 1;
    if (perm_entry->ndim != 1 || perm_entry->shape[0] != rows || !moe_st_dtype_is_integer(perm_entry->dtype)) {
        snprintf(why, size, "%s must be (%lld) integers, one golden row per candidate row",
                 perm_entry->name, (long long)rows);
        return NULL;
    }
    moe_status st = {0};
    void *perm = moe_xmalloc((size_t)(perm_entry->end - perm_entry->begin) + 1);
    float *out = moe_xmalloc(sizeof(float) * (size_t)(rows * width) + 1);
    uint8_t *seen = moe_xcalloc((size_t)rows + 1, 1);
    bool ok = moe_st_read(cand, perm_entry, perm, &st) == MOE_EXIT_OK;
    for (int64_t i = 0; ok && i < rows; i++) {
        const double to = moe_st_element(perm, perm_entry->dtype, i);
        ok = to >= 0 && to < (double)rows && !seen[(int64_t)to];
        if (!ok) {
            snprintf(why, size, "%s is not a permutation of the %lld golden rows (row %lld: %.0f)",
                     perm_entry->name, (long long)rows, (long long)i, to);
            break;
        }
        seen[(int64_t)to] = 1;
        for (int64_t j = 0; j < width; j++)
            out[(int64_t)to * width + j] = (float)moe_st_element(got, e->dtype, i * width + j);
    }
    free(seen);
    free(perm);
    if (!ok) {
        free(out);
        return NULL;
    }
    return out;
}

/* The evidence under a failing tensor's row: the first bad element's
 * values, and what it stands for where the set says (a token's top-k, an
 * expert output's (token, expert) pair). */
static void explain_mismatch(const verify_run *v, const char *name, const moe_st_entry *golden,
                             const void *ref, const moe_st_entry *cand, const void *got, int64_t first)
{
    FILE *out = v->out;
    moe_status ignored = {0};
    const int64_t width = golden->ndim > 1 ? golden->shape[golden->ndim - 1] : 1;
    const int64_t row = first / width;
    if (!strcmp(name, "router.topk_ids")) {
        moe_st_entry w_entry;
        float *w = load_golden(v, "router.topk_weights", &w_entry, &ignored);
        fprintf(out, "%-28s token %lld: golden ids", "", (long long)row);
        for (int64_t s = 0; s < width; s++)
            fprintf(out, " %d", ((const int32_t *)ref)[row * width + s]);
        if (w) {
            fprintf(out, " (weights");
            for (int64_t s = 0; s < width; s++)
                fprintf(out, " %.6g", w[row * width + s]);
            fprintf(out, ")");
        }
        fprintf(out, ", candidate ids");
        for (int64_t s = 0; s < width; s++)
            fprintf(out, " %.0f", moe_st_element(got, cand->dtype, row * width + s));
        fprintf(out, "\n");
        free(w);
        return;
    }
    fprintf(out, "%-28s golden %.9g, candidate %.9g", "", moe_st_element(ref, golden->dtype, first),
            moe_st_element(got, cand->dtype, first));
    int rank;
    if (sscanf(name, "experts.rank%d.out", &rank) == 1) {
        char pair_name[MOE_ST_NAME_MAX];
        snprintf(pair_name, sizeof pair_name, "experts.rank%d.pair", rank);
        moe_st_entry p_entry;
        int32_t *pair = load_golden(v, pair_name, &p_entry, &ignored);
        if (pair && row < p_entry.shape[0])
            fprintf(out, " at (token %d, expert %d), column %lld", pair[2 * row], pair[2 * row + 1],
                    (long long)(first % width));
        free(pair);
    }
    fprintf(out, "\n");
}


/* For a tensor after the router whose rows are tokens: which of its rows
 * belong to tied tokens (NULL: its rows are not tokens, e.g. counts). */
static uint8_t *tied_rows(verify_run *v, const char *name, int64_t rows)
{
    int r;
    char golden_name[MOE_ST_NAME_MAX + 8], file[32];
    int64_t width = 1;
    moe_status ignored = {0};
    moe_st_entry entry;
    int32_t *token = NULL;
    if (!strncmp(name, "output.", 7) || !strcmp(name, "layout.is_token_in_rank") ||
        !strcmp(name, "layout.kept_ids") || !strcmp(name, "layout.physical_ids")) {
        uint8_t *skip = moe_xcalloc((size_t)rows + 1, 1);
        for (int64_t i = 0; i < rows && i < v->tokens; i++)
            skip[i] = v->tied[i];
        return skip;
    }
    int used = -1;
    /* The layout tensors' slots move when a tied token's experts change:
     * their differences are not counted (as the counts'). */
    if (sscanf(name, "dispatch.rank%d.layout.%n", &r, &used) == 1 && used > 0)
        return NULL;
    used = -1;
    const bool sums = sscanf(name, "experts.rank%d.sum%n", &r, &used) == 1 && used == (int)strlen(name);
    if (sscanf(name, "dispatch.rank%d.", &r) == 1 || sums) { /* a sum's rows are the received rows */
        snprintf(golden_name, sizeof golden_name, "dispatch.rank%d.token", r);
        snprintf(file, sizeof file, "dispatch.safetensors");
    } else if (sscanf(name, "experts.node%d.", &r) == 1) { /* a relay sum's rows are the node's tokens */
        snprintf(golden_name, sizeof golden_name, "experts.node%d.token", r);
        snprintf(file, sizeof file, "experts.safetensors");
    } else if (sscanf(name, "experts.rank%d.", &r) == 1) {
        snprintf(golden_name, sizeof golden_name, "experts.rank%d.pair", r);
        snprintf(file, sizeof file, "experts.safetensors");
        width = 2; /* (token, expert) */
    } else {
        return NULL;
    }
    token = load_golden(v, golden_name, &entry, &ignored);
    if (!token || entry.shape[0] != rows) {
        free(token);
        return NULL;
    }
    uint8_t *skip = moe_xcalloc((size_t)rows + 1, 1);
    for (int64_t i = 0; i < rows; i++) {
        const int64_t t = token[i * width];
        skip[i] = t >= 0 && t < v->tokens && v->tied[t];
    }
    free(token);
    return skip;
}

/* Both ids, or both values. */
static bool same_kind_of(const moe_st_entry *golden, const moe_st_entry *cand)
{
    return moe_st_dtype_is_integer(golden->dtype) == moe_st_dtype_is_integer(cand->dtype);
}

static void fail_stage(verify_run *v, int stage)
{
    if (stage < v->first_failing)
        v->first_failing = stage;
    v->result.failed[stage]++;
}

/* Companions of a candidate tensor, read with it rather than on their own:
 * the scales of an F8 tensor it holds, the row order of its expert outputs,
 * and DeepEP's per-rank layout (compared in the layout stage under derived
 * golden values). */
static bool companion_name(const verify_run *v, const char *name)
{
    const size_t len = strlen(name);
    char base[MOE_ST_NAME_MAX + 8], what[64];
    int r, end = -1;
    if (len > 6 && !strcmp(name + len - 6, ".scale")) {
        snprintf(base, sizeof base, "%.*s", (int)(len - 6), name);
        const moe_st_entry *e = moe_st_find(&v->cand, base);
        return e && e->dtype == MOE_ST_F8_E4M3;
    }
    if (sscanf(name, "experts.rank%d.row%n", &r, &end) == 1 && end == (int)len) {
        snprintf(base, sizeof base, "experts.rank%d.out", r);
        return moe_st_find(&v->cand, base) != NULL;
    }
    end = -1;
    if (sscanf(name, "dispatch.rank%d.layout.range%n", &r, &end) == 1 && end == (int)len) {
        snprintf(base, sizeof base, "dispatch.rank%d.layout.src", r);
        return moe_st_find(&v->cand, base) != NULL;
    }
    return sscanf(name, "layout.rank%d.%63s", &r, what) == 2 && r >= 0 && r < v->ranks &&
           (!strcmp(what, "tokens_per_rank") || !strcmp(what, "is_token_in_rank") ||
            !strcmp(what, "tokens_per_expert"));
}

/* Edit distance of two names (at most MOE_ST_NAME_MAX characters). */
static int edit_distance(const char *a, const char *b)
{
    int row[MOE_ST_NAME_MAX + 2];
    const int n = (int)strnlen(b, MOE_ST_NAME_MAX);
    for (int j = 0; j <= n; j++)
        row[j] = j;
    for (int i = 1; a[i - 1] && i <= MOE_ST_NAME_MAX; i++) {
        int diagonal = row[0];
        row[0] = i;
        for (int j = 1; j <= n; j++) {
            const int above = row[j];
            const int best = diagonal + (a[i - 1] != b[j - 1]);
            row[j] = best < above + 1 ? best : above + 1;
            row[j] = row[j] < row[j - 1] + 1 ? row[j] : row[j - 1] + 1;
            diagonal = above;
        }
    }
    return row[n];
}

/* A candidate tensor the set does not name is refused (a misspelt name
 * would otherwise pass unchecked), unless options allow it: one line
 * naming it and the nearest name the set has. */
static int check_names(const verify_run *v, const char *candidate, moe_status *st)
{
    int unknown = 0;
    const char *first = NULL;
    for (int n = 0; n < v->cand.count; n++) {
        const char *name = v->cand.entries[n].name;
        if (!json_object_get(v->tensors, name) && !companion_name(v, name) && unknown++ == 0)
            first = name;
    }
    if (!unknown || v->opt.allow_unknown)
        return MOE_EXIT_OK;
    const char *key, *nearest = "";
    json_t *value;
    int best = INT_MAX;
    json_object_foreach(v->tensors, key, value) {
        const int distance = edit_distance(first, key);
        if (distance < best)
            best = distance, nearest = key;
    }
    return moe_fail(st, MOE_EXIT_USAGE,
                    "'%s' holds %d tensor%s the golden set does not name, the first '%s' (nearest: "
                    "'%s'); --allow-unknown ignores them", candidate, unknown, unknown == 1 ? "" : "s",
                    first, nearest);
}

/* The masked layout as a kernel fills it (DeepEP's low-latency receive
 * buffer): each expert's slots [0, count) in arrival order, source blocks
 * in any order and in any order within them, slots past count as they
 * were. The candidate's own dispatch.rank{r}.layout.src names each slot's
 * token: a global id, or, with dispatch.rank{r}.layout.range beside it
 * (EL, G) I64, DeepEP's index within the source rank, the source rank s
 * the one whose range (begin in the high 32 bits, count in the low) holds
 * the slot. Returns, per golden slot (EL * C), the candidate slot (of the
 * EL * C) holding its token (-1: none), or NULL when the candidate has no such src or its
 * order is impossible (a line says which; the dispatch stage fails). */
static int32_t *arrival_order(verify_run *v, int r)
{
    char name[MOE_ST_NAME_MAX];
    moe_status ignored = {0};
    moe_st_entry golden;
    snprintf(name, sizeof name, "dispatch.rank%d.layout.src", r);
    const moe_st_entry *src_entry = moe_st_find(&v->cand, name);
    const char *layout = json_string_value(json_object_get(json_object_get(v->manifest, "config"), "expert-layout"));
    if (!src_entry || !layout || strcmp(layout, "masked") || src_entry->ndim != 2 ||
        !moe_st_dtype_is_integer(src_entry->dtype))
        return NULL;
    int32_t *gsrc = load_golden(v, name, &golden, &ignored);
    if (!gsrc || golden.ndim != 2 || golden.shape[0] != src_entry->shape[0] || golden.shape[1] != src_entry->shape[1]) {
        free(gsrc);
        return NULL;
    }
    const int64_t EL = golden.shape[0], C = golden.shape[1], T = v->config_tokens, G = v->ranks;
    void *csrc = moe_xmalloc((size_t)(src_entry->end - src_entry->begin) + 1);
    snprintf(name, sizeof name, "dispatch.rank%d.layout.count", r);
    const moe_st_entry *count_entry = moe_st_find(&v->cand, name);
    void *count = NULL, *range = NULL;
    if (count_entry && count_entry->ndim == 1 && count_entry->shape[0] == EL && moe_st_dtype_is_integer(count_entry->dtype)) {
        count = moe_xmalloc((size_t)(count_entry->end - count_entry->begin) + 1);
        moe_st_read(&v->cand, count_entry, count, &ignored);
    }
    snprintf(name, sizeof name, "dispatch.rank%d.layout.range", r);
    const moe_st_entry *range_entry = moe_st_find(&v->cand, name);
    char why[200] = "";
    if (range_entry && (range_entry->ndim != 2 || range_entry->shape[0] != EL || range_entry->shape[1] != G ||
                        range_entry->dtype != MOE_ST_I64))
        snprintf(why, sizeof why, "%s must be (%lld, %lld) I64, DeepEP's packed_recv_layout_range", name,
                 (long long)EL, (long long)G);
    else if (range_entry)
        range = moe_xmalloc((size_t)(range_entry->end - range_entry->begin) + 1);
    if (moe_st_read(&v->cand, src_entry, csrc, &ignored) || (range && moe_st_read(&v->cand, range_entry, range, &ignored)))
        snprintf(why, sizeof why, "the candidate's layout tensors cannot be read");
    int32_t *from = moe_xmalloc(sizeof(int32_t) * (size_t)(EL * C) + 1);
    int32_t *where = moe_xmalloc(sizeof(int32_t) * (size_t)(G * T) + 1); /* golden slot of a token, this expert */
    for (int64_t e = 0; e < EL && !*why; e++) {
        for (int64_t t = 0; t < G * T; t++)
            where[t] = -1;
        for (int64_t c = 0; c < C; c++) {
            from[e * C + c] = -1;
            const int32_t t = gsrc[e * C + c];
            if (t >= 0 && t < G * T)
                where[t] = (int32_t)c;
        }
        const int64_t filled = count ? (int64_t)moe_st_element(count, count_entry->dtype, e) : C;
        if (filled < 0 || filled > C) { /* the count first: the slots past C do not exist */
            snprintf(why, sizeof why, "expert %lld: layout.count %lld is outside [0, %lld], the "
                     "expert's slots", (long long)e, (long long)filled, (long long)C);
            break;
        }
        for (int64_t c = 0; c < filled && !*why; c++) {
            int64_t id = (int64_t)moe_st_element(csrc, src_entry->dtype, e * C + c), source = -1;
            if (!count && id < 0)
                continue; /* without counts, -1 marks an empty slot */
            for (int64_t s = 0; range && s < G && source < 0; s++) {
                const int64_t packed = (int64_t)((const int64_t *)range)[e * G + s];
                const int64_t begin = packed >> 32, n = packed & 0xffffffff;
                if (c >= begin && c < begin + n)
                    source = s;
            }
            if (range && (source < 0 || id < 0 || id >= T))
                snprintf(why, sizeof why, "expert %lld slot %lld: %s", (long long)e, (long long)c,
                         source < 0 ? "no source rank's range holds it" : "its source index is outside [0, T)");
            id = range ? source * T + id : id;
            if (!*why && (id < 0 || id >= G * T))
                snprintf(why, sizeof why, "expert %lld slot %lld holds token %lld, outside [0, %lld)",
                         (long long)e, (long long)c, (long long)id, (long long)(G * T));
            if (*why || where[id] < 0)
                continue; /* a token the golden does not send here: src differs below */
            if (from[e * C + where[id]] >= 0)
                snprintf(why, sizeof why, "expert %lld holds token %lld twice (slots %lld and %lld)", (long long)e,
                         (long long)id, (long long)(from[e * C + where[id]] - e * C), (long long)c);
            from[e * C + where[id]] = (int32_t)(e * C + c);
        }
    }
    free(where);
    free(range);
    free(count);
    free(csrc);
    free(gsrc);
    if (*why) {
        fprintf(v->out, "%-28s %-9s FAIL: %s\n", src_entry->name, "dispatch", why);
        fail_stage(v, MOE_GOLDEN_DISPATCH);
        free(from);
        return NULL;
    }
    return from;
}

/* A masked layout tensor (EL, C, width) in golden slot order by `from`: a
 * golden slot no candidate slot holds takes the golden's value where the
 * golden slot is empty (nothing to compare) and -1 or NaN where it is not
 * (a token missing). src becomes global ids. */
static void *in_arrival_order(const verify_run *v, int r, const int32_t *from, const moe_st_entry *as,
                              const void *got, bool src)
{
    char name[MOE_ST_NAME_MAX];
    moe_status ignored = {0};
    moe_st_entry golden;
    snprintf(name, sizeof name, "dispatch.rank%d.layout.src", r);
    int32_t *gsrc = load_golden(v, name, &golden, &ignored);
    const int64_t slots = golden.shape[0] * golden.shape[1];
    const int64_t width = slots ? moe_st_elements(as->ndim, as->shape) / slots : 0;
    float *out = moe_xmalloc(sizeof(float) * (size_t)(slots * width) + 1);
    for (int64_t g = 0; g < slots; g++)
        for (int64_t j = 0; j < width; j++) {
            float value = gsrc[g] < 0 ? (src ? -1.0f : 0.0f) : src ? -1.0f : NAN; /* empty; missing */
            if (from[g] >= 0) /* the slot holds the golden's token: its id, or its values */
                value = src ? (float)gsrc[g] : (float)element(got, as->dtype, from[g] * width + j);
            out[g * width + j] = value;
        }
    free(gsrc);
    return out;
}

/* A masked layout tensor of rank r (x, x.scale, src) put in golden slot
 * order when the candidate's src gives another (arrival_order). */
static int arrival_values(verify_run *v, const char *name, moe_st_entry *as, void **got)
{
    int r, end = -1;
    char what[16] = "";
    if (sscanf(name, "dispatch.rank%d.layout.%15[a-z.]%n", &r, what, &end) != 2 || end != (int)strlen(name) ||
        r < 0 || r >= v->ranks || (strcmp(what, "x") && strcmp(what, "x.scale") && strcmp(what, "src")))
        return MOE_EXIT_OK;
    if (!v->arrival) {
        v->arrival = moe_xcalloc((size_t)v->ranks, sizeof(int32_t *));
        v->arrival_done = moe_xcalloc((size_t)v->ranks, 1);
    }
    if (!v->arrival_done[r]) {
        v->arrival[r] = arrival_order(v, r);
        v->arrival_done[r] = 1;
    }
    if (!v->arrival[r])
        return MOE_EXIT_OK;
    void *ordered = in_arrival_order(v, r, v->arrival[r], as, *got, !strcmp(what, "src"));
    free(*got);
    *got = ordered;
    as->dtype = MOE_ST_F32;
    return MOE_EXIT_OK;
}

/* The candidate's top-k weights in the golden's slot order (compare_ids
 * matched each token's experts as a set): F32. A masked pair's weight is
 * used by nothing (and its -1 matches any of the token's -1s): the golden
 * one stands in for it. */
static int weights_in_golden_order(const verify_run *v, moe_st_entry *as, void **got)
{
    const int64_t count = moe_st_elements(as->ndim, as->shape);
    if (count != v->topk_count)
        return MOE_EXIT_OK; /* comparable() has said the shapes differ */
    float *ordered = moe_xmalloc(sizeof(float) * (size_t)count + 1);
    const int64_t k = as->shape[as->ndim - 1];
    moe_status ignored = {0};
    moe_st_entry golden;
    const float *unused = v->masked ? load_golden(v, "router.topk_weights", &golden, &ignored) : NULL;
    for (int64_t i = 0; i < count; i++)
        ordered[i] = unused && v->masked[i] ? unused[i]
                                            : (float)moe_st_element(*got, as->dtype, i - i % k + v->slot_of[i]);
    free((void *)unused);
    free(*got);
    *got = ordered;
    as->dtype = MOE_ST_F32;
    return MOE_EXIT_OK;
}

/* The candidate's values of e as compared: read, F8_E4M3 with its scales
 * made F32, a scale tensor in another form made F32, the top-k weights in
 * the golden's slot order when the ids came in another, rows put in golden
 * order when a row order comes with them.
 * *as describes them. Returns MOE_EXIT_OK, MOE_EXIT_CHECK_FAILED (the
 * tensor's stage failed; printed) or another code with st set. */
static int candidate_values(verify_run *v, const moe_st_entry *e, const moe_st_entry *golden,
                            const char *stage_name, int stage, void **got, moe_st_entry *as,
                            moe_status *st)
{
    *as = *e;
    if (exponent_scales(e, golden)) {
        const int64_t blocks = golden->shape[golden->ndim - 1];
        *got = scales_as_f32(&v->cand, golden, e, blocks ? moe_st_elements(golden->ndim, golden->shape) / blocks : 0,
                             blocks, st);
        *as = *golden;
        if (!*got)
            return st->code;
        return arrival_values(v, e->name, as, got);
    }
    *got = moe_xmalloc((size_t)(e->end - e->begin) + 1);
    if (moe_st_read(&v->cand, e, *got, st))
        return st->code;
    if (e->dtype == MOE_ST_F8_E4M3) {
        float *values = fp8_with_scales(&v->cand, e, *got, st);
        free(*got);
        *got = values;
        if (!values)
            return st->code;
        as->dtype = MOE_ST_F32;
    }
    int r, end = -1;
    char perm_name[MOE_ST_NAME_MAX + 8];
    const moe_st_entry *perm = NULL;
    if (v->slot_of && !strcmp(e->name, "router.topk_weights"))
        return weights_in_golden_order(v, as, got);
    if (!strncmp(e->name, "dispatch.rank", 13))
        return arrival_values(v, e->name, as, got);
    if (sscanf(e->name, "experts.rank%d.out%n", &r, &end) == 1 && end == (int)strlen(e->name)) {
        snprintf(perm_name, sizeof perm_name, "experts.rank%d.row", r);
        perm = moe_st_find(&v->cand, perm_name);
    }
    if (!perm)
        return MOE_EXIT_OK;
    char why[256];
    float *ordered = golden_order(&v->cand, as, *got, perm, why, sizeof why);
    free(*got);
    *got = ordered;
    as->dtype = MOE_ST_F32;
    if (ordered)
        return MOE_EXIT_OK;
    fprintf(v->out, "%-28s %-9s FAIL: %s\n", e->name, stage_name, why);
    fail_stage(v, stage);
    return MOE_EXIT_CHECK_FAILED;
}

/* The per-element allowance a tolerance tensor's manifest entry names, or
 * NULL (*failed false) without one. */
static double *load_allowance(verify_run *v, json_t *info, const char *name, int64_t count,
                              bool *failed, moe_status *st)
{
    const char *allow_name = json_string_value(json_object_get(info, "allow"));
    *failed = false;
    if (!allow_name)
        return NULL;
    moe_st_entry entry;
    double *allow = load_golden(v, allow_name, &entry, st);
    if (allow && (entry.dtype != MOE_ST_F64 || moe_st_elements(entry.ndim, entry.shape) != count)) {
        free(allow);
        allow = NULL;
        moe_fail(st, MOE_EXIT_USAGE, "golden tensor '%s' is not an F64 allowance of %lld elements for '%s'",
                 allow_name, (long long)count, name);
    }
    *failed = allow == NULL;
    return allow;
}

/* Candidate tensor e against its golden tensor, if it belongs to `stage`:
 * one line of the table (and the evidence under a failure). Returns
 * MOE_EXIT_OK, or the code of a file that could not be read (st set). */
/* Whether e has the golden tensor's shape and kind of values; if not, the
 * line that says why, and its stage failed unless near-ties explain it. */
static bool comparable(verify_run *v, const moe_st_entry *e, const moe_st_entry *golden, int stage,
                       const char *stage_name)
{
    bool same_shape = golden->ndim == e->ndim;
    for (int dim = 0; same_shape && dim < e->ndim; dim++)
        same_shape = golden->shape[dim] == e->shape[dim];
    if ((same_shape && moe_st_dtype_is_integer(golden->dtype) == moe_st_dtype_is_integer(e->dtype)) ||
        exponent_scales(e, golden))
        return true;
    char cshape[96], gshape[96];
    shape_text(e->ndim, e->shape, cshape, sizeof cshape);
    shape_text(golden->ndim, golden->shape, gshape, sizeof gshape);
    if (v->first_failing < stage)
        fprintf(v->out, "%-28s %-9s not compared: %s differs upstream (candidate %s %s, golden %s %s)\n",
                e->name, stage_name, moe_golden_stage_names[v->first_failing],
                moe_st_dtype_name(e->dtype), cshape, moe_st_dtype_name(golden->dtype), gshape);
    else if (v->tied_count > 0 && same_kind_of(golden, e))
        fprintf(v->out, "%-28s %-9s not compared: %lld tokens routed differently at near-ties change its "
                        "shape (candidate %s, golden %s)\n",
                e->name, stage_name, (long long)v->tied_count, cshape, gshape);
    else
        fprintf(v->out, "%-28s %-9s FAIL: candidate %s %s, golden %s %s\n", e->name, stage_name,
                moe_st_dtype_name(e->dtype), cshape, moe_st_dtype_name(golden->dtype), gshape);
    if (!(v->tied_count > 0 && same_kind_of(golden, e)))
        fail_stage(v, stage);
    return false;
}

/* The top-k ids against the golden's: exact, or different only at
 * near-ties (the tokens so tied are remembered: their rows are left out
 * downstream). A golden id outside [-1, E) is a usage error (-1: a pair
 * masked in a replayed routing, which a candidate matches with -1). */
static int compare_ids(verify_run *v, const moe_st_entry *e, const void *ref, const void *got,
                       const moe_st_entry *as, int64_t count, verdict *result, moe_status *st)
{
    const int k = (int)e->shape[e->ndim - 1];
    for (int64_t i = 0; i < count; i++)
        if (((const int32_t *)ref)[i] < -1 || ((const int32_t *)ref)[i] >= v->experts_config) {
            moe_fail(st, MOE_EXIT_USAGE, "golden tensor '%s' holds id %d, outside [-1, %lld)",
                     e->name, ((const int32_t *)ref)[i], (long long)v->experts_config);
            return st->code;
        }
    int32_t *ids = moe_xmalloc(sizeof(int32_t) * (size_t)count + 1); /* as the golden's I32 */
    for (int64_t i = 0; i < count; i++) {
        const double id = moe_st_element(got, as->dtype, i);
        ids[i] = id >= INT32_MIN && id <= INT32_MAX ? (int32_t)id : -1;
    }
    free(v->tied);
    free(v->slot_of);
    free(v->masked);
    v->masked = NULL;
    for (int64_t i = 0; i < count; i++)
        if (((const int32_t *)ref)[i] == -1) {
            if (!v->masked)
                v->masked = moe_xcalloc((size_t)count + 1, 1);
            v->masked[i] = 1;
        }
    v->tokens = k > 0 ? count / k : 0;
    v->tied = moe_xcalloc((size_t)v->tokens + 1, 1);
    v->slot_of = moe_xmalloc(sizeof(int32_t) * (size_t)count + 1);
    v->topk_count = count;
    compare_topk(ref, ids, count, k, v->selection, v->experts, v->sel_abs, v->sel_rel, v->tied,
                 v->slot_of, result);
    v->tied_count = 0;
    for (int64_t t = 0; t < v->tokens; t++)
        v->tied_count += v->tied[t];
    free(ids);
    return MOE_EXIT_OK;
}

/* The tensor's line of the table, the notes on near-ties and rows left
 * out, and on a difference the first element explained and its stage
 * failed. */
static void print_verdict(verify_run *v, const moe_st_entry *e, int stage, const char *stage_name,
                          const char *rule_text, enum moe_golden_rule rule, const verdict *result,
                          const uint8_t *skip, bool uncounted, const moe_st_entry *golden,
                          const void *ref, const moe_st_entry *as, const void *got)
{
    char where[64] = "", used[16];
    if (result->bad)
        index_text(result->first_bad, as->ndim, as->shape, where, sizeof where);
    snprintf(used, sizeof used, rule == MOE_RULE_TOLERANCE ? "%.1f" : "-", 100.0 * result->max_used);
    fprintf(v->out, "%-28s %-9s %-10s %11.3e %11.3e %8s %10lld  %s%s\n", e->name, stage_name,
            rule_text, result->max_abs, result->max_rel, used, (long long)result->bad,
            result->bad ? where : "-", result->near_ties ? " (near-ties accepted)" : "");
    if (result->near_ties)
        fprintf(v->out, "%-28s %lld top-k ids of %lld tokens differ only by near-ties; their rows "
                        "are left out downstream\n", "", (long long)result->near_ties, (long long)v->tied_count);
    if (skip) {
        int64_t left_out = 0;
        for (int64_t i = 0; i < e->shape[0]; i++)
            left_out += skip[i];
        if (left_out)
            fprintf(v->out, "%-28s %lld rows of tied tokens left out\n", "", (long long)left_out);
    }
    if (result->bad && uncounted)
        fprintf(v->out, "%-28s differs, but tokens routed differently at near-ties change it: not counted\n", "");
    if (result->bad && !uncounted) {
        explain_mismatch(v, e->name, golden, ref, as, got, result->first_bad);
        fail_stage(v, stage);
    }
}

/* P(|X - n/2| >= |m - n/2|) for X ~ Binomial(n, 1/2), m >= n/2: how likely
 * a split as uneven as (m, n - m) is when each of n differences goes
 * either way with even odds. */
static double binomial_two_sided(int64_t n, int64_t m)
{
    double tail = 0.0;
    for (int64_t i = m; i <= n; i++) {
        const double term = exp(lgamma((double)n + 1) - lgamma((double)i + 1) - lgamma((double)(n - i) + 1) -
                                (double)n * log(2.0));
        tail += term;
        if (term < 1e-30 * tail)
            break;
    }
    return fmin(1.0, 2.0 * tail);
}

/* Under a bf16 step contract: the elements one bf16 step from the golden
 * are allowed one by one, but a correct port lands on either neighbour
 * with even odds (its fp32 value differs from ours by a few units of u,
 * either way); a port that truncates, or rounds up, lands on one side
 * only. A split this uneven at p < MOE_GOLDEN_DIRECTION_P fails the stage. */
#define MOE_GOLDEN_DIRECTION_P 1e-6
static void explain_rounding(verify_run *v, const moe_st_entry *e, int stage, const verdict *result)
{
    const int64_t n = result->toward_zero + result->away;
    if (n == 0)
        return;
    const int64_t m = result->toward_zero > result->away ? result->toward_zero : result->away;
    const double p = binomial_two_sided(n, m);
    fprintf(v->out, "%-28s %lld elements one bf16 step from the golden (allowed): %lld toward zero, "
                    "%lld away\n", "", (long long)n, (long long)result->toward_zero, (long long)result->away);
    if (p >= MOE_GOLDEN_DIRECTION_P)
        return;
    fprintf(v->out, "%-28s FAIL: so uneven a split has p = %.1e where a correct port's roundings go "
                    "either way: the candidate rounds %s, not to nearest\n", e->name, p,
            result->toward_zero > result->away ? "toward zero (truncates)" : "away from zero");
    fail_stage(v, stage);
}

/* A failing tensor of values that is one constant times the golden
 * throughout (a scale left out or applied twice): the factor. */
static void explain_factor(const verify_run *v, const void *ref, enum moe_st_dtype ref_dtype, const void *got,
                           enum moe_st_dtype got_dtype, int64_t n, const uint8_t *skip, int64_t width)
{
    double rg = 0, rr = 0;
    for (int64_t i = 0; i < n; i++)
        if (!(skip && skip[i / width])) {
            const double r = moe_st_element(ref, ref_dtype, i);
            rg += r * moe_st_element(got, got_dtype, i);
            rr += r * r;
        }
    if (!(rr > 0) || !isfinite(rg))
        return;
    const double c = rg / rr;
    double residual = 0;
    for (int64_t i = 0; i < n; i++)
        if (!(skip && skip[i / width])) {
            const double r = moe_st_element(ref, ref_dtype, i), g = moe_st_element(got, got_dtype, i);
            residual += (g - c * r) * (g - c * r);
        }
    if (fabs(c - 1.0) > 1e-3 && sqrt(residual / (c * c * rr)) < 1e-3)
        fprintf(v->out, "%-28s candidate = %.6g x golden throughout (to %.1e): one constant factor is "
                        "wrong (a route scale left out or applied twice?)\n", "", c, sqrt(residual / (c * c * rr)));
}

/* A failing F8_E4M3 candidate: every recipe scales a block of 128 by its
 * own largest magnitude, so the block's largest E4M3 value is 448 (float
 * scales) or in (224, 448] (UE8M0). Blocks well below that were scaled by
 * a larger amax than their own: the scales are not per block. Blocks whose
 * golden magnitude is under the recipes' clamp (1e-4) are not judged. */
static void explain_fp8_scales(verify_run *v, const moe_st_entry *e, const void *ref, enum moe_st_dtype ref_dtype)
{
    moe_status ignored = {0};
    uint8_t *bytes = moe_xmalloc((size_t)(e->end - e->begin) + 1);
    const int64_t width = e->shape[e->ndim - 1], rows = width ? moe_st_elements(e->ndim, e->shape) / width : 0;
    int64_t judged = 0, low = 0, first = -1;
    double first_max = 0;
    const bool read = moe_st_read(&v->cand, e, bytes, &ignored) == MOE_EXIT_OK;
    for (int64_t i = 0; read && i < rows; i++)
        for (int64_t b0 = 0; b0 < width; b0 += MOE_FP8_BLOCK) {
            double q = 0, amax = 0;
            for (int64_t j = b0; j < width && j < b0 + MOE_FP8_BLOCK; j++) {
                q = fmax(q, fabs(moe_st_element(bytes, MOE_ST_F8_E4M3, i * width + j)));
                amax = fmax(amax, fabs(moe_st_element(ref, ref_dtype, i * width + j)));
            }
            if (amax < 2e-4)
                continue;
            judged++;
            if (q < 224 && low++ == 0)
                first = i * width + b0, first_max = q;
        }
    free(bytes);
    if (low)
        fprintf(v->out, "%-28s FP8 scales: in %lld of %lld blocks the largest E4M3 value is below 224 "
                        "(first: row %lld, column %lld, %.4g): those blocks were not scaled by their own "
                        "amax (per-row or per-tensor scales?)\n", "", (long long)low, (long long)judged,
                (long long)(first / width), (long long)(first % width), first_max);
}

static int verify_tensor(verify_run *v, const moe_st_entry *given, int stage, moe_status *st)
{
    json_t *info = json_object_get(v->tensors, given->name);
    moe_st_entry bytes_as = *given; /* U8 where the set holds E4M3 bytes: numpy has no float8 */
    const char *held = json_string_value(json_object_get(info, "dtype"));
    if (given->dtype == MOE_ST_U8 && held && !strcmp(held, "F8_E4M3"))
        bytes_as.dtype = MOE_ST_F8_E4M3;
    const moe_st_entry *e = &bytes_as;
    moe_st_entry golden;
    void *ref = NULL;
    if (!info && stage == MOE_GOLDEN_LAYOUT &&
        (ref = convention_golden(v, e->name, &golden)))
        info = v->convention;
    const char *stage_name = json_string_value(json_object_get(info, "stage"));
    if (!info || !stage_name || strcmp(stage_name, moe_golden_stage_names[stage])) {
        free(ref);
        return MOE_EXIT_OK;
    }
    if (!ref)
        ref = load_golden(v, e->name, &golden, st);
    if (ref && golden.dtype == MOE_ST_F8_E4M3)
        ref = golden_fp8_values(v, e->name, &golden, ref, st);
    if (!ref)
        return st->code;
    v->compared++;
    v->result.compared[stage]++;
    /* A tensor that cannot be compared is a failure of its stage, or the
     * consequence of an earlier stage's. */
    if (!comparable(v, e, &golden, stage, stage_name)) {
        free(ref);
        return MOE_EXIT_OK;
    }
    void *got = NULL;
    moe_st_entry as;
    int rc = candidate_values(v, e, &golden, stage_name, stage, &got, &as, st);
    const char *rule_text = json_string_value(json_object_get(info, "compare"));
    const enum moe_golden_rule rule = !strcmp(rule_text, "topk")        ? MOE_RULE_TOPK
                                      : !strcmp(rule_text, "tolerance") ? MOE_RULE_TOLERANCE
                                                                        : MOE_RULE_EXACT;
    const int64_t count = moe_st_elements(as.ndim, as.shape);
    bool failed = false;
    double *allow = rc == MOE_EXIT_OK ? load_allowance(v, info, e->name, count, &failed, st) : NULL;
    if (rc != MOE_EXIT_OK || failed) {
        free(got);
        free(ref);
        return rc == MOE_EXIT_CHECK_FAILED ? MOE_EXIT_OK : st->code;
    }
    const contract tol = {json_number_value(json_object_get(info, "abs")),
                          json_number_value(json_object_get(info, "rel")), allow,
                          json_is_true(json_object_get(info, "bf16_step"))};
    verdict result = {.first_bad = -1};
    /* After near-ties, rows of the tied tokens legitimately differ: they are
     * left out; a tensor whose rows are not tokens (counts) cannot leave
     * them out, and its differences are not counted. */
    uint8_t *skip = NULL;
    bool uncounted = false;
    if (stage > MOE_GOLDEN_ROUTER && v->tied_count > 0) {
        skip = tied_rows(v, e->name, e->shape[0]);
        uncounted = skip == NULL;
    }
    if (rule == MOE_RULE_TOPK) {
        if (compare_ids(v, e, ref, got, &as, count, &result, st)) {
            free(skip);
            free(allow);
            free(got);
            free(ref);
            return st->code;
        }
    } else {
        compare_values(ref, golden.dtype, got, as.dtype, count, rule, &tol, skip,
                       e->shape[0] ? count / e->shape[0] : 1, &result);
    }
    print_verdict(v, e, stage, stage_name, rule_text, rule, &result, skip, uncounted, &golden, ref, &as,
                  got);
    explain_rounding(v, e, stage, &result);
    if (result.bad && !uncounted && rule != MOE_RULE_TOPK && !moe_st_dtype_is_integer(as.dtype))
        explain_factor(v, ref, golden.dtype, got, as.dtype, count, skip, e->shape[0] ? count / e->shape[0] : 1);
    if (result.bad && !uncounted && e->dtype == MOE_ST_F8_E4M3)
        explain_fp8_scales(v, e, ref, golden.dtype);
    free(skip);
    free(allow);
    free(got);
    free(ref);
    return MOE_EXIT_OK;
}

/* ---- the manifest as untrusted input -------------------------------------
 *
 * Everything verify later relies on is checked first: the keys it reads and
 * their types, tensor entries that name a listed file, a stage, a dtype, a
 * rule and a shape of sizes whose product cannot overflow, tolerances that
 * are finite numbers (integers or reals), allowances that are F64 tensors
 * of their tensor's shape, and the shapes of the tensors the layer defines
 * against the config's G, T, d, E and k. Golden files are then held to the
 * manifest (load_golden) and golden ids to [0, E) (verify_tensor). */

static int bad_manifest(moe_status *st, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int bad_manifest(moe_status *st, const char *path, const char *fmt, ...)
{
    char what[MOE_MESSAGE_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return moe_fail(st, MOE_EXIT_USAGE, "golden manifest '%s' is not valid: %s", path, what);
}

/* A config value that must be an integer in [1, max]. */
static bool config_integer(json_t *config, const char *key, int64_t max, int64_t *out)
{
    const char *text = json_string_value(json_object_get(config, key));
    char *end;
    if (!text || !isdigit((unsigned char)text[0]))
        return false;
    errno = 0;
    const long long v = strtoll(text, &end, 10);
    *out = v;
    return !*end && !errno && v >= 1 && v <= max;
}

/* The shape the layer gives a tensor of this name, in the config's sizes:
 * -1 for a size that varies (rows of a rank); false when the name is not
 * one of the layer's. */
static bool expected_shape(const verify_run *v, const char *name, int64_t d, int *ndim, int64_t shape[2])
{
    const int64_t N = v->ranks * v->config_tokens, E = v->experts_config, k = v->topk, G = v->ranks;
    static const struct {
        const char *name;
        char rows, cols; /* N tokens, G ranks, E experts, k, d hidden, r varying rows, 0 none */
    } table[] = {{"tokens.x", 'N', 'd'},           {"router.logits", 'N', 'E'},
                 {"router.scores", 'N', 'E'},      {"router.selection", 'N', 'E'},
                 {"router.topk_ids", 'N', 'k'},    {"router.topk_weights", 'N', 'k'},
                 {"gate.weight", 'E', 'd'},        {"gate.bias", 'E', 0},
                 {"router.skew", 'E', 0},          {"layout.tokens_per_rank", 'G', 0},
                 {"layout.tokens_per_expert", 'E', 0}, {"layout.is_token_in_rank", 'N', 'G'},
                 {"layout.send_counts", 'G', 'G'}, {"layout.kept_ids", 'N', 'k'}, {"layout.physical_ids", 'N', 'k'}, {"output.y", 'N', 'd'},
                 {"output.truth", 'N', 'd'},       {"output.allow", 'N', 'd'}};
    const char *rank_tensor[][2] = {{"dispatch.rank%d.x%n", "rd"}, {"dispatch.rank%d.token%n", "r"},
                                    {"experts.rank%d.out%n", "rd"}, {"experts.rank%d.pair%n", "r2"},
                                    {"experts.rank%d.sum%n", "rd"}, {"experts.node%d.sum%n", "rd"},
                                    {"experts.rank%d.out_allow%n", "rd"}, {"experts.rank%d.sum_allow%n", "rd"},
                                    {"experts.node%d.token%n", "r"}};
    char rows = 0, cols = 0;
    for (size_t n = 0; n < sizeof table / sizeof table[0]; n++)
        if (!strcmp(name, table[n].name))
            rows = table[n].rows, cols = table[n].cols;
    for (size_t n = 0; n < sizeof rank_tensor / sizeof rank_tensor[0] && !rows; n++) {
        int r, used = -1;
        if (sscanf(name, rank_tensor[n][0], &r, &used) == 1 && used == (int)strlen(name) && r >= 0 && r < G)
            rows = rank_tensor[n][1][0], cols = rank_tensor[n][1][1];
    }
    if (!rows)
        return false;
    const char sym[2] = {rows, cols};
    *ndim = cols ? 2 : 1;
    for (int i = 0; i < *ndim; i++)
        shape[i] = sym[i] == 'N' ? N : sym[i] == 'G' ? G : sym[i] == 'E' ? E : sym[i] == 'k' ? k
                 : sym[i] == 'd' ? d : sym[i] == '2' ? 2 : -1;
    return true;
}

static int validate_tensor_entry(const verify_run *v, const char *path, const char *name, json_t *t,
                                 moe_status *st)
{
    if (!json_is_object(t))
        return bad_manifest(st, path, "tensor '%s' is not an object", name);
    const char *file = json_string_value(json_object_get(t, "file"));
    const char *stage = json_string_value(json_object_get(t, "stage"));
    const char *dtype = json_string_value(json_object_get(t, "dtype"));
    const char *rule = json_string_value(json_object_get(t, "compare"));
    json_t *shape = json_object_get(t, "shape"), *abs = json_object_get(t, "abs"), *rel = json_object_get(t, "rel");
    if (!file || !json_object_get(v->files, file))
        return bad_manifest(st, path, "tensor '%s' names no file of \"files\"", name);
    bool known = false;
    for (int s = 0; s < MOE_GOLDEN_STAGES; s++)
        known |= stage && !strcmp(stage, moe_golden_stage_names[s]);
    if (!known)
        return bad_manifest(st, path, "tensor '%s' has no known \"stage\"", name);
    int kind = -1;
    for (int k = 0; k < MOE_ST_DTYPES; k++)
        if (dtype && !strcmp(dtype, moe_st_dtype_name((enum moe_st_dtype)k)))
            kind = k;
    if (kind < 0)
        return bad_manifest(st, path, "tensor '%s' has no known \"dtype\"", name);
    if (!rule || (strcmp(rule, "exact") && strcmp(rule, "tolerance") && strcmp(rule, "topk")))
        return bad_manifest(st, path, "tensor '%s' has no \"compare\" of exact, tolerance or topk", name);
    if (!json_is_array(shape) || json_array_size(shape) > MOE_ST_MAX_DIMS)
        return bad_manifest(st, path, "tensor '%s' has no \"shape\" of at most %d sizes", name, MOE_ST_MAX_DIMS);
    int64_t elements = 1;
    for (size_t dim = 0; dim < json_array_size(shape); dim++) {
        json_t *size = json_array_get(shape, dim);
        const json_int_t n = json_is_integer(size) ? json_integer_value(size) : -1;
        if (n < 0 || (n > 0 && elements > ((int64_t)1 << 40) / n))
            return bad_manifest(st, path, "tensor '%s' has a shape that is not sizes of at most 2^40 elements in all", name);
        elements *= n;
    }
    if (!strcmp(rule, "topk") && (json_array_size(shape) != 2 || strcmp(dtype, "I32")))
        return bad_manifest(st, path, "tensor '%s' compared as topk is not (tokens, k) I32", name);
    /* The tensors verify reads as indices have the dtype it reads them as. */
    int r, used = -1;
    const bool index_tensor = !strcmp(name, "router.topk_ids") || !strcmp(name, "layout.send_counts") ||
                              !strcmp(name, "layout.kept_ids") || !strcmp(name, "layout.physical_ids") ||
                              !strcmp(name, "layout.replica_of") ||
                              (sscanf(name, "dispatch.rank%d.token%n", &r, &used) == 1 && used == (int)strlen(name)) ||
                              (sscanf(name, "experts.rank%d.pair%n", &r, &used) == 1 && used == (int)strlen(name));
    if ((index_tensor && strcmp(dtype, "I32")) ||
        (!strcmp(name, "layout.is_token_in_rank") && strcmp(dtype, "BOOL")) ||
        (!strcmp(name, "router.selection") && strcmp(dtype, "F32")) ||
        (!strcmp(name, "router.topk_weights") && strcmp(dtype, "F32")))
        return bad_manifest(st, path, "tensor '%s' is not of the dtype the layer gives it", name);
    if (!json_is_number(abs) || !json_is_number(rel) || !(json_number_value(abs) >= 0) ||
        !(json_number_value(rel) >= 0) || !isfinite(json_number_value(abs)) || !isfinite(json_number_value(rel)))
        return bad_manifest(st, path, "tensor '%s' has no finite \"abs\" and \"rel\" of at least 0", name);
    json_t *bf16 = json_object_get(t, "bf16_step"), *allow = json_object_get(t, "allow");
    if (bf16 && !json_is_boolean(bf16))
        return bad_manifest(st, path, "tensor '%s' has a \"bf16_step\" that is not true or false", name);
    if (allow) {
        json_t *a = json_object_get(v->tensors, json_string_value(allow) ? json_string_value(allow) : "");
        const char *a_dtype = json_string_value(json_object_get(a, "dtype"));
        if (!json_is_object(a) || !json_equal(json_object_get(a, "shape"), shape) || !a_dtype ||
            strcmp(a_dtype, "F64"))
            return bad_manifest(st, path, "tensor '%s' has an \"allow\" that is not an F64 tensor of its shape", name);
    }
    int ndim;
    int64_t want[2];
    const int64_t d = v->hidden;
    if (expected_shape(v, name, d, &ndim, want)) {
        bool ok = json_array_size(shape) == (size_t)ndim;
        for (int dim = 0; ok && dim < ndim; dim++)
            ok = want[dim] < 0 || json_integer_value(json_array_get(shape, (size_t)dim)) == want[dim];
        if (!ok)
            return bad_manifest(st, path, "tensor '%s' does not have the shape its config gives it", name);
    }
    return MOE_EXIT_OK;
}

static int validate_manifest(verify_run *v, const char *path, moe_status *st)
{
    json_t *m = v->manifest, *config = json_object_get(m, "config");
    const char *format = json_string_value(json_object_get(m, "format"));
    if (!json_is_object(m) || !format || strcmp(format, "moe-ep golden set"))
        return moe_fail(st, MOE_EXIT_USAGE, "'%s' is not a moe-ep golden manifest", path);
    if (!json_is_integer(json_object_get(m, "format_version")) ||
        json_integer_value(json_object_get(m, "format_version")) != 1)
        return bad_manifest(st, path, "\"format_version\" is not 1, the version this moe-ep reads");
    if (!json_is_object(config) || !json_is_object(v->tensors) || !json_is_object(v->files))
        return bad_manifest(st, path, "\"config\", \"files\" and \"tensors\" must be objects");
    if (!config_integer(config, "ranks", 1 << 20, &v->ranks) ||
        !config_integer(config, "tokens", 1 << 24, &v->config_tokens) ||
        !config_integer(config, "experts", 4096, &v->experts_config) ||
        !config_integer(config, "topk", v->experts_config, &v->topk) ||
        !config_integer(config, "hidden", 65536, &v->hidden))
        return bad_manifest(st, path, "\"config\" lacks ranks, tokens, experts, topk or hidden as "
                            "integers in their ranges");
    const char *key;
    json_t *value;
    json_object_foreach(config, key, value) {
        if (!json_is_string(value))
            return bad_manifest(st, path, "config value '%s' is not a string", key);
    }
    json_t *stages = json_object_get(m, "stages");
    bool known = json_is_array(stages);
    for (size_t n = 0; known && n < json_array_size(stages); n++) {
        const char *name = json_string_value(json_array_get(stages, n));
        known = false;
        for (int s = 0; name && s < MOE_GOLDEN_STAGES && !known; s++)
            known = !strcmp(name, moe_golden_stage_names[s]);
    }
    if (!known)
        return bad_manifest(st, path, "\"stages\" is not a list of stage names");
    json_object_foreach(v->files, key, value) {
        const char *sha = json_string_value(json_object_get(value, "sha256"));
        if (!sha || strlen(sha) != 64 || strspn(sha, "0123456789abcdef") != 64 ||
            !json_is_integer(json_object_get(value, "bytes")) ||
            json_integer_value(json_object_get(value, "bytes")) < 0 || strchr(key, '/') || !strcmp(key, ".."))
            return bad_manifest(st, path, "file '%s' has no \"sha256\" of 64 hex digits and \"bytes\"", key);
    }
    json_object_foreach(v->tensors, key, value) {
        if (validate_tensor_entry(v, path, key, value, st))
            return st->code;
    }
    return MOE_EXIT_OK;
}

/* The order tensors are compared in within a stage: ids, slots and counts
 * first (a token in the wrong slot explains the values that follow), then
 * FP8 scales on their own, then values. */
static int compare_order(const moe_st_entry *e)
{
    const size_t len = strlen(e->name);
    if (moe_st_dtype_is_integer(e->dtype) && !(len > 6 && !strcmp(e->name + len - 6, ".scale")))
        return 0;
    return len > 6 && !strcmp(e->name + len - 6, ".scale") ? 1 : 2;
}

/* Every candidate tensor in pipeline order, the stages the set holds
 * counted, the table's closing lines on what was checked and what not. */
static int compare_all(verify_run *v, moe_status *st)
{
    const char *key;
    json_t *value;
    json_object_foreach(v->tensors, key, value) {
        for (int s = 0; s < MOE_GOLDEN_STAGES; s++)
            v->result.in_set[s] |= !strcmp(json_string_value(json_object_get(value, "stage")),
                                           moe_golden_stage_names[s]);
    }
    int rc = MOE_EXIT_OK;
    for (int stage = 0; stage < MOE_GOLDEN_STAGES && rc == MOE_EXIT_OK; stage++)
        for (int order = 0; order < 3; order++)
            for (int n = 0; n < v->cand.count && rc == MOE_EXIT_OK; n++)
                if (compare_order(&v->cand.entries[n]) == order)
                    rc = verify_tensor(v, &v->cand.entries[n], stage, st);
    for (int n = 0; n < v->cand.count && rc == MOE_EXIT_OK; n++)
        if (!companion_name(v, v->cand.entries[n].name) && !json_object_get(v->tensors, v->cand.entries[n].name))
            fprintf(v->out, "%-28s (not in the golden set: ignored)\n", v->cand.entries[n].name);
    if (rc != MOE_EXIT_OK)
        return rc;
    const char *lead[2] = {"stages checked:", "stages not checked:"};
    for (int missing = 0; missing < 2; missing++) {
        int listed = 0;
        for (int s = 0; s < MOE_GOLDEN_STAGES; s++) {
            if (!v->result.in_set[s] || (v->result.compared[s] == 0) != missing)
                continue;
            fprintf(v->out, "%s %s", listed++ ? "," : lead[missing], moe_golden_stage_names[s]);
            if (!missing)
                fprintf(v->out, " (%d)", v->result.compared[s]);
            if (missing && (v->opt.require >> s & 1u))
                v->result.missing_required |= 1u << s;
        }
        if (listed)
            fprintf(v->out, "%s\n", missing ? " (--require STAGE makes one missing fail)" : "");
    }
    return MOE_EXIT_OK;
}

int moe_golden_verify(const char *dir, const char *candidate, const moe_golden_options *options,
                      FILE *out, moe_golden_result *result, moe_status *st)
{
    if (result)
        memset(result, 0, sizeof *result);
    char path[700];
    snprintf(path, sizeof path, "%s/manifest.json", dir);
    json_error_t error;
    verify_run v = {.dir = dir, .out = out, .first_failing = MOE_GOLDEN_STAGES};
    if (options)
        v.opt = *options;
    FILE *fp = moe_open_input("golden manifest: ", path, st);
    if (!fp)
        return st->code;
    v.manifest = json_loadf(fp, JSON_REJECT_DUPLICATES, &error);
    fclose(fp);
    if (!v.manifest)
        return moe_fail(st, MOE_EXIT_USAGE, "cannot read golden manifest '%s': %s (line %d)", path,
                        error.text, error.line);
    v.checked = json_object();
    v.tensors = json_object_get(v.manifest, "tensors");
    v.files = json_object_get(v.manifest, "files");
    if (validate_manifest(&v, path, st)) {
        json_decref(v.manifest);
        json_decref(v.checked);
        return st->code;
    }
    if (moe_st_open(candidate, &v.cand, st)) {
        json_decref(v.manifest);
        json_decref(v.checked);
        return st->code;
    }
    if (check_names(&v, candidate, st)) {
        moe_st_close(&v.cand);
        json_decref(v.manifest);
        json_decref(v.checked);
        return st->code;
    }
    v.convention = json_pack("{s:s, s:s, s:s}", "stage", "layout", "compare", "exact", "file",
                             "layout.safetensors");
    moe_st_entry sel_entry;
    moe_status ignored = {0};
    json_t *sel_info = json_object_get(v.tensors, "router.selection");
    if (sel_info)
        v.selection = load_golden(&v, "router.selection", &sel_entry, &ignored);
    v.experts = v.selection ? (int)sel_entry.shape[1] : 0;
    v.sel_abs = json_number_value(json_object_get(sel_info, "abs"));
    v.sel_rel = json_number_value(json_object_get(sel_info, "rel"));

    fprintf(out, "%-28s %-9s %-10s %11s %11s %8s %10s  %s\n", "tensor", "stage", "rule", "max abs",
            "max rel", "% of tol", "mismatch", "first mismatch");
    const int rc = compare_all(&v, st);
    for (int r = 0; v.arrival && r < v.ranks; r++)
        free(v.arrival[r]);
    free(v.arrival);
    free(v.arrival_done);
    free(v.tied);
    free(v.slot_of);
    free(v.masked);
    free(v.selection);
    json_decref(v.convention);
    moe_st_close(&v.cand);
    json_decref(v.manifest);
    json_decref(v.checked);
    if (result)
        *result = v.result;
    if (rc != MOE_EXIT_OK)
        return rc;
    if (v.compared == 0)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "'%s' holds no tensor of the golden set (names as in %s/manifest.json)",
                        candidate, dir);
    if (v.first_failing < MOE_GOLDEN_STAGES) {
        fprintf(out, "verify: FAIL, first failing stage: %s\n", moe_golden_stage_names[v.first_failing]);
        return MOE_EXIT_CHECK_FAILED;
    }
    if (v.result.missing_required) {
        fprintf(out, "verify: FAIL, required stage%s not checked:",
                (v.result.missing_required & (v.result.missing_required - 1)) ? "s" : "");
        for (int s = 0; s < MOE_GOLDEN_STAGES; s++)
            if (v.result.missing_required >> s & 1u)
                fprintf(out, " %s", moe_golden_stage_names[s]);
        fprintf(out, "\n");
        return MOE_EXIT_CHECK_FAILED;
    }
    fprintf(out, "verify: PASS, %d tensors within contract\n", v.compared);
    return MOE_EXIT_OK;
}

int moe_golden_parse_require(const char *text, unsigned *require, moe_status *st)
{
    *require = 0;
    if (!strcmp(text, "all")) {
        *require = ~0u;
        return MOE_EXIT_OK;
    }
    char copy[256];
    snprintf(copy, sizeof copy, "%s", text);
    char *save = NULL;
    for (char *name = strtok_r(copy, ",", &save); name; name = strtok_r(NULL, ",", &save)) {
        int stage = -1;
        for (int s = 0; s < MOE_GOLDEN_STAGES; s++)
            if (!strcmp(name, moe_golden_stage_names[s]))
                stage = s;
        if (stage < 0)
            return moe_fail(st, MOE_EXIT_USAGE, "--require: '%s' is not a stage (inputs, router, layout, "
                            "dispatch, experts, output, backward, or all)", name);
        *require |= 1u << stage;
    }
    if (!*require)
        return moe_fail(st, MOE_EXIT_USAGE, "--require needs stage names separated by commas, or all");
    return MOE_EXIT_OK;
}
