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
- A rank that raised zero_ext's error with one of its collectives still in
  flight exits at once (nanoGPT's master-only evaluation, then a barrier
  on every rank): the group with the abandoned collective is kept until
  exit instead of being freed, which joined a gloo thread blocked in it
  for the group's timeout, 30 minutes ([Note: abandoned collectives] in
  csrc/abandoned_collectives.h); its exit ends the other rank's barrier.
- destroy_process_group() frees every group, the world's and zero_ext's,
  once the models are gone: no gloo thread outlives it into interpreter
  exit, where letting go of a collective's tensors aborts the process
  ([Note: groups die with destroy_process_group]).
- A peer killed during zero_ext's background work (an asynchronous save's
  writer thread, either format; the "nvme" offload's I/O threads): the
  survivor raises zero_ext's error and its process exits within seconds of
  it, with the 30-minute timeouts left as they are, and prints no c10d
  warning with a C++ stack trace, also when the victim is rank 0, the
  store's host ([Note: an asynchronous save at exit] in
  zero_ext/files/asynchronous.py).
"""
from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)


def _soak_module():
    spec = importlib.util.spec_from_file_location("exit_soak", os.path.join(REPO, "scripts", "exit_soak.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_rank_aborts_at_exit():
    soak = _soak_module()
    # A tripwire, not the soak (scripts/exit_soak.sh runs 50 of each): 6 + 6
    # runs, about 65 s on 2 cores, within the README suite's 15 minutes.
    outcomes, table = soak.soak(demo_runs=6, dead_peer_runs=6, parallel=2)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_ranks(tmp_path, args, deadline_s: float = 240, **extra_env):
    """Two processes launched as torchrun would, but watched one by one
    (torchrun would end the survivor itself once one rank exits): each
    rank's exit time, exit code and output."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), WORLD_SIZE="2", **extra_env)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    procs, logs = [], []
    for rank in range(2):
        log = open(tmp_path / f"rank{rank}.log", "w+")
        procs.append(subprocess.Popen([sys.executable, os.path.join(TESTS, "exit_scenarios.py")] + args,
                                      env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), stdout=log,
                                      stderr=subprocess.STDOUT))
        logs.append(log)
    ended = [None, None]
    deadline = time.monotonic() + deadline_s
    while None in ended and time.monotonic() < deadline:
        for rank, proc in enumerate(procs):
            if ended[rank] is None and proc.poll() is not None:
                ended[rank] = time.time()
        time.sleep(0.1)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    report = "\n\n".join(f"rank {r} (exit {p.returncode}):\n{out[-4000:]}" for r, (p, out) in
                          enumerate(zip(procs, outputs)))
    return ended, [p.returncode for p in procs], outputs, report


@pytest.mark.parametrize("kind,victim", [("async-save", 1), ("async-save-dcp", 1), ("async-save", 0),
                                         ("async-save-dcp", 0), ("nvme", 1)])
def test_a_peer_killed_during_background_work_leaves_the_survivor_free_to_exit(kind, victim, tmp_path):
    from zero_ext.tools import faults
    injected = kind.startswith("async") and victim == 1
    env = {faults.VARIABLE: faults.spec("async_after_write", victim)} if injected else {}
    ended, codes, outputs, report = _run_two_ranks(
        tmp_path, ["peer-killed", kind, str(victim), str(tmp_path)], **env)
    survivor = 1 - victim
    assert codes[victim] == (faults.EXIT_CODE if injected else -9), report
    assert ended[survivor] is not None, f"the survivor did not exit within 240 s:\n{report}"
    assert codes[survivor] == 1 and "RuntimeError: zero_ext: " in outputs[survivor], report
    seconds = ended[survivor] - ended[victim]
    print(f"\n{kind}, rank {victim} killed: the survivor exited {seconds:.2f} s later")
    # The heartbeat's silence (5 s) and seconds of slack, never the 30-minute timeout.
    assert seconds < 15, f"the survivor exited {seconds:.1f} s after the victim:\n{report}"
    for trace in ("sendBytes", "recvValue", "Broken pipe", "Exception raised from", "frame #", "terminate called"):
        assert trace not in outputs[survivor], f"{trace!r} in the survivor's output:\n{report}"
    if kind == "nvme":
        assert os.listdir(tmp_path / "offload") == [], "offload files left behind"


@pytest.mark.parametrize("how", ["quiet", "plain"])
def test_the_quiet_store_raises_without_a_stack_trace(how, tmp_path):
    """What the asynchronous save's exchange calls the store through: once
    rank 0 (the store's host) died, a call raises zero_ext's error, and c10d's
    warning with its C++ stack trace is not printed. The control (torch's
    store object) shows what the quiet calls keep out."""
    ended, codes, outputs, report = _run_two_ranks(tmp_path, ["store-host-killed", how], deadline_s=120)
    assert codes == [-9, 0], report
    raised = [line for line in outputs[1].splitlines() if line.startswith("raised: ")]
    assert raised and raised[0] != "raised: nothing", report
    traced = any(t in outputs[1] for t in ("Exception raised from", "frame #", "Broken pipe"))
    if how == "quiet":
        assert raised[0].startswith("raised: RuntimeError: zero_ext: the store is unreachable"), report
        assert not traced, report
    else:
        assert traced, f"the control printed no stack trace: the quiet case proves nothing\n{report}"


def test_a_rank_that_raised_with_a_collective_in_flight_exits_at_once(tmp_path):
    """Two processes launched as torchrun would, but watched one by one (torchrun
    would end the survivor itself once rank 0 exits): rank 0 raises zero_ext's
    error and must end within seconds of it, not at the 30-minute timeout of
    the all-gather it left in flight; rank 1, in dist.barrier(), ends when
    rank 0's exit closes the connection. Neither aborts."""
    ended, codes, outputs, report = _run_two_ranks(tmp_path, ["evaluation-then-barrier"])
    assert None not in ended, f"a rank did not exit within 240 s:\n{report}"
    raised = [line for line in outputs[0].splitlines() if line.startswith("rank 0: raised at ")]
    assert raised, report
    raised_at = float(raised[0].split()[-1])
    assert codes[0] == 1, report
    assert "RuntimeError: zero_ext: " in outputs[0] and "not running this model" in outputs[0], report
    assert codes[1] == 1 and "unreachable" not in outputs[1], report
    for rank in range(2):
        assert ended[rank] - raised_at < 20, f"rank {rank} exited {ended[rank] - raised_at:.1f} s after rank 0 " \
                                             f"raised:\n{report}"
