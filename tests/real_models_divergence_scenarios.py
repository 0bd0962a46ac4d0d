"""The ways ranks can disagree on a real model (an expert made a unit of its
own and skipped, a rank-0-only evaluation, with or without a barrier after
it, evaluation loops of different lengths, a forward that raised on one
rank only, parameters frozen on one rank, wrap() with different models or
options, or reached late): every rank must end in zero_ext's own error,
never a wrong number, a hang or an abort inside gloo. Each scenario catches
the error and returns it with what the rank computed before it
(DIVERGENCES)."""
from __future__ import annotations

import os
import tempfile
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

import zero_ext
from parity_scenarios import DIM, VOCAB
from real_models_common import CHECK_TIMEOUT, Expert, MoEModel, ONE_UNIT_PER_BLOCK_MB, lm_loss, tokens_of


# --- ranks that disagree -------------------------------------------------------
# Each returns {"error": zero_ext's message or None, "outputs": what the rank
# computed before it, "seconds": from the divergence to the error}.

def _outcome(body: Callable[[], list]) -> dict:
    import time

    outputs: list = []
    started = [None]

    def mark() -> None:
        if started[0] is None:
            started[0] = time.monotonic()

    try:
        body(outputs, mark)
        error = None
    except (RuntimeError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    seconds = None if started[0] is None else time.monotonic() - started[0]
    return {"error": error, "outputs": outputs, "seconds": seconds}


def _train_step(loss: torch.Tensor, opt, outputs: list) -> None:
    """backward, step, zero_grad; the loss joins what the rank computed."""
    loss.backward()
    opt.step()
    opt.zero_grad()
    outputs.append(loss.item())


def _moe_wrapped(stage: int = 3, **options):
    """Dense routing until a scenario makes the ranks differ."""
    model = MoEModel(seed=31)
    for moe in model.moes():
        moe.dense = True
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return zero_ext.wrap(model, opt, stage=stage, timeout=CHECK_TIMEOUT, **options)


def _route_differently(model: nn.Module, rank: int, only: List[int]) -> None:
    for moe in model.moes():
        moe.dense = False
        moe.only = only


def expert_units_skipped_in_training(rank: int, world: int, compiled: bool = False) -> dict:
    """units={Expert} asks for one unit per expert; at step 1 rank 0's tokens
    pick experts 0-1 and the others' experts 2-3. `compiled`: the whole
    model under torch.compile (backend aot_eager: no C++ compile per graph;
    the routing breaks the graph, its own break): the experts' gathers are
    ops inside the graphs ([Note: stage 3 in a compiled graph]), and the
    graphs each rank traces after the routing changed gather other experts."""
    def body(outputs, mark):
        model, opt = _moe_wrapped(units={Expert}, bucket_mb=ONE_UNIT_PER_BLOCK_MB)
        forward = model
        if compiled:
            torch._dynamo.reset()
            forward = torch.compile(model, backend="aot_eager")
        for step in range(3):
            if step == 1:
                mark()
                _route_differently(model, rank, [0, 1] if rank == 0 else [2, 3])
            loss = lm_loss(forward, tokens_of(world, step, rank))
            outputs.append(float(loss))
            loss.backward()
            opt.step()
            opt.zero_grad()
    return _outcome(body)


def expert_units_skipped_in_no_grad_evaluation(rank: int, world: int) -> dict:
    """The same under torch.no_grad(): no backward follows, so nothing later
    could catch a wrong gather; the losses must never come back."""
    def body(outputs, mark):
        model, opt = _moe_wrapped(units={Expert}, bucket_mb=ONE_UNIT_PER_BLOCK_MB)
        lm_loss(model, tokens_of(world, 0, rank)).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for k in range(3):
                if k == 1:
                    mark()
                    _route_differently(model, rank, [0] if rank == 0 else [1 + rank % 3])
                outputs.append(float(lm_loss(model, tokens_of(world, 50 + k, rank))))
    return _outcome(body)


def _train_with_evaluation(rank: int, world: int, batches: int) -> dict:
    """Three training steps; before the second, this rank evaluates
    `batches` batches under no_grad (nanoGPT's estimate_loss())."""
    def body(outputs, mark):
        model, opt = _moe_wrapped(bucket_mb=ONE_UNIT_PER_BLOCK_MB)
        for step in range(3):
            if step == 1:
                mark()
                with torch.no_grad():
                    for k in range(batches):
                        outputs.append(float(lm_loss(model, tokens_of(world, 60 + k, rank))))
            loss = lm_loss(model, tokens_of(world, step, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
    return _outcome(body)


def evaluation_on_rank0_only(rank: int, world: int) -> dict:
    """nanoGPT's `if master_process: estimate_loss()`: rank 0 evaluates under
    no_grad while the others go on training."""
    return _train_with_evaluation(rank, world, batches=2 if rank == 0 else 0)


def evaluation_loops_of_different_lengths(rank: int, world: int) -> dict:
    """Every rank evaluates, but rank 0 over one more batch (uneven data)."""
    return _train_with_evaluation(rank, world, batches=3 if rank == 0 else 2)


def evaluation_on_rank0_only_then_barrier(rank: int, world: int) -> dict:
    """nanoGPT's `if master_process: estimate_loss()` followed by
    dist.barrier() on every rank: rank 0's no_grad forward needs the others,
    who wait in the barrier, which needs rank 0. Rank 0 raises within
    seconds, joins the barrier (a user's `finally:`) and every rank goes on
    training: the others' next step must end in zero_ext's error too (their
    first header meets the one rank 0 sent for its no_grad forward), not
    wait for a rank whose model stopped. (Its process must also be free to
    exit: tests/test_exit.py.)"""
    def body(outputs, mark):
        model, opt = _moe_wrapped(bucket_mb=ONE_UNIT_PER_BLOCK_MB)
        for step in range(3):
            if step == 1:
                mark()
                try:
                    if rank == 0:
                        with torch.no_grad():
                            outputs.append(float(lm_loss(model, tokens_of(world, 60, rank))))
                finally:
                    dist.barrier()
            loss = lm_loss(model, tokens_of(world, step, rank))
            _train_step(loss, opt, outputs)
    return _outcome(body)


def input_of_another_shape_on_rank0(rank: int, world: int) -> dict:
    """At step 1 a Linear inside block 1 gets an input of another width on
    rank 0 only (a batch the data pipeline got wrong there): torch raises in
    the middle of the forward, after its first gathers (the default units:
    the blocks merged into one unit). Rank 0 catches it and goes on with the
    next batch, as a loop that skips bad batches does: the others went on
    with that forward, so rank 0's next step must refuse, and the others
    must raise the same report within seconds, never train with the ranks
    one forward apart (which the collectives' checks let pass here: rank 0's
    next forward issues what the others' next one does)."""
    def body(outputs, mark):
        model, opt = _moe_wrapped()
        widen = [False]
        model.blocks[1].mix.register_forward_pre_hook(
            lambda module, args: (torch.cat([args[0], args[0]], -1),) if widen[0] else None)
        for step in range(3):
            if step == 1:
                mark()
            widen[0] = step == 1 and rank == 0
            try:
                loss = lm_loss(model, tokens_of(world, step, rank))
            except RuntimeError as error:
                if not widen[0] or "zero_ext" in str(error):
                    raise
                continue  # the bad batch is skipped
            _train_step(loss, opt, outputs)
    return _outcome(body)


def _steps_parting_at_step_1(rank: int, world: int, build: Callable[[], tuple], steps: int,
                             part: Callable[[nn.Module], None]) -> dict:
    """Trains the (model, optimizer) build() gives for `steps` steps; before
    step 1, part(model) makes the ranks differ. Each step's loss is kept once
    the step is taken."""
    def body(outputs, mark):
        model, opt = build()
        for step in range(steps):
            if step == 1:
                mark()
                part(model)
            loss = lm_loss(model, tokens_of(world, step, rank))
            _train_step(loss, opt, outputs)
    return _outcome(body)


def frozen_on_one_rank_only(rank: int, world: int, stage: int = 3) -> dict:
    """Rank 1 freezes the head before step 1 (requires_grad_(False) after
    wrap, allowed when every rank does it): its gradient would be averaged
    with rank 1's zeros."""
    return _steps_parting_at_step_1(rank, world, lambda: _moe_wrapped(stage=stage, bucket_mb=ONE_UNIT_PER_BLOCK_MB),
                                    3, lambda model: model.head.weight.requires_grad_(rank != 1))


def layer_frozen_on_one_rank_only(rank: int, world: int) -> dict:
    """Rank 1 freezes the whole head (its buckets hold nothing else at
    ~100-byte buckets): it would retire them unreduced while the others
    reduce them."""
    return _steps_parting_at_step_1(rank, world, lambda: _moe_wrapped(stage=1, bucket_mb=ONE_UNIT_PER_BLOCK_MB),
                                    3, lambda model: model.head.requires_grad_(rank != 1))


def unshard_on_rank0_only(rank: int, world: int) -> dict:
    """Rank 0 alone calls model.unshard() before step 1 (a one-rank call of a
    collective API): its gathers would pair with the others' forward gathers."""
    return _steps_parting_at_step_1(rank, world, lambda: _moe_wrapped(bucket_mb=ONE_UNIT_PER_BLOCK_MB), 3,
                                    lambda model: model.unshard() if rank == 0 else None)


def gradient_divide_factor_differs(rank: int, world: int) -> dict:
    """Rank 1 sets another gradient divide factor after step 0: its
    reductions would scale its share differently."""
    return _steps_parting_at_step_1(rank, world, lambda: _moe_wrapped(stage=2), 2,
                                    lambda model: model.set_gradient_divide_factor(1.0 if rank == 1 else float(world)))


def blocks_backward_skipped_on_one_rank(rank: int, world: int) -> dict:
    """reshard_after_forward=2 (at world 4 the blocks keep halves in
    subgroups of 2; at world 2 it means True): at step 1 rank 1's loss
    reads the head only, so its blocks' backward, and their gathers within
    rank 1's subgroup, never come."""
    def build():
        return _moe_wrapped(bucket_mb=ONE_UNIT_PER_BLOCK_MB, reshard_after_forward=2)

    def body(outputs, mark):
        model, opt = build()
        for step in range(2):
            if step == 1:
                mark()
            logits = model(tokens_of(world, step, rank)[:, :-1])
            if step == 1 and rank == 1:
                loss = logits.detach().sum() * 0 + model.head.weight.square().sum()
            else:
                loss = logits.square().mean()
            _train_step(loss, opt, outputs)
    return _outcome(body)


def prefetch_lists_differ(rank: int, world: int) -> dict:
    """Rank 1 sets another forward prefetch list for block 0 (block 2, where
    the others prefetch block 1): it would gather the units in another order."""
    def body(outputs, mark):
        model, opt = _moe_wrapped(bucket_mb=ONE_UNIT_PER_BLOCK_MB, prefetch=0)
        blocks = model.blocks
        zero_ext.set_modules_to_forward_prefetch(blocks[0], [blocks[2] if rank == 1 else blocks[1]])
        mark()
        loss = lm_loss(model, tokens_of(world, 0, rank))
        loss.backward()
        outputs.append(loss.item())
    return _outcome(body)


def _wrap_differently(rank: int, world: int, change: Callable[[int], dict]) -> dict:
    """Rank 1 builds or wraps differently (change(rank) gives its model and options)."""
    def body(outputs, mark):
        mark()
        spec = change(rank)
        model = spec.pop("model", None) or MoEModel(seed=31)
        opt = spec.pop("optimizer", lambda params: torch.optim.SGD(params, lr=0.05))(model.parameters())
        options = {"stage": 3, "timeout": CHECK_TIMEOUT, "bucket_mb": ONE_UNIT_PER_BLOCK_MB, **spec}
        model, opt = zero_ext.wrap(model, opt, **options)
        outputs.append(float(lm_loss(model, tokens_of(world, 0, rank))))
    return _outcome(body)


def _nvme(rank: int, bad: Optional[Callable[[str], str]] = None) -> dict:
    """'nvme' offload under a directory of this rank's own; `bad` (rank 1
    only) turns that directory into the offload_path rank 1 passes."""
    path = tempfile.mkdtemp()
    return {"offload_optimizer": "nvme", "offload_params": "nvme",
            "offload_path": bad(path) if bad is not None and rank == 1 else path}


def _a_file_in(path: str) -> str:
    with open(os.path.join(path, "not-a-directory"), "w") as f:
        f.write("x")
    return os.path.join(path, "not-a-directory")


def _below_a_file(path: str) -> str:
    """A directory that cannot be created: its parent is a file."""
    return os.path.join(_a_file_in(path), "offload")


def offload_space_not_reserved_on_one_rank(rank: int, world: int) -> dict:
    """Rank 1 cannot grow a file past 4 MiB (RLIMIT_FSIZE, as a full disk or
    a quota would): its offload file (12 MiB and more here) fails its space
    reservation after the ranks agreed and made their groups. (The limit
    is far above what the rendezvous FileStore and the captured stderr reach
    meanwhile: they are files this process writes too.)"""
    import resource
    import signal

    def body(outputs, mark):
        model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(6)))  # 24 MiB of fp32 parameters
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
        try:
            mark()
            if rank == 1:
                resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, limit[1]))
            model, opt = zero_ext.wrap(model, opt, stage=3, timeout=CHECK_TIMEOUT, persist_kb=0, **_nvme(rank))
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
            signal.signal(signal.SIGXFSZ, handler)
        outputs.append(float(model(torch.ones(2, 1024)).sum()))
    return _outcome(body)


def meta_device_missing_on_one_rank(rank: int, world: int) -> dict:
    """A meta model materialized on 'cpu', on rank 1 on a CUDA device it
    does not have."""
    def body(outputs, mark):
        with zero_ext.empty_init():
            model = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        mark()
        model, opt = zero_ext.wrap(model, opt, stage=3, timeout=CHECK_TIMEOUT,
                                   device="cuda:99" if rank == 1 else "cpu")
        outputs.append(float(model(torch.ones(2, DIM)).sum()))
    return _outcome(body)


LATE_TIMEOUT = 3.0  # wrap's timeout in the scenario below: also the bound on waiting for a rank to arrive


def wrap_reached_late_by_one_rank(rank: int, world: int) -> dict:
    """Rank 1 is still in its set-up (a checkpoint load, say) past the wrap's
    timeout: the ranks waiting at wrap() name it, and rank 1, arriving after
    they stopped, raises too instead of waiting in a collective nobody joins."""
    import time

    def body(outputs, mark):
        model = MoEModel(seed=31)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        mark()
        if rank == 1:
            time.sleep(LATE_TIMEOUT + 3)
        model, opt = zero_ext.wrap(model, opt, stage=3, timeout=LATE_TIMEOUT, bucket_mb=ONE_UNIT_PER_BLOCK_MB)
        outputs.append(float(lm_loss(model, tokens_of(world, 0, rank))))
    return _outcome(body)


class WiderHead(MoEModel):
    def __init__(self):
        super().__init__(seed=31)
        self.head = nn.Linear(DIM, VOCAB + 1)


DIVERGENCES: Dict[str, Callable[[int, int], dict]] = {
    "expert_units_skipped_in_training": expert_units_skipped_in_training,
    "expert_units_skipped_in_no_grad_evaluation": expert_units_skipped_in_no_grad_evaluation,
    "expert_units_skipped_in_compiled_training": lambda rank, world: expert_units_skipped_in_training(
        rank, world, compiled=True),
    "evaluation_on_rank0_only": evaluation_on_rank0_only,
    "evaluation_loops_of_different_lengths": evaluation_loops_of_different_lengths,
    "evaluation_on_rank0_only_then_barrier": evaluation_on_rank0_only_then_barrier,
    "input_of_another_shape_on_rank0": input_of_another_shape_on_rank0,
    "frozen_on_one_rank_only": frozen_on_one_rank_only,
    "frozen_on_one_rank_only_stage1": lambda rank, world: frozen_on_one_rank_only(rank, world, stage=1),
    "gradient_divide_factor_differs": gradient_divide_factor_differs,
    "unshard_on_rank0_only": unshard_on_rank0_only,
    "layer_frozen_on_one_rank_only": layer_frozen_on_one_rank_only,
    "prefetch_lists_differ": prefetch_lists_differ,
    "blocks_backward_skipped_on_one_rank": blocks_backward_skipped_on_one_rank,
    "wrap_a_different_shape": lambda rank, world: _wrap_differently(
        rank, world, lambda r: {"model": WiderHead()} if r == 1 else {}),
    "wrap_a_different_stage": lambda rank, world: _wrap_differently(
        rank, world, lambda r: {"stage": 2} if r == 1 else {}),
    "wrap_different_units": lambda rank, world: _wrap_differently(
        rank, world, lambda r: {"units": {Expert}} if r == 1 else {}),
    "wrap_a_different_optimizer_sharding": lambda rank, world: _wrap_differently(  # flat SGD vs whole Adafactor
        rank, world, lambda r: {"optimizer": lambda params: torch.optim.Adafactor(params)} if r == 1 else {}),
    "wrap_a_different_precision": lambda rank, world: _wrap_differently(
        rank, world, lambda r: {"mixed_precision": "bf16"} if r == 1 else {}),
    "wrap_different_reshard_after_forward": lambda rank, world: _wrap_differently(  # units kept on rank 1 only
        rank, world, lambda r: {"reshard_after_forward": False} if r == 1 else {}),
    "wrap_different_offload_params": lambda rank, world: _wrap_differently(
        rank, world, lambda r: {"offload_params": "cpu"} if r == 1 else {}),
    "wrap_different_offload_optimizer": lambda rank, world: _wrap_differently(  # state in files on rank 1 only
        rank, world, lambda r: {"offload_optimizer": "nvme", "offload_path": tempfile.mkdtemp()} if r == 1 else {}),
    "wrap_different_max_live_mb": lambda rank, world: _wrap_differently(  # prefetch bounded on rank 1 only
        rank, world, lambda r: {"max_live_mb": 0.001} if r == 1 else {}),
    # What fails on one rank only before the ranks agree (rank 1's file system,
    # devices or arguments), or after it (rank 1 cannot reserve its file's space).
    "wrap_offload_path_a_file_on_one_rank": lambda rank, world: _wrap_differently(
        rank, world, lambda r: _nvme(r, _a_file_in)),
    "wrap_offload_path_not_creatable_on_one_rank": lambda rank, world: _wrap_differently(
        rank, world, lambda r: _nvme(r, _below_a_file)),
    "wrap_offload_space_not_reserved_on_one_rank": offload_space_not_reserved_on_one_rank,
    "wrap_a_stage_out_of_range_on_one_rank": lambda rank, world: _wrap_differently(
        rank, world, lambda r: {"stage": 5} if r == 1 else {}),
    "wrap_meta_device_missing_on_one_rank": meta_device_missing_on_one_rank,
    "wrap_reached_late_by_one_rank": wrap_reached_late_by_one_rank,
}
