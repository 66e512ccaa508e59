"""A worker script for the collectives tests: every rank runs one --mode
and writes what it got to --out/rank<r>.npz, or prints the error.

  reference  each collective on seeded per-rank tensors, and the refusals
  mismatch   rank 1 calls max where rank 0 calls sum
  dead       rank 0 all-reduces, rank 1 waits to be killed
  missing    rank 0 all-reduces with a short timeout, rank 1 never does
  batchnorm  a small CNN with BatchNorm trained by every rank
"""

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardps
import shardps.torch as spt


def rank_tensors(rank):
    """The seeded tensors rank `rank` reduces (the test recomputes them)."""
    g = np.random.default_rng(1000 + rank)
    return dict(
        f32=(g.standard_normal((3, 5)) * 10.0 ** g.integers(-3, 8, (3, 5))
             ).astype(np.float32),
        f64=g.standard_normal(7),
        i64=g.integers(-2 ** 62, 2 ** 62, 6, dtype=np.int64),
        scalar=np.float32(g.standard_normal()))


def reference(ctx, out):
    got = {}
    mine = rank_tensors(ctx.rank)
    for op in ("mean", "sum", "max", "min"):
        t = torch.from_numpy(mine["f32"].copy())
        spt.all_reduce(t, op=op)
        got[f"f32_{op}"] = t.numpy()
    t = torch.from_numpy(mine["f64"].copy())
    spt.all_reduce(t, op="sum")
    got["f64_sum"] = t.numpy()
    for op in ("sum", "max"):
        t = torch.from_numpy(mine["i64"].copy())
        spt.all_reduce(t, op=op)
        got[f"i64_{op}"] = t.numpy()
    t = torch.tensor(mine["scalar"])
    spt.all_reduce(t, op="mean")
    got["scalar_mean"] = t.numpy()
    t = torch.from_numpy(mine["f64"].copy())
    spt.broadcast(t, src=1)
    got["broadcast_src1"] = t.numpy()
    spt.barrier()
    # Refused before anything is sent, or by the coordinator.
    errors = []
    for bad in (lambda: spt.all_reduce(torch.zeros(3, dtype=torch.int32)),
                lambda: spt.all_reduce(torch.zeros((1 << 18) + 1)),
                lambda: ctx.session.collective(
                    "sum", "float32", [(1 << 18) + 1],
                    bytes(4 * ((1 << 18) + 1)), 0, 30.0)):
        try:
            bad()
        except (ValueError, shardps.Error) as e:
            errors.append(f"{type(e).__name__}: {e}")
    print("\n".join(errors), flush=True)
    # Still in step after the refusals.
    t = torch.ones(2, dtype=torch.int64)
    spt.all_reduce(t, op="sum")
    got["after_refusals"] = t.numpy()
    np.savez(os.path.join(out, f"rank{ctx.rank}.npz"), **got)


class BnCnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 5 * 5, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)  # 12 -> 10 -> 5
        return self.fc(x.flatten(1))


def batchnorm(ctx, out, steps=3):
    torch.manual_seed(0)
    model = BnCnn()
    opt = spt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model=model)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 1, 12, 12, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)
    sampler = spt.DistributedSampler(len(x), batch_size=16, seed=0)
    got, done = {}, 0
    for indices in sampler.epoch(0):
        loss = F.cross_entropy(model(x[indices]), y[indices])
        opt.zero_grad()
        loss.backward()
        before = {k: b.clone() for k, b in model.named_buffers()}
        opt.step()
        done += 1
        if done == steps:
            for k, b in model.named_buffers():
                got["before." + k] = before[k].numpy()
                got["after." + k] = b.numpy()
            break
    np.savez(os.path.join(out, f"rank{ctx.rank}.npz"), **got)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    ctx = spt.init()
    torch.set_num_threads(1)
    try:
        if args.mode == "reference":
            reference(ctx, args.out)
        elif args.mode == "batchnorm":
            batchnorm(ctx, args.out)
        elif args.mode == "mismatch":
            t = torch.ones(4)
            spt.all_reduce(t, op="sum" if ctx.rank == 0 else "max")
        elif args.mode in ("dead", "missing"):
            if ctx.rank == 1:
                print("waiting", flush=True)
                time.sleep(600 if args.mode == "dead" else 20)
                return 0
            print("calling", flush=True)
            start = time.time()
            try:
                spt.all_reduce(torch.ones(4), op="sum",
                               timeout_s=120 if args.mode == "dead" else 2)
            finally:
                print(f"after {time.time() - start:.1f} s", flush=True)
    except shardps.Error as e:
        print(f"error {type(e).__name__}: {e}", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
