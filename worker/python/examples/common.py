"""What the examples share: flags, the shardps-or-plain job, progress lines,
Fashion-MNIST loading and a safetensors writer.

Every example runs two ways with the same model, data, global batch, seed and
optimizer:
  shardps-local --servers=2 --workers=2 -- /usr/bin/python3 EXAMPLE.py ARGS
  /usr/bin/python3 EXAMPLE.py --plain ARGS      # one ordinary torch process
Under shardps each worker computes the gradient of its slice of every global
batch and the servers average them, so both runs compute the same steps.
"""
import argparse
import contextlib
import gzip
import os
import struct
import sys
import time
import warnings

import numpy as np
import torch

import curves

FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


def parser(description: str, epochs: int, batch_size: int, lr: float,
           max_grad_norm: float = 0.0) -> argparse.ArgumentParser:
    """The flags every example takes; each adds its own."""
    p = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plain", action="store_true",
                   help="one ordinary torch process, no shardps")
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--batch_size", type=int, default=batch_size,
                   help="global batch: the sum over workers")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--seed", type=int, default=0,
                   help="initial weights and the sampler's permutations")
    p.add_argument("--max_steps", type=int, default=0,
                   help="stop after this many global steps (0: no limit)")
    p.add_argument("--accum", type=int, default=1,
                   help="backward passes per step (gradient accumulation): "
                   "each rank's slice in this many micro-batches")
    p.add_argument("--max_grad_norm", type=float, default=max_grad_norm,
                   help="clip the global norm of each step's averaged "
                   "gradient to this (on the servers; plain: torch's "
                   "clip_grad_norm_); 0: off")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: 1 under shardps, all cores plain)")
    p.add_argument("--model_out", default="",
                   help="write the final model here as safetensors")
    p.add_argument("--log_every", type=_not_negative, default=10,
                   help="a progress line and a metrics.csv row every this "
                   "many steps (0: only the epochs')")
    p.add_argument("--run_dir", default="",
                   help="where metrics.csv and loss.png go (default: "
                   "<shardps-local's run directory>/<example> under "
                   "shardps-local, else the current directory)")
    return p


def _not_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _shardps():
    """The built shardps package (PYTHONPATH=<build>/worker/python), which
    the plain runs use too: for the data order and for saving."""
    try:
        import shardps
        import shardps.torch
        return shardps
    except ImportError as e:
        sys.exit(f"cannot import shardps ({e}): put the build's worker/python "
                 "on PYTHONPATH (shardps-local does), e.g. "
                 "PYTHONPATH=build/worker/python")


class PlainSampler:
    """The plain twin of spt.DistributedSampler for one process: each step's
    whole global batch, the same indices the workers' slices add up to."""

    def __init__(self, n: int, batch_size: int, seed: int = 0):
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.steps_per_epoch = n // batch_size
        self.start_epoch = 0
        self.batch_epoch = None  # the epoch of the batch yielded last

    def epoch(self, epoch: int):
        # The sampler's order: shardps-worker's permutation, epochs from 1.
        perm = torch.from_numpy(
            _shardps().epoch_permutation(self.n, self.seed, epoch + 1))
        for s in range(self.steps_per_epoch):
            self.batch_epoch = epoch
            yield perm[s * self.batch_size:(s + 1) * self.batch_size]


class Float32Master:
    """The plain twin of shardps's float32 master weights, for a model that
    is not all float32: `optimizer` steps float32 copies of the parameters
    with the model's gradients made float32 (exact), and the model gets
    the copies rounded to nearest even, as DistributedOptimizer and the
    servers do."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer, self.pairs = optimizer, []
        for group in optimizer.param_groups:
            masters = [p.detach().to(torch.float32, copy=True)
                       for p in group["params"]]
            self.pairs += zip(group["params"], masters)
            group["params"] = masters

    def zero_grad(self, set_to_none: bool = False):
        for p, _ in self.pairs:
            if p.grad is not None:
                p.grad = None if set_to_none else p.grad.zero_()

    def step(self, max_grad_norm: float = 0.0):
        """Returns the gradients' global norm when clipping, else None."""
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()
        norm = clip(self.optimizer, max_grad_norm)
        self.optimizer.step()
        with torch.no_grad():
            for p, m in self.pairs:
                p.copy_(m)
        return norm


def clip(optimizer: torch.optim.Optimizer, max_grad_norm: float):
    """torch's clip_grad_norm_ over the optimizer's parameters (the plain
    run's clipping); the norm, or None when max_grad_norm is 0."""
    if not max_grad_norm:
        return None
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))


class PlainContext:
    rank, num_workers, is_lead, step = 0, 1, True, 0

    def finish(self):
        pass


class Job:
    """The run: shardps (spt) under shardps-local, or one plain process."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        threads = args.threads or (os.cpu_count() if args.plain else 1)
        torch.set_num_threads(threads)
        if args.plain:
            self.spt, self.ctx = None, PlainContext()
            return
        spt = _shardps().torch
        self.spt, self.ctx = spt, spt.init()

    @property
    def is_lead(self) -> bool:
        return self.ctx.is_lead

    def optimizer(self, optimizer: torch.optim.Optimizer,
                  model: torch.nn.Module, backward_passes_per_step: int = 1,
                  max_grad_norm: float = 0.0):
        if self.spt is None:
            if any(p.dtype != torch.float32 for p in model.parameters()):
                return Float32Master(optimizer)
            return optimizer
        # The buffers the model saves (BatchNorm's statistics) follow the
        # lead's, as DDP's; derived ones (a GPT's rotary tables) are the
        # same everywhere already.
        saved = model.state_dict().keys()
        return self.spt.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(),
            named_buffers=[(n, b) for n, b in model.named_buffers()
                           if n in saved],
            backward_passes_per_step=backward_passes_per_step,
            max_grad_norm=max_grad_norm or None)

    def optimizer_step(self, opt, max_grad_norm: float = 0.0):
        """opt.step(), clipping the plain run as shardps's servers clip;
        returns the step's global gradient norm when clipping, else None."""
        if self.spt is not None:
            opt.step()
            return opt.grad_norm if max_grad_norm else None
        if isinstance(opt, Float32Master):
            return opt.step(max_grad_norm)
        norm = clip(opt, max_grad_norm)
        opt.step()
        return norm

    def sampler(self, n: int, batch_size: int, seed: int):
        if self.spt is None:
            return PlainSampler(n, batch_size, seed)
        return self.spt.DistributedSampler(n, batch_size=batch_size, seed=seed)

    def save(self, model: torch.nn.Module, path: str):
        if self.is_lead:
            _shardps().torch.save(model, path)

    def finish(self):
        self.ctx.finish()

    def eval_part(self, n: int) -> slice:
        """This rank's contiguous part of an evaluation set of n items (the
        whole set plain): every rank in the job evaluates one."""
        if self.spt is None:
            return slice(0, n)
        ranks = self.ctx.session.active_ranks()
        begin, end = _shardps().worker_slice(0, n, ranks.index(self.ctx.rank),
                                             len(ranks))
        return slice(begin, end)

    def mean(self, total: float, count: int) -> float:
        """The ranks' totals over their counts (spt.all_reduce, in rank
        order: every rank gets bitwise the same figure)."""
        if self.spt is None:
            return total / count
        t = torch.tensor([total, float(count)], dtype=torch.float64)
        self.spt.all_reduce(t, op="sum")
        return float(t[0] / t[1])

    def check_ranks_agree(self, evaluate, model, n: int, metric: str) -> None:
        """Every rank evaluates the same n items and sums its model's
        state_dict (weights and saved buffers such as BatchNorm's
        statistics); the lead says whether both are bitwise equal on every
        rank, or that they differ."""
        if self.spt is None:
            return
        total, count = evaluate(model, slice(0, n))
        values = torch.tensor(
            [total / count, sum(float(t.double().sum())
                                for t in model.state_dict().values())],
            dtype=torch.float64)
        high, low = values.clone(), values.clone()
        self.spt.all_reduce(high, op="max")
        self.spt.all_reduce(low, op="min")
        if self.is_lead:
            same = ("equal on every rank, as the model's weights and buffers"
                    if torch.equal(high, low) else
                    f"DIFFERS between ranks ({metric} {float(low[0]):.6f} "
                    f"to {float(high[0]):.6f}, state sums {float(low[1])!r} "
                    f"to {float(high[1])!r})")
            print(f"every rank evaluated the first {n} items: {metric} "
                  f"{float(values[0]):.6f}, {same}", flush=True)

    @property
    def step(self) -> int:
        """The job's step: under shardps the servers' (it jumps back after a
        rollback, and starts at a restored checkpoint's step)."""
        return self.ctx.step if self.spt is not None else self._plain_step

    _plain_step = 0

    def follow(self, scheduler, stepped: bool = True) -> None:
        """Moves `scheduler` to the job's step: after each opt.step(), and
        once before training with stepped=False (a resumed job starts at its
        checkpoint's step). A learning rate that follows the job's step
        keeps a run with a rollback bitwise equal to one without."""
        if self.spt is None and stepped:
            self._plain_step += 1
        scheduler.last_epoch = self.step - 1
        with warnings.catch_warnings():
            if not stepped:  # no opt.step() yet: torch would warn
                warnings.simplefilter("ignore", UserWarning)
            scheduler.step()

    def describe(self) -> str:
        if self.spt is None:
            return f"plain torch, 1 process x {torch.get_num_threads()} thread(s)"
        return (f"shardps, {self.ctx.num_workers} worker(s), rank {self.ctx.rank},"
                f" {torch.get_num_threads()} thread(s)")


class Recipe:
    """An example's model, optimizer, learning-rate schedule and data, so that
    the example and the DDP benchmark (tests/bench/torch) train the same thing.

    loss(module, indices, epoch): the mean loss of those sampler indices of
    `epoch` through `module` (the model, or a DDP wrapper of it).
    """

    def __init__(self, model, optimizer, scheduler, num_samples: int,
                 items_per_sample: int, loss):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.num_samples, self.items_per_sample = num_samples, items_per_sample
        self.loss = loss


def backward(r: Recipe, module, indices, epoch: int, accum: int = 1,
             no_sync=None) -> float:
    """The backward passes of one step: `indices` in `accum` micro-batches
    (torch.tensor_split), each loss weighted by its share of `indices`, so
    that the gradients add up to those of the mean loss over `indices`.
    With no_sync (DDP's), all passes but the last run under it. Returns
    the mean loss."""
    if len(indices) < accum:
        raise ValueError(f"--accum={accum} micro-batches of a slice of "
                         f"{len(indices)} samples")
    total = 0.0
    for i, part in enumerate(torch.tensor_split(indices, accum)):
        late = no_sync is not None and i < accum - 1
        with no_sync() if late else contextlib.nullcontext():
            loss = r.loss(module, part, epoch)
            if accum > 1:
                loss = loss * (len(part) / len(indices))
            loss.backward()
        total += loss.item()
    return total


class Steps:
    """Counts global steps and honours --max_steps."""

    def __init__(self, max_steps: int, start: int = 0):
        self.max_steps, self.step = max_steps, start

    def done(self) -> bool:
        return self.max_steps > 0 and self.step >= self.max_steps


class EpochClock:
    """Seconds and processed items (samples, tokens) of one epoch."""

    def __init__(self):
        self.start, self.items = time.time(), 0
        self.loss_sum, self.loss_n = 0.0, 0
        self.norm_sum, self.norm_n = 0.0, 0

    def add(self, items: int, loss: float, norm=None):
        self.items += items
        self.loss_sum += loss
        self.loss_n += 1
        if norm is not None:
            self.norm_sum += norm
            self.norm_n += 1

    @property
    def grad_norm(self):
        """The epoch's mean global gradient norm (None: not clipping)."""
        return self.norm_sum / self.norm_n if self.norm_n else None

    @property
    def seconds(self) -> float:
        return time.time() - self.start

    @property
    def train_loss(self) -> float:
        return self.loss_sum / max(self.loss_n, 1)


def progress(**fields) -> None:
    """One progress line: `key value` pairs in order, floats with 4 decimals."""
    parts = []
    for k, v in fields.items():
        parts.append(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}")
    print(" ".join(parts), flush=True)


def final(**fields) -> None:
    parts = [f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
             for k, v in fields.items()]
    print("final: " + " ".join(parts), flush=True)


def load_idx(path: str) -> np.ndarray:
    """An IDX file (gzip): images as (n, rows, cols) uint8, labels as int64."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    magic = struct.unpack(">I", raw[:4])[0]
    if magic == 0x803:
        n, rows, cols = struct.unpack(">III", raw[4:16])
        return np.frombuffer(raw, np.uint8, offset=16).reshape(n, rows, cols)
    if magic == 0x801:
        n = struct.unpack(">I", raw[4:8])[0]
        return np.frombuffer(raw, np.uint8, offset=8).astype(np.int64)
    raise ValueError(f"{path}: magic {magic:#x} is not IDX images or labels")


def fashion_mnist(data_dir: str = FASHION_MNIST):
    """(train_x, train_y, test_x, test_y): images float32 (n, 1, 28, 28) in
    [0, 1] normalised to mean 0, std 1 with the training set's figures."""
    def part(prefix):
        x = load_idx(f"{data_dir}/{prefix}-images-idx3-ubyte.gz")
        y = load_idx(f"{data_dir}/{prefix}-labels-idx1-ubyte.gz")
        return torch.from_numpy(x.astype(np.float32) / 255.0)[:, None], \
            torch.from_numpy(y)
    try:
        x, y = part("train")
        tx, ty = part("t10k")
    except FileNotFoundError as e:
        sys.exit(f"{e.filename} is missing: Fashion-MNIST is expected in "
                 f"{data_dir} (train-images-idx3-ubyte.gz, ...)")
    mean, std = x.mean(), x.std()
    return (x - mean) / std, y, (tx - mean) / std, ty


def train(job: Job, args: argparse.Namespace, r: Recipe, name: str,
          details: str, evaluate, eval_size: int, metric: str,
          items: str, sample=None) -> int:
    """The examples' loop: each epoch of the sampler, a step per global
    batch (the scheduler following the job's step); at each epoch's end
    every rank evaluates its part of the evaluation set
    (`evaluate(model, part)` -> (total, count) over the items of the slice
    `part` of the eval_size items), the parts are averaged with
    spt.all_reduce into the float called `metric`, and the lead prints a
    progress line, then `sample(model)` if given (a string: the lead alone
    computes it, while the others wait in their next step). Every
    --log_every steps the lead prints a step line; it writes metrics.csv as
    it goes and loss.png at the end (curves.py). At the end the model
    (--model_out) and the final line. `items` names what
    r.items_per_sample counts."""
    model, sched = r.model, r.scheduler
    directory = curves.run_dir(args.run_dir, name)
    sampler = job.sampler(r.num_samples, args.batch_size, args.seed)
    steps_per_epoch = r.num_samples // args.batch_size
    opt = job.optimizer(r.optimizer, model, args.accum, args.max_grad_norm)
    first_epoch = sampler.start_epoch  # a worker joining a job waits here
    steps = Steps(args.max_steps, job.step)
    job.follow(sched, stepped=False)
    log = curves.RunLog(directory, job.is_lead, args.log_every, items, metric,
                        resumed=steps.step > 0,
                        max_grad_norm=args.max_grad_norm)
    if job.is_lead:
        print(f"{name}: {job.describe()}, "
              f"{sum(p.numel() for p in model.parameters())} parameters, "
              f"{details}, global batch {args.batch_size}, "
              f"{steps_per_epoch} steps/epoch; writing {directory}",
              flush=True)
    items_per_step = args.batch_size * r.items_per_sample
    epoch, clock, value = first_epoch, None, float("nan")
    for epoch in range(first_epoch, args.epochs):
        clock = EpochClock()
        for indices in sampler.epoch(epoch):
            started = time.perf_counter()
            lr = r.optimizer.param_groups[0]["lr"]  # this step's
            opt.zero_grad()
            loss = backward(r, model, indices, sampler.batch_epoch,
                            args.accum)
            norm = job.optimizer_step(opt, args.max_grad_norm)
            job.follow(sched)
            steps.step = job.step
            clock.add(items_per_step, loss, norm)
            log.step(epoch + 1, steps.step, loss, lr, norm, items_per_step,
                     time.perf_counter() - started)
            if steps.done():
                break
        seconds = clock.seconds
        evaluated = time.perf_counter()
        # Every rank its part, so that none waits idle for the lead.
        value = job.mean(*evaluate(model, job.eval_part(eval_size)))
        if job.is_lead:
            if steps.done() or epoch + 1 == args.epochs:
                log.flush(epoch + 1, steps.step)  # the run's last steps
            rate = clock.items / seconds
            clipping = {} if clock.grad_norm is None else {
                "grad_norm": clock.grad_norm}
            progress(epoch=f"{epoch + 1}/{args.epochs}", step=steps.step,
                     train_loss=clock.train_loss, **clipping, **{metric: value},
                     **{f"{items}/s": f"{rate:.0f}",
                        "epoch_s": f"{seconds:.2f}"})
            if sample is not None:
                print(f"sample: {sample(model)}", flush=True)
            log.evaluation(epoch + 1, steps.step, clock.train_loss,
                           clock.grad_norm, rate,
                           1000 * seconds / max(clock.loss_n, 1), seconds,
                           time.perf_counter() - evaluated, value)
        if steps.done():
            break
    job.check_ranks_agree(evaluate, model, min(eval_size, 256), metric)
    if args.model_out:
        job.save(model, args.model_out)
    if job.is_lead:
        log.finish(f"{name}: {job.describe()}")
        final(epoch=epoch + 1, step=steps.step, **{metric: value},
              train_loss=clock.train_loss if clock else float("nan"))
    job.finish()
    return 0
