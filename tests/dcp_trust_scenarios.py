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
from checkpoint_trust_scenarios import Evil, _secret, attempt, litter, make, params_of, same, step
from zero_ext.files.dcp import save as _dcp_save

WORLD1_CASES = ["evil-metadata", "evil-build", "evil-item", "traversal", "absolute", "data-symlink", "fifo",
                "flipped-byte", "truncated", "overlap", "outside-shape", "sidecar-of-another-save",
                "foreign-flipped-byte", "strict", "model-only", "exists"]
WORLD2_CASES = ["async-fail-rank1", "options-differ", "async-then-load", "zero-size-and-scalar", "two-models-async"]

# A pickle that sets an attribute on an allowlisted class (BUILD with slot
# state on pathlib.PosixPath): refused, and the class untouched after.
EVIL_BUILD = b"cpathlib\nPosixPath\n(N(dS'is_absolute'\nctorch\nSize\nstb."


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
    outcome["model_unchanged"] = same(before, params_of(model))
    return outcome


def world1(root: str, case: str) -> Dict[str, Any]:
    model, opt, path = _saved(root, case)
    marker = os.path.join(os.path.dirname(path), "marker")
    out: Dict[str, Any] = {}
    if case == "evil-build":
        import pathlib
        with open(os.path.join(path, ".metadata"), "wb") as f:
            f.write(EVIL_BUILD)
        out = _load(path)
        out["marker"] = pathlib.Path("/etc").is_absolute() is not True  # the class was changed
        return out
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
        secret = _secret(os.path.dirname(path))
        meta = _metadata(path)
        info = meta.storage_data[_first_storage(meta, "model.lin.weight")]
        info.relative_path = "../secret.bin" if case == "traversal" else secret
        _put_metadata(path, meta)
    elif case == "data-symlink":
        secret = _secret(os.path.dirname(path))
        data = os.path.join(path, "__0_0.distcp")
        os.remove(data)
        os.symlink(secret, data)
    elif case in ("flipped-byte", "foreign-flipped-byte"):
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
    elif case == "strict":
        bigger, bigger_opt = make(1, seed=3, more=True)
        out["missing"] = attempt(lambda: zero_ext.load(path, bigger, bigger_opt))
        bigger, bigger_opt = make(1, seed=3, more=True)
        out["nonstrict"] = attempt(lambda: zero_ext.load(path, bigger, bigger_opt, strict=False))
        out["nonstrict_loaded"] = torch.equal(zero_ext.full_state_dict(bigger)["lin.weight"],
                                              params_of(model)["lin.weight"])
        return out
    elif case == "model-only":  # as a plain process writes a model with dcp.save
        import torch.distributed.checkpoint as dcp
        plain = os.path.join(os.path.dirname(path), "model-only")
        state = {"model": {k: v.clone() for k, v in params_of(model).items()}}
        dcp.save(state, checkpoint_id=plain, no_dist=True)
        out["refused"] = _load(plain)
        fresh, fresh_opt = make(1, seed=9)
        out["fresh"] = attempt(lambda: zero_ext.load(plain, fresh, fresh_opt, optimizer_class_mismatch="fresh"))
        out["fresh_loaded"] = same(params_of(fresh), params_of(model))
        return out
    elif case == "exists":
        os.makedirs(os.path.join(root, "dcp", "empty"), exist_ok=True)
        return {"ours": zero_ext.checkpoint_exists(path),
                "empty": zero_ext.checkpoint_exists(os.path.join(root, "dcp", "empty")),
                "torch": zero_ext.checkpoint_exists(os.path.join(root, "dcp", "model-only", "model-only"))}
    out = _load(path)
    out["marker"] = os.path.exists(marker)
    out["secret_in_model"] = False
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
