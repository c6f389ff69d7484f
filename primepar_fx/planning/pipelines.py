"""Pipeline stages as a lever: which stage counts, micro-batch counts and schedules a pipeline of a graph may use on
a world (:func:`stage_counts`, :func:`pipeline_micro_batches`, :func:`schedules`); a plan is priced as a pipeline by
:func:`~primepar_fx.pricing.pipelined.price_pipeline`, and Megatron-LM's with pipelines by
:func:`~primepar_fx.planning.compare.best_megatron_pipelined`.

A pipeline of ``p`` stages runs each stage on ``world / p`` devices (stage ``s``: ranks ``s * q`` to
``(s + 1) * q - 1``), so that its cuts cross the slowest links: between nodes where a stage fills whole nodes. A
stage's devices are a mesh of their own, on which the stage's plan splits its nodes; the stages see the whole batch,
``m`` micro-batches of it, one after another.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from primepar_fx.cost.pipeline import check_schedule

#: the schedules Megatron-LM runs, as ``(torch's name, virtual stages a rank)``: 1F1B, and interleaved 1F1B with two
#: model chunks a rank (its ``--num-layers-per-virtual-pipeline-stage`` at half a stage)
MEGATRON_SCHEDULES = (("1F1B", 1), ("Interleaved1F1B", 2))
#: the micro-batch sizes a data-parallel rank runs in a pipeline (Megatron-LM's ``--micro-batch-size``)
MICRO_BATCH_SIZES = (1, 2, 4)


def stage_counts(world: int, layers: int, devices_per_node: int) -> list[int]:
    """The stage counts ``p >= 2`` a pipeline of ``layers`` layers may use on ``world`` devices: ``p`` divides
    ``world``, each stage has a layer, and each stage's ``world / p`` devices fill whole nodes or a whole share of
    one (so every stage's mesh is the same)."""
    out = []
    for p in range(2, min(world, layers) + 1):
        q = world // p
        if world % p == 0 and (q % devices_per_node == 0 or devices_per_node % q == 0):
            out.append(p)
    return out


def pipeline_micro_batches(batch: int, stages: int, dp: int) -> list[int]:
    """The micro-batch counts of a pipeline of ``stages`` on ``dp`` data-parallel replicas: each micro-batch
    :data:`MICRO_BATCH_SIZES` samples a replica, at least as many micro-batches as stages (1F1B's warm-up), most
    first."""
    out = []
    for size in MICRO_BATCH_SIZES:
        if batch % (dp * size) == 0 and batch // (dp * size) >= stages:
            out.append(batch // (dp * size))
    return out


def schedules(
    stages: int, layers: int, micro_batches: int, choices: Sequence[tuple[str, int]] = MEGATRON_SCHEDULES
) -> Iterator[tuple[str, int]]:
    """The schedules of ``choices`` (``(name, virtual stages a rank)``) that ``stages`` ranks can run over
    ``micro_batches`` with a layer in every (virtual) stage."""
    for name, virtual in choices:
        if stages * virtual > layers:
            continue
        try:
            check_schedule(name, stages, micro_batches, virtual)
        except ValueError:
            continue
        yield name, virtual
