# SPDX-License-Identifier: MIT
"""Read and write safetensors files with the standard library and numpy only:
the Python package's pure-Python module (python/moe_ep/safetensors.py), so
that no C code of moe-ep takes part and the files are checked against the
format itself.
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from moe_ep.safetensors import DTYPES, NAMES, load, write as save  # noqa: E402,F401


def load_set(golden):
    """A golden set's manifest and every tensor of its stage files, by name."""
    manifest = json.load(open(os.path.join(golden, "manifest.json")))
    files = {}
    for stage in manifest["stages"]:
        path = os.path.join(golden, stage + ".safetensors")
        if os.path.exists(path):
            files.update(load(path)[0])
    return manifest, files
