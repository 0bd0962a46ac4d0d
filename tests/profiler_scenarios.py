"""zero_ext's phases as labels in a torch.profiler trace, run by
test_profiler.py on spawned gloo ranks. An item "stageN": one step of
parity_scenarios.Blocks (stage 3: a unit per block) under the profiler.
An item "stack/stageN" ("stack/bf16/stageN": under bf16): two steps of
GainBlocks traced with with_stack=True, the second trace starting between
two backward passes; the parameters must equal an untraced run's exactly.
Each returns None or what went wrong."""
import contextlib
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import zero_ext
from parity_scenarios import BATCH, DIM, SEQ, VOCAB, Block, Blocks


def expected(stage: int, buckets: int, units: int) -> List[str]:
    reduce = "zero_ext::all_reduce bucket" if stage == 0 else "zero_ext::reduce_scatter bucket"
    labels = [f"{reduce} {b}" for b in range(buckets)] + ["zero_ext::epilogue", "zero_ext::step"]
    if stage == 3:  # the root unit stays gathered from forward into backward; the blocks are gathered twice
        labels += [f"zero_ext::all_gather unit {u}" for u in range(1, units)]
    return labels


def _missing(model: nn.Module, stage: int, names: set) -> Optional[str]:
    buckets = len(model._zero_ext.handles.reduction.bucket_layout()) // 3
    units = model._zero_ext.handles.diagnostics.stats()["units"]
    missing = [label for label in expected(stage, buckets, units) if label not in names]
    if missing:
        return f"labels missing from the trace: {missing}; zero_ext's there: {sorted(n for n in names if 'zero_ext' in n)}"
    return None


def _tokens(rank: int, k: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 * rank + k))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def run_labels(rank: int, stage: int) -> Optional[str]:
    model = Blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = zero_ext.wrap(model, opt, stage=stage, bucket_mb=0.0005)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _loss(model, _tokens(rank, 0)).backward()
        opt.step()
    return _missing(model, stage, {e.name for e in prof.events()})


class GainBlock(Block):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(DIM))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return super().forward(h) * self.gain


class GainBlocks(Blocks):
    """Blocks whose root and blocks (stage 3's units) hold parameters of
    their own: torch's Python tracer reads a module's own parameters and
    their .grad on entering its __call__, before any hook runs."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(GainBlock() for _ in range(3))
        self.bias = nn.Parameter(torch.zeros(VOCAB))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(tokens) + self.bias


def _train_traced(rank: int, stage: int, precision: Optional[str], traced: bool):
    """Two steps; with `traced`, step 1 whole in a with_stack trace and step
    2's trace starting after its first micro-batch's backward (its .grad
    then holds zero_ext's gradient stand-ins, but in fp32 stage 0)."""
    model = GainBlocks()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = zero_ext.wrap(model, opt, stage=stage, bucket_mb=0.0005, mixed_precision=precision)

    def trace():
        if not traced:
            return contextlib.nullcontext()
        return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True)

    traces = []
    with trace() as prof:
        _loss(model, _tokens(rank, 0)).backward()
        opt.step()
        opt.zero_grad()
    traces.append(prof)
    _loss(model, _tokens(rank, 1)).backward()
    with trace() as prof:
        _loss(model, _tokens(rank, 2)).backward()
        opt.step()
        opt.zero_grad()
    traces.append(prof)
    return model, zero_ext.full_state_dict(model), traces


def run_stack(rank: int, stage: int, precision: Optional[str]) -> Optional[str]:
    _, want, _ = _train_traced(rank, stage, precision, traced=False)
    model, got, traces = _train_traced(rank, stage, precision, traced=True)
    for k, prof in enumerate(traces, start=1):
        missing = _missing(model, stage, {e.name for e in prof.events()})
        if missing:
            return f"trace {k}: {missing}"
    different = [name for name in want if not torch.equal(got[name], want[name])]
    if different:
        return f"traced run differs from the untraced one in {different}"
    return None


def run_one(rank: int, world: int, item: str) -> Optional[str]:
    kind, _, stage = item.rpartition("stage")
    if kind.startswith("stack/"):
        return run_stack(rank, int(stage), "bf16" if "bf16" in kind else None)
    return run_labels(rank, int(stage))


LABEL_ITEMS = [f"stage{s}" for s in (0, 1, 2, 3)]
STACK_ITEMS = [f"stack/stage{s}" for s in (0, 1, 2, 3)] + ["stack/bf16/stage0"]


def all_items() -> List[str]:
    return LABEL_ITEMS + STACK_ITEMS
