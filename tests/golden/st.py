# SPDX-License-Identifier: MIT
"""Read and write safetensors files with the standard library and numpy only.

Used by the golden-set tests; no C code of moe-ep takes part, so the files are
checked against the format itself.
"""
import json
import os
import struct

import numpy as np

# BF16 travels as its raw 16-bit patterns (numpy has no bfloat16): an array
# of uint16 is written as BF16, and BF16 is read back as uint16.
DTYPES = {"F32": np.float32, "F64": np.float64, "I32": np.int32, "BOOL": np.bool_, "U8": np.uint8,
          "I64": np.int64, "I16": np.int16, "F16": np.float16, "BF16": np.uint16}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


def load(path):
    """All tensors of a file, as a dict of numpy arrays, and its metadata."""
    with open(path, "rb") as f:
        blob = f.read()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    data = blob[8 + length :]
    meta = header.pop("__metadata__", {})
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        array = np.frombuffer(data[begin:end], dtype=DTYPES[entry["dtype"]])
        tensors[name] = array.reshape(entry["shape"])
    return tensors, meta


def load_set(golden):
    """A golden set's manifest and every tensor of its stage files, by name."""
    manifest = json.load(open(os.path.join(golden, "manifest.json")))
    files = {}
    for stage in manifest["stages"]:
        path = os.path.join(golden, stage + ".safetensors")
        if os.path.exists(path):
            files.update(load(path)[0])
    return manifest, files


def save(path, tensors):
    """Write a dict of numpy arrays (in insertion order); a value may also be
    (DTYPE, array) to name the dtype of raw bytes, e.g. ("F8_E4M3", uint8s)."""
    header, offset, chunks = {}, 0, []
    for name, array in tensors.items():
        dtype, array = array if isinstance(array, tuple) else (NAMES[np.dtype(array.dtype)], array)
        raw = np.ascontiguousarray(array).tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        offset += len(raw)
        chunks.append(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in chunks:
            f.write(raw)
