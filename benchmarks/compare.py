"""zero_ext side by side with torch DDP, FSDP2 and DeepSpeed ZeRO on one GPT model.

    bash benchmarks/setup.sh && python benchmarks/compare.py     # the CPU table (gpt2-10m, 2 gloo ranks)
    python benchmarks/compare.py --model gpt2-124m --steps 5 --systems ddp zero_ext-3 deepspeed-3
    python benchmarks/compare.py --model llama-200m --batch 1 --seq 64

Every system trains the same model (transformers GPT-2 or Llama config with
random weights, seed 0; see benchmarks/_models.py) on the same synthetic token
batches with the same AdamW, each in its own group of freshly started ranks so
that peak memory is the system's own. Systems:

  ddp                    torch DistributedDataParallel (25 MiB buckets)
  fsdp2, fsdp2-keep      torch fully_shard on each block and the root,
                         reshard_after_forward True / False
  deepspeed-1/2/3        DeepSpeed ZeRO stage 1/2/3 (fp32, 25 MiB buckets, its
                         default clipping to norm 1.0 turned off, as no other
                         system clips), if installed; it steps with
                         engine.backward / engine.step
  zero_ext-0/1/2/3       zero_ext.wrap(stage=N), plain loss.backward() / step()

Reported per system (mean over ranks unless said):
  ms/step      median wall time of a training step after --warmup steps
  tok/s        tokens per second over all ranks
  peak RSS     the rank's peak resident memory (VmHWM), whole process, over
               the timed training loop (before the profiled step)
  state MiB    bytes of parameters + gradients + optimizer state the rank
               holds after a step (before zero_grad), from each system's own
               tensors; "ZeRO" is the paper's formula for that stage with
               fp32 Adam: 16P (stage 0), 8P + 8P/N (1), 4P + 12P/N (2), 16P/N (3)
  sent MiB     bytes this rank sends per step, counted from the collectives
               the process-group backend ran during one profiled step
               (torch.profiler records each gloo/nccl collective with its
               tensor size) under bandwidth-optimal algorithms: all-reduce
               2(N-1)/N x S, reduce-scatter and reduce (N-1)/N x S,
               all-gather (N-1) x the shard, all-to-all and broadcast
               (N-1)/N x S. Gloo runs a reduce-scatter as a full all-reduce
               (it shows up as one), so FSDP2 and DeepSpeed send 3(N-1)/N x 4P
               at stages 1-2 and 4(N-1)/N x 4P at stage 3 on gloo, where NCCL
               would send 2 and 3; zero_ext's stages 1-3 reduce-scatter with
               an all-to-all there and send the 2, 2 and 3 (stage 1 all-reduced
               its full staging in place, 3, until issue 43). "theory" is each
               system's gloo figure.
               Hybrid systems (zero_ext-STAGE-RxS) are counted from
               zero_ext's issue log instead, split by group: within the row
               (as a flat run over S ranks) and across replicas, an
               all-reduce of the reduced 1/S shard: 2(R-1)/R x 4P/S (stage 0:
               of the full gradient, 2(R-1)/R x 4P). The ZeRO formula uses N = S
  loss         the global batch's loss at the last step

Peak RSS depends on the allocator as much as on the system: glibc raises its
mmap threshold each time a large block is freed, so buffers that a sharded
system frees and allocates again every step (gathered parameters, FSDP2's and
zero_ext stage 3's alike) end up in the heap, and the heap fragments over
the first steps. --mmap-threshold 131072 fixes glibc's threshold
(MALLOC_MMAP_THRESHOLD_) in the ranks, so freed buffers go back to the OS at
once and the peak shows what the system holds (steps get somewhat slower).

Writes a JSON (all numbers, per-step losses) and a PNG (bars plus loss curves).
Timings are measured, never asserted.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's start/stop lines

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _accounting import (deepspeed_state_bytes, mesh_of, plain_state_bytes, proc_status_kib,  # noqa: E402
                         reset_peak_rss, sent_bytes, sent_bytes_by_group, stage_of, theory_sent_by_group,
                         theory_sent_bytes, zero_formula_bytes)
from _compare_report import plot, print_table  # noqa: E402
from _models import blocks_of, build_model, transformers_available, PRESETS  # noqa: E402
from zero_ext.tools import state_or_none  # noqa: E402
from zero_ext.tools.torch_compat import profiled_ops  # noqa: E402  (torch-version differences live there)

ALL_SYSTEMS = ["ddp", "fsdp2", "fsdp2-keep", "deepspeed-1", "deepspeed-2", "deepspeed-3",
               "zero_ext-0", "zero_ext-1", "zero_ext-2", "zero_ext-3"]
# Hybrid sharding over an R x S (replicate, shard) mesh: "zero_ext-STAGE-RxS"
# (with --world R*S), e.g. zero_ext-2-2x2 at --world 4; not run by default.
HYBRID_SYSTEMS = [f"zero_ext-{stage}-2x2" for stage in range(4)]
BUCKET_MB = 25.0


# --- data --------------------------------------------------------------------

def make_batch(args, rank: int, world: int, step: int):
    """This rank's slice of step's global batch: arithmetic progressions mod a
    small alphabet with a random start and stride per sequence, so the loss has
    something to learn and falls visibly within a few steps."""
    g = torch.Generator().manual_seed(1000 + step)
    n = world * args.batch
    alphabet = min(args.alphabet, PRESETS[args.model].vocab)
    start = torch.randint(0, alphabet, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    tokens = (start + stride * torch.arange(args.seq + 1)) % alphabet
    mine = tokens[rank * args.batch:(rank + 1) * args.batch]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


# --- one system on one rank -------------------------------------------------------

def build_system(args, system: str, world: int):
    """(model for forward, step function, state-bytes function)."""
    model = build_model(args.model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    def loss_of(forward, x, y):
        return F.cross_entropy(forward(x).float().flatten(0, 1), y.flatten())

    if system.startswith("deepspeed"):
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 10 ** 9,
            "gradient_clipping": 0.0,  # DeepSpeed clips to norm 1.0 unless told not to
            "zero_optimization": {
                "stage": stage_of(system),
                "reduce_bucket_size": int(BUCKET_MB * 2 ** 20 / 4),
                "allgather_bucket_size": int(BUCKET_MB * 2 ** 20 / 4),
                "stage3_prefetch_bucket_size": int(BUCKET_MB * 2 ** 20 / 4),
            },
        }
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

        def ds_step(x, y):
            loss = loss_of(engine, x, y)
            engine.backward(loss)
            engine.step()
            return loss

        return ds_step, lambda: deepspeed_state_bytes(engine)

    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        forward = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB) if world > 1 else model
        report = lambda: plain_state_bytes(model, opt)  # noqa: E731
    elif system.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        reshard = system == "fsdp2"
        for block in blocks_of(model):
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        forward = model
        report = lambda: plain_state_bytes(model, opt)  # noqa: E731
    else:
        import zero_ext

        group = {}
        if mesh_of(system):
            from torch.distributed.device_mesh import init_device_mesh

            group["process_group"] = init_device_mesh("cpu", mesh_of(system), mesh_dim_names=("replicate", "shard"))
        forward, opt = zero_ext.wrap(model, opt, stage=stage_of(system), bucket_mb=BUCKET_MB, **group)
        report = lambda: zero_ext.memory_report(model, opt)  # noqa: E731

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(forward, x, y)
        loss.backward()
        opt.step()
        return loss

    state = state_or_none(model)  # zero_ext: its issue log, through the core's diagnostics handle
    step.diagnostics = state.handles.diagnostics if state is not None else None
    return step, report


def run_rank(rank: int, world: int, system: str, args, init_file: str, out_dir: str) -> None:
    result: Dict = {"rank": rank}
    # The ranks' own output (DeepSpeed's and the profiler's logs) goes to a
    # file, shown only when the system fails.
    log = os.open(os.path.join(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        torch.set_num_threads(args.threads)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.system_timeout))
        if system.startswith("deepspeed"):
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
        baseline_kib = proc_status_kib("VmRSS")
        reset_peak_rss()
        step, report = build_system(args, system, world)
        times, losses = [], []
        for i in range(args.warmup + args.steps):
            x, y = make_batch(args, rank, world, i)
            dist.barrier()
            start = time.perf_counter()
            loss = step(x, y)
            elapsed = time.perf_counter() - start
            losses.append(loss.item())
            if i >= args.warmup:
                times.append(elapsed)
        # The training loop's peak: the profiler's own records come after.
        peak_rss_kib = proc_status_kib("VmHWM")
        # One more step under the profiler, only to count the collectives.
        x, y = make_batch(args, rank, world, args.warmup + args.steps)
        dist.barrier()
        diagnostics = getattr(step, "diagnostics", None)
        if diagnostics is not None:
            diagnostics.log_issues(True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            loss = step(x, y)
            # gloo ends a collective's profiler event in a callback of its
            # future, which runs on gloo's thread after the future wakes its
            # waiters (c10::ivalue::Future::markCompleted): a profiler that
            # stops right after the step can lose the last collective (seen:
            # DDP's one all-reduce on rank 0, torch 2.11). Let it finish.
            dist.barrier()
            time.sleep(0.05)
        losses.append(loss.item())
        result.update(sent_bytes(profiled_ops(prof), world))
        if diagnostics is not None:
            diagnostics.log_issues(False)
            replicas, shard = mesh_of(system) or (1, world)
            result["sent_by_group"] = sent_bytes_by_group(diagnostics.take_issue_log(), replicas, shard)
            if mesh_of(system):  # the profiler cannot tell the groups apart; zero_ext's own count can
                result["sent_bytes"] = sum(result["sent_by_group"].values())
        result.update(report())
        result.update(ms_per_step=1e3 * statistics.median(times), losses=losses,
                      baseline_rss_kib=baseline_kib, peak_rss_kib=peak_rss_kib)
        dist.barrier()
    except Exception as e:  # recorded, so one failing system does not end the comparison
        result["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        result["traceback"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # DeepSpeed's ranks sometimes abort while tearing down; the result is
    # written, so leave without running any teardown.
    os._exit(0)


def run_system(args, system: str) -> Dict:
    """Runs one system on fresh ranks; its per-rank results or an error."""
    if system.startswith("deepspeed"):
        try:
            import deepspeed  # noqa: F401
        except Exception as e:
            return {"error": f"deepspeed not importable here ({type(e).__name__}: {e})"}
    if args.mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)  # read by the ranks' glibc at start
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=run_rank, args=(r, args.world, system, args, os.path.join(tmp, "rdv"), tmp))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + args.system_timeout + 60
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        ranks = []
        for r in range(args.world):
            path = os.path.join(tmp, f"rank{r}.json")
            if not os.path.exists(path):
                if args.verbose:
                    with open(os.path.join(tmp, f"rank{r}.log")) as f:
                        print(f.read()[-5000:], file=sys.stderr)
                return {"error": f"rank {r} " + ("timed out" if r in hung else f"died (exit {procs[r].exitcode})")}
            with open(path) as f:
                ranks.append(json.load(f))
        errors = [r for r in ranks if "error" in r]
        if errors:
            if args.verbose:
                with open(os.path.join(tmp, f"rank{errors[0]['rank']}.log")) as f:
                    print(f.read()[-5000:], file=sys.stderr)
            return {"error": errors[0]["error"]}
    return summarize(args, system, ranks)


def summarize(args, system: str, ranks: List[Dict]) -> Dict:
    numel = sum(p.numel() for p in build_model(args.model).parameters())
    ms = statistics.mean(r["ms_per_step"] for r in ranks)
    state = [r["params"] + r["grads"] + r["optimizer_state"] for r in ranks]
    replicas, shard = mesh_of(system) or (1, args.world)
    formula = zero_formula_bytes(stage_of(system), numel, shard)  # hybrid: N is the shard group's size
    by_group = {}
    if "sent_by_group" in ranks[0]:
        by_group = {k: statistics.mean(r["sent_by_group"][k] for r in ranks) for k in ranks[0]["sent_by_group"]}
        theory = (theory_sent_by_group(stage_of(system), numel, replicas, shard) if mesh_of(system) else
                  {"within_row": theory_sent_bytes(system, numel, args.world), "across_replicas": 0.0})
        by_group = {"measured": by_group, "theory": theory}
    return {
        "sent_by_group": by_group,
        "ms_per_step": ms,
        "tokens_per_s": args.world * args.batch * args.seq / (ms / 1e3),
        "peak_rss_mib": max(r["peak_rss_kib"] for r in ranks) / 1024,
        "baseline_rss_mib": statistics.mean(r["baseline_rss_kib"] for r in ranks) / 1024,
        "state_bytes": statistics.mean(state),
        "state_bytes_by_rank": state,
        "state_breakdown_rank0": {k: ranks[0][k] for k in ("params", "grads", "optimizer_state")},
        "zero_formula_bytes": formula,
        "state_vs_formula": statistics.mean(state) / formula,
        "sent_bytes": statistics.mean(r["sent_bytes"] for r in ranks),
        "theory_sent_bytes": theory_sent_bytes(system, numel, args.world),
        "sent_by_kind_rank0": ranks[0]["sent_by_kind"],
        "collectives_per_step": statistics.mean(r["collectives"] for r in ranks),
        # The global batch's loss: every rank's local loss is over equal slices.
        "losses": [statistics.mean(r["losses"][i] for r in ranks) for i in range(len(ranks[0]["losses"]))],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-10m", choices=sorted(PRESETS))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--alphabet", type=int, default=512, help="token ids the synthetic data uses")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--systems", nargs="+", default=ALL_SYSTEMS, choices=ALL_SYSTEMS + HYBRID_SYSTEMS,
                        metavar="SYSTEM")
    parser.add_argument("--system-timeout", type=float, default=900.0, help="seconds before a system's ranks are killed")
    parser.add_argument("--mmap-threshold", type=int, default=0,
                        help="fix glibc's mmap threshold in the ranks to this many bytes (see above)")
    parser.add_argument("--port", type=int, default=29617, help="DeepSpeed's MASTER_PORT")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "compare"),
                        help="writes OUT.json and OUT.png")
    parser.add_argument("--verbose", action="store_true", help="print the output of a failing system's rank")
    args = parser.parse_args()
    if not transformers_available():
        print("note: transformers is not installed; using the built-in GPT-2 (pip install transformers)")

    results = {}
    for system in args.systems:
        started = time.monotonic()
        results[system] = run_system(args, system)
        status = results[system].get("error", "ok")
        print(f"  {system}: {status} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)

    numel = sum(p.numel() for p in build_model(args.model).parameters())
    print_table(args, results, numel)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"args": vars(args), "parameters": numel, "torch": torch.__version__,
                   "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                   "results": results}, f, indent=2)
    png = plot(args, results, args.out + ".png")
    print(f"wrote {args.out}.json" + (f" and {png}" if png else " (no PNG: pip install matplotlib)"))


if __name__ == "__main__":
    main()
