"""Bytes each rank sends, by kind, so tests and benchmarks can hold them against the cost model.

Kinds: ``"collective"`` (all-reduces of partial sums and statistics), ``"ring"`` (the P(S x S) shifts inside a ring
operator), ``"redistribution"`` (inter-operator layout changes, point to point), ``"pipeline"`` (the tensors a
pipeline stage sends to the next and their gradients sent back, :mod:`primepar_fx.compiler.pipelined`) and
``"output"`` (gathering the model's outputs whole on every rank, which a plan does not price: a training step that
returns only the loss sends almost nothing of this kind). A collective is counted with the ring-algorithm volume the
cost model uses (``2 (g-1)/g`` of the block for an all-reduce over ``g`` ranks, the bus volume of ``nccl-tests``);
point-to-point traffic is counted exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

COMM_KINDS = ("collective", "ring", "redistribution", "pipeline", "output")


@dataclass
class CommStats:
    """A running count of bytes sent by this rank, per kind; :meth:`reset` between steps."""

    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COMM_KINDS, 0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COMM_KINDS, 0))
    #: bytes per graph node of the plan the traffic belongs to
    by_node: dict[str, int] = field(default_factory=dict)
    detail: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: float, node: str = "", calls: int = 1) -> None:
        """Count ``nbytes`` of ``kind`` sent for ``node`` in ``calls`` messages (``0``: part of a message counted
        already, as each tensor of a gradient bucket is)."""
        if kind not in self.bytes:
            raise ValueError(f"unknown communication kind {kind!r}; expected one of {COMM_KINDS}")
        n = int(round(nbytes))
        self.bytes[kind] += n
        self.calls[kind] += calls
        if node:
            self.by_node[node] = self.by_node.get(node, 0) + n
            self.detail[(node, kind)] = self.detail.get((node, kind), 0) + n

    def reset(self) -> None:
        for k in COMM_KINDS:
            self.bytes[k] = 0
            self.calls[k] = 0
        self.by_node.clear()
        self.detail.clear()

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    @property
    def planned(self) -> int:
        """Bytes of the kinds a plan prices (everything but ``"output"``)."""
        return sum(v for k, v in self.bytes.items() if k != "output")

    def snapshot(self) -> dict[str, int]:
        return dict(self.bytes)
