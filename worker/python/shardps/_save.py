"""spt.save: a model's state (parameters, persistent buffers, every name of
a tied parameter) as a safetensors file a fresh model loads strictly."""

import json
import os
import struct
import tempfile

import numpy as np
import torch

from . import _context

# safetensors' dtype names.
_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
           torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


def save(model, path, metadata=None):
    """Writes model.state_dict() as safetensors, with `metadata` (str ->
    str) in the header: every parameter (a tied one under each of its
    names) and every persistent buffer (BatchNorm statistics), so that
    `fresh.load_state_dict(load(path))` accepts it strictly. A bfloat16 or
    float16 parameter that the job's DistributedOptimizer trains is written
    as its float32 master weights (the servers' copy, which the model holds
    rounded); everything else as it is, in its dtype. Optimizer state lives
    on the servers, checkpointed by them. The file appears whole or not at
    all (written aside, then renamed).

    Raises:
        ValueError: a tensor of a dtype safetensors has no name for.
        RuntimeError: while a step is open (its replies are writing the
            weights).
        OSError: the file cannot be written.
    """
    ctx = _context.current()
    optimizer = ctx._optimizer if ctx is not None else None
    tensors = []
    for name, t in model.state_dict(keep_vars=True).items():
        master = None
        if (isinstance(t, torch.nn.Parameter) and optimizer is not None
                and t.dtype != torch.float32):
            master = float32_weights(optimizer, t)
        if master is not None:
            t = torch.from_numpy(master).view(t.shape)
        tensors.append((name, t.detach().cpu().contiguous()))
    meta = {"format": "pt"}
    if ctx is not None:
        meta["step"] = str(ctx.step)
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
    write(path, tensors, meta)


def load(path):
    """The tensors of a safetensors file spt.save wrote (any safetensors
    file of the dtypes above), by name, on the CPU: what
    model.load_state_dict takes.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a safetensors file, or has another dtype.
    """
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: not a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise ValueError(f"{path}: not a safetensors file ({e})") from None
    body = memoryview(data)[8 + n:]
    by_name = {v: k for k, v in _DTYPES.items()}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in by_name:
            raise ValueError(f"{path}: {name} has dtype {info.get('dtype')}")
        dtype = by_name[info["dtype"]]
        b, e = info["data_offsets"]
        raw = torch.frombuffer(bytearray(body[b:e]), dtype=torch.uint8)
        out[name] = raw.view(dtype).reshape(info["shape"]).clone()
    return out


def write(path, tensors, metadata):
    """(name, CPU contiguous tensor) pairs as a safetensors file, in that
    order, written aside and renamed into place."""
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name, t in tensors:
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} is {t.dtype}: safetensors has no name "
                             "for it")
        blob = t.reshape(-1).view(torch.uint8).numpy().tobytes() if (
            t.numel()) else b""
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".spt-save-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for blob in blobs:
                f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def float32_weights(opt, p):
    """The job's float32 weights of parameter p of DistributedOptimizer
    `opt` after the last step (a flat array), or None for a parameter not
    declared here. Raises RuntimeError while a step is open: its replies
    are writing them."""
    if opt._open or opt._ctx.session.step_open:
        raise RuntimeError(
            "the job's float32 weights are being written by the open "
            "step's replies: read them (spt.save) after step()")
    i = opt._index.get(id(p))
    if i is None:
        return None
    session = opt._ctx.session
    if session.wire[1] == "ENCODING_FP32":
        return opt._weights[i]
    # The replies are rounded (bf16 wire): read the servers' own.
    if opt._exact is None or opt._exact[0] != session.step:
        arrays = [np.empty_like(w) for w in opt._weights]
        session.pull_fp32(arrays)
        opt._exact = (session.step, arrays)
    return opt._exact[1][i]
