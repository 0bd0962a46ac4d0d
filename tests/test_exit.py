"""How zero_ext's processes end (issue 32).

- No rank aborts at interpreter exit: 8 torchrun runs of the demo
  (examples/train_lm.py, stages 0-3) all exit 0, and 8 saves whose peer
  exits mid-save (stages 1-3) all end with the survivor's RuntimeError and
  exit code 1, never SIGABRT ("terminate called ..."). The abort came from
  a thread other than the main one releasing a tensor Python made after the
  interpreter had begun to finalize ([Note: tensors a backend thread lets go
  of] in zero_ext/groups/process_groups.py). The full soak, 50 + 50 runs:
  `python scripts/exit_soak.py`.
- An elastic restart (`torchrun --max-restarts 1`) with
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the second incarnation wraps again
  (new zero_ext groups) and trains. Without the variable torch 2.13's agent
  hands the new workers the dead incarnation's store, and torch's own
  default group connects to the dead workers' gloo addresses before any
  zero_ext code runs (docs/multi-node.md, "Restarts").
- destroy_process_group() frees every group, the world's and zero_ext's,
  once the models are gone: no gloo thread outlives it into interpreter
  exit, where letting go of a collective's tensors aborts the process
  ([Note: groups die with destroy_process_group]).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)


def _soak_module():
    spec = importlib.util.spec_from_file_location("exit_soak", os.path.join(REPO, "scripts", "exit_soak.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_rank_aborts_at_exit():
    soak = _soak_module()
    outcomes, table = soak.soak(demo_runs=8, dead_peer_runs=8, parallel=2)  # about 50 s on 2 cores
    failed = [o for o in outcomes if not o.ok]
    details = "\n\n".join(f"{o.kind} {o.label}: exit {o.code}\n{o.output[-3000:]}" for o in failed)
    assert not failed, f"\n{table}\n\n{details}"


def test_elastic_restart_wraps_again(tmp_path):
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.5",
           os.path.join(TESTS, "exit_scenarios.py"), "restart", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("attempt-")) == \
        ["attempt-1-rank0", "attempt-1-rank1"]


def test_destroy_process_group_frees_every_group():
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           os.path.join(TESTS, "exit_scenarios.py"), "groups-freed"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert done.stdout.count("groups freed") == 4, done.stdout
