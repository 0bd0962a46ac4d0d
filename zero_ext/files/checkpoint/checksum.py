"""The checksum of zero_ext's own format: the one every format uses
(files/checksum.py), also named by this path, which tools and tests that
check a checkpoint's files by hand import."""
from __future__ import annotations

from ..checksum import ALGORITHM, MAX, digest

__all__ = ["ALGORITHM", "MAX", "digest"]
