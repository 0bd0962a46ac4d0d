"""Loads the compiled core, which registers torch.classes.zero_ext.*."""
import torch

from . import _C  # noqa: F401  (registration happens on import)

GradBuckets = torch.classes.zero_ext.GradBuckets
