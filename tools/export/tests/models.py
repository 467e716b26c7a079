"""Models defined for the tests: export them as `tests.models:NAME` from tools/export."""

import torch
from torch import nn


class ClampIfLarge(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace into it, so the exporter keeps it whole."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().max() > 1e3:
            return x.clamp(-1e3, 1e3)
        return x


class TinyTransformer(nn.Module):
    """Two inputs (token ids and a padding mask) and a dict output (logits and hidden states)."""

    vocab, seq, dim, classes = 50, 12, 32, 5

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(self.vocab, self.dim)
        self.pos = nn.Parameter(torch.randn(1, self.seq, self.dim) * 0.02)
        self.encoder = nn.ModuleList(
            nn.TransformerEncoderLayer(self.dim, 4, 64, dropout=0.1, batch_first=True) for _ in range(2)
        )
        self.guard = ClampIfLarge()
        self.norm = nn.LayerNorm(self.dim)
        self.head = nn.Linear(self.dim, self.classes)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor):
        x = self.embed(tokens) + self.pos[:, : tokens.size(1)]
        for layer in self.encoder:
            x = layer(x, src_key_padding_mask=mask)
        x = self.norm(self.guard(x))
        keep = (~mask).unsqueeze(-1).to(x.dtype)
        pooled = (x * keep).sum(1) / keep.sum(1).clamp(min=1)
        return {"logits": self.head(pooled), "hidden": x}

    def example_inputs(self, batch: int):
        tokens = torch.randint(0, self.vocab, (batch, self.seq))
        lengths = torch.randint(4, self.seq + 1, (batch,))
        mask = torch.arange(self.seq)[None, :] >= lengths[:, None]
        return tokens, mask


class TinyResidual(nn.Module):
    """A residual block small enough for fast tests of multi-tensor cuts."""

    input_shape = (4, 6, 6)

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        y = self.conv2(torch.relu(self.bn(self.conv1(x))))
        return self.head(torch.flatten(torch.relu(x + y), 1))


class BnDropoutResidual(nn.Module):
    """Batch norm, dropout and a residual connection, small enough for fast split-training tests:
    at op granularity the cuts inside the block carry two tensors (the branch and the skip)."""

    input_shape = (4, 6, 6)

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop1 = nn.Dropout(0.3)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.drop2 = nn.Dropout(0.2)
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        y = self.conv2(self.drop1(torch.relu(self.bn(self.conv1(x)))))
        return self.head(self.drop2(torch.flatten(torch.relu(x + y), 1)))


class BatchBaked(nn.Module):
    """Bakes the example batch size into a reshape: exported at one batch, wrong at another."""

    input_shape = (4,)

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x).reshape(3, 2)


@torch.fx.wrap
def _rows_unscriptable(x, **_options):
    # TorchScript takes no **kwargs, so the stage holding this call is traced, and the trace
    # keeps the example's batch size as a constant.
    return x.reshape(int(x.shape[0]), -1)


class TracedNotScripted(nn.Module):
    """A stage that cannot be scripted and whose trace is right at one batch size only."""

    input_shape = (3,)

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(_rows_unscriptable(x))


class DataDependentMiddle(nn.Module):
    """Holds a tensor whose size depends on the data (the positive activations) between two
    operations: the cuts around it cannot be split at."""

    input_shape = (4,)

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x):
        y = self.fc1(x)
        positive = y[y > 0]
        return self.fc2(y) + positive.sum()


def data_dependent_middle():
    return DataDependentMiddle()


def traced_not_scripted():
    return TracedNotScripted()


def tiny_transformer():
    return TinyTransformer()


def tiny_residual():
    return TinyResidual()


def bn_dropout_residual():
    return BnDropoutResidual()


def batch_baked():
    return BatchBaked()


def not_a_module():
    return 42
