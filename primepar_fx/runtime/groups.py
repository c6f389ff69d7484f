"""Process groups for the group indicators of a device mesh, created once and cached.

A group indicator is a set of digit positions; its groups are the ranks that differ only in those digits
(:meth:`~primepar_fx.partition.DeviceMesh.groups`). ``torch.distributed.new_group`` is collective over the whole
world, so :meth:`ProcessGroups.get` creates *every* group of a pattern the first time any rank asks for it. The
graph passes ask in graph order, which is the same on every rank.

A pipelined plan (:mod:`primepar_fx.compiler.pipelined`) runs one stage's mesh on each block of ``q`` consecutive
ranks: stage ``s`` is the ranks ``s * q`` to ``(s + 1) * q - 1``. Every stage localises the same graph for its
mesh rank ``r = rank % q``, so the passes, the modules and the groups' rank tuples all speak *mesh* ranks; only the
process groups (created for every stage alike, in the same order on every rank) and the point-to-point peers
(:func:`global_rank`) add the stage's offset.

A *channel* names a second, separate set of groups over the same ranks: the gradient buckets of
:mod:`primepar_fx.runtime.gradsync` run on their own channel, so that their asynchronous collectives, launched from
autograd hooks, can never be matched with a collective of the graph that a peer issued in a different order.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from primepar_fx.partition import DeviceMesh


class ProcessGroups:
    """The process group of this mesh rank for every digit pattern.

    ``stages``: the meshes of that many pipeline stages side by side (module docstring); ``stage``: this rank's.
    The rank tuples returned are mesh ranks; the groups hold the global ranks of this rank's stage."""

    def __init__(
        self, mesh: DeviceMesh, rank: int, timeout: timedelta | None = None, *, stages: int = 1, stage: int = 0
    ) -> None:
        if not 0 <= stage < stages:
            raise ValueError(f"stage {stage} of a pipeline of {stages} stages")
        self.mesh, self.timeout = mesh, timeout
        self.rank = rank
        self.coords = mesh.coords(rank)
        self.stages, self.stage = stages, stage
        self._cache: dict[tuple[tuple[int, ...], str], tuple[object | None, tuple[int, ...]]] = {}

    def get(self, positions: tuple[int, ...], channel: str = "") -> tuple[object | None, tuple[int, ...]]:
        """``(group, ranks)`` of this rank's group over the digits ``positions``; group ``None`` if alone.

        ``channel``: ``""`` for the graph's own groups; any other name gives groups of the same ranks that are
        separate communicators (the world group included), created on first use like the others."""
        digits = tuple(sorted(set(positions)))
        key = (digits, channel)
        if key not in self._cache:
            groups = self.mesh.groups(digits)
            mine: tuple[object | None, tuple[int, ...]] = (None, (self.rank,))
            for ranks in groups:
                if len(ranks) == 1:
                    continue
                for stage in range(self.stages):  # new_group is collective over the world: every stage's, in order
                    if len(ranks) == self.mesh.size and not channel and self.stages == 1:
                        handle = dist.group.WORLD
                    else:
                        size = self.mesh.size
                        handle = dist.new_group([r + stage * size for r in ranks], timeout=self.timeout)
                    if self.rank in ranks and stage == self.stage:
                        mine = (handle, tuple(ranks))
            self._cache[key] = mine
        return self._cache[key]


#: the global rank of this process's mesh rank 0: ``stage * q`` in a pipeline of stages of ``q`` ranks, else 0
_stage_offset = 0


def set_stage_offset(offset: int) -> None:
    """Make :func:`global_rank` map mesh rank ``r`` to global rank ``r + offset`` in this process (a pipeline
    stage's first rank; 0 without stages). It is process state: a compiled module sets its own where it builds and
    where it runs (a step, a gather), so modules of different plans in one process take turns."""
    global _stage_offset
    _stage_offset = offset


def global_rank(mesh_rank: int) -> int:
    """The global rank of mesh rank ``mesh_rank`` of this process's stage: the peer of a point-to-point transfer."""
    return mesh_rank + _stage_offset


def mesh_rank(global_rank_: int) -> int:
    """This process's stage's mesh rank of global rank ``global_rank_``."""
    return global_rank_ - _stage_offset


#: how long a point-to-point wait of a compiled module lasts before it raises (``compile(timeout=...)``; ``None``:
#: the transport's own). Sends and receives run on the default group, whose gloo transport waits for the timeout
#: the group was created with, whatever its timeout is set to later; the works are told explicitly instead.
_p2p_timeout: timedelta | None = None


def set_p2p_timeout(timeout: timedelta | None) -> None:
    """Bound every later :func:`wait_p2p` of this process by ``timeout`` (``None``: the transport's own)."""
    global _p2p_timeout
    _p2p_timeout = timeout


def wait_p2p(work: object) -> None:
    """Wait for a point-to-point work of ``batch_isend_irecv``, at most :func:`set_p2p_timeout`'s time: a peer that
    stopped answering raises (``RuntimeError: ... Timed out waiting``) instead of hanging."""
    if _p2p_timeout is None:
        work.wait()  # type: ignore[attr-defined]
    else:
        work.wait(_p2p_timeout)  # type: ignore[attr-defined]
