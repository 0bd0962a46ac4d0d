"""Tamper evidence of checkpoints (issue 31): every piece of every file
carries a checksum and its writer's rank and save; metadata.json carries a
checksum over itself; optimizer scalars in it are validated. A damaged
checkpoint is refused on every rank, within seconds, before anything is
copied into the model, with an error naming the file and the piece;
`python -m zero_ext.convert --verify` checks a checkpoint alone.

Rank-side halves in checkpoint_integrity_scenarios.py: one group of 2 ranks
saves a checkpoint per configuration and loads a damaged copy of it per
case; a group of 4 ranks and this process (world 1) load the world-2
checkpoints (re-sharding: parts of pieces) and a damaged copy; convert runs
as a subprocess on the damaged copies.
"""
import glob
import json
import os
import re
import subprocess
import sys

import pytest

import zero_ext
from checkpoint_integrity_scenarios import (CONFIGS, FLIPS, MAIN, TIMEOUT, base_path, case_path, save_with_a_dying_rank,
                                            world1 as run_world1, world2_items)
from dist_harness import run_items_on_ranks

TARGET = "checkpoint_integrity_scenarios"
FAST = 10.0  # seconds: a refused load raises on every rank well within the 30 s collective timeout
# The zero_ext under test (the checkout, or the copy the torch-versions script installed): the
# subprocesses import that one, never whatever the checkout's build is.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(zero_ext.__file__)))
OTHER_WORLD_ITEMS = [f"{what}:{c}" for c in MAIN for what in ("good", "flip-param", "sealed-steps-differ")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpts"))


@pytest.fixture(scope="module")
def world2(root):
    outcome = run_items_on_ranks(2, f"{TARGET}:world2", world2_items(root), item_deadline_s=150, deadline_s=600)
    return {case: got for (case, _), got in outcome.items()}


@pytest.fixture(scope="module")
def world4(root, world2):  # loads world2's checkpoints and damaged copies
    items = [(c, root) for c in OTHER_WORLD_ITEMS]
    outcome = run_items_on_ranks(4, f"{TARGET}:other_world", items, item_deadline_s=150, deadline_s=600)
    return {case: got for (case, _), got in outcome.items()}


@pytest.fixture(scope="module")
def world1(root, world2):
    return {case: got for (case, _), got in run_world1([(c, root) for c in OTHER_WORLD_ITEMS]).items()}


def ranks(results, case, world=2):
    got = results[case]
    assert isinstance(got, list), f"{case}: a rank crashed or hung:\n{got}"
    assert len(got) == world
    return got


def _has(message, word):
    """`word` is a string, or a tuple of alternatives."""
    return any(w in message for w in word) if isinstance(word, tuple) else word in message


def quoted(name):
    return (f"'{name}'", f'"{name}"')


def expected_words(case, info):
    """What a refusal of `case` must name (besides zero_ext.load / zero_ext.convert)."""
    what = case.split(":")[0]
    if what.startswith("flip-") and what[5:] in FLIPS:
        words = ["checksum", f"pieces[{info['index']}]", quoted(info["name"]), info["file"]]
        return words + ([info["key"]] if info["key"] else [])
    if what == "swap-ranks":
        return ["written by rank", ("rank0.bin", "rank1.bin")]
    if what == "swap-extras":
        return ["written by rank", ("extra-rank0.pt", "extra-rank1.pt")]
    if what in ("flip-rng", "flip-optimizer", "flip-buffers"):
        return ["checksum", info["file"]]
    if what.startswith("meta-"):  # edited, checksum not recomputed
        return ["metadata.json", "checksum"]
    if what == "sealed-offsets":  # the metadata is consistent: the pieces' own checksums catch it
        return ["checksum", tuple(f"pieces[{i}]" for i in info["index"]), quoted(info["name"]), info["key"],
                info["shard"]]
    if what == "sealed-steps-differ":  # the parameter, the key and both values
        return ["metadata.json", quoted(info["name"]), quoted("step"), "must agree"] + [repr(v) for v in info["values"]]
    if what.startswith("sealed-step-"):
        return ["metadata.json", "step", "pieces[", ("finite", "non-negative integer")]
    if what.startswith("sealed-scale-"):
        return ["metadata.json", "loss_scaler"]
    if what == "paths-differ":
        return ["different paths"]
    raise ValueError(case)


def assert_refused(results, case, world=2):
    """Every rank raised RuntimeError/ValueError naming zero_ext.load and the
    case's words, within seconds, and its model and optimizer are untouched."""
    for rank, got in enumerate(ranks(results, case, world)):
        assert "setup_error" not in got.get("info", {}), f"{case}: the damage could not be made:\n{got['info']}"
        where = f"{case}, world {world}, rank {rank}"
        assert got["error"] is not None, f"{where}: loaded silently"
        assert got["error"] in ("RuntimeError", "ValueError"), (where, got["error"], got["message"])
        for word in ["zero_ext.load"] + expected_words(case, got["info"]):
            assert _has(got["message"], word), f"{where}: {word!r} not in the message: {got['message']}"
        assert got["seconds"] < FAST, f"{where}: took {got['seconds']:.1f} s (a timeout?)"
        assert got["model_changed"] is None, f"{where}: the refused load changed the model: {got['model_changed']}"
        assert got["optimizer_changed"] is None, \
            f"{where}: the refused load changed the optimizer: {got['optimizer_changed']}"


# --- the undamaged checkpoint ---------------------------------------------------

@pytest.mark.parametrize("config", CONFIGS)
def test_an_undamaged_checkpoint_loads_and_training_continues_exactly(world2, config):
    sizes = ranks(world2, f"save:{config}")[0]
    assert sizes["rank0.bin"] == sizes["rank1.bin"], f"the model's shards should split evenly: {sizes}"
    for rank, problems in enumerate(ranks(world2, f"good:{config}")):
        assert problems == [], f"rank {rank}: {problems}"


@pytest.mark.parametrize("config", MAIN)
def test_a_checkpoint_saved_at_world_2_loads_exactly_at_world_1_and_4(world1, world4, config):
    for world, results in ((1, world1), (4, world4)):
        for rank, problems in enumerate(ranks(results, f"good:{config}", world)):
            assert problems == [], f"world {world}, rank {rank}: {problems}"


# --- damaged shard files --------------------------------------------------------

@pytest.mark.parametrize("target", FLIPS)
@pytest.mark.parametrize("config", CONFIGS)
def test_a_flipped_byte_in_a_piece_is_refused_naming_the_piece(world2, config, target):
    assert_refused(world2, f"flip-{target}:{config}")


@pytest.mark.parametrize("config", MAIN)
def test_a_flipped_byte_is_caught_when_loading_at_another_world_size(world1, world4, config):
    assert_refused(world1, f"flip-param:{config}", 1)
    assert_refused(world4, f"flip-param:{config}", 4)  # ranks read parts of the damaged piece


@pytest.mark.parametrize("case", ["swap-ranks", "swap-extras"])
@pytest.mark.parametrize("config", MAIN)
def test_files_swapped_between_ranks_are_refused(world2, config, case):
    assert_refused(world2, f"{case}:{config}")


@pytest.mark.parametrize("case", ["flip-rng", "flip-optimizer", "flip-buffers"])
@pytest.mark.parametrize("config", MAIN)
def test_a_flipped_byte_in_a_pt_file_is_refused(world2, config, case):
    assert_refused(world2, f"{case}:{config}")


# --- damaged and forged metadata ----------------------------------------------------

@pytest.mark.parametrize("case", ["meta-offsets", "meta-step-nan", "meta-step-neg", "meta-step-digit"])
@pytest.mark.parametrize("config", MAIN)
def test_metadata_edited_without_its_checksum_is_refused(world2, config, case):
    assert_refused(world2, f"{case}:{config}")


@pytest.mark.parametrize("case", ["sealed-offsets", "sealed-step-nan", "sealed-step-neg", "sealed-step-frac",
                                  "sealed-scale-nan", "sealed-scale-neg", "sealed-steps-differ"])
@pytest.mark.parametrize("config", MAIN)
def test_forged_metadata_with_a_recomputed_checksum_is_refused(world2, config, case):
    assert_refused(world2, f"{case}:{config}")


@pytest.mark.parametrize("config", MAIN)
def test_pieces_of_one_parameter_with_different_scalars_are_refused_at_worlds_1_and_4(world1, world4, config):
    # Each piece's step is valid alone; the world-1 load reads both pieces of the parameter
    # (it used to take the first one's step), world 4 parts of them.
    assert_refused(world1, f"sealed-steps-differ:{config}", 1)
    assert_refused(world4, f"sealed-steps-differ:{config}", 4)


@pytest.mark.parametrize("config", MAIN)
def test_ranks_loading_different_paths_are_refused(world2, config):
    assert_refused(world2, f"paths-differ:{config}")


# --- python -m zero_ext.convert ------------------------------------------------------

VERIFY_CASES = ["flip-param:s2-fp32", "flip-exp_avg_sq:s3-bf16", "swap-ranks:s2-fp32", "flip-rng:s3-bf16",
                "flip-optimizer:s2-fp32", "flip-buffers:s3-bf16", "meta-step-digit:s2-fp32",
                "sealed-offsets:s3-bf16", "sealed-step-neg:s2-fp32", "sealed-steps-differ:s3-bf16"]
CLI_CASES = VERIFY_CASES[:1]  # run as `python -m zero_ext.convert --verify`, each its own process

# The other cases in one process (each Python start costs seconds on two cores):
# `python -m zero_ext.convert --verify PATH` for each PATH, as runpy runs it,
# with its exit code (SystemExit, or 1 and the traceback for an exception) and output.
VERIFY_MANY = r"""
import contextlib, io, json, runpy, sys, traceback
results = {}
for path in sys.argv[1:]:
    buffer, code = io.StringIO(), 0
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        sys.argv = ["zero_ext.convert", "--verify", path]
        try:
            runpy.run_module("zero_ext.convert", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            code = 1
            traceback.print_exc()
    results[path] = [code, buffer.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def converted(root, world2):
    """At once (two cores): --verify on the good checkpoint and on each
    damaged copy; a plain convert of a damaged one."""
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    convert = [sys.executable, "-m", "zero_ext.convert"]
    out = os.path.join(root, "converted-damaged.pt")
    commands = {"good": convert + ["--verify", base_path(root, "s2-fp32")],
                "convert": convert + [case_path(root, "flip-param:s3-bf16"), out],
                "many": [sys.executable, "-c", VERIFY_MANY] + [case_path(root, c) for c in VERIFY_CASES
                                                              if c not in CLI_CASES]}
    commands.update({case: convert + ["--verify", case_path(root, case)] for case in CLI_CASES})
    procs = {k: subprocess.Popen(args, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True) for k, args in commands.items()}
    results = {}
    for k, p in procs.items():
        try:
            output, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            p.kill()
            output, _ = p.communicate()
        results[k] = (p.returncode, output)
    code, output = results.pop("many")
    try:
        many = json.loads(output.strip().splitlines()[-1])
    except (ValueError, IndexError):
        many = None
    for case in VERIFY_CASES:
        if case not in CLI_CASES:
            results[case] = (tuple(many[case_path(root, case)]) if many
                             else (None, f"the driver failed ({code}): {output}"))
    results["convert-left"] = sorted(os.path.basename(f) for f in glob.glob(glob.escape(out) + "*"))
    return results


def test_convert_verify_passes_a_good_checkpoint(converted):
    code, output = converted["good"]
    assert code == 0 and re.search(r"\bok\b", output, re.IGNORECASE), (code, output)


@pytest.mark.parametrize("case", VERIFY_CASES)
def test_convert_verify_names_each_damage(converted, world2, case):
    info = ranks(world2, case)[0]["info"]
    assert "setup_error" not in info, info
    code, output = converted[case]
    assert code != 0, f"--verify passed a damaged checkpoint ({case}): {output}"
    for word in ["zero_ext.convert"] + expected_words(case, info):
        assert _has(output, word), f"{case}: {word!r} not in --verify's output: {output}"


def test_convert_of_a_damaged_checkpoint_fails_and_leaves_no_file(converted, world2):
    info = ranks(world2, "flip-param:s3-bf16")[0]["info"]
    code, output = converted["convert"]
    assert code != 0, f"a damaged checkpoint was converted: {output}"
    for word in ["zero_ext.convert"] + expected_words("flip-param:s3-bf16", info):
        assert _has(output, word), f"{word!r} not in convert's output: {output}"
    assert converted["convert-left"] == [], f"convert left {converted['convert-left']}"


# --- a rank dies during a save ---------------------------------------------------------

def test_a_rank_dying_during_a_save_is_named_with_stage_and_step(root):
    got = save_with_a_dying_rank(root)
    assert got["exit_codes"][1] not in (None, 0), f"rank 1 should have exited at after_shards: {got}"
    survivor = got["survivor"]
    assert survivor is not None, f"the survivor (rank 0) crashed or hung without a report: {got}"
    assert survivor["error"] in ("RuntimeError", "ValueError"), survivor
    assert survivor["seconds"] < TIMEOUT, f"the survivor waited {survivor['seconds']:.0f} s (the timeout?)"
    for word in ("stage 2", "step"):
        assert word in survivor["message"], f"{word!r} not in the survivor's error: {survivor['message']}"
