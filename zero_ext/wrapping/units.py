"""Stage 3 units: which submodules gather their parameters as one.

A unit is one module, or several sibling modules gathered as one: a run of
small blocks the default policy merged, or the children of a block kept as a
ModuleDict/ModuleList (see `default_policy`). Either way it is one flat buffer
per dtype, one all-gather per use and one reduce-scatter per backward.

Unit 0 is the root (the wrapped model): it owns every parameter no other unit
claims. A parameter registered in several units' subtrees (tied weights, e.g.
an embedding shared with the output layer) belongs to their closest common
unit, so it is gathered whenever either user runs. The members of a merged
unit count as one unit there: a weight tied between two of its members stays
in it.

The default policy chooses only modules that run a forward of their own on
every rank every step. Every rank must gather the same units in the same
order: a unit one rank skips pairs the others' all-gathers with different
buffers (wrong numbers, or an abort inside gloo), and a module without a
forward of its own is never called, so its hooks never gather it. Hence:
- It walks the tree from the root down and never looks inside a module it
  chose: one unit per repeated block, nothing below the block level unless
  units= asks (the FSDP2/torchtitan recipes wrap exactly the repeated block).
  Below that level a module may run on some ranks only: the experts of an
  MoE, which routing skips when no token picks them, differently per rank.
- A block is a child of a ModuleList/Sequential whose class repeats there,
  that has parameters and a forward of its own. ModuleList, ModuleDict,
  ParameterList and ParameterDict have none: their parent calls what they
  hold. A repeated child with parameters but no forward (a block kept as
  ModuleDict({"attn": ..., "mlp": ...})) is one unit whose members are its
  children that have parameters, if each has a forward of its own; else
  nothing in it is a unit. Such a unit is never merged with other blocks:
  the members of a unit must be children of one module (assign_parameters,
  [Note: merged units] in zero_ext/runtime/hooks.py), and its neighbours are not the
  block's children.
- A container of experts is never a unit, nor is anything in it: one whose
  attribute name, or a child's class name, matches /expert/i, or one owned
  by a router: a module whose class name matches /moe|mixture.?of.?experts/i,
  or that has, beside the container, a child module or parameter named like
  a router (`_ROUTER`: gate, router, gating, routing, switch; w_gate,
  router_weight, gate_linear, ...; a `gate` without a container beside it
  is a gated MLP's), unless the container's children hold a mixture (then they
  are the layers of an MoE model, e.g. transformers' Qwen2MoeModel.layers of
  Qwen2MoeDecoderLayer). This matters for an MoE outside any block, or in a
  block whose class does not repeat; inside a repeated block the first rule
  already keeps its experts in the block's unit. Experts named otherwise
  (`ffns` of `SparseMLP` beside a `scorer`) are not recognized: a rank that
  skips one stops every rank with an error naming the unit and the units=
  to pass (zero_ext/wrapping/unit_advice.py). A name is all there is to go
  on: the policy runs before any forward, and which modules data skips shows
  only in forwards, differently per rank.
- ModuleDicts and other modules that are not blocks are looked into, so
  nanoGPT's transformer.h (a ModuleList inside a ModuleDict) is found.

Why blocks merge only while under 4 MiB (MERGE_MIB; bucket_mb when smaller):
a collective has a fixed cost (launch and latency, ~10-50 us for NCCL and
~0.1-1 ms for gloo on CPU, plus zero_ext's hooks per unit use) that a
transfer of a few MiB hides: at 100 GB/s 4 MiB take 40 us, over gloo on CPU
2-4 ms. Beyond that, a larger unit buys no speed and costs memory: stage 3
holds several buffers of a unit's size at once (the gathered unit and its
prefetch, the gradient's staging, the exchange's receive buffer, the reduced
shard), so a rank's working memory grows with its largest unit. Hence one
unit per repeated block, as FSDP2 and torchtitan wrap, and a run of tiny
blocks merged until it holds MERGE_MIB (DeepSpeed ZeRO-3 makes the same call
from the other side: parameters under 1e5 elements are not sharded at all,
stage3_param_persistence_threshold). Measured on a 14M GPT (8 blocks of
7 MiB, world 2, docs/benchmarks.md "Resident memory"): blocks merged into
27 MiB units held 1026/994/1035 MiB peak RSS per rank against DDP's
951/975/1019, one block a unit 942/955/945, at the same step time. A merged
unit holds less than 3 x MERGE_MIB (it ends at the block that reaches it,
and a remainder below it may join it).
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Callable, Dict, List, Set, Tuple, Union

import torch.nn as nn

# Consecutive blocks merge into one unit until it holds this many MiB (or
# wrap()'s bucket_mb, when smaller); a block this large is a unit of its own.
MERGE_MIB = 4.0


def merge_bytes(bucket_bytes: int) -> int:
    """The size up to which the default policy merges consecutive blocks:
    MERGE_MIB, or the bucket size when smaller (see the module's text)."""
    return min(int(bucket_bytes), int(MERGE_MIB * 2 ** 20))


UnitPolicy = Union[None, Set[type], Callable[[nn.Module], bool], List[Union[nn.Module, List[nn.Module]]]]
Unit = Tuple[nn.Module, ...]  # its member modules: one, or siblings (children of one module)

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
_EXPERT = re.compile(r"expert", re.IGNORECASE)
_MIXTURE = re.compile(r"moe|mixture.?of.?experts", re.IGNORECASE)
# A router's attribute name (Mixtral's and DeepSeek's `gate`, Switch
# Transformers' `router`, fairseq's `gate`, GShard's `w_gate`); not
# `gate_proj`, the gated MLP's projection.
_ROUTER = re.compile(r"^(w_)?(gate|gating|router|routing|switch)(_(weight|linear|layer|net|network))?$",
                     re.IGNORECASE)


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


def _has_own_forward(module: nn.Module) -> bool:
    """Whether calling `module` runs a forward of its class. ModuleList,
    ModuleDict, ParameterList and ParameterDict (and subclasses that define
    none) inherit nn.Module's, which raises: their parent calls what they
    hold, so hooks on them never fire."""
    return type(module).forward is not nn.Module.forward


def _routes(module: nn.Module) -> bool:
    """Whether `module` looks like an MoE layer: its class name, or a
    container child beside a child module with parameters, or a parameter
    of its own, named like a router. A gated MLP or residual (a `gate`
    Linear and no container: the parity suite's Block, an expert's own
    GLU) is none."""
    if _MIXTURE.search(type(module).__name__):
        return True
    if not any(isinstance(c, _CONTAINERS) for c in module.children()):
        return False
    return (any(_ROUTER.match(n) and _has_params(c) for n, c in module.named_children())
            or any(_ROUTER.match(n) for n, _ in module.named_parameters(recurse=False)))


def _holds_mixture(module: nn.Module) -> bool:
    """Whether `module`'s subtree holds an MoE (by class name or router) or
    experts (by attribute name): a layer of an MoE model, not one of its experts."""
    return any(_routes(m) or _EXPERT.search(name.rpartition(".")[2]) for name, m in module.named_modules())


def _holds_experts(owner: nn.Module, name: str, container: nn.Module) -> bool:
    """Whether `container` (owner's child `name`) holds experts, which routing
    may skip on some ranks: see the module docstring."""
    children = list(container.children())
    if _EXPERT.search(name) or any(_EXPERT.search(type(c).__name__) for c in children):
        return True
    return _routes(owner) and not any(_holds_mixture(c) for c in children)


def _members_of_forwardless_block(block: nn.Module, taken: Set[int]) -> Unit:
    """A block without a forward of its own (a ModuleDict of attn and mlp) as
    one unit: its children that have parameters, if each has a forward and
    is in no other unit; else () (it stays in the enclosing unit). Children
    without parameters are left out: nothing to gather, and no hooks on an
    activation shared between blocks."""
    members = tuple(c for c in block.children() if _has_params(c))
    if all(_has_own_forward(c) and id(c) not in taken for c in members):
        return members
    return ()


def default_policy(model: nn.Module, min_bytes: int = 0) -> List[Unit]:
    """The blocks below `model` (see the module docstring for which), walked
    top-down, never below a chosen block. A block of at least `min_bytes` is
    a unit of its own; consecutive smaller blocks merge into one unit until
    it holds `min_bytes` (a remainder joins the unit before it), so a stack
    of tiny blocks costs a few collectives per step, not three per block.
    Parameter-free siblings between merged blocks (activations, dropout)
    become members too, so the chain from block to block stays inside the
    unit; any other sibling with parameters ends the run, and a block
    without a forward of its own is a unit of its own (its children).
    `min_bytes=0` makes every block a unit of its own."""
    units: List[Unit] = []
    taken: Set[int] = set()  # a module registered in two containers joins only the first unit
    visited: Set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in visited:
            return
        visited.add(id(module))
        holds_blocks = isinstance(module, (nn.ModuleList, nn.Sequential))
        counts = Counter(type(c) for c in module.children())
        stretch: List[Tuple[nn.Module, int]] = []

        def flush() -> None:
            units.extend(tuple(run) for run in _split_runs(stretch, min_bytes))
            stretch.clear()

        for name, child in module.named_children():
            if id(child) in taken or (isinstance(child, _CONTAINERS) and _holds_experts(module, name, child)):
                flush()  # consecutive blocks end here; experts stay in the enclosing unit
                continue
            if not _has_params(child):
                if stretch:
                    stretch.append((child, 0))
                continue
            if not holds_blocks or counts[type(child)] < 2:
                flush()  # not a block: look for blocks inside it
                visit(child)
                continue
            if not _has_own_forward(child):
                flush()
                members = _members_of_forwardless_block(child, taken)
                if members:
                    units.append(members)
                    taken.update(id(m) for m in members)
                continue
            taken.add(id(child))
            nbytes = _param_bytes(child)
            if nbytes >= min_bytes:
                flush()
                units.append((child,))
            else:
                stretch.append((child, max(nbytes, 1)))  # a block of zero-size parameters still counts as one
        flush()

    visit(model)
    return units


def _refuse_forwardless(model: nn.Module, selected: List[nn.Module]) -> None:
    """An explicit policy that selects a module without a forward of its own
    would make a unit its hooks never gather: refused at wrap, by path."""
    forwardless = {id(m) for m in selected if not _has_own_forward(m)}
    if forwardless:
        path, module = next((n, m) for n, m in model.named_modules() if id(m) in forwardless)
        raise ValueError(
            f"zero_ext.wrap: the units policy selected {path!r} ({type(module).__name__}), which has no "
            f"forward of its own (its parent calls the modules it holds), so it would never be gathered; "
            f"pass the classes of the blocks inside it, or leave units=None for the automatic policy"
        )


def resolve_units(model: nn.Module, units: UnitPolicy, min_bytes: int = 0) -> List[Unit]:
    """The units, root first as ``(model,)``, then the rest in registration
    order (of their first member). An explicit policy makes each module it
    selects a unit of its own (each must have a forward of its own); the
    default policy merges small blocks up to `min_bytes` (see
    `default_policy`)."""
    if units is None:
        chosen = default_policy(model, min_bytes)
    elif _lists_modules(units):
        chosen = _listed_units(model, units)
    else:
        if isinstance(units, (set, frozenset, list, tuple)):
            classes = tuple(units)
            if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
                raise TypeError("zero_ext.wrap: units must be a set of nn.Module classes, a callable module -> bool, "
                            "or a list of modules and lists of modules")
            selected = [m for m in model.modules() if isinstance(m, classes) and m is not model]
        elif callable(units):
            selected = [m for m in model.modules() if m is not model and units(m)]
        else:
            raise TypeError("zero_ext.wrap: units must be a set of nn.Module classes, a callable module -> bool, "
                            "or a list of modules and lists of modules")
        if not selected:
            raise ValueError(
                "zero_ext.wrap: the units policy matched no submodule of the model; pass the classes of "
                "its blocks (e.g. units={MyBlock}) or leave units=None for the automatic policy"
            )
        _refuse_forwardless(model, selected)
        chosen = [(m,) for m in selected]
    position = {id(m): i for i, m in enumerate(model.modules())}
    chosen.sort(key=lambda unit: position[id(unit[0])])
    return [(model,)] + chosen


def _lists_modules(units: UnitPolicy) -> bool:
    return isinstance(units, (list, tuple)) and bool(units) and all(
        isinstance(u, nn.Module) or (isinstance(u, (list, tuple)) and u and all(isinstance(m, nn.Module) for m in u))
        for u in units)


def _listed_units(model: nn.Module, units) -> List[Unit]:
    """units=[module, [module, module], container, ...]: a module is a unit;
    a list of modules is one unit (gathered before the first member's
    forward, released after the last member's: [Note: merged units] in
    runtime/hooks.py), its members siblings; a container without a forward
    of its own (ModuleList, ModuleDict) stands for its children as one unit."""
    position = {id(m): i for i, m in enumerate(model.modules())}
    parent_of = {id(child): id(m) for m in model.modules() for child in m.children()}
    names = {id(m): n for n, m in model.named_modules()}
    seen: Set[int] = set()
    chosen: List[Unit] = []
    for item in units:
        members: List[nn.Module] = []
        for module in (item if isinstance(item, (list, tuple)) else [item]):
            if id(module) not in position or module is model:
                raise ValueError(f"zero_ext.wrap: units lists a {type(module).__name__} that is not a submodule "
                                 "of the model (the model itself is the root unit, always)")
            if _has_own_forward(module):
                members.append(module)
            else:  # a container: its children, which its parent's forward calls
                members.extend(c for c in module.children() if _has_params(c))
        for module in members:
            if id(module) in seen:
                raise ValueError(f"zero_ext.wrap: units lists {names[id(module)]!r} twice")
            seen.add(id(module))
        if len({parent_of[id(m)] for m in members}) > 1:
            raise ValueError("zero_ext.wrap: the modules of one unit must be children of one module "
                             f"(siblings); {[names[id(m)] for m in members]} are not")
        _refuse_forwardless(model, members)
        if members:
            chosen.append(tuple(sorted(members, key=lambda m: position[id(m)])))
    return chosen


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
