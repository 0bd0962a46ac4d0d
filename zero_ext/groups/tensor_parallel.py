"""Tensor parallelism underneath: a model made tensor parallel with torch's
own parallelize_module (its parameters DTensors on a 1-D "tp" mesh), sharded
by zero_ext over the data-parallel group passed as process_group.

[Note: local leaves]
zero_ext owns each DTensor parameter's local tensor as an ordinary
parameter, a "local leaf", registered in the DTensor's place under the same
name (no copy: the leaf is the local tensor's storage). Every part of
zero_ext (buckets, shards, gradient hooks, the optimizer's segments,
checkpoints) then sees plain tensors of the tp-local shape, sharded over the
data-parallel group as any parameter is. The module reads that name back as
a DTensor built over the leaf (DTensor.from_local: no copy, no
communication), so its forward runs torch's tensor-parallel collectives
untouched, and autograd carries the local gradient to the leaf, already in
the parameter's placement (from_local's backward turns a Partial gradient,
e.g. a replicated norm weight's under SequenceParallel, into the sum over
tp), where zero_ext's hooks take it like any other. Gradients are then
averaged over dp only: tensor-parallel ranks see the same data.
What needs both dimensions reads a leaf's TensorParallelSpec: the global
norm (a sum over dp of sums over tp, replicated parameters counted once),
full tensors (gathered over dp by the core, then over tp here) and
checkpoints (one part per tp rank, convert puts them together).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..tools import swap_class


def _dtensor_api():
    from torch.distributed.tensor import DTensor, Replicate, Shard
    return DTensor, Replicate, Shard


_DTENSOR: list = []  # the DTensor class, looked up once (is_dtensor runs at every unit's forward)


def is_dtensor(tensor: object) -> bool:
    if not _DTENSOR:
        try:
            _DTENSOR.append(_dtensor_api()[0])
        except ImportError:  # pragma: no cover - torch without DTensor
            _DTENSOR.append(type(None))
    return isinstance(tensor, _DTENSOR[0])


@dataclass(frozen=True)
class TensorParallelSpec:
    """How a local leaf sits in its full parameter: the tp mesh, the
    placement (Shard(dim) or Replicate), the full shape and stride."""
    mesh: object  # a 1-D DeviceMesh
    placements: tuple
    shape: torch.Size
    stride: tuple

    @property
    def shard_dim(self) -> Optional[int]:
        """The dimension split over tp, None for a replicated parameter."""
        placement = self.placements[0]
        return placement.dim if placement.is_shard() else None

    @property
    def size(self) -> int:
        return self.mesh.size()

    def local_sizes(self) -> List[int]:
        """Each tp rank's extent along shard_dim (DTensor's Shard splits as torch.chunk does)."""
        dim = self.shard_dim
        assert dim is not None
        chunks = [c.shape[0] for c in torch.empty(self.shape[dim], device="meta").chunk(self.size)]
        return chunks + [0] * (self.size - len(chunks))

    def dtensor(self, local: torch.Tensor):
        """The DTensor the module computes with, over the leaf itself."""
        DTensor, _, _ = _dtensor_api()
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=self.stride)


class TensorParallelModule:
    """Mixin in front of the class of a module holding local leaves: the
    leaves' names read as DTensors over them ([Note: local leaves]); the
    module's _parameters hold the leaves."""

    def __getattr__(self, name: str):
        specs = self.__dict__.get("_zero_ext_tp_specs")
        if specs is not None and name in specs:
            leaf = self.__dict__["_parameters"].get(name)
            return None if leaf is None else specs[name].dtensor(leaf)
        return super().__getattr__(name)  # type: ignore[misc]


@dataclass
class TensorParallel:
    """A wrapped model's tensor-parallel dimension: the tp group and each
    local leaf's spec, by id."""
    mesh: object  # the 1-D tp DeviceMesh
    group: dist.ProcessGroup
    size: int
    rank: int
    specs: Dict[int, TensorParallelSpec]  # id(local leaf) -> spec

    def spec_of(self, tensor: torch.Tensor) -> Optional[TensorParallelSpec]:
        return self.specs.get(id(tensor))

    def sums_over_tp(self, tensor: torch.Tensor) -> bool:
        """Whether a leaf's gradient norm sums over tp (split) rather than counting once (replicated)."""
        spec = self.specs.get(id(tensor))
        return spec is not None and spec.shard_dim is not None

    def check_grads_agree(self, names: Sequence[str], has: Sequence[bool], device: torch.device) -> None:
        """Collective over tp, after the dp ranks agreed which parameters got
        a gradient: every tp rank must have the same ones. A tp part unused
        in backward on one rank (an expert no token reached) would leave that
        part unstepped while the others step, and a replicated parameter
        used on some tp ranks only would drift apart: raises on every rank."""
        mask = torch.tensor([int(bool(h)) for h in has], dtype=torch.int32, device=self.device_of(
            torch.empty(0, device=device)))
        dist.all_reduce(mask, group=self.group)
        partial = [n for n, v in zip(names, mask.tolist()) if 0 < v < self.size]
        if partial:
            raise RuntimeError(
                f"zero_ext: parameter(s) {partial[:4]} of a tensor-parallel model got a gradient on some of its "
                f"{self.size} tensor-parallel ranks and not on the others in this step (their part was not used in "
                "backward there, e.g. experts no token was routed to on one rank). Those ranks' parts would not step "
                "while the others do. Use every rank's part in every forward (run an expert on zero tokens, as a "
                "grouped GEMM does), or freeze the parameter.")

    def all_reduce(self, tensor: torch.Tensor, maximum: bool) -> None:
        """In place, over tp (tensor on the device the backend moves)."""
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM, group=self.group)

    def full(self, local: torch.Tensor, spec: TensorParallelSpec) -> torch.Tensor:
        """Collective over tp: the full tensor from every tp rank's local one
        (replicated: this rank's). Uneven splits travel padded."""
        dim = spec.shard_dim
        if dim is None:
            return local
        sizes = spec.local_sizes()
        padded_shape = list(local.shape)
        padded_shape[dim] = max(sizes)
        padded = torch.zeros(padded_shape, dtype=local.dtype, device=self.device_of(local))
        padded.narrow(dim, 0, local.shape[dim]).copy_(local)
        pieces = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(pieces, padded, group=self.group)
        return torch.cat([piece.narrow(dim, 0, n) for piece, n in zip(pieces, sizes)], dim=dim).to(local.device)

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        """Where the tp group's backend moves tensors: NCCL the current CUDA
        device (full_state_dict's values are on the host), gloo the host."""
        if self.mesh.device_type == "cuda" and tensor.device.type != "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return tensor.device

    def local_of(self, full: torch.Tensor, spec: TensorParallelSpec) -> torch.Tensor:
        """This rank's part of a full tensor (a view)."""
        dim = spec.shard_dim
        if dim is None:
            return full
        sizes = spec.local_sizes()
        return full.narrow(dim, sum(sizes[:self.rank]), sizes[self.rank])


@dataclass
class _Found:
    module: torch.nn.Module
    name: str  # the attribute name in the module
    param: torch.nn.Parameter  # the DTensor parameter
    spec: TensorParallelSpec


def _check_local_part(where: str, p, spec: TensorParallelSpec) -> None:
    """This rank's part is where zero_ext puts it back together: its mesh
    coordinate numbers it in the tp group, and a split part has the extent
    DTensor's Shard gives (torch.chunk's); a DTensor built otherwise
    (from_local with other extents, a mesh out of rank order) is refused."""
    mesh = spec.mesh
    coordinate = mesh.get_local_rank()
    if dist.get_rank(mesh.get_group(0)) != coordinate:
        raise ValueError(
            f"zero_ext.wrap: parameter '{where}' is on a tensor-parallel mesh whose ranks are not in increasing "
            "order; build the mesh with init_device_mesh, which lays ranks out in order.")
    dim = spec.shard_dim
    if dim is not None and p._local_tensor.shape[dim] != spec.local_sizes()[coordinate]:
        raise ValueError(
            f"zero_ext.wrap: parameter '{where}' holds {p._local_tensor.shape[dim]} of its {spec.shape[dim]} "
            f"rows along dim {dim} on tp rank {coordinate}, where Shard({dim}) puts {spec.local_sizes()[coordinate]}; "
            "zero_ext takes DTensors split as distribute_tensor / parallelize_module split them.")


def _group_ranks(group) -> List[int]:
    return list(dist.get_process_group_ranks(group))


def data_parallel_ranks(process_group) -> List[int]:
    """Global ranks of the data-parallel group or mesh passed to wrap()."""
    if process_group is None:
        return list(range(dist.get_world_size()))
    if hasattr(process_group, "mesh") and hasattr(process_group, "get_group"):  # a DeviceMesh
        return sorted(int(r) for r in process_group.mesh.flatten().tolist())
    return _group_ranks(process_group)


def find_tensor_parallel(model: torch.nn.Module, process_group, experts: Sequence[_Found] = ()) -> List[_Found]:
    """The model's DTensor parameters, checked to be what zero_ext shards:
    on one 1-D mesh, Shard(dim) or Replicate, orthogonal to the data-parallel
    group; `experts` (groups/experts.py) are not among them. Raises
    ValueError before anything changes (every rank sees the same model and
    meshes, so every rank raises alike)."""
    expert_ids = {id(f.param) for f in experts}

    def spec_of(p, where: str) -> TensorParallelSpec:
        mesh = p.device_mesh
        if mesh.ndim != 1:
            raise ValueError(
                f"zero_ext.wrap: parameter '{where}' is a DTensor on a {mesh.ndim}-D mesh; zero_ext takes "
                "parameters made tensor parallel over one mesh dimension (parallelize_module(module, "
                "mesh['tp'], plan)) and shards them itself over the data-parallel dimension it is given. "
                "Do not apply fully_shard / FSDP before zero_ext.wrap.")
        placement = p.placements[0]
        if not (placement.is_shard() or placement.is_replicate()):
            raise ValueError(
                f"zero_ext.wrap: parameter '{where}' has the placement {placement}; zero_ext takes "
                "tensor-parallel parameters that are Shard(dim) or Replicate() (what ColwiseParallel, "
                "RowwiseParallel and SequenceParallel make).")
        return TensorParallelSpec(mesh, tuple(p.placements), p.shape, tuple(p.stride()))

    found = walk_dtensors(model, lambda p: id(p) not in expert_ids, spec_of, "a tensor-parallel")
    for name, b in model.named_buffers():
        if is_dtensor(b):
            raise ValueError(f"zero_ext.wrap: buffer '{name}' is a DTensor; zero_ext keeps buffers whole on every "
                             "rank. Keep buffers plain tensors (parallelize_module's plans leave them so).")
    if not found:
        return found
    tp_mesh = found[0].spec.mesh
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("zero_ext.wrap: the model has DTensor parameters but torch.distributed is not initialized")
    tp_ranks = _group_ranks(tp_mesh.get_group(0))
    dp_ranks = data_parallel_ranks(process_group)
    me = dist.get_rank()
    common = sorted(set(tp_ranks) & set(dp_ranks))
    if common != [me]:
        raise ValueError(
            f"zero_ext.wrap: the model is tensor parallel over ranks {tp_ranks} (its DTensor parameters' mesh), "
            f"and process_group spans ranks {dp_ranks[:16]}{' ...' if len(dp_ranks) > 16 else ''}, which share "
            f"ranks {common} with it. Pass the data-parallel dimension of the same mesh as process_group, "
            "e.g. wrap(model, optimizer, process_group=mesh['dp']) for "
            "mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))."
            + (" If these parameters are expert-parallel experts (Shard(0) over mesh['ep'], tokens dispatched to "
               "them), pass expert_process_group=mesh['dp_mod_ep'] (the ranks holding the same experts) too."
               if set(tp_ranks) <= set(dp_ranks) else ""))
    return found


def walk_dtensors(model: torch.nn.Module, wanted: Callable[[torch.Tensor], bool],
                  spec_of: Callable[[torch.Tensor, str], TensorParallelSpec], kind: str) -> List[_Found]:
    """Every DTensor parameter `wanted` takes, by module and attribute (a
    shared one once per holder), with the spec `spec_of` checks it to have
    (raising on what zero_ext cannot take), its local part checked, all on
    one mesh (`kind`: which mesh dimension, for the error)."""
    found: List[_Found] = []
    seen: Dict[int, TensorParallelSpec] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is None or not is_dtensor(p) or not wanted(p):
                continue
            where = f"{prefix}.{name}" if prefix else name
            if id(p) not in seen:
                spec = spec_of(p, where)
                _check_local_part(where, p, spec)
                if found and found[0].spec.mesh != spec.mesh:
                    raise ValueError(
                        f"zero_ext.wrap: parameters '{found[0].module.__class__.__name__}.{found[0].name}' and "
                        f"'{where}' are DTensors on different meshes; zero_ext takes {kind} mesh dimension "
                        "for the whole model.")
                seen[id(p)] = spec
            found.append(_Found(module, name, p, seen[id(p)]))
    return found


def check_supported(found: List[_Found], deferred: bool, optimizers: Sequence[torch.optim.Optimizer],
                    stage: int, elementwise: Callable[[torch.optim.Optimizer], bool]) -> None:
    """What this version does not combine with tensor parallelism, refused
    before anything changes."""
    refuse_for_local_leaves(found, deferred, optimizers, elementwise, "tensor-parallel parameters",
                            "parallelize_module it")


def refuse_for_local_leaves(found: List[_Found], deferred: bool, optimizers: Sequence[torch.optim.Optimizer],
                            elementwise: Callable[[torch.optim.Optimizer], bool], what: str, how: str) -> None:
    """What local leaves ([Note: local leaves]) do not combine with: a meta
    model (its DTensors hold no values to split), and a non-elementwise
    optimizer over them (it would step one rank's part as if whole). `what`
    names the leaves, `how` the user's step that makes them."""
    if not found:
        return
    if deferred:
        raise ValueError(
            f"zero_ext.wrap: a meta-device model (zero_ext.empty_init) with {what} is not supported; build the "
            f"model on its device, {how}, then wrap()")
    ids = {id(f.param) for f in found}
    for opt in optimizers:
        holds = any(id(p) in ids for g in opt.param_groups for p in g["params"])
        if holds and not elementwise(opt):
            raise ValueError(
                f"zero_ext.wrap: {type(opt).__name__} is not elementwise, and stepping it on the local part of "
                f"{what} would not equal stepping the full parameter (zero_ext's whole-parameter ownership steps "
                f"one rank's tensor). Step the {what} with an elementwise optimizer (AdamW, SGD, ...) and give a "
                "non-elementwise one (Muon) only plain parameters.")


def localize(found: List[_Found], optimizers: Sequence[torch.optim.Optimizer]) -> Tuple[Dict[int, TensorParallelSpec],
                                                                                       Callable[[], None]]:
    """Registers a local leaf in each DTensor parameter's place ([Note: local
    leaves]) and in the optimizers' param_groups. Returns {id(leaf): spec}
    and a function that puts the DTensors back (for a wrap() that fails)."""
    leaves: Dict[int, torch.nn.Parameter] = {}
    specs: Dict[int, TensorParallelSpec] = {}
    undo: List[Callable[[], None]] = []
    for f in found:
        if id(f.param) not in leaves:
            local = f.param._local_tensor.detach()
            leaf = torch.nn.Parameter(local if local.is_contiguous() else local.contiguous(),
                                      requires_grad=f.param.requires_grad)
            leaf._zero_ext_tp = f.spec
            leaves[id(f.param)] = leaf
            specs[id(leaf)] = f.spec
        module, name, param = f.module, f.name, f.param
        module._parameters[name] = leaves[id(param)]
        had = module.__dict__.get("_zero_ext_tp_specs")
        module.__dict__.setdefault("_zero_ext_tp_specs", {})[name] = f.spec
        old_class = type(module)
        if not isinstance(module, TensorParallelModule):
            swap_class(module, TensorParallelModule)

        def put_back(module=module, name=name, param=param, had=had, old_class=old_class):
            module._parameters[name] = param
            if had is None:
                module.__dict__.pop("_zero_ext_tp_specs", None)
            module.__class__ = old_class
        undo.append(put_back)
    for opt in optimizers:
        for group in opt.param_groups:
            before = list(group["params"])
            group["params"] = [leaves.get(id(p), p) for p in before]
            undo.append(lambda group=group, before=before: group.__setitem__("params", before))

    def restore() -> None:
        for step in reversed(undo):
            step()
    return specs, restore


def tensor_parallel_of(found: List[_Found], specs: Dict[int, TensorParallelSpec]) -> Optional[TensorParallel]:
    if not found:
        return None
    mesh = found[0].spec.mesh
    group = mesh.get_group(0)
    return TensorParallel(mesh, group, dist.get_world_size(group), dist.get_rank(group), specs)


def global_description(name: str, p: torch.Tensor) -> str:
    """A parameter as every tp rank describes it alike: full shape and placement."""
    spec = getattr(p, "_zero_ext_tp", None)
    shape = tuple(spec.shape) if spec is not None else tuple(p.shape)
    placed = f" {spec.placements}" if spec is not None else ""
    return f"'{name}' {shape}{placed} {str(p.dtype).replace('torch.', '')}" + ("" if p.requires_grad else " frozen")
