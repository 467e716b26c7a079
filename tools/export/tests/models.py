"""Models defined for the tests: export them as `tests.models:NAME` from tools/export."""

import typing

import numpy as np
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


class ImageAndMetadata(nn.Module):
    """An image and a metadata vector, each through its own branch; the metadata branch is
    called `meta`, a name `torch.fx.GraphModule` uses itself (`gm.meta`)."""

    def __init__(self):
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.meta = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, image: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.image(image), self.meta(meta)], dim=1))

    def example_inputs(self, batch_size: int) -> tuple:
        return (torch.randn(batch_size, 3, 16, 16), torch.randn(batch_size, 4))


class Pair(typing.NamedTuple):
    scaled: torch.Tensor
    shifted: torch.Tensor


class BranchToPair(nn.Module):
    """Data-dependent control flow (kept whole) returning a named tuple."""

    def forward(self, x: torch.Tensor) -> Pair:
        if x.sum() > 0:
            return Pair(x * 2, x + 1)
        return Pair(x, x - 1)


class ReadsFieldsOfAnOutput(nn.Module):
    """A module kept whole whose named-tuple output is read by attribute (`out.scaled`)."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.branch = BranchToPair()
        self.post = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.branch(self.pre(x))
        return self.post(out.scaled * out.shifted)

    def example_inputs(self, batch_size: int) -> tuple:
        return (torch.randn(batch_size, 4),)


class ToList(nn.Module):
    """Data-dependent control flow (kept whole) returning a list."""

    def forward(self, x: torch.Tensor):
        if x.sum() > 0:
            return [x * 2, x + 1]
        return [x, x]


class SumThroughNumpy(nn.Module):
    """Takes a list and goes through numpy: neither scriptable nor traceable with a list input."""

    def forward(self, xs):
        return sum(torch.from_numpy(np.asarray(t.detach())) for t in xs)


class ListIntoUnscriptable(nn.Module):
    """A list crosses the cut into a module TorchScript can neither script nor trace."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.lists = ToList()
        self.combine = SumThroughNumpy()
        self.post = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.combine(self.lists(self.pre(x))))

    def example_inputs(self, batch_size: int) -> tuple:
        return (torch.randn(batch_size, 4),)


class SplitInHalves(nn.Module):
    """Returns a list (torch.fx cannot iterate what it traces, so this is kept whole; scriptable)."""

    def forward(self, x: torch.Tensor):
        return list(torch.chunk(x, 2, dim=1))


class SumOfDoubles(nn.Module):
    """Takes a list; a generator expression, which TorchScript cannot compile but a trace follows."""

    def forward(self, xs):
        return sum(t * 2 for t in xs)


class ListIntoTraceable(nn.Module):
    """A list between two modules kept whole, the second of which can only be traced: the cut
    between them moves before the first."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.halves = SplitInHalves()
        self.combine = SumOfDoubles()
        self.post = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.combine(self.halves(self.pre(x))))

    def example_inputs(self, batch_size: int) -> tuple:
        return (torch.randn(batch_size, 4),)


class UnpacksWithInplaceDropout(nn.Module):
    """Loops over a tensor's chunks (torch.fx cannot; torch.export can) and drops out in place,
    as ultralytics' classification head does."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.25, inplace=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        halves = [h * (i + 1) for i, h in enumerate(torch.chunk(self.linear(x), 2, dim=1))]
        return self.head(self.drop(halves[0] + halves[1]))

    def example_inputs(self, batch_size: int) -> tuple:
        return (torch.randn(batch_size, 4),)


class TakesADict(nn.Module):
    """Its input is a dict of tensors, which no edge can send as such."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.linear(batch["x"])

    def example_inputs(self, batch_size: int) -> tuple:
        return ({"x": torch.randn(batch_size, 4)},)


class BranchesInItsOwnForward(nn.Module):
    """Data-dependent control flow in the model's own forward: no module to keep whole."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.linear(x)
        return self.linear(-x)

    def example_inputs(self, batch_size: int) -> tuple:
        return (torch.randn(batch_size, 4),)


class ScaleByNumpy(nn.Module):
    """Reads its input's size through numpy: TorchScript cannot script it, and a trace keeps the
    size of the example as a constant."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return torch.from_numpy(np.asarray(x.detach())) * 2
        return x


class ThroughNumpy(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = ScaleByNumpy()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.scale(x))

    def example_inputs(self, batch_size: int) -> tuple:
        return (torch.randn(batch_size, 4),)


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


def image_and_metadata():
    return ImageAndMetadata()


def _tiny_wav2vec2_config():
    from transformers import Wav2Vec2Config

    return Wav2Vec2Config(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_labels=3, vocab_size=20,
        conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_feat_extract_layers=3,
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
    )


def tiny_wav2vec2():
    """A waveform classifier (`input_values` [B, T]); fed one second at 16 kHz by default."""
    from transformers import Wav2Vec2ForSequenceClassification

    return Wav2Vec2ForSequenceClassification(_tiny_wav2vec2_config())


def tiny_whisper_encoder():
    """Whisper's encoder with a classification head (`input_features` [B, mels, frames]), 16
    mel bins and 2 x 32 frames."""
    from transformers import WhisperConfig, WhisperForAudioClassification

    config = WhisperConfig(
        encoder_layers=2, decoder_layers=1, d_model=32, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=32, num_labels=3,
        vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )
    return WhisperForAudioClassification(config)


def wav2vec2_with_its_own_inputs():
    """A transformers model that says what it takes: 800 samples (50 ms), not the default second."""
    from transformers import Wav2Vec2ForSequenceClassification

    class ShortClips(Wav2Vec2ForSequenceClassification):
        def example_inputs(self, batch_size: int) -> tuple:
            return (torch.randn(batch_size, 800),)

    return ShortClips(_tiny_wav2vec2_config())


class WrappedGPT2(nn.Module):
    """A user's module around a transformers model, returning one field of its output."""

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=3, n_embd=32, n_head=4, n_inner=64, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0)
        self.inner = GPT2LMHeadModel(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=ids, use_cache=False).logits

    def example_inputs(self, batch_size: int, seq_len: int = 16) -> tuple:
        return (torch.randint(0, 100, (batch_size, seq_len)),)


def wrapped_gpt2():
    return WrappedGPT2()


def reads_fields_of_an_output():
    return ReadsFieldsOfAnOutput()


def list_into_unscriptable():
    return ListIntoUnscriptable()


def takes_a_dict():
    return TakesADict()


def branches_in_its_own_forward():
    return BranchesInItsOwnForward()


def through_numpy():
    return ThroughNumpy()


def list_into_traceable():
    return ListIntoTraceable()


def unpacks_with_inplace_dropout():
    return UnpacksWithInplaceDropout()


class WrappedGPT2WithMeta(WrappedGPT2):
    """The GPT-2 wrapper with a submodule named `meta`, which torch.export cannot rebuild."""

    def __init__(self):
        super().__init__()
        self.meta = nn.Linear(100, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.meta(self.inner(input_ids=ids, use_cache=False).logits)


def wrapped_gpt2_with_meta():
    return WrappedGPT2WithMeta()


class RowsWhateverTheBatch(nn.Module):
    """Its example_inputs give at least two rows, whatever batch size they are asked for."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)

    def example_inputs(self, batch_size: int) -> tuple:
        return (torch.randn(max(batch_size, 2), 4),)


def rows_whatever_the_batch():
    return RowsWhateverTheBatch()
