# SPDX-License-Identifier: MIT
"""moe-ep from Python: an MoE layer's dense fp64 truth and golden-set verify,
over the C library (libmoe-ep) with ctypes; numpy arrays in and out.

    import moe_ep
    cfg = moe_ep.Config(preset="tiny", tokens=24)     # any flag of `moe-ep run`
    x = cfg.tokens(rank=0)                            # (T, d) float32, or your own
    ids, weights = moe_ep.route(x, cfg)               # the configured router, or your own top-k
    y = moe_ep.reference(x, ids, weights, cfg)        # (T, d) float64, no MPI
    t = moe_ep.reference(x, config=cfg, stages=True)  # the truth at every stage, by name
    g = moe_ep.reference_backward(x, dy, cfg)         # the gradients (needs backward=True)
    r = moe_ep.check(my_layer_output, x, ids, weights, cfg)   # moe-ep's tolerance
    v = moe_ep.verify("golden/", {"output.y": y_port, ...})   # per-stage result

reference() and check() take the caller's expert weights (w1 (E, 2f, d),
w2 (E, d, f), shared_w1, shared_w2) or use the config's generated ones
(cfg.expert(n), cfg.gate()). Bad arguments raise ValueError with the
library's message, running out of memory MemoryError. The library is found at $MOE_EP_LIBRARY, in the build
tree (../.libs next to this package), or where the system's loader looks.
"""
import ctypes
import ctypes.util
import os
import tempfile

import numpy as np

from . import safetensors

__all__ = ["Config", "route", "reference", "check", "reference_backward", "check_backward", "verify",
           "CheckResult", "VerifyResult", "library"]

API_VERSION = 3
OK, FAIL, BAD_INPUT, RUNTIME = 0, 1, 2, 3
STAGES = 7


class _Shape(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("tokens", "hidden", "ffn", "experts", "topk",
                                              "shared_experts")]


class _VerifyResult(ctypes.Structure):
    _fields_ = [("verdict", ctypes.c_int), ("compared", ctypes.c_int), ("first_failing", ctypes.c_int),
                ("stage_compared", ctypes.c_int * STAGES), ("stage_failed", ctypes.c_int * STAGES),
                ("stage_in_set", ctypes.c_int * STAGES), ("missing_required", ctypes.c_uint),
                ("message", ctypes.c_char * 512)]


GRADIENTS = ("dx", "dw1", "dw2", "dshared_w1", "dshared_w2", "dgate")


class _Gradients(ctypes.Structure):
    _fields_ = [(name, ctypes.POINTER(ctypes.c_float)) for name in GRADIENTS]


class _TruthGradients(ctypes.Structure):
    _fields_ = [(name, ctypes.POINTER(ctypes.c_double)) for name in GRADIENTS]


def _gradient_shapes(s, tokens):
    """The whole layer's gradients' shapes, by name (moe_ep_truth_gradients)."""
    d, f, E, S = s["hidden"], s["ffn"], s["experts"], s["shared_experts"]
    return {"dx": (tokens, d), "dw1": (E, 2 * f, d), "dw2": (E, d, f), "dshared_w1": (S, 2 * f, d),
            "dshared_w2": (S, d, f), "dgate": (E, d)}


class _VerifyOptions(ctypes.Structure):
    _fields_ = [("require", ctypes.c_uint), ("allow_unknown", ctypes.c_int)]


_lib = None


def _candidates():
    env = os.environ.get("MOE_EP_LIBRARY")
    if env:
        yield env
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "..", "..", ".libs", "libmoe-ep.so")
    found = ctypes.util.find_library("moe-ep")
    if found:
        yield found
    yield "libmoe-ep.so.1"


def library():
    """The loaded libmoe-ep (ctypes.CDLL), its API version checked."""
    global _lib
    if _lib is not None:
        return _lib
    errors = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError as e:
            errors.append("%s: %s" % (path, e))
    else:
        raise OSError("moe_ep: libmoe-ep not found (set MOE_EP_LIBRARY): " + "; ".join(errors))
    P, F, I, D = ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int32), \
        ctypes.POINTER(ctypes.c_double)
    sig = {
        "moe_ep_api_version": (ctypes.c_int, []),
        "moe_ep_config_new": (P, []),
        "moe_ep_config_free": (None, [P]),
        "moe_ep_config_set": (ctypes.c_int, [P, ctypes.c_char_p, ctypes.c_char_p]),
        "moe_ep_config_validate": (ctypes.c_int, [P, ctypes.c_int]),
        "moe_ep_config_shape": (_Shape, [P]),
        "moe_ep_config_error": (ctypes.c_char_p, [P]),
        "moe_ep_config_tokens": (ctypes.c_int, [P, ctypes.c_int, F]),
        "moe_ep_config_expert": (ctypes.c_int, [P, ctypes.c_int, ctypes.c_int, F, F]),
        "moe_ep_config_gate": (ctypes.c_int, [P, F]),
        "moe_ep_config_use_weights": (ctypes.c_int, [P, F, F, F, F]),
        "moe_ep_config_route": (ctypes.c_int, [P, F, ctypes.c_int64, F, I, F]),
        "moe_ep_truth": (ctypes.c_int, [P, ctypes.c_int, F, I, F, ctypes.c_int64, D]),
        "moe_ep_truth_stages": (ctypes.c_int, [P, ctypes.c_int, F, I, F, ctypes.c_int64, F, D, D]),
        "moe_ep_check": (ctypes.c_int, [P, ctypes.c_int, F, I, F, ctypes.c_int64, F, D]),
        "moe_ep_truth_backward": (ctypes.c_int, [P, F, F, ctypes.c_int64, ctypes.POINTER(_TruthGradients)]),
        "moe_ep_check_backward": (ctypes.c_int, [P, ctypes.c_int, F, F, ctypes.c_int64,
                                                 ctypes.POINTER(_Gradients), D]),
        "moe_ep_verify_stage_name": (ctypes.c_char_p, [ctypes.c_int]),
        "moe_ep_verify_with": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p, P, P,
                                         ctypes.POINTER(_VerifyResult)]),
    }
    for name, (restype, argtypes) in sig.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    if lib.moe_ep_api_version() != API_VERSION:
        raise OSError("moe_ep: libmoe-ep speaks API %d, this package %d"
                      % (lib.moe_ep_api_version(), API_VERSION))
    _lib = lib
    return lib


def _ptr(array, ctype):
    return array.ctypes.data_as(ctypes.POINTER(ctype)) if array is not None else None


def _raise(code, message):
    if code == BAD_INPUT:
        raise ValueError(message)
    if message.startswith("cannot allocate"):  # the library returned, the process goes on
        raise MemoryError(message)
    raise RuntimeError(message)


class Config:
    """The flags of `moe-ep run`, checked by the library as the CLI checks
    them: Config(preset="tiny", tokens=24, router="deepseek-v3") sets
    --preset first, then each keyword (underscores become dashes; True and
    False for switches)."""

    def __init__(self, preset=None, **flags):
        self._lib = library()
        self._c = self._lib.moe_ep_config_new()
        if not self._c:
            raise MemoryError("moe_ep: no memory for a config")
        self._given = None
        if preset is not None:
            self.set("preset", preset)
        for name, value in flags.items():
            self.set(name, value)

    def __del__(self):
        if getattr(self, "_c", None):
            self._lib.moe_ep_config_free(self._c)
            self._c = None

    def _check(self, code):
        if code != OK:
            _raise(code, self._lib.moe_ep_config_error(self._c).decode())

    def set(self, flag, value):
        """One flag: set("tokens", 64), set("--router", "deepseek-v3")."""
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        if "\0" in text or "\0" in str(flag):
            raise ValueError("%s: a NUL character would cut the value short, got %r" % (flag, text))
        self._check(self._lib.moe_ep_config_set(self._c, flag.replace("_", "-").encode(), text.encode()))
        return self

    def validate(self, ranks=1):
        self._check(self._lib.moe_ep_config_validate(self._c, _int(ranks, "ranks")))
        return self

    @property
    def shape(self):
        """dict: tokens (per rank), hidden, ffn, experts, topk, shared_experts."""
        s = self._lib.moe_ep_config_shape(self._c)
        return {name: getattr(s, name) for name, _ in _Shape._fields_}

    def tokens(self, rank=0):
        """x (T, d) float32: the tokens of `rank` in `moe-ep run`."""
        s = self.shape
        x = np.empty((s["tokens"], s["hidden"]), dtype=np.float32)
        self._check(self._lib.moe_ep_config_tokens(self._c, _int(rank, "rank"), _ptr(x, ctypes.c_float)))
        return x

    def expert(self, n, shared=False):
        """(w1 (2f, d), w2 (d, f)) float32: the generated weights of expert n."""
        s = self.shape
        w1 = np.empty((2 * s["ffn"], s["hidden"]), dtype=np.float32)
        w2 = np.empty((s["hidden"], s["ffn"]), dtype=np.float32)
        self._check(self._lib.moe_ep_config_expert(self._c, int(bool(shared)), _int(n, "n"),
                                                    _ptr(w1, ctypes.c_float), _ptr(w2, ctypes.c_float)))
        return w1, w2

    def gate(self):
        """W_g (E, d) float32, as the router holds it."""
        s = self.shape
        g = np.empty((s["experts"], s["hidden"]), dtype=np.float32)
        self._check(self._lib.moe_ep_config_gate(self._c, _ptr(g, ctypes.c_float)))
        return g

    def _use_weights(self, w1, w2, shared_w1, shared_w2):
        s = self.shape
        E, S, d, f = s["experts"], s["shared_experts"], s["hidden"], s["ffn"]
        arrays = [_array(w1, "w1", (E, 2 * f, d), np.float32, optional=True),
                  _array(w2, "w2", (E, d, f), np.float32, optional=True),
                  _array(shared_w1, "shared_w1", (S, 2 * f, d), np.float32, optional=True),
                  _array(shared_w2, "shared_w2", (S, d, f), np.float32, optional=True)]
        self._given = arrays  # kept alive while the library reads them
        self._check(self._lib.moe_ep_config_use_weights(self._c, *[_ptr(a, ctypes.c_float) for a in arrays]))


def _int(value, name):
    """value as a C int, or ValueError naming it (no float, no bool, no wrap)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError("%s must be an integer, got %r" % (name, value))
    if not -2**31 <= int(value) < 2**31:
        raise ValueError("%s must fit a 32-bit int, got %d" % (name, value))
    return int(value)


def _array(value, name, shape, dtype, optional=False):
    """value as a C-contiguous array of dtype and shape, or ValueError naming it."""
    if value is None:
        if optional:
            return None
        raise ValueError("%s is required" % name)
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.shape != tuple(shape):
        raise ValueError("%s must have shape %s, got %s" % (name, tuple(shape), array.shape))
    if array.dtype.kind not in "fiub":
        raise ValueError("%s must hold numbers, got dtype %s" % (name, array.dtype))
    if np.dtype(dtype).kind == "i":  # ids: integers that fit, not a float or bool cast
        if array.dtype.kind not in "iu":
            raise ValueError("%s must hold integers, got dtype %s" % (name, array.dtype))
        info = np.iinfo(dtype)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise ValueError("%s must fit %s, got values in [%d, %d]" % (name, np.dtype(dtype).name,
                                                                         array.min(), array.max()))
    return np.ascontiguousarray(array, dtype=dtype)


def _config(config, flags):
    if config is None:
        return Config(**flags)
    if flags:
        raise ValueError("give flags to Config, or pass config=None: got both (%s)" % ", ".join(flags))
    if not isinstance(config, Config):
        raise ValueError("config must be a moe_ep.Config, got %s" % type(config).__name__)
    return config


def _tokens(cfg, x):
    """x as (T, d) float32 for any T, or ValueError naming it."""
    return _array(x, "x", (np.shape(x)[0] if np.ndim(x) == 2 else -1, cfg.shape["hidden"]), np.float32)


def _routing(cfg, x, topk_ids, topk_weights):
    s = cfg.shape
    x = _tokens(cfg, x)
    T = x.shape[0]
    ids = _array(topk_ids, "topk_ids", (T, s["topk"]), np.int32)
    weights = _array(topk_weights, "topk_weights", (T, s["topk"]), np.float32)
    return x, ids, weights, T


def route(x, config=None, gate=None, **flags):
    """(topk_ids (T, k) int32, topk_weights (T, k) float32): the configured
    router on x (T, d), with the config's gate or `gate` (E, d)."""
    cfg = _config(config, flags)
    s = cfg.shape
    x = _tokens(cfg, x)
    g = _array(gate, "gate", (s["experts"], s["hidden"]), np.float32, optional=True)
    ids = np.empty((x.shape[0], s["topk"]), dtype=np.int32)
    weights = np.empty((x.shape[0], s["topk"]), dtype=np.float32)
    cfg._check(cfg._lib.moe_ep_config_route(cfg._c, _ptr(x, ctypes.c_float), x.shape[0],
                                            _ptr(g, ctypes.c_float), _ptr(ids, ctypes.c_int32),
                                            _ptr(weights, ctypes.c_float)))
    return ids, weights


def reference(x, topk_ids=None, topk_weights=None, config=None, ranks=1, w1=None, w2=None,
              shared_w1=None, shared_w2=None, gate=None, stages=False, **flags):
    """y (T, d) float64: the dense truth of the layer on x (T, d) routed by
    topk_ids, topk_weights (T, k), or by the configured router (with the
    config's gate, or `gate` (E, d)) when both are None: every selected
    expert in fp64 (fixed order: the same bits on every machine),
    gate-weighted, summed in id order, plus the shared experts; the config's
    roundings (--dtype, --dispatch-dtype, --combine-dtype over `ranks` ranks)
    as the EP path applies them. Weights: the caller's, or the config's
    generated ones.

    stages=True returns a dict of the truth at each stage a port can be
    compared at, named as the golden sets name their stages:
    "router.topk_ids", "router.topk_weights" (T, k), "dispatch.x" (T, d)
    float32 (x as the experts' ranks receive it, after --dispatch-dtype),
    "experts.out" (T, k, d) float64 (each pair's expert output before its
    gate weight and any combine rounding; zeros for a -1 id) and
    "output.y" (T, d) float64."""
    cfg = _config(config, flags)
    if topk_ids is None and topk_weights is None:
        topk_ids, topk_weights = route(x, cfg, gate=gate)
    elif topk_ids is None or topk_weights is None:
        raise ValueError("give topk_ids and topk_weights together, or neither (the configured router)")
    elif gate is not None:
        raise ValueError("gate routes the tokens: give it without topk_ids and topk_weights")
    x, ids, weights, T = _routing(cfg, x, topk_ids, topk_weights)
    cfg._use_weights(w1, w2, shared_w1, shared_w2)
    s = cfg.shape
    y = np.empty((T, s["hidden"]), dtype=np.float64)
    dispatched = np.empty((T, s["hidden"]), dtype=np.float32) if stages else None
    pairs = np.empty((T, s["topk"], s["hidden"]), dtype=np.float64) if stages else None
    cfg._check(cfg._lib.moe_ep_truth_stages(cfg._c, _int(ranks, "ranks"), _ptr(x, ctypes.c_float),
                                            _ptr(ids, ctypes.c_int32), _ptr(weights, ctypes.c_float), T,
                                            _ptr(dispatched, ctypes.c_float), _ptr(pairs, ctypes.c_double),
                                            _ptr(y, ctypes.c_double)))
    if not stages:
        return y
    return {"router.topk_ids": ids, "router.topk_weights": weights, "dispatch.x": dispatched,
            "experts.out": pairs, "output.y": y}


class CheckResult:
    """passed; used, the largest share of the tolerance a value took (<= 1
    passes); message, the worst value when it failed."""

    def __init__(self, passed, used, message):
        self.passed, self.used, self.message = passed, used, message

    def __bool__(self):
        return self.passed

    def __repr__(self):
        return "CheckResult(passed=%s, used=%.3g%s)" % (self.passed, self.used,
                                                         ", message=%r" % self.message if self.message else "")


def check(y, x, topk_ids, topk_weights, config=None, ranks=1, w1=None, w2=None, shared_w1=None,
          shared_w2=None, **flags):
    """y (T, d), a layer's fp32 output, against reference() under moe-ep's
    tolerance (docs/numerics.md)."""
    cfg = _config(config, flags)
    x, ids, weights, T = _routing(cfg, x, topk_ids, topk_weights)
    y = _array(y, "y", (T, cfg.shape["hidden"]), np.float32)
    cfg._use_weights(w1, w2, shared_w1, shared_w2)
    used = ctypes.c_double(0.0)
    code = cfg._lib.moe_ep_check(cfg._c, _int(ranks, "ranks"), _ptr(x, ctypes.c_float), _ptr(ids, ctypes.c_int32),
                                 _ptr(weights, ctypes.c_float), T, _ptr(y, ctypes.c_float),
                                 ctypes.byref(used))
    if code not in (OK, FAIL):
        cfg._check(code)
    message = cfg._lib.moe_ep_config_error(cfg._c).decode() if code == FAIL else ""
    return CheckResult(code == OK, used.value, message)


def reference_backward(x, dy, config=None, w1=None, w2=None, shared_w1=None, shared_w2=None,
                       **flags):
    """The layer's gradients in fp64 (a dict: dx (N, d), dw1 (E, 2f, d),
    dw2 (E, d, f), dshared_w1 (S, 2f, d), dshared_w2 (S, d, f), dgate (E,
    d)) for every rank's tokens x and upstream gradient dy (N, d), routed by
    the configured router (whose gradient flows through its logits); the
    config needs backward=True. No MPI."""
    cfg = _config(config, flags)
    x = _tokens(cfg, x)
    N = x.shape[0]
    dy = _array(dy, "dy", x.shape, np.float32)
    cfg._use_weights(w1, w2, shared_w1, shared_w2)
    out = {name: np.empty(shape, dtype=np.float64) for name, shape in _gradient_shapes(cfg.shape, N).items()}
    g = _TruthGradients(*[_ptr(out[name], ctypes.c_double) for name in GRADIENTS])
    cfg._check(cfg._lib.moe_ep_truth_backward(cfg._c, _ptr(x, ctypes.c_float), _ptr(dy, ctypes.c_float), N,
                                              ctypes.byref(g)))
    return out


def check_backward(gradients, x, dy, config=None, ranks=1, w1=None, w2=None, shared_w1=None,
                   shared_w2=None, **flags):
    """gradients, a dict of the layer's fp32 gradients (any of the names of
    reference_backward, whole-layer shapes), made by `ranks` ranks of N/ranks
    tokens each, against reference_backward under `moe-ep run --backward
    --check`'s tolerance. A CheckResult naming the worst element."""
    cfg = _config(config, flags)
    x = _tokens(cfg, x)
    N = x.shape[0]
    dy = _array(dy, "dy", x.shape, np.float32)
    if not isinstance(gradients, dict) or not gradients:
        raise ValueError("gradients must be a non-empty dict of name -> array (%s)" % ", ".join(GRADIENTS))
    shapes = _gradient_shapes(cfg.shape, N)
    for name in gradients:
        if name not in shapes:
            raise ValueError("gradients: %r is not a gradient (%s)" % (name, ", ".join(GRADIENTS)))
    arrays = {name: _array(gradients.get(name), name, shapes[name], np.float32, optional=True)
              for name in GRADIENTS}
    cfg._use_weights(w1, w2, shared_w1, shared_w2)
    g = _Gradients(*[_ptr(arrays[name], ctypes.c_float) for name in GRADIENTS])
    used = ctypes.c_double(0.0)
    code = cfg._lib.moe_ep_check_backward(cfg._c, _int(ranks, "ranks"), _ptr(x, ctypes.c_float),
                                          _ptr(dy, ctypes.c_float), N, ctypes.byref(g), ctypes.byref(used))
    if code not in (OK, FAIL):
        cfg._check(code)
    message = cfg._lib.moe_ep_config_error(cfg._c).decode() if code == FAIL else ""
    return CheckResult(code == OK, used.value, message)


class VerifyResult:
    """What verify compared: passed; verdict (0 pass, 1 fail); compared
    (tensors); first_failing (a stage name or None); stages, a list of
    (stage, compared, failed); checked and missing, the names of the set's
    stages the candidate held tensors of and those it left out;
    missing_required, the required ones among them; table, verify's
    per-tensor table; message."""

    def __init__(self, r, table, lib):
        self.verdict, self.compared, self.table = r.verdict, r.compared, table
        self.passed = r.verdict == OK
        self.first_failing = lib.moe_ep_verify_stage_name(r.first_failing).decode() \
            if r.first_failing >= 0 else None
        self.stages = [(lib.moe_ep_verify_stage_name(s).decode(), r.stage_compared[s], r.stage_failed[s])
                       for s in range(STAGES)]
        in_set = [s for s in range(STAGES) if r.stage_in_set[s]]
        self.checked = [self.stages[s][0] for s in in_set if r.stage_compared[s]]
        self.missing = [self.stages[s][0] for s in in_set if not r.stage_compared[s]]
        self.missing_required = [self.stages[s][0] for s in in_set if r.missing_required >> s & 1]
        self.message = r.message.decode()

    def __bool__(self):
        return self.passed

    def __str__(self):
        return self.table

    def __repr__(self):
        return "VerifyResult(passed=%s, compared=%d, first_failing=%r)" % (self.passed, self.compared,
                                                                           self.first_failing)


def verify(golden_dir, candidate, require=(), allow_unknown=False):
    """candidate: a safetensors path, or a dict name -> numpy array or torch
    tensor (written to a temporary safetensors file). require: stage names
    the candidate must hold tensors of, or "all" (each missing one fails);
    allow_unknown: ignore tensors the set does not name (by default such a
    name, a misspelt one say, raises ValueError). A VerifyResult; a golden
    set or candidate that cannot be read raises ValueError."""
    lib = library()
    names = [lib.moe_ep_verify_stage_name(s).decode() for s in range(STAGES)]
    if isinstance(require, str):
        require = require.split(",")
    mask = 0
    for stage in require:
        if stage != "all" and stage not in names:
            raise ValueError("require: %r is not a stage (%s, or all)" % (stage, ", ".join(names)))
        mask |= 0xFFFFFFFF if stage == "all" else 1 << names.index(stage)
    options = _VerifyOptions(mask, 1 if allow_unknown else 0)
    if not isinstance(golden_dir, (str, os.PathLike)):
        raise ValueError("golden_dir must be a path, got %s" % type(golden_dir).__name__)
    with tempfile.TemporaryDirectory(prefix="moe_ep.") as tmp:
        path = candidate
        if isinstance(candidate, dict):
            if not candidate:
                raise ValueError("candidate must be a non-empty dict of name -> array")
            path = os.path.join(tmp, "candidate.safetensors")
            safetensors.write(path, candidate)
        elif not isinstance(candidate, (str, os.PathLike)):
            raise ValueError("candidate must be a path or a dict of arrays, got %s" % type(candidate).__name__)
        table_path = os.path.join(tmp, "table.txt")
        libc = ctypes.CDLL(None)
        libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        out = libc.fopen(table_path.encode(), b"w")
        r = _VerifyResult()
        lib.moe_ep_verify_with(os.fsencode(golden_dir), os.fsencode(path), ctypes.byref(options), out,
                               ctypes.byref(r))
        libc.fclose(out)
        with open(table_path, encoding="utf-8", errors="replace") as f:
            table = f.read()
    if r.verdict not in (OK, FAIL):
        _raise(r.verdict, r.message.decode())
    return VerifyResult(r, table, lib)
