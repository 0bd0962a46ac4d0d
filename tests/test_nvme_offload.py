"""offload_optimizer="nvme" / offload_params="nvme" in one process (SPEC
"Beyond device and host memory"): the same numbers as in memory, nothing
left on disk, a full disk an error at the step that hits it with nothing
saved lost, and resident memory that does not grow with the model. The
multi-rank parity scenarios (worlds 1, 2, 4) are nvme_* in parity_scenarios.py."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import zero_ext
from zero_ext.tools import state_of

PACKAGE_ROOT = os.path.dirname(os.path.dirname(zero_ext.__file__))


def blocks(seed: int = 0, n: int = 6, width: int = 32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                 for _ in range(n)])


def train(model, opt, steps: int = 3, backwards: int = 2) -> dict:
    g = torch.Generator().manual_seed(1)
    width = next(iter(model.parameters())).shape[-1]
    for _ in range(steps):
        for _ in range(backwards):
            model(torch.randn(4, width, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: t.clone() for n, t in zero_ext.full_state_dict(model).items()}


def nvme(stage: int, path) -> dict:
    # persist_kb=0: these blocks are far below the default threshold, and would all stay in memory.
    return {"offload_optimizer": "nvme", "offload_params": "nvme" if stage == 3 else None, "offload_path": str(path),
            "persist_kb": 0}


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_streamed_through_files_equals_memory_bitwise(tmp_path, stage):
    """Torch's SGD steps each streamed bucket: bitwise the in-memory run.
    AdamW runs zero_ext's C++ kernel under offload: bitwise the run with
    offload_optimizer="cpu", the same kernel on state in memory. Bitwise on
    any CPU: both updates are elementwise, and each call sees the same
    segments (bucket_mb fixed) with the same values, whatever the grouping."""
    model = blocks()
    plain = train(*zero_ext.wrap(model, sgd(model), stage=stage, bucket_mb=0.004))
    model = blocks()
    streamed = train(*zero_ext.wrap(model, sgd(model), stage=stage, bucket_mb=0.004, **nvme(stage, tmp_path)))
    assert all(torch.equal(streamed[k], v) for k, v in plain.items())
    model = blocks()
    in_host = train(*zero_ext.wrap(model, adamw(model), stage=stage, bucket_mb=0.004, offload_optimizer="cpu"))
    model = blocks()
    streamed = train(*zero_ext.wrap(model, adamw(model), stage=stage, bucket_mb=0.004, **nvme(stage, tmp_path)))
    assert all(torch.equal(streamed[k], v) for k, v in in_host.items())


def test_parameters_alone_in_files_step_with_the_state_in_memory(tmp_path):
    model = blocks()
    plain = train(*zero_ext.wrap(model, adamw(model), stage=3, bucket_mb=0.004))
    model = blocks()
    model, opt = zero_ext.wrap(model, adamw(model), stage=3, bucket_mb=0.004, offload_params="nvme",
                               offload_path=str(tmp_path), persist_kb=0)
    streamed = train(model, opt)
    assert all(torch.equal(streamed[k], v) for k, v in plain.items())
    assert state_of(model).handles.offload.stats()["resident_bytes"] == 0  # every shard parked between steps


def test_between_steps_everything_is_in_the_file_and_unreadable_in_memory(tmp_path):
    model = blocks()
    model, opt = zero_ext.wrap(model, adamw(model), stage=3, bucket_mb=0.004, **nvme(3, tmp_path))
    train(model, opt, steps=1)
    stats = state_of(model).handles.offload.stats()
    assert stats["resident_bytes"] == 0 and stats["slots"] == 2 * 6  # a value and a gradient per block
    model(torch.randn(4, 32)).square().mean().backward()
    segment = opt.param_groups[0]["params"][0]
    for tensor, what in ((segment, "segment of a parameter shard"), (segment.grad, "gradient is kept")):
        with pytest.raises(RuntimeError, match=what):
            tensor.sum()
    assert all(not torch.is_tensor(v) or v.numel() == 1 for st in opt.state.values() for v in st.values())
    assert os.listdir(tmp_path) == []  # unlinked once open ([Note: offload files])


def test_a_grad_scaler_ends_in_an_error_that_names_zero_exts_loss_scaling(tmp_path):
    """torch.amp.GradScaler unscales the optimizer's .grad before the step,
    which are in the offload file then: a clear error, not a crash."""
    model = blocks()
    model, opt = zero_ext.wrap(model, sgd(model), stage=2, bucket_mb=0.004, **nvme(2, tmp_path))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 32)).square().mean()).backward()
    with pytest.raises(RuntimeError, match=r"GradScaler reads them before the step: .*\(mixed_precision='fp16'\)"):
        scaler.step(opt)


def test_stage_0_takes_no_optimizer_offload_to_files(tmp_path):
    model = blocks()
    with pytest.raises(ValueError, match="offload_optimizer='nvme' needs stage 1, 2 or 3"):
        zero_ext.wrap(model, sgd(model), stage=0, offload_optimizer="nvme", offload_path=str(tmp_path))
    assert type(model) is torch.nn.Sequential


def test_a_full_disk_mid_step_raises_naming_the_file_and_the_last_checkpoint_loads(tmp_path):
    model = blocks()
    model, opt = zero_ext.wrap(model, adamw(model), stage=3, bucket_mb=0.004, **nvme(3, tmp_path / "swap"))
    saved = train(model, opt, steps=1)
    zero_ext.save(str(tmp_path / "ck"), model, opt)
    state_of(model).handles.offload.swap_fail_writes_after(0)
    with pytest.raises(RuntimeError, match=r"offload file .*zero_ext-rank0-.*\.swap failed: No space left on device"):
        for _ in range(2):  # the gradients' writes fail in backward, seen at the next wait on them
            model(torch.randn(4, 32)).square().mean().backward()
            opt.step()
    fresh = blocks(seed=5)
    fresh, fresh_opt = zero_ext.wrap(fresh, adamw(fresh), stage=3, bucket_mb=0.004, **nvme(3, tmp_path / "swap"))
    zero_ext.load(str(tmp_path / "ck"), fresh, fresh_opt)
    loaded = zero_ext.full_state_dict(fresh)
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())


MEMORY_CHECK = textwrap.dedent("""
    import json, tempfile, torch, zero_ext
    def status(key):
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # torch's first optimizer imports (~70 MB) before
    x = torch.randn(8, 1024)
    base = status("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")  # the peak from here
    with zero_ext.empty_init():
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(40)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zero_ext.wrap(model, opt, stage=3, offload_optimizer="nvme", offload_params="nvme",
                               offload_path=tempfile.mkdtemp())
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    state = 4 * 4 * sum(p.numel() for p in model.parameters())  # fp32 values, gradients, two moments
    print(json.dumps({"state": state, "peak_added": status("VmHWM:") - base}))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc peak reset")
def test_forty_linear_blocks_add_under_a_quarter_of_their_state_to_peak_memory():
    """The issue's check: 40 x Linear(1024, 1024), stage 3, both offloads to
    files. Counted from after the ~72 MB torch imports at a process's first
    optimizer (as here) it adds ~0.11x its state; from before them 0.22-0.23x,
    where in memory it adds 1.37x (878 MB for 641 MB)."""
    import json
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT)
    out = subprocess.run([sys.executable, "-c", MEMORY_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["peak_added"] <= figures["state"] / 4, figures


def test_buckets_under_the_persistence_threshold_stay_in_memory(tmp_path):
    """Six blocks of 4.2 KiB and a head of 33 KiB (its own unit): under a
    16 KiB threshold the blocks stay in memory and the head goes to the file;
    the default (128 KiB) keeps them all. The numbers are the same."""
    def model_with_head():
        torch.manual_seed(0)
        return torch.nn.Sequential(blocks(), torch.nn.Linear(32, 256))

    def slots(**options):
        model = model_with_head()
        model, opt = zero_ext.wrap(model, adamw(model), stage=3, bucket_mb=0.004, offload_optimizer="nvme",
                                   offload_params="nvme", offload_path=str(tmp_path), **options)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            model(torch.randn(4, 32, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return state_of(model).handles.offload.stats()["slots"], zero_ext.full_state_dict(model)

    everything, values = slots(persist_kb=0)
    head_only, head_values = slots(persist_kb=16)
    default, default_values = slots()
    assert (everything, head_only, default) == (2 * 7, 2, 0)  # a value and a gradient slot per unit swapped
    assert all(torch.equal(head_values[k], v) and torch.equal(default_values[k], v) for k, v in values.items())


def test_a_live_budget_bounds_the_units_gathered_ahead():
    """prefetch=3 gathers three units ahead of the one computing; a budget
    of two units' bytes lets one ahead at a time. Same numbers."""
    def run(**options):
        model = blocks(n=8, width=64)
        model, opt = zero_ext.wrap(model, sgd(model), stage=3, bucket_mb=0.004, prefetch=3, **options)
        values = train(model, opt, steps=2, backwards=1)
        stats = state_of(model).handles.diagnostics.stats()
        return values, stats.peak_gathered_units_forward, stats.peak_gathered_units_backward

    unit_mib = (64 * 64 + 64) * 4 / 2**20
    free, free_fwd, free_bwd = run()
    bounded, fwd, bwd = run(max_live_mb=2.5 * unit_mib)
    assert free_fwd >= 4 and free_bwd >= 4
    assert fwd <= 3 and bwd <= 3  # the root (no parameters) and at most two blocks
    assert all(torch.equal(bounded[k], v) for k, v in free.items())


def test_budgets_are_checked():
    model = blocks()
    with pytest.raises(ValueError, match="max_live_mb bounds stage 3's gathered parameters: pass stage=3"):
        zero_ext.wrap(model, sgd(model), stage=2, max_live_mb=64)
    with pytest.raises(ValueError, match="persist_kb keeps small buckets out of the offload files"):
        zero_ext.wrap(model, sgd(model), stage=3, persist_kb=64)
    with pytest.raises(ValueError, match="max_live_mb must be None or a finite number >= 0"):
        zero_ext.wrap(model, sgd(model), stage=3, max_live_mb=-1)
    assert type(model) is torch.nn.Sequential


def test_clipping_streams_the_gradients_chunk_by_chunk(tmp_path, monkeypatch):
    """The three clipping calls over gradients in the offload file give the
    in-memory result; a clip that scales nothing holds one chunk of
    gradients at a time (two blocks' here), never all of them (the ones that
    scale also write each chunk back, behind)."""
    from zero_ext.optim import streamed_step
    monkeypatch.setattr(streamed_step, "STEP_CHUNK_BYTES", 2 * (64 * 64 + 64) * 4)

    def run(**options):
        model = blocks(n=8, width=64)
        model, opt = zero_ext.wrap(model, sgd(model), stage=2, bucket_mb=0.004, **options)
        g = torch.Generator().manual_seed(1)
        norms = []
        for clip in (lambda: opt.clip_grad_norm_(1e6),  # scales nothing
                     lambda: opt.clip_grad_norm_(0.05),
                     lambda: zero_ext.clip_grad_norm_(model.parameters(), 0.05, norm_type=float("inf")),
                     lambda: zero_ext.clip_grad_value_(model.parameters(), 1e-3)):
            model(torch.randn(4, 64, generator=g)).square().mean().backward()
            if options:  # the backward's writes done and their memory let go: the clip's peak from here
                state_of(model).handles.offload.swap_drain()
                state_of(model).handles.offload.swap_reset_peak()
            norms.append(clip())
            if options and len(norms) == 1:
                peak = state_of(model).handles.offload.stats()["peak_resident_bytes"]
                assert peak == 2 * (64 * 64 + 64) * 4, peak  # one chunk: two blocks' gradients
            opt.step()
            opt.zero_grad()
        return norms, zero_ext.full_state_dict(model)

    plain_norms, plain = run()
    norms, streamed = run(offload_optimizer="nvme", offload_path=str(tmp_path), persist_kb=0)
    # The 2-norm sums 16 per-tensor squares in another grouping (per chunk, then
    # over chunks): fp32 sums of n positive terms in any order differ by at most
    # (n - 1) eps relative, 15 x 6e-8 < 1e-6, and the square root halves that;
    # the inf-norm is a max (exact). A clip coefficient off by 1e-6 relative
    # moves an SGD step (lr 0.05, gradients < 0.05 after clipping) by < 3e-9.
    assert torch.allclose(torch.stack(norms[:3]), torch.stack(plain_norms[:3]), rtol=1e-6)
    assert all(torch.allclose(streamed[k], v, rtol=1e-6, atol=1e-7) for k, v in plain.items())
