#!/usr/bin/python3
"""The PyTorch peer of `shardps-bench train`: the main job's model and recipe
(MLP 784-512-256-10, SGD lr 0.1 momentum 0.9, cosine decay to 0 over the run,
global batch 256) trained with DistributedDataParallel over gloo, one thread
per process. Prints one JSON line with the timings and accuracy.

Usage: mlp_ddp.py --processes=2 --epochs=10 [--data=/usr/share/datasets/fashion-mnist]
  One rank of a job on emulated hosts (shardps-bench train --emulate_hosts
  starts each in its host's namespace; rank 0 prints the JSON line):
       mlp_ddp.py --processes=4 --rank=R --master=10.213.0.1:29500 \
           --ifname=eth0 [--compression=fp32|fp16]
"""
import argparse
import json
import os
import sys
import time

# Each process's BLAS threads as --threads says, before torch loads: an
# OpenBLAS pool larger than that only spins against the other process.
for _arg in sys.argv[1:]:
    if _arg.startswith("--threads="):
        for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                     "MKL_NUM_THREADS"):
            os.environ[_var] = _arg.split("=", 1)[1]

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "..", "..", "worker", "python",
                                "examples"))
import common  # noqa: E402
import ddp_launch  # noqa: E402


def load_idx(path):
    """Images flattened to (n, 784) uint8, or labels."""
    data = common.load_idx(path)
    return data.reshape(len(data), -1) if data.ndim == 3 else data


def build_model():
    return torch.nn.Sequential(
        torch.nn.Linear(784, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10))


def run(rank, args):
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    x = torch.from_numpy(load_idx(f"{args.data}/train-images-idx3-ubyte.gz").copy())
    y = torch.from_numpy(load_idx(f"{args.data}/train-labels-idx1-ubyte.gz").copy())
    tx = torch.from_numpy(load_idx(f"{args.data}/t10k-images-idx3-ubyte.gz").copy())
    ty = torch.from_numpy(load_idx(f"{args.data}/t10k-labels-idx1-ubyte.gz").copy())
    model = build_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if args.compression == "fp16":
        # Gradients all-reduced as fp16, 2 bytes an element as shardps's
        # bf16 (gloo in torch 1.13 refuses bfloat16: "Invalid scalar type").
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    batch = 256
    local = batch // args.processes
    steps_per_epoch = len(x) // batch
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(
        opt, T_max=steps_per_epoch * args.epochs)
    loss_fn = torch.nn.CrossEntropyLoss()
    epoch_times, accuracies = [], []
    start = time.time()
    for epoch in range(args.epochs):
        t0 = time.time()
        g = torch.Generator().manual_seed(args.seed + epoch)
        perm = torch.randperm(len(x), generator=g)
        for s in range(steps_per_epoch):
            idx = perm[s * batch + rank * local: s * batch + (rank + 1) * local]
            xb = x[idx].float().div_(255.0)
            loss = loss_fn(ddp(xb), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        epoch_times.append(time.time() - t0)
        if rank == 0:
            with torch.no_grad():
                pred = model(tx.float().div_(255.0)).argmax(1)
                accuracies.append(float((pred == ty).float().mean()))
    total = time.time() - start
    return {"processes": args.processes, "threads": args.threads,
            "compression": args.compression,
            "epochs": args.epochs, "wall_s": total,
            "epoch_s": epoch_times, "test_accuracy": accuracies,
            "torch": torch.__version__, "blas": ddp_launch.blas_library()}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ddp_launch.add_arguments(p)
    args = p.parse_args()
    result = ddp_launch.run_job(run, args, p)
    if result is None:
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
