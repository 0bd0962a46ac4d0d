"""What a rank of a benchmark holds and sends: read from the process and from
each system's tensors and collectives, and what theory says it should be
(the ZeRO paper's state formula, bandwidth-optimal bytes on gloo). Shared by
compare.py, init_memory.py and replica_sync.py."""
from __future__ import annotations

import math
from typing import Dict, List

import torch


# --- the systems' names and what theory says ------------------------------------

def mesh_of(system: str):
    """(replicas, shard size) of a hybrid system, else None."""
    parts = system.split("-")
    return tuple(int(v) for v in parts[2].split("x")) if len(parts) == 3 and "x" in parts[2] else None




def stage_of(system: str) -> int:
    if system == "ddp":
        return 0
    if system.startswith("fsdp2"):
        return 3
    return int(system.split("-")[1])


def zero_formula_bytes(stage: int, numel: int, world: int) -> float:
    """ZeRO paper's model-state bytes per rank for fp32 params and Adam."""
    p = 4.0 * numel
    return {0: 4 * p, 1: 2 * p + 2 * p / world, 2: p + 3 * p / world, 3: 4 * p / world}[stage]


def theory_sent_by_group(stage: int, numel: int, replicas: int, shard: int) -> Dict[str, float]:
    """Hybrid on gloo, fp32: bytes a rank sends per step within its row
    (the shard group, as a flat run of S ranks sends) and across replicas
    (an all-reduce of the 1/S shard of the gradient; stage 0: of all of it)."""
    within = theory_sent_bytes(f"zero_ext-{stage}", numel, shard)
    reduced = 4.0 * numel / (1 if stage == 0 else shard)
    return {"within_row": within, "across_replicas": 2 * (replicas - 1) / replicas * reduced}


def theory_sent_bytes(system: str, numel: int, world: int) -> float:
    """Bytes a rank sends per step on gloo for fp32 gradients and params."""
    mesh = mesh_of(system)
    if mesh is not None:
        return sum(theory_sent_by_group(stage_of(system), numel, *mesh).values())
    s = 4.0 * numel * (world - 1) / world
    if system == "ddp" or system == "zero_ext-0":
        return 2 * s  # one all-reduce
    if system == "fsdp2-keep":
        return 3 * s  # one all-gather, reduce-scatter as all-reduce
    stage = stage_of(system)
    if system.startswith("zero_ext"):  # stages 1-3: an all-to-all and a sum, a reduce-scatter's bytes
        return {1: 2 * s, 2: 2 * s, 3: 3 * s}[stage]
    return {1: 3 * s, 2: 3 * s, 3: 4 * s}[stage]  # gloo's reduce-scatter: an all-reduce


# --- memory and traffic ---------------------------------------------------------

def proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> None:
    """Writing 5 to clear_refs resets VmHWM to the current RSS (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def plain_state_bytes(model, opt) -> Dict[str, int]:
    """DDP and FSDP2: parameters, .grad and optimizer state (local shards)."""
    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    state = sum(local_bytes(v) for st in opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor))
    return {"params": params, "grads": grads, "optimizer_state": state}


def deepspeed_state_bytes(engine) -> Dict[str, int]:
    """DeepSpeed keeps its flat fp32 partitions, gradient partitions and
    buckets as attributes of its ZeRO optimizer object: count every distinct
    storage reachable from there and from the module's parameters (partitions
    of stage 3 hang off each parameter as ds_tensor)."""
    seen = set()

    def storage_bytes(t: torch.Tensor) -> int:
        s = t.untyped_storage()
        key = s.data_ptr()
        if key in seen or s.nbytes() == 0:
            return 0
        seen.add(key)
        return s.nbytes()

    params = 0
    for p in engine.module.parameters():
        params += storage_bytes(p.data)
        if hasattr(p, "ds_tensor"):
            params += storage_bytes(p.ds_tensor)
    grads = sum(storage_bytes(p.grad) for p in engine.module.parameters() if p.grad is not None)
    state = 0
    basic = engine.optimizer
    inner = getattr(basic, "optimizer", None)
    if inner is not None:
        state += sum(storage_bytes(v) for st in inner.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor))
    other = 0
    stack, visited = [basic], set()
    while stack:
        obj = stack.pop()
        if id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            other += storage_bytes(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif type(obj).__module__.startswith("deepspeed") and hasattr(obj, "__dict__"):
            stack.extend(v for k, v in vars(obj).items() if k not in ("module", "model"))
    # What is neither a parameter nor optimizer state (fp32 partitions, gradient
    # partitions, bucket buffers) is counted with the gradients.
    return {"params": params, "grads": grads + other, "optimizer_state": state}


def sent_bytes_by_group(issue_log: List[str], replicas: int, shard: int) -> Dict[str, float]:
    """zero_ext's own count, from its issue log ("<group> <kind> <numel>",
    fp32): bytes this rank sent within its row (reduce and gather groups, S
    ranks) and across replicas (R ranks), under the algorithms above."""
    out = {"within_row": 0.0, "across_replicas": 0.0}
    for entry in issue_log:
        group, kind, numel = entry.split()
        n = replicas if group == "replicate" else shard
        size = 4.0 * int(numel)
        if kind.startswith("all_reduce"):
            b = 2 * (n - 1) / n * size
        elif kind == "all_gather":
            b = (n - 1) / n * size  # the log counts the gathered output
        else:
            b = (n - 1) / n * size
        out["across_replicas" if group == "replicate" else "within_row"] += b
    return out


def sent_bytes(ops, world: int) -> Dict[str, float]:
    """Bytes sent by this rank for the backend collectives among `ops`
    ((name, input shapes, input dtypes), from zero_ext's profiled_ops).
    zero_ext's sequence-check headers (int64 all-gathers on groups of their
    own, collective_sequence.h) are counted apart, as `header_bytes`: the
    theory counts the data."""
    sent, count, by_kind, headers = 0.0, 0, {}, 0.0
    for name, shapes, dtypes in ops:
        if not (name.startswith("gloo:") or name.startswith("nccl:")):
            continue
        kind = name.split(":", 1)[1]
        if "barrier" in kind or not shapes:
            continue
        numel = sum(math.prod(s) for s in shapes if s)
        dtype = (dtypes or ["float"])[0]
        if dtype == "long int" and ("all_gather" in kind or "allgather" in kind):
            headers += (world - 1) * numel * 8
            continue
        size = numel * {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8,
                        "int": 4, "unsigned char": 1, "signed char": 1}.get(dtype, 4)  # bytes: quantized payloads
        if "all_reduce" in kind or "allreduce" in kind:
            b = 2 * (world - 1) / world * size
        elif "all_gather" in kind or "allgather" in kind:
            b = (world - 1) * size
        else:  # reduce_scatter, reduce, broadcast
            b = (world - 1) / world * size
        sent += b
        count += 1
        by_kind[kind] = by_kind.get(kind, 0) + b
    return {"sent_bytes": sent, "collectives": count, "sent_by_kind": by_kind, "header_bytes": headers}
