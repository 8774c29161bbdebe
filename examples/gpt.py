"""A byte-level GPT-style language model and a text corpus every machine has offline: the Python standard
library's own source files. Shared by the examples, the demo and the benchmarks.

Data is deterministic: batch ``i`` of rank ``r`` depends only on ``(seed, i, r)``, so a resumed run sees exactly
the batches the uninterrupted run would have seen (the data position is just the step number).
"""
from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 128
    d: int = 256
    layers: int = 4
    heads: int = 4
    dropout: float = 0.0

    @classmethod
    def preset(cls, name: str) -> "GPTConfig":
        """``tiny`` (~0.2M params, tests), ``small`` (~3.3M), ``10m`` (~10.9M), ``25m`` (~25.6M), ``40m``
        (~38M), ``100m`` (~99M: the benchmarks' scaling rows)."""
        presets = {"tiny": cls(seq=32, d=64, layers=2, heads=2), "small": cls(seq=128, d=256, layers=4, heads=4),
                   "10m": cls(seq=256, d=384, layers=6, heads=6), "25m": cls(seq=256, d=512, layers=8, heads=8),
                   "40m": cls(seq=256, d=512, layers=12, heads=8), "100m": cls(seq=256, d=768, layers=14, heads=12)}
        try:
            return presets[name]
        except KeyError:
            raise ValueError(f"unknown model size {name!r}; choose from {sorted(presets)}") from None


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d)
        self.qkv = nn.Linear(c.d, 3 * c.d)
        self.proj = nn.Linear(c.d, c.d)
        self.ln2 = nn.LayerNorm(c.d)
        self.mlp = nn.Sequential(nn.Linear(c.d, 4 * c.d), nn.GELU(), nn.Linear(4 * c.d, c.d))
        self.heads = c.heads
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.d)
        self.pos = nn.Embedding(c.seq, c.d)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.d)
        self.head = nn.Linear(c.d, c.vocab, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))

    def loss(self, x, y):
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def stdlib_corpus(max_bytes: int = 8 << 20) -> np.ndarray:
    """Bytes of the Python standard library's ``.py`` files (sorted, deterministic), as uint8."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__"))
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                with open(os.path.join(dirpath, fn), "rb") as f:
                    data = f.read()
                chunks.append(data)
                total += len(data)
                if total >= max_bytes:
                    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


class ByteBatches:
    """Deterministic random windows of a corpus; 10% at the end held out for evaluation."""

    def __init__(self, corpus: np.ndarray, seq: int, batch: int, seed: int = 0):
        self.data = torch.from_numpy(corpus.astype(np.int64))
        cut = int(len(self.data) * 0.9)
        self.train, self.heldout = self.data[:cut], self.data[cut:]
        self.seq, self.batch, self.seed = seq, batch, seed

    def get(self, step: int, rank: int = 0, split: str = "train"):
        src = self.train if split == "train" else self.heldout
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + rank)
        starts = torch.randint(0, len(src) - self.seq - 1, (self.batch,), generator=g)
        win = torch.stack([src[s:s + self.seq + 1] for s in starts.tolist()])
        return win[:, :-1], win[:, 1:]

    @torch.no_grad()
    def heldout_loss(self, model: GPT, batches: int = 8) -> float:
        was = model.training
        model.eval()
        dev = next(model.parameters()).device
        losses = [float(model.loss(*(t.to(dev) for t in self.get(i, split="heldout")))) for i in range(batches)]
        model.train(was)
        return sum(losses) / len(losses)


def warmup_cosine(optimizer, warmup: int, total: int, floor: float = 0.1):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        p = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, f)
