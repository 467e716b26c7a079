"""Small models that ship with cleave (no downloads needed)."""

import torch
from torch import nn

from cleave_export.digits import digits_split


class DigitsCNN(nn.Module):
    """A small CNN for scikit-learn's 8x8 digits (input [B, 1, 8, 8], 10 classes)."""

    input_shape = (1, 8, 8)

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 64),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def digits_cnn() -> nn.Module:
    """The digits CNN, randomly initialised (the caller fixes the seed)."""
    return DigitsCNN()


def digits_cnn_without_dropout() -> nn.Module:
    """The digits CNN with an identity where its dropout was (the cuts keep their names): its
    training draws nothing at random, so runs on different devices compare step by step (CUDA
    and the CPU draw different dropout masks from the same seed)."""
    model = DigitsCNN()
    model.classifier[3] = nn.Identity()
    return model


def train_digits_cnn(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int = 40,
    batch_size: int = 64,
    lr: float = 3e-3,
    weight_decay: float = 1e-4,
    seed: int = 0,
) -> list[float]:
    """Trains `model` in place on (x, y) with Adam and a cosine learning-rate schedule; returns the
    mean training loss of each epoch. Shuffling uses a generator of its own seeded with `seed`;
    dropout draws from torch's global RNG, so the caller fixes that (see `digits_cnn_trained`)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    steps_per_epoch = -(-len(x) // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=lr, epochs=epochs, steps_per_epoch=steps_per_epoch, pct_start=0.2
    )
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=g)
        total = 0.0
        for i in range(0, len(x), batch_size):
            rows = order[i : i + batch_size]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[rows]), y[rows])
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(rows)
        losses.append(total / len(x))
    model.eval()
    return losses


def digits_cnn_trained(seed: int = 0, split_seed: int = 0) -> nn.Module:
    """The digits CNN trained to convergence on the train split of
    `cleave_export.digits.digits_split(split_seed)` (about 98-99% test accuracy), in eval mode.

    Reproducible: fixed seeds, one CPU thread and deterministic algorithms while it trains, so
    two calls give bit-identical parameters (on the same machine and torch build). The global
    RNG state, thread count and determinism setting are restored afterwards, so calling it
    leaves torch's global state as it was (the exporter draws its reference inputs from it).
    Takes a few seconds on one core.
    """
    x_train, y_train, _, _ = digits_split(split_seed)
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = DigitsCNN()
            train_digits_cnn(model, x_train, y_train, seed=seed)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    return model.eval()
