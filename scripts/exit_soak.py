"""How zero_ext's processes end, run many times (issue 32): a rank must never
abort (SIGABRT, "terminate called ...") at interpreter exit.

    python scripts/exit_soak.py                  # the acceptance: 50 + 50 runs
    python scripts/exit_soak.py --demo 8 --dead-peer 8

- demo: `torchrun --nproc-per-node 2 examples/train_lm.py` (small, stages 0-3
  in turn); each run must exit 0.
- dead-peer: a 2-rank save at stages 1-3 in turn in which rank 1 exits
  mid-save (ZERO_EXT_TEST_FAULT=after_shards:1, tests/exit_scenarios.py);
  the survivor must end with zero_ext's RuntimeError and exit code 1. The two
  ranks are started the way torchrun starts them (RANK, WORLD_SIZE,
  MASTER_ADDR/PORT) but without its agent, which would SIGTERM the survivor as
  soon as it sees rank 1 gone and would not report the survivor's own exit
  code; `--dead-peer-launcher torchrun` runs them under torchrun instead
  (with a long monitor interval, so the agent sees both exits).

`--parallel K` runs K jobs at once: more processes than cores, so a backend
thread is more often kept waiting while a main thread exits, the moment the
abort needs (4 processes per job already share 2 cores here).

Prints one row per kind: runs, the exit codes seen, aborts. Exit status 1
if any run ended otherwise than required. `--keep DIR` keeps the output (and
with `--cores`, the core dump) of every failing run.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIOS = os.path.join(REPO, "tests", "exit_scenarios.py")
DEMO = os.path.join(REPO, "examples", "train_lm.py")
ABORT = re.compile(r"terminate called|SIGABRT|Signal 6|Fatal Python error: Aborted|core dumped")
SURVIVOR_ERROR = "RuntimeError: zero_ext.save at stage"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env() -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


class Outcome:
    def __init__(self, kind: str, label: str, code: Optional[int], ok: bool, aborted: bool, output: str,
                 seconds: float, cwd: str):
        self.kind, self.label, self.code, self.ok = kind, label, code, ok
        self.aborted, self.output, self.seconds, self.cwd = aborted, output, seconds, cwd


def run_demo(stage: int, timeout: float = 240.0) -> Outcome:
    cwd = tempfile.mkdtemp(prefix="zero_ext_exit_demo_")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           DEMO, "--stage", str(stage), "--steps", "3", "--context", "16", "--batch", "2", "--dim", "32",
           "--no-report"]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=base_env(), capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    aborted = bool(ABORT.search(output)) or done.returncode in (-6, 134)
    return Outcome("demo", f"stage {stage}", done.returncode, done.returncode == 0 and not aborted, aborted,
                   output, time.perf_counter() - start, cwd)


def run_dead_peer(stage: int, launcher: str = "direct", timeout: float = 240.0) -> Outcome:
    """The survivor's (rank 0's) exit code and output."""
    cwd = tempfile.mkdtemp(prefix="zero_ext_exit_save_")
    env = dict(base_env(), ZERO_EXT_TEST_FAULT="after_shards:1")
    args = [SCENARIOS, "dead-peer", str(stage), cwd]
    start = time.perf_counter()
    if launcher == "torchrun":
        # The agent polls every 3 s: both ranks have exited by its first look
        # at them, so it reports both exit codes instead of stopping rank 0.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "--monitor-interval", "3", *args]
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        output = done.stdout + done.stderr
        codes = {int(r): int(c) for r, c in re.findall(r"rank\s*:\s*(\d+) \(local_rank.*?exitcode\s*:\s*(-?\d+)",
                                                        output, re.S)}
        code = codes.get(0)
    else:
        port = free_port()
        procs = []
        for rank in range(2):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            rank_cwd = os.path.join(cwd, f"rank{rank}")  # where a core dump would land
            os.makedirs(rank_cwd)
            procs.append(subprocess.Popen([sys.executable, *args], cwd=rank_cwd, env=rank_env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append(p.communicate()[0] + "\n[exit_soak: timed out, killed]")
        code, output = procs[0].returncode, outs[0] + "\n--- rank 1 ---\n" + outs[1]
        if procs[1].returncode != 17:
            output += f"\n[exit_soak: rank 1 exited {procs[1].returncode}, not 17]"
    aborted = bool(ABORT.search(output)) or code in (-6, 134)
    ok = code == 1 and SURVIVOR_ERROR in output and not aborted
    return Outcome("dead-peer", f"stage {stage}", code, ok, aborted, output, time.perf_counter() - start, cwd)


def soak(demo_runs: int, dead_peer_runs: int, launcher: str = "direct", keep: Optional[str] = None,
         verbose: bool = False, parallel: int = 1) -> Tuple[List[Outcome], str]:
    """Alternates the kinds, `parallel` jobs at a time; returns every
    outcome and the table."""
    outcomes: List[Outcome] = []
    plan = []
    for i in range(max(demo_runs, dead_peer_runs)):
        if i < demo_runs:
            plan.append(("demo", i % 4))            # stages 0-3
        if i < dead_peer_runs:
            plan.append(("dead-peer", 1 + i % 3))   # stages 1-3

    lock = threading.Lock()

    def run(job: Tuple[str, int]) -> None:
        kind, stage = job
        outcome = run_demo(stage) if kind == "demo" else run_dead_peer(stage, launcher)
        with lock:
            outcomes.append(outcome)
            if verbose or not outcome.ok:
                print(f"{kind:9} {outcome.label}: exit {outcome.code} {'ok' if outcome.ok else 'FAILED'}"
                      f"{' (ABORT)' if outcome.aborted else ''} {outcome.seconds:.1f} s", flush=True)
            if not outcome.ok:
                print("    " + outcome.output[-2500:].replace("\n", "\n    "), flush=True)
                if keep:
                    target = os.path.join(keep, f"{kind}-{len(outcomes)}")
                    shutil.copytree(outcome.cwd, target)
                    with open(os.path.join(target, "output.txt"), "w") as f:
                        f.write(outcome.output)
        shutil.rmtree(outcome.cwd, ignore_errors=True)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        list(pool.map(run, plan))
    return outcomes, table(outcomes)


def table(outcomes: List[Outcome]) -> str:
    rows = ["| kind | runs | required | ok | exit codes seen | aborts (SIGABRT / terminate) | mean s |",
            "|---|---|---|---|---|---|---|"]
    for kind, required in (("demo", "exit 0"), ("dead-peer", "survivor: RuntimeError, exit 1")):
        mine = [o for o in outcomes if o.kind == kind]
        if not mine:
            continue
        codes = collections.Counter(o.code for o in mine)
        seen = ", ".join(f"{c}: {n}" for c, n in sorted(codes.items(), key=lambda kv: str(kv[0])))
        rows.append(f"| {kind} | {len(mine)} | {required} | {sum(o.ok for o in mine)} | {seen} | "
                    f"{sum(o.aborted for o in mine)} | {sum(o.seconds for o in mine) / len(mine):.1f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo", type=int, default=50, help="torchrun runs of examples/train_lm.py")
    parser.add_argument("--dead-peer", type=int, default=50, help="saves whose peer dies mid-save")
    parser.add_argument("--dead-peer-launcher", choices=["direct", "torchrun"], default="direct")
    parser.add_argument("--keep", metavar="DIR", help="copy failing runs' directories and output here")
    parser.add_argument("--cores", action="store_true", help="allow core dumps (kept with --keep)")
    parser.add_argument("--verbose", action="store_true", help="a line per run")
    parser.add_argument("--parallel", type=int, default=1, metavar="K", help="jobs at once")
    args = parser.parse_args()
    if args.cores:
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    start = time.perf_counter()
    outcomes, text = soak(args.demo, args.dead_peer, args.dead_peer_launcher, args.keep, args.verbose,
                          args.parallel)
    print(text)
    print(f"{len(outcomes)} runs in {time.perf_counter() - start:.0f} s, {args.parallel} at a time")
    sys.exit(0 if all(o.ok for o in outcomes) else 1)


if __name__ == "__main__":
    main()
