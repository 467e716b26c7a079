"""cleave_export: turn a PyTorch model into a cleave bundle.

A bundle is a chain of TorchScript stages cut at module boundaries so that every cut
between two stages is a valid split point, plus `manifest.json` (what crosses each cut,
what each stage costs, hashes of every file) and reference input/output pairs that let
the Rust runtime check itself without Python.

Modules:
    sources      resolve a SOURCE argument into a model and example inputs
    huggingface  transformers models built from a config, and how to feed them
    libraries    timm and ultralytics (YOLO) models, optional extras installed by `make extras`
    detection    torchvision detectors as one batch in, fixed-shape padded detections out,
                 their data-dependent part kept whole in the last stage
    tracing      trace the model with torch.fx, recording the module path of every node
    exported     trace it with torch.export where torch.fx cannot (transformers, ...)
    specs        value specs (dtype, symbolic shape with B and S) and TorchScript types of live values
    partition    group nodes into stages and compute the live set at every cut
    bundle       compile, validate and write the bundle
    zoo          small built-in models (the digits CNN)
    digits       sklearn's 8x8 digits and their fixed train/test split (the zoo trains on them)
    datasets     write a dataset split as safetensors for the host (`python -m cleave_export.datasets`)
"""

__version__ = "0.1.0"
FORMAT_VERSION = 1


class ExportError(Exception):
    """A model (or an argument) that cannot be exported; the message says which part and why."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type when it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
