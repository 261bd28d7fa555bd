# SPDX-License-Identifier: MIT
"""Recompute every gradient of a golden set made with --backward from its
dumped tensors with numpy, and compare them with the set's.

    /usr/bin/python3 tests/golden/recompute_backward.py GOLDEN_DIR

A cross-language check of docs/backward.md, written again here in float64
from the definitions: the SwiGLU expert's backward on the tokens that chose
it, the router's (softmax over all logits, or DeepSeek-V3's sigmoid; the
renormalised top-k; the route scale), the gate's, the shared experts'. Each
gradient the set holds (per pair on its rank, per token, per expert, the
shared experts', the gate's) and its fp64 truth must lie within the
manifest's tolerance of the recomputed one. Exit 0 when all do.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def expert_backward(x, dy, gate, w1, w2, at_activation):
    """dx, dL/dgate, dW1, dW2 of one expert on rows x with upstream dy; gate
    None for an ungated (shared) expert."""
    f = w1.shape[0] // 2
    h = x @ w1.T
    hg, hu = h[:, :f], h[:, f:]
    s = sigmoid(hg)
    silu = hg * s
    a = silu * hu
    dgate = None
    if gate is None:
        d_out, a_in = dy, a
        da = d_out @ w2
    elif at_activation:
        d_out, a_in = dy, a * gate[:, None]
        da_scaled = dy @ w2
        dgate = np.sum(da_scaled * a, axis=1)
        da = da_scaled * gate[:, None]
    else:
        dgate = np.sum(dy * (a @ w2.T), axis=1)
        d_out, a_in = dy * gate[:, None], a
        da = d_out @ w2
    dh = np.concatenate([da * hu * (s + silu * (1.0 - s)), da * silu], axis=1)
    return dh @ w1, dgate, dh.T @ x, d_out.T @ a_in


def router_backward(config, logits, skew, ids, dweights):
    """dlogits (N, E) from dL/dweight per slot (N, k)."""
    sigmoid_router = config["router"] == "deepseek-v3" and float(config["bias-scale"]) > 0
    norm = config["norm-topk"]
    normalize = sigmoid_router or (norm == "true") or (
        norm == "auto" and config["router"] == "softmax")
    scale = float(config["route-scale"])
    z = logits.astype(np.float64) + (skew if skew is not None else 0.0)
    if sigmoid_router:
        p = sigmoid(z)
    else:
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
    n = ids.shape[0]
    rows = np.arange(n)[:, None]
    sel = p[rows, ids]
    total = sel.sum(axis=1, keepdims=True)
    dp = np.zeros_like(p)
    if normalize:
        weighted = np.sum(dweights * sel, axis=1, keepdims=True)
        np.add.at(dp, (np.repeat(np.arange(n), ids.shape[1]), ids.ravel()),
                  (scale * (dweights / total - weighted / total ** 2)).ravel())
    else:
        np.add.at(dp, (np.repeat(np.arange(n), ids.shape[1]), ids.ravel()),
                  (scale * dweights).ravel())
    if sigmoid_router:
        return dp * p * (1.0 - p)
    return p * (dp - np.sum(p * dp, axis=1, keepdims=True))


def within(name, got, want, info, failures):
    """got within the manifest's contract for `name` of the recomputed want."""
    err = np.abs(got.astype(np.float64) - want)
    bound = info["abs"] + info["rel"] * np.abs(want)
    used = float(np.max(err / bound)) if err.size else 0.0
    ok = used <= 1.0
    print("%-30s %s  max |diff| %.3e  %.1f%% of tolerance" % (
        name, "ok  " if ok else "FAIL", float(err.max()) if err.size else 0.0, 100 * used))
    if not ok:
        failures.append(name)


def main(golden):
    manifest, files = st.load_set(golden)
    config, info = manifest["config"], manifest["tensors"]
    if config.get("backward") != "true":
        print("recompute_backward: %s holds no backward stage" % golden)
        return 1
    f64 = lambda name: files[name].astype(np.float64)  # noqa: E731
    x, dy = f64("tokens.x"), f64("backward.dy")
    w1, w2 = f64("experts.w1"), f64("experts.w2")
    ids, weights = files["router.topk_ids"], f64("router.topk_weights")
    at_activation = config["weight-at"] == "activation"
    n, k = ids.shape
    experts = w1.shape[0]

    dx = np.zeros_like(x)
    dweights = np.zeros((n, k))
    dw1, dw2 = np.zeros_like(w1), np.zeros_like(w2)
    pair_dx, pair_dg = {}, {}
    for e in range(experts):
        token, slot = np.nonzero(ids == e)
        order = np.argsort(token, kind="stable")
        token, slot = token[order], slot[order]
        if token.size == 0:
            continue
        ex, eg, ew1, ew2 = expert_backward(x[token], dy[token], weights[token, slot], w1[e], w2[e],
                                           at_activation)
        np.add.at(dx, token, ex)
        dweights[token, slot] = eg
        dw1[e], dw2[e] = ew1, ew2
        for i, t in enumerate(token):
            pair_dx[(t, e)] = ex[i]
            pair_dg[(t, e)] = eg[i]
    failures = []
    # per pair, on the rank that computed it
    ranks = int(config["ranks"])
    for r in range(ranks):
        pairs = files["experts.rank%d.pair" % r]
        if pairs.shape[0] == 0:
            continue
        want_dx = np.array([pair_dx[(t, e)] for t, e in pairs])
        want_dg = np.array([pair_dg[(t, e)] for t, e in pairs])
        for name, want in (("backward.rank%d.dx" % r, want_dx), ("backward.rank%d.dweight" % r, want_dg)):
            within(name, files[name], want, info[name], failures)
    shared = []
    if "shared.w1" in files:
        for s in range(files["shared.w1"].shape[0]):
            sx, _, sw1, sw2 = expert_backward(x, dy, None, f64("shared.w1")[s], f64("shared.w2")[s],
                                              at_activation)
            dx += sx
            shared.append((sw1, sw2))
    skew = f64("router.skew") if "router.skew" in files else None
    dlogits = router_backward(config, files["router.logits"], skew, ids, dweights)
    gate = f64("gate.weight")
    dx += dlogits @ gate
    recomputed = {"backward.dx": dx, "backward.experts.dw1": dw1, "backward.experts.dw2": dw2,
                  "backward.gate.dw": dlogits.T @ x}
    if shared:
        recomputed["backward.shared.dw1"] = np.stack([s[0] for s in shared])
        recomputed["backward.shared.dw2"] = np.stack([s[1] for s in shared])
    for name, want in recomputed.items():
        within(name, files[name], want, info[name], failures)
        within(name + ".truth", files[name + ".truth"], want, info[name + ".truth"], failures)
    if failures:
        print("recompute_backward: FAIL (%s)" % ", ".join(failures))
        return 1
    print("recompute_backward: every gradient of %s agrees with numpy" % golden)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
