"""Python calls made during one `loss.backward()`, per zero_ext stage.

    python benchmarks/python_calls.py                      # stages 0-3, 40 and 400 parameters
    python benchmarks/python_calls.py --stages 3 --params 40 400 4000

The model is a stack of identical blocks (nn.Linear(8, 8): 2 parameters each)
in an nn.ModuleList, so at stage 3 the default unit policy makes every block a
unit. It is wrapped at world size 1 (a one-rank gloo group, made here when
torch.distributed is not initialized), trained for a few warmup steps, then
one forward is run and `sys.setprofile` records the events of the following
`loss.backward()` only (profiling starts right before it and stops right after).

Columns: `zero_ext calls` are Python 'call' events of functions defined in the
zero_ext package; `zero_ext c_calls` are 'c_call' events made from zero_ext's
Python code (calls of built-in C functions such as list.pop or
queue_callback; calls of the extension's torch.classes methods are not
'c_call' events, so they are not in this column);
`all calls` / `all c_calls` count the same events from any file (torch's own
`Tensor.backward` -> `torch.autograd.backward` Python included, so they are
not 0 even for plain PyTorch, shown as the `plain` row). `units` is the
number of stage 3 units including the root (zero_ext's own count). Counts are
exact, not timings: the same on every run.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import tempfile
from typing import Dict, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

import zero_ext

ZERO_EXT_DIR = os.path.dirname(os.path.abspath(zero_ext.__file__)) + os.sep
BLOCK_DIM = 8


class Stack(nn.Module):
    """n_params // 2 identical nn.Linear blocks in a ModuleList."""

    def __init__(self, n_params: int):
        super().__init__()
        if n_params % 2:
            raise ValueError("n_params must be even (each block holds a weight and a bias)")
        self.blocks = nn.ModuleList(nn.Linear(BLOCK_DIM, BLOCK_DIM) for _ in range(n_params // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo group for the duration, unless one is initialized already."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


class _Counter:
    def __init__(self) -> None:
        self.counts = {"zero_ext_calls": 0, "zero_ext_c_calls": 0, "all_calls": 0, "all_c_calls": 0}
        self.zero_ext_functions: Dict[str, int] = {}

    def __call__(self, frame, event, arg) -> None:
        if event == "call":
            self.counts["all_calls"] += 1
            filename = frame.f_code.co_filename
            if filename.startswith(ZERO_EXT_DIR):
                self.counts["zero_ext_calls"] += 1
                key = f"{os.path.relpath(filename, ZERO_EXT_DIR)}:{frame.f_code.co_name}"
                self.zero_ext_functions[key] = self.zero_ext_functions.get(key, 0) + 1
        elif event == "c_call":
            self.counts["all_c_calls"] += 1
            if frame.f_code.co_filename.startswith(ZERO_EXT_DIR):
                self.counts["zero_ext_c_calls"] += 1
                key = f"c:{getattr(arg, '__qualname__', getattr(arg, '__name__', repr(arg)))}"
                self.zero_ext_functions[key] = self.zero_ext_functions.get(key, 0) + 1


def _unit_count(model: nn.Module, stage: Optional[int]) -> int:
    if stage != 3:
        return 0
    try:
        return int(model._zero_ext.handles.diagnostics.stats()["units"])
    except Exception:  # noqa: BLE001 - an internal that may move; the count is informative only
        return -1


def measure_backward(stage: Optional[int], n_params: int, warmup: int = 2, batch: int = 4,
                     unit_per_block: bool = False) -> dict:
    """Events of one backward; stage None is plain PyTorch (not wrapped).
    `unit_per_block`: stage 3 with units={nn.Linear} (one unit per block)
    instead of the default policy, which merges these small blocks."""
    torch.manual_seed(0)
    model = Stack(n_params)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with one_rank_group():
        if stage is not None:
            extra = {"units": {nn.Linear}} if unit_per_block and stage == 3 else {}
            model, opt = zero_ext.wrap(model, opt, stage=stage, **extra)
        x = torch.randn(batch, BLOCK_DIM)
        for _ in range(warmup):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        loss = model(x).square().mean()
        counter = _Counter()
        gc_was_enabled = gc.isenabled()
        gc.disable()  # no collector-driven __del__ calls inside the window
        try:
            sys.setprofile(counter)
            try:
                loss.backward()
            finally:
                sys.setprofile(None)
        finally:
            if gc_was_enabled:
                gc.enable()
        counter.counts["all_c_calls"] -= 1  # the sys.setprofile(None) call that ends the window
        opt.step()
        opt.zero_grad()
        units = _unit_count(model, stage)
    return {"stage": stage, "params": n_params, "units": units, **counter.counts,
            "zero_ext_functions": counter.zero_ext_functions}


def count_backward_python_calls(stage: int, n_params: int) -> int:
    """Python function calls into zero_ext's code during one backward at world size 1."""
    return measure_backward(stage, n_params)["zero_ext_calls"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--params", nargs="+", type=int, default=[40, 400])
    parser.add_argument("--no-plain", action="store_true", help="leave out the unwrapped PyTorch rows")
    parser.add_argument("--functions", action="store_true",
                        help="also list which zero_ext functions were called, with counts")
    args = parser.parse_args()
    torch.set_num_threads(1)

    rows = []
    for n in args.params:
        if not args.no_plain:
            rows.append(measure_backward(None, n))
        for stage in args.stages:
            rows.append(measure_backward(stage, n))
            if stage == 3:  # and with one unit per block, the per-unit path at full count
                rows.append(measure_backward(stage, n, unit_per_block=True))
    print(f"Python events during one loss.backward(), world size 1 (gloo, CPU), "
          f"model: ModuleList of nn.Linear({BLOCK_DIM}, {BLOCK_DIM}) blocks")
    header = (f"{'stage':<6} {'params':>7} {'units':>6} {'zero_ext calls':>15} {'zero_ext c_calls':>17} "
              f"{'all calls':>10} {'all c_calls':>12}")
    print(header)
    print("-" * len(header))
    for r in rows:
        stage = "plain" if r["stage"] is None else str(r["stage"])
        units = "-" if r["stage"] != 3 else str(r["units"])
        print(f"{stage:<6} {r['params']:>7} {units:>6} {r['zero_ext_calls']:>15} {r['zero_ext_c_calls']:>17} "
              f"{r['all_calls']:>10} {r['all_c_calls']:>12}")
    if args.functions:
        for r in rows:
            if r["zero_ext_functions"]:
                print(f"\nstage {r['stage']}, {r['params']} params:")
                for name, count in sorted(r["zero_ext_functions"].items(), key=lambda kv: -kv[1]):
                    print(f"  {count:>6}  {name}")


if __name__ == "__main__":
    main()
