"""Bytes of model state a rank holds, for logs, demos and benchmarks, and
(process=True) the memory its process holds."""
from __future__ import annotations

import itertools
import math
import sys
import warnings
from typing import Dict

import torch

from ..optim import as_one
from ..tools import require_bool, require_module, require_optimizer, state_or_none


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


def memory_report(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  by_dimension: bool = False, process: bool = False) -> Dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state.

    For a wrapped model, gradients are zero_ext's buffers (full staging and/or
    the fp32 shard accumulator, as the stage keeps them), and with mixed
    precision the fp32 master shards count as optimizer state, as in the ZeRO
    paper's K; for a plain or DDP model gradients are the .grad tensors.
    by_dimension: a tensor-parallel model's, a pipeline stage's or a model
    with expert-parallel experts' report adds the parameter bytes before
    each dimension shards them, "params_full", "params_pp_stage"
    (pipeline), "params_tp_local" (tp) and "params_ep_local" (experts)
    (see _per_dimension); off by default, so the values still sum to what
    this rank holds.
    process: adds what the process holds, all of it, these tensors included
    (so not to be added to them): "process_rss" and "process_peak_rss"
    (see _process_bytes) and, for a model on a GPU, "cuda_allocated" and
    "cuda_reserved" (torch.cuda.memory_allocated / memory_reserved of its
    device); off by default for the same reason.
    """
    call = "zero_ext.memory_report(model, optimizer)"
    require_module(model, "zero_ext.memory_report", call, "the model (wrapped by zero_ext or not)")
    require_optimizer(optimizer, "zero_ext.memory_report", call, "the model's optimizer, or the list of them")
    require_bool(by_dimension, "zero_ext.memory_report", "by_dimension",
                 "pass by_dimension=True to add the bytes before each dimension (pp, tp, dp) shards them")
    require_bool(process, "zero_ext.memory_report", "process",
                 "pass process=True to add the process's resident bytes (and a GPU model's device memory)")
    optimizer = as_one(optimizer)  # a list or tuple of the model's optimizers
    masters = 0
    state = state_or_none(model)
    if state is not None:
        stats = state.handles.diagnostics.stats()
        bucketed = {id(p) for p in state.bucketed}  # counted by the core (frozen ones too, stage 3 or mixed precision)
        params = stats["param_bytes"] + sum(
            p.numel() * p.element_size() for p in model.parameters() if id(p) not in bucketed
        )
        grads = stats["grad_bytes"] + state.handles.diagnostics.residual_bytes()  # compress_grads' residuals
        masters = stats["master_bytes"]
    else:
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    report = {"params": params, "grads": grads, "optimizer_state": _optimizer_state_bytes(optimizer) + masters}
    if by_dimension and state is not None and (state.tensor_parallel is not None or state.pipeline is not None
                                               or state.experts is not None):
        report.update(_per_dimension(model, state.tensor_parallel or state.experts, state.pipeline,
                                     "params_ep_local" if state.experts is not None else "params_tp_local"))
    if process:
        report.update(_process_bytes())
        device = next((t.device for t in itertools.chain(model.parameters(), model.buffers()) if t.is_cuda), None)
        if device is not None:
            report.update(cuda_allocated=torch.cuda.memory_allocated(device),
                          cuda_reserved=torch.cuda.memory_reserved(device))
    return report


_PROC_STATUS = "/proc/self/status"


def _process_bytes() -> Dict[str, int]:
    """The process's resident bytes now ("process_rss": VmRSS) and at most
    so far ("process_peak_rss": VmHWM), from /proc/self/status (Linux; its
    "kB" are KiB). Without that file the peak is getrusage's ru_maxrss (KiB;
    bytes on macOS) and the current RSS is left out, with a warning naming
    what is: the standard library has no portable way to read it."""
    fields = {"VmRSS": "process_rss", "VmHWM": "process_peak_rss"}
    found = {}
    try:
        with open(_PROC_STATUS) as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in fields:
                    found[fields[name]] = int(value.split()[0]) * 1024
    except OSError:
        pass
    if "process_peak_rss" not in found:
        try:
            import resource
        except ImportError:  # Windows
            pass
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            found["process_peak_rss"] = peak if sys.platform == "darwin" else peak * 1024
    missing = [key for key in fields.values() if key not in found]
    if missing:
        warnings.warn(f"zero_ext.memory_report: {' and '.join(missing)} left out: {_PROC_STATUS} does not give "
                      f"{'it' if len(missing) == 1 else 'them'} on this platform ({sys.platform})"
                      + ("" if "process_peak_rss" in missing else "; process_peak_rss is getrusage's ru_maxrss"),
                      RuntimeWarning, stacklevel=3)
    return {key: found[key] for key in fields.values() if key in found}


def _per_dimension(model: torch.nn.Module, tp, pipeline, local_key: str = "params_tp_local") -> Dict[str, int]:
    """A model's parameter bytes before each dimension shards them, the
    outermost first: the whole model ("params_full": every pipeline
    stage's, as wrapped), this rank's pipeline stage ("params_pp_stage",
    a pipeline only), this rank's tensor-parallel part of it
    ("params_tp_local", tp only), which the data-parallel group shards into
    "params" at stage 3; with experts on their own dimension instead, this
    rank's experts and every other parameter ("params_ep_local"), which
    the expert and data-parallel groups shard. Not collective: wrap()
    learned the other stages' sizes."""
    stage = local = 0
    for p in model.parameters():
        spec = tp.spec_of(p) if tp is not None else None
        size = p.element_size()
        local += p.numel() * size
        stage += (math.prod(spec.shape) if spec is not None else p.numel()) * size
    out = {"params_full": pipeline.model_bytes() if pipeline is not None and pipeline.size > 1 else stage}
    if pipeline is not None:
        out["params_pp_stage"] = stage
    if tp is not None:
        out[local_key] = local
    return out
