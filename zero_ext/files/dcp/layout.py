"""Where a model's and optimizer's entries sit in a DCP checkpoint.

Two layouts, both as DCP flattens nested state dicts (keys joined by "."):
- "get_state_dict" (the default; FSDP2 and DDP code that saves
  `{"model": msd, "optim": osd}` from torch.distributed.checkpoint.state_dict
  .get_state_dict): `model.<param>`, `optim.state.<param>.<key>`,
  `optim.param_groups.<i>.<hyperparameter>` and `optim.param_groups.<i>.params`
  (the group's parameter names);
- "torchtitan" (torchtitan's CheckpointManager): model entries at the top
  level (`<param>`), the optimizer flattened by get_optimizer_state_dict's
  flatten_optimizer_state_dict option (`optimizer.state.<param>.<key>`,
  `optimizer.param_groups.<param>.<hyperparameter>`), and the trainer's own
  entries beside them ("lr_scheduler", "dataloader", "train_state").
Reading recognises either, whoever wrote it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch

LAYOUTS = ("get_state_dict", "torchtitan")
Path = Tuple[Union[str, int], ...]


@dataclass(frozen=True)
class Layout:
    name: str
    model: str  # prefix of model entries
    optimizer: str  # prefix of optimizer entries, with its dot

    def model_key(self, param: str) -> Tuple[str, Path]:
        return self.model + param, (("model", param) if self.model else (param,))

    def state_key(self, param: str, key: str) -> Tuple[str, Path]:
        flat = f"{self.optimizer}state.{param}.{key}"
        if self.name == "torchtitan":
            return flat, ("optimizer", f"state.{param}.{key}")
        return flat, ("optim", "state", param, key)

    def group_keys(self, index: int, params: List[str], hyper: str) -> List[Tuple[str, Path]]:
        """Where one hyperparameter of param group `index` is written: once per
        group, or (torchtitan) once per parameter."""
        if self.name == "torchtitan":
            return [(f"{self.optimizer}param_groups.{p}.{hyper}", ("optimizer", f"param_groups.{p}.{hyper}"))
                    for p in params]
        return [(f"{self.optimizer}param_groups.{index}.{hyper}", ("optim", "param_groups", index, hyper))]


def layout_named(name: str) -> Layout:
    if name == "get_state_dict":
        return Layout(name, "model.", "optim.")
    if name == "torchtitan":
        return Layout(name, "", "optimizer.")
    raise ValueError(f"zero_ext.save: dcp_layout must be one of {list(LAYOUTS)}, not {name!r}")


def recognise(keys: Iterable[str], params: List[str], where: str) -> Layout:
    """The layout of a checkpoint holding `keys`, for a model with `params`."""
    keys = set(keys)
    prefixed = sum(f"model.{p}" in keys for p in params)
    bare = sum(p in keys for p in params)
    if not params or prefixed >= bare and prefixed:
        model = "model."
    elif bare:
        model = ""
    else:
        shown = sorted(keys)[:6]
        raise RuntimeError(
            f"zero_ext.load: {where} holds none of this model's parameters, neither as 'model.<name>' "
            f"(get_state_dict's layout) nor at the top level (torchtitan's); it holds {shown}... "
            "Check that the checkpoint is of this model")
    optimizer = "optimizer." if any(k.startswith(("optimizer.state.", "optimizer.param_groups."))
                                   for k in keys) else "optim."
    return Layout("torchtitan" if model == "" else "get_state_dict", model, optimizer)


def flatten(value: Any, path: Path, out: Dict[str, Tuple[Path, Any]]) -> None:
    """DCP's flattening of a nested state dict (torch's traverse_state_dict):
    mappings recurse by str(key); a list recurses by index only where it
    holds a tensor or a container that does; anything else is one leaf."""
    if isinstance(value, dict):
        for k, v in value.items():
            flatten(v, path + (str(k),), out)
    elif isinstance(value, list) and not _is_leaf(value):
        for i, v in enumerate(value):
            flatten(v, path + (i,), out)
    else:
        out[".".join(map(str, path))] = (path, value)


def _is_leaf(value: Any) -> bool:
    if isinstance(value, dict):
        return False
    if not isinstance(value, list):
        return not isinstance(value, torch.Tensor)
    return all(_is_leaf(v) for v in value)


def unflatten(values: Dict[str, Any], paths: Optional[Dict[str, Path]], drop: int = 0) -> Dict[str, Any]:
    """Nested dicts (lists where the keys are 0..n-1) from flat keys, by the
    checkpoint's own paths where it has them, else by the keys' dots."""
    root: Dict[Any, Any] = {}
    for key, value in values.items():
        path = paths.get(key) if paths else None
        path = tuple(path) if path else tuple(key.split("."))
        node = root
        for part in path[drop:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            node[path[-1]] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v) for k, v in node.items()}
    if node and all(type(k) is int for k in node) and sorted(node) == list(range(len(node))):
        return [node[i] for i in range(len(node))]
    return node
