"""The user's optimizer, re-pointed in place at this rank's shards.

The optimizer object, its class, its param_groups' hyperparameters and any LR
scheduler already attached to it all stay; what changes:
  - stages 1-3: each group's "params" become views of this rank's shard of the
    flat core, cut at parameter boundaries ("segments"), so per-parameter
    semantics hold exactly: a parameter with no gradient on any rank has
    grad None and is skipped, with its own step count, as in PyTorch;
  - step() is followed by an all-gather of the updated shards (a post hook,
    so a scheduler that wrapped step() before wrap() still triggers it);
  - zero_grad() and clip_grad_norm_() act on zero_ext's gradients;
  - step() is skipped when fp16 gradients overflowed on any rank, and takes
    torch.amp.GradScaler's scale and overflow flag directly (its check then
    sees every rank's shards, see GradReducer::mark_nonfinite_everywhere);
  - with offload_optimizer="cpu", Adam and AdamW step with zero_ext's C++
    kernel, which also writes the low-precision compute copy in the same pass.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Dict, List

import torch

from ..tools import attach_state, require_bool, state_of, swap_class, wait_for_snapshot
from .clip import check_tensor_parallel_grads, clip_sharded, parts_of, pipelines_of
from .cpu_adam import adam_step_
from .ownership import is_elementwise
from .streamed_step import StreamedStep

def _uses_cpu_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Offload: torch's Adam and AdamW run as zero_ext's fused C++ kernel
    (same arithmetic); anything else, or options the kernel does not have,
    runs the torch optimizer on the host tensors."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return not any(g.get("differentiable") or g.get("capturable") or g.get("fused")
                   for g in optimizer.param_groups)


@torch.no_grad()
def _cpu_adam_step(self, closure=None):
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    copies = self._zero_ext_compute_copies
    adamw = isinstance(self, torch.optim.AdamW)
    for group in self.param_groups:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:  # the layout of torch.optim.Adam's state, so checkpoints match
                state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            adam_step_(
                p, p.grad, state["exp_avg"], state["exp_avg_sq"], step=int(state["step"].item()),
                lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                decoupled_weight_decay=bool(group.get("decoupled_weight_decay", adamw)),
                amsgrad=bool(group["amsgrad"]), maximize=bool(group.get("maximize", False)),
                max_exp_avg_sq=state.get("max_exp_avg_sq"), param_lowp=copies.get(id(p)),
            )
    if copies and len(copies) == sum(len(g["params"]) for g in self.param_groups):
        state_of(self).handles.optimizer.note_compute_copy_written()
    return loss


def _streamed_step(self, closure=None):
    """offload_optimizer="nvme": the optimizer's own step (without its hooks,
    which run once around this) over each chunk of buckets in turn."""
    if self._zero_ext_cpu_adam:
        raw = _cpu_adam_step
    else:
        hooked = type(self).__bases__[1].step
        raw = getattr(hooked, "__wrapped__", hooked)
    return self._zero_ext_streamed.step(lambda: raw(self, closure))


class ZeroExtOptimizer:
    """Mixin placed in front of the user's optimizer class by wrap()."""

    # torch.amp.GradScaler then passes its scale and overflow flag to step()
    # instead of stepping on its own judgement (see step()).
    _step_supports_amp_scaling = True

    def step(self, closure=None):
        with torch.profiler.record_function("zero_ext::step"):  # a label in profiler traces
            if closure is None or not (state_of(self).whole_params or is_elementwise(type(self).__bases__[1])):
                # Only stage 0 takes optimizers that read across parameters:
                # its gradients are reduced in place by the backward itself,
                # so the optimizer may call the closure as it likes (LBFGS,
                # several times).
                return self._zero_ext_step(closure)
            # Other optimizers call a closure once, first: its backward must
            # be reduced and settled, and its overflow or non-finite
            # gradients found, before the step decides and reads gradients,
            # so it runs before settling (Lightning always passes one).
            with torch.enable_grad():
                loss = closure()
            self._zero_ext_step(None)
            return loss

    def _zero_ext_step(self, closure=None):
        # The step writes what an asynchronous save in flight may not have
        # copied yet ([Note: the snapshot of an asynchronous save]); a
        # closure's forward and backward, run before this, overlap the copy.
        wait_for_snapshot(state_of(self))
        try:
            return self._zero_ext_decided_step(closure)
        finally:  # stepped or skipped: this optimizer's part of the step is done (after its refresh)
            state_of(self).step_round.stepped(self)

    def _zero_ext_decided_step(self, closure=None):
        handles = state_of(self).handles
        # fp16 overflow or skip_nonfinite, on some rank (updates the scale):
        # decided once for all of a model's optimizers (StepRound).
        skip, decided_now = state_of(self).step_round.decide(self)
        nonfinite_skip = skip and not handles.optimizer.loss_scaling() and decided_now
        found_inf = getattr(self, "found_inf", None)  # set by torch.amp.GradScaler.step()
        if found_inf is not None:
            grad_scale = getattr(self, "grad_scale", None)
            self.found_inf = self.grad_scale = None  # handled here, not by a fused step
            if state_of(self).step_round.size > 1:
                # GradScaler decides per optimizer from this rank's tensors; zero_ext
                # marks a non-finite gradient in one optimizer's shard only, so the
                # model's optimizers (and ranks) could decide differently.
                raise RuntimeError(
                    "zero_ext: torch.amp.GradScaler with several optimizers of one wrapped model is not "
                    "supported (its per-optimizer overflow check would not agree across the optimizers and "
                    "ranks). Use zero_ext's own fp16 loss scaling, mixed_precision='fp16', which skips the "
                    "step of every optimizer of the model together.")
            if handles.optimizer.loss_scaling():
                warnings.warn(
                    "zero_ext: torch.amp.GradScaler drives this optimizer, so zero_ext's own fp16 "
                    "loss scaling is now off (both would scale the gradient). To silence this, pass "
                    "mixed_precision=zero_ext.MixedPrecision(torch.float16, loss_scale=1.0).")
                handles.optimizer.disable_loss_scaling()
            # GradScaler's overflow check read this rank's shards, which
            # zero_ext marks non-finite whenever any rank's are.
            # (A plain 0 when this rank's optimizer holds no gradient at all.)
            skip = skip or bool(found_inf.item() if isinstance(found_inf, torch.Tensor) else found_inf)
            if not skip and grad_scale is not None:
                grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, grad_scale.double().reciprocal().float().item())
        self._zero_ext_step_was_skipped = bool(skip)
        if skip:
            if nonfinite_skip:
                warnings.warn(
                    f"zero_ext: optimizer step skipped on every rank: a gradient held inf/nan on some rank "
                    f"(skip_nonfinite=True); {self.skipped_steps} step(s) skipped so far. Lower the "
                    f"learning rate, clip gradients, or look for a bad batch.")
            return None
        if self._zero_ext_streamed is not None:
            return self._zero_ext_streamed_step(closure)
        if self._zero_ext_cpu_adam:
            return self._zero_ext_cpu_adam_step(closure)
        return super().step(closure)

    # The same pre/post hooks as the torch optimizer's own step.
    _zero_ext_cpu_adam_step = torch.optim.Optimizer.profile_hook_step(_cpu_adam_step)
    _zero_ext_streamed_step = torch.optim.Optimizer.profile_hook_step(_streamed_step)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients (skip_nonfinite=True or fp16
        loss scaling), the same count on every rank."""
        return int(state_of(self).handles.diagnostics.stats()["skipped_steps"])

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step() was skipped for non-finite gradients (the
        attribute accelerate reads from every optimizer it holds)."""
        return getattr(self, "_zero_ext_step_was_skipped", False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        require_bool(set_to_none, "zero_ext: optimizer.zero_grad", "set_to_none")
        state_of(self).step_round.zero_grad(self, set_to_none)

    # In stages 1-3 (and under mixed precision) the optimizer steps zero_ext's
    # segments of this rank's shard, not the parameters: torch's state_dict()
    # would hold one rank's slice in zero_ext's layout, which loads silently
    # wrong on any other rank, world size or stage (accelerate's save_state
    # writes rank 0's for every rank).
    def _refuse_sharded_state(self, call: str) -> None:
        state = state_of(self)
        if state.sharded_optimizer:
            raise RuntimeError(
                f"zero_ext: optimizer.{call}() is refused: at stage {state.stage} the optimizer's state lives in "
                f"this rank's shard, so it cannot be saved or loaded per rank. Save and load the model and "
                f"optimizer together with zero_ext.save(path, model, optimizer) / zero_ext.load(path, model, "
                f"optimizer) on every rank (any world size or stage). With accelerate (whose accelerator.prepare reads "
                f"the optimizer's state), pass the model and optimizer to "
                f"zero_ext.integrations.accelerate.prepare first, so save_state/load_state do this.")

    def state_dict(self):  # type: ignore[override]
        self._refuse_sharded_state("state_dict")
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:  # type: ignore[override]
        self._refuse_sharded_state("load_state_dict")
        wait_for_snapshot(state_of(self))  # [Note: the snapshot of an asynchronous save]
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the global gradient (every rank's shards) in place and returns
        its total norm before clipping, like torch.nn.utils.clip_grad_norm_."""
        state = state_of(self)
        state.handles.optimizer.settle()  # late gradients reduced, .grad final
        check_tensor_parallel_grads(state)
        held = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        pipelines = pipelines_of([state])  # the other stages' parts of the norm
        if state.sharded_optimizer:
            owner_of = dict(zip(map(id, state.handles.optimizer.segments()),
                                state.handles.optimizer.segment_param_indices()))
            parts = parts_of(state, [(p, state.bucketed[owner_of[id(p)]]) for p in held])
            return clip_sharded(parts, [], max_norm, norm_type, error_if_nonfinite=False, pipelines=pipelines)
        if state.tensor_parallel is not None or state.experts is not None:  # stage 0: the local leaves themselves
            return clip_sharded(parts_of(state, [(p, p) for p in held]), [], max_norm, norm_type,
                                error_if_nonfinite=False, pipelines=pipelines)
        return clip_sharded([], [p.grad for p in held], max_norm, norm_type, error_if_nonfinite=False,
                            pipelines=pipelines)


def shard_optimizer(optimizer: torch.optim.Optimizer, state, ordered_params: List[torch.Tensor],
                    several: bool = False) -> None:
    """Re-points `optimizer` at this rank's segments of its parameters and
    installs the hooks. `several`: one of a model's optimizers (StepRound)."""
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    if state.sharded_optimizer:
        segments = state.handles.optimizer.segments()
        owners = state.handles.optimizer.segment_param_indices()
        for segment in segments:  # zero_ext.clip_grad_norm_ over the optimizer's tensors finds them
            segment._zero_ext_segment_of = weakref.ref(state)
        # A parameter listed twice in a group is stepped twice, as torch.optim
        # does with it (after its warning): its segments are listed twice too.
        listed: Dict[int, int] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                listed[id(p)] = listed.get(id(p), 0) + 1
        per_group: List[List[torch.Tensor]] = [[] for _ in optimizer.param_groups]
        for segment, owner in zip(segments, owners):
            param = ordered_params[owner]
            if id(param) in group_of:  # another optimizer's otherwise
                per_group[group_of[id(param)]].extend([segment] * listed.get(id(param), 1))
        for group, params in zip(optimizer.param_groups, per_group):
            group["params"] = params
        optimizer.state.clear()

    cpu_adam = (state.offload or state.streams_optimizer) and _uses_cpu_adam(optimizer)
    original_class = type(optimizer)
    swap_class(optimizer, ZeroExtOptimizer)
    attach_state(optimizer, state)
    optimizer._zero_ext_cpu_adam = cpu_adam
    optimizer._zero_ext_compute_copies = {}
    if optimizer._zero_ext_cpu_adam:
        copies = state.handles.optimizer.segment_compute_copies()
        optimizer._zero_ext_compute_copies = {
            id(seg): copy for seg, copy in zip(state.handles.optimizer.segments(), copies) if copy is not None}
    optimizer._zero_ext_streamed = None
    if state.handles.offload.swapped():
        optimizer._zero_ext_streamed = StreamedStep(optimizer, original_class, state, state.streams_optimizer)
        state.streamed.append(optimizer._zero_ext_streamed)
    _route_scheduler_wrapper(optimizer)
    # Which parameters this optimizer steps, by the core's index: the same on
    # every rank, so its refresh gathers the same buckets everywhere.
    mine = [i for i, p in enumerate(ordered_params) if id(p) in group_of] if several else []
    state.step_round.join(optimizer)

    managed = {id(t) for group in optimizer.param_groups for t in group["params"]}

    def before_step(opt, args, kwargs) -> None:
        state.check_parameters_unchanged()
        state.handles.optimizer.check_before_step()
        check_tensor_parallel_grads(state)
        foreign = [t for group in opt.param_groups for t in group["params"] if id(t) not in managed]
        if foreign:
            raise ValueError(
                f"zero_ext: the optimizer holds {len(foreign)} tensor(s) that zero_ext does not manage "
                f"(shapes {[tuple(t.shape) for t in foreign[:3]]}), added after zero_ext.wrap() "
                f"(optimizer.add_param_group?). Their gradients are never reduced, so the ranks would "
                f"diverge. Add every parameter group before wrap(), or wrap the model that owns them.")

    def after_step(opt, args, kwargs) -> None:
        state.handles.optimizer.after_step(mine)

    optimizer.register_step_pre_hook(before_step)
    optimizer.register_step_post_hook(after_step)


def check_step_not_patched(optimizer: torch.optim.Optimizer) -> None:
    """Before wrap() changes anything: a step replaced on the instance by
    anything but an LR scheduler would bypass zero_ext's step."""
    inner = optimizer.__dict__.get("step")
    if inner is not None and not getattr(inner, "_wrapped_by_lr_sched", False):
        raise ValueError(
            "zero_ext.wrap: optimizer.step was replaced on this optimizer object before wrap(); "
            "zero_ext's step must run (it skips overflowed fp16 steps and runs offloaded "
            "updates). Patch step after wrap(), or use optimizer.register_step_pre_hook/"
            "register_step_post_hook."
        )


def _route_scheduler_wrapper(optimizer: torch.optim.Optimizer) -> None:
    """An LR scheduler built before wrap() replaced `optimizer.step` on the
    instance with a wrapper around the original class's step, which would
    bypass zero_ext's; re-point it at the new class, keeping its bookkeeping."""
    if optimizer.__dict__.get("step") is None:
        return
    ref = weakref.ref(optimizer)

    def step(*args, **kwargs):
        opt = ref()
        opt._opt_called = True  # what the scheduler's wrapper records
        return type(opt).step(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    optimizer.step = step
