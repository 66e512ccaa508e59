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
import gzip
import json
import os
import struct
import sys
import time

import numpy as np
import torch

FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


def parser(description: str, epochs: int, batch_size: int,
           lr: float) -> argparse.ArgumentParser:
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
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: 1 under shardps, all cores plain)")
    p.add_argument("--model_out", default="",
                   help="write the final model here as safetensors")
    return p


# --- The permutation of the C++ worker (worker/dataset.cc EpochPermutation),
# so that a plain run sees the global batches the shardps sampler gives out.

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class _MT19937_64:
    """std::mt19937_64, the twist vectorised with numpy."""
    N, M = 312, 156

    def __init__(self, seed: int):
        mt = [seed & _MASK]
        for i in range(1, self.N):
            prev = mt[-1]
            mt.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & _MASK)
        self.mt = np.array(mt, dtype=np.uint64)
        self.out = np.empty(0, dtype=np.uint64)
        self.pos = 0

    def _twist(self):
        mt, n, m = self.mt, self.N, self.M
        upper, lower = np.uint64(0xFFFFFFFF80000000), np.uint64(0x7FFFFFFF)
        matrix, one = np.uint64(0xB5026F5AA96619E9), np.uint64(1)

        def mix(i, j, k):  # new mt[i:j] from mt[i:j], mt[i+1:j+1], mt[k:k+j-i]
            y = (mt[i:j] & upper) | (mt[i + 1:j + 1] & lower)
            mt[i:j] = mt[k:k + j - i] ^ (y >> one) ^ ((y & one) * matrix)

        mix(0, n - m, m)  # reads only old words
        # mt[i + m - n] is already new here; it is read in blocks of m words,
        # each block written before the next reads it.
        for start in range(n - m, n - 1, m):
            mix(start, min(start + m, n - 1), start + m - n)
        y = (mt[n - 1] & upper) | (mt[0] & lower)
        mt[n - 1] = mt[m - 1] ^ (y >> one) ^ ((y & one) * matrix)
        y = mt.copy()  # tempering
        y ^= (y >> np.uint64(29)) & np.uint64(0x5555555555555555)
        y ^= (y << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
        y ^= (y << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
        y ^= y >> np.uint64(43)
        self.out, self.pos = y.tolist(), 0

    def __call__(self) -> int:
        if self.pos >= len(self.out):
            self._twist()
        self.pos += 1
        return self.out[self.pos - 1]


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """EpochPermutation(n, seed, epoch) of worker/dataset.cc, element for
    element: Fisher-Yates with unbiased draws from mt19937_64."""
    rng = _MT19937_64(_splitmix64(seed ^ _splitmix64(epoch & _MASK)))
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        bound = i + 1
        threshold = ((1 << 64) - bound) % bound
        r = rng()
        while r < threshold:
            r = rng()
        j = r % bound
        perm[i], perm[j] = perm[j], perm[i]
    return np.array(perm, dtype=np.int64)


class PlainSampler:
    """The plain twin of spt.DistributedSampler for one process: each step's
    whole global batch, the same indices the workers' slices add up to."""

    def __init__(self, n: int, batch_size: int, seed: int = 0):
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.steps_per_epoch = n // batch_size
        self.start_epoch = 0

    def epoch(self, epoch: int):
        perm = torch.from_numpy(epoch_permutation(self.n, self.seed, epoch))
        for s in range(self.steps_per_epoch):
            yield perm[s * self.batch_size:(s + 1) * self.batch_size]


class PlainContext:
    rank, num_workers, is_lead = 0, 1, True

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
        try:
            import shardps.torch as spt
        except ImportError as e:
            sys.exit(f"cannot import shardps.torch ({e}): run under "
                     "`shardps-local --servers=2 --workers=2 -- /usr/bin/python3 "
                     f"{sys.argv[0]} ...`, or pass --plain for one torch process")
        self.spt, self.ctx = spt, spt.init()

    @property
    def is_lead(self) -> bool:
        return self.ctx.is_lead

    def optimizer(self, optimizer: torch.optim.Optimizer,
                  model: torch.nn.Module):
        if self.spt is None:
            return optimizer
        return self.spt.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters())

    def sampler(self, n: int, batch_size: int, seed: int):
        if self.spt is None:
            return PlainSampler(n, batch_size, seed)
        return self.spt.DistributedSampler(n, batch_size=batch_size, seed=seed)

    def save(self, model: torch.nn.Module, path: str):
        if self.spt is not None:
            self.spt.save(model, path)
        elif self.is_lead:
            save_safetensors(model, path)

    def finish(self):
        self.ctx.finish()

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

    def add(self, items: int, loss: float):
        self.items += items
        self.loss_sum += loss
        self.loss_n += 1

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


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16",
                       torch.bfloat16: "BF16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32"}


def save_safetensors(model: torch.nn.Module, path: str) -> None:
    """The model's named_parameters() as a safetensors file (8-byte header
    length, JSON header, little-endian data), written atomically."""
    header, blobs, offset = {}, [], 0
    for name, p in model.named_parameters():
        t = p.detach().cpu().contiguous()
        blob = t.view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16 \
            else t.numpy().astype(t.numpy().dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype],
                        "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)
