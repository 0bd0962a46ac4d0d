"""GPU training throughput and memory of zero_ext against plain PyTorch, DDP, FSDP2 and DeepSpeed.

    python benchmarks/gpu.py                                    # every GPU, gpt2-124m and gpt2-1b, all systems
    python benchmarks/gpu.py --world 1 --models gpt2-124m       # one GPU (adds the "plain" baseline)
    python benchmarks/gpu.py --systems ddp fsdp2 zero_ext-3 zero_ext-3-offload
    torchrun --nnodes 2 --nproc-per-node 8 ... benchmarks/gpu.py --models gpt2-1b --systems zero_ext-3
                                                                # one system over any number of GPUs
    python benchmarks/gpu.py --device cpu --models gpt2-10m --seq 64 --batch 2 \\
        --steps 2 --warmup 1 --world 2 --out /tmp/gpu_smoke.json  # CPU smoke test (gloo)

Systems (default: all that apply):
  plain                 no data parallelism (world size 1 only): torch AdamW, bf16 autocast
  ddp                   DistributedDataParallel, bf16 autocast
  fsdp2                 fully_shard on each block, then the root; bf16 parameters, fp32 reduction
  deepspeed-1/2/3       DeepSpeed ZeRO stage N, bf16 (a row says so when deepspeed is not installed)
  zero_ext-1/2/3        zero_ext.wrap(stage=N, mixed_precision="bf16"), torch AdamW (fused)
  zero_ext-N-offload    the same with offload_optimizer="cpu" (zero_ext's C++ AdamW on the host)

Every system trains the built-in GPT-2 of benchmarks/_models.py (pure torch,
the same random weights everywhere) with AdamW(lr=1e-4, weight_decay=0.01;
fused on the GPU for every system that steps there, DeepSpeed aside) on
the same synthetic token batches (--batch sequences of --seq tokens per rank,
drawn from a generator seeded by the step number); the loss is the cross
entropy of the bf16 logits, taken in fp32, against the next token.

Each (model, system) pair runs in a fresh set of --world spawned processes (one
GPU per rank, NCCL; gloo with --device cpu), so peak memory belongs to that
system alone and a failure (out of memory, a DeepSpeed error, a hang killed
after --system-timeout) becomes an error row while the other systems go on.

Measured per rank, then combined: the median step time over --steps steps
after --warmup steps (CUDA synchronized before each clock read; the slowest
rank's median is reported) with its forward, backward and optimizer phases
(CUDA events, read after the step), tokens per second per rank and in total,
model-FLOPs utilization (6N + 12 * layers * dim * seq FLOPs per token over the
GPU's dense bf16 peak), peak GPU
memory (max_memory_allocated and max_memory_reserved since the model and
optimizer were built), peak host RSS (VmHWM, where offloaded optimizer state
shows) and the final loss (mean over ranks). Prints a table and writes every
row with the machine's facts (torch, CUDA, GPU, zero_ext commit) to --out;
each rank's output goes to a log file beside it. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
sys.path.append(REPO)  # this checkout's zero_ext when none is installed (built in place)
from _models import PRESETS, blocks_of, build_model  # noqa: E402
ALL_SYSTEMS = ["plain", "ddp", "fsdp2", "deepspeed-1", "deepspeed-2", "deepspeed-3",
               "zero_ext-1", "zero_ext-2", "zero_ext-3",
               "zero_ext-1-offload", "zero_ext-2-offload", "zero_ext-3-offload"]
SYSTEM_PATTERN = re.compile(r"^(plain|ddp|fsdp2|deepspeed-[0-3]|zero_ext-[0-3](-offload)?)$")
GiB = 2**30
# After every rank has written its result, how long a rank may take to exit
# (DeepSpeed and NCCL teardown can hang) before it is killed; and how long the
# others get after one rank failed before they are killed (they would wait in a
# collective until the timeout).
EXIT_GRACE_S = 30.0
FAILURE_GRACE_S = 15.0


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


# ---------------------------------------------------------------------------
# Inside a rank


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

        parts = system.split("-")
        stage = int(parts[1])
        offload = "offload" in parts
        # Fused like every other system's, where the optimizer steps on the GPU.
        opt = adamw(model.parameters(), job.device, fused=not offload)
        units = {type(block) for block in blocks_of(model)} if stage == 3 else None
        model, opt = zero_ext.wrap(model, opt, stage=stage, mixed_precision="bf16", units=units,
                                   offload_optimizer="cpu" if offload else None,
                                   timeout=job.timeout_s)
        group = model._zero_ext.process_group
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


# Dense bf16 tensor-core peaks (no sparsity), for model-FLOPs utilization.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0,
                    "L40S": 362.0, "A10G": 70.0}


def peak_tflops(device_name: str) -> Optional[float]:
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in device_name:
            return PEAK_BF16_TFLOPS[key]
    return None


def train_flops_per_token(model: str, seq: int, n_params: int) -> float:
    """6N for the weights' matmuls (forward 2N, backward 4N) plus attention's
    score and value matmuls, 12 * layers * dim * seq (PaLM's appendix B)."""
    p = PRESETS[model]
    return 6.0 * n_params + 12.0 * p.layers * p.dim * seq


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


# ---------------------------------------------------------------------------
# The parent: one fresh group of ranks per (model, system)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_results(job: Job) -> List[Optional[dict]]:
    """Each rank's result file, None where it wrote none."""
    results = []
    for rank in range(job.world):
        path = os.path.join(job.result_dir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
        else:
            results.append(None)
    return results


def log_tail(job: Job, rank: int, lines: int = 3) -> str:
    try:
        with open(f"{job.log_prefix}.rank{rank}.log") as f:
            tail = [line.strip() for line in f.read().splitlines() if line.strip()]
    except OSError:
        return ""
    return " | ".join(tail[-lines:])[:300]


def run_job(job: Job) -> List[dict]:
    """Spawns the ranks and waits for them: killed after the timeout, or soon
    after one rank failed, or soon after all wrote results but some still linger."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_entry, args=(rank, job), daemon=False) for rank in range(job.world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + job.timeout_s
    exited_at: List[Optional[float]] = [None] * job.world  # wall clock, to order failures across ranks
    kill_at = None
    timed_out = False
    try:
        while True:
            for rank, p in enumerate(procs):
                if exited_at[rank] is None and not p.is_alive():
                    exited_at[rank] = time.time()
            if all(t is not None for t in exited_at):
                break
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if kill_at is None:
                results = read_results(job)
                failed = any(r is not None and r["status"] != "ok" for r in results) or any(
                    exited_at[rank] is not None and results[rank] is None for rank in range(job.world))
                if failed:
                    kill_at = now + FAILURE_GRACE_S
                elif all(r is not None for r in results):
                    kill_at = now + EXIT_GRACE_S
            elif now >= kill_at:
                break
            time.sleep(0.1)
    finally:
        killed = [p.is_alive() for p in procs]
        for p, kill in zip(procs, killed):
            if kill:
                p.kill()
        for p in procs:
            p.join()

    results = read_results(job)
    for rank, p in enumerate(procs):
        if results[rank] is None:
            if killed[rank]:
                why = (f"timeout: no result after {job.timeout_s:.0f} s" if timed_out
                       else "killed while the other ranks had stopped")
            elif p.exitcode is not None and p.exitcode < 0:
                why = f"killed by signal {-p.exitcode}"
            else:
                why = f"exited with code {p.exitcode} without a result"
            tail = log_tail(job, rank)
            results[rank] = {"rank": rank, "status": "error", "error": why + (f" (log: {tail})" if tail else ""),
                             "failed_at": None if killed[rank] else exited_at[rank]}
        results[rank]["exit_code"] = p.exitcode  # nonzero after a written result is teardown only
    return results


def combine(job: Job, per_rank: List[dict]) -> dict:
    row = {"model": job.model, "system": job.system, "world": job.world, "batch_per_rank": job.batch,
           "seq": job.seq, "log": f"{job.log_prefix}.rank*.log"}
    errors = [r for r in per_rank if r["status"] != "ok"]
    if errors:
        # The first rank to fail is the cause; the others mostly fail waiting on
        # it (broken connections), and ranks we killed come last.
        first = min(errors, key=lambda r: (r.get("failed_at") is None, r.get("failed_at") or 0.0))
        row.update(status="error", error=f"rank {first['rank']}: {first['error']}", per_rank=per_rank)
        return row
    step_s = max(r["median_step_s"] for r in per_rank)  # the slowest rank sets the pace
    tokens_per_rank = job.batch * job.seq / step_s
    peak = peak_tflops(per_rank[0].get("device_name", ""))
    model_tflops = train_flops_per_token(job.model, job.seq, per_rank[0]["params"]) * tokens_per_rank / 1e12
    phases = {name: 1e3 * max(r["median_phase_s"][name] for r in per_rank)
              for name in per_rank[0]["median_phase_s"]}

    def peak_gib(key):
        values = [r[key] for r in per_rank if r[key] is not None]
        return max(values) / GiB if values else None

    row.update(
        status="ok", error=None, params=per_rank[0]["params"],
        precision=per_rank[0]["precision"], optimizer=per_rank[0]["optimizer"],
        collectives=per_rank[0]["collectives"],
        ms_per_step=1e3 * step_s, tokens_per_s_per_rank=tokens_per_rank,
        tokens_per_s_total=tokens_per_rank * job.world,
        model_tflops_per_rank=model_tflops, mfu=model_tflops / peak if peak else None,
        forward_ms=phases["forward"], backward_ms=phases["backward"], optimizer_ms=phases["optimizer"],
        peak_gpu_allocated_gib=peak_gib("peak_gpu_allocated_bytes"),
        peak_gpu_reserved_gib=peak_gib("peak_gpu_reserved_bytes"),
        gpu_after_build_gib=peak_gib("gpu_after_build_bytes"),
        peak_rss_gib=peak_gib("peak_rss_bytes"),
        loss=statistics.mean(r["loss"] for r in per_rank),
        profiled_ms=({k: max(r["profiled_ms"][k] for r in per_rank) for k in per_rank[0]["profiled_ms"]}
                     if per_rank[0].get("profiled_ms") else None),
        per_rank=per_rank,
    )
    return row


def skipped_row(job_args: dict, why: str) -> dict:
    return {**job_args, "status": "skipped", "error": why}


def run_system(args, model: str, system: str, world: int, log_dir: str) -> dict:
    base = {"model": model, "system": system, "world": world, "batch_per_rank": args.batch, "seq": args.seq}
    if system == "plain" and world != 1:
        return skipped_row(base, "plain runs at world size 1 only")
    if system.startswith("deepspeed-") and importlib.util.find_spec("deepspeed") is None:
        return skipped_row(base, "deepspeed not installed")

    def attempt(deepspeed_fp32: bool) -> dict:
        with tempfile.TemporaryDirectory(prefix="gpu_bench_") as result_dir:
            suffix = "-fp32" if deepspeed_fp32 else ""
            job = Job(model=model, system=system, device=args.device, world=world, batch=args.batch,
                      seq=args.seq, steps=args.steps, warmup=args.warmup, threads=args.threads,
                      port=free_port(), timeout_s=args.system_timeout, result_dir=result_dir,
                      log_prefix=os.path.join(log_dir, f"{model}_{system}{suffix}"),
                      deepspeed_fp32=deepspeed_fp32, profile=args.profile)
            return combine(job, run_job(job))

    row = attempt(False)
    if row["status"] == "error" and system.startswith("deepspeed-") and args.device == "cpu":
        # DeepSpeed's CPU accelerator may lack bf16; the smoke test still wants its code path.
        bf16_error = row["error"]
        row = attempt(True)
        row["bf16_error"] = bf16_error
    return row


def git_facts() -> dict:
    def git(*cmd):
        try:
            return subprocess.run(["git", "-C", REPO, *cmd], capture_output=True, text=True,
                                  timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"zero_ext_commit": git("rev-parse", "HEAD"), "zero_ext_dirty": bool(status)}


def machine_facts(device: str) -> dict:
    """Read after the runs, so the parent's own CUDA context never shares a GPU with a rank."""
    facts = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "device": device,
        **git_facts(),
        "zero_ext_path": getattr(importlib.util.find_spec("zero_ext"), "origin", None),
    }
    try:
        facts["deepspeed"] = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        facts["deepspeed"] = None
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        facts.update(gpu_count=count, gpus=[torch.cuda.get_device_name(i) for i in range(count)],
                     gpu_memory_gib=torch.cuda.get_device_properties(0).total_memory / GiB)
        try:
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - informational only
            facts["nccl"] = None
    else:
        facts.update(gpu_count=0, gpus=[])
    return facts


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: List[dict]) -> None:
    header = (f"{'system':<19} {'model':<10} {'world':>5} {'ms/step':>9} {'fwd/bwd/opt ms':>17} {'tok/s/rank':>11} "
              f"{'tok/s total':>12} {'MFU':>6} {'GPU GiB alloc/resv':>19} {'RSS GiB':>8} {'loss':>7}  status")
    print(header)
    print("-" * len(header))
    for r in rows:
        gpu = "-" if r.get("peak_gpu_allocated_gib") is None else (
            f"{r['peak_gpu_allocated_gib']:.2f}/{r['peak_gpu_reserved_gib']:.2f}")
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['error']}"
        if r.get("bf16_error"):
            status += " (fp32: bf16 failed on CPU)"
        phases = "-" if r.get("forward_ms") is None else (
            f"{r['forward_ms']:.1f}/{r['backward_ms']:.1f}/{r['optimizer_ms']:.1f}")
        print(f"{r['system']:<19} {r['model']:<10} {r['world']:>5} {fmt(r.get('ms_per_step'), '.1f'):>9} "
              f"{phases:>17} {fmt(r.get('tokens_per_s_per_rank'), ',.0f'):>11} "
              f"{fmt(r.get('tokens_per_s_total'), ',.0f'):>12} {fmt(r.get('mfu'), '.1%'):>6} "
              f"{gpu:>19} {fmt(r.get('peak_rss_gib'), '.2f'):>8} {fmt(r.get('loss'), '.4f'):>7}  {status[:110]}")
    for line in profile_lines(rows, markdown=False):
        print(line)


PROFILE_COLUMNS = ("hooks", "gather", "epilogue", "opt", "gpu_matmul", "gpu_nccl", "gpu_memcpy", "gpu_other",
                   "gpu_total")


def profile_lines(rows: List[dict], markdown: bool) -> List[str]:
    """The profiled step's breakdown, a line per system that has one (ms)."""
    profiled = [r for r in rows if r.get("profiled_ms")]
    if not profiled:
        return []
    cells = lambda r: [fmt(r["profiled_ms"].get(c), ".1f") for c in PROFILE_COLUMNS]  # noqa: E731
    if markdown:
        lines = ["", "One profiled step, ms: host time inside zero_ext's ranges (hooks = accumulate_grad, gather = "
                 "gather_unit + release_unit, epilogue = run_epilogue, opt = zero_ext::step) and GPU kernel time "
                 "by kind (gpu_total: all kernels; the step's wall time less it is time the GPU waited for the host).", "", "| system | model | " + " | ".join(PROFILE_COLUMNS) + " |",
                 "|---|---|" + "---|" * len(PROFILE_COLUMNS)]
        lines += [f"| {r['system']} | {r['model']} | " + " | ".join(cells(r)) + " |" for r in profiled]
        return lines
    lines = ["", "one profiled step, ms (host time in zero_ext's ranges; GPU kernel time by kind)",
             f"{'system':<19} {'model':<10} " + " ".join(f"{c:>10}" for c in PROFILE_COLUMNS)]
    lines += [f"{r['system']:<19} {r['model']:<10} " + " ".join(f"{v:>10}" for v in cells(r)) for r in profiled]
    return lines


def markdown_table(rows: List[dict], facts: dict) -> str:
    gpus = ", ".join(sorted(set(facts.get("gpus") or []))) or "no GPU"
    lines = [f"torch {facts.get('torch')}, CUDA {facts.get('cuda')}, {facts.get('gpu_count')} x {gpus}, "
             f"zero_ext {(facts.get('zero_ext_commit') or 'unknown')[:10]}"
             f"{' (dirty)' if facts.get('zero_ext_dirty') else ''}", "",
             "| system | model | world | ms/step | fwd/bwd/opt ms | tok/s total | MFU | peak GiB alloc/resv | loss | status |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = r["status"] == "ok"
        lines.append(
            f"| {r['system']} | {r['model']} | {r['world']} | {fmt(r.get('ms_per_step'), '.1f')} | "
            + (f"{r['forward_ms']:.1f}/{r['backward_ms']:.1f}/{r['optimizer_ms']:.1f}" if ok else "-") + " | "
            f"{fmt(r.get('tokens_per_s_total'), ',.0f')} | {fmt(r.get('mfu'), '.1%')} | "
            + (f"{r['peak_gpu_allocated_gib']:.2f}/{r['peak_gpu_reserved_gib']:.2f}"
               if r.get("peak_gpu_allocated_gib") is not None else "-")
            + f" | {fmt(r.get('loss'), '.4f')} | {r['status'] if ok else r['status'] + ': ' + str(r['error'])[:80]} |")
    return "\n".join(lines + profile_lines(rows, markdown=True)) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda: one GPU per rank, NCCL; cpu: the smoke test, gloo")
    parser.add_argument("--world", type=int, default=None,
                        help="ranks (default: torch.cuda.device_count(); 1 with --device cpu)")
    parser.add_argument("--models", nargs="+", default=["gpt2-124m", "gpt2-1b"], choices=sorted(PRESETS),
                        metavar="MODEL", help=f"presets of benchmarks/_models.py (GPT-2 ones: "
                        f"{', '.join(n for n in PRESETS if PRESETS[n].family == 'gpt2')})")
    parser.add_argument("--systems", nargs="+", default=None, metavar="SYSTEM",
                        help="default: all above (plain only at world size 1); zero_ext-0[-offload] also accepted")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads per rank (default: CPU cores / world size)")
    parser.add_argument("--system-timeout", type=float, default=600.0,
                        help="seconds one (model, system) run may take before its ranks are killed")
    parser.add_argument("--profile", action="store_true",
                        help="one more step under torch.profiler: host time in zero_ext's ranges and GPU kernel "
                             "time by kind (a second table)")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "gpu.json"),
                        help="JSON results; rank logs go to a directory beside it")
    args = parser.parse_args()

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; use --device cpu for the smoke test")
    if under_torchrun():  # the job's ranks, on any number of nodes
        args.world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", args.world))
        args.threads = args.threads or max(1, (os.cpu_count() or 1) // local)
    if args.world is None:
        args.world = torch.cuda.device_count() if args.device == "cuda" else 1
    if not under_torchrun() and (args.world < 1 or (args.device == "cuda" and args.world > torch.cuda.device_count())):
        parser.error(f"--world {args.world}: needs at least 1 rank, and one GPU per rank with --device cuda "
                     f"({torch.cuda.device_count()} here)")
    if args.systems is None:
        args.systems = [s for s in ALL_SYSTEMS if s != "plain" or args.world == 1]
    bad = [s for s in args.systems if not SYSTEM_PATTERN.match(s)]
    if bad:
        parser.error(f"unknown systems {bad}; choose from {ALL_SYSTEMS}")
    for name in args.models:
        preset = PRESETS[name]
        if preset.family != "gpt2":
            parser.error(f"{name}: only GPT-2 presets have a built-in (transformers-free) model")
        if args.seq > preset.context:
            parser.error(f"--seq {args.seq} exceeds {name}'s context of {preset.context}")
    if args.steps < 1 or args.warmup < 0 or args.batch < 1:
        parser.error("--steps and --batch must be positive, --warmup non-negative")
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.world)
    return args


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def torchrun_main(args) -> None:
    """Under torchrun: one (model, system) over every rank of the job, on any
    number of GPUs and nodes; rank 0 prints the row and writes --out (and
    its .md). A failing rank raises, and torchrun ends the job."""
    if len(args.models) != 1 or len(args.systems) != 1:
        raise SystemExit("under torchrun, pass one --models and one --systems: a job runs one system "
                         "(launch it again for the next)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = args.device == "cuda"
    torch.set_num_threads(args.threads)
    timeout = datetime.timedelta(seconds=args.system_timeout)
    if cuda:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    job = Job(model=args.models[0], system=args.systems[0], device=args.device, world=world, batch=args.batch,
              seq=args.seq, steps=args.steps, warmup=args.warmup, threads=args.threads, port=0,
              timeout_s=args.system_timeout, result_dir="", log_prefix="torchrun", profile=args.profile)
    if job.system == "plain" and world != 1:
        raise SystemExit("plain runs at world size 1 only")
    result = benchmark_rank(job, rank, local_rank)
    results: List[Optional[dict]] = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        row = combine(job, results)
        facts = machine_facts(args.device)
        facts.update(world=world, nodes=world // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        report = {"created": datetime.datetime.now().isoformat(timespec="seconds"), "args": vars(args),
                  "machine": facts, "results": [row]}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(markdown_table([row], facts))
        print_table([row])
        print(f"\nwrote {args.out}")
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if under_torchrun():
        torchrun_main(args)
        return
    out_dir = os.path.dirname(os.path.abspath(args.out))
    log_dir = os.path.splitext(os.path.abspath(args.out))[0] + "_logs"
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(log_dir, exist_ok=True)
    print(f"{len(args.models)} model(s) x {len(args.systems)} system(s), world size {args.world} "
          f"({'NCCL' if args.device == 'cuda' else 'gloo, CPU'}), {args.batch}x{args.seq} tokens per rank, "
          f"median of {args.steps} steps after {args.warmup}; rank logs in {log_dir}", flush=True)

    rows = []
    started = time.time()

    def save(facts: Optional[dict] = None) -> None:
        # Written after every system, so a run stopped half-way keeps what it measured.
        report = {"created": datetime.datetime.now().isoformat(timespec="seconds"),
                  "wall_s": time.time() - started, "args": vars(args), "machine": facts or {},
                  "results": rows}
        with open(args.out + ".tmp", "w") as f:
            json.dump(report, f, indent=2)
        os.replace(args.out + ".tmp", args.out)

    for model in args.models:
        for system in args.systems:
            start = time.time()
            row = run_system(args, model, system, args.world, log_dir)
            rows.append(row)
            summary = (f"{row['ms_per_step']:.1f} ms/step, {row['tokens_per_s_total']:,.0f} tok/s"
                       if row["status"] == "ok" else f"{row['status']}: {row['error']}")
            print(f"  {model} {system}: {summary} ({time.time() - start:.0f} s)", flush=True)
            save()

    facts = machine_facts(args.device)
    save(facts)
    print()
    gpus = ", ".join(sorted(set(facts["gpus"]))) or "no GPU"
    print(f"torch {facts['torch']}, CUDA {facts['cuda']}, {facts['gpu_count']} x {gpus}, "
          f"zero_ext {(facts['zero_ext_commit'] or 'unknown')[:10]}{' (dirty)' if facts['zero_ext_dirty'] else ''}")
    print_table(rows)
    markdown = os.path.splitext(args.out)[0] + ".md"
    with open(markdown, "w") as f:
        f.write(markdown_table(rows, facts))
    print(f"\nwrote {args.out} and {markdown}")


if __name__ == "__main__":
    main()
