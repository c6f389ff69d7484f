"""The global loss of a row-split cross-entropy is summed asynchronously and waited where its value is read.

The unit tests drive :class:`PendingTensor` with a work handle that records its waits; the gloo test checks the
loss and the gradients against one device, that backward never waits for the loss value, and the bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from primepar_fx.cost.latency import ring_factors
from primepar_fx.runtime.lowered import ShardedCrossEntropy
from primepar_fx.runtime.pending import Pending, PendingTensor
from primepar_fx.runtime.stats import CommStats
from primepar_fx.runtime.testing import spawn


class _Work:
    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
        return True


def _pending(value: float, divisor: float) -> tuple[PendingTensor, _Work]:
    work = _Work()
    buf = torch.tensor(value)
    return PendingTensor(Pending(buf, work, lambda t: t / divisor), buf), work


def test_shape_only_ops_do_not_wait_and_values_wait_once() -> None:
    import pickle

    t, work = _pending(6.0, 3.0)
    ones = torch.ones_like(t)
    zeros = torch.zeros_like(t)
    assert type(ones) is torch.Tensor and ones.item() == 1.0 and zeros.item() == 0.0
    assert t.shape == () and t.dtype == torch.float32
    assert work.waits == 0 and not t.pending.done
    assert (t * 2).item() == 4.0  # (6 / 3) * 2: the division runs once the sum is in
    assert work.waits == 1 and t.pending.done
    plain = t.detach()  # a plain tensor: numpy(), c10d and pickle need one
    assert type(plain) is torch.Tensor and plain.item() == 2.0
    assert t.numpy() == 2.0 and pickle.loads(pickle.dumps(t)).item() == 2.0
    assert t.wait().item() == 2.0 and repr(t) == repr(torch.tensor(2.0))
    assert work.waits == 1


def _check(rank: int, world: int) -> dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    logits = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 5, (8,))
    target[[1, 2, 6]] = -100  # rank 0 ignores two of its rows, rank 1 one
    full = F.cross_entropy(logits, target)
    (ref,) = torch.autograd.grad(full, logits)

    rows = slice(4 * rank, 4 * rank + 4)
    mine = logits.detach()[rows].clone().requires_grad_(True)
    out = {}
    for reduction in ("mean", "sum"):
        stats = CommStats()
        group = (dist.group.WORLD, (0, 1))
        ce = ShardedCrossEntropy(reduction, -100, 0, (None, (rank,)), group, stats)
        loss = ce(mine, target[rows])
        out[f"{reduction}_pending"] = isinstance(loss, PendingTensor)
        loss.backward()
        out[f"{reduction}_backward_waited"] = loss.pending.done
        want = full if reduction == "mean" else F.cross_entropy(logits, target, reduction="sum")
        scale = 1.0 if reduction == "mean" else float((target != -100).sum())
        out[f"{reduction}_loss"] = abs(loss.item() - want.item())
        out[f"{reduction}_grad"] = (mine.grad - ref[rows] * scale).abs().max().item()
        out[f"{reduction}_bytes"] = stats.bytes["collective"]
        out[f"{reduction}_calls"] = stats.calls["collective"]
        mine.grad = None
    return out


def test_row_split_loss_equals_one_device_and_backward_does_not_wait_for_it() -> None:
    r = spawn(_check, 2, timeout=120)
    for reduction, elements, calls in (("mean", 2, 2), ("sum", 1, 1)):
        assert r[f"{reduction}_pending"]
        assert not r[f"{reduction}_backward_waited"]
        assert r[f"{reduction}_loss"] < 1e-12 and r[f"{reduction}_grad"] < 1e-12
        # the count and the loss sum: the bytes of one all-reduce of both, as the plan prices them
        assert r[f"{reduction}_bytes"] == round(ring_factors("all-reduce", 2)[0] * elements * 8)
        assert r[f"{reduction}_calls"] == calls


def _deferred(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from primepar_fx.runtime.pending import DeferredGradients

    torch.manual_seed(0)
    table = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    positions = torch.tensor([0, 1, 2, 4])
    x = torch.randn(2 * world, 4, 3, dtype=torch.float64)

    def loss_of(pos: torch.Tensor, rows: slice) -> torch.Tensor:  # a consumer that splits the batch
        return ((x[rows] + pos) ** 2).sum()

    (ref,) = torch.autograd.grad(loss_of(F.embedding(positions, table), slice(None)), table)
    stats = CommStats()
    mod = DeferredGradients(
        torch.ops.aten.embedding.default, [None, None], {}, (0, 1), (0,), (dist.group.WORLD, (0, 1)), stats, "add"
    )
    rows = slice(2 * rank, 2 * rank + 2)
    out = {}
    loss_of(mod(table, positions), rows).backward()
    out["backward"] = (table.grad - ref).abs().max().item()
    loss_of(mod(table, positions), rows).backward()  # accumulates, as autograd does
    out["accumulated"] = (table.grad - 2 * ref).abs().max().item()
    (got,) = torch.autograd.grad(loss_of(mod(table, positions), rows), table)  # returned, not deferred
    out["autograd_grad"] = (got - ref).abs().max().item()
    out["untouched"] = (table.grad - 2 * ref).abs().max().item()
    out["bytes"], out["calls"] = stats.bytes["collective"], stats.calls["collective"]
    return out


def test_deferred_gradients_sum_the_output_gradient_once_at_the_end_of_backward() -> None:
    r = spawn(_deferred, 2, timeout=120)
    assert r["backward"] < 1e-12 and r["accumulated"] < 1e-12
    assert r["autograd_grad"] < 1e-12 and r["untouched"] < 1e-12
    # three backwards, each one all-reduce of the (4, 3) float64 output gradient
    assert r["calls"] == 3 and r["bytes"] == 3 * round(ring_factors("all-reduce", 2)[0] * 4 * 3 * 8)


def _joined(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from primepar_fx.runtime.gradsync import GradientBuckets, GradReduction
    from primepar_fx.runtime.pending import DeferredGradients

    torch.manual_seed(0)
    table = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))  # replicated, summed in a bucket
    positions = torch.tensor([0, 1, 2, 4])
    x = torch.randn(2 * world, 4, 3, dtype=torch.float64)

    def loss_of(pos: torch.Tensor, rows: slice) -> torch.Tensor:
        return ((x[rows] + pos) ** 2 * weight).sum()

    ref = torch.autograd.grad(loss_of(F.embedding(positions, table), slice(None)), [table, weight])
    group = (dist.group.WORLD, (0, 1))
    stats = CommStats()
    buckets = GradientBuckets([("weight", weight, GradReduction((0,), group, "mul", 0))], stats)
    mod = DeferredGradients(torch.ops.aten.embedding.default, [None, None], {}, (0, 1), (0,), group, stats, "add")
    mod.bucket = (buckets, buckets.hold_for((0, 1)))
    rows = slice(2 * rank, 2 * rank + 2)
    out = {}
    loss_of(mod(table, positions), rows).backward()
    out["table"] = (table.grad - ref[0]).abs().max().item()
    out["weight"] = (weight.grad - ref[1]).abs().max().item()
    out["calls"], out["by_node"] = stats.calls["collective"], dict(stats.by_node)
    loss_of(mod(table, positions), rows).backward()  # again, into the bucket's kept (grown) buffer: accumulates
    out["again"] = max((table.grad - 2 * ref[0]).abs().max().item(), (weight.grad - 2 * ref[1]).abs().max().item())
    out["calls"] = stats.calls["collective"]
    with buckets.accumulating():  # a micro-batch before the last: the table's sum goes alone, the weight's waits
        loss_of(mod(table, positions), rows).backward()
    out["accumulating_calls"] = stats.calls["collective"] - out["calls"]
    out["accumulating_table"] = (table.grad - 3 * ref[0]).abs().max().item()
    buckets.remove()
    return out


def test_a_deferred_sum_joins_the_last_bucket_over_its_ranks() -> None:
    """The deferred sum travels in the message of the held-back bucket over the same ranks: one message for both,
    each tensor's bytes under its own node, both gradients exact."""
    r = spawn(_joined, 2, timeout=120)
    assert r["table"] < 1e-12 and r["weight"] < 1e-12
    assert r["calls"] == 2 and r["again"] < 1e-12  # one message a backward
    factor = ring_factors("all-reduce", 2)[0]
    assert r["by_node"] == {"mul": round(factor * 3 * 8), "add": round(factor * 4 * 3 * 8)}  # (the first one's)
    assert r["accumulating_calls"] == 1 and r["accumulating_table"] < 1e-12
