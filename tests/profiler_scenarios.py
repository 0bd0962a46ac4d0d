"""zero_ext's phases as labels in a torch.profiler trace, run by
test_profiler.py on spawned gloo ranks: one step of parity_scenarios.Blocks
(stage 3: a unit per block) under the profiler; an item "stageN" returns
None or the labels missing from the trace."""
from typing import List, Optional

import torch
import torch.nn.functional as F

import zero_ext
from parity_scenarios import BATCH, SEQ, VOCAB, Blocks


def expected(stage: int, buckets: int, units: int) -> List[str]:
    reduce = "zero_ext::all_reduce bucket" if stage == 0 else "zero_ext::reduce_scatter bucket"
    labels = [f"{reduce} {b}" for b in range(buckets)] + ["zero_ext::epilogue", "zero_ext::step"]
    if stage == 3:  # the root unit stays gathered from forward into backward; the blocks are gathered twice
        labels += [f"zero_ext::all_gather unit {u}" for u in range(1, units)]
    return labels


def run_one(rank: int, world: int, item: str) -> Optional[str]:
    stage = int(item.removeprefix("stage"))
    model = Blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = zero_ext.wrap(model, opt, stage=stage, bucket_mb=0.0005)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
    names = {e.name for e in prof.events()}
    buckets = len(model._zero_ext.core.bucket_layout()) // 3
    units = model._zero_ext.core.stats()["units"]
    missing = [label for label in expected(stage, buckets, units) if label not in names]
    if missing:
        return f"labels missing from the trace: {missing}; zero_ext's there: {sorted(n for n in names if 'zero_ext' in n)}"
    return None


def all_items() -> List[str]:
    return [f"stage{s}" for s in (0, 1, 2, 3)]
