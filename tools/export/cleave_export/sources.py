"""Resolve a SOURCE argument into a model and a way to make example inputs."""

from __future__ import annotations

import difflib
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from cleave_export import ExportError, huggingface, libraries

InputFactory = Callable[[int, "int | None"], tuple]


@dataclass
class ModelSource:
    """A model ready to export, with everything the exporter needs to feed it."""

    model: nn.Module
    """The model, in eval mode."""
    source: str
    """The SOURCE string it came from, recorded in the manifest."""
    make_inputs: InputFactory
    """Returns example inputs (a tuple of tensors) at a batch size and sequence length (None
    without a dynamic sequence), from torch's global RNG."""
    preprocess: dict | None
    """Image preprocessing the model expects (resize, crop, mean, std), when known."""
    input_names: list[str] | None = None
    """The forward arguments the inputs are passed as, by keyword; None: the first forward
    parameters, by position."""
    fixed_kwargs: dict = field(default_factory=dict)
    """Keyword arguments every call passes (a transformer's `use_cache=False`, ...)."""
    input_ranges: dict[str, list[int]] = field(default_factory=dict)
    """Inclusive value range of integer inputs (token ids below the vocabulary size)."""
    sequence: tuple[int, int] | None = None
    """The sequence lengths a text model takes when the user gives none."""
    tracer: str = "fx"
    """`fx` (torch.fx, falling back to torch.export) or `export` (torch.export only)."""

    def example_inputs(self, seed: int, batch: int, seq: int | None = None) -> tuple:
        """Example inputs at a batch size (and sequence length), the same ones for the same seed:
        the exporter validates with these and writes them as references, and the eager timing
        feeds them."""
        torch.manual_seed(seed * 7919 + batch + (seq or 0) * 104729)
        return self.make_inputs(batch, seq)

    def __call__(self, inputs: tuple):
        """The model run on `inputs`."""
        if self.input_names is None:
            return self.model(*inputs, **self.fixed_kwargs)
        return self.model(**dict(zip(self.input_names, inputs)), **self.fixed_kwargs)


def load_source(source: str, input_shape: tuple[int, ...] | None, seed: int, hf_config: dict | None = None) -> ModelSource:
    """Build the model named by `source` with a fixed seed (`torchvision:NAME`, `hf:CLASS`,
    `timm:NAME`, `ultralytics:CONFIG.yaml` or `module:callable`)."""
    torch.manual_seed(seed)
    if hf_config and not source.startswith("hf:"):
        raise ExportError("--hf-config applies to `hf:CLASS` sources only")
    if source.startswith("torchvision:"):
        model, preprocess, default_shape = _torchvision_model(source.split(":", 1)[1])
    elif source.startswith("hf:"):
        model, preprocess, default_shape = huggingface.build(source.split(":", 1)[1], hf_config or {}), None, None
    elif source.startswith("timm:"):
        model, preprocess, default_shape = libraries.timm_model(source.split(":", 1)[1], source)
    elif source.startswith("ultralytics:"):
        model, preprocess, default_shape = libraries.ultralytics_model(source.split(":", 1)[1], source)
    elif ":" in source:
        model, preprocess, default_shape = _callable_model(source), None, None
    else:
        raise ExportError(
            f"SOURCE {source!r} is none of `torchvision:NAME`, `hf:CLASS`, `timm:NAME`, `ultralytics:CONFIG.yaml` "
            "and `package.module:callable`"
        )
    if input_shape is not None and tuple(input_shape) != default_shape:
        preprocess = None  # a preset's resize and crop describe other inputs than these
    model.eval()
    for part in model.modules():  # the model itself, or a transformers model inside the user's
        if huggingface.is_transformers_model(part):
            huggingface.without_training_draws(part, source)
    if huggingface.is_transformers_model(model):
        if input_shape is None and _has_example_inputs(model):
            return _fed_by_its_example_inputs(model, source)
        return ModelSource(model=model, source=source, **huggingface.feeding(model, source, input_shape))
    return ModelSource(
        model=model,
        source=source,
        make_inputs=_input_factory(model, input_shape or default_shape, source),
        preprocess=preprocess,
    )


def _torchvision_model(name: str):
    import torchvision

    from cleave_export import detection

    available = torchvision.models.list_models()
    if name not in available:
        raise ExportError(f"torchvision has no model {name!r}; {_nearest(name, available)}")
    # weights=None and weights_backbone=None: random initialisation, nothing downloaded (the
    # segmentation and detection builders otherwise fetch an ImageNet backbone); the caller
    # fixes the seed.
    builder = torchvision.models.get_model_builder(name)
    kwargs = {"weights": None}
    if "weights_backbone" in inspect.signature(builder).parameters:
        kwargs["weights_backbone"] = None
    model = builder(**kwargs)
    if detection.is_detector(model):
        # One batch in, fixed shapes out, cut inside the backbone (detection.py). It normalises
        # and resizes itself: images in [0, 1], no preprocessing, its example inputs' size by default.
        return detection.BatchedDetector(model), None, None
    preprocess, shape = None, None
    try:
        weights = torchvision.models.get_model_weights(name).DEFAULT
        kw = getattr(weights.transforms, "keywords", {})
        crop = int(kw.get("crop_size", 224))
        preprocess = {
            "resize": int(kw.get("resize_size", 256)),
            "crop": crop,
            "mean": [0.485, 0.456, 0.406],
            "std": [0.229, 0.224, 0.225],
        }
        shape = (3, crop, crop)
    except Exception:  # models without published weights have no preset; the user passes --input-shape
        pass
    return model, preprocess, shape


def _nearest(name: str, available: list[str]) -> str:
    """The names in `available` nearest to `name` (ignoring case), or where to list them when none is near."""
    by_lower = {a.lower(): a for a in available}
    close = [by_lower[c] for c in difflib.get_close_matches(name.lower(), list(by_lower), n=5)]
    if close:
        return f"the nearest it has: {', '.join(close)}"
    return f"no name it has is near (torchvision.models.list_models() lists its {len(available)})"


def _callable_model(source: str) -> nn.Module:
    module_name, attr = source.rsplit(":", 1)
    try:
        module = importlib.import_module(module_name)
    except (ImportError, ValueError, TypeError) as e:  # ValueError, TypeError: empty or relative module name
        raise ExportError(f"cannot import {module_name!r} (from SOURCE {source!r}): {e}{_import_hint(source, e)}") from e
    factory = getattr(module, attr, None)
    if factory is None:
        raise ExportError(f"module {module_name!r} has no attribute {attr!r}")
    model = factory() if callable(factory) and not isinstance(factory, nn.Module) else factory
    if not isinstance(model, nn.Module):
        raise ExportError(
            f"{source} returned a {type(model).__name__}, expected a torch.nn.Module"
        )
    return model


def _import_hint(source: str, e: Exception) -> str:
    """What to try when the module of `source` itself (or its package) is not found; nothing when
    the module was found and failed inside (a dependency it imports is missing, say): that error says it."""
    module_name = source.rsplit(":", 1)[0]
    missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
    if not missing or not (module_name == missing or module_name.startswith(missing + ".")):
        return ""
    top = module_name.split(".")[0]
    return (
        f" (what to try: the module must be importable from the current directory or via PYTHONPATH: run from the "
        f"directory that holds {top}.py or {top}/, or name that directory in PYTHONPATH: PYTHONPATH=path/to/dir before the command)"
    )


def _has_example_inputs(model: nn.Module) -> bool:
    return callable(getattr(model, "example_inputs", None))


def _fed_by_its_example_inputs(model: nn.Module, source: str) -> ModelSource:
    """A transformers model that says what it takes (`example_inputs`): called with those
    inputs by the names of its first forward parameters, as the other transformers are."""
    make_inputs = _input_factory(model, None, source)
    count = len(make_inputs(1, None))
    names = [p.name for p in forward_parameters(model)[:count]]
    return ModelSource(
        model=model, source=source, make_inputs=make_inputs, preprocess=None, input_names=names,
        fixed_kwargs=huggingface.fixed_kwargs(model), tracer="export",
    )


def _input_factory(model: nn.Module, shape: tuple[int, ...] | None, source: str) -> InputFactory:
    # A model may describe its own inputs: `example_inputs(batch_size)` returning a tuple of
    # tensors (needed for several inputs or integer inputs), or `example_inputs(batch_size,
    # seq_len)` for a model exported with a dynamic sequence; or `input_shape` (one float input).
    if shape is None and _has_example_inputs(model):
        takes_seq = len(inspect.signature(model.example_inputs).parameters) >= 2

        def from_model(batch: int, seq: int | None) -> tuple:
            if seq is not None and not takes_seq:
                raise ExportError(
                    f"{source}: --dynamic-seq needs the model's example_inputs to take a sequence "
                    "length: example_inputs(batch_size, seq_len)"
                )
            inputs = model.example_inputs(batch, seq) if seq is not None else model.example_inputs(batch)
            inputs = inputs if isinstance(inputs, tuple) else (inputs,)
            for i, t in enumerate(inputs):
                if not isinstance(t, torch.Tensor):
                    raise ExportError(
                        f"{type(model).__name__}.example_inputs() item {i} is a {type(t).__name__}; a bundle's inputs are "
                        "tensors (an edge sends tensors); what to try: export a module around the model whose forward "
                        "takes the tensors and builds the rest (`def forward(self, x, m): return self.model({'x': x, 'm': m})`)"
                    )
            return inputs

        return from_model
    shape = shape or getattr(model, "input_shape", None)
    if shape is None:
        raise ExportError(
            f"cannot tell the input shape of {source}: pass --input-shape C,H,W (without the batch) "
            "or give the model an `input_shape` attribute or an `example_inputs(batch_size)` method"
        )
    shape = tuple(int(d) for d in shape)

    def random_image(batch: int, seq: int | None) -> tuple:
        if seq is not None:
            raise ExportError(f"{source}: --dynamic-seq needs a model with example_inputs(batch_size, seq_len)")
        return (torch.randn(batch, *shape),)

    return random_image


def forward_parameters(model: nn.Module) -> list[inspect.Parameter]:
    """The parameters of `model.forward`, in order."""
    return list(inspect.signature(model.forward).parameters.values())
