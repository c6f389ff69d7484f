"""In-process point-to-point messages for tests: ranks as threads, ``torch.distributed``'s P2P calls as mailboxes.

:class:`FakeTransport` replaces ``dist.P2POp`` and ``dist.batch_isend_irecv`` (the calls the re-layouts,
reduce-scatters and overlapped products of :mod:`primepar_fx.runtime` make) so that every rank's real code runs on
one thread each, with no process group.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist


class _Sent:
    def wait(self) -> None:
        pass


@dataclass
class _Arrival:
    box: queue.Queue
    into: torch.Tensor

    def wait(self) -> None:
        message = self.box.get(timeout=30)
        assert message.shape == self.into.shape, "a message of the wrong size"
        self.into.copy_(message)


class FakeTransport:
    """``dist.P2POp`` and ``dist.batch_isend_irecv`` between threads that stand for ranks: a mailbox per pair."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.boxes = {(a, b): queue.Queue() for a in range(world) for b in range(world)}
        self.local = threading.local()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None, tag=0: (op, tensor, peer))
        monkeypatch.setattr(dist, "batch_isend_irecv", self.batch_isend_irecv)

    def batch_isend_irecv(self, ops: list) -> list:
        me, reqs = self.local.rank, []
        for op, tensor, peer in ops:
            if op is dist.isend:
                self.boxes[me, peer].put(tensor.clone())
                reqs.append(_Sent())
            else:
                reqs.append(_Arrival(self.boxes[peer, me], tensor))
        return reqs

    def on_every_rank(self, fn) -> list:
        """``fn(rank)`` on one thread per rank; every message sent must have been received."""

        def rank(me: int):
            self.local.rank = me
            return fn(me)

        with ThreadPoolExecutor(self.world) as pool:
            out = list(pool.map(rank, range(self.world)))
        assert all(box.empty() for box in self.boxes.values()), "messages sent but never received"
        return out
