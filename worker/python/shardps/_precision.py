"""Mixed precision in shardps.torch: the parameter dtypes it trains and
their float32 copies (the servers keep float32 weights and optimizer state
whatever the model's dtype), and the refusal of torch's own loss scaler.
Pure functions.

A bfloat16 or float16 parameter trains with float32 master weights on the
servers: its initial values and its gradients become float32 exactly
(every bf16 and fp16 value is a float32), the servers run the update in
float32, and the model gets the float32 weights rounded to nearest even
(`p.copy_(w)`, as `w.to(p.dtype)`). So the servers' weights are exactly
what fp32-master training computes from the same low-precision gradients,
and the model's copy is their rounding. float32 parameters go as they are.

A model whose every parameter is bfloat16 goes bf16 on the wire both ways
(unless init() was given an encoding): its gradients are bf16 values, so
the bf16 encoding carries them exactly, and the servers round the replies
to nearest even as p.copy_ would. Half the bytes, the same weights.
"""

import torch

# Every value of these is a float32 value: converting is exact.
TRAINED = (torch.float32, torch.bfloat16, torch.float16)


def choose_wire(ctx, params):
    """bf16 both ways for an all-bfloat16 model, when the job's init()
    chose no encoding (ctx.wire_given)."""
    if ctx.wire_given or not params or any(
            p.dtype != torch.bfloat16 for p in params):
        return
    ctx.session.set_wire("bf16", "bf16")


def check_parameter(name, dtype):
    if dtype not in TRAINED:
        raise ValueError(
            f"parameter {name} is {dtype}: shardps trains float32, bfloat16 "
            "and float16 parameters (the servers keep float32 weights); "
            "convert it (model.float())")


def check_gradient(name, g, device):
    if g.dtype not in TRAINED or g.device != device:
        raise ValueError(f"the gradient of {name} is {g.dtype} on "
                         f"{g.device}: want float32, bfloat16 or float16 on "
                         f"{device} (the parameter's device)")


def initial_values(p):
    """p's values as a flat float32 array (a view of p when it is a float32
    CPU tensor)."""
    t = p.detach().cpu()
    if t.dtype != torch.float32:
        t = t.float()
    return t.numpy().reshape(-1)


def copy_gradient(g, out, scale):
    """Writes g * scale into the float32 tensor `out` (g's shape): the
    product in float32 (torch.mul's), after an exact conversion of g."""
    if g.dtype == torch.float32:
        if scale != 1.0:
            torch.mul(g, scale, out=out)
        else:
            out.copy_(g)
        return
    out.copy_(g)
    if scale != 1.0:
        out.mul_(scale)


def as_pushed(g, scale):
    """What copy_gradient(g, out, scale) writes, as a new float32 tensor (or
    g itself): to compare bitwise with `out`."""
    g = g.float()
    return g * scale if scale != 1.0 else g


def refuse_loss_scaler(grad_scaler):
    """Raises ValueError for an enabled loss scaler of torch's
    (torch.cuda.amp.GradScaler passes itself to step() when the optimizer
    says _step_supports_amp_scaling). Unscaling p.grad after backward
    cannot reach the servers, which got the scaled gradients during
    backward, and skipping optimizer.step() would leave the job's step
    half done. A disabled scaler (torch's on a machine without CUDA) calls
    step() without itself, as plain torch does."""
    if grad_scaler is None:
        return
    is_enabled = getattr(grad_scaler, "is_enabled", None)
    if is_enabled is not None and not is_enabled():
        return
    raise ValueError(
        f"{type(grad_scaler).__name__} is an enabled loss scaler of torch's: "
        "it cannot drive a shardps DistributedOptimizer, whose gradients "
        "reached the servers scaled during backward (unscaling p.grad or "
        "skipping step() here cannot take effect there). Use "
        "shardps.torch.GradScaler (spt.GradScaler): the servers unscale and "
        "skip a non-finite step on every shard. This step's scaled "
        "gradients were already pushed: stop the script here")
