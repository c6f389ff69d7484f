"""``GradientBuckets`` on real gloo ranks: every parameter's ``.grad`` is the group sum of this backward's gradient.

Each rank computes a different loss from the same parameters (its inputs depend on the rank), so the sums differ
from every rank's own gradient; the reference is the sum of every rank's ``torch.autograd.grad``, all-reduced
explicitly. One spawn of 4 ranks runs every case: several buckets (a small cap), two groups (digits of a 2 x 2
mesh), two dtypes, gradient accumulation over two backwards, a parameter with no gradient, ``autograd.grad``, and
the byte and message counts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from primepar_fx.cost.latency import ring_factors
from primepar_fx.partition import DeviceMesh
from primepar_fx.runtime.collectives import reduce_scatter_flat
from primepar_fx.runtime.gradsync import GradientBuckets, GradReduction
from primepar_fx.runtime.groups import ProcessGroups
from primepar_fx.runtime.stats import CommStats
from primepar_fx.runtime.testing import spawn


def _params() -> dict[str, torch.nn.Parameter]:
    torch.manual_seed(0)
    shapes = {"a": (64, 32), "b": (32,), "c": (32, 16), "d": (16,), "e": (40, 8), "unused": (3,)}
    out = {k: torch.nn.Parameter(torch.randn(s)) for k, s in shapes.items()}
    out["h"] = torch.nn.Parameter(torch.randn(16, 4, dtype=torch.float64))
    return out


def _loss(p: dict[str, torch.Tensor], rank: int) -> torch.Tensor:
    x = torch.arange(64.0).reshape(1, 64) / 64 + rank
    y = torch.tanh(x @ p["a"] + p["b"]) @ p["c"] + p["d"]
    z = (torch.ones(1, 40) * (rank + 1)) @ p["e"]
    return (y**2).sum() + z.sum() * y.mean() + (y.double() @ p["h"]).sum().float()


def _reference(p: dict[str, torch.nn.Parameter], rank: int, groups: dict[str, object]) -> dict[str, torch.Tensor]:
    names = [k for k in p if k != "unused"]
    grads = torch.autograd.grad(_loss(p, rank), [p[k] for k in names])
    out = {}
    for k, g in zip(names, grads):
        g = g.clone()
        dist.all_reduce(g, group=groups[k])
        out[k] = g
    return out


def _check(rank: int, world: int) -> dict:
    mesh = DeviceMesh((2, 2))
    pg = ProcessGroups(mesh, rank)
    digits = {"a": (0,), "b": (0,), "c": (0, 1), "d": (0, 1), "e": (1,), "h": (0, 1), "unused": (0,)}
    p = _params()
    reductions = {
        k: GradReduction(d, pg.get(d, channel="grad"), f"node_{k}", order)
        for order, (k, d) in enumerate(digits.items())
    }
    ref = _reference(p, rank, {k: pg.get(d)[0] for k, d in digits.items()})  # before the hooks
    stats = CommStats()
    buckets = GradientBuckets(
        [(k, p[k], reductions[k]) for k in p], stats, bucket_cap_mb=1500 / 2**20, first_bucket_cap_mb=600 / 2**20
    )
    result: dict = {"buckets": buckets.describe()}

    _loss(p, rank).backward()
    result["one"] = max((p[k].grad - ref[k]).abs().max().item() for k in ref)
    result["unused"] = p["unused"].grad is None
    result["calls"] = stats.calls["collective"]
    expected = {}
    for k in ref:
        g = len(reductions[k].ranks)
        expected[f"node_{k}"] = round(ring_factors("all-reduce", g)[0] * p[k].numel() * p[k].element_size())
    result["bytes_exact"] = stats.by_node == expected

    _loss(p, rank).backward()  # accumulation: .grad = 2 x the sum
    result["two"] = max((p[k].grad - 2 * ref[k]).abs().max().item() for k in ref)

    names = [k for k in p if k != "unused"]
    got = torch.autograd.grad(_loss(p, rank), [p[k] for k in names])
    result["autograd_grad"] = max((g - ref[k]).abs().max().item() for k, g in zip(names, got))
    result["grads_untouched"] = max((p[k].grad - 2 * ref[k]).abs().max().item() for k in ref)
    buckets.remove()
    result["scatter"] = _scatter_flat(rank, pg)
    return result


def _written() -> int:
    """The bytes this process has written so far (``wchar``: gloo's socket writes included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def _scatter_flat(rank: int, pg: ProcessGroups) -> list[tuple[float, float]]:
    """``reduce_scatter_flat`` over the world and over ranks (0, 2): the error of this rank's chunk against an
    all-reduce's, and the bytes written to gloo's sockets over the ring volume ((g-1)/g of the flat tensor)."""
    out = []
    for digits in ((0, 1), (0,)):
        handle, ranks = pg.get(digits, channel="grad")
        if handle is None:
            continue
        g, chunk = len(ranks), 2**16
        flat = torch.randn(g * chunk, generator=torch.Generator().manual_seed(rank))
        whole = flat.clone()
        dist.all_reduce(whole, group=handle)
        mine = torch.empty(chunk)
        dist.barrier(group=handle)
        before = _written()
        reduce_scatter_flat(mine, flat, handle, ranks).wait()
        written = _written() - before
        error = (mine - whole.view(g, chunk)[ranks.index(rank)]).abs().max().item()
        out.append((error, written / ((g - 1) * chunk * 4)))
    return out


def test_gradient_buckets_sum_exactly_over_their_groups():
    r = spawn(_check, 4, timeout=240)
    assert r["one"] < 1e-5 and r["two"] < 1e-5 and r["autograd_grad"] < 1e-5 and r["grads_untouched"] < 1e-5
    assert r["unused"]
    assert r["bytes_exact"]
    # reverse order of use; one group and dtype per bucket; a bucket takes the next tensor of its kind unless that
    # passes its cap (600 bytes for the first, 1500 for the others), and a tensor over the cap gets one of its own
    assert [(b["params"], b["ranks"], b["dtype"], b["bytes"]) for b in r["buckets"]] == [
        (["unused", "b"], [0, 2], "float32", 12 + 128),
        (["h"], [0, 1, 2, 3], "float64", 512),
        (["e"], [0, 1], "float32", 1280),
        (["d"], [0, 1, 2, 3], "float32", 64),
        (["c"], [0, 1, 2, 3], "float32", 2048),
        (["a"], [0, 2], "float32", 8192),
    ]
    assert r["calls"] == 6  # one message per bucket
    # ZeRO's reduce-scatter of a flat bucket: exact, and under gloo point to point, the ring volume on the wire
    # (gloo's own reduce_scatter writes an all-reduce's bytes, twice that)
    assert len(r["scatter"]) == 2
    for error, over_ring in r["scatter"]:
        assert error < 1e-5
        assert 1.0 <= over_ring < 1.1


def test_zero_buffers_live_on_the_parameters_device():
    """ZeRO's master chunks, padding and reduce-scatter buffers follow the parameters' device (a GPU under NCCL):
    parameters on the meta device, under the fake process group, never meet a CPU tensor."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from primepar_fx.runtime.zero import ShardedOptimizer

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        pg = ProcessGroups(DeviceMesh((2,)), 0)
        p = {k: torch.nn.Parameter(torch.randn(s, device="meta")) for k, s in {"a": (6, 5), "b": (7,)}.items()}
        reductions = {k: GradReduction((0,), pg.get((0,), channel="grad"), f"n_{k}", i) for i, k in enumerate(p)}
        buckets = GradientBuckets([(k, p[k], reductions[k]) for k in p], CommStats())
        opt = ShardedOptimizer(buckets, list(p.values()), 0, 2, torch.optim.AdamW, CommStats())
        assert [s.master.device.type for s in opt.shards] == ["meta"]
        (p["a"].sum() + p["b"].sum()).backward()  # stage 2: reduce-scatter of the padded bucket
        opt.step()  # the all-gather of the updated chunks back into the parameters
        assert all(q.device.type == "meta" for q in p.values())
        buckets.remove()
    finally:
        dist.destroy_process_group()
