# SPDX-License-Identifier: MIT
"""The FP8 recipes of docs/golden.md restated from their upstream code in
numpy, against moe-ep's quantiser (tests/golden/fp8_quantize), byte for byte.

    /usr/bin/python3 tests/golden/fp8_recipes.py FP8_QUANTIZE

Every recipe and scale format on rows built to hit the edges: ordinary
values over several binades, all-zero blocks, tiny blocks (amax < 1e-4, where
the upstream recipes clamp), amax values where x * (448 / amax) rounds past
448 (saturation), subnormal inputs and outputs. Exit 0 when every E4M3 byte
and every scale has the same bits.
"""
import os
import subprocess
import sys
import tempfile

import numpy as np

F = np.float32
MAX = F(448.0)
WIDTH = 256


def e4m3(v):
    """Round float32 v to E4M3 (nearest even, saturating at 448): the bytes."""
    v = np.asarray(v, dtype=F)
    a = np.abs(v).astype(np.float64)
    _, e = np.frexp(np.where(a > 0, a, 1.0))
    binade = np.maximum(e - 1, -6)
    quantum = np.ldexp(1.0, binade - 3)
    r = np.minimum(np.rint(a / quantum) * quantum, 448.0)  # a / quantum is exact
    _, re = np.frexp(np.where(r > 0, r, 1.0))
    exponent = np.where(r >= 2.0 ** -6, re - 1 + 7, 0)
    mantissa = np.where(exponent > 0, r / np.ldexp(1.0, re - 1 - 3) - 8, r * 512)
    byte = (exponent.astype(np.int64) << 3) | np.rint(mantissa).astype(np.int64)
    return (np.where(np.signbit(v), 0x80, 0) | byte).astype(np.uint8)


def pow2_at_least(s):
    """The smallest power of two >= s (UE8M0), exactly."""
    m, e = np.frexp(s.astype(np.float64))
    return np.ldexp(1.0, np.where(m == 0.5, e - 1, e)).astype(F)


def recipe(name, ue8m0, block):
    """(E4M3 bytes, scale) of one block as the named code computes them."""
    amax = F(np.max(np.abs(block)))
    a = np.maximum(amax, F(1e-4))
    if name == "moe":  # moe-ep: amax / 448, 1 for an all-zero block; divide
        s = amax / MAX if amax > 0 else F(1)
        if ue8m0 and amax > 0:  # a normal power of two, one UE8M0 byte on the wire
            s = max(pow2_at_least(np.array([s]))[0], F(2.0**-126))
        return e4m3(block / s), s
    if name == "deepep":  # csrc kernels: calculate_fp8_scales, x * scale
        if ue8m0:
            s_inv = pow2_at_least(np.array([a * F(1.0 / 448.0)]))[0]
            return e4m3(block * (F(1) / s_inv)), s_inv
        return e4m3(block * (MAX / a)), a * F(1.0 / 448.0)
    sf = a / MAX
    if ue8m0:
        sf = pow2_at_least(np.array([sf]))[0]
    if name == "deepgemm":  # per_token_cast_to_fp8: x * (1 / sf)
        return e4m3(block * (F(1) / sf)), sf
    return e4m3(block / sf), sf  # v3 act_quant: x / s


def rows():
    rng = np.random.default_rng(7)
    out = []
    for _ in range(64):  # ordinary rows, magnitudes over a few binades
        out.append((rng.standard_normal(WIDTH) * 2.0 ** rng.integers(-8, 8)).astype(F))
    out.append(np.zeros(WIDTH, dtype=F))  # all-zero blocks
    out.append((rng.standard_normal(WIDTH) * 1e-6).astype(F))  # tiny: amax < 1e-4
    sub = np.full(WIDTH, np.float32(1e-40), dtype=F)  # subnormal inputs
    sub[::3] = F(-3e-39)
    out.append(sub)
    for _ in range(256):  # amax values where x * fl(448 / amax) may round past 448
        row = (rng.uniform(-1, 1, WIDTH) * F(rng.uniform(0.5, 8.0))).astype(F)
        row[rng.integers(0, 128)] = -np.max(np.abs(row[:128]))
        out.append(row)
    return np.stack(out)


def main(tool):
    with tempfile.TemporaryDirectory() as work:
        return run(tool, work)


def run(tool, work):
    data = rows()
    path_in, path_out = os.path.join(work, "in.f32"), os.path.join(work, "out")
    data.tofile(path_in)
    blocks = (WIDTH + 127) // 128
    failed = 0
    for name in ("moe", "deepep", "deepgemm", "v3"):
        for fmt in ("float", "ue8m0"):
            subprocess.run([tool, name, fmt, str(WIDTH), path_in, path_out], check=True)
            raw = np.fromfile(path_out, dtype=np.uint8).reshape(len(data), WIDTH + 4 * blocks)
            q_c, s_c = raw[:, :WIDTH], raw[:, WIDTH:].copy().view(F)
            bad = 0
            for i, row in enumerate(data):
                for b in range(blocks):
                    q, s = recipe(name, fmt == "ue8m0", row[b * 128 : (b + 1) * 128])
                    same = np.array_equal(q, q_c[i, b * 128 : (b + 1) * 128]) and \
                        np.float32(s).view(np.uint32) == s_c[i, b].view(np.uint32)
                    bad += not same
            print("%-9s %-6s %d blocks, %d with other bits: %s"
                  % (name, fmt, len(data) * blocks, bad, "ok" if bad == 0 else "FAIL"))
            failed += bad > 0
    print("fp8-recipes: %d passed, %d failed" % (8 - failed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
