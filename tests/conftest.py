import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Seconds each of the slowest test files took on one worker (2026-11-29,
# issue 54's suite, `pytest -n 2 --durations=0` on 2 cores). Run in parallel
# (`pytest -n 2`, the README's command) a file goes whole to one worker, in
# the order collected: longest first keeps the workers finishing together.
# Only the order changes; files not listed follow in their own order.
SLOWEST_FILES_S = {
    "test_parity.py": 335, "test_docs_examples.py": 261, "test_faults.py": 220, "test_exit.py": 198,
    "test_benchmarks.py": 182, "test_checkpoint.py": 160, "test_multinode.py": 141, "test_tolerances.py": 115,
    "test_real_models.py": 110, "test_ported.py": 82, "test_reshard.py": 68, "test_hf_integrations.py": 61,
    "test_whole_param_optimizers.py": 59, "test_weights.py": 58, "test_checkpoint_publish.py": 54,
    "test_deferred_init.py": 53, "test_demo.py": 50, "test_lightning.py": 42, "test_frozen_mixed_precision.py": 37,
    "test_checkpoint_integrity.py": 37, "test_units_policy.py": 31, "test_gpu_benchmark.py": 27,
    "test_lightning_packages.py": 22, "test_wrap_arrival.py": 20, "test_exports.py": 17,
    "test_checkpoint_trust.py": 16, "test_harness.py": 13,
}

# [Note: the jobs tier] Files whose tests launch whole jobs (torchrun with
# its agent, several agents, pairs of processes watched to their exit, the
# benchmark scripts with fresh ranks, the docs' snippets as written): each
# launch pays torch's import in every process, so together they took 912 of
# the suite's 2570 worker-seconds, past the README suite's 15 minutes. They
# run as a tier of their own, which .ci/run runs after the README suite:
#   ZERO_EXT_TIER=jobs python3 -m pytest -q -n 2 tests   # the jobs tier only
#   ZERO_EXT_TIER=all  python3 -m pytest -q -n 2 tests   # everything
# The README's command (no ZERO_EXT_TIER) skips them, saying so.
JOBS_TIER_FILES = frozenset({
    "test_docs_examples.py", "test_exit.py", "test_benchmarks.py", "test_multinode.py",
    "test_checkpoint_publish.py", "test_demo.py", "test_gpu_benchmark.py",
    "test_pipeline_3d.py",  # world 8 (dp x tp x pp): the README suite stood at 855 s of its 900 with it
    "test_coordinator.py", "test_replicas.py",  # a coordinator process, and replicas as torchrun jobs
})
# [Note: the slow tier] What must stay long and says little about one
# change: the tolerance study (test_tolerances.py reruns every scenario's
# reference with its arithmetic perturbed: 162 tests) and the 1000-step soak;
# together 36 s of the slow tier's run at -n 2 (2026-11-29). They guard the suite's own margins and slow leaks,
# not one behaviour, so they run after the README suite and the jobs tier:
#   ZERO_EXT_TIER=slow python3 -m pytest -q -n 2 tests   # the slow tier only
SLOW_TIER_FILES = frozenset({"test_tolerances.py"})
SLOW_TIER_TESTS = frozenset({("test_faults.py", "test_soak_1000_steps_stage3_nothing_accumulates")})
TIERS = ("readme", "jobs", "slow", "all")
HOW_TO_RUN = {
    "jobs": "the jobs tier ([Note: the jobs tier] in tests/conftest.py): "
            "ZERO_EXT_TIER=jobs python3 -m pytest -q -n 2 tests; .ci/run runs it",
    "slow": "the slow tier ([Note: the slow tier] in tests/conftest.py): "
            "ZERO_EXT_TIER=slow python3 -m pytest -q -n 2 tests; .ci/run runs it",
}


def _tier() -> str:
    tier = os.environ.get("ZERO_EXT_TIER", "readme")
    if tier not in TIERS:
        raise SystemExit(f"ZERO_EXT_TIER={tier!r}: pass one of {TIERS}")
    return tier


def tier_of(item) -> str:
    """The tier a collected test belongs to."""
    name = os.path.basename(str(item.fspath))
    if name in JOBS_TIER_FILES:
        return "jobs"
    if name in SLOW_TIER_FILES or (name, getattr(item, "originalname", item.name)) in SLOW_TIER_TESTS:
        return "slow"
    return "readme"


def pytest_collection_modifyitems(session, config, items):
    def weight(item):
        return -SLOWEST_FILES_S.get(os.path.basename(str(item.fspath)), 0)
    items.sort(key=weight)  # stable: each file's own order is kept
    tier = _tier()
    if tier == "all":
        return
    tiers = [tier_of(item) for item in items]
    if tier != "readme":
        config.hook.pytest_deselected(items=[item for item, t in zip(items, tiers) if t != tier])
        items[:] = [item for item, t in zip(items, tiers) if t == tier]
        return
    import pytest
    for item, t in zip(items, tiers):
        if t != "readme":
            item.add_marker(pytest.mark.skip(reason=HOW_TO_RUN[t]))


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
