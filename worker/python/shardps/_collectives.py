"""Collectives over a job's workers for what is not a gradient: metrics,
flags, seeds, buffers (shardps.torch re-exports all_reduce, broadcast and
barrier).

They go through the coordinator (rpc Collective), which knows the job's
membership and is off the gradient path: every live worker calls the same
collectives in the same order, the coordinator waits for all of them,
reduces in rank order and answers each with bitwise the same result. A
tensor is at most MAX_BYTES (1 MiB). A worker that leaves the job (or
dies: its heartbeats stop) makes the others' pending collective fail with
shardps.Aborted naming it; one that never calls makes it fail with
shardps.DeadlineExceeded naming the ranks missing once a caller's
timeout_s runs out.
"""

import numpy as np
import torch

from . import _context

MAX_BYTES = 1 << 20
DEFAULT_TIMEOUT_S = 300.0

_DTYPES = {torch.float32: ("float32", np.float32),
           torch.float64: ("float64", np.float64),
           torch.int64: ("int64", np.int64)}
_OPS = ("mean", "sum", "max", "min")


def _session(context):
    return _context._context_or(context).session


def _check(tensor, what):
    """(dtype name, numpy dtype) of a tensor a collective can carry."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{what} takes a torch.Tensor, got "
                         f"{type(tensor).__name__}")
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"{what}: the tensor is {tensor.dtype}; collectives "
                         "carry float32, float64 or int64")
    if tensor.device.type not in ("cpu", "cuda") or tensor.is_sparse:
        raise ValueError(f"{what}: the tensor is {tensor.layout} on "
                         f"{tensor.device}; collectives take dense CPU or "
                         "CUDA tensors")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes > MAX_BYTES:
        raise ValueError(
            f"{what}: the tensor holds {nbytes} bytes, over the collectives' "
            f"limit of {MAX_BYTES} (1 MiB): they are for metrics, flags, "
            "seeds and buffers; gradients go through DistributedOptimizer")
    return _DTYPES[tensor.dtype]


def _write(tensor, result, np_dtype):
    out = np.frombuffer(result, dtype=np_dtype).reshape(tuple(tensor.shape))
    with torch.no_grad():
        tensor.copy_(torch.from_numpy(out.copy()))


def all_reduce(tensor, op="mean", timeout_s=DEFAULT_TIMEOUT_S, context=None):
    """Reduces `tensor` over the job's live workers, in place (as
    torch.distributed.all_reduce).

    Every rank gets bitwise the same result, the same run to run: the
    coordinator combines the ranks' tensors in rank order ((r0 + r1) + r2
    ...; mean then divides by the number of ranks; max and min keep the
    first NaN).

    Args:
        tensor: a CPU or CUDA tensor of float32, float64 or int64, at most
            1 MiB; overwritten with the result (a CUDA one goes through
            host memory).
        op: "mean" (float tensors only), "sum" (int64 wraps modulo 2^64),
            "max" or "min".
        timeout_s: how long to wait for the other ranks.
        context: the Context (default: the one init() returned).
    Returns:
        None; `tensor` holds the result.
    Raises:
        ValueError: another dtype, device or op, mean of int64, or a tensor
            over 1 MiB (nothing is sent).
        shardps.InvalidArgument: another rank called a different collective
            (op, dtype or shape) at this point; the message names both.
        shardps.Aborted: a rank left the job (or died) before calling it.
        shardps.DeadlineExceeded: ranks did not call it within a caller's
            timeout; the message names them.
        shardps.FailedPrecondition: a static job of several workers (no
            coordinator to meet at).
    """
    dtype, np_dtype = _check(tensor, "all_reduce")
    if op not in _OPS:
        raise ValueError(f"all_reduce: op={op!r} is not one of "
                         f"{', '.join(_OPS)}")
    if op == "mean" and dtype == "int64":
        raise ValueError("all_reduce: op='mean' of an int64 tensor is not "
                         "exact: reduce with 'sum' and divide")
    values = tensor.detach().cpu().contiguous().numpy().tobytes()
    result = _session(context).collective(
        op, dtype, list(tensor.shape), values, 0, float(timeout_s))
    _write(tensor, result, np_dtype)


def broadcast(tensor, src=0, timeout_s=DEFAULT_TIMEOUT_S, context=None):
    """Overwrites `tensor` on every rank with rank `src`'s (as
    torch.distributed.broadcast).

    Args:
        tensor: a CPU or CUDA tensor of float32, float64 or int64, at
            most 1 MiB, of the same shape and dtype on every rank.
        src: the rank whose tensor everyone gets; -1: the lowest rank in
            the job (the lead, as ctx.is_lead says).
        timeout_s: how long to wait for the other ranks.
        context: the Context (default: the one init() returned).
    Returns:
        None; `tensor` holds src's values.
    Raises:
        ValueError: as all_reduce, or a src below -1.
        shardps.FailedPrecondition: src is not a live worker of the job.
        shardps.InvalidArgument, shardps.Aborted,
        shardps.DeadlineExceeded: as all_reduce.
    """
    dtype, np_dtype = _check(tensor, "broadcast")
    if not isinstance(src, int) or src < -1:
        raise ValueError(f"broadcast: src={src!r} must be a rank or -1 (the "
                         "lowest rank)")
    session = _session(context)
    # Only src's values are used: the others send none, except with -1,
    # where a rank does not know whether it is the lowest.
    sends = src == -1 or src == session.rank
    values = (tensor.detach().cpu().contiguous().numpy().tobytes() if sends
              else b"")
    result = session.collective("broadcast", dtype, list(tensor.shape),
                                values, src, float(timeout_s))
    _write(tensor, result, np_dtype)


def barrier(timeout_s=DEFAULT_TIMEOUT_S, context=None):
    """Returns once every live worker of the job has called barrier().

    Args:
        timeout_s: how long to wait for the other ranks.
        context: the Context (default: the one init() returned).
    Raises:
        shardps.Aborted, shardps.DeadlineExceeded,
        shardps.FailedPrecondition: as all_reduce.
    """
    _session(context).collective("barrier", "", [], b"", 0, float(timeout_s))


def broadcast_bytes(session, packed, timeout_s=DEFAULT_TIMEOUT_S):
    """The lowest rank's `packed` (bytes, a multiple of 8 long, the same
    length on every rank), as one int64 broadcast: how
    DistributedOptimizer sends all the buffers in one message."""
    result = session.collective("broadcast", "int64", [len(packed) // 8],
                                packed, -1, float(timeout_s))
    return result
