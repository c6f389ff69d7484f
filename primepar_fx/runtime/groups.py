"""Process groups for the group indicators of a device mesh, created once and cached.

A group indicator is a set of digit positions; its groups are the ranks that differ only in those digits
(:meth:`~primepar_fx.partition.DeviceMesh.groups`). ``torch.distributed.new_group`` is collective over the whole
world, so :meth:`ProcessGroups.get` creates *every* group of a pattern the first time any rank asks for it. The
graph passes ask in graph order, which is the same on every rank.

A *channel* names a second, separate set of groups over the same ranks: the gradient buckets of
:mod:`primepar_fx.runtime.gradsync` run on their own channel, so that their asynchronous collectives, launched from
autograd hooks, can never be matched with a collective of the graph that a peer issued in a different order.
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
                if len(ranks) == self.mesh.size and not channel:
                    handle = dist.group.WORLD
                else:
                    handle = dist.new_group(ranks, timeout=self.timeout)
                if self.rank in ranks:
                    mine = (handle, tuple(ranks))
            self._cache[key] = mine
        return self._cache[key]


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
