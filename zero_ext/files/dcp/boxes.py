"""Flat element ranges as DCP's rectangles, and back.

zero_ext holds a parameter's shard as a contiguous range of its flattened
(row-major) elements; DCP describes a tensor as rectangular chunks (offsets,
sizes). A flat range is a few boxes: in each dimension a partial run, then
whole sub-blocks, then a partial run (at most 2n - 1 boxes for n dimensions,
three for a matrix). Each box is itself contiguous in row-major order, so it
is a slice of the flat range reshaped: reading and writing never copy to
change layout. A box is (offsets, sizes), tuples of ints.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]


def volume(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def flat_index(shape: Sequence[int], offsets: Sequence[int]) -> int:
    """The row-major flat index of the element at `offsets`."""
    at = 0
    for extent, offset in zip(shape, offsets):
        at = at * extent + offset
    return at


def boxes_of_range(shape: Sequence[int], start: int, end: int) -> List[Box]:
    """The boxes that tile the flat elements [start, end) of a tensor of
    `shape`, in order; each is contiguous in row-major order."""
    shape = tuple(int(s) for s in shape)
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    inner = volume(shape[1:])
    rest = shape[1:]
    first, last = divmod(start, inner), divmod(end, inner)
    if first[0] == last[0]:  # inside one slice of dimension 0
        return [((first[0],) + o, (1,) + s) for o, s in boxes_of_range(rest, first[1], last[1])]
    out: List[Box] = []
    whole_from = first[0]
    if first[1]:
        out += [((first[0],) + o, (1,) + s) for o, s in boxes_of_range(rest, first[1], inner)]
        whole_from += 1
    if last[0] > whole_from:
        out.append(((whole_from,) + (0,) * len(rest), (last[0] - whole_from,) + rest))
    if last[1]:
        out += [((last[0],) + o, (1,) + s) for o, s in boxes_of_range(rest, 0, last[1])]
    return out


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The box both cover, or None."""
    offsets, sizes = [], []
    for (ao, asz, bo, bsz) in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if lo >= hi:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


def shifted(box: Box, dim: Optional[int], by: int) -> Box:
    """The box moved by `by` along `dim` (a tensor-parallel part's place in the full tensor)."""
    if dim is None or not by:
        return box
    offsets = list(box[0])
    offsets[dim] += by
    return tuple(offsets), box[1]


def narrow(tensor, within: Box, part: Box):
    """The view of `tensor` (laid out as the box `within`) covering `part`."""
    for dim, (o, s, wo) in enumerate(zip(part[0], part[1], within[0])):
        tensor = tensor.narrow(dim, o - wo, s)
    return tensor
