"""zero_ext.load_weights: pretrained weights streamed into a wrapped model,
each rank reading only the ranges its own shards hold.

A source is a state dict, a .safetensors file, a .pt/.bin file, or a
directory (Hugging Face's model.safetensors.index.json or
pytorch_model.bin.index.json and the files they name, or a single
model.safetensors / pytorch_model.bin). Safetensors are read by byte range
(safetensors.py: exactly the elements asked for); .pt/.bin files are
memory-mapped with weights_only=True, so only the pages a rank touches are
read and nothing but tensors is unpickled. Values are cast to what the rank
holds (the fp32 masters under mixed precision). Tied parameters load once,
from whichever of their names the source has.

Collective, in the phases of zero_ext.load: (A) open the source and check
names and shapes on every rank; (B) read this rank's ranges; each phase
ends with every rank learning every rank's error, so a failure on one raises
on all. Then the refresh of the compute copies (collective).
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Mapping, NamedTuple, Optional, Tuple, Union

import torch

from . import safetensors as st
from ...groups import Ranks
from ..plan import local_views, persistent_buffers
from ..safe_read import open_directory, open_regular, read_to_end
from .safetensors import NEVER_LINKS
from ...tools import require_bool, require_module, state_of, wait_for_snapshot

BIN_INDEX = "pytorch_model.bin.index.json"
_PLAIN_BIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}\.(bin|pt|pth)\Z")


class LoadedWeights(NamedTuple):
    """Like load_state_dict's result, with the bytes this rank read from files."""
    missing_keys: List[str]
    unexpected_keys: List[str]
    bytes_read: int


class _DictSource:
    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self.tensors = {}
        for name, value in state_dict.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"zero_ext.load_weights: state dict entry '{name}' is a {type(value).__name__}, "
                                "not a tensor")
            if value.is_meta:
                raise ValueError(f"zero_ext.load_weights: state dict entry '{name}' is on the meta device "
                                 "(it holds no values)")
            self.tensors[name] = value.detach()
        self.bytes_read = 0

    def keys(self) -> List[str]:
        return list(self.tensors)

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, start: int, length: int) -> torch.Tensor:
        return self.tensors[name].reshape(-1)[start:start + length]

    def close(self) -> None:
        pass


class _SafetensorsSource:
    def __init__(self, path: str, directory: bool):
        who = "zero_ext.load_weights"
        self.source = st.SafetensorsDirectory(path, who) if directory else st.SafetensorsFile(path, who)

    def keys(self) -> List[str]:
        return self.source.keys()

    def _file(self, name: str) -> st.SafetensorsFile:
        return self.source.file_of(name) if isinstance(self.source, st.SafetensorsDirectory) else self.source

    def shape(self, name: str) -> Tuple[int, ...]:
        return self._file(name).shape(name)

    def read(self, name: str, start: int, length: int) -> torch.Tensor:
        return self._file(name).read(name, start, length)

    @property
    def bytes_read(self) -> int:
        return self.source.bytes_read

    def close(self) -> None:
        self.source.close()


def _load_torch_file(name: str, dir_fd: Optional[int], shown: str) -> Dict[str, torch.Tensor]:
    """A .pt/.bin file of tensors, memory-mapped, weights_only. Opened once
    without following links; torch maps that same open file (/proc/self/fd)."""
    with open_regular(name, dir_fd, shown, "zero_ext.load_weights", NEVER_LINKS) as f:
        fd_path = f"/proc/self/fd/{f.fileno()}"
        target = fd_path if os.path.exists(fd_path) else shown
        try:
            value = torch.load(target, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:  # noqa: BLE001 - what the unpickler or the zip reader refused
            first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
            raise ValueError(
                f"zero_ext.load_weights: {shown} cannot be read by torch.load(weights_only=True, mmap=True): "
                f"it holds more than tensors (loading it could run code), or it is in torch's legacy format, "
                f"which cannot be memory-mapped (re-save it with torch.save) ({type(error).__name__}: {first})"
            ) from None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                 for k, v in value.items()):
        raise ValueError(f"zero_ext.load_weights: {shown} is not a flat mapping of names to tensors "
                         "(a state dict); pass the state dict inside it instead")
    return dict(value)


class _TorchFilesSource(_DictSource):
    """One .pt/.bin file, or a directory of them with Hugging Face's index."""

    def __init__(self, path: str, directory: bool):
        self.tensors: Dict[str, torch.Tensor] = {}
        self.bytes_read = 0
        if not directory:
            self.tensors = _load_torch_file(path, None, path)
            return
        dir_fd = open_directory(path)
        try:
            index_path = os.path.join(path, BIN_INDEX)
            try:
                f = open_regular(BIN_INDEX, dir_fd, index_path, "zero_ext.load_weights", NEVER_LINKS)
            except FileNotFoundError:
                self.tensors = _load_torch_file("pytorch_model.bin", dir_fd, os.path.join(path, "pytorch_model.bin"))
                return
            with f:
                raw = read_to_end(f, index_path, "zero_ext.load_weights", limit=st.MAX_HEADER)
            try:
                index = json.loads(raw.decode("utf-8"))
            except (RecursionError, ValueError) as error:
                raise ValueError(f"zero_ext.load_weights: {index_path} is not valid JSON "
                                 f"({type(error).__name__})") from None
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"zero_ext.load_weights: {index_path} has no weight_map object")
            for name, file in weight_map.items():
                if not isinstance(file, str) or not _PLAIN_BIN.match(file):
                    raise ValueError(f"zero_ext.load_weights: {index_path} maps '{name}' to {file!r}; an index "
                                     "may name only .bin/.pt files in its own directory (no paths)")
            for file in dict.fromkeys(weight_map.values()):
                loaded = _load_torch_file(file, dir_fd, os.path.join(path, file))
                for name, where in weight_map.items():
                    if where == file:
                        if name not in loaded:
                            raise ValueError(f"zero_ext.load_weights: {index_path} places '{name}' in {file}, "
                                             "which does not hold it")
                        self.tensors[name] = loaded[name]
        finally:
            os.close(dir_fd)


def _open_source(source) -> Union[_DictSource, _SafetensorsSource]:
    if isinstance(source, Mapping):
        return _DictSource(source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"zero_ext.load_weights: source must be a state dict, a file or a directory, "
                        f"got {type(source).__name__}")
    path = os.fspath(source)
    if os.path.isdir(path):
        if any(os.path.lexists(os.path.join(path, n)) for n in (st.INDEX, "model.safetensors")):
            return _SafetensorsSource(path, directory=True)
        if any(os.path.lexists(os.path.join(path, n)) for n in (BIN_INDEX, "pytorch_model.bin")):
            return _TorchFilesSource(path, directory=True)
        raise FileNotFoundError(f"zero_ext.load_weights: {path} holds none of {st.INDEX}, model.safetensors, "
                                f"{BIN_INDEX}, pytorch_model.bin")
    if path.endswith(".safetensors"):
        return _SafetensorsSource(path, directory=False)
    if path.endswith((".pt", ".pth", ".bin")):
        return _TorchFilesSource(path, directory=False)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"zero_ext.load_weights: {path} does not exist")
    raise ValueError(f"zero_ext.load_weights: {path}: expected a .safetensors, .pt, .pth or .bin file, or a "
                     "directory of them")


def _model_keys(model: torch.nn.Module) -> Tuple[Dict[int, List[str]], Dict[str, torch.Tensor]]:
    """Each parameter's names (tied ones have several), and the persistent
    buffers, without materializing anything (stage 3 shapes are kept)."""
    aliases: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    return aliases, persistent_buffers(model)


def _match_names(opened, aliases: Dict[int, List[str]], buffers: Dict[str, torch.Tensor],
                 params: Dict[int, torch.Tensor], strict: bool) -> Tuple[Dict[int, str], List[str], List[str]]:
    """Phase A's check: (the source's name read for each parameter, the
    missing keys, the unexpected ones); a shape mismatch raises, and so do
    missing or unexpected keys where strict."""
    available = set(opened.keys())
    chosen: Dict[int, str] = {}
    missing: List[str] = []
    for pid, names in aliases.items():
        found = [n for n in names if n in available]
        if found:
            chosen[pid] = found[0]
        else:
            missing.extend(names)
    missing += [n for n in buffers if n not in available]
    known = {n for names in aliases.values() for n in names} | set(buffers)
    unexpected = [n for n in opened.keys() if n not in known]
    mismatched = [f"'{name}': {list(opened.shape(name))} in the source, {list(params[pid].shape)} in the model"
                  for pid, name in chosen.items() if tuple(opened.shape(name)) != tuple(params[pid].shape)]
    mismatched += [f"'{n}': {list(opened.shape(n))} in the source, {list(b.shape)} in the model"
                   for n, b in buffers.items() if n in available and tuple(opened.shape(n)) != tuple(b.shape)]
    problems = []
    if mismatched:
        problems.append("size mismatch for " + "; ".join(mismatched))
    if strict and missing:
        problems.append("missing key(s): " + ", ".join(repr(n) for n in missing))
    if strict and unexpected:
        problems.append("unexpected key(s): " + ", ".join(repr(n) for n in unexpected))
    if problems:
        raise ValueError("zero_ext.load_weights: " + ". ".join(problems) +
                         (". With strict=False missing and unexpected keys are skipped" if not mismatched else ""))
    return chosen, missing, unexpected


@torch.no_grad()
def load_weights(model: torch.nn.Module, source, strict: bool = True) -> LoadedWeights:
    """Loads weights into a wrapped model from a state dict, a .safetensors
    or .pt/.bin file, or a Hugging Face directory; each rank reads only its
    ranges. Strict like load_state_dict (missing and unexpected keys raise;
    a shape mismatch always does). Collective. Returns the missing and
    unexpected keys and the bytes this rank read."""
    require_module(model, "zero_ext.load_weights", "zero_ext.load_weights(model, source)")
    state = state_of(model)
    if state.tensor_parallel is not None or state.experts is not None:  # every rank raises alike
        raise NotImplementedError(
            "zero_ext.load_weights: this version does not read weights into a tensor- or expert-parallel model; load the "
            "full tensors with zero_ext.load_full_state_dict(model, state_dict) (each rank keeps its part)")
    wait_for_snapshot(state)  # it writes what a save in flight may not have copied yet
    ranks = Ranks(state)
    opened = None
    try:
        # Phase A: open and check names and shapes; nothing changes yet.
        error = None
        try:
            require_bool(strict, "zero_ext.load_weights", "strict",
                         "pass strict=True (the default: missing and unexpected keys raise) or strict=False (they "
                         "are skipped)")
            opened = _open_source(source)
            aliases, buffers = _model_keys(model)
            available = set(opened.keys())
            params = {id(p): p for _, p in model.named_parameters(remove_duplicate=False)}
            chosen, missing, unexpected = _match_names(opened, aliases, buffers, params, strict)
        except Exception as e:  # noqa: BLE001 - raised on every rank by settle
            error = e
        ranks.settle(error)

        # Phase B: this rank's ranges.
        error = None
        try:
            bucketed = {id(p) for p in state.bucketed}
            for i, start, view in local_views(state):
                name = chosen.get(id(state.bucketed[i]))
                if name is not None:
                    view.copy_(opened.read(name, start, view.numel()).to(view.device, view.dtype))
            for pid, name in chosen.items():
                if pid not in bucketed:
                    p = params[pid]
                    p.detach().view(-1).copy_(opened.read(name, 0, p.numel()).to(p.device, p.dtype))
            for n, buf in buffers.items():
                if n in available:
                    buf.copy_(opened.read(n, 0, buf.numel()).view(buf.shape))
        except Exception as e:  # noqa: BLE001
            error = e
        ranks.settle(error, action="zero_ext.load_weights: reading the weights",
                     note="The model is partly loaded; load again before training")
        bytes_read = opened.bytes_read
    finally:
        if opened is not None:
            opened.close()
    state.handles.reduction.zero_grad(True)
    state.handles.checkpoint.refresh_params_from_shards()  # collective: every rank got here
    return LoadedWeights(missing, unexpected, bytes_read)
