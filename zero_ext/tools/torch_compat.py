"""The torch versions zero_ext supports, and every version difference it
handles, in one place.

Supported: torch 2.11 up to the newest release tested (2.15). 2.11 is the
oldest because it is what the GPU machines this project is measured on run,
and the oldest release the whole suite has passed on
(scripts/test_torch_versions.sh); older releases lack nothing known, but are
not tested, so they are refused rather than trusted. Newer releases are
allowed with a warning: the C++ core uses autograd and c10d internals that
can change between releases, and the import-time build check
(tools/build_check.py) catches a build that no longer matches.
"""
from __future__ import annotations

import re
import warnings
from typing import Dict, List, Tuple

import torch

MIN_SUPPORTED: Tuple[int, int] = (2, 11)
NEWEST_TESTED: Tuple[int, int] = (2, 15)


def torch_version(version: str = torch.__version__) -> Tuple[int, int]:
    """(major, minor) of a torch version string such as '2.11.0+cu130'."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if not found:
        raise ImportError(f"zero_ext: cannot read torch's version {version!r}")
    return int(found.group(1)), int(found.group(2))


def check_supported(version: str = torch.__version__) -> None:
    """Raises ImportError below the supported range; warns above the tested one."""
    have = torch_version(version)
    low = ".".join(map(str, MIN_SUPPORTED))
    high = ".".join(map(str, NEWEST_TESTED))
    if have < MIN_SUPPORTED:
        raise ImportError(
            f"zero_ext supports torch {low} to {high}; this is torch {version}. Upgrade torch "
            f"(pip install 'torch>={low}'), then rebuild zero_ext against it "
            f"(pip install --no-build-isolation --force-reinstall --no-deps zero_ext's source).")
    if have > NEWEST_TESTED:
        warnings.warn(
            f"zero_ext is tested with torch {low} to {high}; torch {version} is newer. It built "
            f"and passed its self-check, but report anything that behaves differently.", stacklevel=3)


def profiled_ops(prof) -> List[Tuple[str, List[List[int]], List[str]]]:
    """(name, input shapes, input dtypes) of every op a finished
    torch.profiler.profile(record_shapes=True) recorded. FunctionEvent has
    `input_dtypes` from torch 2.13 on; before that the dtypes are only on
    the profiler's underlying kineto events."""
    events = prof.events()
    if events and hasattr(events[0], "input_dtypes"):
        return [(e.name, list(e.input_shapes or []), list(e.input_dtypes or [])) for e in events]
    return [(k.name(), list(k.shapes()), list(k.dtypes())) for k in prof.profiler.kineto_results.events()]


def outside_compile(fn):
    """`fn` (a module hook) run eagerly even when torch.compile traces the
    call it hooks: zero_ext's hooks call into its C++ core (a TorchScript
    class Dynamo cannot trace), and a graph break inside nn.Module's hook
    loop makes Dynamo skip the whole frame. FSDP2 and DeepSpeed ZeRO-3
    disable their hooks the same way. Costs ~1 us per call in eager mode."""
    return torch.compiler.disable(fn, recursive=True)


def traced_only_inline(fn):
    """`fn` is traced by Dynamo only as part of a caller's trace, never
    compiled as a frame of its own: called from code that runs eagerly (a
    frame Dynamo skipped, a graph break in a loop), it runs eagerly too, so
    `torch.compiler.is_compiling()` inside it says whether the module call
    around it is being traced. Returns `fn`."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(fn.__code__)
    return fn


def all_gather_into_tensor(output, tensor, group) -> None:
    """torch.distributed's all-gather into one tensor: all_gather_single where
    it exists (2.13 deprecates all_gather_into_tensor), else the older name."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def is_device_mesh(value) -> bool:
    """Whether `value` is a torch DeviceMesh (False where this torch has no
    torch.distributed.device_mesh, as a build without distributed support)."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without device_mesh
        return False
    return isinstance(value, DeviceMesh)


# torch.distributed.checkpoint's metadata classes a `.metadata` pickle may
# name; StorageMeta and _MEM_FORMAT_ENCODING came in later torch releases than
# the rest. Those that take pickled state (BUILD) are all but the enum.
_DCP_METADATA_CLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                         "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
_DCP_STATEFUL = frozenset(_DCP_METADATA_CLASSES) - {"_MEM_FORMAT_ENCODING"}


def dcp_metadata_classes(stateful_only: bool = False) -> Dict[str, type]:
    """{name: class} of torch.distributed.checkpoint.metadata's classes that
    this torch has (only those whose instances take state, if asked)."""
    from torch.distributed.checkpoint import metadata as md

    return {name: getattr(md, name) for name in _DCP_METADATA_CLASSES
            if hasattr(md, name) and (not stateful_only or name in _DCP_STATEFUL)}


def stamp_dcp_metadata(meta, checkpoint_id: str, save_id: str) -> None:
    """What a newer torch's DCP Metadata carries besides the entries, set
    where this torch has it: storage_meta (with the save's id) and the
    format version its FileSystemWriter records."""
    from torch.distributed.checkpoint import metadata as md

    if hasattr(md, "StorageMeta"):
        meta.storage_meta = md.StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id)
    try:
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
    except ImportError:  # an older torch: its Metadata has no version
        return
    meta.version = CURRENT_DCP_VERSION
