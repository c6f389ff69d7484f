"""Checkpoints of a compiled module and its optimizer: sharded (``torch.distributed.checkpoint``) or one file.

**Sharded** (:func:`save` / :func:`load`): a directory written by ``torch.distributed.checkpoint`` (DCP) in which
every rank writes only the blocks it holds, each described by its offsets and sizes in the whole tensor. A rank's
storage (:attr:`PrimeParModule._layouts <primepar_fx.compiler.module.PrimeParModule>`) is, per tensor dim, a set of
intervals; its block is their product, several rectangles when a dim is strided (a P(S x S) or a split merged
dim). Each rectangle is one DCP chunk. An element several ranks hold (replication) is written once, by the lowest
rank holding it, so the chunks tile the tensor exactly as DCP requires. Loading asks DCP for the rectangles of the
*loading* module's layout, and DCP reads the overlapping parts of the saved chunks: a checkpoint taken under one
plan or world size loads under any other, and in one process (``compile(..., world_size=1)``).

Why not DTensor or ShardedTensor: a DTensor placement cannot describe a P(S x S) block or a strided dim, and
ShardedTensor is deprecated and forbids overlapping (replicated) shards; DCP's planner interface (``SavePlanner``,
``LoadPlanner``, ``create_read_items_for_chunk_list``) takes explicit chunks, which is what a layout is.

The optimizer's state is sharded like the parameters: a state tensor shaped like the parameter's shard (AdamW's
``exp_avg``, ``exp_avg_sq``) gets the parameter's layout; a 0-dim one (``step``) is saved once. The optimizer's
hyperparameters and the list of entries go to ``primepar.json`` in the directory, written last, so a directory
without it is an incomplete checkpoint. Note that DCP itself writes its ``.metadata`` file with pickle: load only
directories you trust. Nothing here uses pickle.

**Consolidated** (:func:`save_consolidated` / :func:`load_consolidated`): rank 0 writes one ``torch.save`` file of
whole tensors, ``{"format", "model": {name: tensor}, "optimizer": {"state", "param_groups"} | None, "plan"}``,
which loads with ``torch.load(path, weights_only=True)`` (plain containers, numbers, strings and tensors only)
into any plan, world size or the original ``nn.Module`` (``model.load_state_dict(payload["model"])``).

Every function is collective: call it on every rank. Round trips are bit-exact.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorProperties,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from primepar_fx.compiler.module import PrimeParModule, require_compiled
from primepar_fx.compiler.pipelined import PipelinedModule
from primepar_fx.runtime.exchange import full_layout
from primepar_fx.runtime.zero import ShardedOptimizer

log = logging.getLogger(__name__)

FORMAT = "primepar-checkpoint/1"
CONSOLIDATED_FORMAT = "primepar-consolidated/1"
META_FILE = "primepar.json"
_PLAIN = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class HeldBlock:
    """A rectangle of a tensor: its ``offsets`` and ``sizes`` in the whole tensor, and where it sits locally."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local: tuple[slice, ...]


def held_blocks(layout: Any, rank: int) -> list[HeldBlock]:
    """The rectangles of ``rank``'s storage in ``layout``: one per combination of its intervals."""
    per_dim = []
    for intervals in layout[rank]:
        pieces, pos = [], 0
        for a, b in intervals:
            pieces.append((a, b - a, pos))
            pos += b - a
        per_dim.append(pieces)
    return [_block(combo) for combo in itertools.product(*per_dim)]


def owned_blocks(layout: Any, rank: int) -> list[HeldBlock]:
    """The rectangles ``rank`` writes: every element goes to the lowest rank holding it, so they tile the tensor."""
    ndim = len(layout[rank])
    cuts = [sorted({p for held in layout for iv in held[d] for p in iv}) for d in range(ndim)]
    per_dim = []
    for d, intervals in enumerate(layout[rank]):
        atoms, pos = [], 0
        for a, b in intervals:
            points = [p for p in cuts[d] if a <= p <= b]
            atoms += [(lo, hi - lo, pos + lo - a) for lo, hi in zip(points, points[1:])]
            pos += b - a
        per_dim.append(atoms)
    owned = []
    for combo in itertools.product(*per_dim):
        if not any(_holds(layout[r], combo) for r in range(rank)):
            owned.append(_block(combo))
    return owned


def _block(combo: tuple[tuple[int, int, int], ...]) -> HeldBlock:
    return HeldBlock(
        tuple(a for a, _, _ in combo), tuple(n for _, n, _ in combo), tuple(slice(p, p + n) for _, n, p in combo)
    )


def _holds(held: Any, combo: tuple[tuple[int, int, int], ...]) -> bool:
    return all(any(a <= lo and lo + n <= b for a, b in ivs) for ivs, (lo, n, _) in zip(held, combo))


# ---------------------------------------------------------------------------------------------------- entries
@dataclass
class _Entry:
    """One tensor of a checkpoint: this rank's local tensor, its layout over the ranks and its whole shape."""

    tensor: torch.Tensor
    layout: Any
    shape: tuple[int, ...]


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _one_process_is_meant() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process; that is what a one-process module means."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _scalar_entry(value: torch.Tensor, world: int) -> _Entry:
    """A 0-dim tensor every rank holds alike (``step``), stored as one element."""
    return _Entry(value.detach().reshape(1), full_layout((1,), world), (1,))


def _param_entries(module: PrimeParModule) -> dict[str, _Entry]:
    out = {}
    for fqn, p in module.local_parameters().items():
        out[f"model/{fqn}"] = _Entry(p.detach(), module._layouts[fqn], module.full_shape(fqn))
    return out


def _state_kinds(module: PrimeParModule, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """Per parameter, its optimizer state: ``"sharded"`` (shaped like the shard), ``"scalar"`` (0-dim) or a number."""
    kinds: dict[str, dict[str, Any]] = {}
    for fqn, p in module.local_parameters().items():
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == p.shape:
                kinds.setdefault(fqn, {})[key] = {"kind": "sharded", "dtype": _dtype_name(value.dtype)}
            elif isinstance(value, torch.Tensor) and value.dim() == 0:
                kinds.setdefault(fqn, {})[key] = {"kind": "scalar", "dtype": _dtype_name(value.dtype)}
            elif isinstance(value, (bool, int, float)):
                kinds.setdefault(fqn, {})[key] = {"kind": "number", "value": value}
            else:
                raise NotImplementedError(
                    f"optimizer state {key!r} of {fqn!r} is a {type(value).__name__} of shape "
                    f"{tuple(getattr(value, 'shape', ()))}: only tensors shaped like the parameter's shard, 0-dim "
                    "tensors and numbers can be checkpointed"
                )
    return kinds


def _state_entries(module: PrimeParModule, optimizer: torch.optim.Optimizer, kinds: Mapping) -> dict[str, _Entry]:
    _, world = _rank_world()
    params = module.local_parameters()
    out = {}
    for fqn, keys in kinds.items():
        state = optimizer.state[params[fqn]]
        for key, info in keys.items():
            if info["kind"] == "sharded":
                out[f"optim/{fqn}/{key}"] = _Entry(state[key].detach(), module._layouts[fqn], module.full_shape(fqn))
            elif info["kind"] == "scalar":
                out[f"optim/{fqn}/{key}"] = _scalar_entry(state[key], world)
    return out


def _groups_meta(module: PrimeParModule, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's param groups as JSON data: hyperparameters and the parameter names."""
    names = _names(module, optimizer)
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        g: dict[str, Any] = {"params": [names[id(p)] for p in group["params"]]}
        for key, value in group.items():
            if key == "params":
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value):
                value = list(value)
            if isinstance(value, _PLAIN) or isinstance(value, list):
                g[key] = value
            else:
                log.warning("param group %d: %r (a %s) is not saved", i, key, type(value).__name__)
        groups.append(g)
    return groups


def _names(module: PrimeParModule, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    names = {id(p): fqn for fqn, p in module.local_parameters().items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of the module's "
                    "shards; build it on module.parameters()"
                )
    return names


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(where: str, name: Any) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{where}: {name!r} is not a torch dtype")
    return value


# ---------------------------------------------------------------------------------------------------- DCP planners
class _SavePlanner(dcp.DefaultSavePlanner):
    """Writes each entry's owned rectangles (:func:`owned_blocks`) as DCP chunks of the whole tensor."""

    def __init__(self, entries: Mapping[str, _Entry], rank: int) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._entries = entries
        self._blocks = {(k, b.offsets): b for k, e in entries.items() for b in owned_blocks(e.layout, rank)}

    def create_local_plan(self) -> SavePlan:
        items = []
        for (key, offsets), block in self._blocks.items():
            entry = self._entries[key]
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(block.sizes))
            data = TensorWriteData(chunk, TensorProperties.create_from_tensor(entry.tensor), torch.Size(entry.shape))
            items.append(WriteItem(MetadataIndex(key, torch.Size(offsets)), WriteItemType.SHARD, tensor_data=data))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        key = write_item.index.fqn
        block = self._blocks[(key, tuple(write_item.index.offset))]  # type: ignore[arg-type]
        return self._entries[key].tensor[block.local].clone()  # compact: only the rectangle's bytes are written


class _LoadPlanner(dcp.DefaultLoadPlanner):
    """Reads into each entry's held rectangles (:func:`held_blocks`) whatever saved chunks overlap them."""

    def __init__(self, entries: Mapping[str, _Entry], rank: int) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._entries = entries
        self._blocks = {k: held_blocks(e.layout, rank) for k, e in entries.items()}

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata  # type: ignore[union-attr]
        items = []
        for key, entry in self._entries.items():
            md = saved.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"the checkpoint has no tensor {key!r}")
            if tuple(md.size) != entry.shape:
                raise ValueError(f"{key!r} has shape {tuple(md.size)} in the checkpoint, {entry.shape} here")
            chunks = [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in self._blocks[key]]
            items += create_read_items_for_chunk_list(key, md, chunks)
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        block = self._blocks[index.fqn][index.index]  # type: ignore[index]
        return self._entries[index.fqn].tensor[block.local]

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise ValueError(
            f"the checkpoint holds a non-tensor object {read_item.dest_index.fqn!r}; refusing to unpickle it"
        )


def _per_parameter(optimizer: Any) -> Any:
    """A ZeRO optimizer (:class:`~primepar_fx.runtime.zero.ShardedOptimizer`) seen per parameter, as checkpoints
    keep optimizer state; any other optimizer as it is."""
    return optimizer.as_params() if isinstance(optimizer, ShardedOptimizer) else optimizer


def _checkpointable(module: Any, what: str, optimizer: Any) -> None:
    """A compiled module (a pipelined one without an optimizer: its tied copies and per-stage ZeRO optimizers are
    not written yet); a ``TypeError`` or ``NotImplementedError`` naming ``what`` otherwise."""
    if isinstance(module, PipelinedModule):
        if optimizer is not None:
            raise NotImplementedError(
                f"{what} of a pipelined module's optimizer is not supported yet: save the module alone, or use "
                "gather_state_dict()"
            )
        return
    require_compiled(module, what)


# ---------------------------------------------------------------------------------------------------- sharded
def save(module: PrimeParModule, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None) -> Path:
    """Write ``module``'s parameters (and ``optimizer``'s state) as a sharded DCP checkpoint in directory ``path``."""
    _checkpointable(module, "checkpoint.save", optimizer)
    optimizer = _per_parameter(optimizer)
    if Path(path).exists() and not Path(path).is_dir():
        raise ValueError(f"checkpoint.save writes a directory, and {os.fspath(path)!r} is a file")
    rank, world = _rank_world()
    entries = _param_entries(module)
    meta: dict[str, Any] = {
        "format": FORMAT,
        "model": module.plan.model,
        "model_fingerprint": module.plan.model_fingerprint,
        "saved_by": {"world_size": world, "plan": module.plan.to_dict()},
        "parameters": {
            fqn: {"shape": list(shape), "dtype": _dtype_name(dtype)}
            for fqn, (shape, dtype) in module.parameter_specs().items()
        },
        "aliases": dict(module._aliases),
        "optimizer": None,
    }
    if optimizer is not None:
        kinds = _state_kinds(module, optimizer)
        entries.update(_state_entries(module, optimizer, kinds))
        meta["optimizer"] = {
            "class": type(optimizer).__name__,
            "param_groups": _groups_meta(module, optimizer),
            "state": kinds,
        }
    out = Path(path)
    with _one_process_is_meant(), module.whole_parameters():  # ZeRO-3: the parameters' values while they are read
        dcp.save(
            {k: e.tensor for k, e in entries.items()},
            storage_writer=dcp.FileSystemWriter(out),
            planner=_SavePlanner(entries, rank),
            no_dist=_no_dist(),
        )
    if rank == 0:
        _write_atomically(out / META_FILE, json.dumps(meta, indent=1, allow_nan=False).encode())
    if world > 1:
        dist.barrier()
    return out


def load(module: PrimeParModule, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a :func:`save` checkpoint into ``module`` (and ``optimizer``), whatever plan or world size wrote it.

    Names and shapes are checked, and every rank reads into fresh tensors, before any parameter or optimizer
    state changes.
    """
    _checkpointable(module, "checkpoint.load", optimizer)
    optimizer = _per_parameter(optimizer)
    rank, world = _rank_world()
    meta = read_meta(path)
    _check_parameters(module, meta["parameters"], f"{os.fspath(path)}/{META_FILE}")
    entries = {k: _Entry(torch.empty_like(e.tensor), e.layout, e.shape) for k, e in _param_entries(module).items()}
    saved_state: dict[str, dict[str, Any]] = {}
    if optimizer is not None:
        if meta["optimizer"] is None:
            raise ValueError(f"{os.fspath(path)} holds no optimizer state (it was saved without an optimizer)")
        params = module.local_parameters()
        for fqn, keys in meta["optimizer"]["state"].items():
            for key, info in keys.items():
                where = f"optimizer.state[{fqn!r}][{key!r}]"
                if info["kind"] == "sharded":
                    t = torch.empty(params[fqn].shape, dtype=_dtype(where, info["dtype"]))
                    entries[f"optim/{fqn}/{key}"] = _Entry(t, module._layouts[fqn], module.full_shape(fqn))
                elif info["kind"] == "scalar":
                    entries[f"optim/{fqn}/{key}"] = _Entry(
                        torch.empty(1, dtype=_dtype(where, info["dtype"])), full_layout((1,), world), (1,)
                    )
                else:
                    saved_state.setdefault(fqn, {})[key] = info["value"]
    with _one_process_is_meant():
        dcp.load(
            {k: e.tensor for k, e in entries.items()},
            storage_reader=dcp.FileSystemReader(Path(path)),
            planner=_LoadPlanner(entries, rank),
            no_dist=_no_dist(),
        )
    state = {fqn: entries[f"model/{fqn}"].tensor for fqn in module.local_parameters()}
    for key, entry in entries.items():
        if key.startswith("optim/"):
            _, rest = key.split("/", 1)
            fqn, name = rest.rsplit("/", 1)
            value = entry.tensor
            kind = meta["optimizer"]["state"][fqn][name]["kind"]
            saved_state.setdefault(fqn, {})[name] = value.reshape(()) if kind == "scalar" else value
    _apply(module, state, optimizer, saved_state, meta["optimizer"]["param_groups"] if optimizer else None)


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``primepar.json`` of a checkpoint directory, checked (errors name the file and the field)."""
    where = Path(path) / META_FILE
    if not where.is_file():
        raise FileNotFoundError(f"{where} is missing: {os.fspath(path)} is not a complete primepar checkpoint")
    try:
        meta = json.loads(where.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON: {e}") from None
    required = ("format", "model", "parameters", "aliases", "optimizer")
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: must be a JSON object")
    for key in required:
        if key not in meta:
            raise ValueError(f"{where}: field {key!r} is missing")
    if meta["format"] != FORMAT:
        raise ValueError(f"{where}: format {meta['format']!r} is not {FORMAT!r}")
    if not isinstance(meta["parameters"], dict):
        raise ValueError(f"{where}: parameters must be an object")
    for fqn, info in meta["parameters"].items():
        if not (isinstance(info, dict) and isinstance(info.get("shape"), list)):
            raise ValueError(f"{where}: parameters[{fqn!r}] must hold a shape list and a dtype")
        _dtype(f"{where}: parameters[{fqn!r}].dtype", info.get("dtype"))
    opt = meta["optimizer"]
    if opt is not None and not (isinstance(opt, dict) and {"param_groups", "state"} <= set(opt)):
        raise ValueError(f"{where}: optimizer must be null or hold param_groups and state")
    return meta


def _check_parameters(module: PrimeParModule, saved: Mapping[str, Any], where: str) -> None:
    ours = {fqn: list(shape) for fqn, (shape, _) in module.parameter_specs().items()}
    missing = sorted(set(ours) - set(saved))
    extra = sorted(set(saved) - set(ours))
    if missing or extra:
        raise KeyError(
            f"{where}: the checkpoint's parameters differ from the model's: missing {missing[:3]}, "
            f"unexpected {extra[:3]} ({len(missing)} missing, {len(extra)} unexpected)"
        )
    for fqn, shape in ours.items():
        if list(saved[fqn]["shape"]) != shape:
            raise ValueError(f"{where}: parameter {fqn!r} has shape {saved[fqn]['shape']} there, {shape} here")


# ---------------------------------------------------------------------------------------------------- consolidated
def save_consolidated(
    module: PrimeParModule, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None
) -> Path:
    """Gather whole tensors and write them from rank 0 as one ``torch.save`` file (module docstring)."""
    _checkpointable(module, "checkpoint.save_consolidated", optimizer)
    optimizer = _per_parameter(optimizer)
    rank, world = _rank_world()
    payload: dict[str, Any] = {
        "format": CONSOLIDATED_FORMAT,
        "model": module.gather_state_dict(),
        "optimizer": None,
        "plan": module.plan.to_json(indent=None),
    }
    if optimizer is not None:
        kinds = _state_kinds(module, optimizer)
        params = module.local_parameters()
        state: dict[str, dict[str, Any]] = {fqn: {} for fqn in kinds}
        names = sorted({k for keys in kinds.values() for k in keys})
        for key in names:  # one gather per state name, over the parameters that have it (the same on every rank)
            local = {
                f: optimizer.state[params[f]][key]
                for f, keys in kinds.items()
                if keys.get(key, {}).get("kind") == "sharded"
            }
            for fqn, full in module.gather_tensors(local).items():
                state[fqn][key] = full
        for fqn, keys in kinds.items():
            for key, info in keys.items():
                if info["kind"] == "scalar":
                    state[fqn][key] = optimizer.state[params[fqn]][key].detach().clone()
                elif info["kind"] == "number":
                    state[fqn][key] = info["value"]
        payload["optimizer"] = {"state": state, "param_groups": _groups_meta(module, optimizer)}
    out = Path(path)
    if rank == 0:
        tmp = out.with_name(f".{out.name}.tmp")
        torch.save(payload, tmp)
        os.replace(tmp, out)
    if world > 1:
        dist.barrier()
    return out


def load_consolidated(
    module: PrimeParModule, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Load a :func:`save_consolidated` file (``weights_only=True``) into ``module`` (and ``optimizer``)."""
    _checkpointable(module, "checkpoint.load_consolidated", optimizer)
    optimizer = _per_parameter(optimizer)
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != CONSOLIDATED_FORMAT:
        raise ValueError(f"{os.fspath(path)} is not a {CONSOLIDATED_FORMAT} file")
    model = payload["model"]
    other = {used: unused for unused, used in module._aliases.items()}
    full = {
        fqn: model[fqn] if fqn in model else model.get(other.get(fqn, ""), None) for fqn in module.parameter_specs()
    }
    missing = [fqn for fqn, t in full.items() if t is None]
    if missing:
        raise KeyError(f"{os.fspath(path)} lacks {len(missing)} parameters, e.g. {missing[0]!r}")
    _check_parameters(module, {f: {"shape": list(t.shape)} for f, t in full.items()}, os.fspath(path))
    state = {fqn: module.shard_tensor(fqn, full[fqn]) for fqn in module.local_parameters()}
    saved_state: dict[str, dict[str, Any]] = {}
    groups = None
    if optimizer is not None:
        if payload.get("optimizer") is None:
            raise ValueError(f"{os.fspath(path)} holds no optimizer state (it was saved without an optimizer)")
        params = module.local_parameters()
        for fqn, keys in payload["optimizer"]["state"].items():
            for key, value in keys.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    value = module.shard_tensor(fqn, value)
                    if value.shape != params[fqn].shape:
                        raise ValueError(f"optimizer state {key!r} of {fqn!r} does not match the parameter's shape")
                saved_state.setdefault(fqn, {})[key] = value
        groups = payload["optimizer"]["param_groups"]
    _apply(module, state, optimizer, saved_state, groups)


# ---------------------------------------------------------------------------------------------------- applying
def _apply(
    module: PrimeParModule,
    params: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    state: Mapping[str, Mapping[str, Any]],
    groups: list[dict[str, Any]] | None,
) -> None:
    """Copy loaded local tensors into the parameters and the optimizer; everything is checked before it changes."""
    opt_state = _optimizer_state_dict(module, optimizer, state, groups) if optimizer is not None else None
    with torch.no_grad(), module.whole_parameters(write=True):
        for fqn, value in params.items():
            for copy in module.copies(fqn):
                copy.copy_(value)
    for sharded in module._sharded:  # a ZeRO optimizer's master copies follow the new parameters
        sharded.reload()
    if optimizer is not None:
        optimizer.load_state_dict(opt_state)  # type: ignore[arg-type]


def _optimizer_state_dict(
    module: PrimeParModule,
    optimizer: torch.optim.Optimizer,
    state: Mapping[str, Mapping[str, Any]],
    groups: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """``optimizer.state_dict()``'s format, from per-name state and the saved groups matched by parameter names."""
    names = _names(module, optimizer)
    saved_of = {fqn: g for g in groups or [] for fqn in g["params"]}
    out_state: dict[int, Any] = {}
    out_groups = []
    index = 0
    for group in optimizer.param_groups:
        fqns = [names[id(p)] for p in group["params"]]
        saved = saved_of.get(fqns[0]) if fqns else None
        if saved is None or sorted(saved["params"]) != sorted(fqns):
            raise ValueError(
                f"the optimizer's param group of {fqns[:3]} does not match a saved group; build the optimizer's "
                "groups as they were when the checkpoint was saved"
            )
        g = {k: v for k, v in group.items() if k != "params"}
        for k, v in saved.items():
            if k != "params" and k in g:
                g[k] = tuple(v) if isinstance(g[k], tuple) and isinstance(v, list) else v
        g["params"] = list(range(index, index + len(fqns)))
        for i, fqn in zip(g["params"], fqns):
            if fqn in state:
                out_state[i] = dict(state[fqn])
        index += len(fqns)
        out_groups.append(g)
    return {"state": out_state, "param_groups": out_groups}


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
