"""What surviving a lost replica costs (wrap(..., replicas=zero_ext.Replicas(...))),
on CPU ranks (gloo): two replicas of two ranks each against the same four
ranks as one hybrid job ((replicate 2, shard 2) mesh, no fault tolerance).

    python benchmarks/replicas.py                  # gpt2-14m, stage 2, 3 fresh runs of each
    python benchmarks/replicas.py --model gpt2-tiny --runs 1 --steps 6   # quick

Three measurements, every job a fresh torchrun as a user's is:
  1. step time when nothing fails: each run's median step (barrier, then
     perf_counter around forward, backward, step, zero_grad), min / median /
     max over --runs runs of each system, the systems' runs interleaved;
  2. from a kill -9 of one rank of replica b to replica a's next step, for
     --dead-after values (the coordinator's wait for a replica's heartbeats):
     what the survivors lose;
  3. a join: b started again takes a's state over the network; the time of
     its first step beyond a normal one, per GiB of the state it received
     (this rank's values and optimizer state).
Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        if port < 60000:
            return port


# --- one job (under torchrun) --------------------------------------------------

def job(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.append(os.path.join(HERE, ".."))
    import zero_ext
    from _models import PRESETS, build_model

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = build_model(args.model, builtin=True, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    options = {}
    if args.replica:
        options["replicas"] = zero_ext.Replicas(coordinator=args.coordinator, replica_id=args.replica,
                                                timeout=args.timeout)
        group = None
    else:  # the baseline: one job, (replicate 2, shard world / 2)
        from torch.distributed.device_mesh import init_device_mesh
        group = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model, optimizer = zero_ext.wrap(model, optimizer, stage=args.stage, process_group=group, **options)
    preset = PRESETS[args.model]
    context = min(64, preset.context)
    g = torch.Generator().manual_seed(rank)
    times, stamps = [], []
    if rank == 0 and args.replica:
        open(args.out + ".wrapped", "w").close()
    for _ in range(args.steps):
        x = torch.randint(0, preset.vocab, (args.batch, context + 1), generator=g)
        dist.barrier()
        start = time.perf_counter()
        logits = model(x[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        stamps.append(time.time())
        if rank == 0:
            print(f"step {len(times)} t={stamps[-1]:.3f} ms={times[-1] * 1e3:.1f}", flush=True)
        time.sleep(args.step_sleep)
    # What a join sends this rank: the values the optimizer steps and their state.
    sent = sum(p.numel() * 4 + sum(t.numel() * t.element_size() for t in optimizer.state[p].values()
                                   if isinstance(t, torch.Tensor))
               for g in optimizer.param_groups for p in g["params"])
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"times": times, "stamps": stamps, "state_bytes": sent}, f)
    dist.barrier()
    dist.destroy_process_group()


# --- the orchestrator --------------------------------------------------------

class Launch:
    def __init__(self, args, tmp: str) -> None:
        self.args, self.tmp, self.procs = args, tmp, []

    def torchrun(self, ranks: int, name: str, *extra, steps: int = None):
        out = os.path.join(self.tmp, f"{name}.json")
        log = open(os.path.join(self.tmp, f"{name}.log"), "w")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
               str(_free_port()), os.path.abspath(__file__), "--job", "--model", self.args.model, "--stage",
               str(self.args.stage), "--steps", str(steps or self.args.steps), "--batch", str(self.args.batch),
               "--out", out, *extra]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc, out

    def coordinator(self, dead_after: float):
        port = _free_port()
        proc = subprocess.Popen([sys.executable, "-m", "zero_ext.coordinator", "--host", "127.0.0.1", "--port",
                                 str(port), "--min-replicas", "2", "--dead-after", str(dead_after)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                cwd=os.path.join(HERE, ".."))
        proc.stdout.readline()
        self.procs.append(proc)
        return f"127.0.0.1:{port}"

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.procs = []


def _median_step(out: str) -> float:
    with open(out) as f:
        times = json.load(f)["times"]
    return statistics.median(times[2:] if len(times) > 4 else times)


def _wait_file(path: str, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise SystemExit(f"waited {timeout} s for {path}")
        time.sleep(0.05)


def _steps_logged(path: str):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(int(line.split()[1]), float(line.split("t=")[1].split()[0])) for line in f if line.startswith("step ")]


def steady(args, tmp: str):
    """Measurement 1: the runs of each system, interleaved."""
    runs = {"hybrid 2x2, no fault tolerance": [], "2 replicas x 2 ranks (zero_ext.Replicas)": []}
    for r in range(args.runs):
        for system in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            launch = Launch(args, tmp)
            try:
                if system.startswith("hybrid"):
                    proc, out = launch.torchrun(4, f"hybrid{r}")
                    assert proc.wait(600) == 0, open(os.path.join(tmp, f"hybrid{r}.log")).read()[-3000:]
                    runs[system].append(_median_step(out))
                else:
                    address = launch.coordinator(5.0)
                    a, out_a = launch.torchrun(2, f"ft{r}a", "--coordinator", address, "--replica", "a")
                    b, out_b = launch.torchrun(2, f"ft{r}b", "--coordinator", address, "--replica", "b")
                    assert a.wait(600) == 0 and b.wait(600) == 0, open(os.path.join(tmp, f"ft{r}a.log")).read()[-3000:]
                    runs[system].append(max(_median_step(out_a), _median_step(out_b)))
            finally:
                launch.close()
    return runs


def failure(args, tmp: str, dead_after: float):
    """Measurements 2 and 3: kill -9 of b's rank 1, a's next step; b again, its join."""
    launch = Launch(args, tmp)
    try:
        address = launch.coordinator(dead_after)
        name = f"kill{dead_after:g}"
        steps = 10_000  # stopped by the orchestrator
        a, out_a = launch.torchrun(2, f"{name}a", "--coordinator", address, "--replica", "a", "--step-sleep", "0.05",
                                   steps=steps)
        b, out_b = launch.torchrun(2, f"{name}b", "--coordinator", address, "--replica", "b", "--step-sleep", "0.05",
                                   steps=steps)
        log_a = os.path.join(tmp, f"{name}a.log")
        end = time.monotonic() + 600
        while len(_steps_logged(log_a)) < 5 and time.monotonic() < end:
            time.sleep(0.05)
        pid = _child_pid(b.pid, 1)
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        while not [t for _, t in _steps_logged(log_a) if t > killed] and time.monotonic() < end:
            time.sleep(0.01)
        survivors = min(t for _, t in _steps_logged(log_a) if t > killed) - killed
        b.wait(120)
        normal = statistics.median(_step_ms(log_a)[-5:]) / 1e3
        os.remove(out_b + ".wrapped")
        b, out_b = launch.torchrun(2, f"{name}b2", "--coordinator", address, "--replica", "b", "--step-sleep",
                                   "0.05", steps=steps)
        log_b = os.path.join(tmp, f"{name}b2.log")
        while not _step_ms(log_b) and time.monotonic() < end:
            time.sleep(0.05)
        join = _step_ms(log_b)[0] / 1e3
        return survivors, join, normal
    finally:
        launch.close()


def _step_ms(log: str):
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [float(line.split("ms=")[1]) for line in f if line.startswith("step ")]


def _child_pid(agent: int, local_rank: int) -> int:
    """The pid of torchrun's worker `local_rank` (the agent's children, by start order)."""
    children = subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True).stdout.split()
    workers = sorted(int(c) for c in children)
    return workers[local_rank]


def state_gib(args, tmp: str) -> float:
    """This rank's state a join sends (values and optimizer state), from a run's memory report."""
    with open(os.path.join(tmp, "ft0a.json")) as f:
        return json.load(f)["state_bytes"] / 2 ** 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default="")
    parser.add_argument("--replica", default="")
    parser.add_argument("--out", default="")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--model", default="gpt2-14m")
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--runs", type=int, default=3, help="fresh runs of each system")
    parser.add_argument("--dead-after", type=float, nargs="+", default=[1.0, 5.0])
    args = parser.parse_args()
    if args.job:
        job(args)
        return
    sys.path.append(os.path.join(HERE, ".."))
    from _models import describe
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        runs = steady(args, tmp)
        gib = state_gib(args, tmp)
        kills = {d: failure(args, tmp, d) for d in args.dead_after}
    print(f"{describe(args.model)}, stage {args.stage}, 4 CPU ranks (gloo), {args.batch} sequences per rank; "
          f"{args.runs} fresh runs of each system, {args.steps} steps each (each run's median step)\n")
    print("| system | ms/step min | median | max |")
    print("|---|---|---|---|")
    for system, values in runs.items():
        ms = sorted(v * 1e3 for v in values)
        print(f"| {system} | {ms[0]:.1f} | {statistics.median(ms):.1f} | {ms[-1]:.1f} |")
    base = statistics.median(runs["hybrid 2x2, no fault tolerance"])
    ft = statistics.median(runs["2 replicas x 2 ranks (zero_ext.Replicas)"])
    print(f"\nfault tolerance when nothing fails: {ft / base:.2f}x the hybrid step ({(ft - base) * 1e3:+.1f} ms)\n")
    print("| --dead-after s | kill -9 to the survivor's next step, s | join step s | normal step s | "
          f"join s per GiB ({gib * 1024:.1f} MiB per rank) |")
    print("|---|---|---|---|---|")
    for dead_after, (survivors, join, normal) in kills.items():
        print(f"| {dead_after:g} | {survivors:.2f} | {join:.2f} | {normal:.3f} | {(join - normal) / gib:.1f} |")
    print(f"\n({time.perf_counter() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
