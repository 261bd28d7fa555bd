# SPDX-License-Identifier: MIT
"""Golden sets crafted to break verify: every case is a copy of a shipped set
with one inconsistency, and with checksums that match (a careless or hostile
editor fixes them), as the untrusted input verify must treat a set as.

    crafted.py SET WORK: writes WORK/NAME/ for every case, one per line to
    stdout as "NAME EXIT FRAGMENT" (the exit status verify must give and a
    fragment of its one error line; '-' when it must pass).
"""
import hashlib
import json
import os
import shutil
import sys

import numpy as np

import st

src, work = sys.argv[1], sys.argv[2]


def case(name, want, fragment, edit):
    """A copy of the set, edited by edit(dir, manifest); checksums refreshed."""
    d = os.path.join(work, name)
    shutil.copytree(src, d)
    with open(os.path.join(d, "manifest.json")) as f:
        m = json.load(f)
    edit(d, m)
    for file, info in m.get("files", {}).items():
        p = os.path.join(d, file)
        if isinstance(info, dict) and os.path.isfile(p) and "sha256" in info:
            with open(p, "rb") as f:
                info["sha256"] = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump(m, f, indent=1)
    print(name, want, fragment)


def retensor(d, file, name, value):
    """Replace tensor name in file (a numpy array, or None to drop it)."""
    p = os.path.join(d, file)
    tensors, _ = st.load(p)
    tensors = {k: np.array(v) for k, v in tensors.items()}
    if value is None:
        del tensors[name]
    else:
        tensors[name] = value
    st.save(p, tensors)


def drop_key(tensor, key):
    return lambda d, m: m["tensors"][tensor].pop(key)


def set_key(tensor, key, value):
    return lambda d, m: m["tensors"][tensor].__setitem__(key, value)


def ids(d, fill):
    t, _ = st.load(os.path.join(d, "router.safetensors"))
    a = np.array(t["router.topk_ids"])
    a[0, 0] = fill
    retensor(d, "router.safetensors", "router.topk_ids", a)


def cut_selection(d, m):
    t, _ = st.load(os.path.join(d, "router.safetensors"))
    retensor(d, "router.safetensors", "router.selection", np.array(t["router.selection"])[:1])


def cut_selection_and_manifest(d, m):
    cut_selection(d, m)
    m["tensors"]["router.selection"]["shape"][0] = 1


def zero_dim_ids(d, m):
    retensor(d, "router.safetensors", "router.topk_ids", np.array(7, dtype=np.int32))
    m["tensors"]["router.topk_ids"]["shape"] = []


def huge_y(d, m):
    m["tensors"]["output.y"]["shape"] = [2**40, 2**40]


def integer_tolerance(d, m):
    # Tolerances written as JSON integers are read as numbers: with abs = 1000
    # the candidate's shifted output (below) is within contract.
    m["tensors"]["output.y"]["abs"] = 1000
    m["tensors"]["output.y"]["rel"] = 0


def config_value(key, value):
    return lambda d, m: m["config"].__setitem__(key, value)


def bad_file_name(d, m):
    m["files"]["../outside.safetensors"] = m["files"].pop("router.safetensors")
    for t in m["tensors"].values():
        if t["file"] == "router.safetensors":
            t["file"] = "../outside.safetensors"


def i8_ids(d, m):
    t, _ = st.load(os.path.join(d, "router.safetensors"))
    retensor(d, "router.safetensors", "router.topk_ids", np.array(t["router.topk_ids"]).astype(np.uint8))
    m["tensors"]["router.topk_ids"]["dtype"] = "U8"


def pair_out_of_range(d, m):
    t, _ = st.load(os.path.join(d, "experts.safetensors"))
    a = np.array(t["experts.rank0.pair"])
    a[0] = [2**30, -2**30]
    retensor(d, "experts.safetensors", "experts.rank0.pair", a)


case("no-compare", 2, "has no \"compare\"", drop_key("output.y", "compare"))
case("no-file", 2, "names no file", drop_key("output.y", "file"))
case("no-stage", 2, "has no known \"stage\"", drop_key("router.topk_ids", "stage"))
case("ids-plus", 2, "holds id 1073741824, outside [-1, 8)", lambda d, m: ids(d, 2**30))
case("ids-minus", 2, "holds id -1073741824, outside [-1, 8)", lambda d, m: ids(d, -2**30))
case("selection-cut", 2, "is not the dtype and shape its manifest lists", cut_selection)
case("selection-cut-listed", 2, "does not have the shape its config gives it", cut_selection_and_manifest)
case("ids-0-dim", 2, "compared as topk is not (tokens, k) I32", zero_dim_ids)
case("y-2^80", 2, "shape that is not sizes of at most 2^40", huge_y)
case("abs-string", 2, "no finite \"abs\"", set_key("output.y", "abs", "0.1"))
case("abs-negative", 2, "no finite \"abs\"", set_key("output.y", "abs", -1))
case("allow-elsewhere", 2, "\"allow\" that is not an F64 tensor", set_key("output.y", "allow", "router.logits"))
case("bf16-step-text", 2, "\"bf16_step\" that is not true", set_key("output.y", "bf16_step", "yes"))
case("config-ranks", 2, "lacks ranks, tokens", config_value("ranks", "0"))
case("config-tokens-text", 2, "lacks ranks, tokens", config_value("tokens", "many"))
case("config-number", 2, "config value 'seed' is not a string", config_value("seed", 1))
case("format-version", 2, "\"format_version\" is not 1", lambda d, m: m.__setitem__("format_version", 2))
case("not-a-set", 2, "is not a moe-ep golden manifest", lambda d, m: m.__setitem__("format", "other"))
case("file-outside", 2, "has no \"sha256\" of 64 hex digits", bad_file_name)
case("ids-u8", 2, "compared as topk is not (tokens, k) I32", i8_ids)
case("pair-out-of-range", 1, "first failing stage: experts", pair_out_of_range)
case("integer-tolerance", 0, "-", integer_tolerance)
case("stages-string", 2, "\"stages\" is not a list of stage names", lambda d, m: m.__setitem__("stages", "router"))
case("stages-unknown", 2, "\"stages\" is not a list of stage names", lambda d, m: m.__setitem__("stages", ["router", "x"]))
case("bytes-negative", 2, "has no \"sha256\" of 64 hex digits and \"bytes\"",
     lambda d, m: m["files"]["router.safetensors"].__setitem__("bytes", -1))
