"""zero_ext is independent of the user's global torch defaults: with
torch.set_default_dtype(torch.float64) around wrap, training, save and load,
and the default device set to "meta" around save, load and full_state_dict
(as "cuda" would be in a notebook), results are bit-identical to a run
without them, and every tensor zero_ext keeps has the same dtype and device.
Before zero_ext named the device of its host buffers, load under a meta
default device crashed the process (SIGSEGV): each case runs in spawned
ranks, so a crash fails that case only."""
import functools
import io

import pytest
import torch

from dist_harness import run_items_on_ranks

CASES = [(stage, precision, offload) for stage in (0, 1, 2, 3)
         for precision, offload in ((None, False), ("bf16", False), (None, True))]


@functools.lru_cache(maxsize=None)
def outcomes(root: str, device: str = "cpu"):
    items = [(root, *case, on, device) for case in CASES for on in (False, True)]
    return run_items_on_ranks(2, "default_settings_scenarios:round_trip", items, item_deadline_s=120)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("defaults"))


def _load(blob: bytes):
    return torch.load(io.BytesIO(blob), weights_only=True)


def _equal(a, b, where):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: values differ"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("stage,precision,offload", CASES)
def test_user_defaults_change_nothing(root, stage, precision, offload, device="cpu"):
    results = outcomes(root, device)
    plain, under_defaults = results[(root, stage, precision, offload, False, device)], \
        results[(root, stage, precision, offload, True, device)]
    assert not isinstance(plain, str), plain
    assert not isinstance(under_defaults, str), under_defaults
    for rank, (a, b) in enumerate(zip(plain, under_defaults)):
        _equal(_load(a), _load(b), f"rank {rank}")
