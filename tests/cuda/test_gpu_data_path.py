"""On a GPU, at world size 1 over NCCL: parity against plain PyTorch for
stages 0-3 x fp32/bf16 x offload, the bound on gradient memory in backward,
and host syncs in backward counted from the profiler. A group of one rank
runs its collectives as local copies; these tests send them through NCCL all
the same (ZERO_EXT_ONE_RANK_COLLECTIVES=1), to cover NCCL's path on one GPU,
and run parity, memory and host syncs once more the local way; and
memory_report(process=True)'s device memory."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zero_ext

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("nccl_world_of_one")]

WIDTH, DEPTH = 1024, 12  # one 4 MiB (fp32) bucket per layer at bucket_mb=4


class Deep(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = DEPTH):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / width ** 0.5)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def batches(steps: int, rows: int = 4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, WIDTH, generator=g).cuda(), torch.randn(rows, WIDTH, generator=g).cuda())
            for _ in range(steps)]


def train(model, opt, data, autocast=False):
    for x, y in data:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        F.mse_loss(out.float(), y).backward()
        opt.step()
        opt.zero_grad()


CASES = [(stage, precision, offload) for stage in (0, 1, 2, 3) for precision in (None, "bf16")
         for offload in (False, True) if not (offload and stage == 0)]


def one_rank_collectives(monkeypatch, collectives: str) -> None:
    monkeypatch.setenv("ZERO_EXT_ONE_RANK_COLLECTIVES", "1" if collectives == "nccl" else "0")


@pytest.mark.parametrize("collectives", ["nccl", "local"])
@pytest.mark.parametrize("stage,precision,offload", CASES)
def test_parity_with_plain_pytorch_over_nccl(stage, precision, offload, collectives, monkeypatch):
    one_rank_collectives(monkeypatch, collectives)
    data = batches(3)
    reference = Deep(depth=4).cuda()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1)
    train(reference, ref_opt, data, autocast=precision == "bf16")
    model = Deep(depth=4).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model, opt = zero_ext.wrap(model, opt, stage=stage, mixed_precision=precision, bucket_mb=4,
                               offload_optimizer="cpu" if offload else None,
                               units={nn.Linear} if stage == 3 else None)
    assert model._zero_ext.process_group is not None, "world size 1 still runs zero_ext's own group"
    train(model, opt, data)
    sent = model._zero_ext.handles.diagnostics.stats()["collectives"]
    assert (sent > 0) == (collectives == "nccl"), sent
    got = zero_ext.full_state_dict(model)
    # bf16: autocast keeps fp32 weights and rounds per op; zero_ext computes in
    # bf16 weights rounded from fp32 masters. Both land within bf16 ulps.
    tol = dict(rtol=2e-2, atol=2e-3) if precision == "bf16" else dict(rtol=1e-5, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name].float().cpu(), p.detach().float().cpu(), **tol, msg=name)


@pytest.mark.parametrize("collectives", ["nccl", "local"])
@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_memory_in_backward_is_bounded_by_the_buckets(stage, collectives, monkeypatch):
    """Stages 2-3 hold staging only for reductions in flight, bounded in
    bytes: besides the fp32 gradient shard (freed at zero_grad, allocated
    again by the next backward: the whole gradient at world size 1), the
    memory backward adds is the bound plus a bucket, not the model's
    gradient (12 layers x 4 MiB here). Alone, without NCCL, it stages
    straight into the gradient shard: no staging at all."""
    one_rank_collectives(monkeypatch, collectives)
    model = Deep().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zero_ext.wrap(model, opt, stage=stage, bucket_mb=4, units={nn.Linear} if stage == 3 else None)
    (x, y), = batches(1)
    train(model, opt, [(x, y)])  # optimizer state exists from here on
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    shard_before = model._zero_ext.handles.diagnostics.stats()["grad_bytes"]
    torch.cuda.reset_peak_memory_stats()
    F.mse_loss(model(x), y).backward()
    torch.cuda.synchronize()
    stats = model._zero_ext.handles.diagnostics.stats()
    bucket = WIDTH * (WIDTH + 1) * 4
    model_grad = DEPTH * bucket
    shard = stats["grad_bytes"] - shard_before
    assert shard_before == 0 and shard == model_grad // dist.get_world_size(), (shard_before, shard, model_grad)
    added = torch.cuda.max_memory_allocated() - before - shard
    assert stats["peak_staging_bytes"] <= stats["max_in_flight_bytes"] + 2 * bucket, stats
    assert (stats["peak_staging_bytes"] == 0) == (collectives == "local"), stats
    # Besides staging: one layer's param.grad before it moves into its bucket,
    # activations (4 rows) and stage 3's gathered layers.
    allowance = stats["max_in_flight_bytes"] + 2 * bucket + (2 * bucket if stage == 3 else 0) + 2**20
    assert added <= allowance, (added, allowance, model_grad, stats)
    assert added < model_grad / 2, (added, model_grad)
    opt.zero_grad()


def _profiled_syncs(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    counts = {}
    for event in prof.events():
        name = event.name
        if name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"):
            counts[name] = counts.get(name, 0) + 1
    return counts


def host_syncs(fn) -> dict:
    """CUDA runtime calls that make the host wait for the device, by name,
    less the profiler's own (it synchronizes the device once as it stops)."""
    counts = _profiled_syncs(fn)
    for name, n in _profiled_syncs(lambda: None).items():
        counts[name] = counts.get(name, 0) - n
    return {name: n for name, n in counts.items() if n}


@pytest.mark.parametrize("collectives", ["nccl", "local"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_host_sync_in_backward_and_one_per_step(stage, collectives, monkeypatch):
    """Four backward passes accumulate without the host waiting once; the
    step reads the ranks' agreement (which parameters got gradients,
    non-finite, in step) once for all four (README, "Host syncs")."""
    one_rank_collectives(monkeypatch, collectives)
    model = Deep(depth=4).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, opt = zero_ext.wrap(model, opt, stage=stage, bucket_mb=4, mixed_precision="bf16",
                               units={nn.Linear} if stage == 3 else None)
    data = batches(4)
    train(model, opt, data[:1])  # optimizer state exists from here on

    def backwards():
        for x, y in data:
            F.mse_loss(model(x).float(), y).backward()

    in_backward = host_syncs(backwards)
    assert sum(in_backward.values()) == 0, in_backward
    in_step = host_syncs(opt.step)
    assert sum(in_step.values()) <= 1, in_step
    opt.zero_grad()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_backward_does_not_wait_for_its_host_copies(stage):
    """Offload copies reduced shards to pinned host memory without a host
    wait: a backward whose previous copies are done (the device idle before
    it) makes no synchronizing call, the first included; the host adds
    happen when the step reads the gradients ([Note: offload without a host
    sync in backward]). Training still matches the reference (parity test)."""
    model = Deep(depth=4).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zero_ext.wrap(model, opt, stage=stage, bucket_mb=4, mixed_precision="bf16",
                               offload_optimizer="cpu", units={nn.Linear} if stage == 3 else None)
    data = batches(3)
    train(model, opt, data[:1])
    for x, y in data:
        torch.cuda.synchronize()
        syncs = host_syncs(lambda: F.mse_loss(model(x).float(), y).backward())
        assert sum(syncs.values()) == 0, syncs
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("stage,offload", [(1, False), (2, False), (3, False), (2, True), (3, True)])
def test_reduction_stream_changes_no_bit(stage, offload, monkeypatch):
    """The reduction stream reorders nothing but streams: training with it
    and on one stream (ZERO_EXT_REDUCTION_STREAM=0) gives the same bits,
    with two backwards per step and gradients freed at each zero_grad."""
    def trained(stream: bool):
        monkeypatch.setenv("ZERO_EXT_REDUCTION_STREAM", "1" if stream else "0")
        model = Deep(depth=6).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        model, opt = zero_ext.wrap(model, opt, stage=stage, bucket_mb=4, mixed_precision="bf16",
                                   offload_optimizer="cpu" if offload else None,
                                   units={nn.Linear} if stage == 3 else None)
        data = batches(6)
        for step in range(3):
            for x, y in data[2 * step:2 * step + 2]:
                F.mse_loss(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
        return zero_ext.full_state_dict(model)

    with_stream, one_stream = trained(True), trained(False)
    for name, value in one_stream.items():
        assert torch.equal(with_stream[name], value), name


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_counts_its_pinned_compute_shard(stage):
    """Offload on a GPU keeps a pinned bf16 copy of the shard the CPU Adam
    writes (the source of the asynchronous refresh): stats count it in
    param_bytes and in host_bytes, byte for byte."""
    model = Deep(depth=4).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zero_ext.wrap(model, opt, stage=stage, bucket_mb=4, mixed_precision="bf16",
                               offload_optimizer="cpu", units={nn.Linear} if stage == 3 else None)
    train(model, opt, batches(1))
    core = model._zero_ext.handles
    stats = core.diagnostics.stats()
    padded = sum(core.reduction.bucket_layout()[2::3])  # (first, count, padded) per bucket
    shard = padded // dist.get_world_size()
    device_params = shard * 2 if stage == 3 else padded * 2
    pinned_compute = shard * 2
    assert stats["param_bytes"] == device_params + pinned_compute, stats
    assert stats["host_bytes"] >= 4 * shard + pinned_compute, stats


@pytest.mark.parametrize("stage", [0, 3])
def test_memory_report_process_gives_the_devices_allocator_counts(stage):
    """memory_report(process=True) on a GPU model: cuda_allocated and
    cuda_reserved are torch.cuda.memory_allocated / memory_reserved of the
    model's device, read in the call (nothing allocates between), and the
    device holds at least the report's tensors (no offload: all on it)."""
    model = Deep(depth=4).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = zero_ext.wrap(model, opt, stage=stage, bucket_mb=4, units={nn.Linear} if stage == 3 else None)
    train(model, opt, batches(1))
    report = zero_ext.memory_report(model, opt, process=True)
    device = next(model.parameters()).device
    assert report["cuda_allocated"] == torch.cuda.memory_allocated(device), report
    assert report["cuda_reserved"] == torch.cuda.memory_reserved(device), report
    assert report["cuda_reserved"] >= report["cuda_allocated"] >= (
        report["params"] + report["grads"] + report["optimizer_state"]), report
    assert report["process_peak_rss"] >= report["process_rss"] > 0, report


@pytest.mark.parametrize("stage,offload", [(2, False), (3, False), (3, True)])
def test_deferred_init_on_the_gpu_equals_the_model_built_there(stage, offload):
    """empty_init + wrap(device=cuda) over NCCL: the values of the same
    model constructed on the GPU from the same seed, the CUDA RNG used in
    the same order; skip_init then load_weights gives the weights back."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32)) for _ in range(3))
            self.head = nn.Linear(32, 64, bias=False)
            self.head.weight = self.embed.weight

    torch.manual_seed(3)
    with torch.device("cuda"):
        reference = Net()
    with zero_ext.empty_init():
        model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(3)
    model, opt = zero_ext.wrap(model, opt, stage=stage, mixed_precision="bf16", bucket_mb=0.001,
                               offload_optimizer="cpu" if offload else None, device="cuda",
                               units={nn.Sequential} if stage == 3 else None)
    full = zero_ext.full_state_dict(model)
    for name, value in reference.state_dict().items():
        assert torch.equal(full[name].to(value.device), value), name
    with zero_ext.empty_init():
        fresh = Net()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh, _ = zero_ext.wrap(fresh, fresh_opt, stage=stage, mixed_precision="bf16", bucket_mb=0.001,
                             offload_optimizer="cpu" if offload else None, param_init_fn=zero_ext.skip_init,
                             units={nn.Sequential} if stage == 3 else None)
    zero_ext.load_weights(fresh, {k: v.cpu() for k, v in reference.state_dict().items()})
    loaded = zero_ext.full_state_dict(fresh)
    for name, value in reference.state_dict().items():
        assert torch.equal(loaded[name].to(value.device), value), name
