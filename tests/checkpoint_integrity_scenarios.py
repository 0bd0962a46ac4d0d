"""Rank-side halves of tests/test_checkpoint_integrity.py: checkpoints whose
bytes were damaged (a flipped byte in a piece, in a .pt file, in the
metadata), files swapped between ranks, forged metadata with a recomputed
checksum, and the undamaged controls, at world 2, 1 and 4.

One checkpoint is saved per configuration (stage, precision); every damage
case works on its own copy (root/cases/<case>/ckpt), made by rank 0, and
leaves it there for the world-1, world-4 and convert checks to reuse. Every
item catches what zero_ext raises and returns a small report (exception type,
message, seconds, whether the model or the optimizer changed) for the test to
judge, so one expected error never ends the group. Items are (case, root)
tuples for dist_harness.run_items_on_ranks.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import re
import shutil
import struct
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

import zero_ext
from checkpoint_trust_scenarios import attempt, params_of
from dist_harness import rank_context, start_rank

TIMEOUT = 30  # the model group's collective timeout: a hang would take this long
LR = 0.0123   # Adam's learning rate: its bytes are found in optimizer.pt
EXTRA_SEED = 1000  # rank r's extra holds the RNG state after torch.manual_seed(EXTRA_SEED + r)

# name -> (stage, mixed_precision)
CONFIGS: Dict[str, tuple] = {
    "s0-fp32": (0, None), "s0-bf16": (0, "bf16"), "s1-fp32": (1, None), "s1-bf16": (1, "bf16"), "s2-fp32": (2, None),
    "s2-bf16": (2, "bf16"), "s3-fp32": (3, None), "s3-bf16": (3, "bf16"),
}
MAIN = ("s2-fp32", "s3-bf16")  # the configurations every other damage is tried on
FLIPS = ("param", "exp_avg", "exp_avg_sq")  # a flipped byte in a piece of each kind
OTHER_CASES = ("swap-ranks", "swap-extras", "flip-rng", "flip-optimizer", "flip-buffers",
               "meta-offsets", "meta-step-nan", "meta-step-neg", "meta-step-digit",
               "sealed-offsets", "sealed-step-nan", "sealed-step-neg", "sealed-step-frac",
               "sealed-scale-nan", "sealed-scale-neg", "sealed-steps-differ", "paths-differ")
STEPS_DIFFER = (3.0, 7.0)  # Adam's step in a parameter's first piece and in its others (each a valid count)


def world2_items(root: str) -> List[tuple]:
    cases = [f"save:{c}" for c in CONFIGS] + [f"good:{c}" for c in CONFIGS]
    cases += [f"flip-{target}:{c}" for c in CONFIGS for target in FLIPS]
    cases += [f"{case}:{c}" for c in MAIN for case in OTHER_CASES]
    return [(case, root) for case in cases]


# --- the model -----------------------------------------------------------------

def net(seed: int) -> nn.Module:
    """Two linear layers (64 + 8 + 32 + 4 elements: every bucket splits evenly
    over 1, 2 and 4 ranks, so both shard files have the same size) and a
    persistent buffer."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    model.register_buffer("scale", torch.empty(16))
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.copy_(torch.randn(t.shape, generator=g))
    return model


def make(config: str, seed: int = 0):
    stage, precision = CONFIGS[config]
    model = net(seed)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    return zero_ext.wrap(model, opt, stage=stage, mixed_precision=precision, bucket_mb=0.0001, timeout=TIMEOUT)


def train(model, opt, rank: int, steps) -> None:
    for i in steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * i + rank))
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def extra_of(rank: int) -> dict:
    """What rank `rank` passes as extra: its RNG state and a dict (the same
    kind and size on every rank, different values)."""
    torch.manual_seed(EXTRA_SEED + rank)
    return {"rng": torch.get_rng_state(), "info": {"rank": rank, "note": "integrity"}}


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


full = params_of  # every parameter, full, cloned


def differs(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> Optional[str]:
    if a.keys() != b.keys():
        return f"keys differ: {sorted(set(a) ^ set(b))}"
    bad = [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    return f"entries differ: {bad}" if bad else None


def optimizer_state(opt) -> List[Any]:
    """This rank's optimizer: every group's hyperparameters and every state tensor, copied."""
    out: List[Any] = []
    for g in opt.param_groups:
        out.append(("group", {k: v for k, v in g.items() if k != "params"}))
        for p in g["params"]:
            state = opt.state.get(p, {})
            out.append(("state", {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                                  for k, v in state.items()}))
    return out


def state_differs(a: List[Any], b: List[Any]) -> Optional[str]:
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} entries"
    for i, ((kind, x), (_, y)) in enumerate(zip(a, b)):
        if x.keys() != y.keys():
            return f"{kind} {i}: keys {sorted(x)} vs {sorted(y)}"
        for k in x:
            u, v = x[k], y[k]
            if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
                same = (isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) and u.shape == v.shape
                        and u.dtype == v.dtype and torch.equal(u, v))
            else:
                same = u == v
            if not same:
                return f"{kind} {i}: {k!r} changed"
    return None


# --- saving and the undamaged controls -------------------------------------------

def base_path(root: str, config: str) -> str:
    return os.path.join(root, f"base-{config}")


def expect(root: str, config: str) -> Dict[str, Dict[str, torch.Tensor]]:
    """{"want": full state saved, "ref": full state after 2 more steps without save/load}."""
    return torch.load(base_path(root, config) + ".expect.pt", weights_only=True)


def save_base(root: str, config: str, rank: int, world: int) -> Dict[str, int]:
    model, opt = make(config, seed=0)
    train(model, opt, rank, range(2))
    zero_ext.save(base_path(root, config), model, opt, extra=extra_of(rank))
    want = full(model)
    train(model, opt, rank, range(2, 4))
    ref = full(model)
    if rank == 0:
        torch.save({"want": want, "ref": ref}, base_path(root, config) + ".expect.pt")
    barrier(world)
    path = base_path(root, config)
    return {name: os.path.getsize(os.path.join(path, name)) for name in sorted(os.listdir(path))}


def check_extra(extra: Any, writer: int) -> Optional[str]:
    want = extra_of(writer)
    if not isinstance(extra, dict) or set(extra) != {"rng", "info"}:
        return f"extra is {extra!r}"
    if extra["info"] != want["info"] or not torch.equal(extra["rng"], want["rng"]):
        return f"extra is rank {extra['info'].get('rank')}'s, not rank {writer}'s"
    return None


def load_good(root: str, config: str, rank: int, world: int, saved_world: int = 2,
              continue_training: bool = True) -> List[str]:
    """The undamaged checkpoint into a model that differs from it: the saved
    state exactly, this rank's extra, and (at the saving world size) two
    more steps exactly as the run that never saved."""
    problems = []
    model, opt = make(config, seed=7)
    train(model, opt, rank, range(5, 6))
    extra = zero_ext.load(base_path(root, config), model, opt)
    found = check_extra(extra, rank if rank < saved_world else 0)
    if found:
        problems.append(found)
    wanted = expect(root, config)
    found = differs(full(model), wanted["want"])
    if found:
        problems.append(f"loaded state is not the saved one: {found}")
    if continue_training:
        train(model, opt, rank, range(2, 4))
        found = differs(full(model), wanted["ref"])
        if found:
            problems.append(f"training after the load differs from the run without save/load: {found}")
    return problems


# --- damage --------------------------------------------------------------------

def case_path(root: str, case: str) -> str:
    return os.path.join(root, "cases", case.replace(":", "-"), "ckpt")


def read_meta(path: str) -> dict:
    with open(os.path.join(path, "metadata.json")) as f:
        return json.load(f)


def write_meta(path: str, meta: dict) -> None:
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(meta, f)


def flip(path: str, name: str, at: int) -> None:
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))


def find_bytes(path: str, name: str, needle: bytes) -> int:
    with open(os.path.join(path, name), "rb") as f:
        raw = f.read()
    at = raw.find(needle)
    if at < 0 or raw.find(needle, at + 1) >= 0:
        raise AssertionError(f"setup: the bytes to damage are not found exactly once in {name}")
    return at


def _pick(meta: dict, kind: str, key: str, file: str, names=("0.weight", "2.weight")) -> int:
    """Index of a piece of `kind`/`key` with at least 2 elements, in `file` if there is one, preferring `names`."""
    candidates = [i for i, p in enumerate(meta["pieces"])
                  if p["kind"] == kind and p.get("key", "") == key and p["length"] >= 2]
    for wanted_file in (file, None):
        for name in names + (None,):
            for i in candidates:
                p = meta["pieces"][i]
                if (wanted_file is None or p["file"] == wanted_file) and (name is None or p["name"] == name):
                    return i
    raise AssertionError(f"setup: no {kind} {key} piece in the metadata")


def _flip_piece(path: str, meta: dict, target: str) -> dict:
    kind, key, file = {"param": ("param", "", "rank1.bin"), "exp_avg": ("state", "exp_avg", "rank0.bin"),
                       "exp_avg_sq": ("state", "exp_avg_sq", "rank1.bin")}[target]
    i = _pick(meta, kind, key, file, ("2.weight", "0.weight") if target == "exp_avg_sq" else ("0.weight", "2.weight"))
    piece = meta["pieces"][i]
    size = torch.empty(0, dtype=getattr(torch, piece["dtype"].split(".")[1])).element_size()
    # The middle element, its second byte: strictly inside [offset, offset + length * itemsize).
    at = piece["offset"] + (piece["length"] // 2) * size + 1
    flip(path, piece["file"], at)
    return {"file": piece["file"], "index": i, "name": piece["name"], "key": key, "byte": at,
            "piece": [piece["offset"], piece["offset"] + piece["length"] * size]}


def _state_pair(meta: dict) -> tuple:
    """Two same-length pieces in one file: exp_avg and exp_avg_sq of one range."""
    pieces = meta["pieces"]
    for i, p in enumerate(pieces):
        if p["kind"] == "state" and p["key"] == "exp_avg" and p["length"] >= 2:
            for j, q in enumerate(pieces):
                if (q["kind"] == "state" and q["key"] == "exp_avg_sq" and q["name"] == p["name"]
                        and q["start"] == p["start"] and q["length"] == p["length"] and q["file"] == p["file"]):
                    return i, j
    raise AssertionError("setup: no exp_avg/exp_avg_sq pair of pieces")


def _step_piece(meta: dict) -> int:
    for i, p in enumerate(meta["pieces"]):
        if p["kind"] == "scalars" and "step" in p.get("values", {}):
            return i
    raise AssertionError("setup: no scalars piece holding 'step'")


def _split_param(meta: dict) -> List[int]:
    """The scalars pieces (at least 2) of the first parameter whose scalar state is split over ranks."""
    by_name: Dict[str, List[int]] = {}
    for i, p in enumerate(meta["pieces"]):
        if p["kind"] == "scalars" and "step" in p.get("values", {}):
            by_name.setdefault(p["name"], []).append(i)
    split = [found for found in by_name.values() if len(found) >= 2]
    if not split:
        raise AssertionError("setup: no parameter whose scalar state has two pieces")
    return split[0]


def _edit_meta(path: str, what: str, sealed: bool) -> dict:
    """Edits metadata.json; with `sealed`, recomputes its checksum as a forger would."""
    meta = read_meta(path)
    info: Dict[str, Any] = {"file": "metadata.json"}
    if what == "offsets":
        i, j = _state_pair(meta)
        a, b = meta["pieces"][i], meta["pieces"][j]
        a["offset"], b["offset"] = b["offset"], a["offset"]
        info.update(index=[i, j], name=a["name"], key="exp_avg", shard=a["file"])
    elif what == "steps-differ":  # one parameter, two step counts: each piece valid alone
        indices = _split_param(meta)
        first, others = STEPS_DIFFER
        for k, i in enumerate(indices):
            meta["pieces"][i]["values"]["step"]["value"] = first if k == 0 else others
        info.update(index=indices, name=meta["pieces"][indices[0]]["name"], values=list(STEPS_DIFFER))
    elif what.startswith("step-"):
        i = _step_piece(meta)
        meta["pieces"][i]["values"]["step"]["value"] = {"nan": math.nan, "neg": -5, "frac": 2.5}[what[5:]]
        info.update(index=[i], name=meta["pieces"][i]["name"])
    elif what.startswith("scale-"):
        meta["loss_scaler"]["scale"] = {"nan": math.nan, "neg": -1024.0}[what[6:]]
    else:
        raise ValueError(what)
    if sealed:
        from zero_ext.files.checkpoint.metadata import seal  # noqa: PLC0415 - the feature under test; absent before it
        meta = seal(meta)
    write_meta(path, meta)
    return info


def _edit_step_digit(path: str) -> dict:
    """Changes one digit of a step count in the metadata's text, nothing else."""
    name = os.path.join(path, "metadata.json")
    with open(name) as f:
        text = f.read()
    found = re.search(r'"step"\s*:\s*\{[^{}]*?"value"\s*:\s*-?(\d)', text)
    if not found:
        raise AssertionError("setup: no step count in metadata.json's text")
    at = found.start(1)
    with open(name, "w") as f:
        f.write(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1:])
    return {"file": "metadata.json"}


def _swap(path: str, a: str, b: str) -> dict:
    pa, pb = os.path.join(path, a), os.path.join(path, b)
    if os.path.getsize(pa) != os.path.getsize(pb):
        raise AssertionError(f"setup: {a} and {b} differ in size ({os.path.getsize(pa)} vs "
                             f"{os.path.getsize(pb)}); a swap would be caught by the size check alone")
    os.rename(pa, pa + ".swap")
    os.rename(pb, pa)
    os.rename(pa + ".swap", pb)
    return {"file": [a, b]}


def damage(root: str, case: str, config: str) -> dict:
    """Rank 0: a copy of the configuration's checkpoint with `case` done to it.
    Returns what the test expects to see named."""
    path = case_path(root, f"{case}:{config}")
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    os.makedirs(os.path.dirname(path))
    shutil.copytree(base_path(root, config), path)
    meta = read_meta(path)
    if case.startswith("flip-") and case[5:] in FLIPS:
        return _flip_piece(path, meta, case[5:])
    if case == "swap-ranks":
        return _swap(path, "rank0.bin", "rank1.bin")
    if case == "swap-extras":
        return _swap(path, "extra-rank0.pt", "extra-rank1.pt")
    if case == "flip-rng":
        rng = extra_of(0)["rng"].numpy().tobytes()
        at = find_bytes(path, "extra-rank0.pt", rng) + len(rng) // 2
        flip(path, "extra-rank0.pt", at)
        return {"file": "extra-rank0.pt", "byte": at}
    if case == "flip-optimizer":  # the last byte of the learning rate in the pickle (a big-endian double)
        at = find_bytes(path, "optimizer.pt", struct.pack(">d", LR)) + 7
        flip(path, "optimizer.pt", at)
        return {"file": "optimizer.pt", "byte": at}
    if case == "flip-buffers":  # inside the buffer's tensor data
        scale = expect(root, config)["want"]["scale"].numpy().tobytes()
        at = find_bytes(path, "buffers.pt", scale) + len(scale) // 2 + 1
        flip(path, "buffers.pt", at)
        return {"file": "buffers.pt", "byte": at}
    if case == "meta-step-digit":
        return _edit_step_digit(path)
    if case.startswith("meta-"):
        return _edit_meta(path, case[5:], sealed=False)
    if case.startswith("sealed-"):
        return _edit_meta(path, case[7:], sealed=True)
    if case == "paths-differ":  # a second copy of the same checkpoint
        shutil.copytree(path, path + "-copy")
        return {"paths": [path, path + "-copy"]}
    raise ValueError(case)


def refused_load(path: str, config: str, rank: int) -> Dict[str, Any]:
    """Loads `path` into a model and optimizer that differ from it; reports
    the outcome and whether anything of them changed."""
    model, opt = make(config, seed=7)
    train(model, opt, rank, range(5, 6))
    params, state = full(model), optimizer_state(opt)
    outcome = attempt(lambda: zero_ext.load(path, model, opt))
    outcome["value"] = None if outcome["value"] is None else repr(outcome["value"])[:200]
    outcome["model_changed"] = differs(params, full(model))
    outcome["optimizer_changed"] = state_differs(state, optimizer_state(opt))
    return outcome


def _shared_info(root: str, item_case: str, rank: int, world: int, make_info: Callable[[], dict]) -> dict:
    """Rank 0 runs make_info (catching a setup failure); every rank gets its result."""
    where = os.path.join(root, "cases", item_case.replace(":", "-") + ".info.json")
    if rank == 0:
        try:
            info = make_info()
        except Exception as e:  # noqa: BLE001 - reported by the test as a setup failure
            info = {"setup_error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        os.makedirs(os.path.dirname(where), exist_ok=True)
        with open(where, "w") as f:
            json.dump(info, f)
    barrier(world)
    with open(where) as f:
        return json.load(f)


def world2(rank: int, world: int, item) -> Any:
    case, root = item
    what, config = case.split(":")
    if what == "save":
        return save_base(root, config, rank, world)
    if what == "good":
        return load_good(root, config, rank, world)
    info = _shared_info(root, case, rank, world, lambda: damage(root, what, config))
    if "setup_error" in info:
        return {"info": info}
    path = case_path(root, case)
    if what == "paths-differ":
        path = info["paths"][rank % 2]
    outcome = refused_load(path, config, rank)
    outcome["info"] = info
    return outcome


# --- other world sizes: world 1 (in the test's process) and world 4 ---------------

def other_world(rank: int, world: int, item) -> Any:
    """('good', config) loads the world-2 checkpoint exactly; ('flip-param',
    config) loads its damaged copy (partial reads of the damaged piece at world 4)."""
    case, root = item
    what, config = case.split(":")
    if what == "good":
        return load_good(root, config, rank, world, continue_training=False)
    outcome = refused_load(case_path(root, case), config, rank)
    with open(os.path.join(root, "cases", case.replace(":", "-") + ".info.json")) as f:
        outcome["info"] = json.load(f)
    return outcome


def world1(items: List[tuple]) -> Dict[tuple, Any]:
    """other_world's items in this process, unwrapped by torch.distributed (world 1)."""
    out = {}
    for item in items:
        try:
            out[item] = [other_world(0, 1, item)]
        except Exception:  # noqa: BLE001 - one item fails alone
            out[item] = traceback.format_exc()
    return out


# --- a rank dies during a save ---------------------------------------------------

def _dying_rank(rank: int, init_file: str, root: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    model, opt = make("s2-fp32")
    train(model, opt, rank, range(2))
    path = os.path.join(root, "dying", "ckpt")
    zero_ext.save(path, model, opt, extra="first")
    os.environ["ZERO_EXT_TEST_FAULT"] = "after_shards:1"  # rank 1 exits once its shards are written
    outcome = attempt(lambda: zero_ext.save(path, model, opt, extra="second"))
    results.put((rank, outcome))
    results.close()
    results.join_thread()
    os._exit(0)  # the group has lost a rank: leave without its teardown


def save_with_a_dying_rank(root: str, deadline_s: float = 90.0) -> Dict[str, Any]:
    """Two ranks of a stage-2 model save; rank 1 exits once it has written its
    shards. Returns {"survivor": rank 0's outcome, "exit_codes": [...]}. A
    launcher of its own: dist_harness ends a group as soon as a rank dies,
    which could kill the survivor before it reports."""
    ctx = rank_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [start_rank(ctx, _dying_rank, (r, init_file, root, results)) for r in range(2)]
        survivor = None
        end = time.monotonic() + deadline_s
        try:
            while survivor is None and time.monotonic() < end:
                try:
                    rank, outcome = results.get(timeout=0.5)
                except Exception:  # noqa: BLE001 - queue.Empty
                    if procs[0].exitcode not in (None, 0):
                        break  # the survivor crashed without a report
                    continue
                if rank == 0:
                    survivor = outcome
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    return {"survivor": survivor, "exit_codes": [p.exitcode for p in procs]}
