"""The servers' optimizer settings of a torch optimizer's param_groups:
every option run exactly or refused (ValueError naming the group, the
option and its value). Pure functions."""

import math

import numpy as np
import torch

from . import _precision


# Keys torch's lr schedulers add to a param_group for their own use: they
# only compute lr, momentum and betas, which travel with every step.
_SCHEDULER_KEYS = ("initial_lr", "max_lr", "min_lr", "max_momentum",
                   "base_momentum", "swa_lr")

# Keys that may change between steps besides lr (OneCycleLR and CyclicLR
# cycle them): each push of the group carries their values
# (PushPullRequest.momentum, beta1, beta2).
_STEPPED = ("momentum", "betas")

# By optimizer class: the keys turned into the servers' settings, and the
# keys the servers run only at the value given (torch 1.13's own keys;
# foreach=None lets torch pick an implementation of the same update).
_MAPPED = {
    torch.optim.SGD: ("momentum", "nesterov", "weight_decay"),
    torch.optim.Adam: ("betas", "eps", "weight_decay"),
    torch.optim.AdamW: ("betas", "eps", "weight_decay"),
    torch.optim.Adagrad: ("eps", "weight_decay", "initial_accumulator_value"),
}
_COMMON = dict(maximize=(False,), foreach=(None, False),
               differentiable=(False,))
_FIXED = {
    torch.optim.SGD: dict(dampening=(0,), **_COMMON),
    torch.optim.Adam: dict(amsgrad=(False,), capturable=(False,),
                           fused=(None, False), **_COMMON),
    torch.optim.AdamW: dict(amsgrad=(False,), capturable=(False,),
                            fused=(None, False), **_COMMON),
    torch.optim.Adagrad: dict(lr_decay=(0,), **_COMMON),
}


def _same(value, allowed):
    # Not `value in allowed`, which takes 0.0 for False and 1 for True.
    if allowed is None or isinstance(allowed, bool):
        return value is allowed
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and value == allowed)


def _check_keys(cls, group_index, group):
    """Every key of a group is mapped to the servers' settings, run only at
    a value the servers run exactly, or a learning-rate key; anything else
    (a key of the script's own, an option of a newer torch) is refused."""
    where = f"{cls.__name__}(param_groups[{group_index}])"
    fixed = _FIXED[cls]
    for key, value in group.items():
        if key in ("params", "lr") or key in _SCHEDULER_KEYS or (
                key in _MAPPED[cls]):
            continue
        if key not in fixed:
            raise ValueError(
                f"{where}: {key}={value!r} is not an option shardps knows: "
                "the servers would not run it (remove it from the group)")
        allowed = fixed[key]
        if not any(_same(value, a) for a in allowed):
            raise ValueError(
                f"{where}: {key}={value!r} cannot run on the shardps servers "
                f"(supported: {', '.join(repr(a) for a in allowed)})")


def _nonzero(where, key, value, default):
    # The servers' OptimizerSpec reads 0 (also a float32 that rounds to 0)
    # as "unset" and runs its default instead.
    value = float(value)
    if np.float32(value) == 0:
        raise ValueError(
            f"{where}: {key}={value!r} cannot run on the shardps servers: "
            f"their optimizer settings take 0 for unset and would run "
            f"{key}={default} instead (a value that is not 0 in float32, "
            "such as 1e-30, runs as given)")
    return value


def _server_optimizer(optimizer, group_index, group):
    """The servers' optimizer settings (a dict for _shardps) of one group."""
    cls = type(optimizer)
    if cls not in _MAPPED:
        raise ValueError(
            f"{cls.__name__} cannot run on the shardps servers: use "
            "torch.optim.SGD, Adam, AdamW or Adagrad")
    _check_keys(cls, group_index, group)
    where = f"{cls.__name__}(param_groups[{group_index}])"
    if cls is torch.optim.SGD:
        spec = dict(kind="sgd", momentum=group["momentum"],
                    nesterov=bool(group["nesterov"]),
                    weight_decay=group["weight_decay"])
    elif cls in (torch.optim.Adam, torch.optim.AdamW):
        beta1, beta2 = group["betas"]
        spec = dict(kind="adam" if cls is torch.optim.Adam else "adamw",
                    beta1=_nonzero(where, "betas[0]", beta1, 0.9),
                    beta2=_nonzero(where, "betas[1]", beta2, 0.999),
                    eps=_nonzero(where, "eps", group["eps"], 1e-8),
                    weight_decay=group["weight_decay"])
    else:
        spec = dict(kind="adagrad",
                    eps=_nonzero(where, "eps", group["eps"], 1e-10),
                    weight_decay=group["weight_decay"],
                    initial_accumulator=group["initial_accumulator_value"])
    # The learning rate travels with every step; the declared one only
    # has to be valid.
    lr = float(group["lr"])
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"param_groups[{group_index}]: lr={lr} must be "
                         "finite and >= 0")
    spec["lr"] = lr if lr > 0 else 1.0
    return spec


def _settings(group):
    """A group's settings that must not change during training."""
    return {k: v for k, v in group.items()
            if k not in ("params", "lr") and k not in _SCHEDULER_KEYS
            and k not in _STEPPED}


def _in_unit_interval(where, key, value):
    value = float(value)
    if not 0 <= value < 1:  # NaN fails too
        raise ValueError(f"{where}: {key}={value!r} must be in [0, 1)")
    return value


def _stepped(optimizer, group_index, group, spec):
    """The momentum or betas a group's pushes carry this step (keyword
    arguments of session.push), as torch's step would read them."""
    cls = type(optimizer)
    where = f"{cls.__name__}(param_groups[{group_index}])"
    if spec["kind"] == "sgd":
        momentum = _in_unit_interval(where, "momentum", group["momentum"])
        if np.float32(spec["momentum"]) != 0:
            return dict(momentum=momentum)
        if momentum != 0:
            raise ValueError(
                f"{where}: momentum={momentum!r}, but the group was declared "
                "with momentum 0, for which the servers keep no momentum "
                "buffer. Declare the SGD with a momentum > 0, or "
                "construct the scheduler that sets it (OneCycleLR, CyclicLR) "
                "on the torch optimizer before wrapping it in "
                "DistributedOptimizer")
        return {}
    if spec["kind"] in ("adam", "adamw"):
        beta1, beta2 = group["betas"]
        return dict(beta1=_in_unit_interval(where, "betas[0]", beta1),
                    beta2=_in_unit_interval(where, "betas[1]", beta2))
    return {}


def _step_settings(optimizer, groups, declared, specs):
    """For each group, what its pushes carry this step besides lr
    (_stepped). ValueError naming the group and the keys when a setting
    that may not change did."""
    stepped = []
    for gi, group in enumerate(groups):
        now = _settings(group)
        if now != declared[gi]:
            changed = sorted(k for k in set(now) | set(declared[gi])
                             if now.get(k) != declared[gi].get(k))
            raise ValueError(
                f"param_groups[{gi}]: {', '.join(changed)} changed after "
                "the model was declared: only lr, momentum (SGD) and betas "
                "(Adam, AdamW) can change during training (they travel "
                "with every step)")
        stepped.append(_stepped(optimizer, gi, group, specs[gi]))
    return stepped


def _check_parameter(name, p, shape=None, device=None):
    _precision.check_parameter(name, p.dtype)
    if device is not None and p.device != device:
        raise ValueError(
            f"parameter {name} is on {p.device}, the model was declared on "
            f"{device}: move it back (the servers' weights are copied to "
            "the declared device after every step)")
    if p.is_sparse or not p.is_contiguous():
        raise ValueError(f"parameter {name} is not a contiguous dense tensor")
    if p.numel() == 0:
        raise ValueError(f"parameter {name} has no elements")
    if shape is not None and tuple(p.shape) != shape:
        raise ValueError(
            f"parameter {name} changed shape from {list(shape)} to "
            f"{list(p.shape)} after the model was declared")
