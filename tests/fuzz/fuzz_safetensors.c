/* SPDX-License-Identifier: MIT */
/* fuzz_safetensors.c — libFuzzer target: any bytes as a safetensors file,
 * through the validating reader and a read of every tensor it accepts.
 * Built by `make fuzz` (clang). */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "moe/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[64];
    snprintf(path, sizeof path, "/tmp/moe-ep-fuzz-%ld.safetensors", (long)getpid());
    FILE *fp = fopen(path, "wb");
    if (!fp)
        return 0;
    fwrite(data, 1, size, fp);
    fclose(fp);
    moe_st_file f;
    moe_status st = {0};
    if (moe_st_open(path, &f, &st) == MOE_EXIT_OK) {
        for (int n = 0; n < f.count; n++) {
            void *buffer = malloc((size_t)(f.entries[n].end - f.entries[n].begin) + 1);
            moe_st_read(&f, &f.entries[n], buffer, &st);
            free(buffer);
        }
        moe_st_close(&f);
    }
    unlink(path);
    return 0;
}
