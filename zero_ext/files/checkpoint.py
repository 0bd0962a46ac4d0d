"""zero_ext.save / zero_ext.load: sharded, atomic, loadable at any world size
and stage (the format, and how reading distrusts it, is in format.py).

Each rank writes only the elements it owns: for every bucket, the r-th equal
slice of its flat parameters (in stages 1-3 exactly the rank's shard; in
stage 0, where every rank holds everything, the same split, so ranks share
the writing). Values are the fp32 masters where they exist. Pieces are
indexed by parameter name and element range, not by rank or bucket, so a
loading rank reads the ranges of each parameter its own layout needs,
whatever world size, stage or bucket size wrote them.

Both are collective and run in phases; after each, every rank reports None
or its error to all (_Ranks.settle), so a failure anywhere raises everywhere
at the next exchange instead of leaving peers waiting for the timeout.

save: (0) inputs: the path is rank 0's and every rank must have passed the
same; `extra` must be something torch.load(weights_only=True) reads back;
nothing is written before all ranks agree. (1) every rank writes its files
into `PATH.tmp-<token>`. (2) rank 0 checks every rank's files are there with
their sizes, writes metadata.json (which makes a directory a checkpoint) and
renames the directory into place, moving an existing checkpoint aside first
and deleting it after. A failure removes the unfinished directory; a crash
at any point leaves either the old or the new checkpoint complete (see
publish.resolve).

load: (A) open and validate the checkpoint, check it against the model
(strictly by default) and read the small files; ranks also agree that they
opened the same save (its token). (B) read this rank's ranges into the model
and optimizer. Only then the collective refresh of parameters.
"""
from __future__ import annotations

import io
import os
import pickle
import shutil
import uuid
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from . import format as files
from . import publish
from .._state_dict import _state

class _Ranks:
    """Collectives of a save or load on the model's own group (which carries
    wrap()'s timeout), or nothing for a single process. They run through the
    core's communicator (ShardedModel.group_*), as its own collectives do, so
    a failure marks the group failed and a stalled wait is diagnosed.

    Objects travel pickled between the ranks of this job, as
    torch.distributed's object collectives carry them; nothing read from a
    file is ever unpickled."""

    def __init__(self, state):
        self.group = state.process_group
        # Over every rank of the mesh (hybrid: both levels); ranks by mesh rank.
        self.distributed = self.group is not None and state.mesh_size > 1
        self.rank = state.mesh_rank if self.distributed else 0
        self.world = state.mesh_size
        self.core = state.core
        # NCCL moves device tensors only; gloo takes host tensors.
        self.device = state.device if dist.is_initialized() and self.distributed and \
            dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    def _all_gather(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        out = torch.empty(self.world * tensor.numel(), dtype=tensor.dtype, device=self.device)
        self.core.mesh_all_gather(out, tensor, what)
        return out.view(self.world, -1)

    def gather(self, obj: Any) -> List[Any]:
        if not self.distributed:
            return [obj]
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        sizes = self._all_gather(torch.tensor([data.numel()], dtype=torch.int64, device=self.device),
                                 "checkpoint: exchanging payload sizes").view(-1).tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=self.device)
        padded[:data.numel()] = data
        everyone = self._all_gather(padded, "checkpoint: exchanging payloads").cpu()
        return [pickle.loads(everyone[r, :n].numpy().tobytes()) for r, n in enumerate(sizes)]

    def from_rank0(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        data = pickle.dumps(obj) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.core.mesh_broadcast_from_rank0(size, "checkpoint: rank 0's payload size")
        buffer = torch.zeros(int(size.item()), dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.core.mesh_broadcast_from_rank0(buffer, "checkpoint: rank 0's payload")
        return obj if self.rank == 0 else pickle.loads(buffer.cpu().numpy().tobytes())

    def settle(self, error: Optional[BaseException], payload: Any = None, action: Optional[str] = None,
               note: str = "", on_failure: Optional[Callable[[], None]] = None) -> List[Any]:
        """Ends a phase on every rank: each sends its payload and None or its
        error; returns every rank's payload, or raises on every rank if any
        failed. Call it after every phase also when the phase raised here, so
        no rank is left waiting in a later collective.

        With `action` (an I/O phase), every rank raises a RuntimeError naming
        the failing rank, the cause and the failing rank's `note` (what it
        cleaned up). Without, every rank raises the failing rank's kind of
        error (ValueError for bad input, ...) with its message. `on_failure`
        runs first, on every rank, when a failure was reported (not when a
        peer died: then nothing is known about its files)."""
        report = None if error is None else (type(error).__name__, str(error), note)
        outcomes = self.gather((report, payload))
        failed = [(r, rep) for r, (rep, _) in enumerate(outcomes) if rep is not None]
        if not failed:
            return [p for _, p in outcomes]
        if on_failure is not None:
            on_failure()
        rank, (kind, message, their_note) = failed[0]
        also = f" (and on rank(s) {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        if action is not None:
            raise RuntimeError(f"{action} failed on rank {rank}{also}: {kind}: {message}. {their_note}".rstrip()) \
                from error
        if not self.distributed:
            raise error
        kinds = {"ValueError": ValueError, "TypeError": TypeError, "FileNotFoundError": FileNotFoundError}
        raise kinds.get(kind, RuntimeError)(
            f"{message} [raised on rank {rank} of {self.world}{also}; every rank stopped]") from error


def _owned_ranges(state, rank: int) -> List[Tuple[int, int, int]]:
    """(param index, start, end) this rank writes: its equal slice of each
    bucket (the core's layout knows the arithmetic)."""
    raw = state.core.owned_ranges(rank)
    return [tuple(raw[k:k + 3]) for k in range(0, len(raw), 3)]


def _local_views(state) -> List[Tuple[int, int, torch.Tensor]]:
    """(param index, start in param, flat view) of every bucketed value this
    rank holds: fp32 masters or its parameter shard; in stage 0 without
    masters the parameters themselves."""
    if not state.sharded_optimizer:
        return [(i, 0, p.detach().view(-1)) for i, p in enumerate(state.bucketed)]
    shards = state.core.local_value_shards()
    raw = state.core.local_pieces()  # (param, start in param, bucket, start in its shard, length)
    return [(i, start, shards[b][at:at + length])
            for i, start, b, at, length in (raw[k:k + 5] for k in range(0, len(raw), 5))]


def _optimizer_pieces(state, optimizer) -> List[Tuple[torch.Tensor, int, int]]:
    """(optimizer tensor, param index, start in param) for each tensor the
    optimizer steps: this rank's segments, or whole parameters in stage 0.
    Once each: a parameter listed twice in a group has one state."""
    listed = list({id(p): p for g in optimizer.param_groups for p in g["params"]}.values())
    if not state.sharded_optimizer:
        index = {id(p): i for i, p in enumerate(state.bucketed)}
        return [(p, index[id(p)], 0) for p in listed if id(p) in index]
    segments = state.core.segments()
    owners = state.core.segment_param_indices()
    starts = state.core.segment_param_starts()
    by_id = {id(s): (i, st) for s, i, st in zip(segments, owners, starts)}
    return [(p, *by_id[id(p)]) for p in listed]


def _persistent_buffers(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    out = {}
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def _scalar(value: Any) -> Optional[dict]:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() == 0:
        if not files.storable(value.dtype) or value.dtype.is_complex:
            raise TypeError(f"zero_ext.save: cannot store scalar optimizer state of dtype {value.dtype}")
        return {"value": value.item(), "tensor": True, "dtype": files.dtype_name(value.dtype)}
    if isinstance(value, (int, float, bool)):
        return {"value": value, "tensor": False}
    return None


def _unscalar(spec: dict) -> Any:
    if spec["tensor"]:
        return torch.tensor(spec["value"], dtype=files.dtype_of(spec["dtype"]), device="cpu")
    return spec["value"]


# --- save ---------------------------------------------------------------------

def _is_safe(value: Any) -> bool:
    try:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, map_location="cpu", weights_only=True)
        return True
    except Exception:  # noqa: BLE001 - unpicklable, or refused by weights_only
        return False


def _first_unsafe(value: Any, where: str) -> Tuple[str, Any]:
    """The innermost entry of `value` that weights_only cannot read back."""
    if isinstance(value, dict):
        children = [(f"{where}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        children = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    else:
        children = []
    for at, child in children:
        if not _is_safe(child):
            return _first_unsafe(child, at)
    return where, value  # a leaf, or a container type weights_only refuses


def _checked_file(token: str, value: Any, label: str) -> bytes:
    """The bytes of a .pt file holding `value`, once torch.load(weights_only=True)
    has read them back: load reads nothing else, so this is checked at save."""
    try:
        blob = files.packed(token, value)
        torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        return blob
    except Exception:  # noqa: BLE001 - named precisely below
        pass
    where, bad = _first_unsafe(value, label)
    raise TypeError(
        f"zero_ext.save: {where} is a {type(bad).__module__}.{type(bad).__qualname__}, which "
        "torch.load(weights_only=True) cannot read back, and zero_ext.load reads checkpoints only that way "
        "(anything else could run code when loaded). It may hold tensors, numbers, strings, bools, None and "
        "lists, tuples and dicts of them (e.g. scheduler.state_dict(), torch.get_rng_state()): store the "
        "object's state_dict() or plain values instead. Nothing was written")


def _write_rank_files(tmp: str, model, optimizer, state, ranks: _Ranks, token: str,
                      blobs: Dict[str, bytes]) -> Tuple[List[dict], Dict[str, int]]:
    """This rank's files in `tmp`; returns its pieces and {file: size}.
    Hybrid: the replicas of a shard each write 1/R of what it owns, so the
    rows share the writing (and the files are named by mesh rank)."""
    rank = ranks.rank
    name = f"rank{rank}.bin"

    def my_part(lo: int, hi: int) -> Tuple[int, int]:
        step = -(-(hi - lo) // state.replicas)
        a = min(hi, lo + state.replica_rank * step)
        return a, min(hi, a + step)
    writer = files.ShardWriter(os.path.join(tmp, name), token)
    pieces: List[dict] = []

    def put(kind: str, param_name: str, start: int, tensor: torch.Tensor, key: str = "", **more) -> None:
        offset, dtype = writer.write(tensor)
        pieces.append(dict(kind=kind, name=param_name, key=key, start=start, length=tensor.numel(),
                           file=name, offset=offset, dtype=dtype, **more))

    names = state.bucketed_names
    owned = {}
    for i, start, end in _owned_ranges(state, state.shard_rank):
        owned.setdefault(i, []).append(my_part(start, end))
    for i, start, view in _local_views(state):
        for lo, hi in owned.get(i, []):
            a, b = max(lo, start), min(hi, start + view.numel())
            if a < b:
                put("param", names[i], a, view[a - start:b - start])
    if rank == 0:  # parameters not bucketed (frozen, stages 0-2 without mixed precision): full on every rank
        bucketed = {id(p) for p in state.bucketed}
        for n, p in model.named_parameters():
            if id(p) not in bucketed and p.numel():
                put("param", n, 0, p.detach().reshape(-1))

    for tensor, i, start in _optimizer_pieces(state, optimizer):
        st = optimizer.state.get(tensor)
        if not st:
            continue
        length = tensor.numel()
        # Sharded, a rank's state is its own; replicated (stage 0), every
        # rank has all of it and writes its owned ranges only.
        sharded = state.sharded_optimizer and not state.core.replicated()
        ranges = [my_part(start, start + length)] if sharded else owned.get(i, [])
        scalars = {k: _scalar(v) for k, v in st.items()}
        scalars = {k: v for k, v in scalars.items() if v is not None}
        flat = {k: v.detach().reshape(-1) for k, v in st.items()
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == length}
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() != length and rank == 0:
                put("whole", names[i], 0, v.reshape(-1), key=k, shape=list(v.shape))
        for lo, hi in ranges:
            a, b = max(lo, start), min(hi, start + length)
            if a >= b:
                continue
            pieces.append(dict(kind="scalars", name=names[i], start=a, length=b - a, values=scalars))
            for k, v in flat.items():
                put("state", names[i], a, v[a - start:b - start], key=k)
    writer.close()
    written = {name: writer.offset}
    for file, blob in blobs.items():
        files.write_file(os.path.join(tmp, file), blob)
        written[file] = len(blob)
    if rank == 0:  # buffers are tensors: always weights_only-safe, and written without a copy in memory
        buffers = os.path.join(tmp, "buffers.pt")
        with open(buffers, "wb") as f:
            values = {k: v.detach().cpu() for k, v in _persistent_buffers(model).items()}
            torch.save({"token": token, "value": values}, f)
            f.flush()
            os.fsync(f.fileno())
        written["buffers.pt"] = os.path.getsize(buffers)
    return pieces, written


def _stored_dtypes(model, state, pieces: List[dict]) -> Dict[str, str]:
    """Each parameter's dtype in the shard files: its pieces'; for a zero-size
    one (no pieces), what a piece of it would have been."""
    out = {p["name"]: p["dtype"] for p in pieces if p["kind"] == "param"}
    bucketed = {id(p) for p in state.bucketed}
    masters = state.core.has_masters()
    for n, p in model.named_parameters():
        if n not in out:
            out[n] = files.dtype_name(torch.float32 if masters and id(p) in bucketed else p.dtype)
    return out


def _metadata(model, optimizer, state, token: str, pieces: List[dict], sizes: Dict[str, int]) -> dict:
    group_of = {}
    index = {id(p): i for i, p in enumerate(state.bucketed)}
    for g_index, members in enumerate(_optimizer_pieces_by_group(state, optimizer)):
        for i in members:
            group_of[i] = g_index
    params = []
    aliases: Dict[int, List[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    dtypes = _stored_dtypes(model, state, pieces)
    for n, p in model.named_parameters():
        i = index.get(id(p))
        params.append({
            "name": n, "aliases": aliases[id(p)], "shape": list(p.shape), "dtype": dtypes[n],
            "trainable": p.requires_grad, "group": group_of.get(i) if i is not None else None,
        })
    scaler = state.core.loss_scaler_state()
    return {
        "format": files.FORMAT, "version": files.VERSION, "token": token,
        "world_size": state.mesh_size, "stage": state.stage,
        "compute_dtype": None if state.compute_dtype is None else files.dtype_name(state.compute_dtype),
        "offload": state.offload,
        "loss_scaler": {"scale": scaler[0], "clean_steps": int(scaler[1]), "skipped_steps": int(scaler[2])},
        "params": params,
        "files": sizes,
        "pieces": pieces,
    }


def _optimizer_pieces_by_group(state, optimizer) -> List[List[int]]:
    pieces = _optimizer_pieces(state, optimizer)
    owner = {id(t): i for t, i, _ in pieces}
    return [[owner[id(p)] for p in g["params"] if id(p) in owner] for g in optimizer.param_groups]


def _check_written(tmp: str, world: int, gathered: List[Tuple[List[dict], Dict[str, int]]]) -> Dict[str, int]:
    """Rank 0: every rank's files are in `tmp` with the sizes that rank wrote
    (ranks writing to different filesystems, or a file lost, end here)."""
    reported = {}
    for rank, (_, written) in enumerate(gathered):
        for name, size in written.items():
            reported[name] = (rank, size)
    sizes = {}
    for name in files.file_names(world):
        if name not in reported:
            raise RuntimeError(f"zero_ext.save: no rank reported writing {name} (zero_ext bug)")
        rank, size = reported[name]
        full = os.path.join(tmp, name)
        actual = os.path.getsize(full) if os.path.isfile(full) else None
        if actual != size:
            seen = "is missing" if actual is None else f"has {actual} bytes, not {size}"
            raise RuntimeError(
                f"zero_ext.save: {name}, written by rank {rank}, {seen} in {tmp} as rank 0 sees it: every rank "
                "must write to the same shared filesystem at this path")
        sizes[name] = size
    return sizes


def save(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: Any = None) -> None:
    """Writes a sharded checkpoint directory at `path`, atomically: every rank
    writes its own shards; the directory appears (replacing an older
    checkpoint) only once all ranks have finished. Collective: call on every
    rank with the same path. `extra` (per rank) may hold what
    torch.load(weights_only=True) reads: tensors, numbers, strings, None,
    lists, tuples and dicts of them."""
    state = _state(model)
    ranks = _Ranks(state)
    token = ranks.from_rank0(uuid.uuid4().hex)

    # Phase 0: every input checked on every rank; nothing written yet.
    error, target, blobs = None, None, {}
    try:
        if getattr(optimizer, "_zero_ext", None) is not state:
            raise ValueError("zero_ext.save: this optimizer was not wrapped together with this model")
        target = os.path.abspath(os.fspath(path))
        blobs[f"extra-rank{ranks.rank}.pt"] = _checked_file(token, extra, "extra")
        if ranks.rank == 0:
            publish.check_target(target)
            groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            blobs["optimizer.pt"] = _checked_file(
                token, {"class": type(optimizer).__mro__[1].__name__, "param_groups": groups}, "optimizer")
    except Exception as e:  # noqa: BLE001 - raised on every rank by settle
        error = e
    targets = ranks.settle(error, target)
    if any(t != targets[0] for t in targets):
        listed = ", ".join(f"rank {r}: {t}" for r, t in enumerate(targets))
        raise ValueError(f"zero_ext.save: ranks passed different paths ({listed}); a save writes one checkpoint "
                         "at rank 0's path, so pass the same path on every rank. Nothing was written")

    # Phase 1: every rank's files into the staging directory.
    tmp = f"{target}.tmp-{token[:12]}"
    error, pieces, written = None, [], {}
    try:
        os.makedirs(tmp, exist_ok=True)
        pieces, written = _write_rank_files(tmp, model, optimizer, state, ranks, token, blobs)
    except Exception as e:  # noqa: BLE001
        error = e
    publish.maybe_die("after_shards", ranks.rank)

    def remove_tmp() -> None:
        if ranks.rank == 0:  # every rank has stopped writing by now
            shutil.rmtree(tmp, ignore_errors=True)
    gathered = ranks.settle(error, (pieces, written), action=f"zero_ext.save: writing {target}",
                            note=f"The unfinished {tmp} was removed and the previous checkpoint, if any, is untouched",
                            on_failure=remove_tmp)

    # Phase 2: rank 0 checks, writes the metadata and publishes.
    error, note = None, ""
    if ranks.rank == 0:
        try:
            sizes = _check_written(tmp, state.mesh_size, gathered)
            meta = _metadata(model, optimizer, state, token, [p for ps, _ in gathered for p in ps], sizes)
        except Exception as e:  # noqa: BLE001
            shutil.rmtree(tmp, ignore_errors=True)
            error = e
            note = f"Nothing was published: {tmp} was removed and the previous checkpoint, if any, is untouched"
        else:
            error, note = publish.publish(target, tmp, token, meta)
    ranks.settle(error, action=f"zero_ext.save: publishing {target}", note=note)  # nobody returns before it is in place


# --- load ---------------------------------------------------------------------

def _check_same_model(where: str, meta: dict, model: torch.nn.Module, buffers: Dict[str, Any],
                      strict: bool) -> None:
    """Like nn.Module.load_state_dict: names must match unless not strict;
    shapes always (a saved (1,) never broadcasts into a (4,))."""
    saved = {p["name"]: tuple(p["shape"]) for p in meta["params"]}
    saved.update({n: tuple(b.shape) for n, b in buffers.items()})
    mine = {n: tuple(p.shape) for n, p in model.named_parameters()}
    mine.update({n: tuple(b.shape) for n, b in _persistent_buffers(model).items()})
    missing = sorted(set(mine) - set(saved)) if strict else []
    unexpected = sorted(set(saved) - set(mine)) if strict else []
    shapes = sorted(n for n in set(mine) & set(saved) if mine[n] != saved[n])
    if not (missing or unexpected or shapes):
        return
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {missing[:8]}")
    if unexpected:
        problems.append(f"unexpected in it: {unexpected[:8]}")
    if shapes:
        problems.append("shapes differ: " + ", ".join(f"{n} saved {saved[n]} vs model {mine[n]}" for n in shapes[:8]))
    fix = ("; pass strict=False to load only the entries both have (shapes must still match)"
           if missing or unexpected else "; build the model with the shapes it was saved with")
    raise RuntimeError(f"zero_ext.load: {where} was saved from a different model: {'; '.join(problems)}{fix}")


def _saved_buffers(checkpoint) -> Dict[str, torch.Tensor]:
    buffers = checkpoint.load_pt("buffers.pt")
    if not isinstance(buffers, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in buffers.items()):
        raise ValueError(f"zero_ext.load: {checkpoint.path('buffers.pt')} is not a name -> tensor mapping; "
                         "restore the checkpoint from a good copy")
    return buffers


def _saved_groups(checkpoint, optimizer) -> List[dict]:
    saved = checkpoint.load_pt("optimizer.pt")
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not all(isinstance(g, dict) and all(isinstance(k, str) for k in g)
                                               for g in groups):
        raise ValueError(f"zero_ext.load: {checkpoint.path('optimizer.pt')} holds no list of param groups; "
                         "restore the checkpoint from a good copy")
    if len(groups) != len(optimizer.param_groups):
        raise RuntimeError(
            f"zero_ext.load: {checkpoint.where} has {len(groups)} optimizer param groups, this optimizer "
            f"{len(optimizer.param_groups)}; build the optimizer with the same groups")
    return groups


def _wanted_files(reader, state, model, optimizer, loaded: Set[str]) -> Set[str]:
    """The shard files holding any range this rank will read."""
    wanted: Dict[str, List[Tuple[int, int]]] = {}
    names = state.bucketed_names
    for i, start, view in _local_views(state):
        wanted.setdefault(names[i], []).append((start, view.numel()))
    bucketed = {id(p) for p in state.bucketed}
    for n, p in model.named_parameters():
        if id(p) not in bucketed:
            wanted.setdefault(n, []).append((0, p.numel()))
    for tensor, i, start in _optimizer_pieces(state, optimizer):
        wanted.setdefault(names[i], []).append((start, tensor.numel()))
    out = set()
    for (kind, name, key), pieces in reader.pieces.items():
        if kind == "scalars" or name not in loaded:
            continue
        for start, length in wanted.get(name, []):
            out.update(reader.files_for(kind, name, 0 if kind == "whole" else start,
                                        pieces[0]["length"] if kind == "whole" else length, key))
    return out


@torch.no_grad()
def load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, strict: bool = True) -> Any:
    """Loads a checkpoint written by zero_ext.save at any world size and
    stage into a wrapped model and optimizer; returns this rank's `extra`
    (rank 0's for a rank the writer did not have). Strict like
    nn.Module.load_state_dict: with strict=False, parameters and buffers
    missing on either side are skipped (shapes must still match). Reads
    nothing outside the checkpoint and unpickles only with
    weights_only=True. Collective."""
    state = _state(model)
    ranks = _Ranks(state)
    checkpoint = None
    try:
        # Phase A: open and validate; nothing in the model changes yet.
        error, token = None, None
        try:
            if getattr(optimizer, "_zero_ext", None) is not state:
                raise ValueError("zero_ext.load: this optimizer was not wrapped together with this model")
            checkpoint = files.Checkpoint(os.path.abspath(os.fspath(path)), "zero_ext.load")
            token, meta, where = checkpoint.token, checkpoint.meta, checkpoint.where
            reader = files.PieceReader(checkpoint)
            loaded = {p["name"] for p in meta["params"]}
            # A reader rank the writer did not have gets rank 0's extra; one it had gets its own.
            extra_file = f"extra-rank{ranks.rank if ranks.rank < meta['world_size'] else 0}.pt"
            # Every file this rank reads is opened before any is read: a save
            # that replaces the path from now on cannot change what is read.
            for file in ["buffers.pt", "optimizer.pt", extra_file] + sorted(
                    _wanted_files(reader, state, model, optimizer, loaded)):
                checkpoint.open(file)
            buffers = _saved_buffers(checkpoint)
            _check_same_model(where, meta, model, buffers, strict)
            groups = _saved_groups(checkpoint, optimizer)
            extra = checkpoint.load_pt(extra_file)
        except Exception as e:  # noqa: BLE001 - raised on every rank by settle
            error = e
        tokens = ranks.settle(error, token)
        if any(t != tokens[0] for t in tokens):
            raise RuntimeError(f"zero_ext.load: ranks opened different saves at {path}: it was replaced during "
                               "this load. Nothing was loaded; load again")

        # Phase B: this rank's ranges into the model and optimizer.
        error = None
        try:
            names = state.bucketed_names
            for i, start, view in _local_views(state):
                if names[i] in loaded:
                    view.copy_(reader.read("param", names[i], start, view.numel(), dtype=view.dtype))
            bucketed = {id(p) for p in state.bucketed}
            for n, p in model.named_parameters():
                if id(p) not in bucketed and n in loaded:
                    p.detach().view(-1).copy_(reader.read("param", n, 0, p.numel(), dtype=p.dtype))
            _load_optimizer(where, reader, state, optimizer, groups, loaded)
            for n, buf in _persistent_buffers(model).items():
                if n in buffers:
                    buf.copy_(buffers[n])
        except Exception as e:  # noqa: BLE001
            error = e
        ranks.settle(error, action=f"zero_ext.load: reading {where}",
                     note="The model and optimizer are partly loaded; load a good checkpoint before training")
    finally:
        if checkpoint is not None:
            checkpoint.close()
    state.core.zero_grad(True)
    state.core.refresh_params_from_shards()  # collective: every rank got here
    scaler = meta["loss_scaler"]
    state.core.restore_loss_scaler(float(scaler["scale"]), int(scaler["clean_steps"]), int(scaler["skipped_steps"]))
    return extra


def _load_optimizer(where: str, reader, state, optimizer, groups: List[dict], loaded: Set[str]) -> None:
    for mine, theirs in zip(optimizer.param_groups, groups):
        mine.update({k: v for k, v in theirs.items() if k != "params"})
    optimizer.state.clear()
    names = state.bucketed_names
    for tensor, i, start in _optimizer_pieces(state, optimizer):
        name, length = names[i], tensor.numel()
        if name not in loaded:
            continue  # strict=False: a parameter the checkpoint lacks starts fresh
        scalars = reader.scalars(name, start, length)
        keys = reader.keys("state", name)
        if not scalars and not keys:
            continue  # never stepped (or zero-size: nothing to restore)
        st = {}
        for key, spec in scalars.items():
            st[key] = _unscalar(spec)
        for key in keys:
            st[key] = reader.read("state", name, start, length, key=key).view(tensor.shape).to(tensor.device)
        for key in reader.keys("whole", name):
            if state.sharded_optimizer and not state.core.replicated():
                raise RuntimeError(
                    f"zero_ext.load: optimizer state '{key}' of '{name}' in {where} is not "
                    "elementwise and cannot be sharded; load it at stage 0")
            st[key] = reader.read_whole(name, key).to(tensor.device)
        optimizer.state[tensor] = st
