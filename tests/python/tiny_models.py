"""Tiny models and deterministic data for the Python tests: a CNN (two
conv layers, two linear, and a parameter no step uses), the example's
LLaMA-style GPT (worker/python/examples/gpt_kjv.py: RMSNorm, rotary
embeddings, SwiGLU, tied embeddings) at a tiny size, so that 20 steps take
a second, and an MLP whose parameters are float32, bfloat16 and float16."""

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

IMAGE = 12
FEATURES = 12
VOCAB = 32
CONTEXT = 16


class TinyCnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.conv2 = nn.Conv2d(4, 8, 3)
        self.fc1 = nn.Linear(8 * 1 * 1 * 4, 16)
        self.fc2 = nn.Linear(16, 10)
        # Never used in forward: no gradient on any rank.
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)   # 12 -> 10 -> 5
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)   # 5 -> 3 -> 1
        x = F.relu(self.fc1(x.flatten(1).repeat(1, 4)))
        return self.fc2(x)


class MixedMlp(nn.Module):
    """A float32 layer, a bfloat16 one and a float16 output scale (used
    elementwise only: torch 1.13 has no float16 matmul on the CPU)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 16)
        self.fc2 = nn.Linear(16, 10).to(torch.bfloat16)
        self.scale = nn.Parameter(torch.ones(10, dtype=torch.float16))

    def forward(self, x):
        h = F.relu(self.fc1(x)).to(torch.bfloat16)
        return self.fc2(h).float() * self.scale.float()


def make(kind):
    if kind == "cnn":
        return TinyCnn()
    if kind == "mixed":
        return MixedMlp()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))), "worker", "python",
        "examples"))
    import gpt_kjv
    return gpt_kjv.GPT(seq_len=CONTEXT, dim=32, layers=2, heads=2, vocab=VOCAB)


def data(kind, n):
    g = torch.Generator().manual_seed(99)
    if kind == "mixed":
        x = torch.randn(n, FEATURES, generator=g)
        y = torch.randint(0, 10, (n,), generator=g)
        return x, y
    if kind == "cnn":
        x = torch.randn(n, 1, IMAGE, IMAGE, generator=g)
        y = torch.randint(0, 10, (n,), generator=g)
        return x, y
    tokens = torch.randint(0, VOCAB, (n, CONTEXT + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
