"""Reads a float32 safetensors file into numpy arrays (test-only)."""

import json
import struct

import numpy as np


def read(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        assert meta["dtype"] == "F32", meta
        b, e = meta["data_offsets"]
        out[name] = np.frombuffer(body[b:e], dtype=np.float32).reshape(
            meta["shape"])
    return out, header.get("__metadata__", {})
