/* SPDX-License-Identifier: MIT */
/* safetensors.c — the safetensors format with jansson (see safetensors.h). */
#define _POSIX_C_SOURCE 200809L
#include "moe/safetensors.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "moe/files.h"
#include "moe/quant.h"
#include "moe/sha256.h"

static const struct {
    const char *name;
    size_t size;
} dtypes[MOE_ST_DTYPES] = {{"F32", 4}, {"F64", 8}, {"I32", 4}, {"BOOL", 1}, {"U8", 1},
                           {"I64", 8}, {"I16", 2}, {"BF16", 2}, {"F16", 2}, {"F8_E4M3", 1}};

size_t moe_st_dtype_size(enum moe_st_dtype dtype) { return dtypes[dtype].size; }
const char *moe_st_dtype_name(enum moe_st_dtype dtype) { return dtypes[dtype].name; }

/* An IEEE half (1 sign, 5 exponent, 10 fraction bits) as a double. */
static double half_value(uint16_t h)
{
    const int exponent = (h >> 10) & 0x1f, fraction = h & 0x3ff;
    const double sign = h & 0x8000 ? -1.0 : 1.0;
    if (exponent == 0x1f)
        return fraction ? NAN : sign * INFINITY;
    if (exponent == 0)
        return sign * ldexp(fraction, -24); /* subnormal: fraction * 2^-10 * 2^-14 */
    return sign * ldexp(1024 + fraction, exponent - 25);
}

double moe_st_element(const void *data, enum moe_st_dtype dtype, int64_t i)
{
    switch (dtype) {
    case MOE_ST_F32: return ((const float *)data)[i];
    case MOE_ST_F64: return ((const double *)data)[i];
    case MOE_ST_I32: return ((const int32_t *)data)[i];
    case MOE_ST_I64: return (double)((const int64_t *)data)[i];
    case MOE_ST_I16: return ((const int16_t *)data)[i];
    case MOE_ST_BF16: {
        const uint32_t bits = (uint32_t)((const uint16_t *)data)[i] << 16;
        float v;
        memcpy(&v, &bits, sizeof v);
        return v;
    }
    case MOE_ST_F16: return half_value(((const uint16_t *)data)[i]);
    case MOE_ST_F8_E4M3: return moe_e4m3_to_f32(((const uint8_t *)data)[i]);
    default: return ((const uint8_t *)data)[i];
    }
}

int64_t moe_st_elements(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    return n;
}

static uint64_t tensor_bytes(const moe_st_tensor *t)
{
    return (uint64_t)moe_st_elements(t->ndim, t->shape) * moe_st_dtype_size(t->dtype);
}

/* The header: metadata, then each tensor in order with consecutive offsets,
 * padded with spaces to a multiple of 8 bytes so that the data is aligned. */
static char *build_header(const moe_st_tensor *tensors, int n, const char *metadata_json,
                          size_t *length, moe_status *st)
{
    json_t *root = json_object();
    if (metadata_json) {
        json_error_t error;
        json_t *meta = json_loads(metadata_json, 0, &error);
        if (!meta) {
            json_decref(root);
            moe_fail(st, MOE_EXIT_RUNTIME, "internal: bad metadata JSON: %s", error.text);
            return NULL;
        }
        json_object_set_new(root, "__metadata__", meta);
    }
    uint64_t offset = 0;
    for (int i = 0; i < n; i++) {
        json_t *entry = json_object(), *shape = json_array();
        for (int dim = 0; dim < tensors[i].ndim; dim++)
            json_array_append_new(shape, json_integer(tensors[i].shape[dim]));
        json_object_set_new(entry, "dtype", json_string(moe_st_dtype_name(tensors[i].dtype)));
        json_object_set_new(entry, "shape", shape);
        json_t *offsets = json_array();
        json_array_append_new(offsets, json_integer((json_int_t)offset));
        offset += tensor_bytes(&tensors[i]);
        json_array_append_new(offsets, json_integer((json_int_t)offset));
        json_object_set_new(entry, "data_offsets", offsets);
        json_object_set_new(root, tensors[i].name, entry);
    }
    char *text = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    size_t len = strlen(text), padded = (len + 7) / 8 * 8;
    char *header = realloc(text, padded + 1);
    memset(header + len, ' ', padded - len);
    header[padded] = '\0';
    *length = padded;
    return header;
}

/* What the atomic writer's callback needs: the header, the tensors, and the
 * hash of every byte written. */
typedef struct {
    const char *header;
    size_t header_len;
    const moe_st_tensor *tensors;
    int n;
    moe_sha256 hash;
} st_payload;

static void write_hashed(FILE *fp, moe_sha256 *h, const void *data, size_t bytes)
{
    moe_sha256_update(h, data, bytes);
    fwrite(data, 1, bytes, fp);
}

/* Errors show in ferror(fp), which the atomic writer checks. */
static void write_payload(FILE *fp, const void *arg)
{
    st_payload *p = (st_payload *)arg;
    uint8_t length[8];
    for (int b = 0; b < 8; b++)
        length[b] = (uint8_t)((uint64_t)p->header_len >> (8 * b));
    write_hashed(fp, &p->hash, length, 8);
    write_hashed(fp, &p->hash, p->header, p->header_len);
    for (int i = 0; i < p->n && !ferror(fp); i++) {
        const moe_st_tensor *t = &p->tensors[i];
        if (t->data) {
            write_hashed(fp, &p->hash, t->data, tensor_bytes(t));
            continue;
        }
        const size_t row = tensor_bytes(t) / (size_t)(t->shape[0] ? t->shape[0] : 1);
        void *buffer = moe_xmalloc(row);
        for (int64_t r = 0; r < t->shape[0] && !ferror(fp); r++) {
            t->fill(t->ctx, r, buffer);
            write_hashed(fp, &p->hash, buffer, row);
        }
        free(buffer);
    }
}

int moe_st_write(const char *path, const moe_st_tensor *tensors, int n, const char *metadata_json,
                 char *sha256_hex, moe_status *st)
{
    st_payload payload = {.tensors = tensors, .n = n};
    char *header = build_header(tensors, n, metadata_json, &payload.header_len, st);
    if (!header)
        return st->code;
    payload.header = header;
    moe_sha256_init(&payload.hash);
    const int rc = moe_write_file_atomic(path, write_payload, &payload, st);
    free(header);
    if (rc == MOE_EXIT_OK && sha256_hex) {
        uint8_t digest[32];
        moe_sha256_final(&payload.hash, digest);
        moe_sha256_hex(digest, sha256_hex);
    }
    return rc;
}

static int bad(moe_st_file *f, moe_status *st, const char *what)
{
    moe_fail(st, MOE_EXIT_USAGE, "'%s' is not a valid safetensors file: %s", f->path, what);
    moe_st_close(f);
    return st->code;
}

static int by_begin(const void *a, const void *b)
{
    const moe_st_entry *x = *(const moe_st_entry *const *)a, *y = *(const moe_st_entry *const *)b;
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

/* No two tensors on the same bytes (the format lays them one after the
 * other): a file whose weights point at its ids' bytes is refused. */
static int check_disjoint(moe_st_file *f, moe_status *st)
{
    const moe_st_entry **order = moe_xmalloc(sizeof *order * (size_t)f->count + 1);
    for (int n = 0; n < f->count; n++)
        order[n] = &f->entries[n];
    qsort(order, (size_t)f->count, sizeof *order, by_begin);
    const moe_st_entry *last = NULL; /* the non-empty tensor that ends last so far */
    char names[2 * MOE_ST_NAME_MAX + 80] = "";
    for (int n = 0; n < f->count && !names[0]; n++) {
        if (order[n]->end == order[n]->begin)
            continue;
        if (last && order[n]->begin < last->end)
            snprintf(names, sizeof names, "tensors '%s' and '%s' share bytes (overlapping data_offsets)",
                     last->name, order[n]->name);
        if (!last || order[n]->end > last->end)
            last = order[n];
    }
    free(order);
    if (names[0])
        return bad(f, st, names);
    return MOE_EXIT_OK;
}

int moe_st_open(const char *path, moe_st_file *f, moe_status *st)
{
    memset(f, 0, sizeof *f);
    snprintf(f->path, sizeof f->path, "%s", path);
    f->fp = moe_open_input("", path, st);
    if (!f->fp)
        return st->code;
    struct stat info;
    if (fstat(fileno(f->fp), &info) != 0)
        return bad(f, st, "cannot stat it");
    const uint64_t file_size = (uint64_t)info.st_size;
    uint8_t length[8];
    if (file_size < 8 || fread(length, 1, 8, f->fp) != 8)
        return bad(f, st, "shorter than its 8-byte header length");
    uint64_t header_len = 0;
    for (int b = 0; b < 8; b++)
        header_len |= (uint64_t)length[b] << (8 * b);
    if (header_len > file_size - 8 || header_len > (100u << 20))
        return bad(f, st, "its header length runs past the end of the file");
    char *header = moe_xmalloc((size_t)header_len + 1);
    if (fread(header, 1, (size_t)header_len, f->fp) != header_len) {
        free(header);
        return bad(f, st, "truncated header");
    }
    header[header_len] = '\0';
    json_error_t error;
    /* a name twice would leave one of its entries unread, whichever */
    json_t *root = json_loadb(header, (size_t)header_len, JSON_REJECT_DUPLICATES, &error);
    free(header);
    if (!root && strstr(error.text, "duplicate"))
        return bad(f, st, "its header names a tensor twice");
    if (!root || !json_is_object(root)) {
        json_decref(root);
        return bad(f, st, "its header is not a JSON object");
    }
    f->data_start = 8 + header_len;
    const uint64_t data_size = file_size - f->data_start;
    f->entries = moe_xcalloc(json_object_size(root) + 1, sizeof *f->entries);
    const char *key;
    json_t *value;
    json_object_foreach(root, key, value) {
        if (!strcmp(key, "__metadata__"))
            continue;
        moe_st_entry *e = &f->entries[f->count];
        json_t *dtype = json_object_get(value, "dtype"), *shape = json_object_get(value, "shape");
        json_t *offsets = json_object_get(value, "data_offsets");
        if (strlen(key) >= MOE_ST_NAME_MAX || !json_is_string(dtype) || !json_is_array(shape) ||
            json_array_size(shape) > MOE_ST_MAX_DIMS || !json_is_array(offsets) ||
            json_array_size(offsets) != 2) {
            json_decref(root);
            return bad(f, st, "a tensor entry lacks dtype, shape or data_offsets");
        }
        snprintf(e->name, sizeof e->name, "%s", key);
        e->dtype = MOE_ST_DTYPES;
        for (int t = 0; t < MOE_ST_DTYPES; t++)
            if (!strcmp(json_string_value(dtype), dtypes[t].name))
                e->dtype = (enum moe_st_dtype)t;
        if (e->dtype == MOE_ST_DTYPES) {
            char what[MOE_ST_NAME_MAX + 96], known[160] = "";
            for (int t = 0; t < MOE_ST_DTYPES; t++)
                snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s", t ? " " : "",
                         dtypes[t].name);
            snprintf(what, sizeof what, "tensor '%s' is %.16s, a dtype this reader does not know (%s)",
                     e->name, json_string_value(dtype), known);
            json_decref(root);
            return bad(f, st, what);
        }
        e->ndim = (int)json_array_size(shape);
        uint64_t elements = 1;
        for (int dim = 0; dim < e->ndim; dim++) {
            json_t *n = json_array_get(shape, (size_t)dim);
            if (!json_is_integer(n) || json_integer_value(n) < 0 || json_integer_value(n) > (1ll << 40)) {
                json_decref(root);
                return bad(f, st, "a shape is not a list of sizes");
            }
            e->shape[dim] = json_integer_value(n);
            if (e->shape[dim] > 0 && elements > (1ull << 50) / (uint64_t)e->shape[dim]) {
                json_decref(root); /* the product would overflow, or no file holds it */
                return bad(f, st, "a shape of more than 2^50 elements");
            }
            elements *= (uint64_t)e->shape[dim];
        }
        json_t *b = json_array_get(offsets, 0), *end = json_array_get(offsets, 1);
        if (!json_is_integer(b) || !json_is_integer(end) || json_integer_value(b) < 0 ||
            json_integer_value(end) < json_integer_value(b)) {
            json_decref(root);
            return bad(f, st, "bad data_offsets");
        }
        e->begin = (uint64_t)json_integer_value(b);
        e->end = (uint64_t)json_integer_value(end);
        if (e->end > data_size) {
            json_decref(root);
            return bad(f, st, "a tensor runs past the end of the file (truncated?)");
        }
        if (elements > (1ull << 50) || e->end - e->begin != elements * dtypes[e->dtype].size) {
            json_decref(root);
            return bad(f, st, "a tensor's bytes do not match its shape and dtype");
        }
        f->count++;
    }
    json_decref(root);
    return check_disjoint(f, st);
}

const moe_st_entry *moe_st_find(const moe_st_file *f, const char *name)
{
    for (int n = 0; n < f->count; n++)
        if (!strcmp(f->entries[n].name, name))
            return &f->entries[n];
    return NULL;
}

int moe_st_read(const moe_st_file *f, const moe_st_entry *e, void *out, moe_status *st)
{
    const size_t bytes = (size_t)(e->end - e->begin);
    if (fseeko(f->fp, (off_t)(f->data_start + e->begin), SEEK_SET) != 0 ||
        fread(out, 1, bytes, f->fp) != bytes)
        return moe_fail(st, MOE_EXIT_USAGE, "cannot read tensor '%s' from '%s'", e->name, f->path);
    return MOE_EXIT_OK;
}

void moe_st_close(moe_st_file *f)
{
    if (f->fp)
        fclose(f->fp);
    free(f->entries);
    f->fp = NULL;
    f->entries = NULL;
    f->count = 0;
}
