"""Recompute every expert output of a `--gemm exact` golden set bit for bit
with numpy, from the dumped dispatch rows, weights and top-k weights.

    /usr/bin/python3 tests/golden/exact.py GOLDEN_DIR

A port's view of the contract in docs/golden.md: the fixed-order GEMM (k
ascending, each product rounded to fp32 and then added, no fused
multiply-add), silu with the exp that include/moe/experts.h specifies step
by step, the gate weight multiplied into the activation when the set applies
it there, and the combine rounding. Every float32 operation below is one
IEEE single operation, as in C. Exit 0 when every value of every
experts.rank{r}.out is the same bits.
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402
from recompute import bf16  # noqa: E402

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


def main(golden):
    manifest = json.load(open(os.path.join(golden, "manifest.json")))
    config = manifest["config"]
    if config["gemm"] != "exact":
        print("exact: %s was not made with --gemm exact; nothing to compare bit for bit" % golden)
        return 0
    files = {}
    for stage in manifest["stages"]:
        path = os.path.join(golden, stage + ".safetensors")
        if os.path.exists(path):
            files.update(st.load(path)[0])
    ids, weights = files["router.topk_ids"], files["router.topk_weights"]
    w1t = np.ascontiguousarray(files["experts.w1"].transpose(0, 2, 1))  # (E, d, 2f)
    w2t = np.ascontiguousarray(files["experts.w2"].transpose(0, 2, 1))  # (E, f, d)
    f = w2t.shape[1]
    before_l2 = config["weight-at"] == "activation"
    combine_bf16 = config["combine-dtype"] == "bf16"
    with np.errstate(over="ignore"):
        checked = differ = 0
        for r in range(int(config["ranks"])):
            rows = dict(zip(files["dispatch.rank%d.token" % r].tolist(), files["dispatch.rank%d.x" % r]))
            pairs, out = files["experts.rank%d.pair" % r], files["experts.rank%d.out" % r]
            for e in np.unique(pairs[:, 1]):
                at = np.nonzero(pairs[:, 1] == e)[0]
                tokens = pairs[at, 0]
                x = np.stack([rows[t] for t in tokens.tolist()]).astype(np.float32)
                h = gemm_exact(x, w1t[e])
                gate, up = h[:, :f], h[:, f:]
                act = gate / (F(1) + exp_fp32(-gate)) * up
                if before_l2:
                    slot = np.argmax(ids[tokens] == e, axis=1)
                    act = act * weights[tokens, slot][:, None]
                y = gemm_exact(act, w2t[e])
                if combine_bf16:
                    y = bf16(y)
                same = y.view(np.uint32) == out[at].view(np.uint32)
                checked += same.size
                differ += int((~same).sum())
    ok = differ == 0
    print("exact recompute of %s: %d expert output values, %d with other bits: %s"
          % (golden, checked, differ, "ok" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
