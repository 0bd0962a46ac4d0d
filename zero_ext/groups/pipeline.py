"""Pipeline stages above zero_ext: each rank wraps its stage's module (the
whole model's parameter names kept, the other stages' layers removed, as
torchtitan builds them) with wrap(..., pipeline_group=mesh["pp"]), and hands
it to torch.distributed.pipelining.

What the pp dimension needs from zero_ext, besides the core's reductions at
read ([Note: reductions at read] in csrc/backward_round.h): the global norm
sums every stage's part over this group; wrap() checks across it that the
stages hold disjoint parameters and were wrapped alike (fingerprint.py); a
DCP save writes every stage's parameters into one directory (files/dcp)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Set

import torch
import torch.distributed as dist

from ..tools import all_gather_into_tensor


# Every parameter wrap() saw held across each pp group (by group name), with
# its full bytes (before tp and dp shard it), over every stage module wrapped
# with it in this process (an interleaved schedule wraps two per rank): what
# a load of a whole-model checkpoint into one stage may find that belongs
# elsewhere, and the whole model's size (memory_report). The same on every
# rank of the group: each wrap gathers its names across it.
_NAMES_BY_GROUP: Dict[str, Dict[str, int]] = {}


@dataclass
class Pipeline:
    """A wrapped stage's pipeline dimension: the group of the ranks that hold
    the other stages of the same data-parallel replica."""
    group: dist.ProcessGroup
    size: int
    rank: int

    def all_reduce(self, tensor: torch.Tensor, maximum: bool) -> None:
        """In place, over pp (a tensor on the device the backend moves)."""
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM, group=self.group)

    def note_names(self, full_bytes: Dict[str, int]) -> None:
        """wrap(): the parameters every stage of this wrap holds, with their full bytes."""
        _NAMES_BY_GROUP.setdefault(self.group.group_name, {}).update(full_bytes)

    def names_elsewhere(self, mine: Set[str]) -> Set[str]:
        """Parameter names the other stage modules of this pipeline hold."""
        return set(_NAMES_BY_GROUP.get(self.group.group_name, {})) - mine

    def model_bytes(self) -> int:
        """The full bytes of every parameter of every stage (as wrapped so far)."""
        return sum(_NAMES_BY_GROUP.get(self.group.group_name, {}).values())

    def gather_texts(self, text: str, device: torch.device) -> List[str]:
        """Collective over pp: every stage's `text`, by pp rank (UTF-8 bytes
        in padded rows; nothing unpickled)."""
        data = text.encode()
        length = torch.tensor([len(data)], dtype=torch.int64, device=device)
        lengths = torch.empty(self.size, dtype=torch.int64, device=device)
        all_gather_into_tensor(lengths, length, group=self.group)
        longest = max(int(lengths.max()), 1)
        row = torch.zeros(longest, dtype=torch.uint8, device=device)
        if data:
            row[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        table = torch.empty(self.size * longest, dtype=torch.uint8, device=device)
        all_gather_into_tensor(table, row, group=self.group)
        rows = table.view(self.size, longest).cpu()
        return [bytes(rows[k, :int(lengths[k])].tolist()).decode() for k in range(self.size)]


def pipeline_of(pipeline_group: object) -> Optional[Pipeline]:
    """wrap()'s pipeline_group: None, a ProcessGroup or a 1-D DeviceMesh
    (mesh["pp"]) this rank belongs to. Raises TypeError / ValueError."""
    if pipeline_group is None:
        return None
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without DeviceMesh
        DeviceMesh = ()  # type: ignore[assignment,misc]
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("zero_ext.wrap: pipeline_group needs torch.distributed initialized "
                         "(torchrun, then dist.init_process_group()) before wrap().")
    if isinstance(pipeline_group, DeviceMesh):
        if pipeline_group.ndim != 1:
            raise ValueError(f"zero_ext.wrap: pipeline_group takes the pipeline dimension of the mesh, a 1-D mesh "
                             f"(mesh['pp']); got a {pipeline_group.ndim}-D mesh {pipeline_group.mesh_dim_names}.")
        group = pipeline_group.get_group(0)
    elif isinstance(pipeline_group, dist.ProcessGroup):
        group = pipeline_group
    else:
        raise TypeError(f"zero_ext.wrap: pipeline_group takes a ProcessGroup or a 1-D DeviceMesh (mesh['pp']), got "
                        f"{type(pipeline_group).__name__}.")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"zero_ext.wrap: this rank (global rank {dist.get_rank()}) is not in the pipeline_group it "
                         "passed; pass the pp group this rank's stage belongs to (mesh['pp']).")
    return Pipeline(group=group, size=dist.get_world_size(group), rank=rank)
