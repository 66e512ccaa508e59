#!/usr/bin/python3
"""The PyTorch DDP peer of the shardps torch examples: the model, data, global
batch, optimizer and schedule of worker/python/examples/{cnn_fashion_mnist,
gpt_kjv}.py (their build() recipes) trained with DistributedDataParallel over
gloo, one thread per process, for a fixed number of steps. Each rank takes its
contiguous slice of every global batch of the examples' sampler order.

Prints a progress line, then one JSON line with the timings.

Usage: ddp_bench.py --model=cnn|gpt --steps=N [--processes=2] [-- EXAMPLE ARGS]
  One rank of a job on emulated hosts (shardps-bench torch --emulate_hosts
  starts each in its host's namespace; rank 0 prints the lines):
       ddp_bench.py --model=gpt --steps=N --processes=4 --rank=R \
           --master=10.213.0.1:29500 --ifname=eth0 [--compression=fp16]
"""
import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # before torch loads: one thread per process

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        "..", "..", "..", "worker", "python", "examples")
sys.path.insert(0, os.path.abspath(EXAMPLES))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import cnn_fashion_mnist  # noqa: E402
import ddp_launch  # noqa: E402
import gpt_kjv  # noqa: E402


def recipe(model: str, example_args):
    if model == "cnn":
        args = cnn_fashion_mnist.arg_parser().parse_args(example_args)
        return args, cnn_fashion_mnist.build(
            args, common.fashion_mnist(args.data))
    args = gpt_kjv.arg_parser().parse_args(example_args)
    train, _ = gpt_kjv.windows(gpt_kjv.kjv_text(), args.seq_len)
    return args, gpt_kjv.build(args, train)


def run(rank, bench):
    torch.set_num_threads(bench.threads)
    args, r = recipe(bench.model, bench.example_args)
    ddp = torch.nn.parallel.DistributedDataParallel(r.model)
    if bench.compression == "fp16":
        # Gradients all-reduced as fp16, 2 bytes an element as shardps's
        # bf16 (gloo in torch 1.13 refuses bfloat16).
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    sampler = common.PlainSampler(r.num_samples, args.batch_size, args.seed)
    local = args.batch_size // bench.processes
    items_per_step = args.batch_size * r.items_per_sample
    dist.barrier()
    start, step, epoch, losses = time.time(), 0, 0, []
    first_done = start
    while step < bench.steps:
        for batch in sampler.epoch(epoch):
            indices = batch[rank * local:(rank + 1) * local]
            r.optimizer.zero_grad()
            losses.append(common.backward(r, ddp, indices, epoch, args.accum,
                                          ddp.no_sync))
            # The recipe's clipping (--max_grad_norm): DDP's gradients are
            # the average already.
            common.clip(r.optimizer, args.max_grad_norm)
            r.optimizer.step()
            r.scheduler.step()
            step += 1
            if step == 1:
                first_done = time.time()
            if step >= bench.steps:
                break
        epoch += 1
    end = time.time()
    wall = end - start
    # From the end of the first step: what the steps take once every rank
    # holds the model (its broadcast is in DDP's constructor, untimed).
    steady = end - first_done
    return {"model": bench.model, "processes": bench.processes,
            "compression": bench.compression,
            "threads": bench.threads, "steps": step,
            "global_batch": args.batch_size, "wall_s": wall,
            "step_s": wall / step, "items_per_s": step * items_per_step / wall,
            "steady_s": steady, "steady_steps": step - 1,
            "steady_items_per_s": (step - 1) * items_per_step / max(steady, 1e-9),
            "items": "samples" if bench.model == "cnn" else "tokens",
            "train_loss_last": losses[-1],
            "train_loss_mean": sum(losses) / len(losses),
            "parameters": sum(p.numel() for p in r.model.parameters()),
            "torch": torch.__version__, "blas": ddp_launch.blas_library()}


def main():
    argv = sys.argv[1:]
    example_args = []
    if "--" in argv:
        at = argv.index("--")
        argv, example_args = argv[:at], argv[at + 1:]
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("cnn", "gpt"), required=True)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    ddp_launch.add_arguments(p)
    bench = p.parse_args(argv)
    # The examples' schedules count --max_steps; keep them the same here.
    bench.example_args = [f"--max_steps={bench.steps}"] + example_args
    result = ddp_launch.run_job(run, bench, p)
    if result is None:
        return 1
    print(f"ddp {result['model']}: {result['processes']} processes x "
          f"{result['threads']} thread(s), {result['steps']} steps of global "
          f"batch {result['global_batch']}: {result['wall_s']:.2f} s, "
          f"{result['step_s']:.3f} s/step, {result['items_per_s']:.0f} "
          f"{result['items']}/s", flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
