"""torch.compile with zero_ext, run by test_compile.py on spawned gloo ranks.

An item "MODE/stageN" (or "MODE/stage3/kept": reshard_after_forward=False) trains parity_scenarios.Blocks (3 blocks, stage 3's
default units, a tied output layer) for a few AdamW steps twice: eagerly,
and with MODE's compilation; it returns None or the first difference (losses
per step, then parameters), or the graph breaks Dynamo reported.
- blocks: each block compiled in place (block.compile(), regional
  compilation as torchtitan does it with FSDP2); stage 3's unit hooks run
  inside the compiled call, and no graph break at all is allowed.
- whole: the whole model compiled (model.compile()).
- fullgraph (stages 0-3): a function calling the model compiled with
  fullgraph=True (Dynamo inlines the model's call, hooks included): zero_ext's
  root hooks are traced into the graph (runtime/compiled_forward.py), stage
  3's parameter reads are its gather op (runtime/compiled_units.py), no
  graph break, and the result is bitwise the eager one's. At stage 3 also:
  no unit left gathered after the forward, gathers in the backward (its
  reads recomputed; none with reshard_after_forward=False, "kept"), and a
  reduction issued before the backward's last gather (gradients handed over
  inside the compiled backward).
- fullgraph-module (stages 0-3): torch.compile(model, fullgraph=True) on the
  model itself, and torch._dynamo.explain(model) reporting no graph break.
- autograd-grad (stages 2-3): torch.autograd.grad with respect to the
  parameters through the compiled model, as eagerly, zero_ext accumulating
  nothing.
- fullgraph/stage2/accumulate: a micro-batch under no_sync(), then a
  backward run twice over one forward (retain_graph), bitwise as eager.
- fullgraph/stage{0,2}/eager-use: the loss also takes a term computed
  outside the graph from a weight the graph reads: its gradient is added
  to the graph's, not lost; as eager within rounding (it arrives after the
  weight's bucket went out and is reduced in a second round: the ranks' sums
  are added in another order).
- compiled-autograd (stages 0, 2, 3): a train step (forward, loss and
  loss.backward()) compiled with compiled autograd on, so the backward is
  compiled autograd's graph too: bitwise the eager result, one epilogue per
  backward, compiled autograd's graphs traced in the first step only, and
  one process's result over the global batch within rounding. Variants:
  fp16 with loss scaling (stage 3), and accumulate (stages 2 and 3: a
  micro-batch under no_sync(), then one backward run twice over a retained
  graph), and model (stage 3: only the model compiled with compiled autograd
  on, the backward the engine's, outside: one epilogue per backward still).
- fullgraph-inductor (stages 0-3): the same with Inductor, equal to eager
  within Inductor's rounding. It fuses and reorders fp32 sums: a sum of n
  terms may move by n * eps relative (eps 1.2e-7; the longest sum here is
  the batch's, BATCH * SEQ <= 64 terms: under 1e-5). AdamW's update is
  lr * m / sqrt(v), a ratio of such sums, so each step moves a parameter by
  at most lr * 1e-5 = 1e-7 more than eagerly, and the loss by the same
  relative order; rtol 1e-4 (atol 1e-5) leaves a factor of 10 over three
  steps and any BLAS's blocking.
Backend aot_eager (but fullgraph-inductor): Dynamo and AOTAutograd, the
parts that meet zero_ext's hooks, storage release and autograd nodes,
without a C++ compile per graph.
"""
from contextlib import nullcontext
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

import zero_ext
from parity_scenarios import BATCH, SEQ, VOCAB, Blocks

BACKEND = "aot_eager"
EXPLAINED: List[int] = []  # torch._dynamo.explain's graph break counts, by fullgraph-module items
STEPS = 3
MODES = ("blocks", "whole")
FULLGRAPH_STAGES = (0, 1, 2, 3)


def _compiled_autograd_step(model: torch.nn.Module, scale: float, model_only: bool):
    """A train step compiled with compiled autograd on: forward, loss and
    backward (`twice`: twice over a retained graph) in one compiled function;
    `model_only`: the model compiled so, the backward run by the engine
    outside it (the forward's reads are detached then too)."""
    with torch._dynamo.config.patch(compiled_autograd=True):
        forward = torch.compile(model, backend=BACKEND) if model_only else model

    def step(tokens: torch.Tensor, twice: bool) -> torch.Tensor:
        logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) * scale
        if twice:
            loss.backward(retain_graph=True)
        loss.backward()
        return loss

    if model_only:
        return step
    with torch._dynamo.config.patch(compiled_autograd=True):
        return torch.compile(step, backend=BACKEND)


def _train(stage: int, rank: int, world: int, mode: Optional[str], accumulate: bool = False,
           gathers: Optional[list] = None, model_only: bool = False, eager_use: bool = False,
           **options) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """`gathers`: if a list, gets per step (units the core holds gathered
    after the forward, bucket gathers during the backward)."""
    model = Blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    model, opt = zero_ext.wrap(model, opt, stage=stage, bucket_mb=0.0005, **options)
    if mode == "compiled-autograd":
        scale = 2.0 ** -20 if "mixed_precision" in options else 1.0
        step_fn = _compiled_autograd_step(model, scale, model_only)
        from torch._dynamo.utils import counters

        losses, captures = [], []
        diagnostics = model._zero_ext.handles.diagnostics
        for step in range(STEPS):
            g = torch.Generator().manual_seed(700 + step)
            tokens = torch.randint(0, VOCAB, (world * BATCH, SEQ + 1), generator=g)[rank * BATCH:(rank + 1) * BATCH]
            before = diagnostics.stats().epilogues
            if accumulate:
                with model.no_sync():
                    step_fn(tokens.flip(0), False)
            loss = step_fn(tokens, accumulate)
            backwards = 3 if accumulate else 1
            ran = diagnostics.stats().epilogues - before
            if ran != backwards:
                raise AssertionError(f"step {step}: {ran} epilogues for {backwards} backward calls")
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            captures.append(counters["compiled_autograd"]["captures"])
        # Compiled autograd traced the backward (each kind of backward) in
        # the first step and reused its graphs after, as for a plain model.
        if model_only and captures[-1]:
            raise AssertionError(f"compiled autograd captured {captures[-1]} backward graphs of the engine's backward")
        if not model_only and (not captures[0] or captures[-1] != captures[0]):
            raise AssertionError(f"compiled autograd's captures after each step: {captures}")
        return losses, zero_ext.full_state_dict(model)
    if mode == "blocks":
        for block in model.blocks:
            block.compile(backend=BACKEND)  # FSDP2's idiom: zero_ext's unit hooks are inside what is compiled
    elif mode == "whole":
        model.compile(backend=BACKEND)
    forward = model
    if mode == "fullgraph-module":  # the module itself, as docs/torch-compile-and-profiling.md shows it
        forward = torch.compile(model, fullgraph=True, backend=BACKEND)
    if mode in ("fullgraph", "fullgraph-inductor"):
        # A function that calls the model, as a compiled train step does:
        # Dynamo inlines the model's __call__, its hooks included (compiling
        # the module itself may start the trace at its forward, hooks outside).
        forward = torch.compile(lambda tokens: model(tokens), fullgraph=True,
                                backend=BACKEND if mode == "fullgraph" else "inductor")
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(700 + step)
        tokens = torch.randint(0, VOCAB, (world * BATCH, SEQ + 1), generator=g)[rank * BATCH:(rank + 1) * BATCH]
        if accumulate:  # a micro-batch under no_sync(), then one backward twice over its forward
            with model.no_sync():
                logits = forward(tokens[:, :-1].flip(0))
                F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flip(0).flatten()).backward()
            logits = forward(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward(retain_graph=True)  # the epilogue waits for the graph's last backward
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            continue
        logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        if eager_use:  # a term outside the compiled graph on a weight it reads too (the parameter itself)
            loss = loss + 0.01 * model.blocks[0].ff.weight.square().sum()
        if "mixed_precision" in options:  # fp16 gradients ~1e-9: zero unless the loss scale lifts them
            loss = loss * 2.0 ** -20
        diagnostics = model._zero_ext.handles.diagnostics
        after_forward = diagnostics.stats()
        if gathers is not None:
            diagnostics.log_issues(True)
        loss.backward()
        if gathers is not None:
            issued = [entry.split()[0] for entry in diagnostics.take_issue_log()]
            diagnostics.log_issues(False)
            # A bucket's reduction goes out while the compiled backward still
            # gathers earlier units, not after the whole graph ran.
            overlapped = "reduce" in issued and "gather" in issued and issued.index("reduce") < (
                len(issued) - 1 - issued[::-1].index("gather"))
            gathers.append((after_forward["gathered_units"],
                            diagnostics.stats()["param_gathers"] - after_forward["param_gathers"], overlapped))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if mode == "fullgraph-module":  # what a user asks Dynamo: the wrapped model's graph breaks
        explained = torch._dynamo.explain(model)(tokens[:, :-1])
        EXPLAINED.append(explained.graph_break_count)
        opt.zero_grad()
    return losses, zero_ext.full_state_dict(model)


def _one_process(world: int, accumulate: bool) -> Dict[str, torch.Tensor]:
    """The model trained as one process over the global batch (no zero_ext):
    what the compiled-autograd items must also equal."""
    model = Blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(700 + step)
        tokens = torch.randint(0, VOCAB, (world * BATCH, SEQ + 1), generator=g)
        shards = tokens.chunk(world)
        passes = [(torch.cat([t.flip(0) for t in shards]), False), (tokens, True)] if accumulate else [(tokens, False)]
        for batch, twice in passes:
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            for _ in range(2 if twice else 1):
                loss.backward(retain_graph=True)
        opt.step()
        opt.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _autograd_grad(stage: int, rank: int, world: int) -> Optional[str]:
    """torch.autograd.grad with respect to the parameters, through the
    compiled model: the gradients it returns are the eager model's (bitwise,
    aot_eager), and zero_ext accumulates none of them (the backward's
    hand-over in the graph passes them on: [Note: gradients handed over in
    the graph])."""
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = Blocks()
        model, _ = zero_ext.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage,
                                 bucket_mb=0.0005)
        forward = torch.compile(model, fullgraph=True, backend=BACKEND) if compiled else model
        g = torch.Generator().manual_seed(900)
        tokens = torch.randint(0, VOCAB, (world * BATCH, SEQ + 1), generator=g)[rank * BATCH:(rank + 1) * BATCH]
        params = [p for p in model.parameters() if p.requires_grad]
        logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        results.append(torch.autograd.grad(loss, params))
        kept = [name for name, grad in zero_ext.full_grads(model).items() if grad is not None and grad.any()]
        if kept:
            return f"compiled={compiled}: zero_ext accumulated gradients of {kept[:3]}"
    for k, (a, b) in enumerate(zip(*results)):
        if not torch.equal(a, b):
            return f"parameter {k}: autograd.grad through the compiled model differs by {(a - b).abs().max().item()}"
    return None


def run_one(rank: int, world: int, item: str) -> Optional[str]:
    from torch._dynamo.utils import counters

    if item.startswith("autograd-grad/"):
        return _autograd_grad(int(item.split("/stage")[1]), rank, world)
    mode, stage = item.split("/stage")
    stage, _, variant = stage.partition("/")
    options = {"reshard_after_forward": False} if variant == "kept" else {}
    if variant == "fp16":  # the loss scale applied in the compiled backward
        options = {"mixed_precision": zero_ext.MixedPrecision(param_dtype=torch.float16)}
    if variant == "accumulate":  # no_sync() and a second backward (retain_graph) through the compiled graph
        options = {"accumulate": True}
    if variant == "model":  # compiled autograd on for the model's compile only: the engine runs the backward
        options = {"model_only": True}
    if variant == "eager-use":  # a weight the graph reads, used by eager code in the loss too
        options = {"eager_use": True}
    torch._dynamo.reset()
    # A compiled backward run twice (retain_graph) needs donated buffers off:
    # torch's own rule for any compiled model, zero_ext or not.
    retained = torch._functorch.config.patch(donated_buffer=False) if variant == "accumulate" else nullcontext()
    gathers = [] if stage == "3" and mode.startswith("fullgraph") and variant != "accumulate" else None
    with retained:
        eager_losses, eager_params = _train(int(stage), rank, world, None, **options)
        counters.clear()
        losses, params = _train(int(stage), rank, world, mode, gathers=gathers, **options)
    breaks = dict(counters["graph_break"])
    if mode == "fullgraph-module" and EXPLAINED.pop():
        return "torch._dynamo.explain reports a graph break in the wrapped model"
    if mode in ("blocks", "fullgraph", "fullgraph-module", "fullgraph-inductor") and breaks:
        return f"graph breaks ({mode}): {breaks}"
    if mode == "compiled-autograd":
        # torch 2.13's own break at loss.backward() (unless trace_autograd_ops)
        # is the user's step's, not zero_ext's: none in the backward's graph.
        others = [reason for reason in breaks if "backward" not in reason.split("\n")[0]]
        if others:
            return f"graph breaks ({mode}): {others}"
    # Stage 3 in the graph: no unit left gathered by the forward (the graph
    # holds its own copies); the backward gathers again (its reads are
    # recomputed), but not a unit kept from forward to backward.
    for step, (held, backward_gathers, overlapped) in enumerate(gathers or []):
        if variant != "kept" and not overlapped:
            return f"step {step}: every reduction went out after the backward's last gather (no overlap)"
        if held:
            return f"step {step}: {held} units still gathered after the compiled forward"
        if variant == "kept" and backward_gathers:
            return f"step {step}: {backward_gathers} gathers in backward with reshard_after_forward=False"
        if variant != "kept" and not backward_gathers:
            return f"step {step}: no gather in backward: the forward's gathered values were saved for it"
    if mode == "whole" and not counters["stats"]["unique_graphs"]:
        return "nothing was compiled"
    if mode == "compiled-autograd" and variant != "fp16":
        # One process over the global batch, summed in another order: fp32
        # sums of BATCH * SEQ * world = 40 terms differ by at most 40 * eps
        # (eps 1.2e-7) relative, 5e-6; AdamW's update lr * m / sqrt(v), a ratio
        # of such sums, by about twice that: lr * 1e-5 = 1e-7 per step, 3e-7
        # over three. atol 1e-6 leaves a factor 3, whatever the CPU's BLAS.
        for name, p in _one_process(world, variant == "accumulate").items():
            if not torch.allclose(params[name], p, rtol=1e-5, atol=1e-6):
                return f"{name}: {(params[name] - p).abs().max().item()} from one process after {STEPS} steps"
    if mode in ("fullgraph", "fullgraph-module", "compiled-autograd") and variant != "eager-use":  # bitwise
        for step, (a, b) in enumerate(zip(eager_losses, losses)):
            if a != b:
                return f"step {step}: loss {b!r} compiled, {a!r} eager (bitwise expected)"
        for name, p in eager_params.items():
            if not torch.equal(params[name], p):
                return f"{name}: max abs diff {(params[name] - p).abs().max().item()} after {STEPS} steps (bitwise)"
        return None
    rtol = 1e-4 if mode == "fullgraph-inductor" else 1e-5
    for step, (a, b) in enumerate(zip(eager_losses, losses)):
        if abs(a - b) > rtol * max(1.0, abs(a)):
            return f"step {step}: loss {b} compiled, {a} eager"
    for name, p in eager_params.items():
        if not torch.allclose(params[name], p, rtol=rtol, atol=rtol / 10):
            return f"{name}: max abs diff {(params[name] - p).abs().max().item()} after {STEPS} steps"
    return None


def all_items() -> List[str]:
    """Each mode at each stage, and stage 3 with its units kept gathered from
    forward to backward (reshard_after_forward=False)."""
    return ([f"{mode}/stage{stage}" for mode in MODES for stage in (0, 1, 2, 3)] + [f"{m}/stage3/kept" for m in MODES]
            + [f"fullgraph/stage{stage}" for stage in FULLGRAPH_STAGES]
            + [f"fullgraph-inductor/stage{stage}" for stage in (0, 1, 2, 3)]
            + [f"fullgraph/stage{stage}/{variant}" for stage in (2, 3) for variant in ("fp16", "accumulate")]
            + ["fullgraph/stage3/kept", "fullgraph/stage0/eager-use", "fullgraph/stage2/eager-use"] + [f"fullgraph-module/stage{stage}" for stage in (0, 1, 2, 3)]
            + [f"autograd-grad/stage{stage}" for stage in (2, 3)]
            + [f"compiled-autograd/stage{stage}" for stage in (0, 2, 3)]
            + ["compiled-autograd/stage3/fp16", "compiled-autograd/stage2/accumulate",
               "compiled-autograd/stage3/accumulate", "compiled-autograd/stage3/model"])
