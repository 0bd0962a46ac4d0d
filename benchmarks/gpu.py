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
import importlib.util
import json
import os
import re
import socket
import sys
import tempfile
import time
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
sys.path.append(REPO)  # this checkout's zero_ext when none is installed (built in place)
from _models import PRESETS  # noqa: E402
# Inside a rank (the job, each system's step, the spawned entry point), and
# the parent's row, facts and tables after the ranks.
from _gpu_rank import Job, benchmark_rank, rank_entry  # noqa: E402
from _gpu_report import combine, machine_facts, markdown_table, print_table  # noqa: E402

ALL_SYSTEMS = ["plain", "ddp", "fsdp2", "deepspeed-1", "deepspeed-2", "deepspeed-3",
               "zero_ext-1", "zero_ext-2", "zero_ext-3",
               "zero_ext-1-offload", "zero_ext-2-offload", "zero_ext-3-offload"]
SYSTEM_PATTERN = re.compile(r"^(plain|ddp|fsdp2|deepspeed-[0-3]|zero_ext-[0-3](-offload)?)$")
# After every rank has written its result, how long a rank may take to exit
# (DeepSpeed and NCCL teardown can hang) before it is killed; and how long the
# others get after one rank failed before they are killed (they would wait in a
# collective until the timeout).
EXIT_GRACE_S = 30.0
FAILURE_GRACE_S = 15.0


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
