"""Sealing a JSON document: its "checksum" field holds the checksum of the
rest in canonical form (sorted keys, no spaces), so a flipped byte anywhere
in it (a digit of a step count, an offset) is refused even where the result
would still parse. zero_ext's metadata.json and its DCP checksum sidecar
are sealed alike."""
from __future__ import annotations

import json
from typing import Any, Dict, Mapping

from .checksum import digest

SEAL = "checksum"  # the field that holds the seal


def canonical(document: Mapping[str, Any]) -> bytes:
    """The bytes the seal covers: the document without its seal."""
    body = {k: v for k, v in document.items() if k != SEAL}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(document: Dict[str, Any]) -> Dict[str, Any]:
    """`document` with its seal set to the checksum of the rest."""
    document[SEAL] = digest(canonical(document))
    return document


def is_sealed(document: Mapping[str, Any]) -> bool:
    """Whether the document's seal matches its content."""
    return document.get(SEAL) == digest(canonical(document))
