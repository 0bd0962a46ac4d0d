"""Quantized collectives (wrap's compress_weights / compress_grads, SPEC.md
"Fewer bytes on the wire") and zero_ext.traffic, on gloo ranks.

Items run in the parity groups (parity_scenarios.run_one hands over
"compression:<name>/stageN[/meshRxS]"): each returns None or what went wrong
on this rank. The baseline is the same model wrapped without compression in
the same process over the same data: quantization changes the numbers (by
design), so learning is compared, not bits.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero_ext

VOCAB, DIM, SEQ, GLOBAL_BATCH = 32, 48, 8, 16
BUCKET_MB = 0.02  # a few buckets, each several quantization blocks per rank
INT8_FP32_RATIO = (1 + 4 / 2048) / 4 + 0.01  # bytes of int8 + a scale per 2048, of fp32; padding
INT4_FP32_RATIO = (0.5 + 4 / 2048) / 4 + 0.01


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class TinyLM(nn.Module):
    """Next token of a fixed rule over a random sequence: it learns in a few
    dozen steps, so a compressed run that learns worse shows."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _batch(step: int, rank: int, ranks: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    # A rule an MLP learns, and a third of the targets noise: the loss
    # levels off well above zero, where a run learning worse shows.
    noise = torch.randint(0, VOCAB, tokens.shape, generator=g)
    targets = torch.where(torch.rand(tokens.shape, generator=g) < 0.3, noise, (tokens * 3 + 1) % VOCAB)
    per = GLOBAL_BATCH // ranks
    return tokens[rank * per:(rank + 1) * per], targets[rank * per:(rank + 1) * per]


def _wrap(stage: int, group, lr: float = 3e-3, **compress):
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return zero_ext.wrap(model, opt, stage=stage, bucket_mb=BUCKET_MB, process_group=group, **compress)


def _train(model, opt, steps: int, group) -> List[float]:
    rank, ranks = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        tokens, targets = _batch(step, rank, ranks)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / ranks)
    return losses


# [Note: learning tolerances] The final loss of learns_like_uncompressed
# (LEARNING_STEPS steps of TinyLM) may differ from the uncompressed run's by
# at most this fraction. Measured (2 cores, torch 2.13, gloo) at 30 steps,
# |compressed - uncompressed| / uncompressed over the layouts the scenario runs
# (world 2 and 4 flat at stages 2 and 3, the 2x2 mesh at stage 3) and model
# seeds (0-4 on the mesh, 1-3 seeds per flat layout; the test uses seed 0):
#   int8 (grads, or weights + grads): at most 0.14% (seed 0: 0.02-0.04%);
#   int4 grads (with or without int8 weights): at most 0.38% (the 2x2 mesh,
#     seed 3; seed 0: 0.01-0.14%, the 2x2 mesh 0.13%).
# The bounds are twice the worst over every seed and layout: 0.3% and 0.8%.
# Another seed moves the trajectory far more than another CPU's rounding or
# BLAS kernels do (both perturb only the last bits of each step), so the
# spread over seeds, doubled, covers another machine while staying an order
# below a reduction that stops learning. This model's loss is
# dominated by its noisy targets, so compression moves it little: the 2x2
# mesh's int4 gap is still 0.06% at 200 steps, where the demo LM of
# benchmarks/compression.py is 6.4% worse (1.0% at 30 steps; docs/compression.md).
# These bounds catch a reduction that breaks learning, not that slower drift.
LEARNING_STEPS = 30
LEARNING_TOLERANCE = {"int8": 0.003, "int4": 0.008}


def learns_like_uncompressed(stage: int, group) -> Optional[str]:
    """LEARNING_STEPS steps with and without compression: the loss falls
    alike (within LEARNING_TOLERANCE, [Note: learning tolerances]), the
    compressed kinds send at most int8's (int4's) share of the bytes, the
    others the same."""
    steps = LEARNING_STEPS
    plain, plain_opt = _wrap(stage, group)
    base = _train(plain, plain_opt, steps, group)
    sent_plain = zero_ext.traffic(plain)
    int8, int4 = LEARNING_TOLERANCE["int8"], LEARNING_TOLERANCE["int4"]
    configs = [("int8 grads", {"compress_grads": "int8"}, int8),
               ("int4 grads", {"compress_grads": "int4"}, int4)]
    if stage == 3:
        configs = [("int8 weights + int8 grads", {"compress_weights": "int8", "compress_grads": "int8"}, int8),
                   ("int8 weights + int4 grads", {"compress_weights": "int8", "compress_grads": "int4"}, int4)]
    if base[-1] > 0.8 * base[0]:
        return f"the uncompressed baseline did not learn: loss {base[0]:.3f} -> {base[-1]:.3f}"
    for label, compress, tolerance in configs:
        model, opt = _wrap(stage, group, **compress)
        losses = _train(model, opt, steps, group)
        gap = abs(losses[-1] - base[-1]) / base[-1]
        if gap > tolerance:
            return (f"{label}: final loss {losses[-1]:.4f} vs {base[-1]:.4f} uncompressed ({gap:.2%} apart, "
                    f"tolerance {tolerance:.1%})")
        sent = zero_ext.traffic(model)
        compressed = {"all_gather": compress.get("compress_weights"), "reduce_scatter": compress.get("compress_grads")}
        if group is not None:  # the all-reduce across the 2 replicas too (beside the small exact agreements)
            compressed["all_reduce"] = compress.get("compress_grads")
        for kind in ("all_gather", "reduce_scatter", "all_reduce", "broadcast"):
            bits = compressed.get(kind)
            if bits is None:  # not compressed: the very same bytes
                if sent[kind] != sent_plain[kind]:
                    return f"{label}: {kind} sent {sent[kind]} bytes, uncompressed {sent_plain[kind]}"
                continue
            ratio = sent[kind] / sent_plain[kind]
            bound = (INT8_FP32_RATIO if bits == "int8" else INT4_FP32_RATIO) + (0.05 if kind == "all_reduce" else 0)
            if not 0 < ratio <= bound:
                return f"{label}: {kind} sent {sent[kind]} bytes, {ratio:.3f} of uncompressed (at most {bound:.3f})"
        apart = _apart_across_ranks(model)
        if apart:
            return f"{label}: {apart}"
    return None


def _apart_across_ranks(model) -> Optional[str]:
    """Every rank (every replica of a shard) holds the same model, or what differs."""
    full = zero_ext.full_state_dict(model)
    digest = float(sum(v.double().sum() * (i + 1) for i, v in enumerate(full.values())))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digest)
    return None if len(set(everyone)) == 1 else f"the ranks' full models differ after training: {everyone}"


def replica_all_reduce_deferred(stage: int, group) -> Optional[str]:
    """Hybrid only: two backwards a step, the first kept back from the
    replicas (set_requires_all_reduce(False)), the second carrying both.
    int8 learns as uncompressed, sends under a third of its all-reduce bytes,
    and the replicas stay identical."""
    runs = {}
    for label, compress in (("plain", {}), ("int8", {"compress_grads": "int8"})):
        model, opt = _wrap(stage, group, **compress)
        rank, ranks = dist.get_rank(), dist.get_world_size()
        for step in range(25):
            for micro in range(2):
                model.set_requires_all_reduce(micro == 1)
                tokens, targets = _batch(2 * step + micro, rank, ranks)
                F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
            opt.step()
            opt.zero_grad()
        tokens, targets = _batch(1000, rank, ranks)
        with torch.no_grad():
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        dist.all_reduce(loss)
        runs[label] = (loss.item() / ranks, zero_ext.traffic(model)["all_reduce"])
        apart = _apart_across_ranks(model)
        if apart:
            return f"{label}: {apart}"
    (plain_loss, plain_bytes), (loss, sent) = runs["plain"], runs["int8"]
    if abs(loss - plain_loss) > 0.02 * plain_loss:
        return f"int8 with deferred replica all-reduces: held-out loss {loss:.4f} vs {plain_loss:.4f} uncompressed"
    if not sent < 0.35 * plain_bytes:
        return f"int8 with deferred replica all-reduces sent {sent} all-reduce bytes, uncompressed {plain_bytes}"
    return None


def subgroup_regather_keeps_forward_weights(stage: int, group) -> Optional[str]:
    """World 4, reshard_after_forward=2: backward regathers each unit within
    pairs of ranks from the parts they kept, which hold the dequantized values
    forward used, so it must send them exact. The gradients then equal those of
    reshard_after_forward=True, whose backward gathers the same shards
    quantized the same way again (a second rounding of the kept parts, on
    blocks that straddle two shards, would move them)."""
    grads = {}
    for reshard in (True, 2):
        model, opt = _wrap(stage, group, compress_weights="int8", reshard_after_forward=reshard)
        rank, ranks = dist.get_rank(), dist.get_world_size()
        tokens, targets = _batch(0, rank, ranks)
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        grads[reshard] = zero_ext.full_grads(model)
    for name, value in grads[True].items():
        if not torch.equal(value, grads[2][name]):
            return (f"{name}: gradient with reshard_after_forward=2 differs from =True by "
                    f"{(value - grads[2][name]).abs().max().item():.3e}")
    return None


def error_feedback_cancels_rounding(stage: int, group) -> Optional[str]:
    """The same gradient reduced 16 times (lr 0, the same batch): int4 rounds
    each reduction by up to half a step of its scale, but error feedback
    carries what one reduction lost into the next, so the average of the 16
    reduced gradients is within 1/16 of that of the exact one; without it the
    same rounding would repeat and the average be as far off as one."""
    exact, exact_opt = _wrap(stage, group, lr=0.0)
    model, opt = _wrap(stage, group, lr=0.0, compress_grads="int4")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    tokens, targets = _batch(0, rank, ranks)
    F.cross_entropy(exact(tokens).flatten(0, 1), targets.flatten()).backward()
    truth = torch.cat([g.flatten() for g in zero_ext.full_grads(exact).values()])
    total, first_error, repeats = torch.zeros_like(truth), 0.0, 16
    for k in range(repeats):
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        reduced = torch.cat([g.flatten() for g in zero_ext.full_grads(model).values()])
        opt.zero_grad()
        if k == 0:
            first_error = (reduced - truth).abs().max().item()
        total += reduced
    average_error = (total / repeats - truth).abs().max().item()
    if first_error <= 1e-6:
        return f"one int4 reduction matched the exact gradient to {first_error:.2e}: nothing was quantized"
    if average_error > 2 * first_error / repeats:
        return (f"the average of {repeats} int4 reductions is {average_error:.3e} from the exact gradient, one "
                f"reduction {first_error:.3e}: error feedback should bring it under {2 * first_error / repeats:.3e}")
    return None


def _profiled_bytes(ops, ranks: int) -> Dict[str, float]:
    """Bytes this rank sent by kind, from the profiler's backend ops: the
    formulas of benchmarks/_accounting.py's sent_bytes (headers apart). On
    gloo both gathers and reduce-scatters of data are all-to-alls
    (csrc/exchange_all_gather.h, csrc/exchange_reduce_scatter.h), which the
    profiler cannot tell apart: they are one kind here, "gathers_and_scatters"."""
    sizes = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4,
             "unsigned char": 1, "signed char": 1}
    out = {"gathers_and_scatters": 0.0, "all_reduce": 0.0, "sequence_headers": 0.0}
    for name, shapes, dtypes in ops:
        if not name.startswith("gloo:") or "barrier" in name or not shapes:
            continue
        numel = sum(int(torch.tensor(s).prod()) if s else 0 for s in shapes)
        dtype = (dtypes or ["float"])[0]
        size = numel * sizes[dtype]
        if "all_gather" in name or "allgather" in name:
            out["sequence_headers" if dtype == "long int" else "gathers_and_scatters"] += (ranks - 1) * size
        elif "all_reduce" in name or "allreduce" in name:
            out["all_reduce"] += 2 * (ranks - 1) / ranks * size
        elif "all_to_all" in name or "alltoall" in name:
            out["gathers_and_scatters"] += (ranks - 1) / ranks * size
    return out


def traffic_matches_the_profiler(stage: int, group) -> Optional[str]:
    """What zero_ext.traffic counts in two training steps equals what the
    profiler saw the backend send, plain and compressed."""
    from zero_ext.tools.torch_compat import profiled_ops
    ranks = dist.get_world_size()
    for compress in ({}, {"compress_weights": "int8", "compress_grads": "int8"} if stage == 3
                     else {"compress_grads": "int8"}):
        # Without the collective checks: they issue collectives from gloo's
        # threads, which the profiler does not record.
        os.environ["ZERO_EXT_COLLECTIVE_CHECKS"] = "0"
        try:
            model, opt = _wrap(stage, group, **compress)
        finally:
            del os.environ["ZERO_EXT_COLLECTIVE_CHECKS"]
        _train(model, opt, 1, group)  # the first step's one-time exchanges out of the way
        before = zero_ext.traffic(model)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            rank = dist.get_rank()
            for step in range(2):
                tokens, targets = _batch(step, rank, ranks)
                F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
                opt.step()
                opt.zero_grad()
        after = zero_ext.traffic(model)
        seen = _profiled_bytes(profiled_ops(prof), ranks)
        counted_by_kind = {kind: after[kind] - before[kind] for kind in ("all_reduce", "sequence_headers")}
        counted_by_kind["gathers_and_scatters"] = sum(after[k] - before[k] for k in ("all_gather", "reduce_scatter"))
        for kind, counted in counted_by_kind.items():
            if abs(counted - seen[kind]) > 1e-6 * max(1.0, seen[kind]) + 8:
                return f"{compress or 'plain'}: traffic() counted {counted} {kind} bytes, the profiler saw {seen[kind]:.0f}"
        for kind in ("reduce_scatter", "all_gather") if stage == 3 else ("reduce_scatter",):
            if after[kind] == before[kind]:
                return f"{compress or 'plain'}: no {kind} bytes counted in two steps"
    return None


def _shared_dir() -> str:
    box = [tempfile.mkdtemp(prefix="zero_ext_compress_") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(box, 0)
    return box[0]


def checkpoints_across_compression(stage: int, group) -> Optional[str]:
    """A checkpoint saved with compression loads without it and the other
    way round, bit for bit (masters and optimizer state are never quantized;
    the error-feedback residual is not saved: a resumed run starts it at zero)."""
    root = _shared_dir()
    try:
        pairs = [({"compress_grads": "int8"} | ({"compress_weights": "int8"} if stage == 3 else {}), {}),
                 ({}, {"compress_grads": "int4"})]
        for saved_with, loaded_with in pairs:
            model, opt = _wrap(stage, group, **saved_with)
            _train(model, opt, 3, group)
            path = os.path.join(root, f"ckpt-{len(saved_with)}")
            zero_ext.save(path, model, opt)
            expected = zero_ext.full_state_dict(model)
            other, other_opt = _wrap(stage, group, **loaded_with)
            zero_ext.load(path, other, other_opt)
            loaded = zero_ext.full_state_dict(other)
            for name, value in expected.items():
                if not torch.equal(value, loaded[name]):
                    return f"saved with {saved_with}, loaded with {loaded_with}: {name} differs"
            a, b = _train(model, opt, 2, group), _train(other, other_opt, 2, group)
            if not all(abs(x - y) <= 0.02 * abs(x) for x, y in zip(a, b)):
                return f"saved with {saved_with}, loaded with {loaded_with}: losses after resuming {a} vs {b}"
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    return None


def ranks_disagree_at_wrap(stage: int, group) -> Optional[str]:
    """compress_grads on rank 0 only, then compress_weights on the last rank
    only: zero_ext's error on every rank at wrap, naming the option; a good
    wrap follows."""
    last = dist.get_world_size() - 1
    cases = [{"compress_grads": "int8"} if dist.get_rank() == 0 else {},
             {"compress_weights": "int8"} if dist.get_rank() == last and stage == 3 else {}]
    for compress in cases[:2 if stage == 3 else 1]:
        try:
            _wrap(stage, group, **compress)
        except ValueError as error:
            if "compress" not in str(error):
                return f"wrap with {compress or 'no compression'} raised without naming the option: {error}"
            continue
        return f"wrap with {compress or 'no compression'} on this rank (others differing) raised nothing"
    model, opt = _wrap(stage, group, compress_grads="int8")
    _train(model, opt, 1, group)
    return None


SCENARIOS = {f.__name__: f for f in [learns_like_uncompressed, error_feedback_cancels_rounding,
                                     traffic_matches_the_profiler, checkpoints_across_compression,
                                     ranks_disagree_at_wrap, replica_all_reduce_deferred,
                                     subgroup_regather_keeps_forward_weights]}
# Worlds 2 and 4 flat run every scenario; the 2x2 mesh (rows reduce-scatter
# compressed, the 2 replicas all-reduce quantized) the learning and the checkpoints.
MESH_ONLY = ("replica_all_reduce_deferred",)
WORLD_4_ONLY = ("subgroup_regather_keeps_forward_weights",)  # subgroups of 2 within 4 ranks
ON_MESH = ("learns_like_uncompressed", "checkpoints_across_compression", "replica_all_reduce_deferred")


# The stages each scenario runs at: learning at both; the rest where it says
# the most (stage 3 gathers and reduces; the deferred path is a reduction's).
STAGES = {"learns_like_uncompressed": (2, 3), "error_feedback_cancels_rounding": (2,),
          "traffic_matches_the_profiler": (3,), "checkpoints_across_compression": (3,),
          "ranks_disagree_at_wrap": (3,), "replica_all_reduce_deferred": (2,),
          "subgroup_regather_keeps_forward_weights": (3,)}


def all_items(mesh: str = "", world_4: bool = False) -> List[str]:
    names = ON_MESH if mesh else [n for n in SCENARIOS if n not in MESH_ONLY]
    if not world_4 and not mesh:
        names = [n for n in names if n not in WORLD_4_ONLY]
    suffix = f"/mesh{mesh}" if mesh else ""
    return [f"compression:{name}/stage{stage}{suffix}" for name in names
            for stage in (STAGES[name] if not mesh or name != "learns_like_uncompressed" else (3,))]


def run_one(item: str, mesh_of) -> Optional[str]:
    """`mesh_of(replicas, shard)`: parity_scenarios' (replicate, shard) mesh."""
    name, rest = item[len("compression:"):].rsplit("/stage", 1)
    stage, _, mesh = rest.partition("/mesh")
    group = mesh_of(*(int(v) for v in mesh.split("x"))) if mesh else None
    return SCENARIOS[name](int(stage), group)
