"""Multi-node launch and elastic restart, run the way a cluster runs them:
two torchrun agents (one per "node", two workers each) on this machine,
rendezvous over c10d, training examples/train_lm.py with a hybrid mesh
(shard within a node, replicate across nodes).

- The two-agent run matches one process over the same global batch.
- A worker killed mid-step: torchrun restarts every worker, the job goes on
  from the last complete zero_ext.save and ends bit-identical to a run
  never interrupted.
- A node lost for good (its agent stopped): the other agent restarts alone,
  at half the world size, loads the hybrid save flat (resharded) and ends
  where one process over the same data ends.

TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: without it torch 2.13's agent keeps
one TCPStore across restarts and gloo's new workers connect to the dead
incarnation's addresses (README, Multi-node).
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_lm.py")
COMMON = ["--global-batch", "8", "--mesh", "nodes", "--no-report"]


def _env() -> dict:
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agents(out: str, args, nnodes: str = "2", deadline: float = 240.0, stop_second_when=None):
    """Starts two agents; returns their (returncode, log). `stop_second_when`:
    a predicate polled while they run; once true, the second agent gets
    SIGTERM (a node going away: torchrun stops its workers and exits)."""
    port = _port()
    procs, logs = [], []
    for host in (1, 0):
        log = open(os.path.join(out, f"agent{host}.log"), "w")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"job{port}",
               "--rdzv-conf", f"is_host={host},last_call_timeout=2", "--local-addr", "127.0.0.1",
               "--max-restarts", "3", "--monitor-interval", "0.5", EXAMPLE, *args]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT))
        logs.append(log)
    end = time.monotonic() + deadline
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > end:
                pytest.fail(f"the agents ran past {deadline} s; logs in {out}")
            if stop_second_when is not None and procs[1].poll() is None and stop_second_when():
                procs[1].send_signal(signal.SIGTERM)
                stop_second_when = None
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    texts = [open(os.path.join(out, f"agent{h}.log")).read() for h in (1, 0)]
    return [p.returncode for p in procs], texts


def _single_process(out: str, steps: int) -> dict:
    path = os.path.join(out, "reference.pt")
    subprocess.run([sys.executable, EXAMPLE, "--steps", str(steps), *COMMON, "--save-final", path],
                   check=True, capture_output=True, env=_env(), cwd=ROOT)
    return torch.load(path, weights_only=True)


def _close(got: dict, want: dict) -> None:
    # Four ranks against one process: the same sums in another order, through AdamW.
    for name, value in want.items():
        assert torch.allclose(got[name], value, rtol=1e-4, atol=1e-4), \
            (name, (got[name] - value).abs().max().item())


def test_two_agents_train_a_hybrid_mesh_like_one_process(tmp_path):
    final = str(tmp_path / "final.pt")
    codes, logs = _agents(str(tmp_path), ["--steps", "6", *COMMON, "--save-final", final])
    assert codes == [0, 0], logs
    assert "4 rank(s) x 2 sequences" in logs[0] + logs[1] and "hybrid: 2 replicas of a 2-way sharding" in logs[0] + logs[1]
    _close(torch.load(final, weights_only=True), _single_process(str(tmp_path), 6))


def test_a_killed_worker_restarts_from_the_last_save_bit_identically(tmp_path):
    runs = {}
    for name, extra in (("whole", []), ("killed", ["--kill-at", "3:5"])):
        out = tmp_path / name
        out.mkdir()
        final = str(out / "final.pt")
        started = time.time()
        codes, logs = _agents(str(out), ["--steps", "8", *COMMON, "--save-final", final, "--resume-dir", str(out),
                                         "--save-every", "2", *extra])
        assert codes == [0, 0], logs
        runs[name] = (torch.load(final, weights_only=True), logs, time.time() - started, out)
    whole, killed = runs["whole"][0], runs["killed"][0]
    logs = "".join(runs["killed"][1])
    assert (runs["killed"][3] / "killed-once").exists(), "the worker was never killed"
    assert "resumed from" in logs and "after step 4 at world size 4" in logs, logs
    for name in whole:
        assert torch.equal(whole[name], killed[name]), name
    kill_time = os.path.getmtime(runs["killed"][3] / "killed-once")
    resumed = float(re.search(r"unix time ([0-9.]+)", logs).group(1))
    print(f"\nkill -> resumed: {resumed - kill_time:.1f} s; run {runs['killed'][2]:.1f} s "
          f"vs {runs['whole'][2]:.1f} s uninterrupted")


def test_a_lost_node_resumes_at_the_smaller_world_size(tmp_path):
    checkpoint = tmp_path / "checkpoint" / "metadata.json"
    final = str(tmp_path / "final.pt")
    codes, logs = _agents(str(tmp_path), ["--steps", "10", *COMMON, "--save-final", final,
                                          "--resume-dir", str(tmp_path), "--save-every", "2",
                                          "--step-seconds", "0.3"],
                          nnodes="1:2", stop_second_when=checkpoint.exists)
    assert codes[0] == 0, logs
    assert re.search(r"resumed from .* at world size 2", logs[0]), logs[0]
    _close(torch.load(final, weights_only=True), _single_process(str(tmp_path), 10))
