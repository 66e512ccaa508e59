#!/usr/bin/python3
"""The PyTorch peer of `shardps-bench train`: the main job's model and recipe
(MLP 784-512-256-10, SGD lr 0.1 momentum 0.9, cosine decay to 0 over the run,
global batch 256) trained with DistributedDataParallel over gloo, one thread
per process. Prints one JSON line with the timings and accuracy.

Usage: torch_ddp.py --processes=2 --epochs=10 [--data=/usr/share/datasets/fashion-mnist]
"""
import argparse
import gzip
import json
import os
import socket
import struct
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def load_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic = struct.unpack(">I", data[:4])[0]
    if magic == 0x803:
        n, rows, cols = struct.unpack(">III", data[4:16])
        return np.frombuffer(data, np.uint8, offset=16).reshape(n, rows * cols)
    n = struct.unpack(">I", data[4:8])[0]
    return np.frombuffer(data, np.uint8, offset=8).astype(np.int64)


def blas_library():
    """The BLAS shared object this process loaded (the peer must use OpenBLAS)."""
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "blas" in line.lower()}
    return sorted(os.path.realpath(l) for l in libs if l.startswith("/"))


def build_model():
    return torch.nn.Sequential(
        torch.nn.Linear(784, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10))


def run(rank, args, port, queue):
    torch.set_num_threads(args.threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.processes)
    torch.manual_seed(args.seed)
    x = torch.from_numpy(load_idx(f"{args.data}/train-images-idx3-ubyte.gz").copy())
    y = torch.from_numpy(load_idx(f"{args.data}/train-labels-idx1-ubyte.gz").copy())
    tx = torch.from_numpy(load_idx(f"{args.data}/t10k-images-idx3-ubyte.gz").copy())
    ty = torch.from_numpy(load_idx(f"{args.data}/t10k-labels-idx1-ubyte.gz").copy())
    model = build_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
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
    if rank == 0:
        queue.put({"processes": args.processes, "threads": args.threads,
                   "epochs": args.epochs, "wall_s": total,
                   "epoch_s": epoch_times, "test_accuracy": accuracies,
                   "torch": torch.__version__, "blas": blas_library()})
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, args, port, queue))
             for r in range(args.processes)]
    for proc in procs:
        proc.start()
    result = queue.get()
    for proc in procs:
        proc.join()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
