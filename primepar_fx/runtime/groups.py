"""Process groups for the group indicators of a device mesh, created once and cached.

A group indicator is a set of digit positions; its groups are the ranks that differ only in those digits
(:meth:`~primepar_fx.partition.DeviceMesh.groups`). ``torch.distributed.new_group`` is collective over the whole
world, so :meth:`ProcessGroups.get` creates *every* group of a pattern the first time any rank asks for it. The
graph passes ask in graph order, which is the same on every rank.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from primepar_fx.partition import DeviceMesh


class ProcessGroups:
    """The process group of this rank for every digit pattern, plus global-rank helpers for P2P."""

    def __init__(self, mesh: DeviceMesh, rank: int, timeout: timedelta | None = None) -> None:
        self.mesh, self.timeout = mesh, timeout
        self.rank = rank
        self.coords = mesh.coords(rank)
        self._cache: dict[tuple[int, ...], tuple[object | None, tuple[int, ...]]] = {}

    def get(self, positions: tuple[int, ...]) -> tuple[object | None, tuple[int, ...]]:
        """``(group, ranks)`` of this rank's group over the digits ``positions``; group ``None`` if alone."""
        key = tuple(sorted(set(positions)))
        if key not in self._cache:
            groups = self.mesh.groups(key)
            mine: tuple[object | None, tuple[int, ...]] = (None, (self.rank,))
            for ranks in groups:
                if len(ranks) == 1:
                    continue
                if len(ranks) == self.mesh.size:
                    handle = dist.group.WORLD
                else:
                    handle = dist.new_group(ranks, timeout=self.timeout)
                if self.rank in ranks:
                    mine = (handle, tuple(ranks))
            self._cache[key] = mine
        return self._cache[key]
