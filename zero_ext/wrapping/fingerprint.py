"""wrap()'s first collective: the ranks agree that they wrap the same model the
same way, before anything whose size depends on it is sent.

Every later collective of a model has a size fixed by its layout (buckets,
units, buffers), and gloo aborts the whole process, from a thread, when two
ranks' sizes differ. So each rank first sends a fixed-size fingerprint: one
64-bit value per field of what changes the collectives (the stage, each
parameter's name, shape, dtype and trainability in bucket order, the buckets,
the units, mixed precision, offload, ...). One all-gather (two on a hybrid
mesh) shows every rank every rank's row; where rows differ, every rank raises
the same error naming the fields and the ranks. A difference in the
parameters takes one more fixed-size exchange (per-parameter hashes, then the
first differing parameter's description) so the error names the parameter.

Before it, settle_failures: what wrap() checks that can fail on some ranks
only (an offload_path, a device, an argument one rank passes differently) is
recorded instead of raised, and one fixed-size exchange tells every rank
whether any failed; if so, every rank raises the failing ranks' errors, naming
them ([Note: one-rank failures at wrap]).
"""
from __future__ import annotations

import hashlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..groups import Pipeline, TensorParallel, Topology, exchange_device, global_description
from ..tools import all_gather_into_tensor

_DESCRIPTION_BYTES = 200
_MESSAGE_BYTES = 1024  # of each failing rank's error, in settle_failures
# The kinds of error settle_failures raises as they are; any other as RuntimeError.
_KINDS = {kind.__name__: kind for kind in (ValueError, TypeError, NotImplementedError, RuntimeError,
                                           FileNotFoundError, NotADirectoryError, PermissionError, OSError)}


def _hash(value: object) -> int:
    """A 63-bit digest that is the same on every rank (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _parameter_description(name: str, p: torch.Tensor) -> str:
    return f"'{name}' {tuple(p.shape)} {str(p.dtype).replace('torch.', '')}" + (
        "" if p.requires_grad else " frozen")


class _Table:
    """Every rank's row of one exchange, by mesh rank."""

    def __init__(self, topology: Topology, device: torch.device):
        self.topology = topology
        self.device = device

    def gather(self, row: torch.Tensor) -> torch.Tensor:
        """(mesh size, len(row)): the shard group first, then the rows across replicas."""
        t = self.topology
        row = row.to(self.device)
        table = torch.empty(t.shard_size * row.numel(), dtype=row.dtype, device=self.device)
        all_gather_into_tensor(table, row, group=t.shard_group)
        if t.replicate_group is not None:
            rows = table
            table = torch.empty(t.mesh_size * row.numel(), dtype=row.dtype, device=self.device)
            all_gather_into_tensor(table, rows, group=t.replicate_group)
        return table.view(t.mesh_size, row.numel()).cpu()


# [Note: one-rank failures at wrap]
# Much of what wrap() checks before its first collective depends on the
# rank: the offload_path on its file system, the device it materializes a
# meta model on, the model it built, the arguments it was given. Raised on
# one rank only, such an error would leave the others in the first
# collective until a timeout that names nothing (or gloo's "Connection
# closed by peer" once the failing process exits). So wrap() records any
# error of its checks instead of raising it, and every rank, failed or not,
# then takes part in settle_failures: one all-gather of (global rank, failed)
# over the wrap's ranks (the mesh, then across tp), and where a rank failed,
# one more of each rank's error text in _MESSAGE_BYTES, so every exchange has
# the same sizes on every rank. Every rank then raises the first failing
# rank's kind of error with its message, naming the rank(s). What runs after
# the groups are made and can fail on one rank (materializing a meta model,
# building the core, reserving the offload file's space) is settled the same
# way before the next collective. A rank that cannot take part (no
# torch.distributed, a process_group it is not in) raises alone, as nobody
# waits for it there.


def _error_text(error: BaseException) -> str:
    message = str(error)
    if not message.startswith("zero_ext"):
        message = f"zero_ext.wrap: {type(error).__name__}: {message}"
    return f"{type(error).__name__}\n{message}"


def settle_failures(topology: Topology, across: Sequence[Optional[dist.ProcessGroup]],
                    failure: Optional[BaseException]) -> None:
    """Collective over the wrap's ranks: this rank's mesh, then across each
    group of `across` in turn (a tensor-parallel model's tp group, a
    pipeline stage's pp group). Each rank tells whether its
    checks failed (`failure`); if any did, raises on every rank the first
    failing rank's kind of error with its message, naming the failing ranks
    by global rank ([Note: one-rank failures at wrap])."""
    device = exchange_device(topology.shard_group)
    table = _Table(topology, device)

    def gather(row: torch.Tensor) -> torch.Tensor:
        rows = table.gather(row)
        for group in across:
            if group is None:
                continue
            flat = rows.reshape(-1).to(device)
            gathered = torch.empty(dist.get_world_size(group) * flat.numel(), dtype=flat.dtype, device=device)
            all_gather_into_tensor(gathered, flat, group=group)
            rows = gathered.view(-1, row.numel()).cpu()
        return rows

    rows = gather(torch.tensor([dist.get_rank(), int(failure is not None)], dtype=torch.int64))
    if not bool(rows[:, 1].any()):
        return
    text = _error_text(failure).encode() if failure is not None else b""
    if len(text) > _MESSAGE_BYTES:
        text = text[:_MESSAGE_BYTES - 4] + b" ..."
    padded = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    padded[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    texts = gather(padded)
    by_message: Dict[Tuple[str, str], List[int]] = {}
    for k in range(rows.shape[0]):  # a rank appears twice where the groups overlap (a refused tp layout)
        rank = int(rows[k, 0])
        if int(rows[k, 1]) and not any(rank in ranks for ranks in by_message.values()):
            kind, _, message = bytes(texts[k].tolist()).rstrip(b"\0").decode(errors="replace").partition("\n")
            by_message.setdefault((kind, message), []).append(rank)
    failed = sorted(r for ranks in by_message.values() for r in ranks)
    world = len(set(rows[:, 0].tolist()))
    (kind, message), ranks = next(iter(by_message.items()))
    if len(by_message) == 1:
        shown = f"{message} [raised on {_ranks_text(sorted(ranks))} of {world}; every rank stopped]"
    else:
        shown = (f"zero_ext.wrap failed on {_ranks_text(failed)} of {world}; every rank stopped:\n  "
                 + "\n  ".join(f"on {_ranks_text(sorted(r))}: {m}" for (_, m), r in by_message.items()))
    raise _KINDS.get(kind, RuntimeError)(shown) from failure


def _ranks_by_value(column: Sequence[int]) -> Dict[int, List[int]]:
    out: Dict[int, List[int]] = {}
    for rank, value in enumerate(column):
        out.setdefault(int(value), []).append(rank)
    return out


def _ranks_text(ranks: List[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def check_ranks_agree(topology: Topology, device: torch.device,
                      fields: List[Tuple[str, object, str]],
                      parameters: List[Tuple[str, torch.Tensor]]) -> None:
    """Collective over the mesh. `fields`: (name, value, how this rank shows
    it); `parameters`: (name, parameter) in bucket order. Raises ValueError
    on every rank if any rank differs."""
    if topology.shard_group is None or topology.mesh_size < 2:
        return
    exchange_device = device if device.type == "cuda" else torch.device("cpu")
    table = _Table(topology, exchange_device)
    mine = [_hash(value) for _, value, _ in fields]
    rows = table.gather(torch.tensor(mine, dtype=torch.int64))
    differing = [k for k in range(len(fields)) if not bool((rows[:, k] == rows[0, k]).all())]
    if not differing:
        return
    lines = []
    for k in differing:
        name, _, shown = fields[k]
        groups = _ranks_by_value(rows[:, k].tolist())
        others = [ranks for value, ranks in groups.items() if value != mine[k]]
        lines.append(f"{name}: {shown} on this rank (rank {topology.mesh_rank}); different on "
                     + "; ".join(_ranks_text(r) for r in others))
    parameter_field = next(k for k, (name, _, _) in enumerate(fields) if name == "parameters")
    counts_field = next(k for k, (name, _, _) in enumerate(fields) if name == "parameter count")
    if parameter_field in differing and counts_field not in differing:
        lines.append(_first_differing_parameter(table, parameters))
    raise ValueError(
        "zero_ext.wrap: the ranks wrapped different models or options, so their collectives would not match "
        "(gloo aborts the process on such a mismatch; NCCL hangs or mixes data):\n  " + "\n  ".join(lines)
        + "\nEvery rank must build the same model (same parameters, shapes, dtypes and requires_grad in the same "
          "order) and call zero_ext.wrap() with the same options. Typical causes: a rank-dependent model "
          "config or seed that changes shapes, freezing layers on some ranks only, different command-line "
          "arguments per rank, or an earlier zero_ext.wrap() made on some ranks only.")


def _first_differing_parameter(table: _Table, parameters: List[Tuple[str, torch.Tensor]]) -> str:
    """Names the first parameter (in bucket order) some rank has differently:
    every rank runs this (the tables are the same everywhere), so the two
    extra exchanges have the same sizes on every rank."""
    hashes = torch.tensor([_hash(_parameter_description(n, p)) for n, p in parameters], dtype=torch.int64)
    rows = table.gather(hashes)
    index = next(i for i in range(rows.shape[1]) if not bool((rows[:, i] == rows[0, i]).all()))
    text = _parameter_description(*parameters[index]).encode()[:_DESCRIPTION_BYTES]
    padded = torch.zeros(_DESCRIPTION_BYTES, dtype=torch.uint8)
    padded[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    described = table.gather(padded)
    by_text: Dict[str, List[int]] = {}
    for rank in range(described.shape[0]):
        shown = bytes(described[rank].tolist()).rstrip(b"\0").decode(errors="replace")
        by_text.setdefault(shown, []).append(rank)
    return (f"parameter #{index} in bucket order: "
            + "; ".join(f"{shown} on {_ranks_text(ranks)}" for shown, ranks in by_text.items()))


def _describe_reshard(reshard, unit_names: List[str]) -> str:
    if reshard is None or not (reshard.kept or reshard.to_subgroup):
        return "every unit resharded after forward"
    parts = []
    resharded = f"resharded to {reshard.subgroup_size}"
    for units, what in ((reshard.kept, "kept gathered"), (reshard.to_subgroup, resharded)):
        if units:
            shown = ", ".join(unit_names[u] for u in units[:3]) + (", ..." if len(units) > 3 else "")
            parts.append(f"{len(units)} units {what} after forward ({shown})")
    return "; ".join(parts)


def wrap_fields(options, topology: Topology, ordered: List[torch.nn.Parameter], names: List[str],
                counts: List[int], unit_names: List[str], unit_of_bucket: List[int],
                buffers: List[Tuple[str, torch.Tensor]], deferred: bool, pooled_groups: int,
                version: str, owners: List[int], reshard=None,
                device: Optional[torch.device] = None) -> List[Tuple[str, object, str]]:
    """What changes the collectives, field by field: (name, value, shown)."""
    precision = options.precision
    parameters = [_parameter_description(n, p) for n, p in zip(names, ordered)]
    shown_precision = (f"compute {precision.compute_dtype}, reduce {precision.reduce_dtype}, "
                       f"loss scale {precision.loss_scale!r}")
    return [
        ("mesh", (topology.replicas, topology.shard_size), f"{topology.replicas} x {topology.shard_size}"),
        ("stage", options.stage, f"stage={options.stage}"),
        ("device", device.type if device is not None else None,
         f"the model on {device.type if device is not None else '?'}"),
        ("parameter count", len(ordered), f"{len(ordered)} parameters"),
        ("parameters", parameters, f"{len(parameters)} parameters, first '{names[0]}'"),
        ("buckets", (counts, options.bucket_bytes), f"{len(counts)} buckets of {options.bucket_bytes} bytes"),
        ("units", (unit_names, unit_of_bucket), f"{len(unit_names)} units ({', '.join(unit_names[1:4])}"
                                                  f"{', ...' if len(unit_names) > 4 else ''})"),
        ("mixed_precision", (str(precision.compute_dtype), str(precision.reduce_dtype), repr(precision.loss_scale),
                             precision.cast_inputs), shown_precision),
        ("optimizer sharding", owners,
         f"{sum(o >= 0 for o in owners)} of {len(owners)} parameters stepped whole on an owner rank (an optimizer "
         "that is not elementwise)" if any(o >= 0 for o in owners) else "every optimizer elementwise (flat shards)"),
        ("offload_optimizer", options.offload_optimizer, f"offload_optimizer={options.offload_optimizer!r}"),
        ("offload_params", options.offload_params, f"offload_params={options.offload_params!r}"),
        ("prefetch", options.prefetch, f"prefetch={options.prefetch}"),
        ("max_live_mb", options.max_live_bytes, f"max_live_mb={options.max_live_bytes / 2**20:g}"),
        ("persist_kb", options.persist_bytes, f"persist_kb={options.persist_bytes / 2**10:g}"),
        ("reshard_after_forward", (reshard.kept, reshard.to_subgroup, reshard.subgroup_size) if reshard else None,
         _describe_reshard(reshard, unit_names)),
        ("skip_nonfinite", options.skip_nonfinite, f"skip_nonfinite={options.skip_nonfinite}"),
        ("compression", (options.compress_weights, options.compress_grads),
         f"compress_weights={options.compress_weights!r}, compress_grads={options.compress_grads!r}"),
        ("deferred initialization", deferred, "a meta model" if deferred else "a materialized model"),
        ("buffers", [(n, tuple(b.shape), str(b.dtype)) for n, b in buffers], f"{len(buffers)} buffers"),
        ("zero_ext groups already held", pooled_groups,
         f"{pooled_groups} pooled groups (models wrapped before on this rank)"),
        ("versions", version, version),
    ]



class _FieldTable:
    """One row per rank of `group` (a tp or pp group across the data-parallel
    mesh): its global rank, whether an earlier check failed there, and a hash
    of each field. Collective; one fixed-size row per rank, so ranks whose
    dp meshes differ still exchange it whole."""

    def __init__(self, group: dist.ProcessGroup, size: int, device: torch.device, failed_here: bool,
                 fields: List[Tuple[str, object, str]]) -> None:
        self.device = device if device.type == "cuda" else torch.device("cpu")
        self.fields = fields
        self.mine = [int(dist.get_rank()), int(failed_here)] + [_hash(value) for _, value, _ in fields]
        row = torch.tensor(self.mine, dtype=torch.int64, device=self.device)
        table = torch.empty(size * row.numel(), dtype=torch.int64, device=self.device)
        all_gather_into_tensor(table, row, group=group)
        self.table = table.view(-1, len(self.mine)).cpu()
        self.ranks = self.table[:, 0].tolist()
        self.failed = [r for r, bad in zip(self.ranks, self.table[:, 1].tolist()) if bad]

    def differences(self) -> List[str]:
        """A line per field some rank of the group has differently."""
        lines = []
        for k, (name, _, shown) in enumerate(self.fields):
            column = self.table[:, k + 2]
            if bool((column == column[0]).all()):
                continue
            others = sorted(r for r, v in zip(self.ranks, column.tolist()) if v != self.mine[k + 2])
            lines.append(f"{name}: {shown} on this rank (global rank {self.mine[0]}); different on global "
                         + _ranks_text(others))
        return lines

    def raise_if_only_earlier_failed(self, lines: List[str]) -> None:
        """Another rank's data-parallel check failed and nothing here differs: say so."""
        if self.failed and not lines:
            raise ValueError(
                f"zero_ext.wrap: global rank(s) {sorted(self.failed)} found that their data-parallel group wrapped "
                "different models or options (their error names what differs); every rank stopped.")

def check_tensor_parallel_agree(tp: TensorParallel, device: torch.device,
                                fields: List[Tuple[str, object, str]], dp_error: Optional[ValueError]) -> None:
    """Collective over this rank's tp group, after its data-parallel check:
    the fields every rank has alike whatever its tp coordinate (full shapes
    and placements, stage, options), and whether that check failed here.
    Every pair of ranks is linked through a tp group and a dp group, so a
    difference anywhere, or a dp group's failure, raises on every rank,
    never leaving another group to wait. One fixed-size row per rank: ranks
    whose dp meshes differ still exchange it whole. Raises ValueError."""
    table = _FieldTable(tp.group, tp.size, device, dp_error is not None, fields)
    if dp_error is not None:
        raise dp_error
    lines = table.differences()
    table.raise_if_only_earlier_failed(lines)
    if lines:
        raise ValueError(
            "zero_ext.wrap: the ranks of the tensor-parallel model disagree about it, so their collectives would "
            "not match:\n  " + "\n  ".join(lines)
            + "\nEvery rank must build the same mesh (init_device_mesh with the same shape and names), apply the "
              "same parallelize_module plan to the same model, and call zero_ext.wrap() with the same options and "
              "process_group=mesh['dp'].")


def tensor_parallel_fields(options, topology: Topology, tp: TensorParallel, names: List[str],
                           ordered: List[torch.nn.Parameter], unit_names: List[str]) -> List[Tuple[str, object, str]]:
    """What every rank of the dp x tp mesh has alike, field by field."""
    described = sorted(global_description(n, p) for n, p in zip(names, ordered))
    precision = options.precision
    return [
        ("mesh", (topology.replicas, topology.shard_size, tp.size),
         f"data parallel {topology.replicas} x {topology.shard_size}, tensor parallel {tp.size}"),
        ("stage", options.stage, f"stage={options.stage}"),
        ("parameters", described, f"{len(described)} parameters (full shapes and placements)"),
        ("units", unit_names, f"{len(unit_names)} units"),
        ("mixed_precision", (str(precision.compute_dtype), str(precision.reduce_dtype), repr(precision.loss_scale)),
         f"compute {precision.compute_dtype}"),
        ("offload", (options.offload_optimizer, options.offload_params),
         f"offload_optimizer={options.offload_optimizer!r}, offload_params={options.offload_params!r}"),
    ]


def check_pipeline_agree(pipeline: Pipeline, device: torch.device, fields: List[Tuple[str, object, str]],
                         names: List[str], full_bytes: List[int], earlier_error: Optional[ValueError]) -> None:
    """Collective over this rank's pp group, after its data-parallel (and
    tensor-parallel) checks: the fields every stage has alike (the
    data-parallel mesh, stage, options), whether an earlier check failed
    here, and every stage's parameter names, which must not overlap (a
    parameter held by two stages would be stepped twice, saved twice, and
    its gradient split between them). Every pair of ranks is linked through
    a pp group and a dp group, so a difference anywhere raises on every
    rank. Raises ValueError."""
    table = _FieldTable(pipeline.group, pipeline.size, device, earlier_error is not None, fields)
    held = pipeline.gather_texts("\n".join(f"{n}\t{b}" for n, b in zip(names, full_bytes)), table.device)
    if earlier_error is not None:
        raise earlier_error
    lines = table.differences()
    owner: Dict[str, int] = {}
    shared: Dict[str, List[int]] = {}
    sizes: Dict[str, int] = {}
    for stage_rank, text in enumerate(held):
        for line in filter(None, text.split("\n")):
            name, _, size = line.rpartition("\t")
            sizes[name] = int(size)
            if name in owner:
                shared.setdefault(name, [owner[name]]).append(stage_rank)
            else:
                owner[name] = stage_rank
    pipeline.note_names(sizes)
    if shared:
        shown = "; ".join(f"'{n}' on pp ranks {', '.join(map(str, r))}" for n, r in list(shared.items())[:4])
        lines.append(f"pipeline split: {len(shared)} parameter(s) held by more than one stage ({shown}"
                     f"{'; ...' if len(shared) > 4 else ''})")
    table.raise_if_only_earlier_failed(lines)
    if lines:
        raise ValueError(
            "zero_ext.wrap: the pipeline stages disagree, so their collectives or their model would not match:\n  "
            + "\n  ".join(lines)
            + "\nEvery rank must build the same mesh, split the model at the same stage boundaries (each stage keeps "
              "its own layers under the whole model's names and drops the others'), and call zero_ext.wrap() with the "
              "same options, process_group=mesh['dp'] and pipeline_group=mesh['pp'].")


def pipeline_fields(options, topology: Topology, tp_size: int, pp_size: int) -> List[Tuple[str, object, str]]:
    """What every stage of the pipeline has alike, field by field."""
    precision = options.precision
    return [
        ("mesh", (topology.replicas, topology.shard_size, tp_size, pp_size),
         f"data parallel {topology.replicas} x {topology.shard_size}, tensor parallel {tp_size}, pipeline {pp_size}"),
        ("stage", options.stage, f"stage={options.stage}"),
        ("mixed_precision", (str(precision.compute_dtype), str(precision.reduce_dtype), repr(precision.loss_scale)),
         f"compute {precision.compute_dtype}, reduce {precision.reduce_dtype}"),
        ("offload", (options.offload_optimizer, options.offload_params),
         f"offload_optimizer={options.offload_optimizer!r}, offload_params={options.offload_params!r}"),
        ("skip_nonfinite", options.skip_nonfinite, f"skip_nonfinite={options.skip_nonfinite}"),
    ]
