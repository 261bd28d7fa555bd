/* SPDX-License-Identifier: MIT */
/* safetensors.h — reading and writing the safetensors format.
 *
 * A file is: 8 bytes, little-endian u64 N; N bytes of JSON header; the data.
 * The header maps each tensor name to {"dtype", "shape", "data_offsets":
 * [begin, end)} (offsets into the data), plus an optional "__metadata__"
 * object of strings. The JSON is read and written with jansson. Writing goes
 * to a temporary file that is renamed into place only when complete, and the
 * SHA-256 of the bytes written comes back. Reading validates the header
 * fully (sizes, offsets, dtypes, shapes) before any data is touched:
 * a truncated or corrupt file is an error, never a crash.
 */
#ifndef MOE_SAFETENSORS_H
#define MOE_SAFETENSORS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "moe/common.h"

/* The dtypes moe-ep writes (F32, F64, I32, BOOL) and those a port's
 * candidate may also hold (what torch and numpy write): verify converts. */
enum moe_st_dtype {
    MOE_ST_F32, MOE_ST_F64, MOE_ST_I32, MOE_ST_BOOL, MOE_ST_U8,
    MOE_ST_I64, MOE_ST_I16, MOE_ST_BF16, MOE_ST_F16, MOE_ST_F8_E4M3, MOE_ST_DTYPES
};

/* Whether a dtype holds integers (ids, counts, flags) rather than reals. */
static inline int moe_st_dtype_is_integer(enum moe_st_dtype dtype)
{
    return dtype == MOE_ST_I32 || dtype == MOE_ST_BOOL || dtype == MOE_ST_U8 ||
           dtype == MOE_ST_I64 || dtype == MOE_ST_I16;
}

/* Element i of data (dtype) as a double: exact for every dtype here but
 * I64 beyond 2^53 (F8_E4M3: the value of the byte, before any scale). */
double moe_st_element(const void *data, enum moe_st_dtype dtype, int64_t i);

#define MOE_ST_MAX_DIMS 4
#define MOE_ST_NAME_MAX 96

/* A tensor to write: data, or rows of its first dimension produced on demand
 * by fill (for weights generated from the seed, never held whole). */
typedef struct {
    char name[MOE_ST_NAME_MAX];
    enum moe_st_dtype dtype;
    int ndim;
    int64_t shape[MOE_ST_MAX_DIMS];
    const void *data;
    void (*fill)(const void *ctx, int64_t row, void *out); /* one row of dims 1.. */
    const void *ctx;
} moe_st_tensor;

/* Bytes of one element. */
size_t moe_st_dtype_size(enum moe_st_dtype dtype);
const char *moe_st_dtype_name(enum moe_st_dtype dtype);
/* Elements of a shape. */
int64_t moe_st_elements(int ndim, const int64_t *shape);

/* Write tensors (n) to path with metadata (a JSON object of strings; NULL
 * for none). sha256_hex (65) receives the file's checksum. Returns
 * MOE_EXIT_OK or MOE_EXIT_RUNTIME (st names the path and the reason). */
int moe_st_write(const char *path, const moe_st_tensor *tensors, int n, const char *metadata_json,
                 char *sha256_hex, moe_status *st);

/* A file opened for reading: its validated header. */
typedef struct {
    char name[MOE_ST_NAME_MAX];
    enum moe_st_dtype dtype;
    int ndim;
    int64_t shape[MOE_ST_MAX_DIMS];
    uint64_t begin, end; /* in the data section */
} moe_st_entry;

typedef struct {
    FILE *fp;
    char path[512];
    uint64_t data_start;
    moe_st_entry *entries;
    int count;
} moe_st_file;

/* Open and validate. Returns MOE_EXIT_OK, or MOE_EXIT_USAGE with st saying
 * what is wrong (the file is closed again). */
int moe_st_open(const char *path, moe_st_file *f, moe_status *st);
const moe_st_entry *moe_st_find(const moe_st_file *f, const char *name);
/* Read the entry's bytes into out (entry->end - entry->begin bytes). */
int moe_st_read(const moe_st_file *f, const moe_st_entry *e, void *out, moe_status *st);
void moe_st_close(moe_st_file *f);

#endif
