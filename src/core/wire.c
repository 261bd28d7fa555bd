/* SPDX-License-Identifier: MIT */
/* wire.c — rows as they travel (see wire.h). */
#include "moe/wire.h"

#include <math.h>
#include <string.h>

#include "moe/layout.h"

static moe_wire wire_of(int dtype, const moe_config *cfg)
{
    moe_wire w = {.dtype = dtype, .hidden = cfg->hidden};
    w.fp8 = (moe_fp8_format){(enum moe_fp8_recipe)cfg->fp8_recipe, cfg->fp8_scale == MOE_FP8_SCALE_UE8M0};
    const size_t d = (size_t)cfg->hidden;
    if (dtype == MOE_DTYPE_FP8) {
        w.scale_bytes = w.fp8.pow2 ? 1 : sizeof(float);
        w.bytes = d + (size_t)moe_fp8_blocks(cfg->hidden) * w.scale_bytes;
    } else {
        w.bytes = d * (dtype == MOE_DTYPE_BF16 ? 2 : 4);
    }
    return w;
}

moe_wire moe_wire_dispatch(const moe_config *cfg) { return wire_of(cfg->dispatch_dtype, cfg); }
moe_wire moe_wire_combine(const moe_config *cfg) { return wire_of(cfg->combine_dtype, cfg); }

/* A power-of-two scale as UE8M0: its biased exponent; anything else (a
 * non-finite scale of a non-finite block) as 0xFF, which decodes to NaN. */
static uint8_t ue8m0(float s)
{
    uint32_t bits;
    memcpy(&bits, &s, sizeof bits);
    const uint32_t exponent = bits >> 23 & 0xff;
    return (bits & 0x807fffff) == 0 && exponent > 0 && exponent < 0xff ? (uint8_t)exponent : 0xff;
}

static float from_ue8m0(uint8_t e)
{
    if (e == 0xff)
        return NAN;
    const uint32_t bits = (uint32_t)e << 23;
    float s;
    memcpy(&s, &bits, sizeof s);
    return s;
}

static void encode_row(const moe_wire *w, const float *x, uint8_t *out)
{
    const moe_index d = w->hidden;
    if (w->dtype == MOE_DTYPE_FP32) {
        memcpy(out, x, sizeof(float) * (size_t)d);
    } else if (w->dtype == MOE_DTYPE_BF16) {
        for (moe_index j = 0; j < d; j++) {
            const uint16_t h = moe_f32_to_bf16(x[j]);
            memcpy(out + 2 * j, &h, sizeof h);
        }
    } else {
        float scales[65536 / MOE_FP8_BLOCK]; /* d <= 65536 (config.c) */
        moe_quantize_e4m3_row(x, d, w->fp8, out, scales, NULL);
        uint8_t *at = out + d;
        for (moe_index b = 0; b < moe_fp8_blocks(d); b++) {
            if (w->scale_bytes == 1)
                at[b] = ue8m0(scales[b]);
            else
                memcpy(at + (size_t)b * sizeof(float), &scales[b], sizeof(float));
        }
    }
}

void moe_wire_encode(const moe_wire *w, const float *x, const moe_index *row_index, moe_index rows,
                     uint8_t *out)
{
    const moe_index d = w->hidden;
#pragma omp parallel for schedule(static) if (rows * d > 65536)
    for (moe_index i = 0; i < rows; i++)
        encode_row(w, x + (row_index ? row_index[i] : i) * d, out + (size_t)i * w->bytes);
}

/* Every E4M3 byte's value, as moe_e4m3_to_f32 gives it, filled at load. */
static float e4m3[256];

__attribute__((constructor)) static void fill_e4m3(void)
{
    for (int q = 0; q < 256; q++)
        e4m3[q] = moe_e4m3_to_f32((uint8_t)q);
}

void moe_wire_decode(const moe_wire *w, const uint8_t *in, moe_index rows, float *out)
{
    const moe_index d = w->hidden;
#pragma omp parallel for schedule(static) if (rows * d > 65536)
    for (moe_index i = 0; i < rows; i++) {
        const uint8_t *row = in + (size_t)i * w->bytes;
        float *values = out + i * d;
        if (w->dtype == MOE_DTYPE_FP32) {
            memcpy(values, row, sizeof(float) * (size_t)d);
        } else if (w->dtype == MOE_DTYPE_BF16) {
            for (moe_index j = 0; j < d; j++) {
                uint16_t h;
                memcpy(&h, row + 2 * j, sizeof h);
                values[j] = moe_bf16_to_f32(h);
            }
        } else {
            const uint8_t *scales = row + d;
            for (moe_index j = 0; j < d; j++) {
                const moe_index b = j / MOE_FP8_BLOCK;
                float s;
                if (w->scale_bytes == 1)
                    s = from_ue8m0(scales[b]);
                else
                    memcpy(&s, scales + (size_t)b * sizeof(float), sizeof s);
                values[j] = e4m3[row[j]] * s;
            }
        }
    }
}

void moe_wire_scales(const moe_wire *w, const uint8_t *in, moe_index rows, float *scales)
{
    MOE_ASSERT(w->dtype == MOE_DTYPE_FP8);
    const moe_index d = w->hidden, blocks = (d + MOE_FP8_BLOCK - 1) / MOE_FP8_BLOCK;
    for (moe_index i = 0; i < rows; i++) {
        const uint8_t *at = in + (size_t)i * w->bytes + d;
        for (moe_index b = 0; b < blocks; b++) {
            if (w->scale_bytes == 1)
                scales[i * blocks + b] = from_ue8m0(at[b]);
            else
                memcpy(&scales[i * blocks + b], at + (size_t)b * sizeof(float), sizeof(float));
        }
    }
}

double moe_dispatch_row_bytes(const moe_config *cfg)
{
    return (double)moe_wire_dispatch(cfg).bytes + 4.0 * (double)MOE_META_WORDS(cfg->topk);
}

double moe_combine_row_bytes(const moe_config *cfg) { return (double)moe_wire_combine(cfg).bytes; }

double moe_backward_pair_bytes(const moe_config *cfg)
{
    return (double)moe_wire_dispatch(cfg).bytes + (double)moe_wire_combine(cfg).bytes + sizeof(float);
}

double moe_ll_row_bytes(const moe_config *cfg)
{
    return (double)moe_wire_dispatch(cfg).bytes + 4.0 * MOE_LL_META_WORDS;
}

double moe_ll_buffer_bytes(const moe_config *cfg, int ranks)
{
    const moe_wire cw = moe_wire_combine(cfg);
    const int64_t physical = cfg->experts + cfg->redundant_experts; /* --redundant-experts */
    const double E = (double)physical, G = ranks, k = (double)cfg->topk;
    const double EL = (double)moe_config_most_local_experts(cfg, ranks);
    const double N = (double)moe_config_max_tokens(cfg);
    const double row = moe_ll_row_bytes(cfg), out = (double)cw.bytes;
    return 32.0 + 8.0 * G * EL + 8.0 * E + N * k * (row + out) + EL * G * N * (row + out);
}

/* --mode low-latency: a forward of its own (ep_ll.c), one round each way;
 * and the tokens per rank its buffers and the masked layout hold. */
int moe_ll_validate(const moe_config *cfg, moe_status *st)
{
    const bool masked = moe_config_layout(cfg) == MOE_LAYOUT_MASKED;
    if (cfg->mode != MOE_MODE_LOW_LATENCY && !masked) {
        if (cfg->max_tokens_per_rank >= 0)
            return moe_fail(st, MOE_EXIT_USAGE,
                            "--max-tokens-per-rank sizes the low-latency mode's buffers and the "
                            "masked layout: add --mode low-latency or --expert-layout masked");
        return MOE_EXIT_OK;
    }
    if (cfg->max_tokens_per_rank >= 0 && cfg->max_tokens_per_rank < cfg->tokens)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--max-tokens-per-rank must be in [%lld, %d] (at least --tokens: a rank's "
                        "tokens must fit the fixed buffers), got %lld",
                        (long long)cfg->tokens, 1 << 24, (long long)cfg->max_tokens_per_rank);
    if (cfg->mode != MOE_MODE_LOW_LATENCY)
        return MOE_EXIT_OK;
    const char *other = cfg->backward                             ? "--backward"
                        : cfg->dispatch == MOE_DISPATCH_HIERARCHICAL ? "--dispatch hierarchical"
                        : cfg->trace[0]                           ? "--trace"
                        : cfg->timeline[0]                        ? "--timeline"
                                                                  : NULL;
    if (other)
        return moe_fail(st, MOE_EXIT_USAGE,
                        "--mode low-latency runs the decode forward alone (one round each way, no "
                        "waves): %s needs --mode normal", other);
    return MOE_EXIT_OK;
}

double moe_ll_memory(const moe_config *cfg, int ranks)
{
    const double T = (double)cfg->tokens, k = (double)cfg->topk, d = (double)cfg->hidden;
    const double f = (double)cfg->ffn, S = (double)cfg->shared_experts;
    return moe_ll_buffer_bytes(cfg, ranks) + T * k * (d + 2.0 * f) * 4.0 + S * T * d * 4.0;
}

const float *moe_wire_dispatched(const moe_config *cfg, const float *x, moe_index rows,
                                 float *scratch)
{
    if (cfg->dispatch_dtype == MOE_DTYPE_FP32)
        return x;
    const moe_fp8_format fp8 = {(enum moe_fp8_recipe)cfg->fp8_recipe,
                                cfg->fp8_scale == MOE_FP8_SCALE_UE8M0};
    moe_precision_dispatch(cfg->dispatch_dtype, fp8, x, rows, cfg->hidden, scratch);
    return scratch;
}
