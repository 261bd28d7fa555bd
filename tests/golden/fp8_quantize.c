/* SPDX-License-Identifier: MIT */
/* fp8_quantize — moe-ep's E4M3 block quantiser on a file, for
 * tests/golden/fp8_recipes.py to compare with each upstream recipe restated
 * in numpy:
 *
 *   fp8_quantize RECIPE float|ue8m0 WIDTH IN.f32 OUT
 *
 * IN holds rows of WIDTH little-endian float32 values; OUT receives, for
 * every row, its WIDTH E4M3 bytes, then its ceil(WIDTH/128) float32 scales. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe/quant.h"

int main(int argc, char **argv)
{
    static const char *const recipes[] = {"moe", "deepep", "deepgemm", "v3"};
    if (argc != 6) {
        fprintf(stderr, "usage: fp8_quantize RECIPE float|ue8m0 WIDTH IN.f32 OUT\n");
        return 2;
    }
    moe_fp8_format fmt = {MOE_FP8_RECIPE_MOE, strcmp(argv[2], "ue8m0") == 0};
    int known = 0;
    for (int r = 0; r < 4; r++)
        if (!strcmp(argv[1], recipes[r])) {
            fmt.recipe = (enum moe_fp8_recipe)r;
            known = 1;
        }
    const long width = atol(argv[3]);
    FILE *in = fopen(argv[4], "rb"), *out = fopen(argv[5], "wb");
    if (!known || width <= 0 || !in || !out) {
        fprintf(stderr, "fp8_quantize: bad recipe, width or file\n");
        return 2;
    }
    const moe_index blocks = moe_fp8_blocks(width);
    float *x = malloc(sizeof(float) * (size_t)width), *scales = malloc(sizeof(float) * (size_t)blocks);
    uint8_t *q = malloc((size_t)width);
    while (fread(x, sizeof(float), (size_t)width, in) == (size_t)width) {
        moe_quantize_e4m3_row(x, width, fmt, q, scales, NULL);
        fwrite(q, 1, (size_t)width, out);
        fwrite(scales, sizeof(float), (size_t)blocks, out);
    }
    free(q);
    free(scales);
    free(x);
    fclose(in);
    return fclose(out) == 0 ? 0 : 1;
}
