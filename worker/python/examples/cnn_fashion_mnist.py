#!/usr/bin/python3
"""A CNN on Fashion-MNIST, trained data-parallel through the shardps servers.

  shardps-local --servers=2 --workers=2 -- \\
      /usr/bin/python3 worker/python/examples/cnn_fashion_mnist.py
  /usr/bin/python3 worker/python/examples/cnn_fashion_mnist.py --plain

conv(1,32,5)-relu-maxpool-conv(32,64,5)-relu-maxpool-fc(1024,128)-relu-fc(10),
Adam with a cosine decay of the learning rate over the run; global batch 128.
Every rank evaluates its part of the test set after each epoch; the lead
prints one line per epoch (the accuracy over the whole set) and a final line.
--dtype=bf16 makes the parameters (and the images) bfloat16: the servers
keep float32 master weights and Adam state, the model their rounding
(--plain keeps the same float32 master in the process).
"""
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self, batchnorm=False):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 32, 5)
        self.conv2 = torch.nn.Conv2d(32, 64, 5)
        norm = torch.nn.BatchNorm2d if batchnorm else (
            lambda c: torch.nn.Identity())
        self.bn1, self.bn2 = norm(32), norm(64)
        self.fc1 = torch.nn.Linear(64 * 4 * 4, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)  # 32 x 12 x 12
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)  # 64 x 4 x 4
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@torch.no_grad()
def correct(model, x, y, batch=1000):
    """(correct predictions, samples) over x."""
    model.eval()
    dtype = model.fc2.weight.dtype
    right = sum(int((model(x[i:i + batch].to(dtype)).argmax(1) ==
                     y[i:i + batch]).sum())
                for i in range(0, len(x), batch))
    model.train()
    return right, len(x)


def arg_parser():
    p = common.parser(__doc__, epochs=10, batch_size=128, lr=2e-3)
    p.add_argument("--data", default=common.FASHION_MNIST)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="the parameters' dtype (float32 master weights on "
                   "the servers either way)")
    p.add_argument("--batchnorm", action="store_true",
                   help="BatchNorm after each convolution: its running "
                   "statistics follow the lead's (broadcast after every "
                   "step, as DDP's broadcast_buffers), so every rank "
                   "evaluates the same model")
    return p


def build(args, data):
    """The recipe: model from --seed, Adam, cosine decay over the run."""
    x, y, _, _ = data
    torch.manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    # bf16: the float32 initial weights rounded
    model = Net(args.batchnorm).to(dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    total_steps = len(x) // args.batch_size * args.epochs
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(
            math.pi * min(s, total_steps) / total_steps)))

    def loss(module, indices, epoch):
        return F.cross_entropy(module(x[indices].to(dtype)), y[indices])

    return common.Recipe(model, optimizer, scheduler, len(x), 1, loss)


def main() -> int:
    args = arg_parser().parse_args()
    job = common.Job(args)
    data = common.fashion_mnist(args.data)
    _, _, tx, ty = data
    return common.train(job, args, build(args, data), "cnn_fashion_mnist",
                        f"Adam with cosine decay, {args.dtype} parameters"
                        f"{', BatchNorm' if args.batchnorm else ''}",
                        lambda model, part: correct(model, tx[part], ty[part]),
                        len(tx), "test_accuracy", "samples")


if __name__ == "__main__":
    sys.exit(main())
