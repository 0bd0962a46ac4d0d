"""Replicas that survive each other's failures, as users launch them: a
coordinator (python -m zero_ext.coordinator) and one torchrun job per
replica (tests/replica_job.py). One replica is killed mid-training (kill -9
of one of its ranks): the other goes on alone within seconds; started again,
the killed one joins from its peer and both end with the model one process
trains on the batches of the replicas that contributed to each step. A
replica wrapped differently is refused at join; a coordinator that dies
ends every replica with zero_ext's error (and one started again in time
lets training go on). In the jobs tier ([Note: the jobs tier] in conftest.py)."""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import zero_ext
from zero_ext.groups import coordinator_request as request

from dist_harness import free_port_pair

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(zero_ext.__file__)))
JOB = os.path.join(ROOT, "tests", "replica_job.py")
ENV = {**os.environ, "PYTHONPATH": PACKAGE_ROOT + os.pathsep + os.path.join(ROOT, "tests")}
LINE = re.compile(r"^step (\d+) contributors ([\w,]+) t=([\d.]+)$", re.M)


class Run:
    """The processes of one test, all killed at its end."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.procs = []

    def coordinator(self, port=None, *extra):
        port = port or free_port_pair()
        proc = subprocess.Popen([sys.executable, "-m", "zero_ext.coordinator", "--host", "127.0.0.1", "--port",
                                 str(port), "--dead-after", "2", *extra], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=ENV)
        self.procs.append(proc)
        line = proc.stdout.readline()
        assert "zero_ext coordinator" in line, (line, proc.stderr.read() if proc.wait(5) is not None else "")
        return f"127.0.0.1:{port}", proc

    def replica(self, address, rid, ranks=2, *extra, env=None):
        log = open(self.tmp / f"{rid}.log", "a")
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                                 "--master-port", str(free_port_pair()), JOB, "--coordinator", address,
                                 "--replica", rid,
                                 "--out", str(self.tmp / f"{rid}.pt"), *extra],
                                stdout=log, stderr=subprocess.STDOUT, env={**ENV, **(env or {})}, cwd=str(self.tmp))
        self.procs.append(proc)
        return proc

    def log(self, rid) -> str:
        path = self.tmp / f"{rid}.log"
        return path.read_text() if path.exists() else ""

    def steps(self, rid):
        return [(int(s), c.split(","), float(t)) for s, c, t in LINE.findall(self.log(rid))]

    def wait_for(self, what, condition, timeout=120):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if condition():
                return
            time.sleep(0.1)
        raise AssertionError(f"waited {timeout} s for {what}:\n" + "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in self.tmp.glob("*.log")))

    def b_joins_and_both_finish(self, address, a, common, gate) -> dict:
        """Replica b started again (2 ranks), a let past its hold once b is
        wrapped; both end, identical: a's saved state and status."""
        (self.tmp / "b.pt.wrapped").unlink()
        b = self.replica(address, "b", 2, *common)
        self.wait_for("b wrapped", lambda: (self.tmp / "b.pt.wrapped").exists())
        gate.write_text("go")
        assert a.wait(120) == 0, self.log("a")
        assert b.wait(120) == 0, self.log("b")
        saved_a, saved_b = (torch.load(self.tmp / f"{r}.pt", weights_only=True) for r in "ab")
        for name, value in saved_a["state"].items():
            assert torch.equal(value, saved_b["state"][name]), name  # b took a's state exactly
        return saved_a

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path)
    yield r
    r.close()


def _reference(contributed, steps):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    try:
        import replica_job
    finally:
        sys.path.pop(0)
    model, optimizer = replica_job.model_and_optimizer(0)
    for step in range(steps):
        ids = contributed[step]
        loss = sum(replica_job.loss_of(model, *replica_job.batch(rid, step)) for rid in ids) / len(ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _same(state, expected):
    # The same sums in another order (each replica's mean over its ranks,
    # then the mean over the contributors, against one process's mean of the
    # contributors' losses), over 12-16 AdamW steps at lr 1e-2 of weights
    # ~0.3: a few fp32 ulps, as the parity suite's fp32 tolerance.
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_killed_replica_is_left_out_then_joins_from_its_peer(run, tmp_path):
    steps = 16
    address, _ = run.coordinator(None, "--min-replicas", "2")
    gate = tmp_path / "gate"
    a = run.replica(address, "a", 2, "--steps", str(steps), "--step-sleep", "0.05", "--hold", f"9:{gate}")
    b = run.replica(address, "b", 2, "--steps", str(steps), "--step-sleep", "0.05", "--seed", "3")
    run.wait_for("both replicas at step 3", lambda: any(s >= 3 for s, _, _ in run.steps("b")))
    victim = int((tmp_path / "b.pt.pid1").read_text())
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    run.wait_for("replica a alone", lambda: any(c == ["a"] for _, c, _ in run.steps("a")))
    alone = next(t for _, c, t in run.steps("a") if c == ["a"])
    assert b.wait(60) != 0
    assert alone - killed_at < 2 + 10, "the survivor's next step came more than dead-after + 10 s after the kill"
    (tmp_path / "b.pt.wrapped").unlink()
    b = run.replica(address, "b", 2, "--steps", str(steps), "--step-sleep", "0.05", "--seed", "5")
    run.wait_for("b wrapped again", lambda: (tmp_path / "b.pt.wrapped").exists())
    gate.write_text("go")  # a asks for step 9's quorum now, b for its first: b joins from a
    assert a.wait(120) == 0, run.log("a")
    assert b.wait(120) == 0, run.log("b")
    saved_a, saved_b = torch.load(tmp_path / "a.pt", weights_only=True), torch.load(tmp_path / "b.pt",
                                                                                    weights_only=True)
    contributed = saved_a["status"]["contributed"]
    assert any(c == ["a"] for c in contributed.values()) and contributed[steps - 1] == ["a", "b"], contributed
    assert saved_b["status"]["step"] == saved_a["status"]["step"] == steps
    for name, value in saved_a["state"].items():
        assert torch.equal(value, saved_b["state"][name]), name  # the joined replica took a's state exactly
    _same(saved_a["state"], _reference(contributed, steps))


def test_a_replica_wrapped_differently_is_refused_at_join(run, tmp_path):
    address, _ = run.coordinator()
    a = run.replica(address, "a", 1, "--steps", "400", "--step-sleep", "0.02")
    run.wait_for("a training", lambda: len(run.steps("a")) >= 2)
    b = run.replica(address, "b", 1, "--steps", "4", "--width", "32")
    assert b.wait(120) != 0
    assert "wrapped differently" in run.log("b") and "parameters" in run.log("b"), run.log("b")
    assert a.poll() is None  # the refused one never got in: a goes on


def test_ranks_of_one_replica_that_name_different_replicas_end_in_zero_ext_error(run, tmp_path):
    """Rank 1 of a job passes another replica_id than rank 0: wrap() refuses
    on both ranks, naming the option, before any step."""
    address, _ = run.coordinator()
    a = run.replica(address, "a", 2, "--steps", "4", "--rank1-replica", "z")
    assert a.wait(120) != 0
    log = run.log("a")
    assert log.count("replicas=zero_ext.Replicas(") >= 2 and "different on rank 1" in log, log


def test_a_join_that_leaves_the_states_different_ends_every_rank_of_both_replicas(run, tmp_path):
    """Replica b joins from a, and one of its ranks ends up holding a value
    other than a's (a damaged transfer, standing in): the checksums differ, and
    every rank of both replicas ends with ReplicaMismatch, none trains on."""
    address, _ = run.coordinator()
    gate = tmp_path / "gate"
    a = run.replica(address, "a", 2, "--steps", "8", "--hold", f"3:{gate}")
    run.wait_for("a at its hold", lambda: len(run.steps("a")) >= 3)
    b = run.replica(address, "b", 2, "--steps", "8", "--seed", "5", env={"ZERO_EXT_TEST_FAULT": "replica_damaged:1"})
    run.wait_for("b wrapped", lambda: (tmp_path / "b.pt.wrapped").exists())
    gate.write_text("go")
    assert a.wait(120) != 0 and b.wait(120) != 0, (run.log("a"), run.log("b"))
    for rid in "ab":
        log = run.log(rid)
        assert log.count("ReplicaMismatch: zero_ext:") == 2 and "states differ" in log, log  # one per rank
        assert not re.search(r"^step [3-9]", log, re.M), log  # no step after the join


def test_a_dead_coordinator_ends_every_replica_and_one_started_again_lets_them_go_on(run, tmp_path):
    address, coordinator = run.coordinator()
    a = run.replica(address, "a", 1, "--steps", "400", "--step-sleep", "0.02", "--timeout", "4")
    run.wait_for("a training", lambda: len(run.steps("a")) >= 2)
    coordinator.kill()
    coordinator.wait()
    assert a.wait(60) != 0
    assert "did not answer for 4 s" in run.log("a"), run.log("a")
    port = int(address.rpartition(":")[2])
    address, coordinator = run.coordinator(port)
    a = run.replica(address, "a2", 1, "--steps", "400", "--step-sleep", "0.02", "--timeout", "8")
    run.wait_for("a2 training", lambda: len(run.steps("a2")) >= 2)
    coordinator.kill()
    coordinator.wait()
    seen = len(run.steps("a2"))
    run.coordinator(port)  # back within the replica's timeout: training goes on
    run.wait_for("a2 going on", lambda: len(run.steps("a2")) > seen + 2)


DEATHS = {  # where one rank of replica b dies at step 4: its job's options, or the fault point inside zero_ext
    "forward": (["--die-in", "forward", "--die-at", "4"], {}),
    "backward": (["--die-in", "backward", "--die-at", "4"], {}),
    "step": ([], {"ZERO_EXT_TEST_FAULT": "replica_average:1:4"}),
}


@pytest.mark.parametrize("where", list(DEATHS) + ["join"])
def test_a_rank_that_dies_anywhere_leaves_its_peers_training(run, tmp_path, where):
    """kill -9 of one rank of replica b mid-forward, mid-backward, inside the
    step's exchange, or while b joins again (then b is started a third
    time): a goes on alone, b joins, and both end with one process's model
    over the batches of each step's contributors."""
    steps = 12
    address, _ = run.coordinator(None, "--min-replicas", "2")
    gate = tmp_path / "gate"
    common = ["--steps", str(steps), "--step-sleep", "0.02"]
    a = run.replica(address, "a", 2, *common, "--hold", f"7:{gate}", "--hold", f"9:{tmp_path / 'gate2'}")
    extra, env = DEATHS.get(where, ([], {}))
    if where == "join":  # b dies at step 2 (forward), then again while joining
        extra = ["--die-in", "forward", "--die-at", "2"]
    b = run.replica(address, "b", 2, *common, *extra, env=env)
    assert b.wait(120) != 0
    run.wait_for("a alone", lambda: any(c == ["a"] for _, c, _ in run.steps("a")))
    if where == "join":
        (tmp_path / "b.pt.wrapped").unlink()
        b = run.replica(address, "b", 2, *common, env={"ZERO_EXT_TEST_FAULT": "replica_recover:1"})
        run.wait_for("b wrapped", lambda: (tmp_path / "b.pt.wrapped").exists())
        gate.write_text("go")
        assert b.wait(120) != 0
        gate = tmp_path / "gate2"  # a holds again before step 9
    else:
        (tmp_path / "gate2").write_text("go")
    saved_a = run.b_joins_and_both_finish(address, a, common, gate)
    contributed = saved_a["status"]["contributed"]
    assert any(c == ["a"] for c in contributed.values()), contributed
    _same(saved_a["state"], _reference(contributed, steps))


def test_a_stopped_replica_is_left_out_and_catches_up_when_it_wakes(run, tmp_path):
    """Three replicas of one rank each; c is stopped (SIGSTOP) for longer
    than the timeout: a and b go on without it, and c, woken (SIGCONT),
    takes their state and trains with them to the end."""
    steps = 30
    address, _ = run.coordinator(None, "--min-replicas", "3")
    common = ["--steps", str(steps), "--step-sleep", "0.1", "--timeout", "4"]
    procs = {r: run.replica(address, r, 1, *common) for r in "abc"}
    run.wait_for("c at step 3", lambda: any(s >= 3 for s, _, _ in run.steps("c")))
    stopped = int((tmp_path / "c.pt.pid0").read_text())
    os.kill(stopped, signal.SIGSTOP)
    run.wait_for("a and b alone", lambda: any(c == ["a", "b"] for _, c, _ in run.steps("a")))
    os.kill(stopped, signal.SIGCONT)
    for r, proc in procs.items():
        assert proc.wait(180) == 0, run.log(r)
    saved = {r: torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in "abc"}
    contributed = saved["a"]["status"]["contributed"]
    assert contributed[steps - 1] == ["a", "b", "c"], contributed
    for name, value in saved["a"]["state"].items():
        assert torch.equal(value, saved["b"]["state"][name]) and torch.equal(value, saved["c"]["state"][name]), name
    _same(saved["a"]["state"], _reference(contributed, steps))


SETTINGS = {  # wrap options of both replicas; whether one process's fp32 model is the reference
    "stage0": (["--stage", "0"], True),
    "stage1-offload": (["--stage", "1", "--offload-optimizer", "cpu"], True),
    "stage3": (["--stage", "3"], True),
    "stage2-bf16": (["--stage", "2", "--mixed-precision", "bf16"], False),
    "stage3-int8-grads": (["--stage", "3", "--compress-grads", "int8"], False),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_every_setting_survives_a_lost_replica_and_saves_as_today(run, tmp_path, setting):
    """Two replicas of two ranks at another stage, with mixed precision, the
    optimizer offloaded or compressed gradients: b killed at step 3 (mid
    forward), a alone, b back and joined; both end identical (and, exact
    settings, equal to one process); a checkpoint a live replica saved
    converts to its model."""
    options, exact = SETTINGS[setting]
    steps = 10
    address, _ = run.coordinator(None, "--min-replicas", "2")
    gate = tmp_path / "gate"
    common = ["--steps", str(steps), "--step-sleep", "0.02", *options]
    a = run.replica(address, "a", 2, *common, "--hold", f"6:{gate}", "--save", str(tmp_path / "ckpt"))
    b = run.replica(address, "b", 2, *common, "--die-in", "forward", "--die-at", "3")
    assert b.wait(120) != 0
    run.wait_for("a alone", lambda: any(c == ["a"] for _, c, _ in run.steps("a")))
    saved_a = run.b_joins_and_both_finish(address, a, common, gate)
    if exact:
        _same(saved_a["state"], _reference(saved_a["status"]["contributed"], steps))
    from zero_ext.convert import convert
    convert(str(tmp_path / "ckpt"), str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    for name, value in saved_a["state"].items():
        torch.testing.assert_close(whole[name].float(), value.float(), rtol=0, atol=0)
