"""How close two values are: the one measure every validation of the exporter uses."""

from __future__ import annotations

import math

import torch

from cleave_export.specs import flatten_tensors

TOLERANCE = 1e-5
"""Largest allowed |chain - model| relative to the largest |model output|."""


def relative_error(got, want) -> float:
    """The largest absolute difference over the largest magnitude of `want`, worst over the
    tensors of two value trees; infinite when their structure, shapes, dtypes or integers
    differ, or when infinities and NaNs are not at the same places."""
    got_t, want_t = flatten_tensors("", got), flatten_tensors("", want)
    if [k for k, _ in got_t] != [k for k, _ in want_t]:
        return float("inf")
    worst = 0.0
    for (_, g), (_, w) in zip(got_t, want_t):
        if g.shape != w.shape or g.dtype != w.dtype:
            return float("inf")
        if not w.is_floating_point():
            if not torch.equal(g, w):
                return float("inf")
            continue
        if not w.numel():
            continue
        if w.element_size() < 4:
            g, w = g.float(), w.float()
        # In the tensors' own precision: the difference of two close floats is exact enough,
        # and a float64 copy of a language model's logits costs seconds.
        diff = max_abs(g - w)
        if not math.isfinite(diff):
            # Infinities and NaNs must sit at the same places with the same values; the rest
            # is compared as usual.
            finite = w.isfinite()
            if bool(finite.all()) or not torch.equal(g.isfinite(), finite):
                return float("inf")
            if not torch.equal(g[~finite].nan_to_num(), w[~finite].nan_to_num()):
                return float("inf")
            g, w = g[finite], w[finite]
            diff = max_abs(g - w)
        worst = max(worst, diff / max(max_abs(w), 1e-12))
    return worst


def absolute_error(got, want) -> float:
    """The largest absolute difference between the floating-point tensors of two value trees of
    the same structure (finite values only); for reports, next to `relative_error`."""
    worst = 0.0
    for (_, g), (_, w) in zip(flatten_tensors("", got), flatten_tensors("", want)):
        if w.is_floating_point() and g.shape == w.shape and w.numel():
            finite = w.isfinite() & g.isfinite()
            worst = max(worst, max_abs((g.float() - w.float())[finite]))
    return worst


def max_abs(t: torch.Tensor) -> float:
    """The largest magnitude in `t` (0 for an empty tensor)."""
    return torch.linalg.vector_norm(t, ord=float("inf")).item() if t.numel() else 0.0
