"""zero_ext.save_weights: a wrapped model's weights as safetensors that the
safetensors package and transformers' from_pretrained read, written one
bucket at a time (memory: one bucket's full values, at most a unit).

A path ending in .safetensors gets one file. Any other path is a directory
in Hugging Face's layout: model.safetensors, or, past max_shard_size,
model-0000k-of-0000K.safetensors plus model.safetensors.index.json. Each file
appears complete or not at all (written aside, then renamed); the index is
written last, and weight files of an earlier save that the new one does not
list are removed after it. A transformers model's directory also gets
config.json (and generation_config.json when it has one) after the weights,
as save_pretrained writes them: from_pretrained(path) reads the result.

Collective: every rank takes part in the gathers; rank 0 writes. A write
error on rank 0 raises on every rank at the end, never leaving one waiting.
"""
from __future__ import annotations

import collections
import copy
import inspect
import os
import sys
import weakref
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from . import safetensors as st
from ...groups import Ranks
from ..plan import persistent_buffers
from ...tools import require_module, state_of
from ...runtime import full_state_dict

def _entries(model, state, dtype: Optional[torch.dtype]):
    """(name, dtype, shape, source) in the order they are written: the
    bucketed parameters bucket by bucket, then other parameters, then the
    persistent buffers; each tied parameter once, under its first name."""
    def cast(t_dtype: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and t_dtype.is_floating_point else t_dtype

    # Without mixed precision the model's own dtype; with it, the masters' (fp32).
    masters = state.handles.optimizer.has_masters()
    out: List[Tuple[str, torch.dtype, Tuple[int, ...], object]] = []
    for i, (name, p) in enumerate(zip(state.bucketed_names, state.bucketed)):
        out.append((name, cast(torch.float32 if masters else p.dtype), tuple(p.shape), ("bucketed", i)))
    bucketed = {id(p) for p in state.bucketed}
    seen = set(bucketed)
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, cast(p.dtype), tuple(p.shape), ("plain", p)))
    for name, buf in persistent_buffers(model).items():
        out.append((name, cast(buf.dtype), tuple(buf.shape), ("plain", buf)))
    return out


@torch.no_grad()
def save_weights(model: torch.nn.Module, path, dtype: Optional[torch.dtype] = None,
                 max_shard_size: Union[int, str] = "5GB") -> None:
    """Writes the model's full weights (fp32 masters under mixed precision,
    or cast to `dtype`) as safetensors; see the module's docstring."""
    require_module(model, "zero_ext.save_weights", "zero_ext.save_weights(model, path)")
    state = state_of(model)
    if state.tensor_parallel is not None or state.experts is not None:  # every rank raises alike
        raise NotImplementedError(
            "zero_ext.save_weights: this version does not write a tensor- or expert-parallel model's weights as safetensors; "
            "zero_ext.full_state_dict(model) gives the full tensors on every rank, or zero_ext.save then "
            "python -m zero_ext.convert CKPT OUT --format safetensors writes them")
    ranks = Ranks(state)
    path = os.fspath(path)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"zero_ext.save_weights: dtype must be a floating torch.dtype or None, got {dtype!r}")
    limit = st.parse_size(max_shard_size, "zero_ext.save_weights")
    entries = _entries(model, state, dtype)
    writer: Optional[st.ModelWriter] = None
    error: Optional[BaseException] = None

    def put(i: int, value: torch.Tensor) -> None:
        nonlocal error, writer
        if ranks.rank != 0 or error is not None:
            return  # rank 0 writes; after an error it only keeps up with the gathers
        try:
            if writer is None:
                writer = st.ModelWriter(path, [(name, d, shape) for name, d, shape, _ in entries], limit)
            writer.put(i, value)
        except BaseException as e:  # noqa: BLE001 - reported to every rank below
            error = e

    layout = state.handles.reduction.bucket_layout()  # (first, count, padded) per bucket
    for b in range(len(layout) // 3):
        first, count = layout[3 * b], layout[3 * b + 1]
        values = state.handles.checkpoint.full_masters_of([b])  # collective: every rank gathers this bucket
        for k in range(count):
            put(first + k, values[k])
        del values
    for i in range(len(state.bucketed), len(entries)):
        put(i, entries[i][3][1].detach())
    if writer is not None:
        try:
            if error is None:
                writer.finish()
                if not path.endswith(".safetensors"):
                    _write_pretrained_config(model, path, _written_dtype(entries))
        except BaseException as e:  # noqa: BLE001
            error = e
        writer.abort()  # files not finished go; complete ones stay
    ranks.settle(error, action=f"zero_ext.save_weights: writing {path}",
                 note="Files already complete are left in place; the index is written last")


def _written_dtype(entries) -> Optional[torch.dtype]:
    """The floating dtype the weights were written in (transformers'
    model.dtype: the first floating parameter's)."""
    return next((d for _, d, _, _ in entries if d.is_floating_point), None)


def _write_pretrained_config(model: torch.nn.Module, directory: str, dtype: Optional[torch.dtype]) -> None:
    """Rank 0, after the weights: a transformers model's config.json, saying
    the class it had before wrap() and the dtype just written, and its
    generation_config.json if it has one (save_pretrained writes both; without
    config.json from_pretrained cannot tell the architecture). The model's own
    config is left as it is."""
    if _library_of(model) != "transformers" or getattr(model, "config", None) is None:
        return
    config = copy.deepcopy(model.config)
    export = vars(model).get("save_pretrained")
    config.architectures = [export.class_name if isinstance(export, PretrainedExport) else type(model).__name__]
    _declare_dtype(config, dtype)
    config.save_pretrained(directory)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(directory)


def _declare_dtype(config: Any, dtype: Optional[torch.dtype]) -> None:
    """config's dtype field as save_pretrained sets it (transformers:
    ``dtype``; before 4.56: ``torch_dtype``)."""
    if dtype is not None:
        field = "torch_dtype" if "torch_dtype" in vars(config) and "dtype" not in vars(config) else "dtype"
        setattr(config, field, str(dtype).split(".")[1])


# --- Exports through the libraries' own savers ---------------------------------
# Under mixed precision a wrapped model's parameters hold the compute-dtype
# copies the forward uses (model.state_dict() returns those); the trained
# values are the fp32 masters. Exports must write the masters, as the same
# run under DDP (fp32 parameters, autocast) writes fp32.

def export_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The state_dict an export of a wrapped model writes: model.state_dict()
    with the fp32 masters in place of the compute-dtype copies under mixed
    precision (full shape, on CPU). The names of one tied parameter share one
    tensor, as in model.state_dict(), so savers that drop shared tensors
    (transformers, accelerate) drop the same names as under DDP; an
    OrderedDict as model.state_dict() is (accelerate's save drops them only
    from one). Collective under mixed precision or at stage 3: every rank
    calls it."""
    state = state_of(model)
    if state.tensor_parallel is not None or state.experts is not None:  # model.state_dict() holds parts
        raise NotImplementedError(
            "zero_ext: this version does not export a tensor- or expert-parallel model's weights (save_pretrained, an "
            "integration's state_dict); zero_ext.full_state_dict(model) gives the full tensors on every rank")
    if not state.handles.optimizer.has_masters():
        return model.state_dict()
    full = collections.OrderedDict(full_state_dict(model))
    first: Dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in full:
            full[name] = first.setdefault(id(p), full[name])
    return full


def _library_of(model: torch.nn.Module) -> Optional[str]:
    """'transformers' for a PreTrainedModel, 'peft' for a PeftModel, else None.
    Looked up in sys.modules: a model of the library means it is imported."""
    for library, name in (("transformers", "PreTrainedModel"), ("peft", "PeftModel")):
        module = sys.modules.get(library)
        cls = getattr(module, name, None) if module is not None else None
        if isinstance(cls, type) and isinstance(model, cls):
            return library
    return None


class PretrainedExport:
    """The save_pretrained of a wrapped transformers or peft model, set on
    the model by wrap() (an attribute of the instance; the class's method is
    called inside). The class's own would write model.state_dict() (under
    mixed precision: the compute-dtype copies), and transformers also writes
    the parameters' dtype and zero_ext's subclass name (ZeroExt...) into
    config.json. This one passes the fp32 masters as ``state_dict`` unless
    one is given, and config.json says what the unwrapped model's would: the
    dtype and class the model had before wrap(). Collective under mixed
    precision or at stage 3 (call it on every rank, with is_main_process as
    transformers asks); transformers writes from rank 0."""

    def __init__(self, model: torch.nn.Module, dtype: Optional[torch.dtype], library: str) -> None:
        self._model = weakref.ref(model)  # the model holds this object
        self._function = type(model).save_pretrained
        self._signature = inspect.signature(self._function)
        self._var_keyword = next((n for n, p in self._signature.parameters.items()
                                  if p.kind is inspect.Parameter.VAR_KEYWORD), None)
        self._library = library
        self.dtype = dtype  # what the unwrapped model's .dtype said
        self.class_name = type(model).__name__  # before wrap() swaps the class
        self.__doc__ = self._function.__doc__
        self.__signature__ = inspect.signature(self._function.__get__(model))

    def describe(self, config: Any) -> None:
        """Sets config's dtype and architectures as the unwrapped model's
        save_pretrained sets them (transformers: ``dtype``; before 4.56:
        ``torch_dtype``)."""
        _declare_dtype(config, self.dtype)
        config.architectures = [self.class_name]

    def __call__(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        model = self._model()
        bound = self._signature.bind(model, save_directory, *args, **kwargs)
        arguments = bound.arguments
        if self._var_keyword is not None:
            arguments.setdefault(self._var_keyword, {})
        # transformers names state_dict; peft reads it from **kwargs.
        where = arguments if "state_dict" in self._signature.parameters else arguments.get(self._var_keyword, {})
        if arguments.get("push_to_hub") or arguments.get(self._var_keyword, {}).get("push_to_hub"):
            raise ValueError(
                "zero_ext: save_pretrained(push_to_hub=True) of a wrapped model is not supported: the library "
                "uploads before zero_ext writes config.json's dtype and class as the unwrapped model would. "
                "Call save_pretrained(directory) on every rank, then upload the directory from one rank "
                "(huggingface_hub.upload_folder)")
        if where.get("state_dict") is None and state_of(model).handles.optimizer.has_masters():
            where["state_dict"] = export_state_dict(model)  # collective: before any rank writes
        result = self._function(*bound.args, **bound.kwargs)
        if self._library == "transformers" and not getattr(model, "_hf_peft_config_loaded", False):
            # transformers wrote config.json with model.dtype (the compute
            # dtype) and type(model).__name__; write it again as DDP's would be.
            self.describe(model.config)
            is_main = arguments.get("is_main_process", True)
            should_save = getattr(model, "should_save_on_this_rank", None)
            if should_save(is_main) if callable(should_save) else is_main:
                model.config.save_pretrained(save_directory)
        return result


def install_pretrained_export(model: torch.nn.Module, dtype: Optional[torch.dtype]) -> None:
    """wrap(), before it swaps the model's class: a transformers or peft
    model gets PretrainedExport as its save_pretrained. `dtype`: the model's
    first floating parameter's dtype before wrap() (transformers' model.dtype)."""
    library = _library_of(model)
    if library is not None and callable(getattr(type(model), "save_pretrained", None)):
        model.save_pretrained = PretrainedExport(model, dtype, library)


def describe_pretrained_config(model: torch.nn.Module, config: Any) -> None:
    """config's dtype and architectures as the unwrapped model's save_pretrained
    would write them (for savers that write config.json themselves)."""
    export = vars(model).get("save_pretrained")
    if isinstance(export, PretrainedExport):
        export.describe(config)
