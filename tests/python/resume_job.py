"""A job that saves itself the torch way and resumes from the file: the
model's, the optimizer's, the scheduler's and the sampler's state_dict in
one torch.save file at step --save_at (then it stops), and a job started
with --resume=FILE (new servers, no checkpoint directory) goes on from it
to --steps. With --plain it is one torch process that averages the two
ranks' half batches as the servers do; its files and shardps's load into
each other.

  python3 resume_job.py --model=gpt --optimizer=adamw --steps=16 --save_at=6 \\
      --save=at6.pt --out=w.safetensors
"""

import argparse
import sys

import torch

import tiny_models
from torch_job import NUM_SAMPLES, loss_of, make_optimizer


def scheduler(opt, steps):
    # Chainable: its lr at step s depends on the lr at s - 1, so it resumes
    # only from its state_dict.
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps,
                                                      eta_min=1e-4)


def plain(args, model, x, y):
    import shardps
    from shardps.torch import save
    opt = make_optimizer(model, args.optimizer, args.lr)
    sched = scheduler(opt, args.steps)
    step = 0
    if args.resume:
        saved = torch.load(args.resume)
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        step = saved["sampler"]["step"]
    spe = NUM_SAMPLES // args.batch
    while step < args.steps:
        epoch, s = divmod(step, spe)
        perm = torch.from_numpy(
            shardps.epoch_permutation(NUM_SAMPLES, 0, epoch + 1))
        grads = []
        for r in range(2):
            b, e = shardps.worker_slice(s * args.batch, args.batch, r, 2)
            model.zero_grad()
            loss_of(model, args.model, x[perm[b:e]], y[perm[b:e]]).backward()
            grads.append([None if p.grad is None else p.grad.clone()
                          for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = None if g0 is None else (g0 + g1) / 2
        opt.step()
        sched.step()
        step += 1
        if step == args.save_at:
            torch.save({"model": model.state_dict(),
                        "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(),
                        "sampler": {"step": step, "num_samples": NUM_SAMPLES,
                                    "batch_size": args.batch, "seed": 0}},
                       args.save)
            return
    save(model, args.out)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=["cnn", "gpt"], default="gpt")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"],
                        default="adamw")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--save_at", type=int, default=-1,
                        help="write --save after this many steps and stop")
    parser.add_argument("--save", default="")
    parser.add_argument("--resume", default="",
                        help="a --save file to go on from")
    parser.add_argument("--out", default="",
                        help="the final weights (safetensors)")
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--bad_loads", action="store_true",
                        help="after --steps, load bad state_dicts: each "
                        "must be refused with the servers' state unchanged")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    model = tiny_models.make(args.model)
    x, y = tiny_models.data(args.model, NUM_SAMPLES)
    saved = torch.load(args.resume) if args.resume else None
    if saved:
        model.load_state_dict(saved["model"])
    if args.plain:
        return plain(args, model, x, y)

    import shardps.torch as spt
    ctx = spt.init()
    opt = spt.DistributedOptimizer(
        make_optimizer(model, args.optimizer, args.lr),
        named_parameters=model.named_parameters())
    sched = scheduler(opt, args.steps)
    sampler = spt.DistributedSampler(NUM_SAMPLES, args.batch, seed=0)
    if saved:
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        sampler.load_state_dict(saved["sampler"])
    print(f"rank {ctx.rank} starts at data step "
          f"{sampler.state_dict()['step']}", flush=True)
    epoch = sampler.start_epoch
    done = False
    while not done:
        for indices in sampler.epoch(epoch):
            opt.zero_grad()
            loss_of(model, args.model, x[indices], y[indices]).backward()
            opt.step()
            sched.step()
            step = sampler.state_dict()["step"]
            if step == args.save_at:
                state = {"model": model.state_dict(),
                         "optimizer": opt.state_dict(),
                         "scheduler": sched.state_dict(),
                         "sampler": sampler.state_dict()}
                if ctx.is_lead:
                    torch.save(state, args.save)
                print(f"saved at step {step}", flush=True)
                return 0
            if step >= args.steps:
                done = True
                break
        epoch += 1
    if args.bad_loads:
        bad_loads(opt)
        for bad in ({"step": None}, {"step": -1}, {"seed": 1}):
            try:
                sampler.load_state_dict(dict(sampler.state_dict(), **bad))
            except ValueError as e:
                print(f"refused sampler {bad}: {e}", flush=True)
    if ctx.is_lead and args.out:
        spt.save(model, args.out)
    return 0


def bad_loads(opt):
    """Each bad state_dict raises ValueError naming the problem, and the
    servers' state is as before."""
    import copy
    if isinstance(opt._inner, torch.optim.SGD):
        # Momentum 0 at this step (it travels with the push): the servers
        # still keep the buffer the group was declared with.
        momentum = opt.param_groups[0]["momentum"]
        opt.param_groups[0]["momentum"] = 0.0
        opt.load_state_dict(opt.state_dict())
        opt.param_groups[0]["momentum"] = momentum
        print("loaded at momentum 0", flush=True)
    good = opt.state_dict()
    first = min(good["state"])
    key = "exp_avg" if "exp_avg" in good["state"][first] else \
        "momentum_buffer"

    def changed(change):
        sd = copy.deepcopy(good)
        change(sd)
        return sd

    def nan(sd):
        sd["state"][first][key][0] = float("nan")

    def shape(sd):
        sd["state"][first][key] = sd["state"][first][key].reshape(-1)[:-1]

    def unknown(sd):
        sd["state"][first]["max_exp_avg_sq"] = sd["state"][first][key]

    def groups(sd):
        sd["param_groups"].append(dict(sd["param_groups"][-1], params=[]))

    def count(sd):
        sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][1:]

    def setting(sd):
        sd["param_groups"][0]["weight_decay"] = 0.5

    def step(sd):
        if "step" in sd["state"][first]:
            sd["state"][first]["step"] = torch.tensor(2.5)
        else:
            sd["state"][first][key] = sd["state"][first][key].long()

    for name, change in [("nan", nan), ("shape", shape),
                         ("unknown", unknown), ("groups", groups),
                         ("count", count), ("setting", setting),
                         ("step", step)]:
        try:
            opt.load_state_dict(changed(change))
        except ValueError as e:
            print(f"refused {name}: {e}", flush=True)
        else:
            raise AssertionError(f"{name}: a bad state_dict was loaded")
        now = opt.state_dict()
        for i, entry in good["state"].items():
            for k, v in entry.items():
                same = (v is None and now["state"][i][k] is None) or \
                    torch.equal(v, now["state"][i][k])
                assert same, f"{name} changed {k} of parameter {i}"
    try:
        opt.load_state_dict({"state": {}})
    except ValueError as e:
        print(f"refused not-a-state-dict: {e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
