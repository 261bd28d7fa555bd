# SPDX-License-Identifier: MIT
"""Recompute, bit for bit with numpy, every expert output of a `--gemm exact`
golden set (from the dumped dispatch rows, weights and top-k weights) and
the dense truth of any golden set (from the dumped tokens, routing and
weights).

    /usr/bin/python3 tests/golden/exact.py GOLDEN_DIR

A port's view of the contract in docs/golden.md. Experts: the fixed-order
GEMM (k ascending, each product rounded to fp32 and then added, no fused
multiply-add), silu with the exp that include/moe/experts.h specifies step
by step, the gate weight multiplied into the activation when the set applies
it there, the rounding points inside the routed experts (--gemm-out-dtype
bf16: h and the output; --act-dtype: the activation, FP8 with the set's
recipe per block of 128), the combine rounding, and with --combine reduced
the sums each rank sends back. Truth: the same in fp64, with the GEMM
of moe_dgemm_nt_exact (include/moe/gemm.h) and the exp of
include/moe/exp.h, every expert on every token, summed in expert order,
each rounding point applied to the fp64 value as fp32 code would round its
own (to fp32 first).
Every operation below is one IEEE operation, as in C. Exit 0 when every
value has the same bits.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402
from recompute import bf16, pair_ranks, reduced_sum, round_act, round_h  # noqa: E402

F = np.float32


def gemm_exact(a, bt):
    """a (m, K) times bt (K, n): products rounded, added in k order."""
    acc = a[:, 0:1] * bt[0]
    for k in range(1, a.shape[1]):
        acc = acc + a[:, k : k + 1] * bt[k]
    return acc


def exp_fp32(x):
    """moe_exp_fp32, as include/moe/experts.h writes it out."""
    hi, lo, shifter = F(88.7228317), F(-87.3365402), F(12582912.0)
    xc = np.minimum(np.maximum(x, lo), hi)
    t = xc * F(1.44269504) + shifter
    n = t - shifter
    k = t.view(np.int32) - np.int32(0x4B400000)
    r = (xc - n * F(0.693359375)) - n * F(-2.12194440e-4)
    p = F(1) / F(5040)
    for c in (F(1) / F(720), F(1) / F(120), F(1) / F(24), F(1) / F(6), F(0.5), F(1), F(1)):
        p = p * r + c
    k1 = np.where(k < 0, -((-k) // 2), k // 2).astype(np.int32)
    k2 = k - k1
    s1 = ((k1 + 127) << 23).astype(np.int32).view(np.float32)
    s2 = ((k2 + 127) << 23).astype(np.int32).view(np.float32)
    e = p * s1 * s2
    return np.where(x > hi, F(np.inf), np.where(x < lo, F(0), e)).astype(np.float32)


def exp_fp64(x):
    """moe_exp_fp64, as include/moe/exp.h writes it out."""
    hi, lo, shifter = 709.782712893384, -708.3964185322641, float.fromhex("0x1.8p52")
    xc = np.minimum(np.maximum(x, lo), hi)
    n = (xc * 1.4426950408889634 + shifter) - shifter
    r = (xc - n * float.fromhex("0x1.62e42feep-1")) - n * float.fromhex("0x1.a39ef35793c76p-33")
    factorial = [1.0]
    for m in range(1, 14):
        factorial.append(factorial[-1] * m)
    p = np.full_like(r, 1.0 / factorial[13])
    for m in range(12, 1, -1):
        p = p * r + 1.0 / factorial[m]
    p = p * r + 1.0
    p = p * r + 1.0
    k = n.astype(np.int64)
    k1 = np.where(k < 0, -((-k) // 2), k // 2)
    k2 = k - k1
    e = p * ((k1 + 1023) << 52).view(np.float64) * ((k2 + 1023) << 52).view(np.float64)
    return np.where(x > hi, np.inf, np.where(x < lo, 0.0, e))


def dgemm_exact(a, b):
    """a (m, K) times b (n, K)^T in fp64: products rounded, added in k order from +0."""
    acc = np.zeros((a.shape[0], b.shape[0]))
    for k in range(a.shape[1]):
        acc = acc + a[:, k : k + 1] * b[:, k]
    return acc


def ffn_fp64(x, w1, w2, config=None):
    """The truth's SwiGLU expert, w1 (2f, d) and w2 (d, f) as dumped; with a
    config, a routed expert's rounding points."""
    w1, w2 = w1.astype(np.float64), w2.astype(np.float64)
    h = round_h(dgemm_exact(x, w1), config)
    f = w1.shape[0] // 2
    gate, up = h[:, :f], h[:, f:]
    return round_h(dgemm_exact(round_act(gate / (1.0 + exp_fp64(-gate)) * up, config), w2), config)


def truth_exact(files, config):
    """output.truth as src/core/truth.c computes it."""
    x = files["tokens.x"].astype(np.float64)
    xq = np.zeros_like(x)  # what each token's experts received
    for r in range(int(config["ranks"])):
        xq[files["dispatch.rank%d.token" % r]] = files["dispatch.rank%d.x" % r]
    ids, weights = files.get("layout.kept_ids", files["router.topk_ids"]), files["router.topk_weights"]
    combine_bf16 = config["combine-dtype"] == "bf16"
    before_l2 = config["weight-at"] == "activation"
    reduced = config.get("combine", "pairs") == "reduced"
    ranks = int(config["ranks"])
    rank_of = pair_ranks(files, ids, ranks)
    y = np.zeros_like(x)
    partials = {}  # --combine reduced: per rank, its experts' terms in expert order
    for e in range(files["experts.w1"].shape[0]):
        g, at_rank = np.zeros(x.shape[0]), np.zeros(x.shape[0], dtype=np.int64)
        for s in range(ids.shape[1]):
            g = np.where(ids[:, s] == e, weights[:, s].astype(np.float64), g)
            at_rank = np.where(ids[:, s] == e, rank_of[:, s], at_rank)
        out = ffn_fp64(xq, files["experts.w1"][e], files["experts.w2"][e], config)
        rows = np.nonzero(g != 0.0)[0]
        v, gr = out[rows], g[rows][:, None]
        if reduced:  # each pair into the sum of the rank that computed it (its copy's)
            for r in np.unique(at_rank[rows]):
                mine = at_rank[rows] == r
                partial = partials.setdefault(int(r), np.zeros_like(x))
                partial[rows[mine]] = partial[rows[mine]] + gr[mine] * v[mine]
            continue
        if not combine_bf16:
            term = gr * v
        elif before_l2:
            term = bf16(gr * v).astype(np.float64)
        else:
            term = gr * bf16(v).astype(np.float64)
        y[rows] = y[rows] + term
    if reduced:
        y = y + reduced_sum(ranks, partials, combine_bf16)
    for s in range(files["shared.w1"].shape[0] if "shared.w1" in files else 0):
        y = y + ffn_fp64(x, files["shared.w1"][s], files["shared.w2"][s])
    if config.get("output-dtype", "fp32") == "bf16":  # the fp64 value rounded once, at the end
        y = bf16(y).astype(np.float64)
    return y


def reduced_rows(files, r, before_l2, combine_bf16):
    """experts.rank{r}.sum from experts.rank{r}.out: per received row, its
    pairs in slot order, each times its gate weight unless the weight was
    applied before L2, summed in fp32 from zero, then rounded to the combine
    dtype (src/comm/ep.c, moe_ep_reduce_at_source)."""
    ids, weights = files.get("layout.kept_ids", files["router.topk_ids"]), files["router.topk_weights"]
    ids = files.get("layout.physical_ids", ids)  # pairs are named by the copy that computed them
    tokens = files["dispatch.rank%d.token" % r]
    pairs, out = files["experts.rank%d.pair" % r], files["experts.rank%d.out" % r]
    at = {(int(t), int(e)): p for p, (t, e) in enumerate(pairs.tolist())}
    sums = np.zeros((tokens.shape[0], out.shape[1]), dtype=F)
    for row, t in enumerate(tokens.tolist()):
        for s in range(ids.shape[1]):
            p = at.get((t, int(ids[t, s])))
            if p is not None:
                term = out[p] if before_l2 else weights[t, s] * out[p]
                sums[row] = sums[row] + term
    return bf16(sums) if combine_bf16 else sums


def main(golden):
    manifest, files = st.load_set(golden)
    config = manifest["config"]
    truth = truth_exact(files, config)
    truth_differ = int((truth.view(np.uint64) != files["output.truth"].view(np.uint64)).sum())
    print("exact recompute of %s: %d truth values, %d with other bits: %s"
          % (golden, truth.size, truth_differ, "ok" if truth_differ == 0 else "FAIL"))
    if config["gemm"] != "exact":
        print("exact: %s was not made with --gemm exact; no expert outputs to compare bit for bit"
              % golden)
        return 0 if truth_differ == 0 else 1
    ids, weights = files.get("layout.kept_ids", files["router.topk_ids"]), files["router.topk_weights"]
    w1t = np.ascontiguousarray(files["experts.w1"].transpose(0, 2, 1))  # (E, d, 2f)
    w2t = np.ascontiguousarray(files["experts.w2"].transpose(0, 2, 1))  # (E, f, d)
    f = w2t.shape[1]
    before_l2 = config["weight-at"] == "activation"
    combine_bf16 = config["combine-dtype"] == "bf16"
    reduced = config.get("combine", "pairs") == "reduced"  # outputs summed before they travel
    with np.errstate(over="ignore"):
        checked = differ = 0
        for r in range(int(config["ranks"])):
            rows = dict(zip(files["dispatch.rank%d.token" % r].tolist(), files["dispatch.rank%d.x" % r]))
            pairs, out = files["experts.rank%d.pair" % r], files["experts.rank%d.out" % r]
            for p in np.unique(pairs[:, 1]):  # a physical expert: a copy of replica_of[p]
                at = np.nonzero(pairs[:, 1] == p)[0]
                e = files["layout.replica_of"][p] if "layout.replica_of" in files else p
                tokens = pairs[at, 0]
                x = np.stack([rows[t] for t in tokens.tolist()]).astype(np.float32)
                h = round_h(gemm_exact(x, w1t[e]), config)
                gate, up = h[:, :f], h[:, f:]
                act = gate / (F(1) + exp_fp32(-gate)) * up
                if before_l2:
                    slot = np.argmax(ids[tokens] == e, axis=1)
                    act = act * weights[tokens, slot][:, None]
                y = round_h(gemm_exact(round_act(act, config), w2t[e]), config)
                if combine_bf16 and not reduced:
                    y = bf16(y)
                same = y.view(np.uint32) == out[at].view(np.uint32)
                checked += same.size
                differ += int((~same).sum())
            if reduced:  # each received row's pairs, summed in slot order, as sent back
                sums = reduced_rows(files, r, before_l2, combine_bf16)
                same = sums.view(np.uint32) == files["experts.rank%d.sum" % r].view(np.uint32)
                checked += same.size
                differ += int((~same).sum())
    ok = differ == 0 and truth_differ == 0
    print("exact recompute of %s: %d expert output values, %d with other bits: %s"
          % (golden, checked, differ, "ok" if differ == 0 else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
