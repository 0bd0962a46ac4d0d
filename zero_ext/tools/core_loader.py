"""Loads the compiled core, which registers torch.classes.zero_ext.*, after
checking the torch version and, once per build, that the build raises C++
errors as Python errors (see build_check.py)."""
import torch

from . import build_check, torch_compat

torch_compat.check_supported()
_built_against = build_check.build_info().get("torch")
if _built_against and _built_against != torch.__version__:
    raise ImportError(
        f"zero_ext was built against torch {_built_against} but this is torch {torch.__version__}: "
        f"a build serves only the torch it was built against. Rebuild with pip install "
        f"--no-build-isolation --force-reinstall --no-deps . from zero_ext's source "
        f"(or bash scripts/setup.sh).")
try:
    from .. import _C  # noqa: F401  (registration happens on import)
except ImportError as error:
    raise ImportError(
        f"zero_ext's compiled core does not load with torch {torch.__version__} "
        f"({build_check.describe_build(build_check.build_info())}): {error}. A build serves only the "
        f"torch it was built against: rebuild with pip install --no-build-isolation "
        f"--force-reinstall --no-deps . from zero_ext's source (or bash scripts/setup.sh).") from error
build_check.ensure_checked()

ShardedModel = torch.classes.zero_ext.ShardedModel
CoreConfig = torch.classes.zero_ext.CoreConfig  # built whole before the model (tools/core_config.py)
# The model's bound views, one per concern (csrc/core_views.h; tools/core_handles.py).
CORE_VIEWS = {name: getattr(torch.classes.zero_ext, name) for name in (
    "Units", "Reduction", "OptimizerShards", "CheckpointRanges", "Diagnostics", "GroupCollectives", "OffloadFiles")}
# The job's store, called quietly (csrc/diagnosis_store.h): for Python's own exchanges through it.
QuietStore = torch.classes.zero_ext.QuietStore
