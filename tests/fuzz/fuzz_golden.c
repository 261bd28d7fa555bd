/* SPDX-License-Identifier: MIT */
/* fuzz_golden.c — libFuzzer target: any bytes as the manifest.json of a
 * golden set whose tensor files are a shipped set's (copied once into a
 * scratch directory), verified against that set's own output.safetensors.
 * Inputs that keep the checksums reach the comparisons. Built by `make fuzz`. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "moe/golden.h"

static const char *const files[] = {"inputs", "router", "layout", "dispatch", "experts", "output"};

static void copy(const char *from, const char *to)
{
    FILE *in = fopen(from, "rb"), *out = fopen(to, "wb");
    char block[1 << 16];
    for (size_t got; in && out && (got = fread(block, 1, sizeof block, in)) > 0;)
        fwrite(block, 1, got, out);
    if (in)
        fclose(in);
    if (out)
        fclose(out);
}

static const char *scratch(void)
{
    static char dir[64];
    if (dir[0])
        return dir;
    snprintf(dir, sizeof dir, "/tmp/moe-ep-fuzz-golden-%ld", (long)getpid());
    char command[128];
    snprintf(command, sizeof command, "mkdir -p %s", dir);
    if (system(command) != 0)
        abort();
    for (size_t n = 0; n < sizeof files / sizeof files[0]; n++) {
        char from[512], to[128];
        snprintf(from, sizeof from, "%s/golden/softmax-fp32/%s.safetensors", MOE_SOURCE_DATA_DIR, files[n]);
        snprintf(to, sizeof to, "%s/%s.safetensors", dir, files[n]);
        copy(from, to);
    }
    return dir;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *dir = scratch();
    char manifest[128], candidate[128];
    snprintf(manifest, sizeof manifest, "%s/manifest.json", dir);
    snprintf(candidate, sizeof candidate, "%s/output.safetensors", dir);
    FILE *fp = fopen(manifest, "wb");
    if (!fp)
        return 0;
    fwrite(data, 1, size, fp);
    fclose(fp);
    FILE *out = fopen("/dev/null", "w");
    moe_status st = {0};
    moe_golden_verify(dir, candidate, NULL, out, NULL, &st);
    fclose(out);
    return 0;
}
