"""zero_ext.traffic(model): the bytes this rank sent since wrap, by what each
collective does for the model ([Note: traffic] in csrc/communicator.h)."""
from __future__ import annotations

from typing import Dict

import torch

from ..tools import require_module, state_of

# The core's TrafficKind order.
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "sequence_headers")


def traffic(model: torch.nn.Module) -> Dict[str, int]:
    """Bytes this rank has sent on the model's groups since ``wrap``, by kind:
    ``"all_gather"`` (stage 3 gathers, stage 1-2 gathers after the step,
    gathers for checkpoints), ``"reduce_scatter"`` (gradients, whatever
    algorithm carries them out), ``"all_reduce"`` (stage 0-1 gradients,
    across replicas, the per-backward agreement), ``"broadcast"`` and
    ``"sequence_headers"`` (the collective checks' own exchanges).

    Counted in the core as each collective goes out, under the
    bandwidth-optimal algorithm for its group of n ranks and B bytes: an
    all-gather sends (n - 1) parts, a reduce-scatter or broadcast
    (n - 1) / n x B, an all-reduce 2 (n - 1) / n x B. Quantized collectives
    (``compress_weights``, ``compress_grads``) count their payloads: integers
    and scales. A single rank sends nothing. Local to this rank: no
    collective is issued.

    Takes the model zero_ext.wrap returned: anything but a module (its
    optimizer, a list, None) raises TypeError, and a module zero_ext did
    not wrap raises ValueError."""
    require_module(model, "zero_ext.traffic", "zero_ext.traffic(model)")
    counts = state_of(model).handles.diagnostics.traffic()
    return {kind: int(b) for kind, b in zip(KINDS, counts)}
