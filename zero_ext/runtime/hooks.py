"""The module hooks wrap() installs, as objects with explicit state (as FSDP2's
FSDPState does): RootHooks on the model, UnitHooks on each stage 3 unit,
MergedUnitHooks on the members of a merged unit. Each hook is one call or two
into the C++ core; the backward runs no Python (autograd_boundaries.h).

The root's pre-forward drops a stale backward round, casts inputs under mixed
precision and gathers the root unit (stage 3); its post-forward hooks the
model's outputs, so the epilogue belongs to the outermost backward through
them, and applies the fp16 loss scale there; an always-called hook after it
tells the core when the forward raised instead. A unit is gathered before its
forward, released after it, and its outputs are hooked to gather it again
before its backward.

Every hook runs eagerly, outside any graph torch.compile traces
(outside_compile). Inside one, the root's hooks take their traced form
(runtime/compiled_forward.py) and a unit's do nothing (each parameter read
gathers there, runtime/compiled_units.py): no graph break of zero_ext's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import sys
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_iter, tree_map_only, tree_unflatten

from ..groups import is_dtensor
from ..tools import outside_compile, state_of, traced_only_inline
from . import compiled_forward


def tensors_requiring_grad(output: Any) -> List[torch.Tensor]:
    """Tensors requiring grad anywhere in a forward's output: pytrees, and
    dataclasses (e.g. model outputs) that pytree does not look into."""
    found: List[torch.Tensor] = []
    stack = [output]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                found.append(item)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name) for f in dataclasses.fields(item))
        else:
            leaves = list(tree_iter(item))  # tree_flatten's recursive closure is garbage per call
            if len(leaves) == 1 and leaves[0] is item:
                continue  # a leaf that is no tensor
            stack.extend(leaves)
    return found


def _map_outputs(output: Any, fn) -> Any:
    """`output` with `fn` applied to its floating tensors that require grad,
    dataclasses included."""
    if isinstance(output, torch.Tensor):
        return fn(output) if output.requires_grad and output.is_floating_point() else output
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        changes = {f.name: _map_outputs(getattr(output, f.name), fn) for f in dataclasses.fields(output) if f.init}
        return dataclasses.replace(output, **changes)
    leaves = list(tree_iter(output))
    if len(leaves) == 1 and leaves[0] is output:
        return output
    return tree_map_only(torch.Tensor, lambda t: _map_outputs(t, fn), output)


def _grad_inputs(args: tuple, kwargs: dict) -> List[torch.Tensor]:
    """tensors_requiring_grad((args, kwargs)), fast for the usual call: tensors only, positional."""
    if not kwargs and all(type(a) is torch.Tensor for a in args):
        return [a for a in args if a.requires_grad]
    return tensors_requiring_grad((args, kwargs))


def _fed_by(inputs: List[torch.Tensor], previous: List[torch.Tensor]) -> bool:
    """Whether there are inputs and every one is among `previous` (by identity)."""
    for t in inputs:
        for o in previous:
            if t is o:
                break
        else:
            return False
    return bool(inputs)


class _UnitUse:
    """One grad-enabled forward of a stage 3 unit whose inputs require grad."""

    __slots__ = ("__weakref__",)


class SpentHooks:
    """Multi-grad hooks whose use was reported (see UnitUses.track).

    torch's multi-grad hook keeps the graph's nodes in its closures while the
    nodes hold the hook: a reference cycle that only the cyclic garbage
    collector frees, ~70 objects per stage 3 step. Once reported, a hook is of
    no further use: it is removed when the backward ends (a callback queued on
    the engine: not from inside the hook, while the engine runs it), or else
    at the next forward."""

    __slots__ = ("handles",)

    def __init__(self) -> None:
        self.handles: List[Any] = []

    def remove(self) -> None:
        while self.handles:
            self.handles.pop().remove()


class UnitUses:
    """Where a use of a stage 3 unit begins, for every hook that starts one."""

    def __init__(self, units: Any, spent: SpentHooks) -> None:
        self.units = units  # the core's Units handle (tools/core_handles.py)
        self.spent = spent

    def enter(self, u: int, args: tuple, kwargs: dict, gather: bool) -> Any:
        """One use of unit `u` begins: gathers it (`gather`) and, with grad
        enabled, passes its inputs that require grad through a C++ boundary
        node whose backward reports the use over (autograd_boundaries.h;
        [Note: when a unit's backward is over] in csrc/units.cpp), so the
        backward runs no Python. Returns the (args, kwargs) to call the module
        with, or None. Tensors that pytree cannot rebuild (inside a dataclass)
        fall back to a Python multi-grad hook (track)."""
        units = self.units
        if not torch.is_grad_enabled():
            if gather:
                units.pre_forward(u)
            return None
        if not kwargs and all(type(a) is torch.Tensor for a in args):  # the usual call: plain tensors, positional
            positions = [k for k, a in enumerate(args) if a.requires_grad]
            tensors = [args[k] for k in positions]
            passed = units.enter_unit(u, tensors) if gather else units.track_unit_inputs(u, tensors)
            if not positions:
                return None
            replaced = list(args)
            for k, t in zip(positions, passed):
                replaced[k] = t
            return tuple(replaced), kwargs
        flat, spec = tree_flatten((args, kwargs))
        positions = [k for k, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        tensors = [flat[k] for k in positions]
        opaque = [x for x in flat if dataclasses.is_dataclass(x) and not isinstance(x, type)]
        hidden = tensors_requiring_grad(opaque) if opaque else []
        if hidden:
            if gather:
                units.pre_forward(u)
            self.track(u, tensors + hidden)
            return None
        passed = units.enter_unit(u, tensors) if gather else units.track_unit_inputs(u, tensors)
        if not positions:
            return None
        for k, t in zip(positions, passed):
            flat[k] = t
        return tree_unflatten(flat, spec)

    def track(self, unit: int, inputs: List[torch.Tensor]) -> None:
        """The fallback of enter(). Reports when this use's backward is over:
        a multi-grad hook fires once the gradients of all the unit's inputs
        are computed. If the graph is dropped without a backward (a forward
        for logging, a non-reentrant checkpoint's recompute), the hook dies
        with it and the use is reported over all the same. `inputs`: the
        use's inputs that require grad."""
        units, spent = self.units, self.spent
        if not inputs:
            units.note_untracked_use(unit)
            return
        units.add_pending_use(unit)
        use, reported, handle = _UnitUse(), [False], []

        def report(*_: Any) -> None:
            if not reported[0]:
                reported[0] = True
                units.post_backward_use(unit)
                spent.handles.extend(handle)
                if torch._C._current_graph_task_id() != -1:
                    torch.autograd.Variable._execution_engine.queue_callback(spent.remove)

        def on_input_grads(grads: Any, use: _UnitUse = use) -> None:  # holds `use` alive with the graph
            report()

        handle.append(torch.autograd.graph.register_multi_grad_hook(inputs, on_input_grads, mode="all"))
        weakref.finalize(use, report)


class ModelPhase(enum.Enum):
    """Where the model is, as its root hooks see it."""

    IDLE = enum.auto()     # outside the model's forward
    FORWARD = enum.auto()  # inside it (nested forwards of the model count in depth)


class RunState(enum.Enum):
    """A merged unit within one forward of the model ([Note: merged units])."""

    CLOSED = enum.auto()  # no member ran yet in this forward, or its last member ended the run
    OPEN = enum.auto()    # its first member gathered it; its last member has not run


def _eager_or_traced(hook, traced):
    """`hook` run eagerly (outside_compile), or, while Dynamo traces the call
    it hooks, `traced` (traced into the graph) where there is one."""
    eager = outside_compile(hook)
    if traced is None:
        return eager

    def either(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return traced(*args, **kwargs)
        return eager(*args, **kwargs)

    # Traced only within the module call it hooks: a hook called from a
    # frame Dynamo left eager (a graph break in a loop) runs eagerly, with
    # the module's forward, never as a graph of its own doing nothing.
    return traced_only_inline(either)


def hook_forward(module: torch.nn.Module, pre=None, post=None, always_call: bool = False,
                 traced_pre=None, traced_post=None) -> None:
    """Registers one of zero_ext's forward hooks on `module` (pre: with
    kwargs) and remembers it, in order, for zero_ext.register_forward_method
    (runtime/forward_methods.py), which runs the same hooks around another
    method. traced_pre / traced_post: what the hook does inside a graph
    torch.compile traces (runtime/compiled_forward.py); without one, the hook
    runs eagerly there too, and Dynamo breaks the graph around it."""
    hooks = module.__dict__.setdefault("_zero_ext_forward_hooks", [])
    if pre is not None:
        pre = _eager_or_traced(pre, traced_pre)
        handle = module.register_forward_pre_hook(pre, with_kwargs=True)
        hooks.append(("pre", pre, handle.id))
    if post is not None:
        post = _eager_or_traced(post, traced_post)
        handle = module.register_forward_hook(post, always_call=always_call)
        hooks.append(("always" if always_call else "post", post, handle.id))


class RootHooks:
    """The model's own hooks (one per wrapped model)."""

    def __init__(self, module: torch.nn.Module, has_merged_units: bool) -> None:
        state = state_of(module)
        self.units = state.handles.units
        self.loss_scaling = state.handles.optimizer.loss_scaling
        self.cast_to: Optional[torch.dtype] = state.compute_dtype if state.cast_inputs else None
        self.output_dtype: Optional[torch.dtype] = state.output_dtype
        self.spent = SpentHooks()
        self.uses = UnitUses(self.units, self.spent)
        self.has_merged_units = has_merged_units
        self.depth = 0  # nested forwards of the model; tracked with merged units only
        self.runs: List[Tuple[int, "MergedUnitHooks"]] = []  # merged units opened in this forward, in order
        self.finished = False  # post_forward's core call returned; end_forward, right after it, resets it
        # The root hooks have a traced form (runtime/compiled_forward.py), and
        # at stage 3 the units' hooks do nothing in a graph, where each read
        # of a parameter gathers (runtime/compiled_units.py): torch.compile
        # over the whole model meets no graph break of zero_ext's. Not yet
        # for a tensor-parallel model, or expert-parallel experts, at stage 3 (DTensor parameters).
        self.traceable = not (state.params_sharded and (state.tensor_parallel or state.experts))
        self.handle = self.units.handle() if self.traceable else 0

    @property
    def phase(self) -> ModelPhase:
        return ModelPhase.FORWARD if self.depth > 0 else ModelPhase.IDLE

    def install(self, module: torch.nn.Module) -> None:
        if not self.traceable:
            hook_forward(module, pre=self.pre_forward, post=self.post_forward)
            hook_forward(module, post=self.end_forward, always_call=True)
            return
        handle, cast_to, output_dtype = self.handle, self.cast_to, self.output_dtype
        scales_loss = self.loss_scaling()  # fp16: on from wrap() (disable_loss_scaling turns the scale to 1)
        hook_forward(module, pre=self.pre_forward, post=self.post_forward,
                     traced_pre=lambda mod, args, kwargs: compiled_forward.pre_forward(handle, cast_to, args, kwargs),
                     traced_post=lambda mod, args, output: compiled_forward.post_forward(handle, output_dtype,
                                                                                         scales_loss, output))
        hook_forward(module, post=self.end_forward, always_call=True, traced_post=lambda mod, args, output: None)

    def _inner(self, t: torch.Tensor) -> torch.Tensor:
        # The model's own output fed back in (model(model(x))): use the tensor
        # from before its scaling boundary, or the gradient would be scaled
        # once per pass through it.
        unscaled = getattr(t, "_zero_ext_unscaled", None)
        if unscaled is not None and unscaled[0] is self.units:
            t = unscaled[1]
        if self.cast_to is not None and t.is_floating_point():
            t = t.to(self.cast_to)  # mixed precision: floating inputs compute in it too
        return t

    def _scale_boundary(self, t: torch.Tensor) -> torch.Tensor:
        # fp16: a C++ node whose backward applies the loss scale (see
        # csrc/autograd_boundaries.h); fp16 outputs come out in fp32.
        out = self.units.scale_outputs([t])[0]
        out._zero_ext_unscaled = (self.units, t)
        return out

    def pre_forward(self, mod: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        self.units.begin_forward()  # stale round dropped, shapes checked, root unit gathered
        self.spent.remove()
        if self.has_merged_units:
            if self.runs:
                # A forward nested in this model's own forward: the outer
                # one's runs are forgotten, their outputs hooked. A unit left
                # gathered is released by its next run or the epilogue.
                for u, hooks in self.runs:
                    hooks.forget_run(hook_outputs=True)
                self.runs.clear()
            self.depth += 1
        if self.cast_to is not None or self.loss_scaling():
            return tree_map_only(torch.Tensor, self._inner, (args, kwargs))
        return None

    def post_forward(self, mod: torch.nn.Module, args: Any, output: Any) -> Any:
        if self.has_merged_units:
            for u, hooks in self.runs:
                hooks.close_if_open()  # its last member did not run
            self.runs.clear()
        replaced = None
        grad = torch.is_grad_enabled()
        if grad and self.loss_scaling():
            output = replaced = _map_outputs(output, self._scale_boundary)
        outputs = tensors_requiring_grad(output) if grad else []
        with core_dispatch(outputs):
            self.units.end_forward(outputs)
        self.finished = True
        if self.output_dtype is not None:
            dtype = self.output_dtype
            replaced = tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, output)
        return replaced

    def end_forward(self, mod: torch.nn.Module, args: Any, output: Any) -> None:
        # After post_forward, and also when the forward (or a hook around it)
        # raised (always_call): then the core hears of it, as the ranks may
        # have parted ([Note: a forward that raised] in csrc/forward_raised_agreement.cpp),
        # and the runs it left open are forgotten (see pre_forward).
        finished, self.finished = self.finished, False
        if not finished:
            self.units.forward_raised(_raised_now())
        if not self.has_merged_units:
            return
        for _, hooks in self.runs:
            hooks.forget_run(hook_outputs=False)
        self.runs.clear()
        self.depth = max(self.depth - 1, 0)


def core_dispatch(outputs: List[torch.Tensor]):
    """Around a core op that takes a unit's outputs (to hook their backward):
    outputs that are DTensors (a tensor-parallel model) reach the op's own
    kernel, not DTensor's dispatch, which has no rule for zero_ext's ops and
    need none (the kernel reads no values, it hooks the tensors' autograd)."""
    if any(is_dtensor(t) for t in outputs):
        return torch._C._DisableTorchDispatch()
    return contextlib.nullcontext()


def _raised_now() -> str:
    """The exception being handled (an always-called hook runs inside torch's
    `except` around the forward), as one line for zero_ext's report."""
    error = sys.exc_info()[1]
    if error is None:
        return "an exception"
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def _traced_no_op(root: RootHooks) -> Dict[str, Any]:
    """A unit's hooks inside a traced graph: nothing (each read of a
    parameter gathers there, runtime/compiled_units.py)."""
    if not root.traceable:
        return {}
    return {"traced_pre": lambda mod, args, kwargs: None, "traced_post": lambda mod, args, output: None}


class UnitHooks:
    """A stage 3 unit of one module: gathered before each forward of it,
    released after, its outputs hooked to gather it again before backward."""

    def __init__(self, root: RootHooks, u: int) -> None:
        self.root = root
        self.units = root.units
        self.u = u

    def install(self, module: torch.nn.Module) -> None:
        hook_forward(module, pre=self.pre_forward, post=self.post_forward, **_traced_no_op(self.root))

    def pre_forward(self, mod: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        self.root.spent.remove()  # units may run without the root (called directly)
        return self.root.uses.enter(self.u, args, kwargs, gather=True)

    def post_forward(self, mod: torch.nn.Module, args: Any, output: Any) -> None:
        outputs = tensors_requiring_grad(output) if torch.is_grad_enabled() else []
        with core_dispatch(outputs):
            self.units.post_forward(self.u, outputs)


# [Note: merged units]
# The default policy merges consecutive small sibling blocks m_a..m_b into one
# unit u (see _units.default_policy); the C++ core knows only u, and these
# hooks decide when it hears of it. Inside the model's forward:
# - The first member that runs gathers u (pre_forward(u), which also
#   prefetches the next unit); a later member only checks that u is still
#   gathered (a backward or state_dict() in between may have released it) and
#   gathers it again if not.
# - A member's use is tracked as a unit's use is (see UnitUses.enter)
#   unless every input of it that requires grad is an output of the member
#   that ran just before it: then its backward ends before that member's does,
#   and the run's first tracked use covers it. `h = block(h)` loops and
#   nn.Sequential track one use per run; a member fed from elsewhere (a
#   cross-attention input, a block applied to an earlier hidden state) tracks
#   its own.
# - Every output that requires grad gathers u before its gradient flows into
#   the member that made it: the last member's through post_forward(u,
#   outputs), which also releases u; the others' through hook_regather (a C++
#   tensor hook calling pre_forward(u), which inside a backward only gathers,
#   if released), since such an output can reach the loss without passing the
#   last member (hidden states kept for a loss of their own). In the usual
#   chain, u is gathered already when they fire. They are hooked in one call
#   when the run closes (a call into the core costs ~10-40 us).
# - If the last member does not run (skipped, or an early return), the
#   model's post-forward hook releases u.
# - Members need not run consecutively: parallel ModuleLists iterated together
#   (norms[i], bases[i], ...) interleave one list's merged unit with other
#   units. u stays gathered from its first member to its last, and every
#   output that requires grad is hooked, also when a member returned nothing
#   to hook: a frozen unit is released at the run's end, and its members'
#   backward (input gradients read frozen weights) gathers it again.
# Outside the model's forward (a member called on its own, a checkpoint's
# recompute during backward) each member call is one use, gathered before and
# released after, exactly as a unit of one module.


class MergedUnitHooks:
    """The members of merged unit `u`, and its run through the model's
    current forward (see [Note: merged units])."""

    def __init__(self, root: RootHooks, u: int, members: tuple, probe: Optional[torch.Tensor]) -> None:
        self.root = root
        self.units = root.units
        self.u = u
        self.members = members
        self.probe = probe  # one of its parameters: whether it is still gathered
        self.state = RunState.CLOSED
        self._clear_run()

    def _clear_run(self) -> None:
        self.outputs: List[torch.Tensor] = []  # the previous member's outputs that require grad
        self.grad = False  # whether that member ran with grad enabled
        self.hold = False  # a member returned nothing zero_ext can hook: keep it until the epilogue
        self.to_hook: List[torch.Tensor] = []  # earlier members' outputs, hooked when the run closes

    def install(self) -> None:
        last = len(self.members) - 1
        for position, member in enumerate(self.members):
            after = self.after_last_member if position == last else self.after_member
            hook_forward(member, pre=self.before_member, post=after, **_traced_no_op(self.root))

    def _still_gathered(self) -> bool:
        # A released parameter points at an unreadable storage, never
        # resizable ([Note: unreadable released parameters] in csrc/storage_release.h).
        return self.probe is not None and self.probe.untyped_storage().resizable()

    def before_member(self, mod: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        root = self.root
        root.spent.remove()
        if root.phase is ModelPhase.IDLE:  # called on its own: a use like any unit's
            return root.uses.enter(self.u, args, kwargs, gather=True)
        if self.state is RunState.OPEN and self._still_gathered():
            if torch.is_grad_enabled() and not _fed_by(_grad_inputs(args, kwargs), self.outputs):
                return root.uses.enter(self.u, args, kwargs, gather=False)
            return None
        self.units.pre_forward(self.u)
        if self.state is RunState.CLOSED:
            self.state = RunState.OPEN
            root.runs.append((self.u, self))
        return root.uses.enter(self.u, args, kwargs, gather=False)

    def after_member(self, mod: torch.nn.Module, args: Any, output: Any) -> None:
        grad = torch.is_grad_enabled()
        outputs = tensors_requiring_grad(output) if grad else []
        if self.root.phase is ModelPhase.IDLE or self.state is RunState.CLOSED:
            with core_dispatch(outputs):
                self.units.post_forward(self.u, outputs)
            return
        if outputs:
            self.to_hook.extend(outputs)
        elif grad:
            self.hold = True
        self.outputs, self.grad = outputs, grad

    def after_last_member(self, mod: torch.nn.Module, args: Any, output: Any) -> None:
        outputs = tensors_requiring_grad(output) if torch.is_grad_enabled() else []
        if self.root.phase is ModelPhase.IDLE or self.state is RunState.CLOSED:
            with core_dispatch(outputs):
                self.units.post_forward(self.u, outputs)
            return
        self._close(outputs)

    def _close(self, outputs: List[torch.Tensor]) -> None:
        """Hooks the run's outputs for backward (one call for all of them;
        each is kept alive until then, as the next member's saved input mostly
        is anyway) and releases the unit."""
        to_hook, hold = self.to_hook, self.hold
        self.state = RunState.CLOSED
        self._clear_run()
        if hold:
            # A member returned nothing to hook: post_forward without outputs
            # keeps a trainable unit until the epilogue; a frozen one is
            # released, so the outputs that exist still gather it for the
            # backward that reads its weights (its members' input gradients).
            to_hook = to_hook + outputs
        if to_hook:
            self.units.hook_regather(to_hook, self.u)
        with core_dispatch(outputs):
            self.units.post_forward(self.u, [] if hold else outputs)

    def close_if_open(self) -> None:
        """The model's forward ends and its last member did not run."""
        if self.state is RunState.OPEN:
            with torch.set_grad_enabled(self.grad):
                self._close(self.outputs)

    def forget_run(self, hook_outputs: bool) -> None:
        """A nested forward of the model (`hook_outputs`: the outer run's
        outputs still need their regather hooks) or a forward that raised."""
        if hook_outputs and self.to_hook:
            self.units.hook_regather(self.to_hook, self.u)
        self.state = RunState.CLOSED
        self._clear_run()


def install_forward_hooks(module: torch.nn.Module, units: List[tuple], owner: Dict[int, int]) -> RootHooks:
    """Hooks the model and (stage 3) each unit. `units`: root first, each a
    tuple of its member modules (several for a merged unit; see [Note: merged
    units]); `owner`: id(parameter) -> the index of the unit that owns it."""
    has_merged_units = any(len(members) > 1 for members in units[1:])
    root = RootHooks(module, has_merged_units)
    root.install(module)
    probes: Dict[int, torch.Tensor] = {}
    if has_merged_units:
        for p in module.parameters():
            if p.numel() > 0:
                probes.setdefault(owner[id(p)], p)
    for index, members in enumerate(units[1:], start=1):
        if len(members) > 1:
            MergedUnitHooks(root, index, members, probes.get(index)).install()
        else:
            UnitHooks(root, index).install(members[0])
    return root
