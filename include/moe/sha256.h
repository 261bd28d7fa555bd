/* SPDX-License-Identifier: MIT */
/* sha256.h — SHA-256 (FIPS 180-4), for the checksums of golden files. Pure. */
#ifndef MOE_SHA256_H
#define MOE_SHA256_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint32_t state[8];
    uint64_t length; /* bytes hashed so far */
    uint8_t block[64];
    size_t used;     /* bytes in block */
} moe_sha256;

void moe_sha256_init(moe_sha256 *h);
void moe_sha256_update(moe_sha256 *h, const void *data, size_t bytes);
void moe_sha256_final(moe_sha256 *h, uint8_t digest[32]);
/* Use the portable compression even where the CPU's SHA extensions would
 * serve (the tests compare the two). */
void moe_sha256_portable(bool on);
/* digest as 64 lowercase hex digits and a NUL. */
void moe_sha256_hex(const uint8_t digest[32], char hex[65]);

#endif
