/* SPDX-License-Identifier: MIT */
/* fuzz_config.c — libFuzzer target: a preset file's text, through the parser
 * and the validation every rank runs. Built by `make fuzz` (clang). */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "moe/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[64];
    snprintf(path, sizeof path, "/tmp/moe-ep-fuzz-%ld.conf", (long)getpid());
    FILE *fp = fopen(path, "wb");
    if (!fp)
        return 0;
    fwrite(data, 1, size, fp);
    fclose(fp);
    for (int command = MOE_CMD_RUN; command <= MOE_CMD_PLAN; command++) {
        moe_config cfg;
        moe_status st = {0};
        moe_config_defaults(&cfg);
        char *argv[] = {"--preset", path};
        if (moe_config_parse(&cfg, (enum moe_command)command, 2, argv, &st) == MOE_EXIT_OK &&
            command == MOE_CMD_RUN)
            moe_config_validate(&cfg, 4, &st);
    }
    unlink(path);
    return 0;
}
