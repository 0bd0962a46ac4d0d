"""Stage 3 units: which submodules gather their parameters as one.

A unit is one module, or a run of consecutive sibling modules that the default
policy merged (see `default_policy`); either way it is one flat buffer per
dtype, one all-gather per use and one reduce-scatter per backward.

Unit 0 is the root (the wrapped model): it owns every parameter no other unit
claims. A parameter registered in several units' subtrees (tied weights, e.g.
an embedding shared with the output layer) belongs to their closest common
unit, so it is gathered whenever either user runs. The members of a merged
unit count as one unit there: a weight tied between two of its members stays
in it.

Why small blocks merge up to wrap()'s bucket_mb (25 MiB by default): a
collective has a fixed cost (launch and latency, ~10-50 us for NCCL and
~0.1-1 ms for gloo on CPU, plus zero_ext's hooks per unit use) that only a
transfer of several MiB hides: at 100 GB/s, 4 MiB take 40 us. DDP settled on
25 MiB buckets for this trade-off, stages 0-2 reduce in buckets of bucket_mb,
and stage 3 reduces (and gathers) one bucket per unit, so merging to
bucket_mb gives stage 3 the same collective size. DeepSpeed ZeRO-3 makes the
same call from the other side: parameters under 1e5 elements are not sharded
at all (stage3_param_persistence_threshold). Memory stays bounded: a merged
unit holds less than 3 x bucket_mb (it ends at the block that reaches
bucket_mb, and a remainder below bucket_mb may join it), and the blocks of
real models are not merged at all (a GPT-2 small block is 27 MiB in fp32).
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Dict, List, Set, Tuple, Union

import torch.nn as nn

UnitPolicy = Union[None, Set[type], Callable[[nn.Module], bool]]
Unit = Tuple[nn.Module, ...]  # its member modules: one, or consecutive siblings of one container


def _param_bytes(module: nn.Module) -> int:
    """Bytes of the parameters in `module`'s subtree, each counted once, as
    wrapped (what a unit's flat buffer holds, and what bucket_mb counts)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _split_runs(items: List[Tuple[nn.Module, int]], min_bytes: int) -> List[List[nn.Module]]:
    """Cuts a stretch of consecutive small blocks (bytes > 0) with parameter-free
    siblings between them (bytes 0) into runs: a run ends at the block that
    brings it to `min_bytes`; a remainder below it joins the run before. A run
    never starts or ends with a parameter-free module."""
    runs: List[List[nn.Module]] = []
    current: List[nn.Module] = []
    size = 0
    for module, nbytes in items:
        if nbytes == 0 and not current:
            continue  # between two runs: it stays outside both
        current.append(module)
        size += nbytes
        if nbytes and size >= min_bytes:
            runs.append(current)
            current, size = [], 0
    while current and not _has_params(current[-1]):
        current.pop()
    if current:
        if runs:
            runs[-1].extend(current)  # the remainder is consecutive with the last run: never left below the threshold
        else:
            runs.append(current)  # the whole stretch is below the threshold: one unit
    return runs


def default_policy(model: nn.Module, min_bytes: int = 0) -> List[Unit]:
    """Each child of a ModuleList/Sequential whose class repeats there and that
    has parameters (the blocks of a transformer, say) is a block. A block of at
    least `min_bytes` is a unit of its own; consecutive smaller blocks merge
    into one unit until it holds `min_bytes` (a remainder joins the unit before
    it), so a stack of tiny blocks costs a few collectives per step, not three
    per block. Parameter-free siblings between merged blocks (activations,
    dropout) become members too, so the chain from block to block stays inside
    the unit; any other sibling with parameters ends the run. `min_bytes=0`
    makes every block a unit of its own."""
    units: List[Unit] = []
    taken: Set[int] = set()  # a module registered in two containers joins only the first unit
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.children())
        counts = Counter(type(c) for c in children)
        stretch: List[Tuple[nn.Module, int]] = []

        def flush() -> None:
            units.extend(tuple(run) for run in _split_runs(stretch, min_bytes))
            stretch.clear()

        for child in children:
            has_params = _has_params(child)
            if id(child) in taken or (has_params and counts[type(child)] < 2):
                flush()  # not a block: consecutive blocks end here
                continue
            if not has_params:
                if stretch:
                    stretch.append((child, 0))
                continue
            taken.add(id(child))
            nbytes = _param_bytes(child)
            if nbytes >= min_bytes:
                flush()
                units.append((child,))
            else:
                stretch.append((child, max(nbytes, 1)))  # a block of zero-size parameters still counts as one
        flush()
    return units


def resolve_units(model: nn.Module, units: UnitPolicy, min_bytes: int = 0) -> List[Unit]:
    """The units, root first as ``(model,)``, then the rest in registration
    order (of their first member). An explicit policy makes each module it
    selects a unit of its own; the default policy merges small blocks up to
    `min_bytes` (see `default_policy`)."""
    if units is None:
        chosen = [u for u in default_policy(model, min_bytes) if model not in u]
    else:
        if isinstance(units, (set, frozenset, list, tuple)):
            classes = tuple(units)
            if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
                raise TypeError("zero_ext.wrap: units must be a set of nn.Module classes or a callable module -> bool")
            selected = [m for m in model.modules() if isinstance(m, classes) and m is not model]
        elif callable(units):
            selected = [m for m in model.modules() if m is not model and units(m)]
        else:
            raise TypeError("zero_ext.wrap: units must be a set of nn.Module classes or a callable module -> bool")
        if not selected:
            raise ValueError(
                "zero_ext.wrap: the units policy matched no submodule of the model; pass the classes of "
                "its blocks (e.g. units={MyBlock}) or leave units=None for the automatic policy"
            )
        chosen = [(m,) for m in selected]
    position = {id(m): i for i, m in enumerate(model.modules())}
    chosen.sort(key=lambda unit: position[id(unit[0])])
    return [(model,)] + chosen


def assign_parameters(model: nn.Module, units: List[Unit]) -> Dict[int, int]:
    """Maps id(parameter) to the index of the unit that owns it."""
    unit_index = {id(m): i for i, members in enumerate(units) for m in members}
    parent: Dict[int, int] = {0: -1}
    users: Dict[int, Set[int]] = {}

    def walk(module: nn.Module, current: int) -> None:
        here = unit_index.get(id(module), current)
        if here != current:
            parent[here] = current  # every member of a merged unit is a child of the same module
        for p in module._parameters.values():
            if p is not None:
                users.setdefault(id(p), set()).add(here)
        for child in module.children():
            walk(child, here)

    walk(model, 0)

    def ancestry(u: int) -> List[int]:
        path = []
        while u != -1:
            path.append(u)
            u = parent[u]
        return path

    owner: Dict[int, int] = {}
    for pid, us in users.items():
        paths = [ancestry(u) for u in us]
        common = set(paths[0]).intersection(*map(set, paths[1:]))
        owner[pid] = next(u for u in paths[0] if u in common)  # the deepest common unit
    return owner
