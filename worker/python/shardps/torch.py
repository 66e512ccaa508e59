"""shardps.torch: train a PyTorch model data-parallel through shardps.

Every worker runs the same script on its slice of each global batch; the
gradients go to the parameter servers during backward, the servers average
them, run the optimizer and send the new weights back::

    import shardps.torch as spt
    ctx = spt.init()
    model = Net()
    opt = spt.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4),
                                   named_parameters=model.named_parameters())
    sampler = spt.DistributedSampler(len(train_set), batch_size=256, seed=0)
    for epoch in range(sampler.start_epoch, epochs):
        for indices in sampler.epoch(epoch):
            loss = F.cross_entropy(model(x[indices]), y[indices])
            opt.zero_grad(); loss.backward(); opt.step()
    if ctx.is_lead:
        spt.save(model, "model.safetensors")

What runs where (docs/pytorch.md has the whole story):
  * The optimizer runs on the servers, with the torch optimizer's class and
    per-group hyper-parameters; every option is run exactly or refused
    (ValueError naming the group, option and value). Its state lives and
    is checkpointed there; opt.state_dict() reads it in torch's format and
    opt.load_state_dict() writes one back (_optim_state.py), so
    torch.save checkpoints work and resume bitwise. The learning rate,
    SGD's momentum and Adam's betas may change during training (any
    lr_scheduler, OneCycleLR and CyclicLR included): they travel with
    every step, and every worker of a step must use the same values; any
    other change of a group raises ValueError at the step.
  * Rank 0's initial weights are the model's; every worker starts from the
    servers' copy, frozen parameters too (a parameter left out of the
    optimizer may not require grad).
  * At exit the rank finishes (a normal end, sys.exit(0)) or leaves, so
    that the others stop waiting for it (an uncaught exception,
    KeyboardInterrupt, a failing sys.exit status).
  * A gradient is pushed as soon as backward has accumulated it, so
    communication overlaps the rest of backward; step() waits for the
    replies and copies the new weights into the parameters. The push
    copies p.grad into the layer's own buffer (the client's gradient
    region, which servers on this machine read through shared memory).
    A model on a CUDA device (one per process) stages each gradient to
    pinned host memory on a side stream and pushes it from a thread of
    its own (_device.py).
  * A gradient is used as it was when it was pushed: changing p.grad after
    backward cannot reach the servers, so step() takes the step as pushed
    and then raises shardps.GradientChanged naming the parameters.
  * Clipping by the global norm and loss scaling run on the servers, on
    the averaged gradient (the LLM recipe): max_grad_norm=, or
    opt.clip_grad_norm_ with clip_grad_norm_calls=True, and GradScaler
    (torch's interface); a step whose gradient is not finite is skipped on
    every shard (_two_phase.py).
  * Buffers (BatchNorm running statistics) follow rank 0's (the lead's):
    given the model, every step() ends with one broadcast of its buffers
    from the lead, as DDP's broadcast_buffers=True.
  * all_reduce, broadcast and barrier carry small tensors (at most 1 MiB)
    over the job's workers through the coordinator, in rank order.
  * Parameters are float32, bfloat16 or float16, contiguous, on the CPU or
    one CUDA device. The servers keep float32 weights and optimizer state:
    a bf16 model trains with fp32 master weights (_precision.py).
"""

import numpy as np
import torch

from . import _device, _optim_state, _two_phase
from . import _errors
from . import _precision
from ._collectives import all_reduce, barrier, broadcast
from ._context import Context, _context_or, init
from ._optim_spec import (_check_parameter, _server_optimizer, _settings,
                          _step_settings)
from ._sampler import DistributedSampler
from ._two_phase import GradScaler
from . import _model_state
from ._model_state import _buffers_to_broadcast, _changed_message
from ._save import load, save

__all__ = ["Context", "DistributedOptimizer", "DistributedSampler", "init",
           "save", "load", "all_reduce", "broadcast", "barrier", "GradScaler"]

# id(parameter) -> name, for every parameter a DistributedOptimizer trains.
_claimed = {}


class DistributedOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose update runs on the shardps servers.

    Args:
        optimizer: the torch optimizer to run: SGD (momentum, Nesterov,
            weight decay), Adam, AdamW or Adagrad, with any parameter groups.
            Every key of every group is either run by the servers
            (momentum, nesterov, betas, eps, weight_decay,
            initial_accumulator_value), accepted only at a value they run
            exactly (amsgrad, maximize, dampening, lr_decay, capturable,
            differentiable False or 0, foreach/fused None or False), or lr
            and the keys torch's lr schedulers add (initial_lr, max_lr,
            min_lr, max_momentum, base_momentum, swa_lr). Anything else (a
            key of the script's own, an option of a newer torch), betas or
            eps that are 0 in float32 (the servers take 0 for unset), or
            another optimizer class raises ValueError naming the group, the
            key and the value.
        named_parameters: the model's named_parameters(); every parameter
            of the optimizer must be among them (the names identify the
            tensors on the servers and in saved models). Default: the
            model's.
        model: the torch.nn.Module trained: its named_parameters() (when
            named_parameters is not given) and its named_buffers() (when
            named_buffers is not given).
        named_buffers: the buffers to keep equal on every rank (default:
            the model's; none without a model).
        broadcast_buffers: with buffers of which one is floating-point
            (BatchNorm's running statistics), every step() ends by
            overwriting every rank's buffers with the lead's (rank 0 unless
            it left), all of them in one broadcast through the coordinator,
            as DDP's broadcast_buffers=True; construction does it once too.
            The buffers are then equal on every rank whenever the script
            can look at them (evaluation, saving). At most 1 MiB of
            buffers.
        backward_passes_per_step: backward passes accumulated into .grad
            before each step() (gradient accumulation); the push happens at
            the last one.
        chunk_bytes: the largest piece of a tensor a server holds as one
            unit (a multiple of 4, at most 64 MiB; every rank the same).
            None: a power of two near 1/128 of the model's wire bytes,
            64 KiB (16 KiB on a slow link_rate) to 1 MiB; 8n in 8+ chunks.
        max_grad_norm: clip the global 2-norm of every step's averaged
            gradient to this, on the servers, exactly as
            torch.nn.utils.clip_grad_norm_ on the averaged gradient would
            (the norm is the same on any number of shards). None: no
            clipping at a constant bound.
        clip_grad_norm_calls: every step is a two-phase step, so that
            opt.clip_grad_norm_(max_norm) may clip it (FSDP-style, between
            backward and step(); a step that does not call it is not
            clipped). Every rank must make its optimizer alike.
        context: the Context (default: the one init() returned).

    Construction declares the model on the servers (rank 0's values are the
    initial weights) and loads the servers' copy into the parameters.

    Every parameter of named_parameters is declared: the ones in no
    param_group (frozen ones) hold rank 0's values on every rank and are
    never updated.

    The wrapper shares param_groups with `optimizer`, so lr schedulers
    built on either (or writes to lr, momentum or betas) take effect on the
    servers at the next step. Changing any other hyper-parameter after
    construction raises ValueError at the next step.

    Raises:
        ValueError: before anything is sent, an optimizer option the
            servers cannot run exactly (see `optimizer`), a parameter that
            is not float32, bfloat16 or float16, contiguous and on the CPU,
            empty, unnamed, trained by another DistributedOptimizer, or in
            no param_group but requiring grad, buffers to broadcast over 1
            MiB or in a static job of several workers (no coordinator). At
            a step (backward's first push or step(), before anything of it
            is sent): a hyper-parameter
            other than lr, momentum and betas changed, a momentum > 0 for
            an SGD group declared with momentum 0, momentum or betas
            outside [0, 1), or a parameter in no param_group was
            unfrozen (p.requires_grad_(True)). A max_grad_norm that is not
            finite and > 0, or given with clip_grad_norm_calls=True (one
            way to clip).
        shardps.Error: the servers refused the declaration (its .code
            says why).
    """

    # torch's GradScaler.step(opt) then calls opt.step(grad_scaler=scaler).
    _step_supports_amp_scaling = True

    def __init__(self, optimizer, named_parameters=None,
                 backward_passes_per_step=1, chunk_bytes=None,
                 context=None, model=None, named_buffers=None,
                 broadcast_buffers=True, max_grad_norm=None,
                 clip_grad_norm_calls=False):
        self._ctx = _context_or(context)
        self._max_grad_norm = _two_phase.check_max_grad_norm(max_grad_norm)
        if clip_grad_norm_calls and max_grad_norm is not None:
            raise ValueError(
                "max_grad_norm and clip_grad_norm_calls=True: choose one way "
                "to clip (a constant bound, or clip_grad_norm_ calls)")
        # Two-phase steps (_two_phase.py).
        self._clip_calls = bool(clip_grad_norm_calls)
        self._clip_called = False
        self._step_two_phase = False
        self._step_loss_scale = None
        self._last_norm = None
        self._last_skipped = False
        self._exact = None  # (step, the servers' float32 weights) for save
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("DistributedOptimizer wraps a torch.optim "
                            "optimizer")
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be at least 1")
        if named_parameters is None and model is not None:
            named_parameters = model.named_parameters()
        if named_parameters is None:
            raise ValueError("named_parameters is required: pass "
                             "model=model or model.named_parameters()")
        if named_buffers is None and model is not None:
            named_buffers = model.named_buffers()
        self._synced = _buffers_to_broadcast(
            self._ctx, named_buffers if broadcast_buffers else None)
        names, by_id = {}, {}
        for name, p in named_parameters:
            if id(p) in names:
                continue  # shared (tied) parameter: its first name
            if name in names.values():
                raise ValueError(f"two parameters are named {name}")
            names[id(p)] = name
            by_id[id(p)] = p
        self._inner = optimizer
        self._k = int(backward_passes_per_step)
        params, group_of, specs = [], [], []
        for gi, group in enumerate(optimizer.param_groups):
            specs.append(_server_optimizer(optimizer, gi, group))
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(
                        f"a parameter of param_groups[{gi}] (shape "
                        f"{list(p.shape)}) is not in named_parameters")
                name = names[id(p)]
                if id(p) in _claimed:
                    raise ValueError(
                        f"parameter {name} is already trained by another "
                        "DistributedOptimizer")
                _check_parameter(name, p)
                params.append(p)
                group_of.append(gi)
        if not params:
            raise ValueError("the optimizer has no parameters")
        # Frozen parameters are declared too, never updated: every rank
        # holds rank 0's values.
        trained = {id(p) for p in params}
        for key, name in names.items():
            if key in trained:
                continue
            p = by_id[key]
            if p.requires_grad:
                raise ValueError(
                    f"parameter {name} requires grad but is in no "
                    "param_group of the optimizer: shardps would hold it at "
                    "rank 0's initial value. Add it to the optimizer, or "
                    "freeze it (p.requires_grad_(False))")
            if key in _claimed:
                raise ValueError(
                    f"parameter {name} is already trained by another "
                    "DistributedOptimizer")
            _check_parameter(name, p)
            params.append(p)
            group_of.append(None)
        # One device per process; a CUDA model's gradients are staged to
        # host memory on a side stream and pushed from a thread (_device).
        self._device = _device.device_of(
            (names[id(p)], p) for p in params)
        # Layout order: named_parameters order, the same on every rank.
        position = {key: n for n, key in enumerate(names)}
        order = sorted(range(len(params)),
                       key=lambda i: position[id(params[i])])
        self._params = [params[i] for i in order]
        self._group_of = [group_of[i] for i in order]
        self._names = [names[id(p)] for p in self._params]
        self._shapes = [tuple(p.shape) for p in self._params]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        # Share the inner optimizer's groups (and so its lr values).
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._settings = [_settings(g) for g in self.param_groups]
        self._specs = specs
        self._stepped = [{} for _ in specs]  # by group, this step's

        # A tensor no group trains never gets a gradient: any valid spec.
        constant = dict(kind="sgd", lr=1.0)
        tensors = [dict(name=n, shape=list(s) or [1],
                        optimizer=constant if g is None else specs[g])
                   for n, s, g in zip(self._names, self._shapes,
                                      self._group_of)]
        self._weights = [np.empty(p.numel(), dtype=np.float32)
                         for p in self._params]
        initial = []
        if self._ctx.rank == 0:
            initial = [_precision.initial_values(p) for p in self._params]
        if self._ctx._optimizer is not None:
            raise ValueError("this job already has a DistributedOptimizer: "
                             "the servers hold one model per job")
        for p, name in zip(self._params, self._names):
            _claimed[id(p)] = name
        self._ctx._optimizer = self
        session = self._ctx.session
        _precision.choose_wire(self._ctx, self._params)
        try:
            session.declare(tensors, specs[0], chunk_bytes or 0, initial,
                            self._weights)
        except BaseException:
            for p in self._params:
                _claimed.pop(id(p), None)
            self._ctx._optimizer = None
            raise
        self._load_weights()
        self._broadcast_buffers()
        self._passes = [0] * len(self._params)
        self._pushed = [False] * len(self._params)
        # By tensor, what the step pushed: (p.grad, its _version, the
        # scale); None for no gradient or not yet pushed.
        self._sent = [None] * len(self._params)
        self._open = False
        self._stager = _device.staging_for(self._device, self._params)
        # By tensor, (array, tensor view) of the buffer its gradient is
        # copied into, and the session's buffer_regions they were taken at.
        self._buffers = None
        self._regions = None
        self._grad_accs = []
        for i, p in enumerate(self._params):
            if p.requires_grad and self._group_of[i] is not None:
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                acc.register_hook(self._hook(i))
                self._grad_accs.append(acc)

    def add_param_group(self, param_group):
        raise ValueError("the model is declared on the servers: parameter "
                         "groups cannot be added to a DistributedOptimizer")

    def __getstate__(self):
        raise TypeError("a DistributedOptimizer cannot be pickled")

    def __repr__(self):
        return (f"DistributedOptimizer({type(self._inner).__name__}, "
                f"{len(self._params)} tensors, rank {self._ctx.rank})")

    def _broadcast_buffers(self):
        _model_state.broadcast_buffers(self._ctx, self._synced)

    def _load_weights(self):
        # A bfloat16 or float16 parameter gets the float32 weights rounded
        # to nearest even (copy_ converts as .to(dtype) does).
        with torch.no_grad():
            for p, w in zip(self._params, self._weights):
                p.copy_(torch.from_numpy(w).view(p.shape))
        # Any later write to a parameter (model.load_state_dict, an in-place
        # op) bumps its version: _begin refuses to train on top of it.
        self._loaded = [p._version for p in self._params]

    def _hook(self, i):  # runs on the thread running backward
        def hook(*unused):
            self._passes[i] += 1
            if self._passes[i] > self._k:
                raise RuntimeError(
                    f"backward ran {self._passes[i]} times for parameter "
                    f"{self._names[i]} without step(): "
                    f"backward_passes_per_step={self._k}")
            if self._passes[i] == self._k:
                try:
                    self._push(i, self._params[i].grad)
                except BaseException:
                    self._reset_step()
                    raise
        return hook

    def _reset_step(self):
        # A refused step sends nothing more; the next backward starts over.
        session = self._ctx.session
        if self._stager is not None:
            self._stager.reset()
        if session.step_open:
            session.abort_step()
        self._passes = [0] * len(self._params)
        self._pushed = [False] * len(self._params)
        self._sent = [None] * len(self._params)
        self._open = False

    def _take_buffers(self):
        # The client's gradient region where a server is on this machine
        # (the shard reads the pushed copy there); otherwise buffers of our
        # own. A step that failed on a stream gives the client new regions.
        session = self._ctx.session
        if self._buffers is not None and (
                session.buffer_regions == self._regions):
            return
        self._regions = session.buffer_regions
        arrays = session.gradient_buffers() or [
            np.empty(p.numel(), dtype=np.float32) for p in self._params]
        self._buffers = [(a, torch.from_numpy(a).view(shape))
                         for a, shape in zip(arrays, self._shapes)]

    def _begin(self):
        _model_state.check_unchanged(self)
        self._stepped = _step_settings(self._inner, self.param_groups,
                                       self._settings, self._specs)
        for name, p, shape in zip(self._names, self._params, self._shapes):
            _check_parameter(name, p, shape, self._device)
        unfrozen = [name for name, p, g in zip(
            self._names, self._params, self._group_of)
            if g is None and p.requires_grad]
        if unfrozen:
            raise ValueError(
                f"parameter {', '.join(unfrozen)} requires grad since the "
                "model was declared but is in no param_group of the "
                "optimizer: shardps holds it at rank 0's initial value and "
                "would not train it. Put it in the optimizer before "
                "wrapping (a frozen parameter there trains once unfrozen)")
        second_phase, loss_scale = _two_phase.step_mode(self)
        self._ctx.session.begin_step(second_phase=second_phase,
                                     loss_scale=loss_scale,
                                     max_grad_norm=self._max_grad_norm)
        self._take_buffers()
        self._open = True

    def _push(self, i, grad):
        if not self._open:
            self._begin()
        group = self._group_of[i]
        lr = 0.0 if group is None else float(self.param_groups[group]["lr"])
        name = self._names[i]

        hyper = {} if group is None else self._stepped[group]

        def send(array):
            self._ctx.session.push(i, array, lr, name, **hyper)

        if grad is None or group is None:
            array = None
        else:
            if grad.is_sparse:
                raise ValueError(f"parameter {name} has a sparse gradient: "
                                 "shardps takes dense gradients")
            if tuple(grad.shape) != self._shapes[i]:
                raise ValueError(
                    f"the gradient of {name} has shape {list(grad.shape)}, "
                    f"the parameter {list(self._shapes[i])}")
            g = grad.detach()
            _precision.check_gradient(name, g, self._device)
            scale = self._ctx.grad_scale
            if self._stager is not None:  # _device.py pushes it
                self._sent[i] = (grad, grad._version, scale,
                                 self._stager.stage(i, g, scale,
                                                    self._buffers[i], send))
                self._pushed[i] = True
                return
            # The client reads the gradient until the step ends: it gets
            # our float32 copy, never memory the script can still change.
            array, copy = self._buffers[i]
            _precision.copy_gradient(g, copy, scale)
            self._sent[i] = (grad, grad._version, scale, None)
        self._pushed[i] = True
        if self._stager is not None:
            self._stager.push(send)
        else:
            send(array)

    def step(self, closure=None, grad_scaler=None):
        """Waits for the servers' update of this step and writes the new
        weights into the parameters. Parameters without a gradient
        (p.grad is None) are skipped by the servers, as torch skips them.

        Returns the closure's loss (if a closure was given).
        `grad_scaler` is what torch's GradScaler.step(opt) passes when
        enabled (this class sets _step_supports_amp_scaling, so that
        torch does not unscale p.grad or skip the step itself).

        Raises:
            shardps.GradientChanged: p.grad of a parameter changed after
                backward pushed it (clip_grad_norm_, clip_grad_value_, an
                in-place op, another tensor). The step was taken with the
                gradients as pushed (the job stays consistent; the weights
                are loaded) and the change was not applied.
            RuntimeError: step() without backward, or before the last of
                backward_passes_per_step.
            ValueError: an enabled loss scaler of torch's (see
                _precision.refuse_loss_scaler); the step is cancelled.
        """
        try:
            _precision.refuse_loss_scaler(grad_scaler)
        except ValueError:
            self._reset_step()
            raise
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        done_passes = max(self._passes)
        if done_passes == 0:
            raise RuntimeError(
                "step() without backward(): no gradient was computed since "
                "the last step (nothing was sent)")
        if done_passes < self._k:
            raise RuntimeError(
                f"step() after {done_passes} of {self._k} backward passes "
                "(backward_passes_per_step)")
        step = self._ctx.session.step
        try:
            self._push_rest()
            # Checked while the replies are on their way.
            changed = _model_state.changed_gradients(self)
            self._ctx.session.finish_step()
        finally:
            self._reset_step()
        # lr schedulers built on the wrapped optimizer count its steps.
        if hasattr(self._inner, "_step_count"):
            self._inner._step_count += 1
        # The job's weights after the step (or at the step the job went
        # back to after a rollback: the sampler follows session.step).
        self._load_weights()
        # After the update rather than before the next forward (DDP): the
        # ranks meet here anyway, and the buffers are equal whenever the
        # script can look at them. Train-mode forwards use batch
        # statistics, so the training is the same either way.
        self._broadcast_buffers()
        if changed:
            raise _errors.GradientChanged(_changed_message(changed))
        _two_phase.after_step(self, step)
        return loss

    def _push_rest(self):
        for i, p in enumerate(self._params):
            if not self._pushed[i]:
                self._push(i, p.grad)
        if self._stager is not None:
            self._stager.drain()

    def clip_grad_norm_(self, max_norm, norm_type=2.0,
                        error_if_nonfinite=False):
        """Clips this step's averaged gradient by its global 2-norm, as
        torch.nn.utils.clip_grad_norm_ (FSDP's clip_grad_norm_): call it
        between the last backward() and step(). The servers clip when
        step() sends the decision; p.grad is left as it is.

        Returns the global norm of the averaged (and, with a GradScaler,
        unscaled) gradient over every parameter, the same on every rank,
        as a float32 tensor (NaN when the job went back meanwhile: step()
        then loads the rollback's weights).

        Raises:
            ValueError: max_norm not finite and > 0, or a norm_type other
                than 2.
            RuntimeError: a DistributedOptimizer made without
                clip_grad_norm_calls=True, before the last backward pass,
                twice in a step, or a non-finite norm with
                error_if_nonfinite.
            shardps.Error: the servers' refusals.
        """
        return _two_phase.clip_grad_norm_(self, max_norm, norm_type,
                                          error_if_nonfinite)

    @property
    def grad_norm(self):
        """The global norm of the last two-phase step's averaged gradient
        (None before one)."""
        return self._last_norm

    @property
    def last_step_skipped(self):
        """Every shard skipped the last step (a non-finite gradient under
        loss scaling)."""
        return self._last_skipped

    def zero_grad(self, set_to_none=False):
        """As torch.optim.Optimizer.zero_grad (default set_to_none=False, as
        torch 1.13)."""
        for p in self._params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    def state_dict(self):
        """The optimizer's state as torch's state_dict() gives it, read from
        the servers: per parameter (by index) "step", "exp_avg",
        "exp_avg_sq" (Adam, AdamW), "momentum_buffer" (SGD) or "sum"
        (Adagrad), float32 on the CPU, and "param_groups". torch.save it
        with the model; a plain torch optimizer loads it too.

        Raises:
            RuntimeError: between backward() and step().
            shardps.Error: a server that cannot answer.
        """
        return _optim_state.state_dict(self)

    def load_state_dict(self, state_dict):
        """Installs an optimizer state_dict (this class's or a plain torch
        optimizer's of the same parameter groups) on the servers: the next
        step continues from it. Call it on every rank, between steps (it
        is written by every rank that calls it). Only lr, momentum, betas
        and scheduler keys may differ from the servers' groups (loaded).

        Raises:
            ValueError: another number of groups or parameters, settings
                that differ, unknown keys, wrong shapes, non-finite or
                negative second moments (nothing was written).
            RuntimeError: between backward() and step().
            shardps.Error: the servers' refusals.
        """
        _optim_state.load_state_dict(self, state_dict)
