"""Hugging Face Trainer and accelerate through zero_ext (zero_ext.integrations),
under torchrun with CPU ranks, against the same libraries over DDP: losses,
gradient norms and weights equal at stages 0-3; save -> resume equal to the
uninterrupted run (Trainer: also on one rank from a 2-rank checkpoint;
accelerate: saved at stage 2, resumed at stage 3); from_pretrained reads the
saved weights. An Accelerator made without cpu=True on CPU ranks is
refused on every rank."""
import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import zero_ext  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(zero_ext.__file__)))  # the zero_ext under test


def launch(world: int, mode: str, out, port: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port", str(port),
           os.path.join(HERE, "hf_integration_scenarios.py"), mode, str(out)]
    env = {**os.environ, "PYTHONPATH": PACKAGE_ROOT, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(out), env=env)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-10000:]
    with open(os.path.join(out, f"{mode}.json")) as f:
        return json.load(f)


def test_trainer_and_accelerate_match_ddp_and_resume(tmp_path):
    result = launch(2, "compare", tmp_path, 29675)
    assert result["problems"] == [], result
    print(json.dumps(result["figures"], indent=1))
    # The 2-rank stage 3 checkpoint resumed on one rank with the same global batch.
    result = launch(1, "resume-at-world-1", tmp_path, 29676)
    assert result["problems"] == [], result
    print(json.dumps(result["figures"], indent=1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_accelerate_refuses_an_accelerator_without_cpu_true_on_cpu_ranks(tmp_path):
    """torchrun on CPU ranks with Accelerator() lacking cpu=True: accelerate
    builds the 2-rank group but reports one process (each rank would train on
    every batch and act as main). prepare() raises on every rank, naming
    Accelerator(cpu=True)."""
    result = launch(2, "accelerate-without-cpu", tmp_path, _free_port())
    assert result["problems"] == [], result
