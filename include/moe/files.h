/* SPDX-License-Identifier: MIT */
/* files.h — output files: written atomically, and their paths checked before
 * a run starts. Every file moe-ep writes goes through here. No MPI. */
#ifndef MOE_FILES_H
#define MOE_FILES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "moe/common.h"

/* Write a file atomically: the writer fills a temporary file beside path,
 * which is renamed over path only if everything was written. Returns
 * MOE_EXIT_OK, or MOE_EXIT_RUNTIME with st naming the path and the reason;
 * nothing is left behind on failure. */
/* The temporary path moe_write_file_atomic writes before its rename:
 * PATH.tmp.PID. */
void moe_temp_path(const char *path, char *tmp, size_t size);

int moe_write_file_atomic(const char *path, void (*writer)(FILE *, const void *),
                          const void *arg, moe_status *st);

/* Usage checks before a run, by trying rather than asking (access() says
 * yes to root on a read-only mount): each creates and removes a probe file
 * where the output will go. Returns MOE_EXIT_OK or MOE_EXIT_USAGE naming flag.
 *
 * A file: path names a file (no trailing slash), is not a directory, a
 * device or a dangling symbolic link, and its directory takes new files. */
int moe_check_output_path(const char *flag, const char *path, moe_status *st);

/* A directory (trailing slashes allowed): it is one or does not exist yet,
 * is not a dangling link, and its parent takes new entries (new contents are
 * built beside it and swapped in). */
int moe_check_output_dir(const char *flag, const char *dir, moe_status *st);

/* path without its trailing slashes ("/" stays "/"). */
void moe_path_strip_slashes(const char *path, char *out, size_t size);

/* The place path names, for telling whether two outputs collide: its
 * parent's real path, then its last component. False if the parent does not
 * exist. */
bool moe_path_identity(const char *path, char *out, size_t size);

#endif
