"""Training loops that break on one rank, run by fault_harness.run_with_fault.

The model is the parity suite's Blocks with four blocks (stage 3 makes each a
unit; embedding and tied output are the root) trained with
AdamW; at step `fault_step` the victim rank kills itself (SIGKILL) or raises
at a chosen point, or the ranks take different paths. Every rank returns
"finished" if its loop ends; what the tests check is how each rank ended.
"""
from __future__ import annotations

import os
import signal
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import zero_ext
from fault_harness import linger_until_the_others_end, record_fault
from parity_scenarios import SEQ, VOCAB, Block, Blocks

VICTIM = 1
FAULT_STEP = 2


def loss_of(model: nn.Module, step: int, rank: int, **forward_kwargs) -> torch.Tensor:
    """Next-token loss of the parity suite's Blocks on this rank's tokens."""
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
    logits = model(tokens[:, :-1], **forward_kwargs)
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def make_model() -> nn.Module:
    return Blocks(n_blocks=4)


def _die() -> None:
    record_fault()
    os.kill(os.getpid(), signal.SIGKILL)


def kill_or_raise(rank: int, world: int, stage: int, point: str, timeout: float, steps: int = 6,
                  victim_rank: int = VICTIM) -> str:
    """point: kill_forward, kill_backward, kill_step (SIGKILL on the victim in
    the middle of that phase) or raise_forward (an exception escapes the
    victim's forward and ends its process). `victim_rank` 0 takes a TCPStore
    it hosts down with it."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = zero_ext.wrap(model, opt, stage=stage, timeout=timeout)
    current = {"step": 0}
    victim = rank == victim_rank

    def at_fault() -> bool:
        return victim and current["step"] == FAULT_STEP

    def forward_fault(module, args):
        if at_fault():
            if point == "kill_forward":
                _die()
            if point == "raise_forward":
                record_fault()
                raise RuntimeError("injected failure in the victim's forward")

    def hook_output(module, args, output):
        if at_fault() and point == "kill_backward" and output.requires_grad:
            output.register_hook(lambda grad: _die())

    model.blocks[2].register_forward_pre_hook(forward_fault)
    model.blocks[1].register_forward_hook(hook_output)
    if point == "kill_step":
        opt.register_step_pre_hook(lambda *a: _die() if at_fault() else None)
    for step in range(steps):
        current["step"] = step
        loss_of(model, step, rank).backward()
        opt.step()
        opt.zero_grad()
    return "finished"


def forward_raises_where_told(rank: int, world: int, stage: int, blocks: tuple, timeout: float,
                              steps: int = 5) -> str:
    """At FAULT_STEP the forward raises inside block `blocks[rank]` (None:
    not on this rank), and the rank catches it and goes on, as a user
    retrying a batch would. Ranks that raised at different blocks, or only
    some ranks, must all end with zero_ext's error; all at the same block
    would go on (ported_scenarios' fsdp_reset_after_an_exception_on_every_rank)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = zero_ext.wrap(model, opt, stage=stage, timeout=timeout, units={Block})  # a unit per block
    current = {"step": 0}
    mine = blocks[rank]

    def raise_here(module, args):
        if current["step"] == FAULT_STEP and mine is not None:
            record_fault()
            raise RuntimeError(f"injected failure in block {mine} of rank {rank}'s forward")

    if mine is not None:
        model.blocks[mine].register_forward_pre_hook(raise_here)
    for step in range(steps):
        current["step"] = step
        try:
            loss = loss_of(model, step, rank)
        except RuntimeError as e:
            if not str(e).startswith("injected failure"):
                raise
            current["step"] = -1  # retried once, without the fault
            loss = loss_of(model, step, rank)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return "finished"


def raise_inside_zero_ext(rank: int, world: int, stage: int, point: str, timeout: float, linger: bool,
                          steps: int = 6) -> str:
    """zero_ext's own gradient hook or epilogue raises on the victim at
    FAULT_STEP (test-only ZERO_EXT_TEST_FAULT). The victim sees the error from
    backward(), then goes on training as a user skipping a bad batch would;
    the others must not wait forever for the collectives it skipped. With
    `linger`, the victim stays alive after its last error until the others
    have ended (at most past the timeout), so they can only end by their
    bounded waits."""
    os.environ["ZERO_EXT_TEST_FAULT"] = f"{point}:{VICTIM}:{FAULT_STEP}"
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = zero_ext.wrap(model, opt, stage=stage, timeout=timeout)
    raised = None
    for step in range(steps):
        try:
            loss_of(model, step, rank).backward()
            opt.step()
        except RuntimeError as e:
            if raised is None and str(e).startswith("zero_ext test fault"):
                record_fault()
                raised = str(e).splitlines()[0]
                opt.zero_grad()
                continue
            if raised is None:
                raise  # not the victim: its own error, as zero_ext raised it
            if linger:
                linger_until_the_others_end(world, rank, timeout + 5)
            raise RuntimeError(f"after the injected fault ({raised}): {e}") from e
        opt.zero_grad()
    return "finished"


def offload_file_fails_on_one_rank(rank: int, world: int, stage: int, timeout: float, steps: int = 6) -> str:
    """offload_*="nvme": the victim's offload file stops taking writes at
    FAULT_STEP (a disk that fills up). The victim sees zero_ext's error naming
    the file, then goes on training as a user skipping a bad batch would, and
    lingers; the others must end with the report it posted, not the timeout."""
    import tempfile
    from zero_ext.tools import state_of
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = zero_ext.wrap(model, opt, stage=stage, timeout=timeout, offload_optimizer="nvme",
                               offload_params="nvme" if stage == 3 else None, persist_kb=0,
                               offload_path=tempfile.mkdtemp(prefix="zero_ext_fault_nvme_"))
    raised = None
    for step in range(steps):
        if rank == VICTIM and step == FAULT_STEP:
            record_fault()
            state_of(model).handles.offload.swap_fail_writes_after(0)
        try:
            loss_of(model, step, rank).backward()
            opt.step()
            opt.zero_grad()
        except RuntimeError as e:
            if rank == VICTIM and raised is None and "No space left on device" in str(e):
                raised = str(e).splitlines()[0]
                continue
            if raised is None:
                raise  # not the victim: its own error, as zero_ext raised it
            linger_until_the_others_end(world, rank, timeout + 5)
            raise RuntimeError(f"after the offload failure ({raised}): {e}") from e
    return "finished"


def extra_backward_on_rank0(rank: int, world: int, stage: int, timeout: float, steps: int = 4) -> str:
    """Rank 0 runs two backward passes before step 1's optimizer step, the
    others one: a divergence zero_ext must report, not hang on."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = zero_ext.wrap(model, opt, stage=stage, timeout=timeout)
    for step in range(steps):
        passes = 2 if (rank == 0 and step == 1) else 1
        if step == 1 and rank == 0:
            record_fault()
        for _ in range(passes):
            loss_of(model, step, rank).backward()
        opt.step()
        opt.zero_grad()
    return "finished"


def unit_skipped_on_rank0(rank: int, world: int, timeout: float, steps: int = 4) -> str:
    """Stage 3: at step 1 rank 0 skips block 2 (rank-dependent control flow),
    so its units are gathered differently from the other ranks'. One unit
    per block: the default policy merges these small blocks into one unit,
    which a skipped member does not unbalance."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = zero_ext.wrap(model, opt, stage=3, timeout=timeout, units={Block})
    for step in range(steps):
        plan = [0, 1, 3] if (rank == 0 and step == 1) else None
        if plan:
            record_fault()
        loss_of(model, step, rank, plan=plan).backward()
        opt.step()
        opt.zero_grad()
    return "finished"


def foreign_group_and_one_sided_nonfinite(rank: int, world: int) -> dict:
    """Two checks that need several ranks: wrap() over a group this rank is
    not in, and skip_nonfinite when only the last rank's gradient is inf."""
    import torch.distributed as dist

    out = {}
    group = dist.new_group(ranks=[0])  # every rank calls new_group; only rank 0 is in it
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if rank != 0:
        try:
            zero_ext.wrap(model, opt, process_group=group)
            out["foreign_group"] = "no error"
        except ValueError as e:
            out["foreign_group"] = str(e)
    for stage in (0, 1, 2, 3):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = zero_ext.wrap(model, opt, stage=stage, skip_nonfinite=True)
        before = {k: v.clone() for k, v in zero_ext.full_state_dict(model).items()}
        loss = loss_of(model, 0, rank)
        if rank == world - 1:
            loss = loss * float("inf")
        loss.backward()
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        opt.zero_grad()
        after = zero_ext.full_state_dict(model)
        out[f"stage{stage}"] = {
            "skipped": opt.skipped_steps,
            "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "warned": any("skipped on every rank" in str(w.message) for w in caught),
        }
        # The next clean step trains normally.
        loss_of(model, 1, rank).backward()
        opt.step()
        opt.zero_grad()
        out[f"stage{stage}"]["then_trained"] = not all(
            torch.equal(after[k], v) for k, v in zero_ext.full_state_dict(model).items())
    return out


def used_on_rank0_only(rank: int, world: int, use: str) -> str:
    """After a normal step, rank 0 alone runs the stage 3 model (a no-grad
    forward, or state_dict() as save_pretrained does) while the others wait
    in dist.barrier(): the Hugging Face `if rank == 0:` idiom. Rank 0 must
    raise within seconds, not at zero_ext's 120 s timeout."""
    import torch.distributed as dist

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = zero_ext.wrap(model, opt, stage=3, timeout=120.0)
    loss_of(model, 0, rank).backward()
    opt.step()
    opt.zero_grad()
    outcome = "released"
    if use == "late" and rank != 0:
        time.sleep(9.0)  # busy past the stall interval (5 s), then joins: no error is right
        with torch.no_grad():
            loss_of(model, 1, rank)
        outcome = "joined late"
    if rank == 0:
        started = time.monotonic()
        try:
            if use in ("forward", "late"):
                with torch.no_grad():
                    loss_of(model, 1, rank)
            else:
                model.state_dict()
            outcome = "completed"
        except RuntimeError as error:
            outcome = f"raised after {time.monotonic() - started:.1f} s: {error}"
    dist.barrier()  # rank 0 joins the others' barrier once it is out
    return outcome
