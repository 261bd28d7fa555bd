# SPDX-License-Identifier: MIT
"""Recompute a golden set's combined output from its dumped inputs, top-k and
dispatched rows with numpy, and compare it with the dumped output.

    /usr/bin/python3 tests/golden/recompute.py GOLDEN_DIR

A cross-language check: the SwiGLU experts (with the rounding points inside
the routed ones), the gate-weighted sum, the shared experts and the bf16
combine rounding are written here again, in float64.
Exit 0 when every element is within the manifest's tolerance for output.y.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402
from fp8_recipes import recipe  # noqa: E402

F = np.float32


def bf16(values):
    """Round float32 values to the nearest bfloat16 (ties to even)."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return (bits & 0xFFFFFFFF).astype(np.uint32).view(np.float32)


def expert_ranks(experts, ranks):
    """The rank of each expert: contiguous blocks, the first E % G ranks
    one more (include/moe/layout.h)."""
    base, extra = divmod(experts, ranks)
    return np.repeat(np.arange(ranks), [base + (r < extra) for r in range(ranks)])


def pair_ranks(files, ids, ranks):
    """The rank each (token, slot) pair is computed on: its expert's, or with
    --redundant-experts its copy's (layout.physical_ids; physical experts in
    contiguous blocks as logical ones are without copies)."""
    if "layout.physical_ids" in files:
        physical = files["layout.physical_ids"]
        return expert_ranks(files["layout.replica_of"].shape[0], ranks)[np.maximum(physical, 0)]
    return expert_ranks(files["experts.w1"].shape[0], ranks)[np.maximum(ids, 0)]


def reduced_sum(ranks, partials, combine_bf16):
    """--combine reduced: each rank's sum rounded as it travels, summed home."""
    y = 0.0
    for r in range(ranks):
        if r in partials:
            y = y + (bf16(partials[r]).astype(np.float64) if combine_bf16 else partials[r])
    return y


def e4m3_value(q):
    """The value of E4M3 bytes q, in fp32."""
    q = q.astype(np.int64)
    v = np.where((q >> 3) & 0xF == 0, (q & 7) * 2.0 ** -9, (8 + (q & 7)) * np.ldexp(1.0, ((q >> 3) & 0xF) - 10))
    return (np.where(q & 0x80, -v, v)).astype(F)


def round_h(h, config):
    """--gemm-out-dtype bf16: a GEMM's output to bf16 (an fp64 value through fp32)."""
    return bf16(h).astype(h.dtype) if config and config.get("gemm-out-dtype", "fp32") == "bf16" else h


def round_act(act, config):
    """--act-dtype: the activation to bf16, or to FP8 per block of 128 of a
    row with the set's recipe, dequantised in fp32 (an fp64 value through
    fp32)."""
    kind = config.get("act-dtype", "fp32") if config else "fp32"
    if kind == "bf16":
        return bf16(act).astype(act.dtype)
    if kind != "fp8":
        return act
    out, a32 = np.empty(act.shape, dtype=F), act.astype(F)
    for i in range(a32.shape[0]):
        for b0 in range(0, a32.shape[1], 128):
            q, s = recipe(config["fp8-recipe"], config["fp8-scale"] == "ue8m0", a32[i, b0 : b0 + 128])
            out[i, b0 : b0 + 128] = e4m3_value(q) * s
    return out.astype(act.dtype)


def ffn(x, w1, w2, config=None):
    """SwiGLU in float64; with a config, a routed expert's rounding points."""
    h = round_h(x @ w1.T.astype(np.float64), config)
    f = w1.shape[0] // 2
    gate, up = h[:, :f], h[:, f:]
    return round_h(round_act(gate / (1.0 + np.exp(-gate)) * up, config) @ w2.T.astype(np.float64), config)


def kept_pairs(config, ids, weights):
    """--capacity-factor C (docs/load-balance.md, Megatron-Core's rule): per
    source rank, each expert keeps at most ceil(T k / E * C) of the rank's
    pairs, those of largest gate weight (--drop-policy probs; equal weights
    to the lower token) or the first in token order (position); the others
    become -1."""
    T, k, E = int(config["tokens"]), ids.shape[1], int(config["experts"])
    capacity = int(np.ceil(T * k / E * float(config["capacity-factor"])))
    kept = ids.copy()
    for r0 in range(0, ids.shape[0], T):
        for e in range(E):
            rows, slots = np.nonzero(ids[r0:r0 + T] == e)
            if rows.size <= capacity:
                continue
            if config.get("drop-policy", "probs") == "probs":  # stable: equal weights keep token order
                order = np.argsort(-weights[r0 + rows, slots].astype(np.float64), kind="stable")
            else:
                order = np.arange(rows.size)
            for m in order[capacity:]:
                kept[r0 + rows[m], slots[m]] = -1
    return kept


def bias_steps_hold(files, config):
    """--steps with --bias-update G: after step s every expert's bias moved by
    +G (its load below the mean load), -G (above) or 0, in fp32, and the
    set's router used the last bias (gate.bias)."""
    load, bias = files["router.steps.load"].astype(np.float64), files["router.steps.bias"]
    gamma = np.float32(float(config["bias-update"]))
    for s in range(1, bias.shape[0]):
        mean = load[s].sum() / load.shape[1]
        step = np.where(load[s] < mean, gamma, np.where(load[s] > mean, -gamma, np.float32(0)))
        if not np.array_equal((bias[s - 1] + step).astype(np.float32), bias[s]):
            return "router.steps.bias row %d does not follow the update rule from row %d" % (s, s - 1)
    if not np.array_equal(bias[-1], files["gate.bias"]):
        return "gate.bias is not the last row of router.steps.bias"
    return None


def main(golden):
    manifest, files = st.load_set(golden)
    config = manifest["config"]
    x = files["tokens.x"].astype(np.float64)
    ids, weights = files["router.topk_ids"], files["router.topk_weights"].astype(np.float64)
    n, k = ids.shape
    if "router.steps.bias" in files:
        why = bias_steps_hold(files, config)
        if why:
            print("numpy recompute of %s: %s: FAIL" % (golden, why))
            return 1
    if config.get("capacity-factor", "none") != "none":  # the pairs kept, decided again here
        ids = kept_pairs(config, ids, files["router.topk_weights"])
        if not np.array_equal(ids, files["layout.kept_ids"]):
            print("numpy recompute of %s: layout.kept_ids differs from the capacity rule: FAIL" % golden)
            return 1
    # What each token's experts received: its dispatched row (the same on every rank).
    xq = np.zeros_like(x)
    ranks = int(config["ranks"])
    for r in range(ranks):
        xq[files["dispatch.rank%d.token" % r]] = files["dispatch.rank%d.x" % r]
    combine_bf16 = config["combine-dtype"] == "bf16"
    before_l2 = config["weight-at"] == "activation"
    reduced = config.get("combine", "pairs") == "reduced"
    rank_of = pair_ranks(files, ids, ranks)
    y = np.zeros_like(x)
    partials = {}  # --combine reduced: per rank, its experts' sum (rounded when it travels)
    for e in range(files["experts.w1"].shape[0]):
        rows, slots = np.nonzero(ids == e)
        if rows.size == 0:
            continue
        out = ffn(xq[rows], files["experts.w1"][e], files["experts.w2"][e], config)
        g = weights[rows, slots][:, None]
        if reduced:  # each pair into the sum of the rank that computed it
            for r in np.unique(rank_of[rows, slots]):
                at = rank_of[rows, slots] == r
                np.add.at(partials.setdefault(int(r), np.zeros_like(x)), rows[at], (g * out)[at])
            continue
        if combine_bf16:
            term = bf16(g * out) if before_l2 else g * bf16(out)
        else:
            term = g * out
        np.add.at(y, rows, term)
    if reduced:
        y = y + reduced_sum(ranks, partials, combine_bf16)
    for s in range(files["shared.w1"].shape[0] if "shared.w1" in files else 0):
        y += ffn(x, files["shared.w1"][s], files["shared.w2"][s])
    if config.get("output-dtype", "fp32") == "bf16":  # rounded once at home, after every sum
        y = bf16(y).astype(np.float64)
    ref = files["output.y"].astype(np.float64)
    contract = manifest["tensors"]["output.y"]
    bound = contract["abs"] + contract["rel"] * np.abs(ref)
    if "allow" in contract:  # one bf16 step per rounded term (docs/golden.md)
        bound = bound + files[contract["allow"]]
    err = np.abs(y - ref)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    ok = bool(np.all(err <= bound))
    print("numpy recompute of %s: %d tokens x %d, max |diff| %.3e, worst at %s using %.1f%% of "
          "tolerance: %s" % (golden, n, x.shape[1], err.max(), tuple(int(i) for i in worst),
                             100 * (err / bound).max(), "ok" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
