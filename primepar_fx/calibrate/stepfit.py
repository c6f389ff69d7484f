"""Step-fitted calibration: fit a cluster spec to the measured training steps of a few plans.

``primepar-fx calibrate`` (:mod:`primepar_fx.calibrate.measure`) times each collective alone, after a barrier, and
each kernel in one process. Where ranks share cores, a real step also pays for waiting: for a core, and for a
peer that is not scheduled. Those costs scale with the messages a plan sends, not with what the isolated timings
see. This module fits the measured step times of a few plans instead, one :class:`StepSample` per plan::

    measured = c_op * ops + c_compute * compute + c_message * messages + c_byte * bytes        (every c >= 0)

* ``ops``: the compute sub-operators the cost model prices per step (a node's phases times its ring steps;
  :func:`op_counting_spec` counts them). It is nearly the same for every plan of a graph, so ``c_op * ops`` is
  the part of a step no plan avoids: dispatch, the optimizer, the Python between ops.
* ``compute``: the predicted compute seconds per step under the base spec (the sum of ``NodeCost.compute_s``).
* ``messages``, ``bytes``: what one rank sends per step, counted as the runtime's
  :class:`~primepar_fx.runtime.CommStats` counts them: one message per all-reduce call and one per peer a
  point-to-point transfer (ring shift, re-layout) sends to; an all-reduce's bytes are its bus volume
  ``2 (g-1)/g`` of the block, a transfer's bytes exact.

:func:`fit_steps` solves for the coefficients by non-negative least squares on relative residuals
(:func:`~primepar_fx.calibrate.fitting.nnls`; every plan weighs alike). :func:`step_fitted_spec` writes them into the
*existing* fields of a :class:`~primepar_fx.cost.cluster.ClusterSpec`, so that the cost model prices a plan as
the fit does, with ``g`` the ranks of the measured steps (``world_size``) and ``f`` every op family that costs
anything (not ``view`` or ``meta``)::

    field                                  bytes_coeff (s per bus byte)   fixed (s per ring step / per op)
    compute[f] and compute[f:dtype]        c_compute * base               c_compute * base + c_op
    p2p            (ring shift, 1 step)    c_byte                         c_message
    all-to-all     (re-layout, g-1 steps)  c_byte * g / (g-1)             c_message
    all-reduce     (2 (g-1) steps)         c_byte                         c_message / (2 (g-1))
    all-gather, reduce-scatter (g-1)       c_byte                         c_message / (g-1)

Every level gets the same numbers (samples from one node cannot tell levels apart). Why each row:

* ``compute``: every model (``flops_coeff``, ``bytes_coeff``, ``fixed``) is scaled by ``c_compute``, so a plan's
  compute scales by it; ``c_op`` added to ``fixed`` charges it once per priced sub-operator.
* ``p2p``: the model prices a ring shift as one p2p step of the block's bytes, the runtime counts one message
  of those bytes per peer sent to.
* ``all-to-all``: the model prices a re-layout as the cheaper of an all-to-all of the *mean bytes a device
  sends* ``n``, i.e. ``bytes_coeff * (g-1)/g * n + fixed * (g-1)``, and the point-to-point exchange the runtime
  runs (per receiving device, ``p2p`` per message and per byte; the busiest device sets the time); the runtime
  counts ``n`` bytes and one message per peer, so ``c_byte * g/(g-1)`` is exact for the all-to-all and
  ``c_message`` per step is exact when a re-layout sends to every peer.
* ``all-reduce``: the runtime counts one message per call and its bus bytes, the model ``2 (g-1)`` steps and
  the same bus bytes: exact for an all-reduce over all ``g`` ranks; one over fewer ranks is priced cheaper.
  (The model's ``fixed`` is per ring step, independent of the group size; this is the choice that keeps it so.)

What the spec does not reproduce: the model overlaps a P(S x S) ring shift with the compute of its step
(``max(compute, ring)``, Eq. 7), where the fit adds them, so plans with ring operators are priced below the fit.
Nor the messages of the gradient buckets (:mod:`primepar_fx.runtime.gradsync`): the runtime counts one per bucket,
the model prices a parameter's gradient all-reduce for its bytes only (a few buckets a step, against the hundreds
of messages that set plans apart). ``op_overhead`` is not used: it is the fixed term of the *default*
(uncalibrated) compute models only, and every costed family gets an explicit model here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from primepar_fx.calibrate.fitting import nnls
from primepar_fx.cost.cluster import DTYPES, FREE_FAMILIES, OP_FAMILIES, ClusterSpec
from primepar_fx.cost.latency import ComputeModel, LinearLatency

COSTED_FAMILIES = tuple(f for f in OP_FAMILIES if f not in FREE_FAMILIES)


@dataclass(frozen=True, slots=True)
class StepSample:
    """One plan's measured step and what the model and the runtime count for it (module docstring)."""

    ops: float  # compute sub-operators priced per step (op_counting_spec)
    compute_s: float  # predicted compute seconds per step under the base spec
    messages: float  # per rank per step (CommStats calls)
    bytes: float  # sent per rank per step (CommStats.planned)
    measured_s: float  # the measured step

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"StepSample.{f.name} must be a finite number >= 0, got {v!r}")
        if self.measured_s <= 0:
            raise ValueError(f"StepSample.measured_s must be > 0 seconds, got {self.measured_s!r}")


@dataclass(frozen=True, slots=True)
class StepFit:
    """The fitted coefficients: seconds per op, per predicted compute second, per message and per byte."""

    op_s: float
    compute: float
    message_s: float
    byte_s: float

    def __call__(self, s: StepSample) -> float:
        """The fitted step seconds of one sample."""
        return self.op_s * s.ops + self.compute * s.compute_s + self.message_s * s.messages + self.byte_s * s.bytes


def fit_steps(samples: Sequence[StepSample]) -> StepFit:
    """Non-negative least squares of the measured steps on ops, compute, messages and bytes (relative residuals)."""
    if len(samples) < 2:
        raise ValueError(f"fit_steps needs at least two samples (plans), got {len(samples)}")
    if not all(s.ops > 0 for s in samples):
        raise ValueError("every StepSample needs ops > 0 (count them with op_counting_spec)")
    columns = [[getattr(s, name) / s.measured_s for s in samples] for name in ("ops", "compute_s", "messages", "bytes")]
    return StepFit(*nnls(columns, [1.0] * len(samples)))


def op_counting_spec(base: ClusterSpec) -> ClusterSpec:
    """``base`` with every costed op family priced at 1 second per sub-operator and nothing else.

    A plan's predicted compute seconds under it (the sum of ``NodeCost.compute_s``) is the number of compute
    sub-operators the cost model prices per step, :attr:`StepSample.ops`.
    """
    one = ComputeModel(0.0, 0.0, 1.0)
    device = dataclasses.replace(base.device, compute=dict.fromkeys(COSTED_FAMILIES, one))
    return dataclasses.replace(base, device=device, source=f"op counting (1 s per op) on {base.name}")


def _scaled_compute(base: ClusterSpec, fit: StepFit) -> dict[str, ComputeModel]:
    """Every costed family's model (per dtype where it differs from fp32) scaled by ``c_compute``, plus ``c_op``."""

    def scaled(m: ComputeModel) -> ComputeModel:
        c = fit.compute
        return ComputeModel(c * m.flops_coeff, c * m.bytes_coeff, c * m.fixed + fit.op_s)

    out: dict[str, ComputeModel] = {}
    for family in COSTED_FAMILIES:
        fp32 = base.device.compute_model(family, "fp32")
        out[family] = scaled(fp32)
        for dtype in DTYPES:
            model = base.device.compute_model(family, dtype)
            if dtype != "fp32" and model != fp32:
                out[f"{family}:{dtype}"] = scaled(model)
    return out


def step_fitted_spec(
    base: ClusterSpec, samples: Sequence[StepSample] | StepFit, *, world_size: int, note: str = ""
) -> ClusterSpec:
    """``base`` with the step fit of ``samples`` (or a given :class:`StepFit`) in its fields (module docstring).

    ``world_size`` is the ranks of the measured steps (``g`` above); ``note`` says which steps were fitted and
    goes into ``source``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be the >= 2 ranks of the measured steps, got {world_size!r}")
    fit = samples if isinstance(samples, StepFit) else fit_steps(samples)
    g, c_msg, c_byte = world_size, fit.message_s, fit.byte_s
    kinds = {
        "p2p": LinearLatency(c_byte, c_msg),
        "all-to-all": LinearLatency(c_byte * g / (g - 1), c_msg),
        "all-reduce": LinearLatency(c_byte, c_msg / (2 * (g - 1))),
        "all-gather": LinearLatency(c_byte, c_msg / (g - 1)),
        "reduce-scatter": LinearLatency(c_byte, c_msg / (g - 1)),
    }
    terms = (
        f"{fit.op_s * 1e6:.4g} us per op + {fit.compute:.4g} x compute + {fit.message_s * 1e3:.4g} ms per message "
        f"+ {fit.byte_s * 2**20 * 1e3:.4g} ms per MiB"
    )
    source = f"step-fitted ({terms}, {g} ranks){': ' + note if note else ''}; base: {base.source or base.name}"
    spec = dataclasses.replace(base, device=dataclasses.replace(base.device, compute={}))  # replaced whole below
    collectives = {i: kinds for i in range(len(base.levels))}
    return spec.with_calibration(source=source, collectives=collectives, compute=_scaled_compute(base, fit))
