"""Two-phase steps for shardps.torch: global-norm clipping and loss scaling.

The servers hold the averaged gradient, so they clip it: in a two-phase
step each shard answers every chunk with the sum of the squares of its
averaged (and unscaled) gradient, every worker adds them in chunk order into
the global norm, and every worker sends every chunk the same decision (the
clip coefficient, or skip the step when the norm is not finite). The
weights come after that. A step costs one more round trip of small
messages than a one-phase step; a one-phase step costs what it always did.

A DistributedOptimizer takes two-phase steps when it clips at a constant
bound (max_grad_norm), when it was made for FSDP-style opt.clip_grad_norm_
calls (clip_grad_norm_calls=True), and when a GradScaler scales the loss:
every rank of a step must agree on it before backward pushes anything, so it
is the job's setting, never a guess from the steps before (a worker that
joins or restarts mid-job must take the same steps as the others).
"""

import math

import numpy as np
import torch

from . import _context


def check_max_grad_norm(value, what="max_grad_norm"):
    """`value` as a float, or None.

    Raises:
        ValueError: not a finite number > 0 (float32).
    """
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}={value!r} is not a number") from None
    if not (math.isfinite(v) and v > 0 and math.isfinite(np.float32(v))
            and np.float32(v) > 0):
        raise ValueError(f"{what}={value!r} must be finite and > 0")
    return v


def step_mode(opt):
    """(second_phase, loss_scale) of the step `opt` opens now."""
    scaler = opt._ctx.scaler
    loss_scale = None
    if scaler is not None and scaler.is_enabled():
        loss_scale = scaler.get_scale()
    second_phase = (opt._max_grad_norm is not None or loss_scale is not None
                    or opt._clip_calls)
    opt._step_two_phase = second_phase
    opt._step_loss_scale = loss_scale
    opt._clip_called = False
    return second_phase, loss_scale


def clip_grad_norm_(opt, max_norm, norm_type=2.0, error_if_nonfinite=False):
    """DistributedOptimizer.clip_grad_norm_ (see its docstring)."""
    max_norm = check_max_grad_norm(max_norm, "max_norm")
    if float(norm_type) != 2.0:
        raise ValueError(f"norm_type={norm_type!r}: the servers clip by the "
                         "2-norm only")
    if not opt._clip_calls:
        raise RuntimeError(
            "clip_grad_norm_ on a DistributedOptimizer made without "
            "clip_grad_norm_calls=True: a step the servers may clip is a "
            "two-phase step, which every rank must know before backward "
            "pushes anything. Make it with clip_grad_norm_calls=True (or "
            "max_grad_norm=... to clip every step at one bound)")
    done = max(opt._passes)
    if done < opt._k:
        raise RuntimeError(
            f"clip_grad_norm_ after {done} of {opt._k} backward passes: call "
            "it between the last backward() and step()")
    if opt._clip_called:
        raise RuntimeError("clip_grad_norm_ was already called this step")
    opt._push_rest()
    session = opt._ctx.session
    norm = session.grad_norm()
    opt._clip_called = True
    if norm is None:
        # The job went back (a rollback): step() then loads its weights.
        return torch.tensor(float("nan"), device=opt._device)
    session.set_max_grad_norm(max_norm)
    if error_if_nonfinite and not math.isfinite(norm):
        raise RuntimeError(
            f"the total norm of the gradients is {norm}, so the gradients "
            "cannot be clipped (error_if_nonfinite=True); step() skips this "
            "step on every shard")
    return torch.tensor(norm, dtype=torch.float32, device=opt._device)


def after_step(opt, step):
    """Records a finished step's norm and skip; the step's number `step`
    names it in errors.

    Raises:
        FloatingPointError: a two-phase step without loss scaling whose
            norm was not finite (the float32 sum of the workers' gradients
            overflowed): every shard skipped it.
    """
    if not opt._step_two_phase:
        opt._last_skipped = False
        return
    session = opt._ctx.session
    opt._last_norm = session.last_grad_norm
    opt._last_skipped = session.last_step_skipped
    if opt._last_skipped and opt._step_loss_scale is None:
        raise FloatingPointError(
            f"step {step}: the norm of the averaged gradient is not finite "
            "(the sum of the workers' float32 gradients overflowed); every "
            "shard skipped the step")


class GradScaler:
    """Loss scaling for fp16 training, with torch.cuda.amp.GradScaler's
    interface and defaults, on CPU and CUDA. The servers unscale the
    averaged gradient and, when its norm is not finite, every shard skips
    the whole step (weights, optimizer state and Adam's step count
    unchanged), as torch skips optimizer.step(); every worker learns it,
    so update() backs off on every rank alike. When the job rolls back to
    a checkpoint, the scaler goes back to the scale it had at that step.

    Use it as torch's:
        scaler.scale(loss).backward()
        scaler.unscale_(opt)           # optional; then opt.clip_grad_norm_
        scaler.step(opt)
        scaler.update()

    p.grad stays scaled (the servers unscale); unscale_ only marks the step,
    so that code written for torch runs unchanged. One GradScaler per job.

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval: as
            torch's (2**16, 2.0, 0.5, 2000).
        enabled: False makes every method a pass-through, as torch's.

    Raises:
        ValueError: a growth_factor <= 1, a backoff_factor outside (0, 1),
            a growth_interval < 1, or an init_scale that is not finite and
            > 0.
    """

    def __init__(self, init_scale=2.0**16, growth_factor=2.0,
                 backoff_factor=0.5, growth_interval=2000, enabled=True):
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale={init_scale!r} must be finite "
                             "and > 0")
        if not growth_factor > 1.0:
            raise ValueError("growth_factor should be > 1")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError("backoff_factor should be in (0, 1)")
        if int(growth_interval) < 1:
            raise ValueError("growth_interval should be >= 1")
        self._enabled = bool(enabled)
        self._scale = np.float32(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._growth_tracker = 0
        self._found_inf = None  # of the last step(), until update()
        self._unscaled = False
        # By step: (scale, growth tracker) at that step's start, so that
        # after the job rolls back the scaler goes back with it.
        self._history = {}

    def is_enabled(self):
        return self._enabled

    def get_scale(self):
        """The current scale (1.0 when disabled)."""
        return float(self._scale) if self._enabled else 1.0

    def get_growth_factor(self):
        return self._growth_factor

    def get_backoff_factor(self):
        return self._backoff_factor

    def get_growth_interval(self):
        return self._growth_interval

    def scale(self, outputs):
        """Multiplies a tensor (or an iterable of tensors) by the scale.

        Raises:
            RuntimeError: before shardps.torch.init().
        """
        if not self._enabled:
            return outputs
        ctx = _context.current()
        if ctx is None:
            raise RuntimeError("GradScaler.scale before shardps.torch.init()")
        if ctx.scaler is not None and ctx.scaler is not self:
            raise RuntimeError("a job takes one GradScaler")
        ctx.scaler = self
        state = self._history.get(ctx.step)
        if state is None:
            self._history[ctx.step] = (self._scale, self._growth_tracker)
        else:
            # The job came back to this step (a rollback): the scale it had.
            self._scale, self._growth_tracker = state
        scale = float(self._scale)
        if isinstance(outputs, torch.Tensor):
            return outputs * scale
        return type(outputs)(self.scale(o) for o in outputs)

    def unscale_(self, optimizer):
        """Marks the step unscaled (the servers unscale), so that
        optimizer.clip_grad_norm_ may follow as in torch's recipe.

        Raises:
            RuntimeError: called twice before update().
        """
        if not self._enabled:
            return
        if self._unscaled:
            raise RuntimeError("unscale_() has already been called on this "
                               "optimizer since the last update().")
        self._unscaled = True

    def step(self, optimizer, *args, **kwargs):
        """optimizer.step(); returns its value, or None when every shard
        skipped the step (a non-finite gradient).

        Raises:
            TypeError: an optimizer that is not a DistributedOptimizer.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if not hasattr(optimizer, "_step_two_phase"):
            raise TypeError("GradScaler.step takes a "
                            "shardps.torch.DistributedOptimizer")
        ret = optimizer.step(*args, **kwargs)
        self._found_inf = bool(optimizer.last_step_skipped)
        return None if self._found_inf else ret

    def update(self, new_scale=None):
        """Backs the scale off after a skipped step, grows it after
        growth_interval steps in a row that were not (torch's rule), or
        sets `new_scale`."""
        if not self._enabled:
            return
        self._unscaled = False
        if new_scale is not None:
            value = float(new_scale.item() if isinstance(
                new_scale, torch.Tensor) else new_scale)
            self._scale = np.float32(value)
            return
        if self._found_inf is None:
            return
        ctx = _context.current()
        if self._found_inf:
            self._scale = np.float32(self._scale * np.float32(
                self._backoff_factor))
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self._growth_interval:
                grown = np.float32(self._scale * np.float32(
                    self._growth_factor))
                if math.isfinite(grown):
                    self._scale = grown
                self._growth_tracker = 0
        self._found_inf = None
        if ctx is not None:
            self._history[ctx.step] = (self._scale, self._growth_tracker)
            for old in [k for k in self._history if k < ctx.step - 100000]:
                del self._history[old]

    def state_dict(self):
        """As torch's: scale, growth_factor, backoff_factor,
        growth_interval, _growth_tracker (empty when disabled)."""
        if not self._enabled:
            return {}
        return {"scale": float(self._scale),
                "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict):
        """Loads what state_dict() (or torch's GradScaler) returned.

        Raises:
            RuntimeError: an empty state dict into an enabled scaler.
        """
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly "
                               "because it was saved from a disabled "
                               "instance of GradScaler.")
        self._scale = np.float32(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])
