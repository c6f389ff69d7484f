"""Partition sequences (paper Algorithm 1): ``Split(dim)``, ``Prime(S)`` = P(S x S), and ``Replicate``.

Each element consumes digits of the device ID, earlier elements the more significant ones:

* ``Split(X)`` consumes one digit of radix ``r`` and cuts dim ``X`` into ``r`` more slices.
* ``Prime(S)`` consumes ``2m`` digits ``d_i .. d_{i+2m-1}``. The row index ``r`` is read from
  ``d_i, d_{i+2}, ...`` and the column index ``c`` from ``d_{i+1}, d_{i+3}, ...`` (most significant first), so the
  paired digits must have equal radices whose product is ``S``. With binary digits this is the paper's
  P(2^k x 2^k) on 2k bits; with a radix-3 pair it is P(3 x 3).
* ``Replicate`` consumes one digit and splits nothing: the devices along it compute the same thing
  (Megatron's replicated norms are this).

Text form: elements joined by commas, e.g. ``B,P2x2,N`` or ``K,R``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from math import prod

from primepar_fx.partition.mesh import DeviceMesh


@dataclass(frozen=True, slots=True)
class Split:
    """Cut iteration dim ``dim`` into as many more slices as the radix of the one digit it consumes."""

    dim: str

    def __post_init__(self) -> None:
        if not self.dim or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.dim):
            raise ValueError(f"Split needs a dim name (letters, digits, _), got {self.dim!r}")

    def __str__(self) -> str:
        return self.dim


@dataclass(frozen=True, slots=True)
class Prime:
    """P(S x S), ``S = size``: a matrix product's M, N and K split S ways each, on S x S paired digits."""

    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 2:
            raise ValueError(f"P(S x S) needs S >= 2, got {self.size!r}")

    def __str__(self) -> str:
        return f"P{self.size}x{self.size}"


@dataclass(frozen=True, slots=True)
class Replicate:
    """Consume one digit and split nothing: the devices that differ only in it compute the same thing."""

    def __str__(self) -> str:
        return "R"


Element = Split | Prime | Replicate
_PRIME_RE = re.compile(r"P(\d+)x(\d+)")


@dataclass(frozen=True, slots=True)
class PartitionSeq:
    """An ordered partition sequence; at most one ``Prime`` (its steps are the op's temporal steps)."""

    elements: tuple[Element, ...]

    #: the hash, computed once (a plan hashes these a few hundred thousand times as memo keys)
    _hash: int | None = field(init=False, repr=False, compare=False, default=None)

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash((self.elements,)))
        return self._hash  # type: ignore[return-value]

    def __reduce__(self) -> tuple:
        return PartitionSeq, (self.elements,)  # not the cached hash: a str's hash differs between processes

    def __post_init__(self) -> None:
        if not isinstance(self.elements, tuple):
            raise ValueError("elements must be a tuple")
        for e in self.elements:
            if not isinstance(e, (Split, Prime, Replicate)):
                raise ValueError(f"not a partition element: {e!r}")
        if sum(isinstance(e, Prime) for e in self.elements) > 1:
            raise ValueError(f"at most one P(S x S) per sequence, got {self}")

    def __str__(self) -> str:
        return ",".join(str(e) for e in self.elements) if self.elements else "-"

    @classmethod
    def parse(cls, text: str) -> PartitionSeq:
        """Parse ``"B,P2x2,N"``; ``"-"`` or ``""`` is the empty sequence (one device). Sequences are immutable, so a
        text is parsed once (plans and baselines parse the same few texts for every node of a large model)."""
        return _parse(text)

    @classmethod
    def _parse(cls, text: str) -> PartitionSeq:
        text = text.strip()
        if text in ("", "-"):
            return cls(())
        out: list[Element] = []
        for tok in (t.strip() for t in text.split(",")):
            m = _PRIME_RE.fullmatch(tok)
            if m:
                if m.group(1) != m.group(2):
                    raise ValueError(f"P(S x S) must be square, got {tok!r} in {text!r}")
                out.append(Prime(int(m.group(1))))
            elif tok == "R":
                out.append(Replicate())
            else:
                try:
                    out.append(Split(tok))
                except ValueError as e:
                    raise ValueError(f"bad element {tok!r} in partition {text!r}: {e}") from None
        return cls(tuple(out))

    @property
    def prime(self) -> Prime | None:
        return next((e for e in self.elements if isinstance(e, Prime)), None)

    @property
    def steps(self) -> int:
        p = self.prime
        return p.size if p else 1

    def bind(self, mesh: DeviceMesh) -> tuple[tuple[int, ...], ...]:
        """The digit positions each element consumes on ``mesh``; raises if they do not use it exactly."""
        pos, out = 0, []
        for e in self.elements:
            if isinstance(e, Prime):
                used, rows = [], 1
                while rows < e.size:
                    if pos + 1 >= len(mesh.digits) or mesh.digits[pos] != mesh.digits[pos + 1]:
                        raise ValueError(
                            f"{e} in {self} needs pairs of equal digits at position {pos} of device digits "
                            f"{mesh.digits}"
                        )
                    used += [pos, pos + 1]
                    rows *= mesh.digits[pos]
                    pos += 2
                if rows != e.size:
                    raise ValueError(f"{e} in {self} does not match the device digits {mesh.digits}")
                out.append(tuple(used))
            else:
                if pos >= len(mesh.digits):
                    raise ValueError(f"partition {self} uses more digits than the device ID {mesh.digits} has")
                out.append((pos,))
                pos += 1
        if pos != len(mesh.digits):
            used = prod(mesh.digits[:pos])
            raise ValueError(
                f"partition {self} spreads over {used} devices but the world has {mesh.size} "
                f"(device digits {mesh.digits})"
            )
        return tuple(out)


@lru_cache(maxsize=1 << 14)
def _parse(text: str) -> PartitionSeq:
    return PartitionSeq._parse(text)
