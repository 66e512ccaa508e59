"""DistributedOptimizer.state_dict() and load_state_dict(): torch's optimizer
state format, read from the servers and written to them.

The servers keep each tensor's optimizer state (the slots and the
optimizer's own step count) in float32, by chunk; the session reads and
writes it whole (rpc ReadOptimizerState and WriteOptimizerState). Between
the two and torch's format:

  SGD      {"momentum_buffer": tensor, or None without momentum}, once the
           parameter has taken a step
  Adam(W)  {"step": tensor(float), "exp_avg": ..., "exp_avg_sq": ...},
           once the parameter has taken a step
  Adagrad  {"step": tensor(float), "sum": ...}, always (torch makes it at
           construction)

keyed by the parameter's index in param_groups order, with torch's own
"param_groups" beside them, so torch.save/torch.load and a plain torch
optimizer's load_state_dict take it as torch's.
"""

import math

import numpy as np
import torch

from ._optim_spec import _settings

# By optimizer class: torch's state keys of the servers' slots, in their
# order, and whether torch keeps a "step".
_SLOTS = {
    torch.optim.SGD: (("momentum_buffer",), False),
    torch.optim.Adam: (("exp_avg", "exp_avg_sq"), True),
    torch.optim.AdamW: (("exp_avg", "exp_avg_sq"), True),
    torch.optim.Adagrad: (("sum",), True),
}


def _check_between_steps(opt, what):
    if opt._open or opt._ctx.session.step_open or any(opt._passes):
        raise RuntimeError(
            f"{what} between backward() and step(): call it between steps "
            "(after step(), before the next backward)")


def _indices(groups):
    """id(param) -> its index in torch's state_dict, as torch numbers them
    (group after group, a parameter's first appearance)."""
    index = {}
    for group in groups:
        for p in group["params"]:
            index.setdefault(id(p), len(index))
    return index


def state_dict(opt):
    _check_between_steps(opt, "state_dict()")
    inner = opt._inner
    packed = torch.optim.Optimizer.state_dict(inner)
    keys, has_step = _SLOTS[type(inner)]
    index = _indices(inner.param_groups)
    read = opt._ctx.session.read_optimizer_state()
    state = {}
    for i, (p, gi) in enumerate(zip(opt._params, opt._group_of)):
        if gi is None:
            continue  # declared, not trained: not the optimizer's
        steps, slots = read[i]
        if steps == 0 and type(inner) is not torch.optim.Adagrad:
            continue  # torch has no state for it before its first step
        entry = {}
        if has_step:
            entry["step"] = torch.tensor(float(steps))
        if slots:
            for key, slot in zip(keys, slots):
                entry[key] = torch.from_numpy(slot).view(p.shape)
        else:  # SGD without momentum
            entry["momentum_buffer"] = None
        state[index[id(p)]] = entry
    packed["state"] = state
    return packed


def _float32(value, where, shape):
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        got = (str(value.dtype) if isinstance(value, torch.Tensor)
               else type(value).__name__)
        raise ValueError(f"{where} is {got}: a floating-point tensor is "
                         "expected")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{where} has shape {list(value.shape)}; the "
                         f"parameter has {list(shape)}")
    array = value.detach().to("cpu", torch.float32).contiguous() \
        .numpy().reshape(-1).copy()
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{where} holds non-finite values")
    return array


def _steps(value, where):
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{where} has {value.numel()} values")
        value = value.item()
    value = float(value)
    if not (math.isfinite(value) and value >= 0 and value == int(value)):
        raise ValueError(f"{where} is {value}: a count of steps >= 0 is "
                         "expected")
    return int(value)


def _entry(opt, p, gi, saved, where):
    """(optimizer steps, [slot arrays]) for the servers from torch's state
    entry `saved` of parameter p (None: a fresh state)."""
    inner = opt._inner
    cls = type(inner)
    keys, has_step = _SLOTS[cls]
    group = inner.param_groups[gi]
    n = p.numel()
    # The servers keep a momentum buffer when the group was declared with
    # momentum (it may be 0 at this step: momentum travels with the push).
    if cls is torch.optim.SGD and opt._specs[gi]["momentum"] == 0:
        keys = ()
    saved = dict(saved or {})
    unknown = sorted(set(saved) - set(keys) - {"step", "momentum_buffer"})
    if unknown or ("step" in saved and not has_step):
        raise ValueError(
            f"{where}: {', '.join(unknown) or 'step'} is not a state "
            f"{cls.__name__} keeps on the shardps servers (they keep "
            f"{', '.join(keys) or 'nothing'})")
    if cls is torch.optim.SGD and not keys:
        if saved.get("momentum_buffer") is not None:
            raise ValueError(
                f"{where}: a momentum_buffer for an SGD group without "
                "momentum (the servers keep none)")
        return (1 if saved else 0), []
    slots = []
    for key in keys:
        value = saved.get(key)
        if value is None:
            start = (group["initial_accumulator_value"]
                     if key == "sum" else 0.0)
            slots.append(np.full(n, start, dtype=np.float32))
        else:
            slots.append(_float32(value, f"{where}[{key!r}]", p.shape))
    if has_step:
        steps = _steps(saved["step"], f"{where}['step']") \
            if "step" in saved else 0
    else:
        # SGD: torch counts no steps; a buffer means one was taken.
        steps = 1 if saved.get("momentum_buffer") is not None else 0
    # Adam's exp_avg_sq and Adagrad's sum are never negative.
    if cls is not torch.optim.SGD and bool(np.any(slots[-1] < 0)):
        raise ValueError(f"{where}[{keys[-1]!r}] holds negative values")
    return steps, slots


def load_state_dict(opt, state_dict):
    _check_between_steps(opt, "load_state_dict()")
    inner = opt._inner
    if not isinstance(state_dict, dict) or set(state_dict) != {
            "state", "param_groups"}:
        raise ValueError("load_state_dict takes an optimizer state_dict: a "
                         "dict of 'state' and 'param_groups'")
    groups = inner.param_groups
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"the state_dict has {len(saved_groups)} parameter groups; the "
            f"optimizer has {len(groups)}")
    for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
        if len(g["params"]) != len(sg["params"]):
            raise ValueError(
                f"param_groups[{gi}] of the state_dict has "
                f"{len(sg['params'])} parameters; the optimizer's has "
                f"{len(g['params'])}")
        now, saved = _settings(g), _settings(sg)
        changed = sorted(k for k in set(now) | set(saved)
                         if now.get(k) != saved.get(k))
        if changed:
            raise ValueError(
                f"param_groups[{gi}]: the state_dict's "
                f"{', '.join(f'{k}={saved.get(k)!r}' for k in changed)} "
                f"do not match the optimizer the servers run "
                f"({', '.join(f'{k}={now.get(k)!r}' for k in changed)}): "
                "only lr, momentum, betas and scheduler keys may differ")
    # Saved index -> (parameter, its group), as torch maps them.
    by_saved = {}
    for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
        for p, saved_id in zip(g["params"], sg["params"]):
            by_saved[saved_id] = (p, gi)
    unknown = sorted(set(state_dict["state"]) - set(by_saved), key=str)
    if unknown:
        raise ValueError(f"the state_dict has state for parameters "
                         f"{unknown} that no group of it lists")
    # Everything is checked before anything is written.
    entries = [None] * len(opt._params)
    given = {id(p): state_dict["state"].get(k)
             for k, (p, _) in by_saved.items()}
    for i, (p, gi) in enumerate(zip(opt._params, opt._group_of)):
        if gi is None:
            continue
        where = f"state of {opt._names[i]}"
        entries[i] = _entry(opt, p, gi, given.get(id(p)), where)
    opt._ctx.session.write_optimizer_state(entries)
    for g, sg in zip(groups, saved_groups):
        g.update({k: v for k, v in sg.items() if k != "params"})
