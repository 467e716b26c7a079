"""Small models that ship with cleave (no downloads needed)."""

import torch
from torch import nn


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
