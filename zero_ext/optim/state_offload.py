"""An optimizer's per-parameter state kept in an offload file between steps
and streamed through memory chunk by chunk during the step: the core of
offload_optimizer="nvme" (optim/streamed_step.py drives it bucket by bucket).

    offloaded = OffloadedState(optimizer, optimizer_class, directory, rank)
    offloaded.step(lambda: optimizer_class.step(optimizer))   # instead of optimizer.step()

Between steps each parameter's state holds only what is not shaped like the
parameter (Adam's scalar "step"); its moments are in the file. A step reads
chunk k+1's state while chunk k steps (the optimizer's own step, over that
chunk's parameters only, with their state in memory), then writes chunk k's
back and lets go of it: the memory the state takes is about two chunks,
whatever the model. Exact: the same arithmetic on the same values as the
optimizer stepping everything at once, for optimizers whose update reads
one parameter at a time (every one zero_ext shards).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..tools import offload_file

CHUNK_BYTES = 64 << 20  # state bytes stepped at once (two in memory: one stepping, one read ahead)
READ_AHEAD = 1  # chunks whose reads are in flight while one steps (2 measured no faster, 16 MiB more)


def probe_state_layout(optimizer: torch.optim.Optimizer, optimizer_class: type) -> List[List[Tuple[str, torch.dtype]]]:
    """Per param group: the state entries shaped like the parameter (key,
    dtype), from one step of `optimizer_class` with the group's settings on
    a one-element parameter. Raises naming the class if it cannot be probed."""
    layouts = []
    for group in optimizer.param_groups:
        dtype = group["params"][0].dtype if group["params"] else torch.float32
        p = torch.zeros(1, dtype=dtype, requires_grad=True)
        p.grad = torch.full_like(p, 1e-3)
        hyper = {k: v for k, v in group.items() if k != "params"}
        probe = object.__new__(optimizer_class)
        try:
            torch.optim.Optimizer.__init__(probe, [{"params": [p], **hyper}], dict(optimizer.defaults))
            optimizer_class.step(probe)
        except Exception as e:  # noqa: BLE001 - any failure means: cannot stream this optimizer's state
            raise ValueError(
                f"zero_ext: cannot tell which state {optimizer_class.__name__} keeps per parameter (a probe step "
                f"on a one-element parameter failed: {type(e).__name__}: {e}); its state cannot be offloaded "
                "to files") from e
        layouts.append([(key, value.dtype) for key, value in probe.state[p].items()
                        if isinstance(value, torch.Tensor) and value.shape == p.shape])
    return layouts


def group_lists(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> List[List[torch.Tensor]]:
    """Per param group, its members of `params`, in the group's own order
    (computed once per chunk, not at every step)."""
    chosen = {id(p) for p in params}
    return [[p for p in group["params"] if id(p) in chosen] for group in optimizer.param_groups]


@contextlib.contextmanager
def stepping_only(optimizer: torch.optim.Optimizer, lists: List[List[torch.Tensor]]) -> Iterator[None]:
    """Each group lists only `lists`' entry for it (group_lists) for the duration."""
    saved = [group["params"] for group in optimizer.param_groups]
    try:
        for group, params_of_group in zip(optimizer.param_groups, lists):
            group["params"] = params_of_group
        yield
    finally:
        for group, params_of_group in zip(optimizer.param_groups, saved):
            group["params"] = params_of_group


class OffloadedState:
    """`optimizer`'s per-parameter state in an offload file under
    `directory` between steps (see the module's docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, optimizer_class: type, directory: str, rank: int,
                 chunk_bytes: int = CHUNK_BYTES, io_threads: Optional[int] = None,
                 chunks: Optional[List[List[torch.Tensor]]] = None,
                 layouts: Optional[List[List[Tuple[str, torch.dtype]]]] = None):
        """`chunks`: the caller's (zero_ext's step: whole buckets), else cut
        at `chunk_bytes` of state; `layouts`: probe_state_layout's, if the
        caller has them already."""
        self.optimizer = optimizer
        layouts = layouts if layouts is not None else probe_state_layout(optimizer, optimizer_class)
        self.keys: Dict[int, List[Tuple[str, torch.dtype]]] = {}
        self.params: List[torch.Tensor] = []
        for group, layout in zip(optimizer.param_groups, layouts):
            for p in group["params"]:
                if id(p) not in self.keys:  # a parameter listed twice has one state
                    self.keys[id(p)] = layout
                    self.params.append(p)
        sizes = {f"{key}/{i}": p.numel() * dtype.itemsize
                 for i, p in enumerate(self.params) for key, dtype in self.keys[id(p)]}
        extra = {} if io_threads is None else {"threads": io_threads}
        self.file = offload_file.OffloadFile(directory, rank, sizes, **extra)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.chunks = ([[p for p in chunk if id(p) in self.keys] for chunk in chunks] if chunks is not None
                       else self._cut(chunk_bytes))
        self.lists = [group_lists(optimizer, chunk) for chunk in self.chunks]
        self.in_file: set = set()  # ids of parameters whose state the file holds
        self._spare: Dict[Tuple[tuple, torch.dtype], List[torch.Tensor]] = {}
        self._spare_limit = self._spares_needed()

    def _cut(self, chunk_bytes: int) -> List[List[torch.Tensor]]:
        """The parameters in order, in chunks of at most `chunk_bytes` of state (at least one each)."""
        chunks: List[List[torch.Tensor]] = []
        size = 0
        for p in self.params:
            nbytes = sum(p.numel() * dtype.itemsize for _, dtype in self.keys[id(p)])
            if not chunks or size + nbytes > chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(p)
            size += nbytes
        return chunks

    def _spares_needed(self) -> int:
        """Tensors of one shape the step may keep for reuse: READ_AHEAD + 1
        chunks' worth of the most any chunk holds."""
        most = 0
        for chunk in self.chunks:
            counts: Dict[tuple, int] = {}
            for p in chunk:
                counts[tuple(p.shape)] = counts.get(tuple(p.shape), 0) + 1
            most = max([most, *counts.values()])
        return (READ_AHEAD + 1) * most

    def _region(self, p: torch.Tensor, key: str) -> str:
        return f"{key}/{self.index[id(p)]}"

    def _read(self, chunk: List[torch.Tensor]) -> List[Tuple[torch.Tensor, str, offload_file.Transfer]]:
        reads = []
        for p in chunk:
            if id(p) not in self.in_file:
                continue  # never written: the optimizer creates it, or it is in memory (loaded)
            for key, dtype in self.keys[id(p)]:
                spare = self._spare.get((tuple(p.shape), dtype))
                out = spare.pop() if spare else torch.empty(p.shape, dtype=dtype)
                reads.append((p, key, self.file.read(self._region(p, key), out)))
        return reads

    def _recycle(self, writes: List[offload_file.Transfer]) -> None:
        """Waits for `writes`; their tensors serve later reads of the same
        shape (fresh memory costs a page fault per 4 KiB), at most
        READ_AHEAD + 1 chunks' worth."""
        for transfer in writes:
            tensor = transfer.wait()
            spare = self._spare.setdefault((tuple(tensor.shape), tensor.dtype), [])
            if len(spare) < self._spare_limit:
                spare.append(tensor)

    def step(self, step_fn: Callable[[], object], before_chunk: Optional[Callable[[int], None]] = None,
             after_chunk: Optional[Callable[[int], None]] = None) -> object:
        """Runs `step_fn` (the optimizer's own step) once per chunk, over
        that chunk's parameters only, with their state read in; writes the
        state back and leaves only what is not parameter-shaped in memory.
        `before_chunk(k)` / `after_chunk(k)` run around chunk k's step (the
        caller brings the parameters themselves in and out)."""
        result = None
        writes: List[offload_file.Transfer] = []
        ahead = [self._read(chunk) for chunk in self.chunks[:READ_AHEAD]]
        for k, chunk in enumerate(self.chunks):
            if k + READ_AHEAD < len(self.chunks):
                ahead.append(self._read(self.chunks[k + READ_AHEAD]))
            current = ahead.pop(0)
            if before_chunk is not None:
                before_chunk(k)
            for p, key, transfer in current:
                self.optimizer.state[p][key] = transfer.wait()
            with stepping_only(self.optimizer, self.lists[k]):
                result = step_fn()
            self._recycle(writes)  # the chunk before: done before more memory is taken
            writes = self._write_back(chunk)
            if after_chunk is not None:
                after_chunk(k)
        self._recycle(writes)
        self._spare.clear()
        return result

    def _write_back(self, params: Sequence[torch.Tensor]) -> List[offload_file.Transfer]:
        """Starts writing the parameter-shaped state of `params` to the file
        and takes it out of the optimizer's state."""
        writes = []
        for p in params:
            state = self.optimizer.state.get(p)
            if not state:
                self.in_file.discard(id(p))  # no state (yet, or since a load that brought none)
                continue
            for key, _ in self.keys[id(p)]:
                value = state.pop(key, None)
                if value is not None:
                    writes.append(self.file.write(self._region(p, key), value.contiguous()))
            self.in_file.add(id(p))
        return writes

    @contextlib.contextmanager
    def materialized(self) -> Iterator[None]:
        """Every parameter's state in memory for the duration (a checkpoint
        reads or writes it), written back and let go of afterwards."""
        for p, key, transfer in [r for chunk in self.chunks for r in self._read(chunk)]:
            self.optimizer.state[p][key] = transfer.wait()
        try:
            yield
        finally:
            for transfer in self._write_back(self.params):
                transfer.wait()
