"""Publishing a save (zero_ext/files/checkpoint/publish.py): one atomic step, so that
`path` always names a whole save; zero_ext.checkpoint_exists says what
zero_ext.load would find; crashed saves' leftovers are removed by the next
save, and nothing else is.

- A torchrun job (2 gloo CPU ranks, --max-restarts) dies at every fault
  point of a save in turn, by exchange and without it, and each restart
  goes on from the last published save, decided by checkpoint_exists.
- In one process: every point where a save can die, the fallback for each
  way exchange can be unsupported, checkpoint_exists against load, and the
  look-alikes a clean-up must leave alone.
"""
from __future__ import annotations

import ctypes
import errno
import glob
import json
import os
import pathlib
import subprocess
import sys

import pytest

import zero_ext
from checkpoint_publish_scenarios import ATTEMPTS, PUBLISHED_BEFORE
from checkpoint_scenarios import make, train
from zero_ext.files.checkpoint import publish
from zero_ext.tools import faults

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


class Crash(BaseException):
    """Stands for the process dying at a fault point (nothing catches it)."""


def leftovers(path: str):
    return sorted(os.path.basename(p) for p in glob.glob(path + ".tmp-*") + glob.glob(path + ".old-*"))


def saved(path: str, tag: str, model=None, opt=None):
    if model is None:
        model, opt = make(2)
        train(model, opt, range(1), 0, 1)
    zero_ext.save(path, model, opt, extra={"tag": tag})
    return model, opt


def loaded(path: str) -> str:
    model, opt = make(2)
    return zero_ext.load(path, model, opt)["tag"]


def crash_at(monkeypatch, point: str, seen=None):
    """Makes the save die at `point`; `seen` gets (point, what load finds then) at every point reached."""
    def fake(name, rank):
        if seen is not None:
            seen.append((name, publish.checkpoint_exists(PATH[0]) and loaded(PATH[0])))
        if name == point:
            raise Crash(point)
    monkeypatch.setattr(faults, "exit_if_armed", fake)


PATH = [""]  # the checkpoint the fault-point spy asks about


def fake_renameat2(code: int):
    def renameat2(*args):
        ctypes.set_errno(code)  # what ctypes.get_errno reports after a foreign call
        return -1
    return renameat2


# --- the restarted job ----------------------------------------------------------

# What a save that died at each point leaves: is `ck` there, and which
# other directories (kind, holding metadata.json).
LEFT_BY = {
    "after_shards": (True, [("tmp", False)]),
    "before_publish": (True, [("tmp", True)]),
    "after_exchange": (True, [("tmp", True)]),  # the replaced save under the staging name
    "between_renames": (False, [("old", True), ("tmp", True)]),
    "after_renames": (True, [("old", True)]),
}


def _left(entries: dict):
    return sorted((n.rsplit(".", 1)[1][:3], e["metadata"]) for n, e in entries.items() if n != "ck")


def test_a_job_restarted_after_each_fault_point_resumes_from_its_last_save(tmp_path):
    """One torchrun job, --max-restarts: attempt k dies at ATTEMPTS[k] in
    its second save; the next attempt must find the last published save
    with checkpoint_exists (before init_process_group), load it (the very
    state that was saved) and go on from the step after it, never from step
    1; its first save leaves nothing but the checkpoint."""
    os.makedirs(tmp_path / "log")
    os.makedirs(tmp_path / "run")
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.pop(faults.VARIABLE, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(len(ATTEMPTS) - 1), "--monitor-interval", "0.1",
           os.path.join(TESTS, "checkpoint_publish_scenarios.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=TESTS, capture_output=True, text=True, timeout=300)
    log = tmp_path / "log"
    records = [json.loads((log / f"attempt-{k}.json").read_text()) if (log / f"attempt-{k}.json").exists()
               else None for k in range(len(ATTEMPTS))]
    assert proc.returncode == 0 and all(records), (
        f"torchrun exited {proc.returncode}; attempts recorded: {[r is not None for r in records]}\n"
        + proc.stdout[-3000:] + proc.stderr[-6000:])

    digests = {}  # step -> every digest recorded for the state after it
    for name in os.listdir(log):
        if name.startswith("state-"):
            digests.setdefault(int(name.split("-")[1]), set()).add((log / name).read_text())
    assert all(len(d) == 1 for d in digests.values()), f"a step trained again ended elsewhere: {digests}"

    published, died_at = 0, None
    for k, ((fault, exchange), seen) in enumerate(zip(ATTEMPTS, records)):
        where = f"attempt {k}" + (f", restarted after a save died at {died_at}" if died_at else "")
        if died_at:
            point = died_at.split(":")[0]
            ck_there, left = LEFT_BY.get(point, (True, [("tmp" if records[k - 1]["exchange"] else "old", False)]))
            entries = seen["entries"]
            assert ("ck" in entries) == ck_there, f"{where}: {entries}"
            if point != "after_shards":  # rank 1 may die before rank 0 wrote the marker or its files
                assert _left(entries) == left, f"{where}: {entries}"
                assert all(e["marker"] for n, e in entries.items() if n != "ck"), f"{where}: {entries}"
            assert seen["legacy_exists"] == ck_there, where
        assert seen["exists"] == (k > 0), f"{where}: checkpoint_exists said {seen['exists']}"
        assert seen["first_step"] == published + 1, f"{where}: went on from step {seen['first_step']}, " \
            f"the last published save is of step {published}"
        if published:
            assert {seen["loaded_digest"]} == digests[published], f"{where}: loaded another state"
        assert list(seen["after_first_save"]) == ["ck"], f"{where}: its first save left {seen['after_first_save']}"
        if fault:
            assert not seen.get("survived"), f"{where}: the save meant to die at {fault} completed"
            published = seen["first_step"] + (1 if fault.split(":")[0] in PUBLISHED_BEFORE else 0)
        died_at = fault
    assert list(records[-1]["done"]) == ["ck"]
    after_gap = records[1 + [f for f, _ in ATTEMPTS].index("between_renames:0")]
    assert after_gap["exists"] and not after_gap["legacy_exists"], \
        "after a crash between the two renames only checkpoint_exists, not metadata.json's presence, finds the save"


# --- in one process ---------------------------------------------------------------

def test_exchange_swaps_two_directories_here(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "from-a").touch()
    if not publish._exchange(str(a), str(b)):
        pytest.skip("this OS or filesystem cannot exchange (renameat2 RENAME_EXCHANGE)")
    assert os.listdir(b) == ["from-a"] and os.listdir(a) == []


def test_publishing_replaces_the_checkpoint_with_no_moment_without_one(tmp_path, monkeypatch):
    path = PATH[0] = str(tmp_path / "ck")
    model, opt = saved(path, "first")
    exchanged = []
    real = publish._exchange
    monkeypatch.setattr(publish, "_exchange", lambda a, b: exchanged.append(real(a, b)) or exchanged[-1])
    seen = []
    crash_at(monkeypatch, "", seen)
    saved(path, "second", model, opt)
    if exchanged != [True]:
        pytest.skip("this filesystem cannot exchange")
    assert seen == [("after_shards", "first"), ("before_publish", "first"), ("after_exchange", "second"),
                    ("removing_old", "second")]
    assert loaded(path) == "second" and leftovers(path) == []


@pytest.mark.parametrize("how", ["no-symbol", "ENOSYS", "EINVAL", "EOPNOTSUPP", "env"])
def test_without_exchange_two_renames_publish_and_a_crash_between_them_is_safe(how, tmp_path, monkeypatch):
    if how == "env":
        monkeypatch.setenv(faults.VARIABLE, faults.spec("no_exchange"))
    else:
        monkeypatch.setattr(publish, "_libc_renameat2",
                            lambda: None if how == "no-symbol" else fake_renameat2(getattr(errno, how)))
    path = PATH[0] = str(tmp_path / "ck")
    model, opt = saved(path, "first")
    seen = []
    crash_at(monkeypatch, "", seen)
    saved(path, "second", model, opt)
    assert seen == [("after_shards", "first"), ("before_publish", "first"), ("between_renames", "first"),
                    ("after_renames", "second"), ("removing_old", "second")]
    assert loaded(path) == "second" and leftovers(path) == []
    crash_at(monkeypatch, "between_renames")
    with pytest.raises(Crash):
        saved(path, "third", model, opt)
    assert not os.path.exists(path) and publish.checkpoint_exists(path) and loaded(path) == "second"
    crash_at(monkeypatch, "")
    saved(path, "fourth", model, opt)
    assert loaded(path) == "fourth" and leftovers(path) == []


def test_an_exchange_failing_otherwise_fails_the_save_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    model, opt = saved(path, "first")
    monkeypatch.setattr(publish, "_libc_renameat2", lambda: fake_renameat2(errno.EACCES))
    with pytest.raises(RuntimeError, match="renameat2.*Nothing was published"):
        saved(path, "second", model, opt)
    assert loaded(path) == "first" and leftovers(path) == []


# Where a save dies, and what load finds after it (by exchange; without).
POINTS = [("after_shards", "first"), ("before_publish", "first"), ("after_exchange", "second"),
          ("removing_old", "second"), ("between_renames", "first"), ("after_renames", "second")]


@pytest.mark.parametrize("point,left", POINTS)
def test_a_save_that_dies_anywhere_leaves_one_whole_save_and_the_next_save_cleans_up(point, left, tmp_path,
                                                                                      monkeypatch):
    if point in ("between_renames", "after_renames"):
        monkeypatch.setenv(faults.VARIABLE, faults.spec("no_exchange"))
    path = str(tmp_path / "ck")
    model, opt = saved(path, "first")
    if point == "after_exchange":
        os.remove(os.path.join(path, publish.STAGING_MARKER))  # a checkpoint from before markers
    crash_at(monkeypatch, point)
    with pytest.raises(Crash):
        saved(path, "second", model, opt)
    assert leftovers(path), "the crash should leave something to clean up"
    assert publish.checkpoint_exists(path) and loaded(path) == left
    crash_at(monkeypatch, "")
    saved(path, "third", model, opt)
    assert loaded(path) == "third" and leftovers(path) == []


def test_checkpoint_exists_answers_what_load_finds(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    assert not publish.checkpoint_exists(path)
    crash_at(monkeypatch, "before_publish")
    with pytest.raises(Crash):
        saved(path, "staged only")
    assert leftovers(path) and glob.glob(path + ".tmp-*/metadata.json")  # staged whole, never published
    assert not zero_ext.checkpoint_exists(path)
    with pytest.raises(FileNotFoundError, match="only unfinished saves"):
        loaded(path)

    crash_at(monkeypatch, "")
    saved(path, "aside")
    os.rename(path, path + ".old-0123456789ab")  # only a save set aside remains
    assert zero_ext.checkpoint_exists(path) and loaded(path) == "aside"
    assert zero_ext.checkpoint_exists(pathlib.Path(path)) and zero_ext.checkpoint_exists(path + "/")
    os.rename(path + ".old-0123456789ab", path)
    monkeypatch.chdir(tmp_path)
    assert zero_ext.checkpoint_exists("ck") and loaded("ck") == "aside"

    meta = os.path.join(path, "metadata.json")
    os.rename(meta, meta + ".kept")
    assert not zero_ext.checkpoint_exists(path)  # load reads `path` and finds no metadata
    with pytest.raises(RuntimeError, match="metadata.json is missing"):
        loaded(path)
    os.symlink(meta + ".kept", meta)
    assert not zero_ext.checkpoint_exists(path)
    with pytest.raises(ValueError, match="metadata.json"):
        loaded(path)
    os.remove(meta)
    with open(meta, "w") as f:
        f.write("{ damaged")
    assert zero_ext.checkpoint_exists(path)  # a damaged save is not "no save": load says what is wrong
    with pytest.raises(ValueError, match="metadata.json"):
        loaded(path)


def test_only_zero_ext_leftovers_are_removed(tmp_path):
    path = str(tmp_path / "ck")
    model, opt = saved(path, "first")

    def make_dir(name, marker=False, metadata=None, other=True):
        d = tmp_path / name
        d.mkdir()
        if marker:
            (d / publish.STAGING_MARKER).write_text("0" * 32)
        if metadata is not None:
            (d / "metadata.json").write_text(metadata)
        if other:
            (d / "rank0.bin").write_bytes(b"x")
        return d

    ours = json.dumps({"format": "zero_ext-checkpoint", "version": 3})
    removed = [make_dir("ck.tmp-0123456789ab", marker=True), make_dir("ck.tmp-aaaaaaaaaaaa", marker=True, other=False),
               make_dir("ck.old-bbbbbbbbbbbb", metadata=ours), make_dir("ck.old-cccccccccccc", marker=True),
               make_dir("ck.tmp-dddddddddddd", metadata=ours)]  # a checkpoint from before markers, exchanged out
    kept = [make_dir("ck.tmp-eeeeeeeeeeee"),  # no marker
            make_dir("ck.old-ffffffffffff", metadata=json.dumps({"format": "another-tool"})),
            make_dir("ck.old-121212121212", metadata="not json"),
            make_dir("ck.tmp-ABCDEF012345", marker=True), make_dir("ck.tmp-0123456789a", marker=True),
            make_dir("ck.tmp-0123456789abc", marker=True), make_dir("ck.tmp-notahexvalue", marker=True),
            make_dir("ck.bak-0123456789ab", marker=True), make_dir("ck2.tmp-0123456789ab", marker=True),
            make_dir("xck.tmp-0123456789ab", marker=True), make_dir("elsewhere", marker=True)]
    (tmp_path / "ck.tmp-343434343434").write_bytes(b"a file")
    os.symlink(tmp_path / "elsewhere", tmp_path / "ck.tmp-565656565656")  # a link to a marked directory
    linked = make_dir("ck.tmp-787878787878")
    os.symlink(tmp_path / "elsewhere" / publish.STAGING_MARKER, linked / publish.STAGING_MARKER)
    kept += [tmp_path / "ck.tmp-343434343434", tmp_path / "ck.tmp-565656565656", linked]
    before = {p: sorted(os.listdir(p)) if p.is_dir() else p.read_bytes() for p in kept}

    saved(path, "second", model, opt)
    assert not [p for p in removed if os.path.lexists(p)]
    assert {p: sorted(os.listdir(p)) if p.is_dir() else p.read_bytes() for p in kept} == before
    assert loaded(path) == "second"
