/* SPDX-License-Identifier: MIT */
/* golden.c — writing golden sets (see golden.h; verify.c reads them). */
#define _GNU_SOURCE
#include "moe/golden.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <ctype.h>
#include <stdio.h>
#include <jansson.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config.h"
#include "moe/files.h"
#include "moe/quant.h"
#include "moe/sha256.h"

const char *const moe_golden_stage_names[MOE_GOLDEN_STAGES] = {
    "inputs", "router", "layout", "dispatch", "experts", "output", "backward",
};
static const char *const rule_names[] = {"exact", "tolerance", "topk"};

/* ---- writing ------------------------------------------------------------ */

static json_t *tensor_json(const moe_golden_tensor *g)
{
    json_t *t = json_object(), *shape = json_array();
    for (int dim = 0; dim < g->tensor.ndim; dim++)
        json_array_append_new(shape, json_integer(g->tensor.shape[dim]));
    json_object_set_new(t, "file", json_sprintf("%s.safetensors", moe_golden_stage_names[g->stage]));
    json_object_set_new(t, "stage", json_string(moe_golden_stage_names[g->stage]));
    json_object_set_new(t, "dtype", json_string(moe_st_dtype_name(g->tensor.dtype)));
    json_object_set_new(t, "shape", shape);
    json_object_set_new(t, "compare", json_string(rule_names[g->rule]));
    json_object_set_new(t, "abs", json_real(g->abs));
    json_object_set_new(t, "rel", json_real(g->rel));
    if (g->allow)
        json_object_set_new(t, "allow", json_string(g->allow));
    if (g->bf16_step)
        json_object_set_new(t, "bf16_step", json_true());
    return t;
}

static void write_json(FILE *fp, const void *manifest)
{
    json_dumpf((const json_t *)manifest, fp, JSON_INDENT(1) | JSON_PRESERVE_ORDER);
}


/* ---- the set's directory -------------------------------------------------
 *
 * A set is written into DIR.partial.HOST.PID beside DIR, its files are read
 * back against the checksums the writer computed, and only then is it
 * swapped in: renameat2(RENAME_EXCHANGE) where the filesystem has it, two
 * renames otherwise. A failure before the swap removes the new directory and
 * leaves DIR as it was; a killed writer leaves DIR.partial.HOST.PID, which the
 * next dump into DIR removes once that process is gone. Nothing is removed
 * that holds anything but a set's own entries. */

/* May `name` sit in a set's directory? The stage files, the manifest, and
 * their temporaries NAME.tmp.PID. */
static bool set_entry(const char *name)
{
    const char *tmp = strstr(name, ".tmp.");
    const size_t len = tmp ? (size_t)(tmp - name) : strlen(name);
    if (tmp && (!tmp[5] || strspn(tmp + 5, "0123456789") != strlen(tmp + 5)))
        return false;
    if (len == strlen("manifest.json") && !strncmp(name, "manifest.json", len))
        return true;
    for (int s = 0; s < MOE_GOLDEN_STAGES; s++) {
        char file[64];
        snprintf(file, sizeof file, "%s.safetensors", moe_golden_stage_names[s]);
        if (len == strlen(file) && !strncmp(name, file, len))
            return true;
    }
    return false;
}

/* The first entry of dir that is not a set's, into `odd` ("" when none);
 * false if dir cannot be listed. */
static bool only_set_entries(const char *dir, char *odd, size_t size)
{
    DIR *d = opendir(dir);
    if (!d)
        return false;
    odd[0] = '\0';
    for (struct dirent *e; (e = readdir(d)) && !odd[0];)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && !set_entry(e->d_name))
            snprintf(odd, size, "%s", e->d_name);
    closedir(d);
    return true;
}

/* Remove dir if it holds nothing but a set's entries. */
static bool remove_set_dir(const char *dir)
{
    char odd[256];
    if (!only_set_entries(dir, odd, sizeof odd) || odd[0])
        return false;
    DIR *d = opendir(dir);
    if (!d)
        return false;
    for (struct dirent *e; (e = readdir(d));)
        if (set_entry(e->d_name)) {
            char path[2 * PATH_MAX];
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            unlink(path);
        }
    closedir(d);
    return rmdir(dir) == 0;
}

int moe_golden_check_target(const char *dir, moe_status *st)
{
    char path[PATH_MAX], odd[256];
    moe_path_strip_slashes(dir, path, sizeof path);
    struct stat info;
    if (stat(path, &info) != 0 || !S_ISDIR(info.st_mode))
        return MOE_EXIT_OK;
    if (!only_set_entries(path, odd, sizeof odd))
        return moe_fail(st, MOE_EXIT_USAGE, "--dump: cannot list '%s': %s", path, strerror(errno));
    if (odd[0])
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--dump: '%s' holds '%s', which is not part of a golden set; a dump "
                        "replaces the whole directory, so give a new or empty one", path, odd);
    return MOE_EXIT_OK;
}

/* Remove what killed dumps into `path` left beside it: DIR.partial.HOST.PID
 * of this host whose process is gone, holding only a set's entries. */
static void remove_stale(const char *path, const char *host)
{
    char copy[PATH_MAX], base_copy[PATH_MAX], prefix[PATH_MAX + 16];
    snprintf(copy, sizeof copy, "%s", path);
    snprintf(base_copy, sizeof base_copy, "%s", path);
    const char *parent = dirname(copy), *base = basename(base_copy);
    snprintf(prefix, sizeof prefix, "%s.partial.%s.", base, host);
    DIR *d = opendir(parent);
    if (!d)
        return;
    for (struct dirent *e; (e = readdir(d));) {
        const char *pid_text = e->d_name + strlen(prefix);
        if (strncmp(e->d_name, prefix, strlen(prefix)) || !*pid_text ||
            strspn(pid_text, "0123456789") != strlen(pid_text))
            continue;
        const long pid = strtol(pid_text, NULL, 10);
        if (pid <= 0 || pid == (long)getpid() || kill((pid_t)pid, 0) == 0 || errno != ESRCH)
            continue; /* a dump still writing */
        char stale[2 * PATH_MAX];
        snprintf(stale, sizeof stale, "%s/%s", parent, e->d_name);
        if (remove_set_dir(stale))
            printf("moe-ep: removed '%s', left by a dump that was killed (pid %ld)\n", stale, pid);
    }
    closedir(d);
}

/* Read every file back and compare it with the checksum its writer made. */
static int check_written(const char *work, json_t *files, moe_status *st)
{
    const char *name;
    json_t *file;
    json_object_foreach(files, name, file) {
        char path[2 * PATH_MAX], hex[65];
        snprintf(path, sizeof path, "%s/%s", work, name);
        if (!moe_golden_file_sha256(path, hex) || strcmp(hex, json_string_value(json_object_get(file, "sha256"))))
            return moe_fail(st, MOE_EXIT_RUNTIME, "--dump: '%s' does not read back as written", path);
    }
    return MOE_EXIT_OK;
}

/* Put work in path's place; the old contents of path (if any) are removed. */
static int swap_in(const char *work, const char *path, moe_status *st)
{
    struct stat info;
    if (stat(path, &info) != 0) {
        if (rename(work, path) != 0)
            return moe_fail(st, MOE_EXIT_RUNTIME, "--dump: cannot rename '%s' to '%s': %s", work,
                            path, strerror(errno));
        return MOE_EXIT_OK;
    }
    if (renameat2(AT_FDCWD, work, AT_FDCWD, path, RENAME_EXCHANGE) != 0) {
        /* No atomic exchange here: move the old set aside, then the new one in. */
        char old[2 * PATH_MAX];
        snprintf(old, sizeof old, "%s.old", work);
        if (rename(path, old) != 0)
            return moe_fail(st, MOE_EXIT_RUNTIME, "--dump: cannot move '%s' aside: %s", path,
                            strerror(errno));
        if (rename(work, path) != 0) {
            const int err = errno;
            rename(old, path);
            return moe_fail(st, MOE_EXIT_RUNTIME, "--dump: cannot rename '%s' to '%s': %s", work,
                            path, strerror(err));
        }
        remove_set_dir(old);
        return MOE_EXIT_OK;
    }
    remove_set_dir(work); /* now the old set */
    return MOE_EXIT_OK;
}

/* ---- writing, continued -------------------------------------------------- */

/* The manifest's top, before its files and tensors. */
static json_t *manifest_head(const char *config_json, const moe_golden_tensor *tensors, int n)
{
    json_error_t error;
    json_t *config = json_loads(config_json, 0, &error);
    MOE_ASSERT(config != NULL && json_is_object(config)); /* built with jansson by the caller */
    json_t *manifest = json_object();
    json_object_set_new(manifest, "format", json_string("moe-ep golden set"));
    json_object_set_new(manifest, "format_version", json_integer(1));
    json_object_set_new(manifest, "moe_ep_version", json_string(PACKAGE_VERSION));
    json_object_set_new(manifest, "config", config);
    json_t *stages = json_array();
    for (int s = 0; s < MOE_GOLDEN_STAGES; s++) { /* those the set holds, in pipeline order */
        bool held = false;
        for (int i = 0; i < n; i++)
            held |= (int)tensors[i].stage == s;
        if (held)
            json_array_append_new(stages, json_string(moe_golden_stage_names[s]));
    }
    json_object_set_new(manifest, "stages", stages);
    /* What verify accepts beside the tensors listed: DeepEP's conventions,
     * FP8 rows with their scales (docs/golden.md, "What verify reads"). */
    json_object_set_new(manifest, "accepted", json_pack(
        "{s:s, s:s, s:s, s:s, s:s, s:s, s:s, s:s}",
        "layout.rank{r}.tokens_per_rank", "(G) row r of layout.send_counts",
        "layout.rank{r}.is_token_in_rank", "(T, G) rows r*T .. r*T+T-1 of layout.is_token_in_rank",
        "layout.rank{r}.tokens_per_expert", "(E) (token, expert) pairs of rank r's tokens per expert",
        "router.topk_ids in any order per token", "matched as a set; router.topk_weights follow their ids",
        "experts.rank{r}.out with experts.rank{r}.row", "rows in any order; row[i] is candidate row i's golden row",
        "NAME as F8_E4M3 with NAME.scale", "scale per block of 128: F32, U8 UE8M0 exponents, or packed I32 (4 per element)",
        "NAME.scale of a golden scale tensor", "as F32, U8 UE8M0 exponents, or packed I32",
        "dispatch.rank{r}.layout.* (masked) in arrival order", "slots matched by the token .src names: a "
        "global id, or with dispatch.rank{r}.layout.range (EL, G) I64 (begin << 32 | count) the index within "
        "the source rank"));
    return manifest;
}

/* The stage files and the manifest, into work. */
static int write_files(const char *work, const moe_golden_tensor *tensors, int n,
                       json_t *manifest, double *bytes, moe_status *st)
{
    json_t *files = json_object(), *list = json_object();
    json_object_set_new(manifest, "files", files);
    json_object_set_new(manifest, "tensors", list);
    *bytes = 0.0;
    int rc = MOE_EXIT_OK, written = 0;
    moe_st_tensor *batch = moe_xmalloc(sizeof(moe_st_tensor) * (size_t)(n ? n : 1));
    for (int stage = 0; stage < MOE_GOLDEN_STAGES && rc == MOE_EXIT_OK; stage++) {
        int count = 0;
        for (int i = 0; i < n; i++)
            if ((int)tensors[i].stage == stage) {
                batch[count++] = tensors[i].tensor;
                json_object_set_new(list, tensors[i].tensor.name, tensor_json(&tensors[i]));
            }
        if (count == 0)
            continue;
        char path[2 * PATH_MAX], hex[65], name[64], meta[160];
        snprintf(name, sizeof name, "%s.safetensors", moe_golden_stage_names[stage]);
        snprintf(path, sizeof path, "%s/%s", work, name);
        snprintf(meta, sizeof meta, "{\"format\": \"moe-ep golden set\", \"stage\": \"%s\"}",
                 moe_golden_stage_names[stage]);
        rc = moe_st_write(path, batch, count, meta, hex, st);
        struct stat info;
        if (rc == MOE_EXIT_OK && stat(path, &info) == 0) {
            json_object_set_new(files, name, json_pack("{s:s, s:I}", "sha256", hex, "bytes",
                                                       (json_int_t)info.st_size));
            *bytes += (double)info.st_size;
        }
        if (rc == MOE_EXIT_OK && written++ == 0) { /* the tests' stand-ins for a full disk, a kill */
            if (moe_fault_armed(moe_message_rank, "write"))
                rc = moe_fail(st, MOE_EXIT_RUNTIME, "cannot write '%s': injected fault at stage "
                              "write on rank %d (MOE_EP_FAULT)", path, moe_message_rank);
            if (moe_fault_armed(moe_message_rank, "kill"))
                raise(SIGKILL);
            if (moe_fault_armed(moe_message_rank, "term"))
                raise(SIGTERM);
        }
    }
    free(batch);
    if (rc == MOE_EXIT_OK) {
        char path[2 * PATH_MAX];
        snprintf(path, sizeof path, "%s/manifest.json", work);
        rc = moe_write_file_atomic(path, write_json, manifest, st);
    }
    return rc;
}

/* SIGINT and SIGTERM while a set is being written (Ctrl-C, which mpirun
 * passes on as SIGTERM): the work directory's files, their temporaries and
 * the directory itself are removed, then the signal ends the process as it
 * would have. The paths are made before the handler is armed: it calls
 * only unlink, rmdir, sigaction and raise. */
enum { CLEANUP_FILES = 2 * (MOE_GOLDEN_STAGES + 1) };
static char cleanup_dir[PATH_MAX + 96];
static char cleanup_file[CLEANUP_FILES][2 * PATH_MAX + 160];
static struct sigaction cleanup_old[2];
static const int cleanup_signals[2] = {SIGINT, SIGTERM};

static void cleanup_on_signal(int sig)
{
    for (int n = 0; n < CLEANUP_FILES; n++)
        unlink(cleanup_file[n]);
    rmdir(cleanup_dir);
    for (int s = 0; s < 2; s++)
        sigaction(cleanup_signals[s], &cleanup_old[s], NULL);
    raise(sig);
}

/* Arm (work not NULL) or disarm the clean-up of work. */
static void cleanup_arm(const char *work)
{
    if (!work) {
        for (int s = 0; s < 2; s++)
            sigaction(cleanup_signals[s], &cleanup_old[s], NULL);
        return;
    }
    snprintf(cleanup_dir, sizeof cleanup_dir, "%s", work);
    for (int stage = 0; stage <= MOE_GOLDEN_STAGES; stage++) {
        char name[64];
        if (stage < MOE_GOLDEN_STAGES)
            snprintf(name, sizeof name, "%s.safetensors", moe_golden_stage_names[stage]);
        else
            snprintf(name, sizeof name, "manifest.json");
        snprintf(cleanup_file[2 * stage], sizeof cleanup_file[0], "%s/%s", work, name);
        moe_temp_path(cleanup_file[2 * stage], cleanup_file[2 * stage + 1], sizeof cleanup_file[0]);
    }
    struct sigaction on = {.sa_handler = cleanup_on_signal};
    sigemptyset(&on.sa_mask);
    for (int s = 0; s < 2; s++)
        sigaction(cleanup_signals[s], &on, &cleanup_old[s]);
}

int moe_golden_write(const char *dir, const moe_golden_tensor *tensors, int n,
                     const char *config_json, double *bytes, moe_status *st)
{
    char path[PATH_MAX], work[PATH_MAX + 96], host[64] = "host";
    moe_path_strip_slashes(dir, path, sizeof path);
    gethostname(host, sizeof host - 1);
    host[strcspn(host, "/.")] = '\0';
    remove_stale(path, host);
    snprintf(work, sizeof work, "%s.partial.%s.%ld", path, host, (long)getpid());
    if (mkdir(work, 0777) != 0)
        return moe_fail(st, MOE_EXIT_RUNTIME, "--dump: cannot create '%s': %s", work, strerror(errno));
    cleanup_arm(work);
    json_t *manifest = manifest_head(config_json, tensors, n);
    int rc = write_files(work, tensors, n, manifest, bytes, st);
    if (rc == MOE_EXIT_OK)
        rc = check_written(work, json_object_get(manifest, "files"), st);
    json_decref(manifest);
    if (rc == MOE_EXIT_OK)
        rc = swap_in(work, path, st);
    if (rc != MOE_EXIT_OK)
        remove_set_dir(work); /* the old set stays as it was */
    cleanup_arm(NULL);
    return rc;
}

/* A file's SHA-256 as hex. */
bool moe_golden_file_sha256(const char *path, char hex[65])
{
    moe_status ignored = {0};
    FILE *fp = moe_open_input("", path, &ignored);
    if (!fp)
        return false;
    moe_sha256 h;
    moe_sha256_init(&h);
    char buffer[1 << 16];
    size_t got;
    while ((got = fread(buffer, 1, sizeof buffer, fp)) > 0)
        moe_sha256_update(&h, buffer, got);
    fclose(fp);
    uint8_t digest[32];
    moe_sha256_final(&h, digest);
    moe_sha256_hex(digest, hex);
    return true;
}
