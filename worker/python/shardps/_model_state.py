"""What shardps.torch keeps of a model besides its parameters' updates:
the buffers it broadcasts, and the message when p.grad changed after its
push."""

import torch

from . import _collectives
from . import _precision


def _changed_message(names):
    shown = ", ".join(names[:5])
    if len(names) > 5:
        shown += f" and {len(names) - 5} more"
    return (
        f"p.grad of {shown} changed between backward and step() (an "
        "in-place op such as clip_grad_norm_ or p.grad.mul_, or a new "
        "tensor). shardps pushes each gradient to the servers as backward "
        "produces it: this step was taken with the gradients as backward "
        "left them, and the change was not applied. Change gradients before "
        "the push instead: scale the loss rather than p.grad, clip values in "
        "a hook on the parameter (p.register_hook(lambda g: "
        "g.clamp(-c, c))), or leave p.grad unchanged until step(). To clip "
        "by the global norm use opt.clip_grad_norm_(max_norm) or "
        "DistributedOptimizer(..., max_grad_norm=...); for loss scaling "
        "shardps.torch.GradScaler: the servers clip and unscale the "
        "averaged gradient")


def _buffers_to_broadcast(ctx, named_buffers):
    """The buffers DistributedOptimizer broadcasts at every step: all of
    them (as DDP) when one is floating-point, else none."""
    buffers, seen = [], set()
    for name, b in named_buffers or ():
        if b is None or id(b) in seen:
            continue
        seen.add(id(b))
        if b.device.type not in ("cpu", "cuda") or b.is_sparse:
            raise ValueError(f"buffer {name} is {b.layout} on {b.device}: "
                             "shardps.torch broadcasts dense CPU and CUDA "
                             "buffers")
        buffers.append(b)
    if not any(b.is_floating_point() for b in buffers):
        return []
    nbytes = sum(b.numel() * b.element_size() for b in buffers)
    if nbytes > _collectives.MAX_BYTES:
        raise ValueError(
            f"the model's buffers hold {nbytes} bytes, over the collectives' "
            f"limit of {_collectives.MAX_BYTES} (1 MiB): pass "
            "broadcast_buffers=False (each rank then keeps its own)")
    if not ctx.session.coordinated and ctx.num_workers > 1:
        raise ValueError(
            "broadcast_buffers needs a coordinator (this static job of "
            f"{ctx.num_workers} workers has none): start the job with one "
            "(shardps-local does) or pass broadcast_buffers=False")
    return buffers


def check_unchanged(opt):
    """Raises RuntimeError naming the parameters written since `opt` loaded
    the job's weights into them (their version counters moved): the servers
    would overwrite the change at the next step, so it is refused before
    anything of the step is sent."""
    written = [n for n, p, v in zip(opt._names, opt._params, opt._loaded)
               if p._version != v]
    if not written:
        return
    shown = ", ".join(written[:5]) + (
        f" and {len(written) - 5} more" if len(written) > 5 else "")
    raise RuntimeError(
        f"parameter {shown} changed since step() loaded the job's weights "
        "(model.load_state_dict, an in-place op on the parameter): the "
        "servers hold the job's weights and would overwrite the change at "
        "this step. Load weights before making the DistributedOptimizer "
        "(rank 0's values become the job's), or restore a servers' "
        "checkpoint; nothing of this step was sent")


def changed_gradients(opt):
    """The names of the parameters of DistributedOptimizer `opt` whose
    p.grad changed since its push:
    another tensor, an in-place op (its version counter, shared with
    .detach() views) or different values (an op on p.grad.data, as
    torch 1.13's clip_grad_value_, bumps no version)."""
    changed = []
    for i, sent in enumerate(opt._sent):
        if sent is None:
            continue
        grad, version, scale, fingerprint = sent
        now = opt._params[i].grad
        if now is not grad or now._version != version:
            changed.append(opt._names[i])
            continue
        if opt._stager is not None:
            if opt._stager.changed(now.detach(), scale, fingerprint,
                                   opt._buffers[i]):
                changed.append(opt._names[i])
            continue
        g = _precision.as_pushed(now.detach(), scale)
        # Bitwise, so that a NaN pushed is a NaN unchanged.
        if not torch.equal(g.view(torch.int32),
                           opt._buffers[i][1].view(torch.int32)):
            changed.append(opt._names[i])
    return changed


def broadcast_buffers(ctx, buffers):
    """Every buffer takes the lead's values: one message for all, their
    bytes packed, padded to 8, as int64 (a broadcast moves bytes; their
    dtypes play no part)."""
    if not buffers:
        return
    parts = [b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
             for b in buffers]
    packed = torch.cat(parts)
    pad = -packed.numel() % 8
    if pad:
        packed = torch.cat([packed, torch.zeros(pad, dtype=torch.uint8)])
    result = _collectives.broadcast_bytes(ctx.session,
                                          packed.numpy().tobytes())
    got = torch.frombuffer(bytearray(result), dtype=torch.uint8)
    offset = 0
    with torch.no_grad():
        for b, part in zip(buffers, parts):
            n = part.numel()
            # clone: a view of another dtype needs an aligned start.
            b.copy_(got[offset:offset + n].clone().view(b.dtype)
                    .view(b.shape))
            offset += n
