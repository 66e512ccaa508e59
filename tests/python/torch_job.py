"""A small shardps.torch training job for the Python tests: a tiny CNN, GPT
or mixed-precision MLP on deterministic synthetic data, run as every worker
of a job (or, with --plain, as one ordinary torch process that averages the
two ranks' half batches as the servers do). Writes the final parameters as
safetensors.

  python3 torch_job.py --model=cnn --optimizer=sgd --steps=20 --out=w.safetensors

A model that is not all float32 (--dtype=bf16, --model=mixed) trains in
--plain as the servers train it: a float32 master copy of the parameters
takes the torch optimizer's steps from the model's gradients made float32
(the two halves averaged in float32), and the model gets the master
rounded (p.copy_(master)). Then --out holds the master weights (spt.save
writes them under shardps) and --values_out the model's own values.
"""

import argparse
import copy
import os
import sys
import time

import torch
import torch.nn.functional as F

import tiny_models

NUM_SAMPLES = 256


def make_optimizer(model, name, lr, momentum=0.9):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                               nesterov=momentum > 0, weight_decay=1e-4)
    if name == "adamw":
        # A GPT recipe's groups: no weight decay on biases and norms.
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1},
             {"params": no_decay, "weight_decay": 0.0, "lr": lr * 0.5}],
            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    raise ValueError(name)


CLOSED_FORM = ("warmup", "onecycle", "cyclic")


def make_scheduler(name, opt, args):
    s = torch.optim.lr_scheduler
    if name == "warmup":
        return s.LambdaLR(opt, lambda step: min(1.0, step / 4))
    if name == "onecycle":  # momentum or betas[0] from 0.95 to 0.85 and back
        return s.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps)
    if name == "cyclic":  # momentum between 0.8 and 0.9
        return s.CyclicLR(opt, base_lr=args.lr / 10, max_lr=args.lr,
                          step_size_up=4)
    if name == "plateau":
        return s.ReduceLROnPlateau(opt, factor=0.5, patience=1)
    if name == "cosine":
        return s.CosineAnnealingLR(opt, T_max=args.steps)
    if name == "step":
        return s.StepLR(opt, step_size=5, gamma=0.5)
    return None


def print_schedule(step, optimizer):
    group = optimizer.param_groups[0]
    momentum = group.get("momentum", group.get("betas", (None,))[0])
    print(f"sched step {step} lr {group['lr']!r} momentum {momentum!r}",
          flush=True)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16,
          "fp16": torch.float16}


def loss_of(model, kind, x, y, autocast=False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return _loss(model, kind, x, y)


def _loss(model, kind, x, y):
    out = model(x)
    if kind == "gpt":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.cross_entropy(out, y)


def save_values(model, path):
    """The model's parameters as they are, made float32 (exact)."""
    import shardps
    names, tensors = zip(*[(n, p.detach().float().contiguous())
                           for n, p in model.named_parameters()])
    shardps.write_safetensors(path, list(names),
                              [list(t.shape) for t in tensors],
                              [t.numpy().reshape(-1) for t in tensors],
                              {"format": "pt"})


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=["cnn", "gpt", "mixed"],
                        default="cnn")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--warmup", action="store_true",
                        help="a LambdaLR warmup from lr 0 (--sched=warmup)")
    parser.add_argument("--sched", default="", choices=[
        "", "warmup", "onecycle", "cyclic", "plateau", "cosine", "step"])
    parser.add_argument("--sched_first", action="store_true",
                        help="construct the scheduler on the torch optimizer "
                        "before wrapping it")
    parser.add_argument("--momentum", type=float, default=0.9,
                        help="SGD's momentum (Nesterov when > 0)")
    parser.add_argument("--skew_momentum", type=float, default=-1,
                        help="rank 1 sets this momentum at step 0 (the "
                        "servers refuse the disagreement)")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="the model's parameters (and the CNN's input)")
    parser.add_argument("--autocast", action="store_true",
                        help="forward and loss under torch.autocast bf16")
    parser.add_argument("--torch_scaler", action="store_true",
                        help="backward and step through torch's GradScaler "
                        "(enabled=False: there is no CUDA here)")
    parser.add_argument("--out", default="")
    parser.add_argument("--max_grad_norm", type=float, default=0.0,
                        help="clip the averaged gradient's global norm")
    parser.add_argument("--clip", choices=["constant", "call"],
                        default="constant",
                        help="max_grad_norm= of DistributedOptimizer, or "
                        "opt.clip_grad_norm_ at every step")
    parser.add_argument("--loss_scale", type=float, default=0.0,
                        help="a GradScaler with this initial scale")
    parser.add_argument("--inf_at", type=int, default=-1,
                        help="with --loss_scale: rank 1's loss is inf at "
                        "this step (the reference skips it)")
    parser.add_argument("--values_out", default="",
                        help="the model's parameter values, as float32")
    parser.add_argument("--step_delay", type=float, default=0.0)
    parser.add_argument("--plain", choices=["", "halves", "whole"],
                        default="",
                        help="one torch process: average of the two ranks' "
                        "half-batch gradients, or the whole batch")
    parser.add_argument("--device", default="cpu",
                        help="where the shardps run's model and data live "
                        "(cuda: tests/gpu; --plain always runs on the CPU)")
    args = parser.parse_args()
    if args.warmup:
        args.sched = "warmup"
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    model = tiny_models.make(args.model)
    x, y = tiny_models.data(args.model, NUM_SAMPLES)
    if args.dtype != "fp32":
        model.to(DTYPES[args.dtype])
        if args.model == "cnn":
            x = x.to(DTYPES[args.dtype])
    ac = args.autocast

    if args.plain:
        import shardps
        master = model
        if any(p.dtype != torch.float32 for p in model.parameters()):
            master = copy.deepcopy(model).float()
        inner = make_optimizer(master, args.optimizer, args.lr,
                               args.momentum)
        sched = make_scheduler(args.sched, inner, args)
        spe = NUM_SAMPLES // args.batch
        for step in range(args.steps):
            epoch, s = divmod(step, spe)
            perm = torch.from_numpy(
                shardps.epoch_permutation(NUM_SAMPLES, 0, epoch + 1))
            batch = perm[s * args.batch:(s + 1) * args.batch]
            if args.plain == "whole":
                model.zero_grad()
                loss_of(model, args.model, x[batch], y[batch], ac).backward()
                for m, p in zip(master.parameters(), model.parameters()):
                    m.grad = None if p.grad is None else p.grad.float()
            else:
                grads, losses = [], []
                for r in range(2):
                    b, e = shardps.worker_slice(s * args.batch, args.batch,
                                                r, 2)
                    model.zero_grad()
                    loss = loss_of(model, args.model, x[perm[b:e]],
                                   y[perm[b:e]], ac)
                    loss.backward()
                    losses.append(loss.detach().float().reshape(1))
                    grads.append([None if p.grad is None else p.grad.clone()
                                  for p in model.parameters()])
                for m, g0, g1 in zip(master.parameters(), *grads):
                    m.grad = None if g0 is None else (
                        g0.float() + g1.float()) / 2
            if step == args.inf_at:
                print(f"step {step + 1} skipped True", flush=True)
                if sched:
                    sched.step()
                continue
            if args.max_grad_norm:
                norm = torch.nn.utils.clip_grad_norm_(master.parameters(),
                                                      args.max_grad_norm)
                print(f"step {step + 1} norm {norm.item():.9g}", flush=True)
            inner.step()
            if master is not model:
                with torch.no_grad():
                    for p, m in zip(model.parameters(), master.parameters()):
                        p.copy_(m)
            if args.sched == "plateau":
                # What all_reduce(op="mean") computes: (r0 + r1) / 2.
                sched.step((losses[0] + losses[1]) / 2)
            elif sched:
                sched.step()
            print_schedule(step + 1, inner)
        if args.out:
            from shardps.torch import save
            save(master, args.out)
        if args.values_out:
            save_values(model, args.values_out)
        return

    if args.device != "cpu":
        model.to(args.device)
        x, y = x.to(args.device), y.to(args.device)
    import shardps.torch as spt
    ctx = spt.init()
    inner = make_optimizer(model, args.optimizer, args.lr, args.momentum)
    sched = make_scheduler(args.sched, inner, args) if args.sched_first \
        else None
    constant = args.max_grad_norm and args.clip == "constant"
    opt = spt.DistributedOptimizer(
        inner, named_parameters=model.named_parameters(),
        backward_passes_per_step=args.accumulate,
        max_grad_norm=args.max_grad_norm if constant else None,
        clip_grad_norm_calls=bool(args.max_grad_norm and not constant))
    if not args.sched_first:
        sched = make_scheduler(args.sched, opt, args)
    sampler = spt.DistributedSampler(NUM_SAMPLES, args.batch, seed=0)
    epoch = sampler.start_epoch  # a process new to the job joins here
    # shardps's GradScaler (the servers unscale and skip), or torch's,
    # disabled (no CUDA here): it calls opt.step() as plain torch would.
    scaler = None
    if args.loss_scale:
        scaler = spt.GradScaler(init_scale=args.loss_scale)
    elif args.torch_scaler:
        scaler = torch.cuda.amp.GradScaler(enabled=False)
    # The device path's staging thread (SHARDPS_TORCH_STAGING=1 on CPU).
    print(f"staged {opt._stager is not None}", flush=True)
    print(f"rank {ctx.rank} of {ctx.num_workers} starts at step {ctx.step}; "
          f"wire {' '.join(ctx.session.wire)}", flush=True)
    while ctx.step < args.steps:
        for indices in sampler.epoch(epoch):
            opt.zero_grad()
            if args.skew_momentum >= 0 and ctx.step == 0 and ctx.rank == 1:
                opt.param_groups[0]["momentum"] = args.skew_momentum
            for part in indices.chunk(args.accumulate):
                loss = loss_of(model, args.model, x[part], y[part], ac)
                weighted = loss * len(part) / len(indices)
                if scaler:
                    weighted = scaler.scale(weighted)
                    if ctx.step == args.inf_at and ctx.rank == 1:
                        weighted = weighted * float("inf")
                weighted.backward()
            if args.max_grad_norm and not constant:
                if scaler:
                    scaler.unscale_(opt)
                norm = opt.clip_grad_norm_(args.max_grad_norm)
                print(f"called step {ctx.step + 1} norm {norm.item():.9g}",
                      flush=True)
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            if opt.grad_norm is not None:
                print(f"step {ctx.step} norm {opt.grad_norm:.9g} skipped "
                      f"{opt.last_step_skipped}", flush=True)
            if args.sched == "plateau":
                metric = loss.detach().float().reshape(1)
                spt.all_reduce(metric, op="mean")
                sched.step(metric)
            elif args.sched in CLOSED_FORM:
                sched.last_epoch = ctx.step - 1
                sched.step()
            elif sched:
                sched.step()
            print_schedule(ctx.step, opt)
            print(f"step {ctx.step} loss {loss.item():.6f}", flush=True)
            if args.step_delay:
                time.sleep(args.step_delay)
            if ctx.step >= args.steps:
                break
        epoch += 1
    if ctx.is_lead and args.out:
        spt.save(model, args.out)
    if ctx.is_lead and args.values_out:
        save_values(model, args.values_out)
    print(f"final: step={ctx.step}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
