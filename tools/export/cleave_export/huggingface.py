"""Hugging Face transformers models: built from a config (random weights, nothing downloaded)
and fed token ids, pixels or audio (a waveform, or log-mel features) the way their `forward`
takes them, or the inputs of their own `example_inputs(batch_size)` where they define one.

`hf:CLASS` names a transformers model class (`GPT2LMHeadModel`, `BertForSequenceClassification`,
`LlamaForCausalLM`, `ViTForImageClassification`, ...); `--hf-config key=value,...` sets fields
of its config (small models for tests: `num_hidden_layers=2,hidden_size=64`). A
`package.module:callable` returning a `PreTrainedModel` is fed the same way.
"""

from __future__ import annotations

import inspect
import json
import logging
import os

import torch
from torch import nn

from cleave_export import ExportError, first_line

log = logging.getLogger(__name__)

# Building from a config needs no download; offline mode makes sure nothing tries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEFAULT_MAX_SEQ = 128
"""The longest sequence a text model's bundle takes unless `--dynamic-seq` says otherwise."""


def parse_config(text: str) -> dict:
    """`key=value,key=value` into a dict; values are JSON (numbers, true/false, null) or strings."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ExportError(f"--hf-config item {item!r} is not key=value")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


def is_transformers_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def build(class_name: str, overrides: dict) -> nn.Module:
    """A transformers model of class `class_name` from its default config with `overrides`."""
    import transformers

    cls = getattr(transformers, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ExportError(
            f"transformers has no model class {class_name!r}; "
            "name one such as GPT2LMHeadModel, BertForSequenceClassification, LlamaForCausalLM or ViTForImageClassification"
        )
    defaults = cls.config_class()
    for key, value in overrides.items():
        if not hasattr(defaults, key):
            raise ExportError(f"--hf-config {key}={value}: {cls.config_class.__name__} has no field {key!r}")
    try:
        # Given to the constructor, not set afterwards: it derives fields from them (Llama's
        # head_dim from hidden_size and the heads), which setting would leave at the defaults'.
        return cls(cls.config_class(**overrides))
    except Exception as e:  # an inconsistent config (hidden size not divisible by heads, ...)
        raise ExportError(f"{class_name} cannot be built from this config: {type(e).__name__}: {first_line(e)}") from e


def fixed_kwargs(model: nn.Module) -> dict:
    """The keyword arguments every call of a transformers model passes: no KV cache, a dict out."""
    params = inspect.signature(model.forward).parameters
    # Named parameters only: torch.export matches keyword arguments to them by name.
    return {k: v for k, v in (("use_cache", False), ("return_dict", True)) if k in params}


def feeding(model: nn.Module, source: str, input_shape: tuple[int, ...] | None) -> dict:
    """How to feed a transformers model (the `ModelSource` fields besides the model and source):
    its main input (token ids and an attention mask, pixels, a waveform or audio features),
    called by keyword, without a KV cache, returning its output as a dict."""
    config = model.config
    params = inspect.signature(model.forward).parameters
    fixed = fixed_kwargs(model)
    main = model.main_input_name
    if main == "input_ids":
        vocab = int(config.vocab_size)
        names = ["input_ids"] + (["attention_mask"] if "attention_mask" in params else [])
        longest = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)

        def tokens(batch: int, seq: int | None) -> tuple:
            seq = seq or (longest and min(longest, DEFAULT_MAX_SEQ)) or DEFAULT_MAX_SEQ
            ids = torch.randint(0, vocab, (batch, seq))
            # Right padding of random lengths, so that the mask's path is exercised.
            lengths = torch.randint(max(1, seq // 2), seq + 1, (batch,))
            mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
            return (ids, mask)[: len(names)]

        return {
            "make_inputs": tokens,
            "preprocess": None,
            "input_names": names,
            "fixed_kwargs": fixed,
            "input_ranges": {"input_ids": [0, vocab - 1], "attention_mask": [0, 1]},
            "sequence": (1, min(longest, DEFAULT_MAX_SEQ) if longest else DEFAULT_MAX_SEQ),
            "tracer": "export",
        }
    if main == "pixel_values":
        size = getattr(config, "image_size", 224)
        size = size if isinstance(size, (list, tuple)) else (size, size)
        shape = tuple(input_shape) if input_shape else (getattr(config, "num_channels", 3), *size)

        def pixels(batch: int, seq: int | None) -> tuple:
            if seq is not None:
                raise ExportError(f"{source} takes images; --dynamic-seq is for models that take token ids")
            return (torch.randn(batch, *shape),)

        return {"make_inputs": pixels, "preprocess": None, "input_names": ["pixel_values"], "fixed_kwargs": fixed, "tracer": "export"}
    if main in ("input_values", "input_features"):
        shape = tuple(input_shape) if input_shape else _audio_shape(model, main, source)
        lattice = waveform_lattice(model) if main == "input_values" else None

        def audio(batch: int, seq: int | None) -> tuple:
            if seq is None:
                return (torch.randn(batch, *shape),)
            if lattice is None:
                raise ExportError(
                    f"{source} takes {main} of one length only (Whisper's encoder: exactly 2 x max_source_positions frames); "
                    f"what to try: set the length with --input-shape instead of --dynamic-seq"
                )
            per_frame, plus = lattice
            return (torch.randn(batch, per_frame * seq + plus),)

        return {"make_inputs": audio, "preprocess": None, "input_names": [main], "fixed_kwargs": fixed, "tracer": "export"}
    raise ExportError(
        f"{source}: cannot feed a transformers model whose main input is {main!r} (token ids, pixels, "
        "input_values or input_features only); what to try: give the model an example_inputs(batch_size) method"
    )


def waveform_lattice(model: nn.Module) -> tuple[int, int] | None:
    """(k, c) such that a waveform of k*S+c samples makes exactly S frames, from the model's
    own count of frames (wav2vec2, HuBERT, WavLM ...: a stack of strided convolutions, whose
    first frame takes c + k samples and each further frame k more); None for a model without it.

    With `--dynamic-seq MIN MAX`, S counts frames and every length inside the model is then a
    line in S (`k*S+c`), which a bundle's specs can say; other lengths make frames of partial
    strides, lengths no line gives."""
    count_frames = getattr(model, "_get_feat_extract_output_lengths", None)
    if count_frames is None:
        return None

    def frames(samples: int) -> int:
        return int(count_frames(torch.tensor(samples)))

    first = next((t for t in range(1, _MAX_RECEPTIVE_FIELD) if frames(t) >= 1), None)
    per_frame = first and next((k for k in range(1, _MAX_RECEPTIVE_FIELD) if frames(first + k) >= 2), None)
    if not per_frame or any(frames(per_frame * s + first - per_frame) != s for s in (1, 2, 3, 17, 100)):
        return None
    return per_frame, first - per_frame


_MAX_RECEPTIVE_FIELD = 1 << 16
"""Samples searched for a waveform model's first frame and stride (wav2vec2: 400 and 320)."""


DEFAULT_WAVEFORM_SAMPLES = 16000
"""A waveform model's example input: one second at 16 kHz."""


def _audio_shape(model: nn.Module, main: str, source: str) -> tuple[int, ...]:
    """The shape (without the batch) of a float audio input: a waveform `[T]`, or log-mel
    features `[mels, frames]` as Whisper takes them (its encoder needs exactly
    2 x max_source_positions frames)."""
    config = model.config
    if main == "input_values":
        return (DEFAULT_WAVEFORM_SAMPLES,)
    mels, positions = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    if mels and positions:
        return (int(mels), 2 * int(positions))
    raise ExportError(
        f"cannot tell the shape of {source}'s input_features: pass --input-shape (without the batch), "
        "or give the model an example_inputs(batch_size) method"
    )


_DRAWN_IN_TRAINING = {"apply_spec_augment": False, "layerdrop": 0.0, "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0}
"""Config fields that make a training forward draw in Python (SpecAugment's masks, LayerDrop's
skipped layers), which no traced graph can hold: the exporter records the model in training
mode (for its dropouts), so these are turned off, and the model trains without them."""


def without_training_draws(model: nn.Module, source: str) -> None:
    """Turns off (and says so) the config fields of `_DRAWN_IN_TRAINING` that are on, and the
    `layerdrop` that modules copied from them when built (Whisper's and BART's encoders)."""
    config = model.config
    for key, off in _DRAWN_IN_TRAINING.items():
        if getattr(config, key, off) not in (off, None):
            log.warning("%s: %s=%s turned off (%s): a split model cannot draw it", source, key, getattr(config, key), off)
            setattr(config, key, off)
    for path, module in model.named_modules():
        if isinstance(getattr(module, "layerdrop", None), float) and module.layerdrop > 0:
            log.warning("%s: %s.layerdrop=%s turned off (0.0): a split model cannot draw it", source, path or "model", module.layerdrop)
            module.layerdrop = 0.0
