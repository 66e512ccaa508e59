"""A one-worker shardps.torch job that changes p.grad between backward and
step() in the ways training scripts do, for test_torch_grad_changes.py.

Each case trains one step: the change must raise shardps.GradientChanged
naming the changed parameters, after the step was taken with the gradients
as backward produced them (plain SGD, so the expected float32 weights are
w - lr * g, and the parameters their rounding). Steps without a change,
after zero_grad() and a new backward, must go through, and parameters
without a gradient are never named. Then torch's loss-scaler hook:
step(grad_scaler=...) runs a disabled scaler's step and refuses an
enabled one. Prints one line per case and exits non-zero at the first that
fails. With --dtype=bf16 the model is bfloat16 (float32 on the servers).
"""

import sys

import torch
import torch.nn as nn

import shardps
import shardps.torch as spt
from shardps._save import float32_weights

LR = 0.1
DTYPE = torch.bfloat16 if "--dtype=bf16" in sys.argv[1:] else torch.float32


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.frozen = nn.Parameter(torch.ones(5), requires_grad=False)
        self.unused = nn.Parameter(torch.ones(3))  # in no forward

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def clip_norm(model):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)


def clip_value(model):
    # torch 1.13 clamps p.grad.data: no version counter sees it.
    torch.nn.utils.clip_grad_value_(model.parameters(), 1e-5)


def mul(model):
    model.fc2.bias.grad.mul_(0.5)


def unscale(model):
    # What a loss scaler's unscale_ does after a scaled backward (torch
    # 1.13's GradScaler runs on CUDA only, so it is written out here).
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(1024.0)


def replace(model):
    model.fc1.weight.grad = model.fc1.weight.grad.clone()


ALL = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
# name -> (change, the names it must report, loss scale of the backward)
CASES = {
    "clip_grad_norm_": (clip_norm, ALL, 1.0),
    "clip_grad_value_": (clip_value, ALL, 1.0),
    "p.grad.mul_": (mul, ["fc2.bias"], 1.0),
    "unscale_": (unscale, ALL, 1024.0),
    "p.grad = clone": (replace, ["fc1.weight"], 1.0),
}


class StandInScaler:
    """Stands in for torch.cuda.amp.GradScaler, whose enabled form cannot be
    made without CUDA (it disables itself): its step(opt) calls
    opt.step(grad_scaler=self) when the optimizer sets
    _step_supports_amp_scaling, and the optimizer asks is_enabled()."""

    def __init__(self, enabled):
        self.enabled = enabled

    def is_enabled(self):
        return self.enabled


def fail(message):
    print(f"FAILED: {message}", flush=True)
    sys.exit(1)


def main():
    torch.manual_seed(7)
    ctx = spt.init()
    model = Net().to(DTYPE)
    opt = spt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters())
    print(f"staged {opt._stager is not None}", flush=True)
    print(f"gradient buffers in shared memory: "
          f"{len(ctx.session.gradient_buffers())}", flush=True)
    x = torch.randn(32, 8).to(DTYPE)
    y = torch.randint(0, 4, (32,))

    def weights():
        # The job's float32 weights, as copies. Only between steps: the
        # replies of a step write them while it is open.
        return {n: torch.from_numpy(float32_weights(opt, p).copy())
                .view(p.shape) for n, p in model.named_parameters()}

    def step(name, change=None, scale=1.0, set_to_none=False, scaler=None):
        opt.zero_grad(set_to_none=set_to_none)
        w = weights()
        loss = nn.functional.cross_entropy(model(x), y) * scale
        loss.backward()
        expected = {n: w[n] - LR * p.grad.float()
                    for n, p in model.named_parameters() if p.grad is not None}
        before = ctx.step
        error = None
        if change is not None:
            change(model)
        try:
            opt.step(grad_scaler=scaler)
        except shardps.GradientChanged as e:
            error = e
        if ctx.step != before + 1:
            fail(f"{name}: the step did not complete ({before} -> "
                 f"{ctx.step})")
        now = weights()
        for n, p in model.named_parameters():
            want, got = expected.get(n, w[n]), now[n]
            if not torch.allclose(got, want, rtol=1e-6, atol=1e-6):
                fail(f"{name}: {n} is not the step of the gradient as "
                     "backward produced it")
            if not torch.equal(p.detach(), got.to(p.dtype)):
                fail(f"{name}: {n} is not the job's weights rounded")
        return error

    for name, (change, names, scale) in CASES.items():
        error = step(name, change, scale)
        if error is None:
            fail(f"{name}: no error")
        message = str(error)
        print(f"{name}: {message}", flush=True)
        if not isinstance(error, RuntimeError):
            fail(f"{name}: {type(error).__name__} is not a RuntimeError")
        reported = message.split("p.grad of ")[1].split(" changed")[0]
        if reported.split(", ") != names:
            fail(f"{name}: names {reported}, not {', '.join(names)}")
        if "was not applied" not in message:
            fail(f"{name}: the message does not say the change was lost")
        # zero_grad() and a new backward: not a change.
        for set_to_none in (False, True):
            if step(f"{name} then a clean step", set_to_none=set_to_none):
                fail(f"{name}: a clean step after it raised")
        print(f"{name}: raised, then clean steps went through", flush=True)
    # What the message advises: a hook on the parameter clips before the
    # push, and the step applies the clipped gradient.
    hook = model.fc2.bias.register_hook(lambda g: g.clamp(-1e-5, 1e-5))
    if step("clipped in a hook"):
        fail("clipping in a hook raised")
    if model.fc2.bias.grad.abs().max() > 1e-5:
        fail("the hook did not clip")
    hook.remove()
    print("clipped in a hook: went through", flush=True)
    # torch's GradScaler.step(opt): a disabled one's step is a plain step;
    # an enabled one is refused (the gradients went to the servers
    # scaled), and the step is cancelled: the last thing this job does.
    if step("a disabled loss scaler", scaler=StandInScaler(False)):
        fail("a disabled loss scaler raised")
    print("a disabled loss scaler: went through", flush=True)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    try:
        opt.step(grad_scaler=StandInScaler(True))
        fail("an enabled loss scaler: no error")
    except ValueError as e:
        print(f"an enabled loss scaler: {e}", flush=True)
        if "shardps.torch.GradScaler" not in str(e):
            fail("the message does not name shardps.torch.GradScaler")
    if ctx.session.step_open:
        fail("an enabled loss scaler: the step is still open")
    print("an enabled loss scaler: refused", flush=True)
    print(f"final: step={ctx.step}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
