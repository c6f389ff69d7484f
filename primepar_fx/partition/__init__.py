"""The PrimePar partition space: device digits, partition sequences, DSIs and the communication they imply."""

from primepar_fx.partition.comm import (
    Collective,
    Transfer,
    alignments,
    collectives,
    phase_tensors,
    replicated_tensors,
    tensor_uses,
    transfers,
)
from primepar_fx.partition.dsi import PHASES, OpPartition, PartitionError, Phase
from primepar_fx.partition.enumerate import count_sequences, enumerate_sequences
from primepar_fx.partition.mesh import DeviceMesh, prime_factors
from primepar_fx.partition.seq import PartitionSeq, Prime, Replicate, Split

__all__ = [
    "PHASES",
    "Collective",
    "DeviceMesh",
    "OpPartition",
    "PartitionError",
    "PartitionSeq",
    "Phase",
    "Prime",
    "Replicate",
    "Split",
    "Transfer",
    "alignments",
    "collectives",
    "count_sequences",
    "enumerate_sequences",
    "phase_tensors",
    "prime_factors",
    "replicated_tensors",
    "tensor_uses",
    "transfers",
]
