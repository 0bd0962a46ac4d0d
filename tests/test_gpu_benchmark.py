"""benchmarks/gpu.py end to end on CPU (gloo), as the GPU check runs it:
spawned ranks and torchrun, the table's columns, zero_ext's own group even at
world size 1 (whose collectives over one rank are local copies), and the same
loss for every system. Timings are printed, never asserted."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--device", "cpu", "--models", "gpt2-10m", "--seq", "16", "--batch", "1", "--steps", "1",
         "--warmup", "1", "--system-timeout", "200"]


def run(cmd, out):
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=os.path.dirname(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(out) as f:
        report = json.load(f)
    assert os.path.exists(os.path.splitext(out)[0] + ".md")
    return report["results"]


def check_rows(rows, world):
    for row in rows:
        assert row["status"] == "ok", row
        assert row["world"] == world
        assert row["ms_per_step"] > 0 and row["tokens_per_s_total"] > 0
        assert row["forward_ms"] > 0 and row["backward_ms"] > 0 and row["optimizer_ms"] >= 0
        if row["system"].startswith("zero_ext"):
            assert row["collectives"] == ("gloo" if world > 1 else "local"), row  # its own group, even at world 1
    losses = [row["loss"] for row in rows]
    assert max(losses) - min(losses) < 1e-3, losses


def test_spawned_ranks_world_one(tmp_path):
    out = str(tmp_path / "gpu.json")
    rows = run([sys.executable, os.path.join(REPO, "benchmarks", "gpu.py"), *SMALL, "--world", "1",
                "--systems", "plain", "zero_ext-2", "--profile", "--out", out], out)
    assert [r["system"] for r in rows] == ["plain", "zero_ext-2"]
    check_rows(rows, world=1)
    # The profiled step: zero_ext's ranges are empty for plain, filled for zero_ext.
    plain, zero = (r["profiled_ms"] for r in rows)
    assert plain["hooks"] == plain["epilogue"] == plain["opt"] == 0.0
    assert zero["hooks"] > 0 and zero["epilogue"] > 0 and zero["opt"] > 0


def test_one_system_under_torchrun(tmp_path):
    out = str(tmp_path / "gpu.json")
    rows = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                os.path.join(REPO, "benchmarks", "gpu.py"), *SMALL, "--systems", "zero_ext-3", "--out", out], out)
    assert [r["system"] for r in rows] == ["zero_ext-3"]
    check_rows(rows, world=2)
