# SPDX-License-Identifier: MIT
"""Rebuild a golden set's layout tensors (dispatch.rank{r}.layout.*) from its
top-k ids, its dispatched rows and the placement, and require them exactly.

    /usr/bin/python3 tests/golden/layouts.py GOLDEN_DIR

The rules are written here again from docs/golden.md, without moe-ep's code:
local expert l of rank r is expert first(r) + l (contiguous blocks, the first
E % G ranks one more); its rows are the tokens routed to it in ascending
global token id, each as the ranks received it (dispatch.rank{r}.x);
  rows        the received rows themselves, src = dispatch.rank{r}.token
  masked      (EL, C, d), C = G * N: rows [0, count) of each block filled
  contiguous  (M, d): the blocks back to back, each padded to a multiple of A
Empty slots hold zeros, src and expert -1, scale 0. With FP8 rows every
filled value divided by its block's scale is an E4M3 value (a UE8M0 scale a
power of two). Exit 0 when every tensor matches.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402


def e4m3_values():
    """The 254 finite values of E4M3 (1 sign, 4 exponent, 3 mantissa bits,
    bias 7, no infinities, 0x7F and 0xFF NaN)."""
    values = set()
    for byte in range(256):
        if byte & 0x7F == 0x7F:
            continue
        sign = -1.0 if byte & 0x80 else 1.0
        e, m = byte >> 3 & 0xF, byte & 7
        values.add(sign * (m / 8.0 * 2.0 ** -6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7)))
    return np.array(sorted(values))


def byte_values():
    """The value of each of the 256 E4M3 bytes (NaN for 0x7F and 0xFF)."""
    values = np.full(256, np.nan)
    for byte in range(256):
        if byte & 0x7F != 0x7F:
            e, m = byte >> 3 & 0xF, byte & 7
            v = m / 8.0 * 2.0 ** -6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7)
            values[byte] = -v if byte & 0x80 else v
    return values


def as_values(array, dtype, scale):
    """A layout tensor as the set stores it, as it travelled, in float32:
    E4M3 bytes times their block's scale, bf16 bit patterns, or fp32."""
    if dtype == "F8_E4M3":
        d = array.shape[-1]
        blocks = np.repeat(scale, 128, axis=-1)[..., :d]
        return (byte_values()[array] * blocks).astype(np.float32)
    if dtype == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array


def main(golden):
    manifest, files = st.load_set(golden)
    for name, info in manifest["tensors"].items():
        if name.endswith(".layout.x"):
            files[name] = as_values(files[name], info["dtype"], files.get(name + ".scale"))
    config = manifest["config"]
    G, T = int(config["ranks"]), int(config["tokens"])
    E, d = int(config["experts"]), int(config["hidden"])
    kind = config.get("expert-layout", "auto")
    kind = "rows" if kind == "auto" else kind  # a dump runs the normal path
    N = T if config.get("max-tokens-per-rank", "auto") == "auto" else int(config["max-tokens-per-rank"])
    C, A = G * N, int(config.get("expert-alignment", "1"))
    fp8 = config["dispatch-dtype"] == "fp8"
    ids = files.get("layout.kept_ids", files["router.topk_ids"])  # --capacity-factor: the pairs kept
    if "layout.physical_ids" in files:  # --redundant-experts: the copies the pairs went to
        ids, E = files["layout.physical_ids"], files["layout.replica_of"].shape[0]
    base, extra = divmod(E, G)
    first = np.concatenate([[0], np.cumsum([base + (r < extra) for r in range(G)])])
    e4m3 = e4m3_values()
    failures = []

    def same(name, want):
        got = files.get(name)
        if got is None or got.shape != want.shape or not np.array_equal(got, want):
            failures.append("%s: %s, expected %s" % (name, "missing" if got is None else "differs (shape %s)" % (got.shape,), want.shape))

    for r in range(G):
        prefix = "dispatch.rank%d." % r
        rows = dict(zip(files[prefix + "token"].tolist(), files[prefix + "x"]))
        members = [np.nonzero((ids == e).any(axis=1))[0] for e in range(first[r], first[r + 1])]
        counts = np.array([len(m) for m in members], dtype=np.int32)
        same(prefix + "layout.count", counts)
        if kind == "rows":
            same(prefix + "layout.x", files[prefix + "x"])
            same(prefix + "layout.src", files[prefix + "token"].astype(np.int32))
            src = files[prefix + "token"]
        else:
            rooms = [C] * len(members) if kind == "masked" else [-(-len(m) // A) * A for m in members]
            starts = np.concatenate([[0], np.cumsum(rooms)]).astype(np.int64)
            x = np.zeros((int(starts[-1]), d), dtype=np.float32)
            src = np.full(int(starts[-1]), -1, dtype=np.int32)
            expert = np.full(int(starts[-1]), -1, dtype=np.int32)
            for l, tokens in enumerate(members):
                at = slice(starts[l], starts[l] + len(tokens))
                src[at], expert[at] = tokens, l
                for j, t in enumerate(tokens):
                    x[starts[l] + j] = rows[int(t)]
            shape = (len(members), C) if kind == "masked" else (int(starts[-1]),)
            same(prefix + "layout.x", x.reshape(shape + (d,)))
            same(prefix + "layout.src", src.reshape(shape))
            if kind == "contiguous":
                same(prefix + "layout.expert", expert)
        if fp8:
            src = files[prefix + "layout.src"].reshape(-1)  # the set's own, compared above
            scale = files[prefix + "layout.x.scale"].reshape(len(src), -1)
            x = files[prefix + "layout.x"].reshape(len(src), d)
            empty = src < 0
            if np.any(scale[empty] != 0):
                failures.append(prefix + "layout.x.scale: an empty slot has a scale")
            blocks = np.repeat(scale[~empty], 128, axis=1)[:, :d]
            q = x[~empty].astype(np.float64) / blocks
            if not np.all(np.isin(q, e4m3)):
                failures.append(prefix + "layout.x: a value over its scale is not an E4M3 value")
            if config.get("fp8-scale") == "ue8m0" and not np.all(np.frexp(scale[~empty])[0] == 0.5):
                failures.append(prefix + "layout.x.scale: a UE8M0 scale is not a power of two")
    for f in failures:
        print("FAIL: " + f)
    print("layout tensors of %s (%s, %d ranks) rebuilt from the ids and the dispatched rows: %s"
          % (golden, kind, G, "ok" if not failures else "FAIL"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
