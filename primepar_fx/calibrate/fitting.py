"""Fitting what calibration measures: exact non-negative least squares, a compute model from ``(flops, bytes,
seconds)`` samples and its efficiency table, and how well a fit explains its samples."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from primepar_fx.cost.latency import ComputeModel


def nnls(columns: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Exact non-negative least squares ``min ||sum_j x_j columns[j] - y||, x >= 0`` for a few columns.

    Enumerates the supports (the optimum is the unconstrained least squares on its own support), fewest columns
    first, so ties go to the simpler model. Columns are scaled to unit maximum for conditioning.
    """
    a = np.asarray(columns, dtype=np.float64).T
    b = np.asarray(y, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != b.shape[0] or not a.size:
        raise ValueError(f"nnls needs columns of equal length matching y, got {a.shape} and {b.shape}")
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    best, best_x = float(np.linalg.norm(b)), np.zeros(a.shape[1])
    for k in range(1, a.shape[1] + 1):
        for support in itertools.combinations(range(a.shape[1]), k):
            coef, *_ = np.linalg.lstsq(a[:, support], b, rcond=None)
            if (coef < 0).any():
                continue
            resid = float(np.linalg.norm(a[:, support] @ coef - b))
            if resid < best * (1 - 1e-9):
                best, best_x = resid, np.zeros(a.shape[1])
                best_x[list(support)] = coef
    return [float(v) for v in best_x / scale]


def fit_quality(predicted: Sequence[float], measured: Sequence[float]) -> tuple[float, float]:
    """``(R², max relative residual)`` of a fit."""
    p, t = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    ss_res, ss_tot = float(((t - p) ** 2).sum()), float(((t - t.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else float(ss_res == 0)
    return r2, float((np.abs(p - t) / np.maximum(t, 1e-300)).max())


def fit_compute(samples: Iterable[tuple[float, float, float]], *, use_flops: bool = True) -> ComputeModel:
    """Fit ``(flops, bytes, seconds)`` samples to ``flops_coeff * flops + bytes_coeff * bytes + fixed``.

    Non-negative least squares on relative residuals (each row divided by its time); ``use_flops=False`` pins
    ``flops_coeff`` to 0 (the memory-bound families, whose rules count no FLOPs).
    """
    rows = [(float(f), float(n), float(t)) for f, n, t in samples]
    if len(rows) < 2 or any(t <= 0 or not math.isfinite(t) for *_, t in rows):
        raise ValueError(f"fit_compute needs at least two samples with positive times, got {rows}")
    w = [1.0 / t for *_, t in rows]
    cols = [[r[1] * wi for r, wi in zip(rows, w)], w]
    if use_flops:
        cols.insert(0, [r[0] * wi for r, wi in zip(rows, w)])
    coef = nnls(cols, [1.0] * len(rows))
    return ComputeModel(*coef) if use_flops else ComputeModel(0.0, *coef)


def rounded(model: Any, digits: int = 4) -> Any:
    """The model with every coefficient rounded to ``digits`` significant digits (readable spec files)."""
    values = {
        f.name: float(f"{value:.{digits}g}")
        for f in dataclasses.fields(model)
        if isinstance(value := getattr(model, f.name), float)
    }
    return dataclasses.replace(model, **values)


def with_efficiency(model: ComputeModel, samples: Iterable[tuple[float, float, float]]) -> ComputeModel:
    """``model`` with an efficiency table read off matrix-product ``(flops, bytes, seconds)`` samples.

    The FLOP rate becomes the fastest sample's (its seconds less the model's byte and fixed terms, per FLOP), and
    each size's factor is how close its own rate comes to that (several shapes of one size: the fastest). A model
    fitted this way gives every sample's time back at its size and interpolates between sizes
    (:class:`~primepar_fx.cost.latency.ComputeModel`)."""
    rows = [(float(f), float(t) - model.bytes_coeff * float(n) - model.fixed) for f, n, t in samples if f > 0]
    rows = [(f, t) for f, t in rows if t > 0]
    if len(rows) < 2:
        return model
    best = min(t / f for f, t in rows)  # seconds per FLOP of the fastest sample
    factors: dict[float, float] = {}
    for f, t in rows:
        factors[f] = max(factors.get(f, 0.0), best * f / t)
    table = tuple((f, max(1e-4, min(1.0, float(f"{e:.4g}")))) for f, e in sorted(factors.items()))
    return dataclasses.replace(model, flops_coeff=float(f"{best:.4g}"), efficiency=table)
