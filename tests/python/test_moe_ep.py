# SPDX-License-Identifier: MIT
"""The Python package (python/moe_ep) against what it wraps and against an
independent numpy layer: reference() is the shipped golden sets' truth bit
for bit, route() their routing, reference(stages=True) their dispatch
rows and expert outputs, reference_backward() their gradients' truth
(check_backward() passes their gradients and names a wrong element); reference() on caller weights is a numpy
SwiGLU MoE in fp64; check() passes a correct fp32 layer and fails a wrong
one; verify() passes a set's own tensors and names the stage of a wrong
one, says the stages it checked and fails a required one left out, and
`python3 -m moe_ep verify` exits as moe-ep verify does; bad
arguments raise ValueError naming them. Prints one line per test and
"python: N passed, M failed"; exit 1 on any failure."""
import json
import os
import subprocess
import sys

import numpy as np

SRCDIR = os.environ.get("MOE_EP_SRCDIR", os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(SRCDIR, "python"))
import moe_ep  # noqa: E402
from moe_ep import safetensors  # noqa: E402

GOLDEN = os.path.join(SRCDIR, "data", "golden")
NOT_FLAGS = {"ranks", "preset", "dump", "check", "iters"}
results = []


class Skip(Exception):
    pass


def test(fn):
    try:
        fn()
        results.append((fn.__name__, None))
    except Skip as e:
        print("SKIP: %s (%s)" % (fn.__name__, e))
    except Exception as e:  # a failed assert or an unexpected error alike
        results.append((fn.__name__, "%s: %s" % (type(e).__name__, e)))
    return fn


def golden(name):
    d = os.path.join(GOLDEN, name)
    manifest = json.load(open(os.path.join(d, "manifest.json")))
    cfg = moe_ep.Config()
    for key, value in manifest["config"].items():
        if key not in NOT_FLAGS and value != "":
            cfg.set(key, value)
    tensors = {}
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            tensors.update(safetensors.read(os.path.join(d, f)))
    return d, cfg, int(manifest["config"]["ranks"]), tensors


def numpy_moe(x, ids, weights, w1, w2, sw1, sw2):
    """The layer in fp64, written from docs/golden.md: y = sum_k weight *
    W2 (silu(W1_gate x) * W1_up x), plus the shared experts' outputs."""
    x = x.astype(np.float64)
    f = w2.shape[2]

    def ffn(a, b):
        h = x @ a.astype(np.float64).T
        g, u = h[:, :f], h[:, f:]
        return (g / (1.0 + np.exp(-g)) * u) @ b.astype(np.float64).T

    y = np.zeros_like(x)
    for e in range(w1.shape[0]):
        gate = np.where(ids == e, weights, 0.0).sum(axis=1, dtype=np.float64)
        if gate.any():
            y += gate[:, None] * ffn(w1[e], w2[e])
    for s in range(sw1.shape[0]):
        y += ffn(sw1[s], sw2[s])
    return y


@test
def reference_is_the_golden_truth_bit_for_bit():
    for name in ("softmax-fp32", "v3-router", "softmax-reduced"):
        d, cfg, ranks, t = golden(name)
        y = moe_ep.reference(t["tokens.x"], t["router.topk_ids"], t["router.topk_weights"], cfg, ranks=ranks)
        assert np.array_equal(y, t["output.truth"]), "%s: max diff %g" % (name, np.abs(y - t["output.truth"]).max())


@test
def route_is_the_golden_routing():
    for name in ("softmax-fp32", "v3-router"):
        d, cfg, ranks, t = golden(name)
        ids, weights = moe_ep.route(t["tokens.x"], cfg)
        assert np.array_equal(ids, t["router.topk_ids"]), name
        assert np.array_equal(weights, t["router.topk_weights"]), name


@test
def generated_weights_are_the_golden_ones():
    d, cfg, ranks, t = golden("softmax-fp32")
    w1, w2 = cfg.expert(3)
    assert np.array_equal(w1, t["experts.w1"][3]) and np.array_equal(w2, t["experts.w2"][3])
    assert np.array_equal(cfg.gate(), t["gate.weight"])


@test
def reference_on_caller_weights_is_a_numpy_moe():
    cfg = moe_ep.Config(preset="tiny", tokens=20, shared_experts=1, seed=7)
    s = cfg.shape
    rng = np.random.default_rng(5)
    E, S, d, f, k = s["experts"], s["shared_experts"], s["hidden"], s["ffn"], s["topk"]
    w1 = (rng.standard_normal((E, 2 * f, d)) / np.sqrt(d)).astype(np.float32)
    w2 = (rng.standard_normal((E, d, f)) / np.sqrt(f)).astype(np.float32)
    sw1 = (rng.standard_normal((S, 2 * f, d)) / np.sqrt(d)).astype(np.float32)
    sw2 = (rng.standard_normal((S, d, f)) / np.sqrt(f)).astype(np.float32)
    x = rng.uniform(-1, 1, (20, d)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(20)]).astype(np.int32)
    weights = rng.uniform(0.1, 1, (20, k)).astype(np.float32)
    y = moe_ep.reference(x, ids, weights, cfg, w1=w1, w2=w2, shared_w1=sw1, shared_w2=sw2)
    want = numpy_moe(x, ids, weights, w1, w2, sw1, sw2)
    err = np.abs(y - want).max() / np.abs(want).max()
    assert err < 1e-12, "relative difference %g" % err
    generated = moe_ep.reference(x, ids, weights, cfg)
    assert np.abs(generated - y).max() > 1e-3, "the caller's weights were not used"


def cfg_value(d, key):
    return json.load(open(os.path.join(d, "manifest.json")))["config"][key]


@test
def reference_stages_are_the_golden_sets_stages():
    for name in ("softmax-fp32", "v3-fp8"):  # fp32 wire; FP8 dispatch, weight at the activation
        d, cfg, ranks, t = golden(name)
        x = t["tokens.x"]
        stages = moe_ep.reference(x, config=cfg, ranks=ranks, stages=True)
        ids, weights = stages["router.topk_ids"], stages["router.topk_weights"]
        assert np.array_equal(ids, t["router.topk_ids"]), name
        assert np.array_equal(stages["output.y"], t["output.truth"]), name
        out = stages["experts.out"]
        for r in range(ranks):  # each rank's received rows and its pairs' outputs
            token = t["dispatch.rank%d.token" % r]
            assert np.array_equal(stages["dispatch.x"][token], t["dispatch.rank%d.x" % r]), (name, r)
            for (i, e), got in zip(t["experts.rank%d.pair" % r], t["experts.rank%d.out" % r]):
                slot = list(ids[i]).index(e)
                g = weights[i, slot] if cfg_value(d, "weight-at") == "activation" else 1.0
                want = g * out[i, slot]
                # docs/golden.md's experts.*.out: u (d + f) of the value and of the
                # pairs' rms, then (bf16 combine) one bf16 step
                rel = 2.0 ** -24 * (x.shape[1] + cfg.shape["ffn"])
                bound = rel * (np.abs(want) + np.sqrt(np.mean(out[ids >= 0] ** 2)))
                if cfg_value(d, "combine-dtype") == "bf16":
                    bound += 2.0 ** -8 * np.abs(want)
                assert (np.abs(got - want) <= bound).all(), (name, r, i, e, np.abs(got - want).max())
    assert not np.array_equal(stages["dispatch.x"], x), "v3-fp8 dispatches FP8: the rows must change"
    routed = (stages["experts.out"] * stages["router.topk_weights"][:, :, None]).sum(axis=1)
    assert np.abs(routed).max() > 0


@test
def reference_backward_is_the_golden_sets_truth():
    d, cfg, ranks, t = golden("softmax-backward")
    g = moe_ep.reference_backward(t["tokens.x"], t["backward.dy"], cfg)
    # the same fp64 operations as the set's truth, token by token and expert by expert
    for name, key in (("dx", "backward.dx"), ("dw1", "backward.experts.dw1"), ("dw2", "backward.experts.dw2")):
        assert np.array_equal(g[name], t[key + ".truth"]), (name, np.abs(g[name] - t[key + ".truth"]).max())
    # summed over all tokens at once here, rank by rank there: fp64 order only
    for name, key in (("dgate", "backward.gate.dw"), ("dshared_w1", "backward.shared.dw1"),
                      ("dshared_w2", "backward.shared.dw2")):
        want = t[key + ".truth"]
        assert np.abs(g[name] - want).max() <= 1e-12 * np.abs(want).max(), name
    grads = {"dx": t["backward.dx"], "dw1": t["backward.experts.dw1"], "dw2": t["backward.experts.dw2"],
             "dshared_w1": t["backward.shared.dw1"], "dshared_w2": t["backward.shared.dw2"],
             "dgate": t["backward.gate.dw"]}
    r = moe_ep.check_backward(grads, t["tokens.x"], t["backward.dy"], cfg, ranks=ranks)
    assert r.passed and 0 < r.used <= 1, repr(r)
    grads["dw1"] = grads["dw1"].copy()
    grads["dw1"][2, 3, 4] += 1e-3
    r = moe_ep.check_backward(grads, t["tokens.x"], t["backward.dy"], cfg, ranks=ranks)
    assert not r.passed and "dw1[2][3][4]" in r.message, repr(r)


@test
def check_passes_a_right_layer_and_fails_a_wrong_one():
    d, cfg, ranks, t = golden("softmax-fp32")
    x, ids, weights = t["tokens.x"], t["router.topk_ids"], t["router.topk_weights"]
    r = moe_ep.check(t["output.y"], x, ids, weights, cfg, ranks=ranks)
    assert r.passed and 0 < r.used <= 1, repr(r)
    wrong = t["output.y"].copy()
    wrong[5, 7] += 1e-4
    r = moe_ep.check(wrong, x, ids, weights, cfg, ranks=ranks)
    assert not r.passed and "y[5][7]" in r.message, repr(r)


@test
def verify_passes_a_sets_own_tensors_and_names_a_wrong_stage():
    d, cfg, ranks, t = golden("softmax-fp32")
    names = ["router.topk_ids", "router.topk_weights", "experts.rank0.out", "output.y"]
    v = moe_ep.verify(d, {n: t[n] for n in names})
    assert v.passed and v.compared == 4 and v.first_failing is None, repr(v)
    assert dict((s, c) for s, c, _ in v.stages) == {"inputs": 0, "router": 2, "layout": 0, "dispatch": 0,
                                                  "experts": 1, "output": 1, "backward": 0}, v.stages
    bad = dict((n, t[n]) for n in names)
    bad["experts.rank0.out"] = bad["experts.rank0.out"] * np.float32(1.01)
    v = moe_ep.verify(d, bad)
    assert not v.passed and v.first_failing == "experts" and "experts.rank0.out" in v.table, repr(v)


@test
def verify_says_what_it_checked_and_requires_stages():
    d, cfg, ranks, t = golden("softmax-fp32")
    v = moe_ep.verify(d, {"output.y": t["output.y"]})
    assert v.passed and v.checked == ["output"], repr(v.checked)
    assert v.missing == ["inputs", "router", "layout", "dispatch", "experts"], v.missing
    v = moe_ep.verify(d, {"output.y": t["output.y"]}, require="router,output")
    assert not v.passed and v.missing_required == ["router"] and v.first_failing is None, repr(v)
    v = moe_ep.verify(d, {"output.y": t["output.y"], "outptu.y": t["output.y"]}, allow_unknown=True)
    assert v.passed and "outptu.y" in v.table, v.table


@test
def module_verify_exits_as_the_cli_does():
    d, cfg, ranks, t = golden("softmax-fp32")
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        good, bad = os.path.join(tmp, "good.safetensors"), os.path.join(tmp, "bad.safetensors")
        safetensors.write(good, {"output.y": t["output.y"]})
        safetensors.write(bad, {"output.y": t["output.y"] + np.float32(1e-3)})
        env = dict(os.environ, PYTHONPATH=os.path.abspath(os.path.join(SRCDIR, "python")))
        d = os.path.abspath(d)
        safetensors.write(os.path.join(tmp, "--odd.safetensors"), {"output.y": t["output.y"]})
        codes = [subprocess.run([sys.executable, "-m", "moe_ep", "verify"] + p, env=env, cwd=tmp,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE).returncode
                 for p in ([d, good], [d, bad], [d, os.path.join(tmp, "missing.safetensors")],
                           ["--", d, "--odd.safetensors"])]
    assert codes == [0, 1, 2, 0], codes


@test
def bad_arguments_raise_value_error_naming_them():
    cfg = moe_ep.Config(preset="tiny", tokens=4)
    x = cfg.tokens(0)
    ids, weights = moe_ep.route(x, cfg)
    cases = [
        (lambda: moe_ep.Config(tokens=0), "--tokens"),
        (lambda: moe_ep.Config(no_such_flag=1), "no-such-flag"),
        (lambda: moe_ep.reference(x[:, :3], ids, weights, cfg), "x must have shape"),
        (lambda: moe_ep.reference(x, ids[:, :1], weights, cfg), "topk_ids"),
        (lambda: moe_ep.reference(x, ids + 100, weights, cfg), "ids[0][0]"),
        (lambda: moe_ep.reference(x, ids, weights * np.nan, cfg), "not finite"),
        (lambda: moe_ep.reference(x, ids, weights, cfg, w1=np.zeros((1, 2, 3))), "w1 must have shape"),
        (lambda: moe_ep.reference(x, ids, weights, cfg, w1=np.zeros((8, 128, 128), np.float32)),
         "w1 and w2"),
        (lambda: moe_ep.verify("/nonexistent", {"output.y": x}), "manifest"),
        (lambda: moe_ep.verify(GOLDEN + "/softmax-fp32", {}), "non-empty dict"),
        (lambda: moe_ep.verify(GOLDEN + "/softmax-fp32", {"outptu.y": x}), "nearest: 'output.y'"),
        (lambda: moe_ep.verify(GOLDEN + "/softmax-fp32", {"output.y": x}, require="gemm"), "'gemm' is not a stage"),
        # the sweep's: values that a cast would change silently
        (lambda: moe_ep.Config(preset="tiny\0x"), "NUL"),
        (lambda: moe_ep.Config(preset="tiny", check="maybe"), "--check must be true or false"),
        (lambda: cfg.tokens(1.5), "rank must be an integer"),
        (lambda: cfg.tokens(10**12), "rank must fit a 32-bit int"),
        (lambda: cfg.expert(True), "n must be an integer"),
        (lambda: cfg.validate("2"), "ranks must be an integer"),
        (lambda: moe_ep.reference(x, ids + 0.5, weights, cfg), "topk_ids must hold integers"),
        (lambda: moe_ep.reference(x, ids > 3, weights, cfg), "topk_ids must hold integers"),
        (lambda: moe_ep.reference(x, ids.astype(np.int64) + 2**40, weights, cfg), "topk_ids must fit int32"),
        (lambda: moe_ep.route(np.where(x > 0, np.nan, x), cfg), "x[0]["),
        (lambda: moe_ep.reference(np.where(x > 0, np.inf, x), ids, weights, cfg), "is not finite"),
        (lambda: moe_ep.reference(x, ids, weights, cfg, w1=np.full((8, 128, 128), np.nan, np.float32),
                                  w2=np.zeros((8, 128, 64), np.float32)), "w1[0][0] is not finite"),
        # the stages and the backward
        (lambda: moe_ep.reference(x, ids, None, cfg), "topk_ids and topk_weights together"),
        (lambda: moe_ep.reference(x, ids, weights, cfg, gate=cfg.gate()), "gate routes the tokens"),
        (lambda: moe_ep.reference_backward(x, x, cfg), "needs --backward true"),
        (lambda: moe_ep.reference_backward(x, x[:2], moe_ep.Config(preset="tiny", backward=True)),
         "dy must have shape"),
        (lambda: moe_ep.check_backward({"dW1": x}, x, x, moe_ep.Config(preset="tiny", backward=True)),
         "'dW1' is not a gradient"),
        (lambda: moe_ep.check_backward({"dx": x}, x, x, moe_ep.Config(preset="tiny", backward=True),
                                       ranks=3), "ranks must be at least 1 and divide tokens"),
    ]
    for call, fragment in cases:
        try:
            call()
        except ValueError as e:
            assert fragment in str(e), "%r lacks %r" % (str(e), fragment)
        else:
            raise AssertionError("no ValueError for %s" % fragment)


@test
def torch_example_passes_where_torch_is():
    env = dict(os.environ, PYTHONPATH=os.path.join(SRCDIR, "python"))
    run = subprocess.run([sys.executable, os.path.join(SRCDIR, "examples", "torch_moe_test.py")], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print("  " + run.stdout.strip().replace("\n", "\n  "))
    if run.returncode == 77:
        raise Skip("no torch here")
    assert run.returncode == 0, run.stdout


@test
def torch_port_passes_every_shipped_set_where_torch_is():
    """examples/torch_port.py, a whole-layer port in torch, passes every
    shipped set with every stage required; with the first GEMM rounded to
    bf16 it fails at experts every set made without that rounding."""
    env = dict(os.environ, PYTHONPATH=os.path.join(SRCDIR, "python"))
    sets = sorted(os.path.join(GOLDEN, s) for s in os.listdir(GOLDEN) if os.path.isdir(os.path.join(GOLDEN, s)))
    command = [sys.executable, os.path.join(SRCDIR, "examples", "torch_port.py")]
    good = subprocess.run(command + sets, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print("  " + good.stdout.strip().splitlines()[-1])
    if good.returncode == 77:
        raise Skip("no torch here")
    assert good.returncode == 0, good.stdout
    assert "torch port: %d of %d sets passed" % (len(sets), len(sets)) in good.stdout, good.stdout
    bad = subprocess.run(command + ["--bf16-gemm"] + sets, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    fp32 = [s for s in sets if json.load(open(os.path.join(s, "manifest.json")))["config"]["gemm-out-dtype"] != "bf16"]
    assert bad.returncode == 1 and fp32, bad.stdout
    assert bad.stdout.count("verify: FAIL, first failing stage: experts") == len(fp32), bad.stdout


failed = [(n, why) for n, why in results if why]
for name, why in results:
    print("%s: %s%s" % ("FAIL" if why else "PASS", name, " (%s)" % why if why else ""))
print("python: %d passed, %d failed" % (len(results) - len(failed), len(failed)))
sys.exit(1 if failed else 0)
