"""Checkpoints that can be trusted: loading runs no code from the files and
reads nothing outside the directory; crafted metadata is refused before a
byte is read; loading is strict; a save is one collective decision whose
failure on any rank reaches every rank at once; a load never mixes two saves;
zero-size and one-element parameters round-trip.

A checkpoint remembers its optimizers' classes and loads into another only
when asked.

The rank-side halves are in checkpoint_trust_scenarios.py: three groups of
spawned ranks (world 1, world 2, world 1 again, each reusing the previous
one's checkpoints), every case an item that fails alone.
"""
import os

import pytest

from async_snapshot_scenarios import CASES as SNAPSHOT_CASES
from checkpoint_trust_scenarios import META_CASES
from dcp_trust_scenarios import WORLD1_CASES as DCP_WORLD1, WORLD2_CASES as DCP_WORLD2
from dist_harness import run_items_on_ranks

TARGET = "checkpoint_trust_scenarios"
FAST = 10.0  # seconds: an error must reach every rank well within the 30 s timeout

FIRST_ITEMS = ([f"meta:{c}" for c in META_CASES]
               + [f"evil:{t}" for t in ("extra-rank0.pt", "buffers.pt", "optimizer.pt", "convert")]
               + ["extra-kinds", "strict"]
               + [f"mixed:{n}" for n in ("rank0.bin", "buffers.pt", "optimizer.pt", "extra-rank0.pt")]
               + [f"race:{k}" for k in (1, 2, 3)]
               + ["zero-size-save", "optimizer-class"] + [f"dcp:{c}" for c in DCP_WORLD1])
WORLD2_ITEMS = ["paths-differ", "regular-file", "symlink", "not-a-checkpoint", "bad-extra-rank1",
                "fail-shards-rank1", "fail-fsync-rank1", "fail-metadata-rank0", "fail-rename-rank0",
                "file-vanishes-rank1", "extra-rule", "ranks-open-different-saves", "zero-size-load-from-w1",
                "zero-size-save",
                "zero-size-load-from-w2", "optimizer-class", "scalar-per-slice",
                "loose-inputs-rank1"] + [f"dcp:{c}" for c in DCP_WORLD2] + [f"snapshot:{c}" for c in SNAPSHOT_CASES]
LAST_ITEMS = ["zero-size-load-from-w1", "zero-size-load-from-w2", "zero-size-convert"]


def _run(world, function, cases, root):
    outcome = run_items_on_ranks(world, f"{TARGET}:{function}", [(c, root) for c in cases], item_deadline_s=90)
    return {case: outcome[(case, root)] for case in cases}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("trust"))


@pytest.fixture(scope="module")
def first(root):
    return _run(1, "first_world1", FIRST_ITEMS, root)


@pytest.fixture(scope="module")
def world2(root, first):  # uses the first group's checkpoints
    return _run(2, "world2", WORLD2_ITEMS, root)


@pytest.fixture(scope="module")
def last(root, world2):  # uses the world-2 checkpoints
    return _run(1, "last_world1", LAST_ITEMS, root)


def ranks(results, case):
    got = results[case]
    assert isinstance(got, list), f"{case}: a rank crashed or hung:\n{got}"
    return got


def refused(outcome, kinds, *words):
    assert outcome["error"] in kinds, outcome
    for word in words:
        assert word in outcome["message"], (word, outcome["message"])


# 1 -------------------------------------------------------------------------

def test_checkpoint_files_are_never_unpickled_and_extra_is_checked_at_save(first, world2):
    for target in ("extra-rank0.pt", "buffers.pt", "optimizer.pt", "convert"):
        got = ranks(first, f"evil:{target}")[0]
        assert not got["marker"], f"{target}: loading ran code from the checkpoint"
        refused(got, ("ValueError", "RuntimeError"), "zero_ext.convert:" if target == "convert" else "zero_ext.load:")

    kinds = ranks(first, "extra-kinds")[0]
    assert kinds["round_trip"], "scheduler state, RNG state and plain data must round-trip"
    refused(kinds["refused"], ("ValueError", "TypeError"), "zero_ext.save:", "'obj'", "weights_only")
    assert not kinds["written"], "a refused extra must be refused before anything is written"

    # Collective: rank 1's bad extra stops rank 0 too, at once, before any write.
    for rank, got in enumerate(ranks(world2, "bad-extra-rank1")):
        refused(got, ("ValueError", "TypeError"), "zero_ext.save:", "'obj'", "rank 1")
        assert got["seconds"] < FAST, (rank, got)
        assert got["entries"] == [], (rank, got["entries"])


# 2 -------------------------------------------------------------------------

FIELDS = {
    "traversal": ["file", "../secret.bin"], "absolute": ["file", "secret.bin"],
    "proc": ["file", "/proc/self/environ"], "symlink": ["rank0.bin", "link"],
    "negative-offset": ["offset"], "huge-offset": ["offset"], "huge-length": ["length"],
    "unknown-dtype": ["dtype", "torch.complex64"], "lying-dtype": ["dtype"], "missing-key": ["offset"],
    "wrong-type": ["start"], "not-a-dict": ["object"], "deep": ["JSON"], "overlap": ["overlap"],
    "gap": ["lin.weight"], "unknown-file": ["evil.sh"],
    "bad-optimizer-class": ["optimizer_classes[0]", "qualified class name"],
    "no-optimizer-classes": ["optimizer_classes", "missing"], "newer-version": ["version 6", "newer zero_ext"],
    "older-version": ["version 2", "reads versions 3 to 5"],
}


@pytest.mark.parametrize("case", META_CASES)
def test_crafted_metadata_is_refused_before_any_byte_is_read(case, first):
    got = ranks(first, f"meta:{case}")[0]
    named = os.path.dirname(got["metadata"]) if case == "symlink" else got["metadata"]
    refused(got["load"], ("ValueError",), "zero_ext.load:", named, *FIELDS[case])
    refused(got["convert"], ("ValueError",), "zero_ext.convert:", named, *FIELDS[case])
    assert got["model_unchanged"], "nothing may be loaded from a refused checkpoint"
    assert not got["secret_in_model"] and not got["secret_in_output"], "a file outside the checkpoint was read"


# 3 -------------------------------------------------------------------------

def test_loading_is_strict_by_default(first, world2):
    got = ranks(first, "strict")[0]
    refused(got["buffer-shape"], ("RuntimeError",), "zero_ext.load:", "scale", "(1,)", "(4,)")
    refused(got["buffer-shape-nonstrict"], ("RuntimeError",), "scale")
    refused(got["buffer-missing"], ("RuntimeError",), "count", "strict=False")
    assert got["buffer-missing-nonstrict"]["error"] is None, got["buffer-missing-nonstrict"]
    assert got["buffer-missing-nonstrict-kept"] and got["buffer-missing-nonstrict-loaded"]
    refused(got["buffer-unexpected"], ("RuntimeError",), "scale")
    assert got["buffer-unexpected-nonstrict"]["error"] is None, got["buffer-unexpected-nonstrict"]
    refused(got["param-missing"], ("RuntimeError",), "more.weight")
    assert got["param-missing-nonstrict"]["error"] is None, got["param-missing-nonstrict"]
    assert got["param-missing-nonstrict-loaded"]
    refused(got["param-unexpected"], ("RuntimeError",), "more.weight")
    assert got["param-unexpected-nonstrict"]["error"] is None, got["param-unexpected-nonstrict"]
    refused(got["param-shape-nonstrict"], ("RuntimeError",), "lin.weight")
    refused(got["extra-missing"], ("RuntimeError",), "zero_ext.load:", "extra-rank0.pt")

    for rank, got in enumerate(ranks(world2, "extra-rule")):
        # The writer had rank 1 but its extra is gone: every rank refuses.
        refused(got["missing"], ("RuntimeError",), "extra-rank1.pt")
        # The writer had one rank: rank 1 gets rank 0's extra (documented).
        assert got["fewer-writers"]["error"] is None and got["fewer-writers"]["value"] == {"step": 1}, got


# 4 -------------------------------------------------------------------------

def test_save_is_one_collective_decision(world2):
    for case, words, entries in [
        ("paths-differ", ["ckpt-0", "ckpt-1", "same path"], []),
        ("regular-file", ["regular file"], ["ckpt"]),
        ("symlink", ["symbolic link"], ["ckpt", "real"]),
        ("not-a-checkpoint", ["not a zero_ext checkpoint"], ["ckpt"]),
    ]:
        for rank, got in enumerate(ranks(world2, case)):
            refused(got, ("ValueError",), "zero_ext.save:", *words)
            assert got["seconds"] < FAST, (case, rank, got)
            assert got["entries"] == entries, (case, rank, got["entries"])
            assert got.get("kept", True), (case, rank, "the existing path was changed")

    for case, words in [
        ("fail-shards-rank1", ["rank 1", "planted fail-shards-rank1"]),
        ("fail-fsync-rank1", ["rank 1", "planted fail-fsync-rank1"]),
        ("fail-metadata-rank0", ["rank 0", "planted fail-metadata-rank0"]),
        ("fail-rename-rank0", ["rank 0", "planted fail-rename-rank0"]),
        ("file-vanishes-rank1", ["rank1.bin"]),
    ]:
        for rank, got in enumerate(ranks(world2, case)):
            refused(got, ("RuntimeError",), "zero_ext.save:", *words)
            assert got["seconds"] < FAST, (case, rank, got["seconds"])
            assert got["litter"] == [], (case, rank, got["litter"])
            assert got["previous"]["error"] is None and got["previous"]["value"] == "first", (case, rank, got)


def test_an_option_one_rank_passes_loosely_is_refused_on_every_rank(world2):
    """Issue 54: save and load check their options in their first phase, so
    rank 1's loose option (bool("yes") would be True; a dcp_layout without
    format="dcp" would be ignored; load takes no format) stops every rank
    with zero_ext's error naming it, fast, with nothing written or loaded."""
    for rank, got in enumerate(ranks(world2, "loose-inputs-rank1")):
        for call, kind, words in [
            ("async_save", "TypeError", ["zero_ext.save:", "async_save must be True or False", "'yes'"]),
            ("dcp_layout", "ValueError", ["zero_ext.save:", 'dcp_layout applies to format="dcp" only']),
            ("load_format", "TypeError", ["zero_ext.load takes no format", "detects the format itself"]),
            ("load_strict", "TypeError", ["zero_ext.load:", "strict must be True or False", "'False'"]),
        ]:
            refused(got[call], (kind,), *words, "raised on rank 1 of 2")
            assert got[call]["seconds"] < FAST, (call, rank, got[call])
        assert got["written"] == ["ckpt"], (rank, got["written"])
        assert got["model_unchanged"], rank


# 5 -------------------------------------------------------------------------

def test_a_load_never_mixes_two_saves(first, world2):
    for name in ("rank0.bin", "buffers.pt", "optimizer.pt", "extra-rank0.pt"):
        got = ranks(first, f"mixed:{name}")[0]
        assert got["error"] is not None, f"{name} from another save was loaded: parts came from {got['parts']}"
        refused(got, ("ValueError", "RuntimeError"), "zero_ext.load:", name, "another save")
    for when in (1, 2, 3):
        got = ranks(first, f"race:{when}")[0]
        assert got["saved_during"], got
        if got["error"] is None:
            assert got["parts"] in (["A"] * 4, ["B"] * 4), f"weights, buffers, lr, extra came from {got['parts']}"
        else:
            refused(got, ("RuntimeError",), "zero_ext.load:", "replaced")
    # Each rank reads one save; the ranks must also read the same one.
    for rank, got in enumerate(ranks(world2, "ranks-open-different-saves")):
        refused(got, ("RuntimeError",), "zero_ext.load:", "different saves")
        assert got["model_unchanged"], (rank, "nothing may be loaded when the ranks disagree")


# 6 -------------------------------------------------------------------------

def test_zero_size_and_one_element_parameters_round_trip(first, world2, last):
    saves = {1: ranks(first, "zero-size-save"), 2: ranks(world2, "zero-size-save")}
    for world, per_rank in saves.items():
        for rank, got in enumerate(per_rank):
            for stage, outcome in got.items():
                assert outcome["error"] is None, (f"save at world {world}, stage {stage}, rank {rank}", outcome)
    loads = [(1, 1, ranks(last, "zero-size-load-from-w1")), (2, 1, ranks(world2, "zero-size-load-from-w1")),
             (2, 2, ranks(world2, "zero-size-load-from-w2")), (1, 2, ranks(last, "zero-size-load-from-w2"))]
    for world, saved_world, per_rank in loads:
        for rank, got in enumerate(per_rank):
            for stages, outcome in got.items():
                label = f"world {saved_world} -> {world}, stages {stages}, rank {rank}"
                assert outcome["error"] is None, (label, outcome)
                assert outcome["value"] == (rank if saved_world == world else 0), (label, outcome)
    for label, outcome in ranks(last, "zero-size-convert")[0].items():
        assert outcome["error"] is None, (label, outcome)


# 7 -------------------------------------------------------------------------

ADAMW, SGD, ADAM = "torch.optim.adamw.AdamW", "torch.optim.sgd.SGD", "torch.optim.adam.Adam"


def check_into_sgd(got, where):
    """An AdamW checkpoint into SGD (checkpoint_trust_optimizer_scenarios._into_sgd)."""
    refused(got["refused"], ("RuntimeError",), "zero_ext.load:", ADAMW, SGD, "optimizer_class_mismatch=\"fresh\"",
            "optimizer_class_mismatch=\"load\"")
    assert got["refused"]["seconds"] < FAST, (where, got["refused"])
    assert got["refused-unchanged"], f"{where}: a refused load changed the model or the optimizer"
    assert got["fresh"]["error"] is None, (where, got["fresh"])
    assert got["fresh-loaded"], f"{where}: with \"fresh\" the model must load"
    assert got["fresh-groups-kept"], f"{where}: with \"fresh\" SGD keeps its own param groups"
    assert got["fresh-state"] == [], f"{where}: with \"fresh\" SGD starts without state: {got['fresh-state']}"
    assert got["fresh-trains"]["error"] is None, (where, got["fresh-trains"])
    assert got["fresh-state-after-step"] and all(k == ["momentum_buffer"] for k in got["fresh-state-after-step"])
    assert got["load"]["error"] is None and got["load-loaded"], (where, got["load"])
    assert got["load-state"] and all(k == ["exp_avg", "exp_avg_sq", "step"] for k in got["load-state"]), \
        (where, got["load-state"])
    assert got["load-betas"] == (0.9, 0.999), (where, got["load-betas"])


def test_a_checkpoint_loads_into_another_optimizer_class_only_when_asked(first, world2):
    got = ranks(first, "optimizer-class")[0]
    check_into_sgd(got["into-sgd"], "world 1, stage 0")
    assert got["recorded"] == [ADAMW], got["recorded"]
    refused(got["bad-option"], ("ValueError",), "optimizer_class_mismatch", "'allow'", "'fresh'")
    assert got["same-class"]["error"] is None, got["same-class"]
    assert got["same-class-state"] == [["exp_avg", "exp_avg_sq", "step"]] * 3, got["same-class-state"]
    # Several optimizers: each one's class, in order.
    assert got["pair-recorded"] == [ADAMW, SGD], got["pair-recorded"]
    refused(got["pair-refused"], ("RuntimeError",), f"[{ADAMW}, {SGD}]", f"[{ADAMW}, {ADAM}]")
    assert got["pair"]["error"] is None, got["pair"]
    for rank, got in enumerate(ranks(world2, "optimizer-class")):
        check_into_sgd(got, f"world 2, stage 2, rank {rank}")
        refused(got["modes-differ"], ("ValueError",), "optimizer_class_mismatch", "'fresh'", "'load'", "same")


def test_a_checkpoint_saved_before_optimizer_classes_were_recorded_still_loads(first):
    got = ranks(first, "optimizer-class")[0]
    assert got["v3"]["error"] is None and got["v3-loaded"], got["v3"]
    assert got["v3-state"] == [["exp_avg", "exp_avg_sq", "step"]] * 3, got["v3-state"]
    # No class recorded: nothing to compare, so it loads into SGD as it always did.
    assert got["v3-into-sgd"]["error"] is None, got["v3-into-sgd"]
    assert got["v3-into-sgd-state"] == [["exp_avg", "exp_avg_sq", "step"]] * 3, got["v3-into-sgd-state"]
    for case in ("convert", "v3-convert"):
        assert got[case]["error"] is None and got[case]["value"], (case, got[case])


def test_a_save_refuses_scalar_state_that_differs_between_slices_of_a_parameter(world2):
    for rank, got in enumerate(ranks(world2, "scalar-per-slice")):
        refused(got, ("RuntimeError",), "zero_ext.save:", "'grad_norm'", "'lin.weight'", "rank 0", "rank 1",
                "zero_ext_elementwise")
        assert "zero_ext bug" not in got["message"], got["message"]
        assert got["seconds"] < FAST, (rank, got)
        assert not got["published"] and got["litter"] == [], (rank, got)


# 7: DCP directories, whoever wrote them ---------------------------------------

DCP_REFUSALS = {
    "evil-metadata": ["not a valid torch.distributed.checkpoint metadata", "refused to load io.open"],
    "evil-build": ["not a valid torch.distributed.checkpoint metadata", "refused to set the state of", "PosixPath"],
    "fifo": ["__0_0.distcp", "not a regular file"],
    "evil-item": ["extra.rank0", "weights_only"],
    "traversal": ["'../secret.bin'", "not a plain file name"],
    "absolute": ["secret.bin", "not a plain file name"],
    "data-symlink": ["__0_0.distcp", "never links"],
    "flipped-byte": ["model.lin.weight", "does not match its checksum"],
    "truncated": ["__0_0.distcp", "truncated"],
    "overlap": ["model.lin.weight", "overlap"],
    "outside-shape": ["model.lin.weight", "lies outside its shape"],
    "sidecar-of-another-save": ["zero_ext-dcp.json", "another save"],
}


@pytest.mark.parametrize("case", sorted(DCP_REFUSALS))
def test_a_crafted_or_damaged_dcp_checkpoint_is_refused_and_runs_no_code(case, first):
    got = ranks(first, f"dcp:{case}")[0]
    # traversal, absolute, data-symlink: a valid item of SECRET_VALUE waits outside the directory
    assert not got["secret_in_model"], f"a file outside the checkpoint was read into the model: {got}"
    refused(got, ("ValueError", "RuntimeError"), "zero_ext.load:", *DCP_REFUSALS[case])
    assert not got["marker"], "loading ran code from the checkpoint"
    assert got["model_unchanged"], "nothing may be loaded from a refused checkpoint"


def test_a_dcp_checkpoint_without_checksums_is_checked_for_structure_only(first):
    """Another tool's DCP carries no checksums: a flipped byte inside a
    tensor's data is not detected (documented in docs/checkpoints.md); a
    flip that breaks its serialization is."""
    got = ranks(first, "dcp:foreign-flipped-byte")[0]
    assert not got["marker"]
    if got["error"] is not None:
        refused(got, ("ValueError",), "zero_ext.load:", "model.lin.weight")


def test_dcp_loading_is_strict_and_a_model_only_checkpoint_needs_fresh(first):
    from zero_ext.files.dcp.load import load_dcp

    assert isinstance(load_dcp.__doc__, str) and load_dcp.__doc__.strip(), "load_dcp documents its phases"
    got = ranks(first, "dcp:strict")[0]
    refused(got["missing"], ("RuntimeError",), "zero_ext.load:", "more.weight", "strict=False")
    assert got["nonstrict"]["error"] is None and got["nonstrict_loaded"], got
    got = ranks(first, "dcp:model-only")[0]
    refused(got["refused"], ("RuntimeError",), "no optimizer state", "optimizer_class_mismatch=\"fresh\"")
    assert got["refused"]["model_unchanged"]
    assert got["fresh"]["error"] is None and got["fresh_loaded"], got


def test_checkpoint_exists_knows_dcp_directories(first):
    got = ranks(first, "dcp:exists")[0]
    assert got == {"ours": True, "empty": False, "torch": True}, got


def test_async_and_dcp_saves_fail_together(world2):
    for rank, got in enumerate(ranks(world2, "dcp:async-fail-rank1")):
        refused(got, ("RuntimeError",), "zero_ext.save:", "rank 1", "planted async-fail-rank1")
        assert got["again"] == "RuntimeError", (rank, got)
        assert got["litter"] == [], (rank, got["litter"])
        assert got["previous"]["error"] is None and got["previous"]["value"] == "first", (rank, got)
    for rank, got in enumerate(ranks(world2, "dcp:options-differ")):
        refused(got, ("ValueError",), "zero_ext.save:", "different options", "format='dcp'")
        assert got["seconds"] < FAST and not got["written"], (rank, got)
    for rank, got in enumerate(ranks(world2, "dcp:async-then-load")):
        assert got["error"] is None and got["same"] and got["done"], (rank, got)
    for rank, got in enumerate(ranks(world2, "dcp:two-models-async")):
        assert got == {"a": True, "b": True}, (rank, got)


def test_zero_size_and_0d_parameters_round_trip_through_dcp(world2):
    for rank, got in enumerate(ranks(world2, "dcp:zero-size-and-scalar")):
        for stage, outcome in got.items():
            assert outcome["error"] is None and outcome["same"], (rank, stage, outcome)


# Asynchronous saves: the snapshot taken after the call ([Note: the snapshot
# of an asynchronous save]). Each case slows the writer thread's copy by
# faults.PAUSE_S (1 s), so what follows the call runs before the copy would.

def test_an_asynchronous_save_holds_the_state_at_its_call_while_steps_follow_at_once(world2):
    """Three steps and a buffer changed right after the call, the copy not
    yet taken: the checkpoint is the call's state (parameters, optimizer
    state, buffer), at every stage, in both formats, with masters in host
    memory and with state in offload files. The call does not wait for the
    copy; the first step does (offload to files: copied at the call)."""
    for rank, got in enumerate(ranks(world2, "snapshot:steps-right-after")):
        for name, outcome in got.items():
            assert outcome["error"] is None, (rank, name, outcome)
            assert outcome["params"] and outcome["state"] and outcome["buffer"], (rank, name, outcome)
            if "nvme" in name:
                assert outcome["taken_at_call"] and outcome["waited"] == 0, (rank, name, outcome)
            else:
                assert not outcome["taken_at_call"] and outcome["call"] < 0.5, (rank, name, outcome)
                assert outcome["waited"] > 0.5, (rank, name, outcome)  # the first step waited for the copy


def test_an_in_place_change_before_the_snapshot_fails_the_save_on_every_rank(world2):
    """Rank 1 changes a parameter or its optimizer state in place (under
    no_grad) after the call and before the copy: every rank's wait() raises
    zero_ext's error naming it; nothing is published, the previous
    checkpoint loads, and saving the same model goes on."""
    for rank, got in enumerate(ranks(world2, "snapshot:edited")):
        for name, outcome in got.items():
            refused(outcome, ("RuntimeError",), "zero_ext.save:", "failed on rank 1", "changed in place",
                    "before its snapshot was taken", "previous checkpoint, if any, is untouched")
            assert outcome["litter"] == [], (rank, name, outcome)
            assert outcome["previous"] == "first", (rank, name, outcome)
            assert outcome["next"] == (["RuntimeError", None], "third"), (rank, name, outcome)


def test_full_params_writeback_and_load_full_state_dict_wait_for_the_snapshot(world2):
    for rank, got in enumerate(ranks(world2, "snapshot:gates")):
        for name, outcome in got.items():
            assert outcome["error"] is None, (rank, name, outcome)
            assert outcome["saved_at_call"] and outcome["changed_after"], (rank, name, outcome)
            assert outcome["waited"] > 0.5, (rank, name, outcome)
