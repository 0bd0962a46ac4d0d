"""The demo (examples/train_lm.py) under torchrun with 2 CPU ranks: its
--log-every lines on rank 0 carry the loss, the gradient norm, throughput
and the bytes held, and agree with what the run prints at its end."""
import os
import re
import socket
import subprocess
import sys

import torch

import zero_ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(zero_ext.__file__)))  # the zero_ext under test
LINE = re.compile(r"^step (\d+)/(\d+) \| loss ([\d.]+) \| grad norm ([\d.]+) \| (\d+) tok/s \| held ([\d.]+) MiB "
                  r"\(params ([\d.]+), grads ([\d.]+), optimizer ([\d.]+)\)$", re.M)


def test_log_every_reports_loss_norm_throughput_and_memory(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29671",
           os.path.join(ROOT, "examples", "train_lm.py"), "--stage", "3", "--steps", "6", "--log-every", "3",
           "--context", "16", "--batch", "2", "--no-report"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env={**os.environ, "PYTHONPATH": PACKAGE_ROOT})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = LINE.findall(done.stdout)
    assert [(int(s), int(t)) for s, t, *_ in lines] == [(3, 6), (6, 6)], done.stdout
    final = float(re.search(r"loss [\d.]+ -> ([\d.]+)", done.stdout).group(1))
    assert abs(float(lines[-1][2]) - final) < 1e-3  # the last logged loss is the run's last loss
    for _, _, loss, norm, rate, held, params, grads, opt in lines:
        assert float(norm) > 0 and int(rate) > 0
        # Stage 3 between steps: each rank holds half the fp32 parameters, no
        # gradient, and Adam's two moments of its half.
        assert float(grads) == 0 and abs(float(opt) - 2 * float(params)) < 0.02
        assert abs(float(held) - (float(params) + float(grads) + float(opt))) < 0.02


def test_the_closing_table_shows_bytes_during_the_step(tmp_path):
    """The table compares what each rank holds after backward and before
    optimizer.step(), where gradients peak: stage 2 holds its gradient shard
    (half of DDP's full gradient at 2 ranks), not the nothing it holds
    between steps."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29673",
           os.path.join(ROOT, "examples", "train_lm.py"), "--stage", "2", "--steps", "3",
           "--context", "16", "--batch", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env={**os.environ, "PYTHONPATH": PACKAGE_ROOT})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "during a step (after backward, before optimizer.step())" in done.stdout, done.stdout
    unit = {"KiB": 1024, "MiB": 2**20}
    cells = re.findall(r"^\s+(\d) \| (.+)$", done.stdout, re.M)
    assert [int(r) for r, _ in cells] == [0, 1], done.stdout
    for _, row in cells:
        (zp, zpu, dp, dpu), (zg, zgu, dg, dgu), _ = [
            re.search(r"([\d.]+) (KiB|MiB) vs ([\d.]+) (KiB|MiB)", c).groups() for c in row.split("|")]
        params, ddp_params = float(zp) * unit[zpu], float(dp) * unit[dpu]
        grads, ddp_grads = float(zg) * unit[zgu], float(dg) * unit[dgu]
        assert abs(params - ddp_params) < 0.01 * ddp_params  # stage 2 keeps every parameter
        assert ddp_grads > 0 and abs(grads - ddp_grads / 2) < 0.05 * ddp_grads, (row, done.stdout)


def test_the_offload_demo_trains_with_files_on_two_ranks(tmp_path):
    """examples/offload_to_disk.py, small, under torchrun with 2 ranks: the
    loss goes down over the steps and each log line reports the memory
    figure; nothing is left in the offload directory."""
    offload = tmp_path / "offload"
    with socket.socket() as s:  # a free port: fixed ones collide with other tests running alongside
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           os.path.join(ROOT, "examples", "offload_to_disk.py"), "--offload-path", str(offload), "--dim", "64",
           "--layers", "4", "--steps", "6", "--log-every", "5", "--max-fraction", "100"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                          env={**os.environ, "PYTHONPATH": PACKAGE_ROOT})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = re.findall(r"^step +(\d+)  loss ([\d.]+) .* peak resident added +\d+ MiB = [\d.]+ x the training state$",
                       done.stdout, re.M)
    assert [int(s) for s, _ in lines] == [1, 5], done.stdout
    assert float(lines[-1][1]) < float(lines[0][1]), done.stdout
    assert list(offload.iterdir()) == []


def test_the_tensor_parallel_example_follows_its_reference(tmp_path):
    """examples/tensor_parallel.py, dp 2 x tp 2 (it spawns its 4 gloo ranks):
    zero_ext over the TP model prints the same losses and gradient norms as
    the same training without zero_ext (--reference: gradients averaged over
    dp and clipped by hand), and --check finds the TP model equal to one
    process."""
    def run(*extra):
        cmd = [sys.executable, os.path.join(ROOT, "examples", "tensor_parallel.py"), "--steps", "3", "--log-every",
               "1", "--dim", "64", "--layers", "1", "--context", "16", "--batch", "2", *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                              env={**os.environ, "PYTHONPATH": PACKAGE_ROOT})
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout
    wrapped, reference = run("--check"), run("--reference")
    steps = re.compile(r"^step +(\d+) +loss ([\d.]+) +grad norm ([\d.]+)$", re.M)
    assert len(steps.findall(wrapped)) == 3 and steps.findall(wrapped) == steps.findall(reference), (wrapped, reference)
    diff = re.search(r"largest gradient \|diff\| ([\d.e+-]+)", wrapped)
    assert diff is not None and float(diff.group(1)) < 1e-5, wrapped


def test_the_3d_example_follows_one_process_and_saves_the_whole_model(tmp_path):
    """examples/pipeline_3d.py, pp 2 x dp 2 x tp 2 (it spawns its 8 gloo
    ranks): the same losses and gradient norms as the whole model trained on
    one process over the global batch (--reference), to the printed digit;
    its DCP checkpoint of every rank converts to the whole model's
    state_dict (every name, every full shape)."""
    def run(*extra):
        cmd = [sys.executable, os.path.join(ROOT, "examples", "pipeline_3d.py"), "--steps", "3", "--log-every", "1",
               "--dim", "32", "--context", "16", *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                              env={**os.environ, "PYTHONPATH": PACKAGE_ROOT})
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout
    saved = str(tmp_path / "ckpt")
    pipelined, reference = run("--save", saved), run("--reference")
    steps = re.compile(r"^step +(\d+) +loss ([\d.]+) +grad norm ([\d.]+)$", re.M)
    assert len(steps.findall(pipelined)) == 3 and steps.findall(pipelined) == steps.findall(reference), \
        (pipelined, reference)
    out = str(tmp_path / "whole.pt")
    subprocess.run([sys.executable, "-m", "zero_ext.convert", saved, out], check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": PACKAGE_ROOT})
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        from pipeline_3d import PipelinedLlama, corpus
    finally:
        sys.path.pop(0)
    whole = PipelinedLlama(len(corpus()[0]), 32, 2, 4)
    got = torch.load(out, weights_only=True)
    assert {k: tuple(v.shape) for k, v in got.items()} == {k: tuple(v.shape) for k, v in whole.state_dict().items()}
    whole.load_state_dict(got)


def test_the_expert_parallel_example_follows_one_process_and_saves_whole_experts(tmp_path):
    """examples/moe_expert_parallel.py under torchrun with 4 ranks, ep 2 x
    dp_mod_ep 2 at stage 3 (all-to-all dispatch): the same losses as the
    model trained on one process over the global batch (--reference), to the
    printed digit; its DCP checkpoint converts to the whole model, every
    expert tensor full."""
    script = os.path.join(ROOT, "examples", "moe_expert_parallel.py")
    saved = str(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": PACKAGE_ROOT}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", "29675",
           script, "--ep", "2", "--stage", "3", "--steps", "3", "--save", saved]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(tmp_path), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    reference = subprocess.run([sys.executable, script, "--reference", "--steps", "3"], capture_output=True,
                               text=True, timeout=300, cwd=str(tmp_path), env=env)
    assert reference.returncode == 0, reference.stderr
    steps = re.compile(r"^step (\d+): loss ([\d.]+)$", re.M)
    assert len(steps.findall(done.stdout)) == 3 and steps.findall(done.stdout) == steps.findall(reference.stdout), \
        (done.stdout, reference.stdout)
    out = str(tmp_path / "whole.pt")
    subprocess.run([sys.executable, "-m", "zero_ext.convert", saved, out], check=True, capture_output=True, env=env)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        from moe_expert_parallel import MoELM
    finally:
        sys.path.pop(0)
    got = torch.load(out, weights_only=True)
    assert {k: tuple(v.shape) for k, v in got.items()} == {k: tuple(v.shape) for k, v in MoELM().state_dict().items()}
