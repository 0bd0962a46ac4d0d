"""The collectives of a save or load (and of load_weights / save_weights):
every phase ends with every rank reporting None or its error to all
(Ranks.settle), so a failure anywhere raises everywhere at the next
exchange instead of leaving peers waiting for the timeout."""
from __future__ import annotations

import pickle
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from ..tools import all_gather_into_tensor
from .process_groups import handed_to_backend


def refuse_different_paths(paths: List[Any], who: str, reads_or_writes: str, nothing: str) -> None:
    """Every rank raises the same ValueError unless all ranks passed one path."""
    if any(p != paths[0] for p in paths):
        listed = ", ".join(f"rank {r}: {p}" for r, p in enumerate(paths))
        raise ValueError(f"{who}: ranks passed different paths ({listed}); {reads_or_writes}, so pass the same "
                         f"path on every rank. {nothing}")


class Ranks:
    """Collectives of a save or load on the model's own group (which carries
    wrap()'s timeout), or nothing for a single process. They run through the
    core's communicator (ShardedModel.group_*), as its own collectives do, so
    a failure marks the group failed and a stalled wait is diagnosed.

    Objects travel pickled between the ranks of this job, as
    torch.distributed's object collectives carry them; nothing read from a
    file is ever unpickled."""

    def __init__(self, state, operation: str = "zero_ext", across_pipeline: bool = False):
        self.operation = operation
        self.stage = state.stage
        self.group = state.process_group
        # Over every rank of the mesh (hybrid: both levels); ranks by mesh rank.
        # A tensor-parallel model: over the data-parallel mesh, then across tp
        # (groups/tensor_parallel.py); rank tp_rank * mesh size + mesh rank.
        self.tp = state.tensor_parallel if state.tensor_parallel is not None and state.tensor_parallel.size > 1 \
            else None
        self.mesh_size = state.mesh_size
        # A pipeline stage, `across_pipeline` (what every stage does alike, a
        # DCP save): across the pp group last; rank pp_rank * (the stage's
        # ranks) + the rank within the stage (`stage_rank`). Otherwise the
        # stage's own ranks only.
        pipeline = getattr(state, "pipeline", None) if across_pipeline else None
        self.pp = pipeline if pipeline is not None and pipeline.size > 1 else None
        self.distributed = (self.group is not None and state.mesh_size > 1) or self.tp is not None \
            or self.pp is not None
        self.stage_rank = (state.mesh_rank if self.group is not None and state.mesh_size > 1 else 0) + (
            self.tp.rank * state.mesh_size if self.tp is not None else 0)
        self.stage_world = state.mesh_size * (self.tp.size if self.tp is not None else 1)
        self.rank = self.stage_rank + (self.pp.rank * self.stage_world if self.pp is not None else 0)
        self.world = self.stage_world * (self.pp.size if self.pp is not None else 1)
        self.handles = state.handles
        # NCCL moves device tensors only; gloo takes host tensors.
        self.device = state.device if dist.is_initialized() and self.distributed and \
            dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    def where(self) -> str:
        """Where training stands, in the words training-time errors use."""
        try:
            done = int(self.handles.diagnostics.stats()["step_index"])
        except RuntimeError:
            return f"stage {self.stage}"
        return f"stage {self.stage}, after {done} optimizer step(s) (steps count from 0: the next is step {done})"

    def _failed(self, error: RuntimeError) -> RuntimeError:
        return RuntimeError(f"{self.operation} at {self.where()} stopped: {error}")

    def _all_gather(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        out = torch.empty(self.mesh_size * tensor.numel(), dtype=tensor.dtype, device=self.device)
        with handed_to_backend(out, tensor):
            try:
                if self.mesh_size > 1:
                    self.handles.collectives.mesh_all_gather(out, tensor, what)
                else:
                    out.copy_(tensor.view(-1))
                if self.tp is not None:
                    across = torch.empty(self.stage_world * tensor.numel(), dtype=tensor.dtype, device=self.device)
                    all_gather_into_tensor(across, out, group=self.tp.group)
                    out = across
                if self.pp is not None:
                    across = torch.empty(self.world * tensor.numel(), dtype=tensor.dtype, device=self.device)
                    all_gather_into_tensor(across, out, group=self.pp.group)
                    out = across
            except RuntimeError as error:  # a peer died or left: say where this rank was
                raise self._failed(error) from error
        return out.view(self.world, -1)

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        with handed_to_backend(tensor):
            try:
                if self.mesh_size > 1:
                    self.handles.collectives.mesh_broadcast_from_rank0(tensor, what)
                if self.tp is not None:  # tp rank 0 of each tp group holds rank 0's now
                    dist.broadcast(tensor, dist.get_global_rank(self.tp.group, 0), group=self.tp.group)
                if self.pp is not None:  # each stage's rank 0 holds its own; pp rank 0's is rank 0's
                    dist.broadcast(tensor, dist.get_global_rank(self.pp.group, 0), group=self.pp.group)
            except RuntimeError as error:
                raise self._failed(error) from error

    def gather(self, obj: Any) -> List[Any]:
        if not self.distributed:
            return [obj]
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        sizes = self._all_gather(torch.tensor([data.numel()], dtype=torch.int64, device=self.device),
                                 "checkpoint: exchanging payload sizes").view(-1).tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=self.device)
        padded[:data.numel()] = data
        everyone = self._all_gather(padded, "checkpoint: exchanging payloads").cpu()
        return [pickle.loads(everyone[r, :n].numpy().tobytes()) for r, n in enumerate(sizes)]

    def from_rank0(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        data = pickle.dumps(obj) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self._broadcast(size, "checkpoint: rank 0's payload size")
        buffer = torch.zeros(int(size.item()), dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._broadcast(buffer, "checkpoint: rank 0's payload")
        return obj if self.rank == 0 else pickle.loads(buffer.cpu().numpy().tobytes())

    def settle(self, error: Optional[BaseException], payload: Any = None, action: Optional[str] = None,
               note: str = "", on_failure: Optional[Callable[[], None]] = None) -> List[Any]:
        """Ends a phase on every rank: each sends its payload and None or its
        error; returns every rank's payload, or raises on every rank if any
        failed. Call it after every phase also when the phase raised here, so
        no rank is left waiting in a later collective.

        With `action` (an I/O phase), every rank raises a RuntimeError naming
        the failing rank, the cause and the failing rank's `note` (what it
        cleaned up). Without, every rank raises the failing rank's kind of
        error (ValueError for bad input, ...) with its message. `on_failure`
        runs first, on every rank, when a failure was reported (not when a
        peer died: then nothing is known about its files)."""
        report = None if error is None else (type(error).__name__, str(error), note)
        outcomes = self.gather((report, payload))
        failed = [(r, rep) for r, (rep, _) in enumerate(outcomes) if rep is not None]
        if not failed:
            return [p for _, p in outcomes]
        if on_failure is not None:
            on_failure()
        rank, (kind, message, their_note) = failed[0]
        also = f" (and on rank(s) {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        if action is not None:
            raise RuntimeError(f"{action} failed on rank {rank}{also}: {kind}: {message}. {their_note}".rstrip()) \
                from error
        if not self.distributed:
            raise error
        kinds = {"ValueError": ValueError, "TypeError": TypeError, "FileNotFoundError": FileNotFoundError}
        raise kinds.get(kind, RuntimeError)(
            f"{message} [raised on rank {rank} of {self.world}{also}; every rank stopped]") from error
