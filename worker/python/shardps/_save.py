"""spt.save: a model's parameters as a safetensors file."""

import numpy as np
import torch

from . import _context
from . import _shardps


def save(model, path, metadata=None):
    """Writes the model's parameters as safetensors (the names of
    named_parameters(), float32), with `metadata` (str -> str) in the
    header. A bfloat16 or float16 parameter that the job's
    DistributedOptimizer trains is written as its float32 master weights
    (the servers' copy, which the model holds rounded); others as their
    values. Optimizer state lives on the servers, checkpointed by them."""
    ctx = _context.current()
    optimizer = ctx._optimizer if ctx is not None else None
    names, shapes, arrays = [], [], []
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        t = p.detach()
        master = None
        if t.dtype != torch.float32 and optimizer is not None:
            master = float32_weights(optimizer, p)
        if master is not None:
            arrays.append(master)
        else:
            if t.dtype != torch.float32:
                t = t.float()
            arrays.append(np.ascontiguousarray(t.cpu().numpy()).reshape(-1))
        names.append(name)
        shapes.append(list(p.shape))
    meta = {"format": "pt"}
    if ctx is not None:
        meta["step"] = str(ctx.step)
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
    _shardps.write_safetensors(path, names, shapes, arrays, meta)


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
