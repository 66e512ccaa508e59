"""Starts a PyTorch DDP job of N processes on this machine (gloo on a free
127.0.0.1 port) and returns what rank 0 reports, or runs one rank of a job
whose ranks another program started (each on a host of its own): shared by
the DDP baselines of shardps-bench (mlp_ddp.py for `train`, ddp_bench.py for
`torch`)."""

import os
import queue as queue_module
import socket
import sys

import torch.distributed as dist
import torch.multiprocessing as mp


def blas_library():
    """The BLAS shared objects this process loaded (the peer must use the
    OpenBLAS shardps uses)."""
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "blas" in line.lower()}
    return sorted(os.path.realpath(lib) for lib in libs if lib.startswith("/"))


def _entry(target, rank, processes, port, args, results):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=processes)
    result = target(rank, args)
    if rank == 0:
        results.put(result)
    dist.destroy_process_group()


def run_rank(target, args, rank, processes, master, ifname=None):
    """Runs target(rank, args) as rank `rank` of `processes`, meeting the
    others at `master` ("ADDR:PORT", rank 0's host; rank 0 listens there);
    gloo's connections use network card `ifname` when given (in a network
    namespace the host name may not resolve to the card's address). Returns
    target's return value."""
    addr, port = master.rsplit(":", 1)
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = port
    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    dist.init_process_group("gloo", rank=rank, world_size=processes)
    result = target(rank, args)
    dist.destroy_process_group()
    return result


def run(target, args, processes):
    """Runs target(rank, args) in `processes` spawned processes inside one
    process group; returns rank 0's return value, or None (said on stderr)
    when a process failed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry,
                         args=(target, r, processes, port, args, results))
             for r in range(processes)]
    for proc in procs:
        proc.start()
    result = None
    while result is None:
        try:
            result = results.get(timeout=1)
        except queue_module.Empty:
            if any(proc.exitcode not in (None, 0) for proc in procs):
                for proc in procs:
                    proc.kill()
                print(f"a DDP process failed: exit codes "
                      f"{[proc.exitcode for proc in procs]}", file=sys.stderr)
                return None
    for proc in procs:
        proc.join()
    return result


def add_arguments(parser):
    """The arguments both DDP baselines take: --compression, and --rank,
    --master and --ifname for one rank of a job on emulated hosts."""
    parser.add_argument("--compression", choices=("fp32", "fp16"),
                        default="fp32",
                        help="the gradients' all-reduce encoding")
    parser.add_argument("--rank", type=int, default=-1,
                        help="run this rank alone (with --master); -1: start "
                             "--processes ranks on this machine")
    parser.add_argument("--master", default="",
                        help="with --rank: ADDR:PORT of rank 0")
    parser.add_argument("--ifname", default="",
                        help="with --rank: the network card gloo uses")


def run_job(target, args, parser):
    """Runs target(rank, args) as the arguments of add_arguments say: the
    one rank --rank names (a rank other than 0 exits here, successfully;
    rank 0 reports), or --processes ranks spawned here. Returns rank 0's
    result, or None when a process failed."""
    if args.rank >= 0:
        if not args.master:
            parser.error("--rank needs --master=ADDR:PORT")
        result = run_rank(target, args, args.rank, args.processes,
                          args.master, args.ifname or None)
        if args.rank != 0:
            sys.exit(0)
        return result
    return run(target, args, args.processes)
