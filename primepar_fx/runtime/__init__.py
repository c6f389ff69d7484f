"""Per-rank runtime on torch.distributed: process groups per digit pattern, autograd-aware collectives,
point-to-point redistribution and the P(S x S) ring operator.

Everything here is device-agnostic: tensors stay on the device they arrive on, so the same code runs on gloo
(CPU) and NCCL (GPU). Every module counts the bytes its rank sends in :class:`CommStats`.
"""

from primepar_fx.runtime.collectives import AllReduce
from primepar_fx.runtime.exchange import Exchange, Redistribute
from primepar_fx.runtime.groups import ProcessGroups
from primepar_fx.runtime.ring import RingMatmul
from primepar_fx.runtime.stats import COMM_KINDS, CommStats

__all__ = ["COMM_KINDS", "AllReduce", "CommStats", "Exchange", "ProcessGroups", "Redistribute", "RingMatmul"]
