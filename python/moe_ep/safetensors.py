# SPDX-License-Identifier: MIT
"""Read and write safetensors files (the format of golden sets and of the
candidates moe-ep verify reads) with the standard library and numpy only:
an 8-byte little-endian header length, a JSON header of each tensor's
dtype, shape and byte range, then the data, row-major. numpy has no
bfloat16 or float8: BF16 travels as its uint16 bit patterns and F8_E4M3 as
uint8 bytes; a value given as (DTYPE, array) names the dtype of raw bytes.
"""
import json
import struct

import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_, "F8_E4M3": np.uint8}
NAMES = {np.dtype(v): k for k, v in DTYPES.items() if k != "F8_E4M3"}


def as_numpy(name, value):
    """(safetensors dtype, numpy array) of a numpy array, a torch tensor
    (bfloat16 and float8_e4m3fn kept bit for bit) or a (DTYPE, array) pair."""
    if isinstance(value, tuple):
        return value[0], np.ascontiguousarray(value[1])
    if hasattr(value, "detach"):  # a torch tensor, on any device
        import torch
        t = value.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            return "BF16", t.view(dtype=torch.int16).numpy().view(np.uint16)
        if str(t.dtype) == "torch.float8_e4m3fn":
            return "F8_E4M3", t.view(dtype=torch.uint8).numpy()
        value = t.numpy()
    array = np.ascontiguousarray(value)
    if array.dtype not in NAMES:
        raise ValueError("tensor '%s': dtype %s has no safetensors name" % (name, array.dtype))
    return NAMES[array.dtype], array


def write(path, tensors):
    """tensors: name -> numpy array, torch tensor or (DTYPE, array), written
    in the dict's order."""
    header, chunks, offset = {}, [], 0
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise ValueError("tensor names must be strings, got %r" % (name,))
        dtype, array = as_numpy(name, value)
        raw = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in chunks:
            f.write(raw)


def load(path):
    """All tensors of a file as a dict of numpy arrays, and its metadata."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8 or struct.unpack("<Q", blob[:8])[0] > len(blob) - 8:
        raise ValueError("%s: not a safetensors file" % path)
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + length])
    data = blob[8 + length:]
    meta = header.pop("__metadata__", {})
    tensors = {}
    for name, entry in header.items():
        if entry["dtype"] not in DTYPES:
            raise ValueError("%s: tensor '%s' has dtype %s" % (path, name, entry["dtype"]))
        begin, end = entry["data_offsets"]
        dtype = np.dtype(DTYPES[entry["dtype"]]).newbyteorder("<")
        tensors[name] = np.frombuffer(data[begin:end], dtype=dtype).reshape(entry["shape"])
    return tensors, meta


def read(path):
    """All tensors of a file as a dict of numpy arrays."""
    return load(path)[0]
