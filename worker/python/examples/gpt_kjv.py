#!/usr/bin/python3
"""A LLaMA-style GPT on the King James Bible, byte level, trained data-parallel
through the shardps servers.

  shardps-local --servers=2 --workers=2 -- \\
      /usr/bin/python3 worker/python/examples/gpt_kjv.py
  /usr/bin/python3 worker/python/examples/gpt_kjv.py --plain

Decoder-only: RMSNorm, rotary position embeddings, SwiGLU MLP, tied input and
output embeddings, causal attention. The text (`bible Gen1:1-Rev22:21`, Debian's
bible-kjv) is cut into windows of seq_len+1 bytes; every 20th window is the
validation set. An "epoch" is --steps_per_epoch global steps over the next
steps_per_epoch x batch_size training windows of one fixed seeded shuffle (so
epochs see disjoint windows until the shuffle wraps around); the sampler
permutes them within the epoch. Then every rank evaluates its part of the
first --val_windows validation windows, the ranks average the loss, and the
lead prints --sample_bytes bytes the model generates after --sample_prompt.
The default run is 10 epochs of 200 steps (2,000 steps, minutes on a
laptop-class CPU); --max_steps=N makes a short one (the schedule then spans
N steps).

The recipe of today's LLMs; each part's flag, at the value that turns it off:
  AdamW betas (0.9, 0.95)                         --beta2=0.999 (torch's)
  weight decay 0.1 on tensors of >= 2 dims (the matrices and the tied
    embedding, as nanoGPT; not the norms)         --weight_decay=0
  linear warmup over 20 steps                     --warmup_steps=0
  then cosine down to 10 % of --lr                --min_lr_ratio=1
  bf16 autocast                                   --autocast=off
  gradient accumulation: --accum=N micro-batches  --accum=1 (the default)
    per rank and step (DistributedOptimizer's backward_passes_per_step=N:
    one push per step, at the last backward)
  clipping the global norm of the averaged        --max_grad_norm=0
    gradient at 1.0 (DistributedOptimizer's
    max_grad_norm: on the servers; plain: torch's
    clip_grad_norm_); the norm is logged
bf16 through torch.autocast rather than bf16 parameters: the matmuls run in
bf16 while the weights stay float32 on the worker too (each forward uses a
bf16 copy), and what autocast keeps in float32 stays there: the residual
stream (the embedding's float32 output plus the bf16 projections), so the
RMSNorms, the softmax over float32 scores (bf16 scores plus the float32
mask) and the loss.
"""
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

VAL_EVERY = 20  # window i is validation when i % VAL_EVERY == 0


def kjv_text() -> bytes:
    if shutil.which("bible") is None:
        sys.exit("gpt_kjv: the `bible` program is missing; "
                 "apt-get install bible-kjv bible-kjv-text")
    out = subprocess.run(["bible", "Gen1:1-Rev22:21"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env={**os.environ,
                                                      "COLUMNS": "80"})
    if out.returncode != 0 or len(out.stdout) < 1 << 20:
        sys.exit(f"gpt_kjv: `bible Gen1:1-Rev22:21` failed ({out.returncode}, "
                 f"{len(out.stdout)} bytes): {out.stderr.decode()[:200]} "
                 "(apt-get install bible-kjv bible-kjv-text)")
    return out.stdout


def windows(text: bytes, seq_len: int):
    """(train, val) int64 tensors of shape (n, seq_len + 1): consecutive
    windows of the text, every VAL_EVERY-th one held out."""
    data = np.frombuffer(text, dtype=np.uint8)
    n = (len(data) - 1) // seq_len
    starts = np.arange(n) * seq_len
    w = torch.from_numpy(data[starts[:, None] + np.arange(seq_len + 1)]
                         .astype(np.int64))
    val = torch.arange(n) % VAL_EVERY == 0
    return w[~val].contiguous(), w[val].contiguous()


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) \
            * self.weight


def rotary_tables(seq_len: int, head_dim: int, base: float = 10000.0):
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len).float(), inv)  # (T, hd/2)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    """Rotary embedding of x (B, H, T, hd) by position, pairs (2i, 2i+1)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos),
                       dim=-1).flatten(-2)


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.mlp_norm = RMSNorm(dim)
        self.gate_up = torch.nn.Linear(dim, 2 * hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x, cos, sin, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in (q, k, v))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        att = (att + mask).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class GPT(torch.nn.Module):
    def __init__(self, seq_len: int, dim: int, layers: int, heads: int,
                 vocab: int = 256):
        super().__init__()
        hidden = 64 * math.ceil(dim * 8 / 3 / 64)  # SwiGLU's 2/3 of 4*dim
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(
            Block(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        cos, sin = rotary_tables(seq_len, dim // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer(  # additive: -inf above the diagonal
            "mask", torch.full((seq_len, seq_len), float("-inf")).triu(1),
            persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's init; residual outputs scaled down
                std = 0.02 / math.sqrt(2 * layers) \
                    if name.endswith(("proj.weight", "down.weight")) else 0.02
                torch.nn.init.normal_(p, std=std)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.embed(tokens)
        cos, sin, mask = self.cos[:t], self.sin[:t], self.mask[:t, :t]
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return F.linear(self.norm(x), self.embed.weight)  # tied output


def loss_of(model, w):
    logits = model(w[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                           w[:, 1:].reshape(-1))


def autocast(args):
    """The forward's precision: bf16 matmuls under torch.autocast, or off."""
    return torch.autocast("cpu", dtype=torch.bfloat16,
                          enabled=args.autocast == "bf16")


@torch.no_grad()
def validation_loss(model, val, args, batch=32):
    """(summed loss of the windows, windows) over val."""
    model.eval()
    with autocast(args):
        total = sum(float(loss_of(model, val[i:i + batch])) *
                    len(val[i:i + batch]) for i in range(0, len(val), batch))
    model.train()
    return total, len(val)


@torch.no_grad()
def generate(model, args, prompt: bytes) -> bytes:
    """--sample_bytes bytes after `prompt`, each drawn from the softmax of
    the logits over --temperature (0: the most likely byte), with a
    generator seeded by --seed: every evaluation draws the same random
    numbers, so the samples differ only by the model. The context is the
    last seq_len bytes."""
    model.eval()
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.tensor([list(prompt)], dtype=torch.int64)
    with autocast(args):
        for _ in range(args.sample_bytes):
            logits = model(tokens[:, -args.seq_len:])[0, -1].float()
            if args.temperature > 0:
                probs = (logits / args.temperature).softmax(-1)
                byte = torch.multinomial(probs, 1, generator=g)
            else:
                byte = logits.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, byte[None]], dim=1)
    model.train()
    return bytes(tokens[0, len(prompt):].tolist())


def arg_parser():
    p = common.parser(__doc__, epochs=10, batch_size=16, lr=2e-3,
                      max_grad_norm=1.0)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps_per_epoch", type=int, default=200,
                   help="global steps between evaluations (0: all windows)")
    p.add_argument("--val_windows", type=int, default=128)
    p.add_argument("--warmup_steps", type=int, default=20)
    p.add_argument("--min_lr_ratio", type=float, default=0.1,
                   help="the cosine's end, a fraction of --lr (1: constant)")
    p.add_argument("--weight_decay", type=float, default=0.1,
                   help="AdamW's, on tensors of 2 or more dims")
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--autocast", choices=("bf16", "off"), default="bf16")
    p.add_argument("--sample_bytes", type=int, default=80,
                   help="bytes generated after --sample_prompt at each "
                   "evaluation (the lead; 0: none)")
    p.add_argument("--sample_prompt", default="And God said",
                   help="the generated sample's start")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="the sample's softmax temperature (0: greedy)")
    return p


def build(args, train):
    """The recipe: model from --seed; AdamW with weight decay on the matrices
    only; linear warmup, then cosine down to --min_lr_ratio of --lr; the
    forward under autocast(args)."""
    torch.manual_seed(args.seed)
    model = GPT(args.seq_len, args.dim, args.layers, args.heads)
    full_epoch = len(train) // args.batch_size
    steps_per_epoch = min(args.steps_per_epoch or full_epoch, full_epoch)
    epoch_windows = steps_per_epoch * args.batch_size
    order = torch.randperm(len(train),
                           generator=torch.Generator().manual_seed(args.seed))
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, args.beta2), eps=1e-8)
    warmup, floor = args.warmup_steps, args.min_lr_ratio

    def lr_factor(s):
        if s < warmup:
            return (s + 1) / warmup
        frac = min((s - warmup) / max(total_steps - warmup, 1), 1.0)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    def loss(module, indices, epoch):
        with autocast(args):
            return loss_of(module, train[order[(epoch * epoch_windows +
                                                 indices) % len(train)]])

    return common.Recipe(model, optimizer, scheduler, epoch_windows,
                         args.seq_len, loss)


def main() -> int:
    args = arg_parser().parse_args()
    job = common.Job(args)
    train, val = windows(kjv_text(), args.seq_len)
    val = val[:args.val_windows]
    details = (f"dim {args.dim}, {args.layers} layers, {args.heads} heads, "
               f"{len(train)} train / {len(val)} validation windows of "
               f"{args.seq_len} bytes, autocast {args.autocast}, "
               f"{args.accum} backward pass(es) per step")
    prompt = args.sample_prompt.encode()
    if args.sample_bytes and not prompt:
        sys.exit("gpt_kjv: --sample_prompt is empty; give at least a byte, "
                 "or --sample_bytes=0")

    def sample(model) -> str:
        text = prompt + generate(model, args, prompt)
        return repr(text.decode("utf-8", errors="replace"))

    return common.train(job, args, build(args, train), "gpt_kjv", details,
                        lambda model, part: validation_loss(model, val[part],
                                                            args),
                        len(val), "val_loss", "tokens",
                        sample=sample if args.sample_bytes else None)


if __name__ == "__main__":
    sys.exit(main())
