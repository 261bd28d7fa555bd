/* files.h — output files: written atomically, and their paths checked before
 * a run starts. Every file moe-ep writes goes through here. No MPI. */
#ifndef MOE_FILES_H
#define MOE_FILES_H

#include <stdio.h>

#include "moe/common.h"

/* Write a file atomically: the writer fills a temporary file beside path,
 * which is renamed over path only if everything was written. Returns
 * MOE_EXIT_OK, or MOE_EXIT_RUNTIME with st naming the path and the reason;
 * nothing is left behind on failure. */
int moe_write_file_atomic(const char *path, void (*writer)(FILE *, const void *),
                          const void *arg, moe_status *st);

/* Usage check before a run: can a file be created at path? (Its directory
 * exists and is writable.) Returns MOE_EXIT_OK or MOE_EXIT_USAGE naming flag. */
int moe_check_output_path(const char *flag, const char *path, moe_status *st);

/* Usage check before a run: can dir be written? (It is a writable directory,
 * or it does not exist and its parent is writable.) */
int moe_check_output_dir(const char *flag, const char *dir, moe_status *st);

#endif
