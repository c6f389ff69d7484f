"""``primepar_fx.runtime.simulated``: ranks as threads of one process, their messages carried out in memory.

Every collective and transfer the compiled modules make is checked against what it must deliver on every rank,
on the world group and on subgroups; so are the failures a real backend would hang on (mismatched collectives, a
message nobody receives, a rank that raises or never arrives).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from primepar_fx.runtime.simulated import SimulationError, simulate


def _collectives(rank: int, world: int) -> dict:
    total = torch.full((3,), float(rank))
    dist.all_reduce(total)
    most = torch.tensor([float(rank % 3)])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    gathered = torch.empty(2 * world)
    dist.all_gather_single(gathered, torch.tensor([rank, -rank], dtype=torch.float32))
    scattered = torch.empty(2)
    work = dist.reduce_scatter_single(scattered, torch.arange(2.0 * world) * (rank + 1), async_op=True)
    work.wait()
    root = torch.full((2,), float(rank))
    dist.broadcast(root, 1)
    dist.barrier()
    return {"sum": total.tolist(), "max": most.item(), "gathered": gathered.tolist(), "scattered": scattered.tolist(),
            "root": root.tolist()}  # fmt: skip


@pytest.mark.parametrize("world", [4, 16])
def test_collectives_deliver_what_they_must_on_every_rank(world: int) -> None:
    results = simulate(_collectives, world, timeout=60)
    everyone = sum(range(1, world + 1))  # the scaled inputs summed: (r + 1) summed over ranks
    for rank, got in enumerate(results):
        assert got["sum"] == [float(sum(range(world)))] * 3
        assert got["max"] == float(min(2, world - 1))
        assert got["gathered"] == [float(x) for r in range(world) for x in (r, -r)]
        assert got["scattered"] == [float(2 * rank * everyone), float((2 * rank + 1) * everyone)]
        assert got["root"] == [1.0, 1.0]


def _subgroups_and_ring(rank: int, world: int) -> dict:
    halves = [dist.new_group(list(range(h, h + world // 2))) for h in (0, world // 2)]
    mine = halves[rank // (world // 2)]
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=mine)
    send, recv = torch.tensor([10.0 * rank, 1.0]), torch.empty(2)
    right, left = (rank + 1) % world, (rank - 1) % world
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv, left), dist.P2POp(dist.isend, send, right)])
    send.zero_()  # the message was taken when sent
    for req in reqs:
        req.wait()
    return {"half": x.item(), "from_left": recv.tolist()}


def test_subgroups_reduce_apart_and_a_ring_shift_reaches_each_neighbour() -> None:
    world = 8
    for rank, got in enumerate(simulate(_subgroups_and_ring, world, timeout=60)):
        half = range(0, 4) if rank < 4 else range(4, 8)
        assert got["half"] == float(sum(half))
        assert got["from_left"] == [10.0 * ((rank - 1) % world), 1.0]


def _mismatched(rank: int, world: int) -> None:
    dist.all_reduce(torch.ones(2 + rank % 2))


def test_a_collective_of_different_shapes_on_two_ranks_fails_naming_both() -> None:
    with pytest.raises(SimulationError, match=r"mismatched collective.*\(2,\).*\(3,\)"):
        simulate(_mismatched, 4, timeout=60)


def _one_raises(rank: int, world: int) -> None:
    if rank == 2:
        raise ValueError("rank two gives up")
    dist.all_reduce(torch.ones(1))  # the others wait for rank 2 and are released when it fails


def test_an_exception_on_one_rank_releases_the_others_and_is_raised_with_its_rank() -> None:
    with pytest.raises(SimulationError, match="simulated rank 2 of 4 failed: rank two gives up"):
        simulate(_one_raises, 4, timeout=60)


def _unreceived(rank: int, world: int) -> None:
    if rank == 0:
        dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(3), 1)])[0].wait()


def test_a_message_nobody_receives_is_reported() -> None:
    with pytest.raises(SimulationError, match=r"message\(s\) 0->1 tag 0 never received"):
        simulate(_unreceived, 2, timeout=60)


def _waits_forever(rank: int, world: int) -> None:
    if rank == 1:
        dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.empty(1), 0)])[0].wait()


def test_a_rank_that_never_gets_its_message_times_out() -> None:
    with pytest.raises(TimeoutError, match="2 simulated ranks did not finish within 2 s"):
        simulate(_waits_forever, 2, timeout=2)
    assert not dist.is_initialized()  # the process's own torch.distributed state is back


def test_a_process_can_run_simulations_one_after_another_and_bad_sizes_fail_first() -> None:
    import sys

    hook = sys.excepthook  # every rank's init_process_group wraps it; the run puts it back
    assert simulate(lambda rank, world: (rank, dist.get_rank(), dist.get_world_size()), 3) == [
        (r, r, 3) for r in range(3)
    ]
    assert simulate(lambda rank, world: dist.get_world_size(), 2) == [2, 2]
    assert sys.excepthook is hook
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        simulate(lambda rank, world: None, 0)
