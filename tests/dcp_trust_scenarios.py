"""Rank-side halves of the DCP trust tests (tests/test_checkpoint_trust.py):
items of its world-1 and world-2 groups. A DCP directory is what any tool
wrote: a crafted `.metadata` (a pickle), a bytes item that would run code,
a data file outside the directory or a link, a flipped byte (caught by
zero_ext's checksums where zero_ext wrote it), a missing key; asynchronous
saves that fail on one rank; ranks that disagree about the format."""
from __future__ import annotations

import io
import os
import pickle
import shutil
from typing import Any, Dict

import torch
import torch.distributed as dist

import zero_ext
from checkpoint_trust_scenarios import Evil, attempt, litter, make, params_of, same, step
from zero_ext.files.dcp import save as _dcp_save

WORLD1_CASES = ["evil-metadata", "evil-build", "evil-item", "traversal", "absolute", "data-symlink", "fifo",
                "flipped-byte", "truncated", "overlap", "outside-shape", "sidecar-of-another-save",
                "foreign-flipped-byte", "strict", "model-only", "exists"]
WORLD2_CASES = ["async-fail-rank1", "options-differ", "async-then-load", "zero-size-and-scalar", "two-models-async"]

# A pickle that sets an attribute on an allowlisted class (BUILD with slot
# state on pathlib.PosixPath): refused, and the class untouched after.
EVIL_BUILD = b"cpathlib\nPosixPath\n(N(dS'is_absolute'\nctorch\nSize\nstb."
# What a secret file beside a checkpoint holds: were a load to read it, this
# value would be in the model.
SECRET_VALUE = 1234.5


def _saved(root: str, case: str, rank: int = 0) -> tuple:
    """A wrapped Tiny at stage 1, stepped, saved as DCP; and the path."""
    model, opt = make(1)
    step(model, opt, rank)
    path = os.path.join(root, "dcp", case, "ckpt")
    shutil.rmtree(path, ignore_errors=True)
    zero_ext.save(path, model, opt, extra={"case": case}, format="dcp")
    return model, opt, path


def _metadata(path: str):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)  # the test's own file, written just now


def _put_metadata(path: str, meta: Any) -> None:
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)


def _first_storage(meta, prefix: str):
    return next(k for k in meta.storage_data if k.fqn.startswith(prefix))


def _load(path: str, **kw) -> Dict[str, Any]:
    model, opt = make(1, seed=9)
    before = params_of(model)
    outcome = attempt(lambda: zero_ext.load(path, model, opt, **kw))
    after = params_of(model)
    outcome["model_unchanged"] = same(before, after)
    outcome["secret_in_model"] = any(bool((v == SECRET_VALUE).any()) for v in after.values())
    return outcome


def _lin_weight_item(meta) -> tuple:
    """(storage index, chunk shape, dtype) of lin.weight's first stored chunk."""
    index = _first_storage(meta, "model.lin.weight")
    entry = meta.state_dict_metadata["model.lin.weight"]
    chunk = next(c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset))
    return index, tuple(chunk.sizes), entry.properties.dtype


def _secret_item(meta) -> bytes:
    """A valid DCP item for lin.weight's chunk, every element SECRET_VALUE:
    what a crafted checkpoint points at outside its directory, so that a
    read that left the directory would load it."""
    _, shape, dtype = _lin_weight_item(meta)
    blob = io.BytesIO()
    torch.save(torch.full(shape, SECRET_VALUE, dtype=dtype), blob)
    return blob.getvalue()


def _as_foreign(path: str, meta) -> None:
    """Writes `meta` as another tool's DCP: no checksum sidecar, so nothing
    but the checks of where a file is keeps an outside file's bytes out
    (zero_ext's checksums would refuse them anyway)."""
    os.remove(os.path.join(path, _dcp_save.SIDECAR))
    meta.storage_meta.save_id = "other"
    _put_metadata(path, meta)


def _point_outside(path: str, case: str) -> None:
    """lin.weight's item read from a secret beside the directory: by a
    relative path leaving it ("traversal") or an absolute one."""
    meta = _metadata(path)
    secret = os.path.join(os.path.dirname(path), "secret.bin")
    blob = _secret_item(meta)
    with open(secret, "wb") as f:
        f.write(blob)
    info = meta.storage_data[_lin_weight_item(meta)[0]]
    info.relative_path = "../secret.bin" if case == "traversal" else secret
    info.offset, info.length = 0, len(blob)
    _as_foreign(path, meta)


def _link_outside(path: str) -> None:
    """The data file a link to a secret beside the directory: a copy of it
    whose lin.weight item holds SECRET_VALUE (the same length)."""
    meta = _metadata(path)
    data = os.path.join(path, "__0_0.distcp")
    info = meta.storage_data[_lin_weight_item(meta)[0]]
    blob = _secret_item(meta)
    assert info.relative_path == "__0_0.distcp" and len(blob) == info.length, (info, len(blob))
    with open(data, "rb") as f:
        content = f.read()
    secret = os.path.join(os.path.dirname(path), "secret.distcp")
    with open(secret, "wb") as f:
        f.write(content[:info.offset] + blob + content[info.offset + info.length:])
    os.remove(data)
    os.symlink(secret, data)
    _as_foreign(path, meta)


def _evil_build(root: str, case: str, model, path: str) -> Dict[str, Any]:
    import pathlib
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(EVIL_BUILD)
    out = _load(path)
    out["marker"] = pathlib.Path("/etc").is_absolute() is not True  # the class was changed
    return out


def _strict_loading(root: str, case: str, model, path: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    bigger, bigger_opt = make(1, seed=3, more=True)
    out["missing"] = attempt(lambda: zero_ext.load(path, bigger, bigger_opt))
    bigger, bigger_opt = make(1, seed=3, more=True)
    out["nonstrict"] = attempt(lambda: zero_ext.load(path, bigger, bigger_opt, strict=False))
    out["nonstrict_loaded"] = torch.equal(zero_ext.full_state_dict(bigger)["lin.weight"],
                                          params_of(model)["lin.weight"])
    return out


def _model_only(root: str, case: str, model, path: str) -> Dict[str, Any]:
    """As a plain process writes a model with dcp.save."""
    import torch.distributed.checkpoint as dcp
    out: Dict[str, Any] = {}
    plain = os.path.join(os.path.dirname(path), "model-only")
    state = {"model": {k: v.clone() for k, v in params_of(model).items()}}
    dcp.save(state, checkpoint_id=plain, no_dist=True)
    out["refused"] = _load(plain)
    fresh, fresh_opt = make(1, seed=9)
    out["fresh"] = attempt(lambda: zero_ext.load(plain, fresh, fresh_opt, optimizer_class_mismatch="fresh"))
    out["fresh_loaded"] = same(params_of(fresh), params_of(model))
    return out


def _exists(root: str, case: str, model, path: str) -> Dict[str, Any]:
    os.makedirs(os.path.join(root, "dcp", "empty"), exist_ok=True)
    return {"ours": zero_ext.checkpoint_exists(path),
            "empty": zero_ext.checkpoint_exists(os.path.join(root, "dcp", "empty")),
            "torch": zero_ext.checkpoint_exists(os.path.join(root, "dcp", "model-only", "model-only"))}


# World-1 cases that report on their own; the others damage the save, then load it (world1).
_OWN_REPORT = {"evil-build": _evil_build, "strict": _strict_loading, "model-only": _model_only, "exists": _exists}


def _flip_a_byte(case: str, model, path: str) -> None:
    """Flips a byte of lin.weight's values in its data file."""
    meta = _metadata(path)
    info = meta.storage_data[_first_storage(meta, "model.lin.weight")]
    if case == "foreign-flipped-byte":  # no checksums: what weights_only and the shapes catch, only
        os.remove(os.path.join(path, _dcp_save.SIDECAR))
        meta.storage_meta.save_id = "other"
        _put_metadata(path, meta)
    values = params_of(model)["lin.weight"].numpy().tobytes()
    with open(os.path.join(path, info.relative_path), "r+b") as f:
        f.seek(info.offset)
        at = info.offset + f.read(info.length).find(values)  # the tensor's values in the item's zip
        assert at >= info.offset
        f.seek(at + 5)
        byte = f.read(1)
        f.seek(at + 5)
        f.write(bytes([byte[0] ^ 0x40]))


def _damage(root: str, case: str, model, path: str, marker: str) -> None:
    """Damages the saved checkpoint at `path` as `case` says."""
    if case == "fifo":  # a plain open would block forever on it
        data = os.path.join(path, "__0_0.distcp")
        os.remove(data)
        os.mkfifo(data)
    elif case == "evil-metadata":  # torch's own reader would run this
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(Evil(marker), f)
    elif case == "evil-item":  # a bytes item whose unpickling runs code
        meta = _metadata(path)
        index = _first_storage(meta, "extra.")
        blob = io.BytesIO()
        torch.save(Evil(marker), blob)
        data = os.path.join(path, "__9_0.distcp")
        with open(data, "wb") as f:
            f.write(blob.getvalue())
        info = meta.storage_data[index]
        info.relative_path, info.offset, info.length = "__9_0.distcp", 0, len(blob.getvalue())
        _put_metadata(path, meta)
        os.remove(os.path.join(path, _dcp_save.SIDECAR))  # as if another tool wrote it
        meta.storage_meta.save_id = "other"
        _put_metadata(path, meta)
    elif case in ("traversal", "absolute"):
        _point_outside(path, case)
    elif case == "data-symlink":
        _link_outside(path)
    elif case in ("flipped-byte", "foreign-flipped-byte"):
        _flip_a_byte(case, model, path)
    elif case == "truncated":
        os.truncate(os.path.join(path, "__0_0.distcp"), 100)
    elif case in ("overlap", "outside-shape"):
        meta = _metadata(path)
        chunks = meta.state_dict_metadata["model.lin.weight"].chunks
        if case == "overlap":
            chunks.append(type(chunks[0])(offsets=torch.Size([0, 0]), sizes=torch.Size([1, 1])))
        else:
            chunks[0].sizes = torch.Size([5, 5])
        _put_metadata(path, meta)
    elif case == "sidecar-of-another-save":
        _, _, other = _saved(root, case + "-2")
        shutil.copy(os.path.join(other, _dcp_save.SIDECAR), os.path.join(path, _dcp_save.SIDECAR))


def world1(root: str, case: str) -> Dict[str, Any]:
    model, opt, path = _saved(root, case)
    marker = os.path.join(os.path.dirname(path), "marker")
    if case in _OWN_REPORT:
        return _OWN_REPORT[case](root, case, model, path)
    _damage(root, case, model, path, marker)
    out = _load(path)
    out["marker"] = os.path.exists(marker)
    return out


def world2(root: str, case: str, rank: int, world: int) -> Dict[str, Any]:
    if case == "options-differ":  # one rank asks for DCP: every rank refuses, nothing written
        model, opt = make(2)
        path = os.path.join(root, "dcp-w2", case, "ckpt")
        out = attempt(lambda: zero_ext.save(path, model, opt, format="dcp" if rank else "zero_ext"))
        dist.barrier()
        out["written"] = os.path.exists(path) or bool(litter(path))
        return out
    if case == "async-then-load":  # a load waits for the save in flight on the same model
        model, opt = make(2)
        step(model, opt, rank)
        path = os.path.join(root, "dcp-w2", case, "ckpt")
        want = params_of(model)
        handle = zero_ext.save(path, model, opt, format="dcp", async_save=True)
        step(model, opt, rank)
        out = attempt(lambda: zero_ext.load(path, model, opt))
        out["same"] = same(params_of(model), want)
        out["done"] = handle.done()
        return out
    if case == "zero-size-and-scalar":  # a 0-d and a zero-size parameter's state round-trips through DCP
        out = {}
        for stage in (0, 1, 2, 3):
            def build(seed):
                model, opt = make(stage, seed=seed, zero_size=True, scalar=True)
                return model, opt
            model, opt = build(0)
            step(model, opt, rank)
            path = os.path.join(root, "dcp-w2", case, f"stage{stage}")
            zero_ext.save(path, model, opt, format="dcp")
            step(model, opt, rank)
            want = params_of(model)
            fresh, fresh_opt = build(5)
            loaded = attempt(lambda: zero_ext.load(path, fresh, fresh_opt))
            stepped = attempt(lambda: step(fresh, fresh_opt, rank)) if loaded["error"] is None else loaded
            out[f"stage{stage}"] = {"error": stepped["error"], "message": stepped["message"],
                                    "same": stepped["error"] is None and same(params_of(fresh), want)}
        return out
    if case == "two-models-async":  # two models' saves in flight at once: each its own exchange
        a, a_opt = make(2)
        b, b_opt = make(1, seed=3)
        step(a, a_opt, rank)
        step(b, b_opt, rank)
        where = os.path.join(root, "dcp-w2", case)
        want = {"a": params_of(a), "b": params_of(b)}
        first = zero_ext.save(os.path.join(where, "a"), a, a_opt, format="dcp", async_save=True)
        second = zero_ext.save(os.path.join(where, "b"), b, b_opt, async_save=True)
        (second if rank else first).wait()  # the ranks wait in opposite orders
        (first if rank else second).wait()
        out = {}
        for name, (stage, seed) in (("a", (2, 7)), ("b", (1, 8))):
            m, o = make(stage, seed=seed)
            got = attempt(lambda: zero_ext.load(os.path.join(where, name), m, o))
            out[name] = got["error"] is None and same(params_of(m), want[name])
        return out
    # async-fail-rank1: rank 1's writer fails in the background; every rank's wait() raises it
    model, opt = make(2)
    step(model, opt, rank)
    path = os.path.join(root, "dcp-w2", case, "ckpt")
    zero_ext.save(path, model, opt, extra="first", format="dcp")
    step(model, opt, rank)
    real = _dcp_save.write_rank_file

    def planted(*args, **kwargs):
        raise OSError("planted async-fail-rank1")
    if rank == 1:
        _dcp_save.write_rank_file = planted
    try:
        handle = zero_ext.save(path, model, opt, extra="second", format="dcp", async_save=True)
        out = attempt(handle.wait)
    finally:
        _dcp_save.write_rank_file = real
    again = attempt(handle.wait)  # the same error, again
    dist.barrier()
    out["again"] = again["error"]
    out["litter"] = litter(path)
    m, o = make(2, seed=4)
    out["previous"] = attempt(lambda: zero_ext.load(path, m, o))
    return out
