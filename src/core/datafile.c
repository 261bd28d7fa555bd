/* SPDX-License-Identifier: MIT */
/* datafile.c — where presets and cluster files are found: the data path
 * (MOE_EP_DATA_DIR, the source tree's data/, the installed share/moe-ep)
 * and opening a .conf by name or path (see config.h).
 */
#define _POSIX_C_SOURCE 200809L
#include "moe/config.h"

#include <ctype.h>
#include <dirent.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef MOE_SOURCE_DATA_DIR
#define MOE_SOURCE_DATA_DIR "data"
#endif
#ifndef MOE_INSTALLED_DATA_DIR
#define MOE_INSTALLED_DATA_DIR "/usr/local/share/moe-ep"
#endif

const char *moe_config_data_path(const char *kind)
{
    static char path[4 * PATH_MAX];
    const char *env = getenv("MOE_EP_DATA_DIR");
    snprintf(path, sizeof path, "%s%s%s%s%s/%s:%s/%s", env ? env : "", env ? "/" : "",
             env ? kind : "", env ? ":" : "", MOE_SOURCE_DATA_DIR, kind, MOE_INSTALLED_DATA_DIR,
             kind);
    return path;
}

static bool valid_name(const char *name)
{
    if (!*name)
        return false;
    for (const char *c = name; *c; c++)
        if (!isalnum((unsigned char)*c) && *c != '-' && *c != '_')
            return false;
    return true;
}

/* Names of the .conf files of `kind` in its search path, for a hint. */
static void list_names(const char *kind, char *out, size_t size)
{
    char path[4 * PATH_MAX];
    snprintf(path, sizeof path, "%s", moe_config_data_path(kind));
    out[0] = '\0';
    size_t used = 0;
    for (char *save = NULL, *dir = strtok_r(path, ":", &save); dir;
         dir = strtok_r(NULL, ":", &save)) {
        DIR *d = opendir(dir);
        if (!d)
            continue;
        for (struct dirent *ent; (ent = readdir(d));) {
            size_t len = strlen(ent->d_name);
            if (len <= 5 || strcmp(ent->d_name + len - 5, ".conf"))
                continue;
            int n = snprintf(out + used, size - used, "%s%.*s", used ? ", " : "",
                             (int)(len - 5), ent->d_name);
            if (n < 0 || (size_t)n >= size - used)
                break;
            used += (size_t)n;
        }
        closedir(d);
        if (used)
            break;
    }
}

FILE *moe_config_open_conf(const char *flag, const char *kind, const char *name, char *file,
                       size_t size, moe_status *st)
{
    if (strchr(name, '/')) {
        snprintf(file, size, "%s", name);
        char what[32];
        snprintf(what, sizeof what, "--%s: ", flag);
        return moe_open_input(what, file, st);
    }
    if (!valid_name(name)) {
        moe_fail(st, MOE_EXIT_USAGE,
                 "--%s must be a name of letters, digits, '-' and '_', or a path, got '%s'", flag,
                 name);
        return NULL;
    }
    char path[4 * PATH_MAX];
    snprintf(path, sizeof path, "%s", moe_config_data_path(kind));
    for (char *save = NULL, *dir = strtok_r(path, ":", &save); dir;
         dir = strtok_r(NULL, ":", &save)) {
        snprintf(file, size, "%s/%s.conf", dir, name);
        if (access(file, F_OK) == 0) {
            char what[32];
            snprintf(what, sizeof what, "--%s: ", flag);
            return moe_open_input(what, file, st);
        }
    }
    char known[512];
    list_names(kind, known, sizeof known);
    moe_fail(st, MOE_EXIT_USAGE, "unknown %s '%s' (available: %s)", flag, name,
             known[0] ? known : "none found");
    return NULL;
}
