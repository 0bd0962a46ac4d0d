"""The steps of zero_ext.load that both formats take (checkpoint/load.py,
dcp/load.py): phase A's check that the checkpoint was saved from this model,
phase C's install of what was read into the optimizer and the buffers, and
the collective refresh that ends every load."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from . import plan
from ..tools import state_of


def check_same_names(where: str, saved: Dict[str, tuple], model: torch.nn.Module, strict: bool) -> None:
    """Like nn.Module.load_state_dict: names (parameters and persistent
    buffers) must match unless not strict; shapes always (a saved (1,)
    never broadcasts into a (4,))."""
    saved = {n: tuple(s) for n, s in saved.items()}
    state = state_of(model)
    mine = {n: plan.full_shape(state, p) for n, p in model.named_parameters()}
    mine.update({n: tuple(b.shape) for n, b in plan.persistent_buffers(model).items()})
    # A pipeline stage loads its part of a whole-model checkpoint: the other
    # stages' parameters are expected in it, not in this stage.
    elsewhere = state.pipeline.names_elsewhere(set(mine)) if getattr(state, "pipeline", None) is not None else set()
    missing = sorted(set(mine) - set(saved)) if strict else []
    unexpected = sorted(set(saved) - set(mine) - elsewhere) if strict else []
    shapes = sorted(n for n in set(mine) & set(saved) if mine[n] != saved[n])
    if not (missing or unexpected or shapes):
        return
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {missing[:8]}")
    if unexpected:
        problems.append(f"unexpected in it: {unexpected[:8]}")
    if shapes:
        problems.append("shapes differ: " + ", ".join(f"{n} saved {saved[n]} vs model {mine[n]}" for n in shapes[:8]))
    fix = ("; pass strict=False to load only the entries both have (shapes must still match)"
           if missing or unexpected else "; build the model with the shapes it was saved with")
    raise RuntimeError(f"zero_ext.load: {where} was saved from a different model: {'; '.join(problems)}{fix}")


def install(model, optimizer, groups: List[Optional[dict]], opt_state: Dict[torch.Tensor, dict],
            buffers: Dict[str, torch.Tensor], restored: Callable[[Any, torch.Tensor], Any]) -> None:
    """Phase C: the saved hyperparameters into each param group (None: keep
    its own), the optimizer state, each value through restored(value, its
    tensor) (the old state goes before the new reaches the device; "fresh":
    none comes), buffers."""
    for mine, theirs in zip(optimizer.param_groups, groups):
        if theirs is not None:
            mine.update({k: v for k, v in theirs.items() if k != "params"})
    optimizer.state.clear()
    for tensor, st in opt_state.items():
        optimizer.state[tensor] = {k: restored(v, tensor) for k, v in st.items()}
    for n, buf in plan.persistent_buffers(model).items():
        if n in buffers:
            buf.copy_(buffers[n])


def refresh(state) -> None:
    """After a load (collective: every rank got here): no stale gradients,
    the parameters rebuilt from the loaded shards."""
    state.handles.reduction.zero_grad(True)
    state.handles.checkpoint.refresh_params_from_shards()
