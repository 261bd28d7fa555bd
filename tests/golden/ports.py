# SPDX-License-Identifier: MIT
"""Ports of the expert layer that a GPU engineer could legitimately write,
each checked with `moe-ep verify` against golden sets: every one must pass,
and the worst share of the tolerance each uses is printed.

    /usr/bin/python3 tests/golden/ports.py MOE_EP GOLDEN_DIR [GOLDEN_DIR ...]

Each port recomputes the dispatched rows of an FP8 set with the set's
recipe (tests/golden/fp8_recipes.py), every experts.rank{r}.out from them,
the weights and the routing (with a reduced combine also each rank's sums,
experts.rank{r}.sum), and output.y from its own expert outputs and the
shared experts, as docs/golden.md describes the layer. The ports differ only
in how a GEMM sums (the contract must not depend on it) and use numpy's exp:
    fma       one fused multiply-add per k, k ascending (product and sum
              rounded once: the exact product in fp64, then one rounding)
    blocked   fp32 partial GEMMs over blocks of 64 of K, added in fp32
    pairwise  fp32 products summed pairwise over K (numpy's reduction)
    blas      numpy's fp32 matmul (OpenBLAS's order)
    fp64      fp64 GEMMs, rounded to fp32 once
Exit 0 when every port passes every set.
"""
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench", "peers"))
import moe_data  # noqa: E402  (docs/data.md's Philox mapping in numpy)
import st  # noqa: E402
from fp8_recipes import recipe as fp8_block  # noqa: E402
from recompute import bf16, e4m3_value  # noqa: E402

F = np.float32


def gemm_fma(a, bt):
    acc = np.zeros((a.shape[0], bt.shape[1]), dtype=np.float64)
    for k in range(a.shape[1]):
        acc = (a[:, k : k + 1].astype(np.float64) * bt[k].astype(np.float64) + acc).astype(F).astype(np.float64)
    return acc.astype(F)


def gemm_blocked(a, bt, block=64):
    acc = np.zeros((a.shape[0], bt.shape[1]), dtype=F)
    for k0 in range(0, a.shape[1], block):
        acc = acc + (a[:, k0 : k0 + block] @ bt[k0 : k0 + block]).astype(F)
    return acc


def gemm_pairwise(a, bt, rows=16):
    b = np.ascontiguousarray(bt.T)  # (n, K)
    out = np.empty((a.shape[0], bt.shape[1]), dtype=F)
    for m0 in range(0, a.shape[0], rows):
        out[m0 : m0 + rows] = (a[m0 : m0 + rows, None, :] * b[None, :, :]).sum(axis=-1, dtype=F)
    return out


# Real port bugs, each of which verify must fail at its stage (with the blas
# port) on at least one set: the shared expert dropped, the gate weight
# applied on the other side of L2, FP8 scales per row or per tensor instead
# of per block of 128, softmax for V3's sigmoid, masked groups filled with 0
# instead of -inf, the route scale left out, no renormalisation, the bias in
# the weights, a token's neighbour dispatched in its place, a slot's weight
# taken from the next slot in the combine, bf16 inputs truncated instead of
# rounded to nearest even, the expert outputs truncated to bf16 for the
# combine, and the layer output truncated to bf16 (--output-dtype bf16):
# each such element is at most one bf16 step off, which the contract allows
# one by one; verify catches it by the steps' direction. With rounding
# points inside the experts (--gemm-out-dtype bf16, --act-dtype fp8): a
# port that keeps the GEMM outputs or the activation in fp32.
BUGS = {"no-shared": "output", "weight-elsewhere": "experts", "fp8-per-row": "dispatch",
        "fp8-per-tensor": "dispatch", "softmax-for-sigmoid": "router", "mask-zero": "router",
        "no-route-scale": "router", "no-renorm": "router", "bias-in-weights": "router",
        "dispatch-off-by-one": "dispatch", "combine-off-by-one": "output",
        "bf16-truncation": "inputs", "combine-truncation": "experts", "output-truncation": "output",
        "fp32-gemm-out": "experts", "fp32-activation": "experts"}


def bug_applies(bug, files, config):
    """Whether a set can show the bug at all: each needs what it breaks."""
    v3_bias = config["router"] == "deepseek-v3" and "gate.bias" in files
    return {"no-shared": "shared.w1" in files,
            "fp8-per-row": config["dispatch-dtype"] == "fp8",
            "fp8-per-tensor": config["dispatch-dtype"] == "fp8",
            "softmax-for-sigmoid": v3_bias, "bias-in-weights": v3_bias,
            "no-renorm": v3_bias,
            "mask-zero": v3_bias and int(config["groups"]) > 1,
            "no-route-scale": float(config["route-scale"]) != 1.0,
            "combine-off-by-one": config["weight-at"] == "output" and int(config["topk"]) > 1,
            "bf16-truncation": config["dtype"] == "bf16",
            "combine-truncation": config["combine-dtype"] == "bf16",
            "output-truncation": config.get("output-dtype", "fp32") == "bf16",
            "fp32-gemm-out": config.get("gemm-out-dtype", "fp32") == "bf16",
            "fp32-activation": config.get("act-dtype", "fp32") != "fp32"}.get(bug, True)

PORTS = {
    "fma": gemm_fma,
    "blocked": gemm_blocked,
    "pairwise": gemm_pairwise,
    "blas": lambda a, bt: (a @ bt).astype(F),
    "fp64": lambda a, bt: (a.astype(np.float64) @ bt.astype(np.float64)).astype(F),
}


def ffn(gemm, x, w1, w2, scale=None, config=None, bug=None):
    """SwiGLU of x (rows, d) with w1 (2f, d), w2 (d, f), in fp32; with a
    config, the routed experts' rounding points (--gemm-out-dtype bf16: h
    and the output to bf16; --act-dtype: the activation to bf16, or to FP8
    with the set's recipe per block of 128 of a row)."""
    config = config or {}
    gemm_bf16 = config.get("gemm-out-dtype", "fp32") == "bf16" and bug != "fp32-gemm-out"
    act_dtype = "fp32" if bug == "fp32-activation" else config.get("act-dtype", "fp32")
    h = gemm(x, np.ascontiguousarray(w1.T))
    h = bf16(h) if gemm_bf16 else h
    f = w1.shape[0] // 2
    gate, up = h[:, :f], h[:, f:]
    with np.errstate(over="ignore"):
        act = (gate / (F(1) + np.exp(-gate)) * up).astype(F)
    if scale is not None:
        act = (act * scale[:, None]).astype(F)
    if act_dtype == "bf16":
        act = bf16(act)
    elif act_dtype == "fp8":
        act = dispatch_fp8(act, config)
    y = gemm(act, np.ascontiguousarray(w2.T))
    return bf16(y) if gemm_bf16 else y


def dispatch_fp8(x, config, bug=None):
    """Rows x (n, d) as --dispatch-dtype fp8 sends them, dequantised: the
    set's recipe per block of 128, or one scale per row or per tensor (bugs)."""
    name, ue8m0 = config.get("fp8-recipe", "moe"), config["fp8-scale"] == "ue8m0"
    out = np.empty_like(x)
    tensor_amax = np.abs(x).max()  # the fp8-per-tensor bug's one amax for all rows
    for i, row in enumerate(x):
        for b0 in range(0, row.size, 128):
            block = row[b0 : b0 + 128]
            ref = {"fp8-per-row": np.abs(row).max(), "fp8-per-tensor": tensor_amax}.get(bug)
            if ref is None:
                q, s = fp8_block(name, ue8m0, block)
            else:  # the block's scale from another amax: append it, take the block's values
                q, s = fp8_block(name, ue8m0, np.append(block, F(ref)))
                q = q[: block.size]
            out[i, b0 : b0 + block.size] = e4m3_value(q) * s
    return out


def top_k(values, k):
    """The k largest in descending order, ties to the lower index."""
    return np.argsort(-values, kind="stable")[:k]


def route(files, config, bug=None):
    """router.* of the set's gate, as DeepSeek-V3's and Mixtral's code route:
    fp64 logits, numpy's exp, the group limit with -inf, top-k, weights."""
    x, gate = files["tokens.x"].astype(np.float64), files["gate.weight"].astype(np.float64)
    logits = (x @ gate.T).astype(F)
    skewed = logits + files["router.skew"] if "router.skew" in files else logits
    v3, bias = config["router"] == "deepseek-v3", files.get("gate.bias")
    sigmoid = v3 and bias is not None and bug != "softmax-for-sigmoid"
    z = skewed.astype(np.float64)
    if sigmoid:
        scores = (1.0 / (1.0 + np.exp(-z))).astype(F)
    else:
        e = np.exp(z - z.max(axis=1, keepdims=True))
        scores = (e / e.sum(axis=1, keepdims=True)).astype(F)
    biased = scores + bias if bias is not None else scores.copy()
    k, experts = int(config["topk"]), scores.shape[1]
    groups, keep = int(config["groups"]), int(config["topk-groups"])
    norm = config["norm-topk"] == "true" or (config["norm-topk"] == "auto" and
                                             (not v3 or bias is not None)) or sigmoid
    ids = np.zeros((scores.shape[0], k), dtype=np.int64)
    weights = np.zeros((scores.shape[0], k), dtype=F)
    for i in range(scores.shape[0]):
        b = biased[i].copy()
        if v3 and groups > 1:
            member = b.reshape(groups, -1)
            score = np.sort(member, axis=1)[:, -2:].sum(axis=1) if bias is not None else member.max(axis=1)
            masked = np.setdiff1d(np.arange(groups), top_k(score.astype(F), keep))
            for g in masked:
                member[g] = 0.0 if bug == "mask-zero" else -np.inf
        ids[i] = top_k(b, k)
        w = (biased if bug == "bias-in-weights" else scores)[i, ids[i]].astype(np.float64)
        w = (w / w.sum() if norm and bug != "no-renorm" else w).astype(F)
        weights[i] = w if bug == "no-route-scale" else w * F(config["route-scale"])
    if config.get("topk-weights-dtype", "fp32") == "bf16":  # V3's weights.type_as(x)
        weights = bf16(weights)
    return {"router.logits": logits, "router.scores": scores, "router.topk_ids": ids,
            "router.topk_weights": weights}


def word(seed, tensor, index):
    """The raw Philox word of element index of (tensor, entity 0)."""
    index = np.asarray(index, dtype=np.uint64)
    block = index >> np.uint64(2)
    words = moe_data.philox((block & moe_data.MASK).astype(np.uint32),
                            (block >> np.uint64(32)).astype(np.uint32),
                            np.full(index.size, tensor, np.uint32), np.zeros(index.size, np.uint32),
                            seed & 0xFFFFFFFF, seed >> 32)
    return np.choose((index & np.uint64(3)).astype(np.int64), words)


def regenerate_tokens(config, n, d, bug=None):
    """tokens.x regenerated from the seed as docs/data.md says, rounded to
    --dtype (to nearest even; truncated with the bug)."""
    seed = int(config["seed"])
    x = moe_data.synth(seed, moe_data.TOKENS, 0, 0, n * d, float(config["init-scale"])).reshape(n, d)
    if config.get("input-dist") == "activations":
        binade = np.ldexp(np.float32(1), (word(seed, 8, np.arange(n)) >> np.uint32(30)).astype(np.int64) - 2)
        channel = np.where(word(seed, 9, np.arange(d)) >> np.uint32(27) == 0, np.float32(16), np.float32(1))
        x = (x * binade.astype(F)[:, None] * channel[None, :]).astype(F)
    if config["dtype"] in ("bf16", "fp8"):  # fp8: DeepSeek-V3's tokens are bf16
        x = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(F) if bug == "bf16-truncation" else bf16(x)
    return x


def fp8_block_weights(m, ue8m0):
    """m (rows, cols) as --dtype fp8 holds it (docs/data.md): E4M3 in blocks of
    128 x 128, moe-ep's recipe (amax / 448, or its UE8M0 power of two),
    dequantised in fp32."""
    out = np.empty_like(m)
    for r0 in range(0, m.shape[0], 128):
        for c0 in range(0, m.shape[1], 128):
            block = m[r0 : r0 + 128, c0 : c0 + 128]
            q, s = fp8_block("moe", ue8m0, block.ravel())
            out[r0 : r0 + 128, c0 : c0 + 128] = (e4m3_value(q) * s).reshape(block.shape)
    return out


def regenerate_experts(config, files):
    """experts.w1 and .w2 regenerated from the seed (docs/data.md) and held as
    --dtype fp8 holds them: the gate and up projections of W1 and W2, each in
    its own 128 x 128 blocks."""
    seed, ue8m0 = int(config["seed"]), config["fp8-scale"] == "ue8m0"
    E, two_f, d = files["experts.w1"].shape
    f = two_f // 2
    w1, w2 = np.empty((E, two_f, d), dtype=F), np.empty((E, d, f), dtype=F)
    for e in range(E):
        a, b = moe_data.expert(seed, e, d, f)
        w1[e] = np.concatenate([fp8_block_weights(a[:f], ue8m0), fp8_block_weights(a[f:], ue8m0)])
        w2[e] = fp8_block_weights(b, ue8m0)
    return {"experts.w1": w1, "experts.w2": w2}


def bf16_truncate(values):
    """float32 values cut to bfloat16 (toward zero): the bug combine-truncation."""
    return (np.asarray(values, dtype=F).view(np.uint32) & np.uint32(0xFFFF0000)).view(F)


def rows_of_rank(pairs):
    """The (token, expert) pairs a rank computed, as a set."""
    return {(int(t), int(e)) for t, e in pairs.tolist()}


def port(files, config, gemm, bug=None):
    """The candidate tensors of one port (with one of BUGS when bug is set)."""
    ids, weights = files["router.topk_ids"], files["router.topk_weights"]
    ids = files.get("layout.kept_ids", ids)  # --capacity-factor: the pairs kept, -1 dropped
    ids = files.get("layout.physical_ids", ids)  # --redundant-experts: the copy that computes each
    logical = files.get("layout.replica_of", np.arange(files["experts.w1"].shape[0]))
    before_l2 = (config["weight-at"] == "activation") != (bug == "weight-elsewhere")
    combine_bf16 = config["combine-dtype"] == "bf16"
    to_bf16 = bf16_truncate if bug == "combine-truncation" else bf16
    reduced = config.get("combine", "pairs") == "reduced"
    n, k = ids.shape
    out, rows_of = {}, {}
    for r in range(int(config["ranks"])):
        tokens_r = files["dispatch.rank%d.token" % r]
        sent = files["tokens.x"][(tokens_r + 1) % files["tokens.x"].shape[0] if bug == "dispatch-off-by-one" else tokens_r]
        if config["dispatch-dtype"] == "fp8":  # the port's own quantiser
            out["dispatch.rank%d.x" % r] = dispatch_fp8(sent, config, bug)
        else:
            out["dispatch.rank%d.x" % r] = bf16(sent) if config["dispatch-dtype"] == "bf16" else sent
        rows = dict(zip(tokens_r.tolist(), out.get("dispatch.rank%d.x" % r, files["dispatch.rank%d.x" % r])))
        pairs = files["experts.rank%d.pair" % r]
        result = np.zeros((pairs.shape[0], files["tokens.x"].shape[1]), dtype=F)
        for e in np.unique(pairs[:, 1]):
            at = np.nonzero(pairs[:, 1] == e)[0]
            tokens = pairs[at, 0]
            x = np.stack([rows[t] for t in tokens.tolist()]).astype(F)
            slot = np.argmax(ids[tokens] == e, axis=1)
            y = ffn(gemm, x, files["experts.w1"][logical[e]], files["experts.w2"][logical[e]],
                    weights[tokens, slot] if before_l2 else None, config, bug)
            result[at] = to_bf16(y) if combine_bf16 and not reduced else y
        out["experts.rank%d.out" % r] = result
        for row, (t, e) in enumerate(pairs.tolist()):
            rows_of[(t, e)] = result[row]
        if reduced:  # per received row, its pairs summed in slot order, rounded as it travels
            sums, mine = np.zeros((tokens_r.shape[0], result.shape[1]), dtype=F), rows_of_rank(pairs)
            for row, t in enumerate(tokens_r.tolist()):
                for s in range(k):
                    if (t, int(ids[t, s])) in mine:
                        v = rows_of[(t, int(ids[t, s]))]
                        w = weights[t, (s + 1) % k if bug == "combine-off-by-one" else s]
                        sums[row] = sums[row] + (v if before_l2 else (w * v).astype(F))
            out["experts.rank%d.sum" % r] = to_bf16(sums) if combine_bf16 else sums
    y = np.zeros(files["tokens.x"].shape, dtype=F)
    for r in range(int(config["ranks"]) if reduced else 0):  # home sums the ranks' rows in rank order
        tokens_r = files["dispatch.rank%d.token" % r]
        y[tokens_r] = y[tokens_r] + out["experts.rank%d.sum" % r]
    for i in range(n if not reduced else 0):
        for s in range(k):  # slot order
            if ids[i, s] < 0:
                continue
            v = rows_of[(i, int(ids[i, s]))]
            w = weights[i, (s + 1) % k if bug == "combine-off-by-one" else s]
            y[i] = y[i] + (v if before_l2 else (w * v).astype(F))
    shared = 0 if bug == "no-shared" else files["shared.w1"].shape[0] if "shared.w1" in files else 0
    for s in range(shared):
        y = y + ffn(gemm, files["tokens.x"], files["shared.w1"][s], files["shared.w2"][s])
    if config.get("output-dtype", "fp32") == "bf16":  # the layer's output as DeepEP hands it back
        y = (bf16_truncate if bug == "output-truncation" else bf16)(y)
    out["output.y"] = y
    out.update(route(files, config, bug))
    out["tokens.x"] = regenerate_tokens(config, *files["tokens.x"].shape, bug)
    if config["dtype"] == "fp8" and "experts.w1" in files:  # the port's own FP8 weight blocks
        out.update(regenerate_experts(config, files))
    return out


def verify(moe_ep, golden, candidate):
    """verify's exit status, each tensor's % of tolerance (its elements one
    bf16 step away aside) and those steps, toward zero and away."""
    run = subprocess.run([moe_ep, "verify", golden, candidate], capture_output=True, text=True)
    used, steps = {}, [0, 0]
    for line in run.stdout.splitlines():
        m = re.match(r"(\S+)\s+\S+\s+tolerance\s+\S+\s+\S+\s+(\S+)", line)
        if m:
            used[m.group(1)] = float(m.group(2))
        m = re.search(r"one bf16 step from the golden \(allowed\): (\d+) toward zero, (\d+) away", line)
        if m:
            steps = [steps[0] + int(m.group(1)), steps[1] + int(m.group(2))]
    return run.returncode, used, steps, run.stdout


def main(moe_ep, sets):
    with tempfile.TemporaryDirectory() as work:  # the candidates: about 1 GB, removed after
        return run(moe_ep, sets, work)


def run(moe_ep, sets, work):
    failed = 0
    print("%-10s %-14s %12s %12s %14s  %s" % ("port", "set", "experts %", "output.y %", "bf16 steps", "verify"))
    worst, caught_somewhere = {}, {}
    for golden in sets:
        manifest, files = st.load_set(golden)
        name = os.path.basename(os.path.normpath(golden))
        for label, gemm in PORTS.items():
            candidate = os.path.join(work, "%s-%s.safetensors" % (name, label))
            st.save(candidate, port(files, manifest["config"], gemm))
            rc, used, steps, text = verify(moe_ep, golden, candidate)
            experts = max(v for t, v in used.items() if t.startswith("experts."))
            output = used.get("output.y", float("nan"))
            print("%-10s %-14s %12.1f %12.1f %14s  %s" % (label, name, experts, output, "%d / %d" % tuple(steps),
                                                          "PASS" if rc == 0 else "FAIL (exit %d)" % rc))
            if rc != 0:
                print(text)
                failed += 1
            worst[label] = max(worst.get(label, 0.0), experts, output)
        for bug, stage in BUGS.items():
            if not bug_applies(bug, files, manifest["config"]):
                continue
            if bug == "combine-off-by-one" and manifest["config"].get("combine") == "reduced":
                stage = "experts"  # the weights are applied in the sums each rank sends back
            candidate = os.path.join(work, "%s-%s.safetensors" % (name, bug))
            st.save(candidate, port(files, manifest["config"], PORTS["blas"], bug))
            rc, used, steps, text = verify(moe_ep, golden, candidate)
            caught = rc == 1 and ("first failing stage: %s" % stage) in text
            print("%-19s %-14s %s" % (bug, name, "caught at %s" % stage if caught else "missed"))
            if bug == "combine-truncation":
                print("%-19s %-14s bf16 steps toward zero / away: %d / %d" % ("", "", steps[0], steps[1]))
            caught_somewhere[bug] = caught_somewhere.get(bug, False) or caught
    for bug, caught in caught_somewhere.items():
        if not caught:
            print("FAIL: bug %s was caught at its stage on no set" % bug)
            failed += 1
    for label, used in worst.items():
        print("worst %-9s %.1f %% of tolerance" % (label, used))
    print("ports: %s, %d failed" % ("every port passed and every bug was caught" if not failed else "not all", failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
