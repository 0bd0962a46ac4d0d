"""offload_optimizer="nvme": the optimizer's step streamed through memory
bucket by bucket.

Between steps this rank's fp32 values (the masters, or stage 3's shards), its
gradient shards (csrc/swap_space.h, [Note: swapped buffers]) and the
optimizer's parameter-shaped state (state_offload.py) live in offload files.
A step walks the buckets in chunks of about STEP_CHUNK_BYTES: chunk k's
values, gradients and state are brought in (read ahead while chunk k-1
stepped), the optimizer's own step runs over chunk k's segments only, and
everything is parked again, written behind. Resident memory is about two
chunks whatever the model; the arithmetic is the optimizer's own on the
same values, so the result is bitwise the unstreamed step's.

The step hooks (zero_ext's own before/after step, a user's, an LR
scheduler's count) run once around the whole streamed step, not per chunk.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List

import torch

from .state_offload import READ_AHEAD, OffloadedState, group_lists, probe_state_layout, stepping_only

STEP_CHUNK_BYTES = 16 << 20  # values + gradients + state stepped at once (two chunks are in memory)


def bucket_of_segments(state) -> Dict[int, int]:
    """id(segment) -> its bucket, for the model's optimizer tensors; worked
    out once per model (the layout is fixed at wrap)."""
    if not state.bucket_of_segment:
        handles = state.handles
        triples = handles.reduction.bucket_layout()  # (first param, count, padded) per bucket
        bucket_of_param: List[int] = []
        for b in range(0, len(triples), 3):
            bucket_of_param.extend([b // 3] * triples[b + 1])
        state.bucket_of_segment.update(
            (id(s), bucket_of_param[owner])
            for s, owner in zip(handles.optimizer.segments(), handles.optimizer.segment_param_indices()))
    return state.bucket_of_segment


class StreamedStep:
    """Drives `optimizer`'s step over the model's swapped buckets (see the
    module's docstring). `state`: the model's ZeroState."""

    def __init__(self, optimizer: torch.optim.Optimizer, optimizer_class: type, state, offload_state: bool,
                 chunk_bytes: int = STEP_CHUNK_BYTES):
        self.handles = state.handles
        bucket_of = bucket_of_segments(state)
        mine = {id(t) for group in optimizer.param_groups for t in group["params"]}
        by_bucket: Dict[int, List[torch.Tensor]] = {}
        for segment in self.handles.optimizer.segments():
            if id(segment) in mine:
                by_bucket.setdefault(bucket_of[id(segment)], []).append(segment)
        state_bytes: Dict[int, int] = {}
        layouts = probe_state_layout(optimizer, optimizer_class) if offload_state else None
        if layouts is not None:
            state_bytes = {id(p): sum(dtype.itemsize for _, dtype in layout)
                           for group, layout in zip(optimizer.param_groups, layouts) for p in group["params"]}
        # Per element: the fp32 value, the fp32 gradient and the state's entries.
        self.buckets: List[List[int]] = []
        chunks: List[List[torch.Tensor]] = []
        size = 0
        for b in sorted(by_bucket):
            nbytes = sum(p.numel() * (8 + state_bytes.get(id(p), 0)) for p in by_bucket[b])
            if not chunks or size + nbytes > chunk_bytes:
                self.buckets.append([])
                chunks.append([])
                size = 0
            self.buckets[-1].append(b)
            chunks[-1].extend(by_bucket[b])
            size += nbytes
        self.optimizer = optimizer
        self.lists = [group_lists(optimizer, chunk) for chunk in chunks]
        # offload_params="nvme" alone: the state stays in memory, the shards stream.
        self.offloaded = OffloadedState(optimizer, optimizer_class, state.offload_path, max(state.shard_rank, 0),
                                        chunks=chunks, layouts=layouts) if offload_state else None

    def step(self, step_fn: Callable[[], object]) -> object:
        """`step_fn` (the optimizer's step without its hooks) once per chunk."""
        offload = self.handles.offload

        def before(k: int) -> None:
            offload.swap_in(self.buckets[k])
            for ahead in self.buckets[k + 1:k + 1 + READ_AHEAD]:  # the drive's queue stays full
                offload.swap_prefetch(ahead)

        def after(k: int) -> None:
            offload.swap_out(self.buckets[k], True, False)

        if self.offloaded is not None:
            result = self.offloaded.step(step_fn, before, after)
        else:
            result = None
            for k, lists in enumerate(self.lists):
                before(k)
                with stepping_only(self.optimizer, lists):
                    result = step_fn()
                after(k)
        offload.swap_drain()  # a step that returned has its values in the file
        return result



def gradient_chunks(state, segments: List[torch.Tensor], changed: bool) -> Iterator[List[torch.Tensor]]:
    """offload_optimizer="nvme": the gradients of `segments` (the model's
    optimizer tensors) chunk by chunk, each chunk's buckets brought in for
    its turn and parked after (written back if `changed`): a clip holds a
    chunk of gradients, never all of them. Yields each chunk's .grad tensors
    (None ones left out)."""
    handles = state.handles
    bucket_of = bucket_of_segments(state)
    by_bucket: Dict[int, List[torch.Tensor]] = {}
    for segment in segments:
        by_bucket.setdefault(bucket_of[id(segment)], []).append(segment)
    chunk: List[int] = []
    size = 0
    for b in sorted(by_bucket) + [None]:
        nbytes = 0 if b is None else sum(4 * s.numel() for s in by_bucket[b])
        if chunk and (b is None or size + nbytes > STEP_CHUNK_BYTES):
            handles.offload.swap_in_grads(chunk)
            try:
                yield [s.grad for bucket in chunk for s in by_bucket[bucket] if s.grad is not None]
            finally:
                handles.offload.swap_out_grads(chunk, changed)
            chunk, size = [], 0
        if b is not None:
            chunk.append(b)
            size += nbytes


@contextlib.contextmanager
def offload_in_memory(states, values_changed: bool = False, grads_changed: bool = False) -> Iterator[None]:
    """For the duration, every value, gradient and optimizer state entry of
    these models' (ZeroStates, None skipped) offload files in memory: a
    checkpoint reads or writes them, a clip scales the gradients. Parked
    again afterwards, written back where the caller says it changed them.
    Memory: the model's whole training state, as without offload."""
    swapped = [s for s in states if s is not None and s.handles.offload.swapped()]
    with contextlib.ExitStack() as stack:
        for state in swapped:
            everything = list(range(len(state.handles.reduction.bucket_layout()) // 3))
            state.handles.offload.swap_in(everything)
            stack.callback(state.handles.offload.swap_out, everything, values_changed, grads_changed)
            for streamed in state.streamed:
                if streamed.offloaded is not None:
                    stack.enter_context(streamed.offloaded.materialized())
        yield
