/* SPDX-License-Identifier: MIT */
/* files.c — atomic output files and output path checks (see files.h). */
#define _GNU_SOURCE
#include "moe/files.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

void moe_temp_path(const char *path, char *tmp, size_t size)
{
    snprintf(tmp, size, "%s.tmp.%ld", path, (long)getpid());
}

int moe_write_file_atomic(const char *path, void (*writer)(FILE *, const void *),
                          const void *arg, moe_status *st)
{
    char tmp[PATH_MAX];
    moe_temp_path(path, tmp, sizeof tmp);
    FILE *fp = fopen(tmp, "w");
    if (!fp)
        return moe_fail(st, MOE_EXIT_RUNTIME, "cannot write '%s': %s", tmp, strerror(errno));
    writer(fp, arg);
    const bool ok = !ferror(fp) && fflush(fp) == 0;
    const int saved = errno;
    if (fclose(fp) != 0 || !ok) {
        unlink(tmp);
        return moe_fail(st, MOE_EXIT_RUNTIME, "cannot write '%s': %s", path,
                        strerror(ok ? errno : saved));
    }
    if (rename(tmp, path) != 0) {
        const int err = errno;
        unlink(tmp);
        return moe_fail(st, MOE_EXIT_RUNTIME, "cannot rename '%s' to '%s': %s", tmp, path,
                        strerror(err));
    }
    return MOE_EXIT_OK;
}

void moe_path_strip_slashes(const char *path, char *out, size_t size)
{
    snprintf(out, size, "%s", path);
    for (size_t len = strlen(out); len > 1 && out[len - 1] == '/'; len--)
        out[len - 1] = '\0';
}

/* Can files be created in dir? Tried, not asked: access() says yes to root
 * on a read-only mount and in /proc. */
static int probe_dir(const char *flag, const char *path, const char *dir, moe_status *st)
{
    struct stat info;
    if (stat(dir, &info) != 0)
        return moe_fail(st, MOE_EXIT_USAGE, "%s: cannot create '%s': directory '%s' %s", flag,
                        path, dir, errno == ENOENT ? "does not exist" : strerror(errno));
    if (!S_ISDIR(info.st_mode))
        return moe_fail(st, MOE_EXIT_USAGE, "%s: cannot create '%s': '%s' is not a directory",
                        flag, path, dir);
    char probe[PATH_MAX];
    snprintf(probe, sizeof probe, "%s/.moe-ep-probe.%ld", dir, (long)getpid());
    const int fd = open(probe, O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
        return moe_fail(st, MOE_EXIT_USAGE, "%s: cannot create '%s': directory '%s': %s", flag,
                        path, dir, strerror(errno));
    close(fd);
    unlink(probe);
    return MOE_EXIT_OK;
}

/* What lstat/stat say of path when it exists: a dangling link is refused. */
static int existing(const char *flag, const char *path, struct stat *info, bool *exists,
                    moe_status *st)
{
    struct stat link;
    *exists = stat(path, info) == 0;
    if (!*exists && lstat(path, &link) == 0)
        return moe_fail(st, MOE_EXIT_USAGE, "%s: '%s' is a symbolic link to nothing", flag, path);
    return MOE_EXIT_OK;
}

int moe_check_output_path(const char *flag, const char *path, moe_status *st)
{
    if (!*path || path[strlen(path) - 1] == '/')
        return moe_fail(st, MOE_EXIT_USAGE, "%s needs a file name, got '%s'", flag, path);
    struct stat info;
    bool exists;
    if (existing(flag, path, &info, &exists, st))
        return st->code;
    if (exists && S_ISDIR(info.st_mode))
        return moe_fail(st, MOE_EXIT_USAGE, "%s: '%s' is a directory; give a file name", flag, path);
    if (exists && !S_ISREG(info.st_mode))
        return moe_fail(st, MOE_EXIT_USAGE, "%s: '%s' exists and is not a regular file", flag, path);
    char copy[PATH_MAX];
    snprintf(copy, sizeof copy, "%s", path);
    return probe_dir(flag, path, dirname(copy), st);
}

int moe_check_output_dir(const char *flag, const char *dir, moe_status *st)
{
    char path[PATH_MAX], copy[PATH_MAX];
    moe_path_strip_slashes(dir, path, sizeof path);
    snprintf(copy, sizeof copy, "%s", path);
    const char *last = basename(copy);
    if (!*path || !strcmp(last, ".") || !strcmp(last, "..") || !strcmp(last, "/"))
        return moe_fail(st, MOE_EXIT_USAGE,
                        "%s needs a directory name it can replace, not '%s' (give e.g. %s/golden)",
                        flag, dir, *path ? path : ".");
    struct stat info;
    bool exists;
    if (existing(flag, path, &info, &exists, st))
        return st->code;
    if (exists && !S_ISDIR(info.st_mode))
        return moe_fail(st, MOE_EXIT_USAGE, "%s: '%s' exists and is not a directory", flag, path);
    struct stat link;
    if (lstat(path, &link) == 0 && S_ISLNK(link.st_mode)) /* the swap would move the link, not the set */
        return moe_fail(st, MOE_EXIT_USAGE,
                        "%s: '%s' is a symbolic link; give the directory it points to", flag, path);
    /* The new contents are built beside it, then swapped in. */
    snprintf(copy, sizeof copy, "%s", path);
    return probe_dir(flag, path, dirname(copy), st);
}

bool moe_path_identity(const char *path, char *out, size_t size)
{
    char stripped[PATH_MAX], a[PATH_MAX], b[PATH_MAX], parent[PATH_MAX];
    moe_path_strip_slashes(path, stripped, sizeof stripped);
    snprintf(a, sizeof a, "%s", stripped);
    snprintf(b, sizeof b, "%s", stripped);
    if (!realpath(dirname(a), parent))
        return false;
    const char *base = basename(b);
    snprintf(out, size, "%s/%s", strcmp(parent, "/") ? parent : "", base);
    return true;
}
