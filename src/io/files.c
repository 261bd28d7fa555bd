/* files.c — atomic output files and output path checks (see files.h). */
#define _POSIX_C_SOURCE 200809L
#include "moe/files.h"

#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <stdbool.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int moe_write_file_atomic(const char *path, void (*writer)(FILE *, const void *),
                          const void *arg, moe_status *st)
{
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
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

int moe_check_output_path(const char *flag, const char *path, moe_status *st)
{
    char copy[PATH_MAX];
    snprintf(copy, sizeof copy, "%s", path);
    const char *dir = dirname(copy);
    if (!*path || path[strlen(path) - 1] == '/')
        return moe_fail(st, MOE_EXIT_USAGE, "%s needs a file name, got '%s'", flag, path);
    if (access(dir, W_OK) != 0)
        return moe_fail(st, MOE_EXIT_USAGE, "%s: cannot create '%s': directory '%s' %s", flag,
                        path, dir, errno == ENOENT ? "does not exist" : "is not writable");
    return MOE_EXIT_OK;
}

int moe_check_output_dir(const char *flag, const char *dir, moe_status *st)
{
    struct stat info;
    if (stat(dir, &info) == 0) {
        if (!S_ISDIR(info.st_mode))
            return moe_fail(st, MOE_EXIT_USAGE, "%s: '%s' exists and is not a directory", flag, dir);
        if (access(dir, W_OK) != 0)
            return moe_fail(st, MOE_EXIT_USAGE, "%s: directory '%s' is not writable", flag, dir);
        return MOE_EXIT_OK;
    }
    char copy[PATH_MAX];
    snprintf(copy, sizeof copy, "%s", dir);
    const char *parent = dirname(copy);
    if (access(parent, W_OK) != 0)
        return moe_fail(st, MOE_EXIT_USAGE, "%s: cannot create '%s': directory '%s' %s", flag, dir,
                        parent, errno == ENOENT ? "does not exist" : "is not writable");
    return MOE_EXIT_OK;
}
