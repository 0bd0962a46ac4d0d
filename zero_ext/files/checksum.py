"""The checksum of checkpoint bytes, in every format: XXH3 (64-bit) from the
xxhash package.

At 20-30 GB/s on one core it costs a few percent of a save or load that
streams from the page cache (zlib's CRC32 runs at 4-6 GB/s, which would
add a quarter to a load on a busy host). A checkpoint names the algorithm
(metadata.json's checksum_algorithm, the DCP sidecar's algorithm), so it
says how to check it."""
from __future__ import annotations

ALGORITHM = "xxh3_64"
MAX = (1 << 64) - 1

try:
    from xxhash import xxh3_64_intdigest as _xxh3_64
except ImportError as _error:  # pragma: no cover - a dependency of zero_ext
    _missing = _error

    def _xxh3_64(data) -> int:
        raise ImportError("zero_ext checkpoints are checksummed with XXH3 from the xxhash package, which is not "
                          f"installed here ({_missing}): pip install xxhash") from _missing


def digest(data) -> int:
    """The checksum of a bytes-like object (any buffer: bytes, memoryview, ctypes)."""
    return _xxh3_64(data)
