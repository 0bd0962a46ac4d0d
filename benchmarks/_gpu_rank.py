"""benchmarks/gpu.py inside a rank: the job every rank receives, each
system's training step, the timed and profiled steps, and the spawned rank's
entry point (it writes its result to a file and exits without teardown)."""
from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import sys
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _models import PRESETS, blocks_of, build_model


@dataclass
class Job:
    """One (model, system) run, as every rank receives it."""

    model: str
    system: str
    device: str  # "cuda" or "cpu"
    world: int
    batch: int
    seq: int
    steps: int
    warmup: int
    threads: int
    port: int
    timeout_s: float
    result_dir: str
    log_prefix: str
    deepspeed_fp32: bool = False  # the CPU fallback when DeepSpeed's bf16 fails there
    profile: bool = False  # one more step under torch.profiler: zero_ext's ranges, kernel time by kind


@dataclass
class Trainer:
    """What one training step needs from a system."""

    forward: Callable[[torch.Tensor], torch.Tensor]  # token ids -> logits
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], None]  # optimizer step, then clear the gradients
    autocast: bool  # forward and loss under torch.autocast (plain and DDP keep fp32 weights)
    precision: str
    optimizer: str
    collectives: str = "-"  # zero_ext: the backend of its own group, "local" (one rank) or "none"


def adamw(params, device: str, fused: bool) -> torch.optim.Optimizer:
    extra = {"fused": True} if fused and device == "cuda" else {}
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **extra)


def optimizer_name(opt: torch.optim.Optimizer) -> str:
    flavour = "fused" if opt.defaults.get("fused") else "foreach/default"
    return f"torch AdamW ({flavour})"


def plain_step(opt: torch.optim.Optimizer) -> Callable[[], None]:
    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def collectives_of(group) -> str:
    """What carries zero_ext's collectives: its group's backend, or "local"
    for a group of one rank (local copies; ZERO_EXT_ONE_RANK_COLLECTIVES=1
    sends them through the backend all the same)."""
    if group is None:
        return "none"
    if group.size() == 1 and os.environ.get("ZERO_EXT_ONE_RANK_COLLECTIVES") != "1":
        return "local"
    return dist.get_backend(group)


def build_trainer(job: Job, model: torch.nn.Module, rank: int) -> Trainer:
    system = job.system
    backward = torch.Tensor.backward
    if system == "plain":
        opt = adamw(model.parameters(), job.device, fused=True)
        return Trainer(model, backward, plain_step(opt), True, "bf16 autocast", optimizer_name(opt))
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[rank] if job.device == "cuda" else None)
        opt = adamw(ddp.parameters(), job.device, fused=True)
        return Trainer(ddp, backward, plain_step(opt), True, "bf16 autocast", optimizer_name(opt))
    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(job.device, (job.world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in blocks_of(model):
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = adamw(model.parameters(), job.device, fused=True)  # over the sharded DTensor parameters
        return Trainer(model, backward, plain_step(opt), False, "bf16 params, fp32 reduce",
                       optimizer_name(opt))
    if system.startswith("deepspeed-"):
        return deepspeed_trainer(job, model, stage=int(system.split("-")[1]))
    if system.startswith("zero_ext-"):
        import zero_ext
        from zero_ext.tools import state_of

        parts = system.split("-")
        stage = int(parts[1])
        offload = "offload" in parts
        # Fused like every other system's, where the optimizer steps on the GPU.
        opt = adamw(model.parameters(), job.device, fused=not offload)
        units = {type(block) for block in blocks_of(model)} if stage == 3 else None
        model, opt = zero_ext.wrap(model, opt, stage=stage, mixed_precision="bf16", units=units,
                                   offload_optimizer="cpu" if offload else None,
                                   timeout=job.timeout_s)
        group = state_of(model).process_group
        return Trainer(model, backward, plain_step(opt), False, "bf16",
                       "zero_ext C++ AdamW (host)" if offload else optimizer_name(opt),
                       collectives=collectives_of(group))
    raise ValueError(f"unknown system {system!r}")


def deepspeed_trainer(job: Job, model: torch.nn.Module, stage: int) -> Trainer:
    import deepspeed

    # Attaches DeepSpeed to the process group made in rank_entry; it still reads
    # RANK, LOCAL_RANK, MASTER_ADDR... from the environment set there.
    deepspeed.init_distributed(dist_backend=dist.get_backend(), timeout=datetime.timedelta(seconds=job.timeout_s))
    config = {
        "train_micro_batch_size_per_gpu": job.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,  # DeepSpeed clips to norm 1.0 unless told not to; no other system clips
        "bf16": {"enabled": not job.deepspeed_fp32},
        "zero_allow_untested_optimizer": True,  # torch's AdamW, like every other system here
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    # Not fused: DeepSpeed steps its own flat fp32 partitions with it.
    opt = adamw(model.parameters(), job.device, fused=False)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step() -> None:
        engine.step()  # also clears the gradients

    precision = "fp32 (bf16 failed on CPU)" if job.deepspeed_fp32 else "bf16"
    return Trainer(engine, engine.backward, step, False, precision, f"{optimizer_name(opt)} in DeepSpeed")


def token_batches(job: Job, vocab: int, rank: int, count: int, device: torch.device) -> List[torch.Tensor]:
    """Per step, this rank's slice of a global batch drawn from a generator
    seeded by the step, so every system and world size sees the same tokens."""
    batches = []
    for step in range(count):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, vocab, (job.world * job.batch, job.seq + 1), generator=g)
        batches.append(tokens[rank * job.batch:(rank + 1) * job.batch].to(device))
    return batches


class PerfMark:
    """torch.cuda.Event's record/elapsed_time on the host clock (CPU runs)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, later: "PerfMark") -> float:
        return (later.t - self.t) * 1e3


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


# zero_ext's profiler ranges (csrc), grouped as the per-phase breakdown names them.
ZERO_EXT_RANGES = {"hooks": ("zero_ext::accumulate_grad",),
                   "gather": ("zero_ext::gather_unit", "zero_ext::release_unit"),
                   "epilogue": ("zero_ext::run_epilogue",), "opt": ("zero_ext::step",)}


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    if "nccl" in lowered:
        return "nccl"
    if "memcpy" in lowered or "memset" in lowered:
        return "memcpy"
    if "gemm" in lowered or "cutlass" in lowered or "sm90" in lowered or "flash" in lowered or "attention" in lowered:
        return "matmul"
    return "other"


def profiled_step(run_step: Callable[[], None], cuda: bool) -> dict:
    """One step under torch.profiler: milliseconds of host time inside
    zero_ext's ranges (children included) and of GPU kernel time by kind
    (matmul and attention, NCCL, copies and fills, the rest: elementwise,
    reductions, optimizer kernels)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run_step()
    # key_averages keeps a range's host event apart from its GPU-side user
    # annotation (same name, device CUDA): the host time is the CPU event's,
    # and the kernel time leaves annotations out (they span kernels already
    # counted).
    events = prof.key_averages()
    cpu = torch.autograd.DeviceType.CPU
    host = {e.key: e.cpu_time_total for e in events if getattr(e, "device_type", cpu) == cpu}
    out = {name: sum(host.get(k, 0.0) for k in keys) / 1e3 for name, keys in ZERO_EXT_RANGES.items()}
    if cuda:
        kinds = {"matmul": 0.0, "nccl": 0.0, "memcpy": 0.0, "other": 0.0}
        for e in events:
            if getattr(e, "device_type", cpu) == cpu or getattr(e, "is_user_annotation", False):
                continue
            self_device = getattr(e, "self_device_time_total", None)
            if self_device is None:  # older torch
                self_device = getattr(e, "self_cuda_time_total", 0.0)
            kinds[kernel_kind(e.key)] += self_device / 1e3
        out.update({f"gpu_{k}": v for k, v in kinds.items()}, gpu_total=sum(kinds.values()))
    return out


def benchmark_rank(job: Job, rank: int, local_rank: Optional[int] = None) -> dict:
    cuda = job.device == "cuda"
    device = torch.device("cuda", rank if local_rank is None else local_rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    vocab = PRESETS[job.model].vocab

    with device:  # weights initialised on the device: fast, and host RSS is left to the system
        model = build_model(job.model, builtin=True, seed=0)
    n_params = sum(p.numel() for p in model.parameters())  # the tied embedding counts once
    trainer = build_trainer(job, model, rank)
    batches = token_batches(job, vocab, rank, job.warmup + job.steps + int(job.profile), device)
    profiled_batch = batches.pop() if job.profile else None
    autocast = torch.autocast(job.device, dtype=torch.bfloat16) if trainer.autocast else nullcontext()

    sync()
    state_bytes = torch.cuda.memory_allocated(device) if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()  # builds take different times on different ranks

    # Phases are timed with events on the compute stream (host clocks on
    # CPU): reading them adds no sync inside the step.
    marks = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else PerfMark
    times, phases, loss = [], [], None
    reserved = []  # the caching allocator's reserve after each timed step: flat once warm (issue 56)

    def train_step(tokens: torch.Tensor, events: list) -> torch.Tensor:
        # The logits stay referenced until the step is over, as in a plain
        # training loop (peak memory is compared with earlier runs).
        events[0].record()
        with autocast:
            logits = trainer.forward(tokens[:, :-1])
            step_loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        events[1].record()
        trainer.backward(step_loss)
        events[2].record()
        trainer.step()
        events[3].record()
        return step_loss

    for step, tokens in enumerate(batches):
        sync()
        start = time.perf_counter()
        events = [marks() for _ in range(4)]
        loss = train_step(tokens, events)
        sync()
        if step >= job.warmup:
            times.append(time.perf_counter() - start)
            if cuda:
                reserved.append(torch.cuda.memory_reserved(device))
            phases.append([events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(3)])
    profiled = None
    if profiled_batch is not None:
        profiled = profiled_step(lambda: (train_step(profiled_batch, [marks() for _ in range(4)]), sync()), cuda)

    return {
        "rank": rank,
        "status": "ok",
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "params": n_params,
        "median_step_s": statistics.median(times),
        "median_phase_s": {name: statistics.median(p[i] for p in phases)
                           for i, name in enumerate(("forward", "backward", "optimizer"))},
        "step_times_s": times,
        "loss": loss.item(),
        "gpu_after_build_bytes": state_bytes,
        "peak_gpu_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
        "reserved_after_step_bytes": reserved,
        "peak_rss_bytes": peak_rss_bytes(),
        "precision": trainer.precision,
        "optimizer": trainer.optimizer,
        "collectives": trainer.collectives,
        "profiled_ms": profiled,
    }


def short_error(exc: BaseException) -> str:
    text = str(exc).strip()
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text.lower():
        tried = re.search(r"Tried to allocate [\d.]+ [KMG]iB", text)
        return "out of memory" + (f" ({tried.group(0)})" if tried else "")
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:200]


def write_result(job: Job, rank: int, result: dict) -> None:
    path = os.path.join(job.result_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)  # the parent never reads half a file


def rank_entry(rank: int, job: Job) -> None:
    """A spawned rank: benchmark, write the result, exit without trusting teardown."""
    log = open(f"{job.log_prefix}.rank{rank}.log", "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job.port), RANK=str(rank),
                      WORLD_SIZE=str(job.world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(job.world))
    torch.set_num_threads(job.threads)
    code = 0
    try:
        if job.device == "cuda":
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", init_method="env://", device_id=torch.device("cuda", rank),
                                    timeout=datetime.timedelta(seconds=job.timeout_s))
        else:
            dist.init_process_group("gloo", init_method="env://",
                                    timeout=datetime.timedelta(seconds=job.timeout_s))
        result = benchmark_rank(job, rank)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a row
        traceback.print_exc()
        result = {"rank": rank, "status": "error", "error": short_error(exc), "failed_at": time.time(),
                  "traceback": traceback.format_exc()[-4000:]}
        code = 1
    write_result(job, rank, result)
    if code == 0:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the result is already written
            traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: DeepSpeed ranks sometimes abort in it after a good run.
    os._exit(code)
