"""Rank-side halves of the checkpoint tests (tests/test_checkpoint.py).

The global batch is fixed (GLOBAL rows per step) and split evenly over
however many ranks train, so runs at different world sizes see the same data
and can be compared with one single-process reference.
"""
from __future__ import annotations

import io
import os
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

import zero_ext
from parity_scenarios import IN, OUT, Net, device_mesh

GLOBAL = 8  # rows per step, divisible by every world size tested (1, 2, 4)
K = 2       # steps before and after a save


def global_batch(step: int):
    g = torch.Generator().manual_seed(4242 + step)
    return torch.randn(GLOBAL, IN, generator=g), torch.randn(GLOBAL, OUT, generator=g)


def make(stage: Optional[int], precision: Optional[str] = None, offload: bool = False, seed: int = 0,
         mesh: str = ""):
    """Net and AdamW, wrapped at `stage` (None: plain); `mesh` "RxS": hybrid."""
    model = Net(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, eps=1e-3)
    if stage is None:
        return model, opt
    group = {"process_group": device_mesh(*(int(v) for v in mesh.split("x")))} if mesh else {}
    return zero_ext.wrap(model, opt, stage=stage, bucket_mb=0.0005 * (1 + stage), mixed_precision=precision,
                         offload_optimizer="cpu" if offload else None, timeout=20, **group)


def train(model, opt, steps: range, rank: int, world: int, dtype=torch.float32) -> None:
    rows = GLOBAL // world
    for step in steps:
        x, y = global_batch(step)
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        F.mse_loss(model(x.to(dtype)).float(), y).backward()
        opt.step()
        opt.zero_grad()


def local_optimizer_state(opt) -> List[Dict[str, torch.Tensor]]:
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v)) for k, v in opt.state[p].items()}
            for g in opt.param_groups for p in g["params"] if p in opt.state]


# (stage, precision, offload, format, async_save): zero_ext's format and DCP,
# saved at once or in the background while training changes every weight.
CONFIGS = [(stage, precision, offload, "zero_ext", False) for stage in (0, 1, 2, 3)
           for precision, offload in ((None, False), ("bf16", False), (None, True), ("bf16", True))] + [
    (stage, None, False, "dcp", False) for stage in (0, 1, 2, 3)] + [
    (stage, None, False, fmt, True) for fmt, stages in (("dcp", (1, 3)), ("zero_ext", (0, 2))) for stage in stages] + [
    (3, "bf16", True, "dcp", True), (2, "bf16", True, "zero_ext", True)]


def label_of(config) -> str:
    stage, precision, offload, fmt, asynchronous = config
    return (f"stage{stage}-{precision or 'fp32'}{'-offload' if offload else ''}"
            + ("" if fmt == "zero_ext" else f"-{fmt}") + ("-async" if asynchronous else ""))


def resume_equivalence(rank: int, world: int, root: str, mesh: str = "") -> Dict[str, Optional[str]]:
    """Train K, save, train K; versus load and train K: bit-identical
    parameters (fp32 masters) and optimizer state, per configuration
    (hybrid over `mesh` if given). An asynchronous save is waited for only
    after the K steps that follow it: it must hold the state at the call."""
    results = {}
    for config in CONFIGS:
        stage, precision, offload, fmt, asynchronous = config
        label = label_of(config)
        dtype = torch.bfloat16 if precision else torch.float32
        path = os.path.join(root, label)
        model, opt = make(stage, precision, offload, mesh=mesh)
        train(model, opt, range(K), rank, world, dtype)
        extra = {"rank": rank, "label": label}
        handle = zero_ext.save(path, model, opt, extra=extra, format=fmt, async_save=asynchronous)
        extra["label"] = "changed after the call"  # an asynchronous save keeps what extra held at the call
        train(model, opt, range(K, 2 * K), rank, world, dtype)
        if asynchronous:
            assert handle is not None and not isinstance(handle, bool)
            handle.wait()
            assert handle.done()
        else:
            assert handle is None
        want_params, want_state = zero_ext.full_state_dict(model), local_optimizer_state(opt)

        model2, opt2 = make(stage, precision, offload, seed=7, mesh=mesh)  # different init: all must come from the file
        extra = zero_ext.load(path, model2, opt2)
        train(model2, opt2, range(K, 2 * K), rank, world, dtype)
        got_params, got_state = zero_ext.full_state_dict(model2), local_optimizer_state(opt2)
        problem = None
        if extra != {"rank": rank, "label": label}:
            problem = f"extra {extra}"
        for name in want_params:
            if not torch.equal(want_params[name], got_params[name]):
                problem = problem or f"param {name} differs by {(want_params[name] - got_params[name]).abs().max()}"
        if len(want_state) != len(got_state):
            problem = problem or f"{len(got_state)} optimizer states, want {len(want_state)}"
        for a, b in zip(want_state, got_state):
            for key in a:
                if key not in b or not torch.equal(a[key], b[key]):
                    problem = problem or f"optimizer state {key} differs"
        results[label] = problem
    return results


# (stage, precision, mesh, format) saved at world 4: flat, and hybrid over a
# 2x2 mesh; DCP by zero_ext; "fsdp2": DCP written by FSDP2 (get_state_dict
# layout) and "torchtitan": by FSDP2 as torchtitan's CheckpointManager writes.
RESHARD_SAVES = [(3, None, "", "zero_ext"), (1, None, "", "zero_ext"), (2, "bf16", "", "zero_ext"),
                 (3, None, "2x2", "zero_ext"), (2, "bf16", "2x2", "zero_ext"),
                 (3, None, "", "dcp"), (1, None, "2x2", "dcp"), (2, "bf16", "", "dcp"), (3, None, "", "dcp-torchtitan"),
                 (None, None, "", "fsdp2"), (None, None, "", "torchtitan")]


def saved_name(stage: Optional[int], precision: Optional[str], mesh: str, fmt: str = "zero_ext") -> str:
    if stage is None:
        return f"saved-{fmt}"
    return (f"saved-stage{stage}-{precision or 'fp32'}" + (f"-mesh{mesh}" if mesh else "")
            + ("" if fmt == "zero_ext" else f"-{fmt}"))


def fsdp2_model(seed: int, world: int):
    """Net under FSDP2 over every rank, with the AdamW of make()."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Net(seed=seed)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, eps=1e-3)


def constant_schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)


def torchtitan_state(model, opt, scheduler, rank: int, world: int, step: int) -> Dict[str, object]:
    """The dict torchtitan's CheckpointManager hands dcp.save: the model's
    entries at the top level (ModelWrapper: get_model_state_dict), the
    optimizer flattened (OptimizersContainer: get_optimizer_state_dict with
    flatten_optimizer_state_dict=True), the scheduler's state_dict, the
    trainer's train_state and each data-parallel rank's dataloader state."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    states = dict(get_model_state_dict(model))
    states["optimizer"] = get_optimizer_state_dict(model, opt,
                                                   options=StateDictOptions(flatten_optimizer_state_dict=True))
    states.update(torchtitan_extra(scheduler, rank, world, step))
    return states


def torchtitan_extra(scheduler, rank: int, world: int, step: int) -> Dict[str, object]:
    return {"lr_scheduler": scheduler.state_dict(), "train_state": {"step": step, "ntokens_seen": 64 * step},
            "dataloader": {f"dp_rank_{rank}": b"sampler-state-%d" % rank, "world_size": world}}


def save_for_resharding(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    for stage, precision, mesh, fmt in RESHARD_SAVES:
        path = os.path.join(root, saved_name(stage, precision, mesh, fmt))
        if fmt in ("fsdp2", "torchtitan"):
            model, opt = fsdp2_model(0, world)
            scheduler = constant_schedule(opt)
            train(model, opt, range(K), rank, world)
            scheduler.step()
            if fmt == "fsdp2":
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
            else:
                dcp.save(torchtitan_state(model, opt, scheduler, rank, world, K), checkpoint_id=path)
            continue
        model, opt = make(stage, precision, mesh=mesh)
        train(model, opt, range(K), rank, world, torch.bfloat16 if precision else torch.float32)
        if fmt == "dcp-torchtitan":
            scheduler = constant_schedule(opt)
            scheduler.step()
            zero_ext.save(path, model, opt, extra=torchtitan_extra(scheduler, rank, world, K), format="dcp",
                          dcp_layout="torchtitan")
        else:
            zero_ext.save(path, model, opt, extra={"saved_at": world}, format="dcp" if fmt == "dcp" else "zero_ext")
        full = zero_ext.full_state_dict(model)
        if rank == 0 and fmt != "zero_ext":  # for the test's plain process: what dcp.load must give it
            torch.save(full, path + ".full.pt")


def expected_extra(fmt: str, rank: int, world: int):
    if fmt == "fsdp2":
        return None
    if fmt in ("torchtitan", "dcp-torchtitan"):  # every saving rank's dataloader entry, one scheduler, one train_state
        scheduler = constant_schedule(torch.optim.AdamW(Net().parameters(), lr=0.01))
        scheduler.step()
        extra = torchtitan_extra(scheduler, 0, 4, K)
        extra["dataloader"] = {**{f"dp_rank_{r}": b"sampler-state-%d" % r for r in range(4)}, "world_size": 4}
        return extra
    return {"saved_at": 4}


def load_resharded(rank: int, world: int, root: str, mesh: str = "") -> bytes:
    """Each saved checkpoint loaded at this world size (hybrid over `mesh`
    if given) into every stage, then trained K more steps; returns the full
    parameters (torch.save bytes: the result queue cannot carry tensors out
    of a rank that exits). zero_ext's DCP saves in fp32 are also loaded by
    FSDP2 (dcp.load + set_state_dict, or as torchtitan loads its own) and
    trained on ("->fsdp2")."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict,
                                                         set_state_dict)
    out = {}
    for stage, precision, saved_mesh, fmt in RESHARD_SAVES:
        name = saved_name(stage, precision, saved_mesh, fmt)
        path = os.path.join(root, name)
        assert zero_ext.checkpoint_exists(path), name
        for new_stage in (0, 1, 2, 3):
            model, opt = make(new_stage, precision, seed=7, mesh=mesh)
            extra = zero_ext.load(path, model, opt)
            assert extra == expected_extra(fmt, rank, world), (name, extra)
            train(model, opt, range(K, 2 * K), rank, world, torch.bfloat16 if precision else torch.float32)
            out[f"{name}->stage{new_stage}"] = zero_ext.full_state_dict(model)
        if fmt in ("dcp", "dcp-torchtitan") and precision is None and not mesh:
            model, opt = fsdp2_model(7, world)
            if fmt == "dcp":
                msd, osd = get_state_dict(model, opt)
                dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
                set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
            else:
                scheduler = constant_schedule(opt)
                states = torchtitan_state(model, opt, scheduler, rank, world, 0)
                states["dataloader"] = {f"dp_rank_{rank % 4}": b"", "world_size": 0}
                dcp.load(states, checkpoint_id=path)
                set_model_state_dict(model, {k: v for k, v in states.items() if k not in
                                             ("optimizer", "lr_scheduler", "train_state", "dataloader")},
                                     options=StateDictOptions(strict=False))
                set_optimizer_state_dict(model, opt, states["optimizer"],
                                         options=StateDictOptions(flatten_optimizer_state_dict=True))
                assert states["train_state"] == {"step": K, "ntokens_seen": 64 * K}, states["train_state"]
                assert states["dataloader"][f"dp_rank_{rank % 4}"] == b"sampler-state-%d" % (rank % 4)
            train(model, opt, range(K, 2 * K), rank, world)
            out[f"{name}->fsdp2"] = {k: v.detach().clone() for k, v in get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True)).items()}
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


def save_twice_and_die(rank: int, world: int, root: str, fault: str) -> None:
    """A good checkpoint, then a save during which one rank exits at `fault`."""
    model, opt = make(2)
    train(model, opt, range(K), rank, world)
    path = os.path.join(root, "ckpt")
    zero_ext.save(path, model, opt, extra="first")
    train(model, opt, range(K, 2 * K), rank, world)
    asynchronous = fault.startswith("async/")  # the second save in the background: the fault hits its writer thread
    fault = fault.split("/")[-1]
    armed = os.environ.get("ZERO_EXT_TEST_FAULT")  # a condition the test set (no_exchange) stays
    os.environ["ZERO_EXT_TEST_FAULT"] = f"{armed},{fault}" if armed else fault
    handle = zero_ext.save(path, model, opt, extra="second", format="dcp" if asynchronous else "zero_ext",
                           async_save=asynchronous)
    if asynchronous:
        train(model, opt, range(2 * K, 3 * K), rank, world)
        handle.wait()


def python_collectives_on_the_core(rank: int, world: int, root: str) -> Dict[str, int]:
    """Collectives the core's communicator issued for each Python-side
    collective call (clip_grad_norm_, save, load): zero_ext's Python never
    calls torch.distributed on its own group directly, so a failure there
    marks the group and a stall is diagnosed like the core's own."""
    model, opt = make(2)
    train(model, opt, range(1), rank, world)
    count = lambda: model._zero_ext.handles.diagnostics.stats()["collectives"]  # noqa: E731
    x, y = global_batch(9)
    F.mse_loss(model(x), y).backward()
    out = {}
    before = count()
    opt.clip_grad_norm_(1.0)
    out["clip"] = count() - before
    before = count()
    zero_ext.save(os.path.join(root, "collectives"), model, opt)
    out["save"] = count() - before
    before = count()
    zero_ext.load(os.path.join(root, "collectives"), model, opt)
    out["load"] = count() - before
    return out
