"""zero_ext.save / load / convert: resume equivalence, resharding across
world sizes and stages, conversion to a plain state_dict, crashes during a
save, and damaged or mismatched checkpoints."""
import functools
import glob
import io
import os
import shutil
import subprocess
import sys

import pytest
import torch

import zero_ext
from checkpoint_scenarios import CONFIGS, K, RESHARD_SAVES, global_batch, label_of, make, saved_name, train
from dist_harness import run_on_ranks
from parity_scenarios import Net
from zero_ext.convert import convert


@functools.lru_cache(maxsize=None)
def resume_results(world: int, root: str, mesh: str):
    return run_on_ranks(world, "checkpoint_scenarios:resume_equivalence", (root, mesh), deadline_s=600)


@pytest.mark.parametrize("config", CONFIGS, ids=label_of)
@pytest.mark.parametrize("world,mesh", [(1, ""), (2, ""), (4, "2x2")])
def test_resume_is_bit_identical(world, mesh, config, tmp_path_factory):
    """Either format, saved at once or asynchronously while the next steps
    change every weight: loading gives the state at the save's call."""
    root = str(tmp_path_factory.getbasetemp() / f"resume-{world}{mesh}")
    results = resume_results(world, root, mesh)
    label = label_of(config)
    for rank, per_rank in enumerate(results):
        assert per_rank[label] is None, f"rank {rank}: {per_rank[label]}"


@pytest.fixture(scope="module")
def saved_at_world_4(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    run_on_ranks(4, "checkpoint_scenarios:save_for_resharding", (root,), deadline_s=300)
    return root


def _reference(precision, steps):
    """One process over the global batch, trained without interruption."""
    model, opt = make(None)
    if precision:
        zero_ext.wrap(model, opt, stage=1, mixed_precision=precision)  # world 1: plain master weights
        dtype = torch.bfloat16
    else:
        dtype = torch.float32
    train(model, opt, range(steps), 0, 1, dtype)
    return zero_ext.full_state_dict(model) if precision else {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world,mesh", [(1, ""), (2, ""), (4, ""), (4, "2x2"), (4, "4x1")])
def test_resharded_load_continues_like_one_process(world, mesh, saved_at_world_4):
    """Saved flat or hybrid at world 4 (zero_ext's format, DCP by zero_ext in
    either layout, DCP by FSDP2 and as torchtitan writes it), loaded flat at
    1, 2, 4 or hybrid over 2x2 and 4x1, into every stage (and zero_ext's
    fp32 DCP saves into FSDP2): training goes on as in one process."""
    per_rank = [torch.load(io.BytesIO(raw), weights_only=True) for raw in
                run_on_ranks(world, "checkpoint_scenarios:load_resharded", (saved_at_world_4, mesh), deadline_s=600)]
    for stage, precision, saved_mesh, fmt in RESHARD_SAVES:
        want = _reference(precision, 2 * K)
        rtol, atol = (2e-2, 2e-3) if precision else (1e-5, 1e-6)
        name = saved_name(stage, precision, saved_mesh, fmt)
        into = [f"stage{s}" for s in (0, 1, 2, 3)] + (["fsdp2"] if f"{name}->fsdp2" in per_rank[0] else [])
        assert len(into) == 5 or fmt not in ("dcp", "dcp-torchtitan") or precision or mesh, name
        for target in into:
            label = f"{name}->{target}"
            for rank, got in enumerate(per_rank):
                for param, value in want.items():
                    assert torch.allclose(got[label][param], value, rtol=rtol, atol=atol), (rank, label, param)


@pytest.mark.parametrize("saved", ["saved-stage3-fp32-dcp", "saved-stage1-fp32-mesh2x2-dcp",
                                   "saved-stage2-bf16-dcp", "saved-stage3-fp32-dcp-torchtitan"])
def test_one_plain_process_reads_zero_ext_dcp(saved, saved_at_world_4, tmp_path):
    """zero_ext's DCP, saved over 4 ranks (flat or hybrid, fp32 masters of
    a bf16 run), read by one plain process with torch's own dcp.load (its
    "model" part, or torchtitan's top-level entries) and by
    dcp_to_torch_save: the full state at the save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(saved_at_world_4, saved)
    want = torch.load(path + ".full.pt", weights_only=True)
    model = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(model if saved.endswith("torchtitan") else {"model": model}, checkpoint_id=path, no_dist=True)
    assert model.keys() == want.keys() and all(torch.equal(model[k], want[k]) for k in want)
    dcp_to_torch_save(path, str(tmp_path / "plain.pt"))
    whole = torch.load(str(tmp_path / "plain.pt"), weights_only=False)  # written just now by torch itself
    got = whole if saved.endswith("torchtitan") else whole["model"]
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("saved", ["saved-stage3-fp32", "saved-stage3-fp32-mesh2x2"])
def test_convert_gives_a_plain_state_dict(saved, saved_at_world_4, tmp_path):
    out = str(tmp_path / "plain.pt")
    ckpt = os.path.join(saved_at_world_4, saved)
    # No zero_ext at load time: a fresh interpreter that cannot import it.
    subprocess.run([sys.executable, "-m", "zero_ext.convert", ckpt, out], check=True, capture_output=True)
    code = (
        "import sys; sys.modules['zero_ext'] = None\n"
        "import torch; sd = torch.load(sys.argv[1], weights_only=True)\n"
        "print(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in sd.items()))\n"
    )
    listed = subprocess.run([sys.executable, "-c", code, out], check=True, capture_output=True, text=True).stdout
    assert "'out.weight', (3, 12), 'torch.float32'" in listed
    fresh = Net(seed=11)
    fresh.load_state_dict(torch.load(out, weights_only=True))
    reference = Net()
    reference.load_state_dict(_reference(None, K))
    x, _ = global_batch(99)
    assert torch.allclose(fresh(x), reference(x), rtol=1e-5, atol=1e-6)

    half = str(tmp_path / "half.pt")
    convert(ckpt, half, torch.bfloat16)
    sd = torch.load(half, weights_only=True)
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    assert torch.equal(sd["out.weight"], fresh.out.weight.detach().to(torch.bfloat16))


def test_convert_runs_without_the_compiled_core(saved_at_world_4, tmp_path):
    """`python -m zero_ext.convert` reads a checkpoint with torch alone: with
    the compiled core unimportable it still converts (files/'s door opens
    lazily, so importing the room loads no core)."""
    out = str(tmp_path / "plain.pt")
    ckpt = os.path.join(saved_at_world_4, "saved-stage3-fp32")
    code = (
        "import runpy, sys\n"
        "sys.modules['zero_ext._C'] = None  # importing the core raises ImportError\n"
        "sys.argv = ['-m'] + sys.argv[1:]  # as `python -m zero_ext.convert` sees its argv while it starts\n"
        "runpy.run_module('zero_ext.convert', run_name='__main__')\n"
        "assert sys.modules['zero_ext._C'] is None and 'zero_ext.tools.core_loader' not in sys.modules\n"
    )
    run = subprocess.run([sys.executable, "-c", code, ckpt, out], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert torch.load(out, weights_only=True).keys() == \
        torch.load(_convert_with_the_core(ckpt, tmp_path), weights_only=True).keys()


def _convert_with_the_core(ckpt: str, tmp_path) -> str:
    out = str(tmp_path / "with-core.pt")
    convert(ckpt, out)
    return out


def test_convert_to_safetensors_matches_the_state_dict(saved_at_world_4, tmp_path):
    """--format safetensors: the same values the .pt conversion holds, as
    one file or in Hugging Face's sharded layout, read by the package."""
    load_file = pytest.importorskip("safetensors.torch").load_file  # installed by scripts/setup.sh
    ckpt = os.path.join(saved_at_world_4, "saved-stage2-bf16")
    plain = str(tmp_path / "plain.pt")
    convert(ckpt, plain)
    want = torch.load(plain, weights_only=True)
    out = str(tmp_path / "hf")
    subprocess.run([sys.executable, "-m", "zero_ext.convert", ckpt, out, "--format", "safetensors",
                    "--max-shard-size", "200"], check=True, capture_output=True)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) > 2 and os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    got = {}
    for f in files:
        got.update(load_file(os.path.join(out, f)))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    single = str(tmp_path / "half.safetensors")
    convert(ckpt, single, torch.bfloat16, format="safetensors")
    half = load_file(single)
    assert all(torch.equal(half[k], want[k].to(torch.bfloat16)) for k in want if want[k].is_floating_point())


@pytest.mark.parametrize("fault", ["after_shards:1", "before_publish:0", "between_renames:0",
                                   "async/async_after_write:1", "async/before_publish:0"])
def test_a_crash_during_save_leaves_the_previous_checkpoint(fault, tmp_path, monkeypatch):
    """A rank killed during a save (async/: an asynchronous DCP save, killed
    in its writer thread while training goes on) leaves the previous
    checkpoint loadable."""
    from zero_ext.tools import faults
    if fault == "between_renames:0":  # only a save that cannot exchange directories renames twice
        monkeypatch.setenv(faults.VARIABLE, faults.spec("no_exchange"))
    root = str(tmp_path)
    with pytest.raises(RuntimeError):
        run_on_ranks(2, "checkpoint_scenarios:save_twice_and_die", (root, fault), deadline_s=120)
    path = os.path.join(root, "ckpt")
    model, opt = make(3)
    assert zero_ext.load(path, model, opt) == "first"
    assert glob.glob(path + ".tmp-*"), "the unfinished save should still be there, unused"
    # A later save succeeds, replaces it and removes what the crashed one left.
    zero_ext.save(path, model, opt, extra="third")
    assert zero_ext.load(path, model, opt) == "third"
    assert not glob.glob(path + ".tmp-*") + glob.glob(path + ".old-*")


def _saved(tmp_path):
    model, opt = make(2)
    train(model, opt, range(1), 0, 1)
    path = str(tmp_path / "ckpt")
    zero_ext.save(path, model, opt)
    return path


def test_wrong_model_is_named(tmp_path):
    path = _saved(tmp_path)
    other = torch.nn.Sequential(torch.nn.Linear(6, 5))
    opt = torch.optim.AdamW(other.parameters())
    zero_ext.wrap(other, opt, stage=2)
    with pytest.raises(RuntimeError, match="saved from a different model.*missing from the checkpoint"):
        zero_ext.load(path, other, opt)


def test_missing_truncated_and_incomplete_files_are_named(tmp_path):
    path = _saved(tmp_path)
    model, opt = make(1)
    shard = os.path.join(path, "rank0.bin")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 4)
    with pytest.raises(RuntimeError, match="rank0.bin has .* bytes, the metadata says"):
        zero_ext.load(path, model, opt)
    os.remove(shard)
    with pytest.raises(RuntimeError, match="rank0.bin is missing"):
        zero_ext.load(path, model, opt)
    os.remove(os.path.join(path, "metadata.json"))
    with pytest.raises(RuntimeError, match="metadata.json is missing.*not a complete"):
        zero_ext.load(path, model, opt)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        zero_ext.load(str(tmp_path / "nothing"), model, opt)


def test_a_plain_state_dict_loads_into_a_wrapped_model():
    plain = Net(seed=3)
    model, opt = make(3)
    zero_ext.load_full_state_dict(model, plain.state_dict())
    full = zero_ext.full_state_dict(model)
    assert all(torch.equal(full[n], p) for n, p in plain.state_dict().items())


@pytest.mark.parametrize("saved_stage,loaded_stage", [(1, 3), (3, 0), (0, 2)])
def test_frozen_parameters_round_trip(saved_stage, loaded_stage, tmp_path):
    """In fp32, frozen parameters are bucketed in stage 3 only; either way they are
    saved once and land where the loading layout keeps them."""
    def frozen_net(seed):
        model = Net(seed=seed)
        model.inp.requires_grad_(False)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
        return model, opt
    model, opt = frozen_net(0)
    zero_ext.wrap(model, opt, stage=saved_stage, bucket_mb=0.0005)
    train(model, opt, range(K), 0, 1)
    zero_ext.save(str(tmp_path / "ckpt"), model, opt)
    train(model, opt, range(K, 2 * K), 0, 1)
    want = zero_ext.full_state_dict(model)
    other, other_opt = frozen_net(5)
    zero_ext.wrap(other, other_opt, stage=loaded_stage, bucket_mb=0.0007)
    zero_ext.load(str(tmp_path / "ckpt"), other, other_opt)
    train(other, other_opt, range(K, 2 * K), 0, 1)
    got = zero_ext.full_state_dict(other)
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-6, atol=1e-7), name


def test_python_collectives_go_through_the_core(tmp_path):
    """clip_grad_norm_, save and load exchange over the core's communicator
    (ShardedModel.group_*), not torch.distributed directly."""
    results = run_on_ranks(2, "checkpoint_scenarios:python_collectives_on_the_core", (str(tmp_path),),
                           deadline_s=300)
    for rank, counts in enumerate(results):
        assert counts["clip"] == 1, (rank, counts)
        assert counts["save"] >= 4 and counts["load"] >= 2, (rank, counts)


def test_optimizer_scalars_a_load_would_refuse_are_refused_at_save(tmp_path):
    """A broken step count fails the save (naming the key), not a later
    load; other scalars keep any value, inf included, as tensors may."""
    model, opt = make(2)
    train(model, opt, range(1), 0, 1)
    state = next(iter(opt.state.values()))
    state["best_loss"] = float("inf")  # a custom optimizer's scalar
    path = str(tmp_path / "ckpt")
    zero_ext.save(path, model, opt)
    fresh, fresh_opt = make(2)
    zero_ext.load(path, fresh, fresh_opt)
    assert next(iter(fresh_opt.state.values()))["best_loss"] == float("inf")
    state["step"] = torch.tensor(float("nan"))
    with pytest.raises(RuntimeError, match="'step'.*counts steps, so it must be a non-negative integer"):
        zero_ext.save(str(tmp_path / "broken"), model, opt)
    assert not os.path.exists(tmp_path / "broken")


def test_a_read_larger_than_one_system_read_is_completed():
    """One read() of a regular file returns at most about 2 GiB on Linux: a
    piece that large must be read in a loop, not reported as truncated."""
    from zero_ext.files.checkpoint.reader import _read_exactly

    class ShortReads(io.BytesIO):
        def readinto(self, buffer):  # at most 7 bytes per call, as a capped read() would
            return super().readinto(memoryview(buffer)[:7])

    data = torch.arange(100, dtype=torch.float32)
    into = torch.empty(100, dtype=torch.float32)
    assert _read_exactly(ShortReads(data.numpy().tobytes()), into) and torch.equal(into, data)
    assert not _read_exactly(ShortReads(data.numpy().tobytes()[:-1]), torch.empty(100))


def test_pieces_are_typed_by_kind_and_round_trip_their_json(tmp_path):
    """metadata.json's pieces parse into one class per kind, each with only
    its kind's fields (a parameter's range has no state key, a scalars piece
    no file), and write back the JSON they came from."""
    import json

    from zero_ext.files.checkpoint.metadata import (ParamPiece, PieceKind, ScalarsPiece, StatePiece, StoredPiece,
                                                    WholeStatePiece)
    from zero_ext.files.checkpoint.reader import Checkpoint

    model = Net()
    opt = torch.optim.Adafactor(model.parameters(), lr=0.01)  # state that is not elementwise: whole pieces
    model, opt = zero_ext.wrap(model, opt, stage=1)
    x, y = global_batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    path = str(tmp_path / "ckpt")
    zero_ext.save(path, model, opt)
    ckpt = Checkpoint(path, "test")
    try:
        pieces = ckpt.meta.pieces
        with open(os.path.join(path, "metadata.json")) as f:
            written = json.load(f)["pieces"]
    finally:
        ckpt.close()
    by_kind = {kind: [p for p in pieces if p.kind is kind] for kind in PieceKind}
    assert all(by_kind.values()), {k: len(v) for k, v in by_kind.items()}
    assert {type(p) for p in by_kind[PieceKind.PARAM]} == {ParamPiece}
    assert {type(p) for p in by_kind[PieceKind.STATE]} == {StatePiece}
    assert {type(p) for p in by_kind[PieceKind.WHOLE]} == {WholeStatePiece}
    assert {type(p) for p in by_kind[PieceKind.SCALARS]} == {ScalarsPiece}
    assert not any(hasattr(p, "key") for p in by_kind[PieceKind.PARAM] + by_kind[PieceKind.SCALARS])
    assert not any(isinstance(p, StoredPiece) or hasattr(p, "shape") for p in by_kind[PieceKind.SCALARS])
    assert not any(hasattr(p, "values") for p in pieces if isinstance(p, StoredPiece))
    assert [p.to_json() for p in pieces] == written


@pytest.mark.parametrize("saved", ["saved-fsdp2", "saved-torchtitan", "saved-stage3-fp32-dcp",
                                   "saved-stage3-fp32-dcp-torchtitan", "saved-stage1-fp32-mesh2x2-dcp"])
def test_convert_takes_any_dcp_directory(saved, saved_at_world_4, tmp_path):
    """`python -m zero_ext.convert` reads DCP directories too, whoever wrote
    them (FSDP2's get_state_dict layout, torchtitan's, zero_ext's in either
    layout or hybrid): the model's tensors, under their own names, loaded by
    a plain Net, equal one process's; and as safetensors the same values."""
    ckpt = os.path.join(saved_at_world_4, saved)
    out = str(tmp_path / "plain.pt")
    run = subprocess.run([sys.executable, "-m", "zero_ext.convert", ckpt, out], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    got = torch.load(out, weights_only=True)
    want = _reference(None, K)
    assert set(got) == set(Net().state_dict()), sorted(got)
    for name, value in want.items():
        assert torch.allclose(got[name], value, rtol=1e-5, atol=1e-6), name
    load_file = pytest.importorskip("safetensors.torch").load_file
    single = str(tmp_path / "model.safetensors")
    convert(ckpt, single, format="safetensors")
    assert all(torch.equal(load_file(single)[k], got[k]) for k in got)


def test_convert_verify_reads_every_item_of_a_dcp_directory(saved_at_world_4, tmp_path):
    """--verify over DCP: zero_ext's checked against its checksums ("ok"),
    another writer's for its structure only, saying so; a flipped byte in
    zero_ext's data file is named, exit 1."""
    def verify(path):
        return subprocess.run([sys.executable, "-m", "zero_ext.convert", "--verify", path], capture_output=True,
                              text=True)
    ours = verify(os.path.join(saved_at_world_4, "saved-stage3-fp32-dcp"))
    assert ours.returncode == 0 and "zero_ext's checksums" in ours.stdout, ours.stdout + ours.stderr
    theirs = verify(os.path.join(saved_at_world_4, "saved-fsdp2"))
    assert theirs.returncode == 0 and "structure only" in theirs.stdout, theirs.stdout + theirs.stderr
    damaged = str(tmp_path / "damaged")
    shutil.copytree(os.path.join(saved_at_world_4, "saved-stage3-fp32-dcp"), damaged)
    data = sorted(glob.glob(os.path.join(damaged, "*.distcp")))[0]
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) - 9)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    bad = verify(damaged)
    assert bad.returncode == 1 and "damaged:" in bad.stderr, bad.stdout + bad.stderr
