"""Models people train off the dense path, wrapped by zero_ext on N ranks and
as the parity suite's single-process reference over the global batch
(tests/parity_scenarios.py's Context): MoE layers whose routing skips experts
differently on every rank, a top-level MoE outside any block, blocks kept in
ModuleDicts. Plus the ways ranks can disagree (an expert made a unit of its
own and skipped, a rank-0-only evaluation, with or without a barrier after
it, evaluation loops of different lengths, a forward that raised on one rank
only, wrap() with different models or options): every rank must end in
zero_ext's own error, never a wrong number, a hang or an abort inside gloo.
Those scenarios catch the error and return it, so one group of ranks runs
them all (zero_ext never hands a failed model's groups to another model).
"""
from __future__ import annotations

import os
import tempfile
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import parity_scenarios as ps
import zero_ext
from parity_scenarios import BATCH, DIM, SEQ, VOCAB

N_EXPERTS = 4
ONE_UNIT_PER_BLOCK_MB = 1e-4  # ~100 bytes: no two blocks merge into one unit
CHECK_TIMEOUT = 20.0  # seconds; bounds any wait a failing scenario leaves behind


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(h)))


class MoE(nn.Module):
    """Top-1 routing by a learned gate, as transformers v4 and most third-party
    code write it: experts in an nn.ModuleList, one that no token picks does
    not run. `only`: the experts this forward may run (a rank-dependent
    choice, to make ranks disagree on purpose)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, N_EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(N_EXPERTS))
        self.ran: List[List[int]] = []
        self.only: Optional[List[int]] = None
        self.dense = False  # every expert on every token (weighted): no expert skipped

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tokens = h.reshape(-1, DIM)
        logits = self.gate(tokens)
        if self.dense:
            weights = logits.softmax(-1)
            self.ran.append(list(range(N_EXPERTS)))
            return sum(weights[:, i, None] * e(tokens) for i, e in enumerate(self.experts)).reshape(h.shape)
        if self.only is not None:
            mask = torch.full((N_EXPERTS,), float("-inf"))
            mask[self.only] = 0.0
            logits = logits + mask
        weight, choice = logits.softmax(-1).max(-1)
        out = torch.zeros_like(tokens)
        ran = []
        for i, expert in enumerate(self.experts):
            picked = choice == i
            if picked.any():
                out = out.index_put((picked,), expert(tokens[picked]) * weight[picked, None])
                ran.append(i)
        self.ran.append(ran)
        return out.reshape(h.shape)


class MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mix = nn.Linear(DIM, DIM)  # stands for attention: runs every step
        self.moe = MoE()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + torch.tanh(self.mix(self.norm(h)))
        return h + self.moe(h)


class MoEModel(nn.Module):
    """Embedding, decoder blocks each holding an MoE, a head."""

    def __init__(self, n_blocks: int = 3, seed: int = 21, std: float = 0.5):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(n_blocks))
        self.head = nn.Linear(DIM, VOCAB)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" not in name:
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def moes(self) -> List[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class FlatMoEModel(MoEModel):
    """An MoE outside any block (the model holds it directly): its experts are
    repeated children of a ModuleList, yet never default units."""

    def __init__(self):
        super().__init__(n_blocks=0, seed=22)
        g = torch.Generator().manual_seed(24)  # a seed whose routing differs between ranks at worlds 2 and 4
        self.inner = nn.Linear(DIM, DIM)
        self.moe = MoE()
        with torch.no_grad():
            for p in list(self.inner.parameters()) + list(self.moe.parameters()):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inner(self.embed(tokens)))
        return self.head(h + self.moe(h))


def tokens_of(world: int, step: int, rank: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(700 + 31 * step + salt)
    return torch.randint(0, VOCAB, (world * BATCH, SEQ + 1), generator=g)[rank * BATCH:(rank + 1) * BATCH]


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def global_loss(ctx: ps.Context, model: nn.Module, step: int) -> torch.Tensor:
    return sum(w * lm_loss(model, tokens_of(ctx.world, step, r)) for r, w in ctx.participants())


def _ranks_ran_different_experts(ctx: ps.Context, model: nn.Module) -> bool:
    """Whether, in the forwards since the last call, some rank ran a set of
    experts another did not (the point of the scenario)."""
    ran = torch.zeros(len(model.moes()), N_EXPERTS)
    for k, moe in enumerate(model.moes()):
        for forward in moe.ran:
            ran[k, forward] += 1
        moe.ran.clear()
    if ctx.reference or ctx.world == 1:
        return True
    every = [torch.zeros_like(ran) for _ in range(ctx.world)]
    dist.all_gather(every, ran)
    return any(not torch.equal(every[0], other) for other in every[1:])


def _train_then_evaluate(ctx: ps.Context, model: nn.Module, wrap_options: dict, steps: int = 3) -> None:
    """AdamW steps over the global batch (gradients and parameters recorded
    against the reference), then each rank's loss on held-out tokens under
    torch.no_grad(), against the unwrapped model's."""
    # Some expert weights get gradients near zero whose terms cancel: eps=1e-2 keeps
    # Adam's step within the gradients' tolerance (parity_scenarios.conditioned_adamw).
    opt = ps.conditioned_adamw(model.parameters())
    model, opt = ctx.wrap(model, opt, **wrap_options)
    for step in range(steps):
        global_loss(ctx, model, step).backward()
        ps.step_and_record(ctx, model, opt, step)
    differed = _ranks_ran_different_experts(ctx, model)
    model.eval()
    with torch.no_grad():
        for k in range(2):
            ctx.record_value(f"no_grad evaluation {k} on rank {ctx.rank}'s tokens",
                             lm_loss(model, tokens_of(ctx.world, 100 + k, ctx.rank, salt=5)))
    differed = _ranks_ran_different_experts(ctx, model) or differed  # collective: both calls on every rank
    ctx.record_check("the ranks ran different experts", differed)
    blocks = len(getattr(model, "blocks", []))
    ctx.record_check(f"stage 3: one unit per block ({blocks}) and the root, no expert a unit",
                     ctx.reference or ctx.stage != 3 or model._zero_ext.core.stats()["units"] == 1 + blocks)


def moe_in_blocks(ctx: ps.Context) -> None:
    """Experts in an nn.ModuleList inside each decoder block, skipped when no
    token routes to them, differently on every rank: each block is a unit,
    its experts inside it (the default policy never looks below a block).
    Weights of std 0.3: at 0.5 the gradients (up to 7) move by up to 100
    times a change of the parameters' rounding, beyond RTOL/ATOL where the
    ranks' gradients are summed in another order."""
    _train_then_evaluate(ctx, MoEModel(std=0.3), {})


def moe_outside_any_block(ctx: ps.Context) -> None:
    """An MoE the model holds directly: its experts are no units (the
    default policy skips expert lists)."""
    _train_then_evaluate(ctx, FlatMoEModel(), {})


class DictBlocksModel(nn.Module):
    """Blocks kept as nn.ModuleDicts, their parts called by the parent."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(24)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"norm": nn.LayerNorm(DIM), "attn": nn.Linear(DIM, DIM), "mlp": nn.Linear(DIM, DIM)})
            for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" not in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + torch.tanh(layer["attn"](layer["norm"](h)))
            h = h + torch.tanh(layer["mlp"](h))
        return self.head(h)


def module_dict_blocks(ctx: ps.Context) -> None:
    model = DictBlocksModel()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    model, opt = ctx.wrap(model, opt)  # the parity Context's ~500-byte buckets: one unit per block
    ctx.record_check("stage 3: one unit per ModuleDict block and the root",
                     ctx.reference or ctx.stage != 3 or model._zero_ext.core.stats()["units"] == 4)
    for step in range(3):
        global_loss(ctx, model, step).backward()
        ps.step_and_record(ctx, model, opt, step)
    with torch.no_grad():
        ctx.record_value(f"no_grad evaluation on rank {ctx.rank}'s tokens",
                         lm_loss(model, tokens_of(ctx.world, 100, ctx.rank, salt=5)))


SCENARIOS: Dict[str, Callable[[ps.Context], None]] = {
    f.__name__: f for f in [moe_in_blocks, moe_outside_any_block, module_dict_blocks]
}
STAGE3_ONLY = {"moe_outside_any_block", "module_dict_blocks"}


def items() -> List[str]:
    return [f"{name}/stage{stage}" for name in SCENARIOS
            for stage in ((3,) if name in STAGE3_ONLY else (0, 1, 2, 3))]


_REFERENCES: Dict = {}


def run_one(rank: int, world: int, item: str):
    """A parity item ("name/stageN": None or the first mismatch) or a
    divergence item ("diverge/name": what each rank saw)."""
    if item.startswith("diverge/"):
        return DIVERGENCES[item.split("/", 1)[1]](rank, world)
    name, stage = item.rsplit("/stage", 1)
    if (name, world) not in _REFERENCES:
        ref_ctx = ps.Context(stage=0, rank=rank, world=world, reference=True)
        SCENARIOS[name](ref_ctx)
        _REFERENCES[(name, world)] = ref_ctx.checkpoints
    ctx = ps.Context(stage=int(stage), rank=rank, world=world, reference=False)
    SCENARIOS[name](ctx)
    return ps.compare(_REFERENCES[(name, world)], ctx.checkpoints)


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


def expert_units_skipped_in_training(rank: int, world: int) -> dict:
    """units={Expert} asks for one unit per expert; at step 1 rank 0's tokens
    pick experts 0-1 and the others' experts 2-3."""
    def body(outputs, mark):
        model, opt = _moe_wrapped(units={Expert}, bucket_mb=ONE_UNIT_PER_BLOCK_MB)
        for step in range(3):
            if step == 1:
                mark()
                _route_differently(model, rank, [0, 1] if rank == 0 else [2, 3])
            loss = lm_loss(model, tokens_of(world, step, rank))
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
