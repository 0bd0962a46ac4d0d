"""benchmarks/compare.py end to end on a tiny model: the table's exact columns.

Model-state bytes and bytes sent are exact properties (not timings), so they
are asserted: zero_ext holds what the ZeRO formula says at stages 0, 2 and 3,
and sends what its collectives should on gloo.
"""
import json
import os
import statistics
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    # Two warm-up steps: the profiled step is then in steady state, where
    # zero_ext issues every collective on the training thread at once (in its
    # first steps a collective may wait for its sequence-check header and go
    # out from a gloo thread, which the profiler does not attribute).
    out = str(tmp_path_factory.mktemp("compare") / "cmp")
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "compare.py"), "--systems", "ddp", "zero_ext-0",
           "zero_ext-1", "zero_ext-2", "zero_ext-3", "--steps", "1", "--warmup", "2", "--seq", "16", "--batch", "1", "--model", "gpt2-tiny",
           "--out", out, "--system-timeout", "120", "--verbose"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(out + ".json") as f:
        return json.load(f)


def test_every_system_ran_and_agrees_on_the_loss(table):
    results = table["results"]
    assert all("error" not in r for r in results.values()), results
    reference = results["ddp"]["losses"]
    for system, r in results.items():
        assert r["losses"] == pytest.approx(reference, rel=1e-5), system


@pytest.mark.parametrize("system", ["ddp", "zero_ext-0", "zero_ext-2", "zero_ext-3"])
def test_model_state_bytes_match_the_zero_formula(table, system):
    r = table["results"][system]
    assert r["state_vs_formula"] == pytest.approx(1.0, abs=0.02), r["state_breakdown_rank0"]


@pytest.mark.parametrize("system", ["ddp", "zero_ext-0", "zero_ext-1", "zero_ext-2"])
def test_bytes_sent_are_the_theoretical_volume(table, system):
    """Stages 1 and 2 reduce-scatter by exchange on gloo, then all-gather the
    updated shards: 2(N-1)/N x 4P, DDP's all-reduce (stage 1 sent 3(N-1)/N x
    4P while it all-reduced its full staging in place)."""
    r = table["results"][system]
    assert r["sent_bytes"] == pytest.approx(r["theory_sent_bytes"], rel=1e-3), r["sent_by_kind_rank0"]


def stage3_exact_sent_bytes(model_name: str, world: int) -> dict:
    """Bytes a rank sends in one steady-state step of zero_ext-3 on gloo (fp32,
    one backward), by the profiler's kinds, from the model's unit plan (the
    default policy at compare.py's bucket_mb; stage 3 has one bucket per unit,
    padded to a multiple of the world size, csrc/layout.cpp):
      all_to_all: the gathers, every unit in forward and every unit but the
        root again before its backward (the root stays gathered from forward
        to backward), and each unit's bucket reduced once; on gloo both are
        all-to-alls (csrc/exchange_all_gather.h, exchange_reduce_scatter.h),
        so the profiler sees their sum;
      all_reduce: the one rank-agreement exchange per backward
        (csrc/rank_agreement.cpp: a float per parameter, the late and
        non-finite flags, and per rank a row of 5 (step, synced and deferred
        backwards, the trainable count and hash) + one per unit).
    The collective checks' sequence headers (int64 all-gathers) are not data:
    compare.py counts them apart (header_bytes), so they are not here."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from _models import build_model
    from compare import BUCKET_MB
    from zero_ext.wrapping.units import assign_parameters, merge_bytes, resolve_units

    model = build_model(model_name)
    units = resolve_units(model, None, min_bytes=merge_bytes(int(BUCKET_MB * 2 ** 20)))
    owner = assign_parameters(model, units)
    numel = [0] * len(units)
    params = list(model.parameters())  # tied weights once, as zero_ext holds them
    for p in params:
        numel[owner[id(p)]] += p.numel()
    padded = [-(-n // world) * world for n in numel]
    f = 4.0 * (world - 1) / world  # bytes sent per element of a full-size fp32 buffer (all-gather, reduce-scatter)
    agreement = len(params) + 2 + world * (5 + len(units))
    return {"all_to_all": f * (sum(padded) + sum(padded[1:])) + f * sum(padded),
            "all_reduce": 2 * f * agreement,
            "units": len(units)}


def test_stage3_sends_two_gathers_but_one_of_the_root_and_one_reduction(table):
    # Exact: every count is an integer number of fp32 elements times (N-1)/N
    # or 2(N-1)/N, so the measured bytes equal the theory up to float
    # rounding (abs 1 byte); a unit gathered once too often or too few, the
    # root regathered, an extra or missing reduction are each >= 4 * (N-1)/N
    # bytes per element of a parameter bucket, far beyond it.
    r = table["results"]["zero_ext-3"]
    exact = stage3_exact_sent_bytes(table["args"]["model"], table["args"]["world"])
    assert exact["units"] >= 2  # a root and a unit: the backward regather is exercised
    got = r["sent_by_kind_rank0"]
    assert set(got) == {"all_to_all", "all_reduce"}, got
    for kind in ("all_to_all", "all_reduce"):
        assert got[kind] == pytest.approx(exact[kind], abs=1.0), (kind, got, exact)
    total = exact["all_to_all"] + exact["all_reduce"]
    assert r["sent_bytes"] == pytest.approx(total, abs=1.0), (r["sent_bytes"], exact)
    # The ZeRO-3 figure counts the root's backward gather, which zero_ext saves.
    assert r["sent_bytes"] < r["theory_sent_bytes"]


@pytest.fixture(scope="module")
def hybrid_table(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("compare") / "hybrid")
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "compare.py"), "--world", "4", "--systems",
           "zero_ext-2", "zero_ext-2-2x2", "zero_ext-0-2x2", "--steps", "1", "--warmup", "0", "--seq", "16",
           "--batch", "1", "--model", "gpt2-tiny", "--out", out, "--system-timeout", "120", "--verbose"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "within row" in done.stdout and "across replicas" in done.stdout, done.stdout
    with open(out + ".json") as f:
        return json.load(f)


@pytest.mark.parametrize("system", ["zero_ext-2", "zero_ext-2-2x2", "zero_ext-0-2x2"])
def test_hybrid_bytes_sent_by_group_and_state_follow_the_shard_size(hybrid_table, system):
    """World 4 as 2x2: state per the ZeRO formula with N = 2, and the bytes
    within the row and across replicas are the theory's (flat: all within)."""
    r = hybrid_table["results"][system]
    assert "error" not in r, r
    assert r["state_vs_formula"] == pytest.approx(1.0, abs=0.02), r["state_breakdown_rank0"]
    got, want = r["sent_by_group"]["measured"], r["sent_by_group"]["theory"]
    for group in ("within_row", "across_replicas"):
        assert got[group] == pytest.approx(want[group], rel=1e-3, abs=1.0), (group, got, want)
    assert (got["across_replicas"] > 0) == system.endswith("2x2")
    losses = {s: v["losses"] for s, v in hybrid_table["results"].items()}
    assert r["losses"] == pytest.approx(losses["zero_ext-2"], rel=1e-5)


@pytest.mark.parametrize("script, systems, extra", [
    ("step_time.py", ["ddp", "zero_ext-2", "zero_ext-3-keep"], []),
    ("phases.py", ["ddp", "zero_ext-0", "zero_ext-3"], ["--ranges"]),
    ("phases.py", ["ddp", "fsdp2-s2", "fsdp2", "zero_ext-3"], ["--model", "small-blocks", "--blocks", "12"]),
    ("user_loop.py", ["ddp", "zero_ext-1", "zero_ext-2-unchecked", "fsdp2"], ["--model", "tinygpt", "--vocab", "256"]),
    ("user_loop.py", ["ddp", "zero_ext-3"], ["--builtin", "--vocab", "512", "--context", "16"]),
])
def test_table_scripts_print_a_row_per_system(script, systems, extra):
    """step_time.py, phases.py and user_loop.py end to end on a tiny model
    (world 2): every system trains and gets its row (timings are not checked)."""
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", script), "--world", "2", "--systems", *systems,
           "--layers", "1", "--dim", "32", "--steps", "1", "--warmup", "1", *extra]
    cmd += ["--rounds", "1"] if script != "step_time.py" else []
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split()[0] for line in done.stdout.splitlines() if line.split() and line.split()[0] in systems]
    assert rows == systems, done.stdout
    if script == "step_time.py":  # the same model and batches: the same loss everywhere
        losses = {line.split()[6] for line in done.stdout.splitlines() if line.split()[:1] and line.split()[0] in systems}
        assert len(losses) == 1, done.stdout


def test_resident_memory_prints_where_each_systems_memory_is():
    """benchmarks/resident_memory.py end to end (world 2, a tiny model): a row
    per system, the heap's figures read, zero_ext's blocks counted for
    zero_ext and not for DDP, the highest RSS at least the end of forward's."""
    systems = ["ddp", "zero_ext-3"]
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "resident_memory.py"), "--model", "gpt2-tiny",
           "--systems", *systems, "--steps", "2", "--warmup", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {cells[0]: cells[1:] for cells in map(str.split, done.stdout.splitlines()) if cells and cells[0] in systems}
    assert set(rows) == set(systems), done.stdout
    assert rows["ddp"][3:5] == ["-", "-"], done.stdout
    for system in systems:
        heap_in_use, rss_end_of_forward, rss_highest = float(rows[system][0]), float(rows[system][5]), float(rows[system][6])
        assert heap_in_use > 0 and 0 < rss_end_of_forward <= rss_highest + 1, done.stdout
    float(rows["zero_ext-3"][3]), float(rows["zero_ext-3"][4])


@pytest.mark.parametrize("script, extra", [("step_time.py", []),
                                           ("user_loop.py", ["--model", "tinygpt", "--vocab", "256", "--rounds", "2"])])
def test_fresh_mode_runs_every_system_on_new_ranks_interleaved(script, extra, tmp_path):
    """--fresh 2 (benchmarks/_fresh.py): each run is a new group of
    processes, the systems take their runs in turn, every run times
    --warmup + its timed steps, and the table and the JSON agree."""
    systems = ["ddp", "zero_ext-3"]
    out = tmp_path / "fresh.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", script), "--world", "2", "--systems", *systems,
           "--layers", "1", "--dim", "32", "--steps", "1", "--warmup", "1", "--fresh", "2", "--json", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    order = [line.split()[1:3] for line in done.stderr.splitlines() if line.startswith("run ")]
    assert order == [["1/2", "ddp:"], ["1/2", "zero_ext-3:"], ["2/2", "ddp:"], ["2/2", "zero_ext-3:"]], done.stderr
    table = json.loads(out.read_text())
    runs = table["runs"]
    pids = [pid for system in systems for run in runs[system] for pid in run["pids"]]
    assert len(pids) == len(set(pids)) == 2 * 2 * 2, pids
    timed = 1 if script == "step_time.py" else 2
    rows = {cells[0]: cells for cells in map(str.split, done.stdout.splitlines()) if cells and cells[0] in systems}
    for system in systems:
        assert [len(run["steps_ms"]) for run in runs[system]] == [1 + timed] * 2
        assert [run["first_ms"] for run in runs[system]] == [run["steps_ms"][0] for run in runs[system]]
        medians = sorted(run["median_ms"] for run in runs[system])
        assert table["summary"][system]["median_ms"] == [medians[0], statistics.median(medians), medians[-1]]
        assert float(rows[system][1]) == pytest.approx(statistics.median(medians), abs=0.05)
        assert all(run["peak_rss"] > 0 for run in runs[system])


def test_the_offload_step_benchmark_moves_what_the_step_must(tmp_path):
    """benchmarks/offload_step.py on a tiny model: the table prints, and the
    bytes the files moved per step are what a streamed AdamW step must move
    (counts, not timings): the gradient, the value and the two moments
    written once (4 x the values' bytes, the training state); the gradient
    and the two moments read by the step, and each value read for the
    forward, the backward and the step unless it was still in memory (its
    write behind not done yet when it was wanted again): 3 to 6 x."""
    import re
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "offload_step.py"), "--path", str(tmp_path), "--blocks",
           "4", "--width", "256", "--rounds", "1", "--steps", "2", "--io-mib", "16"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| nvme |" in done.stdout and "nvme step / bound =" in done.stdout, done.stdout
    read, written = (float(v) for v in re.search(r"read ([\d.]+) MiB, written ([\d.]+) MiB", done.stdout).groups())
    state = float(re.search(r"training state \(fp32 values, gradients, 2 moments\) ([\d.]+) MiB", done.stdout).group(1))
    assert written == pytest.approx(state, rel=0.05), done.stdout
    assert 0.75 * written * 0.95 <= read <= 1.5 * written * 1.05, done.stdout


def test_pipeline_step_times_every_schedule_for_both_systems():
    """benchmarks/pipeline_step.py end to end on a tiny model (pp 2 x dp 2):
    a row per schedule (GPipe, 1F1B, interleaved 1F1B) and system (zero_ext,
    FSDP2 per stage), none failed, each with its step times and bubble."""
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "pipeline_step.py"), "--dim", "32", "--layers", "4",
           "--vocab", "64", "--context", "8", "--rounds", "1", "--warmup", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| Schedule")]
    assert len(rows) == 6, done.stdout
    for row in rows:
        assert "error" not in row and row.rstrip().endswith("% |") and row.count("%") == 2, row


def test_replicas_benchmark_prints_the_three_measurements():
    """benchmarks/replicas.py end to end on a tiny model: a row per system
    (hybrid, replicas), the overhead line, and a kill/join row."""
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "replicas.py"), "--model", "gpt2-tiny", "--runs", "1",
           "--steps", "4", "--dead-after", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| system")]
    assert any(r.startswith("| hybrid") for r in rows) and any(r.startswith("| 2 replicas") for r in rows), done.stdout
    assert "fault tolerance when nothing fails" in done.stdout
    assert any(r.startswith("| 1 |") for r in rows), done.stdout
