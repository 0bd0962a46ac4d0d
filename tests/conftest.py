import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Seconds each of the slowest test files took alone on 2 cores (2026-11-26,
# `pytest --durations=0`). Run in parallel (`pytest -n 2`, the README's
# command) a file goes whole to one worker, in the order collected: longest
# first keeps the workers finishing together. Only the order changes; files
# not listed follow in their own order.
SLOWEST_FILES_S = {  # seconds of one worker, measured 2026-11-28 (issue 47's suite, --durations=0)
    "test_parity.py": 270, "test_faults.py": 166, "test_checkpoint.py": 146, "test_exit.py": 110,
    "test_multinode.py": 117, "test_benchmarks.py": 103, "test_tolerances.py": 97, "test_real_models.py": 92,
    "test_deferred_init.py": 62, "test_demo.py": 58, "test_ported.py": 55, "test_reshard.py": 53,
    "test_whole_param_optimizers.py": 52, "test_units_policy.py": 51, "test_checkpoint_publish.py": 43,
    "test_weights.py": 38, "test_lightning.py": 36, "test_hf_integrations.py": 36,
    "test_frozen_mixed_precision.py": 31, "test_checkpoint_integrity.py": 28,
    "test_docs_examples.py": 150,  # issue 54: every docs snippet, 2026-11-29 (150-168 s at load ~5)
    "test_gpu_benchmark.py": 24, "test_lightning_packages.py": 22, "test_exports.py": 17,
    "test_checkpoint_trust.py": 15, "test_harness.py": 12,
}


def pytest_collection_modifyitems(session, config, items):
    def weight(item):
        return -SLOWEST_FILES_S.get(os.path.basename(str(item.fspath)), 0)
    items.sort(key=weight)  # stable: each file's own order is kept


def pytest_cmdline_main(config):
    """`-n N` without `--dist`: whole files to a worker, in the order above.
    Most files run their scenarios in one group of ranks (a module fixture):
    split over workers, each would start and run the group again.
    pytest-xdist 3 has already turned `-n` into `--dist load` by now, so
    whether `--dist` was passed is read from the command line itself."""
    args = config.invocation_params.args
    explicit = any(a in ("--dist", "-d") or str(a).startswith("--dist=") for a in args)
    if getattr(config.option, "numprocesses", None) and not explicit:
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False
