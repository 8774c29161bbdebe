"""The training jobs the benchmark runs: the byte-level GPT of ``examples/gpt.py``, a small CNN on synthetic
images, and the Fashion-MNIST MLP of Ray Train's own example on synthetic 28x28 images (``mlp:fmnist``: ~10 ms
steps, where a checkpointer's per-step fixed cost shows). A job is a pure description (:class:`JobSpec`, JSON-friendly) plus :func:`build`, which makes the model,
the deterministic batches and the loss in a training process.

Batches depend only on ``(seed, step, rank)``, so every configuration trains on exactly the same data.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class JobSpec:
    """One training job. ``kind`` is ``"gpt"``, ``"cnn"`` or ``"mlp"``; ``size`` a GPT preset, a CNN width name or
    ``"fmnist"`` (the MLP)."""

    kind: str
    size: str
    batch: int            #: per data-parallel rank
    lr: float = 3e-4

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.size}"

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------------------------------
# small CNN (BatchNorm included: its running statistics are state the optimizer does not rebuild)
# ------------------------------------------------------------------------------------------------------------
CNN_WIDTHS = {"tiny": 16, "small": 32, "base": 64}


class SmallCNN(nn.Module):
    """conv-bn-relu x 3 stages (two convs each, stride-2 between stages), global pool, linear head."""

    def __init__(self, width: int = 32, classes: int = 10, channels: int = 3):
        super().__init__()
        layers, c_in = [], channels
        for i, c in enumerate((width, 2 * width, 4 * width)):
            for j in range(2):
                stride = 2 if (j == 0 and i > 0) else 1
                layers += [nn.Conv2d(c_in, c, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(c),
                           nn.ReLU(inplace=True)]
                c_in = c
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


class SyntheticImages:
    """Deterministic synthetic 32x32 RGB images: a class-dependent pattern plus noise, so the loss falls."""

    def __init__(self, batch: int, classes: int = 10, size: int = 32, seed: int = 0, channels: int = 3):
        self.batch, self.classes, self.size, self.seed, self.channels = batch, classes, size, seed, channels
        g = torch.Generator().manual_seed(seed + 12345)
        self.templates = torch.randn(classes, channels, size, size, generator=g)

    def get(self, step: int, rank: int = 0):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + rank)
        y = torch.randint(0, self.classes, (self.batch,), generator=g)
        x = 0.5 * self.templates[y] + torch.randn(self.batch, self.channels, self.size, self.size, generator=g)
        return x, y


# ------------------------------------------------------------------------------------------------------------
# Fashion-MNIST MLP (the network of Ray Train's PyTorch quickstart: 784-512-512-10, ReLU, dropout 0.25; trained
# there with SGD lr 1e-3 momentum 0.9). Dropout makes the step draw from the RNG, as real jobs do.
# ------------------------------------------------------------------------------------------------------------
MLP_SIZES = {"fmnist": 512}


class FashionMLP(nn.Module):
    def __init__(self, hidden: int = 512, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, hidden), nn.ReLU(), nn.Dropout(0.25),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(0.25), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


# ------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=2)
def _corpus():
    from examples.gpt import stdlib_corpus
    return stdlib_corpus(4 << 20)


@dataclass
class Job:
    spec: JobSpec
    model: nn.Module
    batches: object
    loss_fn: object

    def batch(self, step: int, rank: int, device):
        x, y = self.batches.get(step, rank)
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def loss(self, model, x, y):
        return self.loss_fn(model, x, y)

    def train_step(self, net, opt, sched, step: int, rank: int, device):
        """One training step on ``step``'s batch of ``rank`` through ``net`` (the model, or its DDP or FSDP2
        wrapper): forward, backward, ``opt.step()``, ``sched.step()``; the loss. Training thread of a rank."""
        x, y = self.batch(step, rank, device)
        loss = self.loss(net, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        return loss


def _gpt_loss(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _cnn_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def build_model(spec: JobSpec, device, seed: int = 0) -> nn.Module:
    """The model of ``spec`` on ``device``, seeded (identical on every rank for the same seed)."""
    torch.manual_seed(seed)
    if spec.kind == "gpt":
        from examples.gpt import GPT, GPTConfig
        model = GPT(GPTConfig.preset(spec.size))
    elif spec.kind == "cnn":
        try:
            width = CNN_WIDTHS[spec.size]
        except KeyError:
            raise ValueError(f"unknown CNN size {spec.size!r}; choose from {sorted(CNN_WIDTHS)}") from None
        model = SmallCNN(width)
    elif spec.kind == "mlp":
        try:
            model = FashionMLP(MLP_SIZES[spec.size])
        except KeyError:
            raise ValueError(f"unknown MLP size {spec.size!r}; choose from {sorted(MLP_SIZES)}") from None
    else:
        raise ValueError(f"unknown job kind {spec.kind!r} (gpt | cnn | mlp)")
    return model.to(device)


def preload(spec: JobSpec) -> None:
    """Load what building ``spec`` reads from disk (the corpus), so that forked processes share it."""
    if spec.kind == "gpt":
        _corpus()


def build(spec: JobSpec, device, seed: int = 0) -> Job:
    """Model, deterministic batches and loss of ``spec``."""
    model = build_model(spec, device, seed)
    if spec.kind == "gpt":
        from examples.gpt import ByteBatches
        batches = ByteBatches(_corpus(), model.config.seq, spec.batch, seed=seed)
        loss = _gpt_loss
    elif spec.kind == "mlp":
        batches = SyntheticImages(spec.batch, size=28, channels=1, seed=seed)
        loss = _cnn_loss
    else:
        batches = SyntheticImages(spec.batch, seed=seed)
        loss = _cnn_loss
    return Job(spec, model, batches, loss)


def make_optimizer(model: nn.Module, lr: float, kind: str = "gpt") -> torch.optim.Optimizer:
    """AdamW, as in the seed papers' GPT runs (weight decay 0.1, betas 0.9/0.95); SGD with momentum 0.9 for the
    MLP, as in Ray Train's Fashion-MNIST example."""
    if kind == "mlp":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))


def make_scheduler(optimizer, total: int):
    from examples.gpt import warmup_cosine
    return warmup_cosine(optimizer, warmup=max(1, total // 10), total=total)


def full_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors of a full checkpoint: model state_dict + optimizer state (AdamW: step, m, v)."""
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for st in optimizer.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return n
