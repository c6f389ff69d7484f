"""primepar_fx: a torch.fx compiler that partitions transformer training across devices with PrimePar.

Pipeline: capture (torch.export) -> symbolic shapes (B, S) -> op dimension rules -> partition space (DSIs)
-> cost model -> search -> plan -> graph passes -> per-rank runtime.
"""

from primepar_fx.api import analyze, explain, plan
from primepar_fx.compiler.dynamo import backend  # also registers torch.compile(backend="primepar")
from primepar_fx.compiler.module import (
    PrimeParModule,
    RankFailureError,
    compile,
    gather_grads,
    gather_state_dict,
    load_state_dict,
)
from primepar_fx.frontend.capture import Captured, capture
from primepar_fx.frontend.specialize import ShapeSpecializationError, StaticSeqWarning
from primepar_fx.graph import OpGraph, OpNode, build_graph
from primepar_fx.partition import DeviceMesh, OpPartition, PartitionSeq, Prime, Replicate, Split
from primepar_fx.record.plan import Plan
from primepar_fx.report.explain import Explanation, explain_choice
from primepar_fx.rules.registry import MissingRuleError, register_rule

__version__ = "0.1.0"


def __getattr__(name: str):
    # primepar_fx.checkpoint.save / load, imported on first use: torch.distributed.checkpoint is slow to import,
    # which every command that never touches a checkpoint (plan, explain, dump) would otherwise pay
    if name == "checkpoint":
        import importlib

        return importlib.import_module("primepar_fx.compiler.checkpoint")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Captured",
    "DeviceMesh",
    "Explanation",
    "MissingRuleError",
    "OpGraph",
    "OpNode",
    "OpPartition",
    "PartitionSeq",
    "Plan",
    "Prime",
    "PrimeParModule",
    "RankFailureError",
    "Replicate",
    "ShapeSpecializationError",
    "Split",
    "StaticSeqWarning",
    "analyze",
    "backend",
    "compile",
    "explain",
    "explain_choice",
    "gather_grads",
    "gather_state_dict",
    "load_state_dict",
    "plan",
    "build_graph",
    "capture",
    "checkpoint",
    "register_rule",
]
