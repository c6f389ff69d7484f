"""Device IDs as mixed-radix digit vectors (paper §3.1, generalised beyond 2^n devices).

A world of N devices is described by its *digits*: radices ``(r1, ..., rn)`` with ``r1 * ... * rn = N``. The
device with rank ``k`` has ID ``D = (d1, ..., dn)``, ``0 <= di < ri``, with ``d1`` the most significant digit, so
ranks that share a node share the leading digits. The paper's binary IDs are the case ``ri = 2``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from math import prod

import numpy as np


def prime_factors(n: int) -> list[int]:
    """Prime factors of ``n`` in ascending order (with repeats)."""
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return out


@dataclass(frozen=True, slots=True)
class DeviceMesh:
    """The digits of the device ID. ``digits[0]`` is the most significant (it spans nodes first)."""

    digits: tuple[int, ...]

    #: the hash, computed once (a plan hashes these a few hundred thousand times as memo keys)
    _hash: int | None = field(init=False, repr=False, compare=False, default=None)

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash((self.digits,)))
        return self._hash  # type: ignore[return-value]

    def __reduce__(self) -> tuple:
        return DeviceMesh, (self.digits,)  # rebuilt, so no cached hash travels to another process

    def __post_init__(self) -> None:
        if not isinstance(self.digits, tuple) or not all(isinstance(d, int) for d in self.digits):
            raise ValueError(f"digits must be a tuple of ints, got {self.digits!r}")
        if any(d < 2 for d in self.digits):
            raise ValueError(f"every digit needs a radix of at least 2, got {self.digits}")

    @classmethod
    def for_world_size(cls, world_size: int, devices_per_node: int | None = None) -> DeviceMesh:
        """Prime-factor digits, largest first; with ``devices_per_node`` the node digits come first."""
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        if devices_per_node is None or devices_per_node >= world_size:
            return cls(tuple(sorted(prime_factors(world_size), reverse=True)))
        if world_size % devices_per_node:
            flat = ",".join(map(str, cls.for_world_size(world_size).digits))
            raise ValueError(
                f"world size {world_size} is not a multiple of {devices_per_node} devices per node; give the device "
                f"digits yourself (--digits, or digits=, e.g. {flat}) or a cluster spec whose nodes hold a divisor"
            )
        nodes = world_size // devices_per_node
        return cls(
            tuple(sorted(prime_factors(nodes), reverse=True))
            + tuple(sorted(prime_factors(devices_per_node), reverse=True))
        )

    def grouped(self, max_digits: int = 3) -> DeviceMesh:
        """The same devices with the most significant digits merged until at most ``max_digits`` remain.

        Merging digits keeps every rank's place (a merged digit is the mixed-radix number of the digits it
        replaces), so a plan on the grouped mesh is a plan on this one whose merged digits all split the same
        dim. It gives up only partitions that treat those digits differently, e.g. a P(S x S) or two different
        splits across nodes, and keeps the strategy count of a large world near that of eight devices.
        """
        if max_digits < 1:
            raise ValueError(f"max_digits must be at least 1, got {max_digits}")
        if len(self.digits) <= max_digits:
            return self
        cut = len(self.digits) - max_digits + 1
        return DeviceMesh((prod(self.digits[:cut]), *self.digits[cut:]))

    @property
    def size(self) -> int:
        return prod(self.digits)

    def __len__(self) -> int:
        return len(self.digits)

    def coords(self, rank: int) -> tuple[int, ...]:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a world of {self.size}")
        out = []
        for radix in reversed(self.digits):
            out.append(rank % radix)
            rank //= radix
        return tuple(reversed(out))

    def rank(self, coords: tuple[int, ...]) -> int:
        if len(coords) != len(self.digits) or any(not 0 <= c < r for c, r in zip(coords, self.digits)):
            raise ValueError(f"{coords} is not a device ID for digits {self.digits}")
        k = 0
        for c, radix in zip(coords, self.digits):
            k = k * radix + c
        return k

    def devices(self) -> Iterator[tuple[int, ...]]:
        """All device IDs in rank order."""
        return itertools.product(*(range(r) for r in self.digits))

    def groups(self, positions: tuple[int, ...]) -> list[list[int]]:
        """Rank groups of a group indicator: devices that differ only in the digits at ``positions``."""
        fixed = [i for i in range(len(self.digits)) if i not in positions]
        buckets: dict[tuple[int, ...], list[int]] = {}
        for rank, coords in enumerate(self.devices()):
            buckets.setdefault(tuple(coords[i] for i in fixed), []).append(rank)
        return list(buckets.values())


@lru_cache(maxsize=64)
def device_grid(mesh: DeviceMesh) -> np.ndarray:
    """``G[k, p]``: digit ``p`` of rank ``k``'s device ID, an ``(world, digits)`` int64 array (read-only)."""
    out = np.array(list(mesh.devices()), dtype=np.int64).reshape(mesh.size, len(mesh.digits))
    out.flags.writeable = False
    return out


# ------------------------------------------------------------------------------------------- who sends
@lru_cache(maxsize=64)
def digit_distance(mesh: DeviceMesh) -> np.ndarray:
    """``D[a, b]``: the number of device-ID digits in which ranks ``a`` and ``b`` differ (read-only)."""
    coords = device_grid(mesh)
    out = (coords[:, None, :] != coords[None, :, :]).sum(axis=-1)
    out.flags.writeable = False
    return out


def nearest_holder(holders: Sequence[int], k: int, mesh: DeviceMesh) -> int:
    """The rank that gives rank ``k`` a block the ranks ``holders`` hold: ``k`` itself when it is one of them, else
    the holder that differs from ``k`` in the fewest device-ID digits, the lowest rank on a tie (the rule of
    :meth:`primepar_fx.runtime.exchange.Exchange.plan` and of the ring's senders)."""
    dist = digit_distance(mesh)
    return min(holders, key=lambda r: (int(dist[r, k]), r))


@lru_cache(maxsize=1 << 12)
def class_senders(classes: tuple[int, ...], mesh: DeviceMesh) -> np.ndarray:
    """``S[r, k]``: :func:`nearest_holder` of rank ``r``'s class for rank ``k``, for every pair (read-only).

    ``classes[r]`` labels the block rank ``r`` holds; ranks with one label hold one block. ``(distance, rank)`` is
    ordered as the single integer ``distance * world + rank``.
    """
    world, cls = mesh.size, np.asarray(classes)
    key = digit_distance(mesh) * world + np.arange(world)[:, None]  # key[r', k]
    same = cls[:, None] == cls[None, :]  # [r, r']
    out = np.where(same[:, :, None], key[None], np.iinfo(np.int64).max).min(axis=1) % world
    out.flags.writeable = False
    return out
