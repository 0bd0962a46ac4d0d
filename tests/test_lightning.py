"""ZeroExtStrategy (zero_ext.integrations.lightning) under torchrun with 2 CPU
ranks, against Lightning's own DDPStrategy on the same module, data, seed,
AdamW, per-step LR scheduler, accumulate_grad_batches=2 and a gradient_clip_val
that clips every step: the same final weights and logged losses at every
stage; a mid-run checkpoint resumed (on 2 ranks, and on 1 rank at another
stage) ends where the uninterrupted run ends. The ranks' side is
tests/lightning_scenarios.py; two launches serve every test here."""
import importlib.util
import os
import socket
import subprocess
import sys

import pytest
import torch

import zero_ext

# Not pytest.importorskip: importing lightning takes ~8 s here, and only the ranks need it.
if importlib.util.find_spec("lightning") is None:
    pytest.skip("lightning is not installed", allow_module_level=True)

SCENARIOS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_scenarios.py")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(zero_ext.__file__)))  # the zero_ext under test
STEPS = 18           # 3 epochs of 6 optimizer steps, 2 micro-batches each
RESUMED_AT = 9       # lightning_scenarios.SAVE_AT_STEP
RTOL, ATOL = 1e-5, 1e-6


def _free_port() -> int:
    """A port no one listens on now: under pytest-xdist both workers may run
    this module's fixtures at once, and a fixed port collides (EADDRINUSE)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(ranks: int, command: str, out_dir: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--master-port", str(_free_port()), SCENARIOS, command, out_dir]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=out_dir,
                          env={**os.environ, "PYTHONPATH": PACKAGE_ROOT})
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    return torch.load(os.path.join(out_dir, f"{command}.pt"), weights_only=True)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lightning"))


@pytest.fixture(scope="module")
def runs(out_dir):
    return _launch(2, "train", out_dir)


@pytest.fixture(scope="module")
def one_rank(runs, out_dir):
    return _launch(1, "resume_one_rank", out_dir)["resumed"]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _assert_weights_close(actual: dict, expected: dict, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def test_clipping_is_active_in_this_setup(runs):
    # Otherwise the comparisons below would not notice clipping computed on one rank's shards.
    assert _max_diff(runs["ddp"]["weights"], runs["ddp_unclipped"]["weights"]) > 1e-2


def test_clipping_by_value_as_ddp(runs):
    ddp, mine = runs["ddp_value_clipped"], runs["stage3_value_clipped"]
    assert _max_diff(ddp["weights"], runs["ddp_unclipped"]["weights"]) > 1e-2  # it clips
    _assert_weights_close(mine["weights"], ddp["weights"])
    torch.testing.assert_close(mine["logged"], ddp["logged"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_trains_as_ddp(runs, stage):
    ddp, mine = runs["ddp"], runs[f"stage{stage}"]
    _assert_weights_close(mine["weights"], ddp["weights"])
    assert len(mine["logged"]) == len(ddp["logged"]) == STEPS
    torch.testing.assert_close(mine["logged"], ddp["logged"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(mine["micro_batch_losses"], ddp["micro_batch_losses"], rtol=RTOL, atol=ATOL)
    assert mine["global_step"] == STEPS and mine["lr"] == ddp["lr"]
    # The accumulating backward of each step ran under no_sync(): one reduction per step.
    assert mine["synced_backwards"] == STEPS


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_two_optimizers_muon_and_adamw_train_as_ddp(runs, stage):
    # configure_optimizers returns [Muon, AdamW]; the strategy wraps them as one list (Muon by whole parameter).
    mine, ddp = runs[f"muon_adamw_stage{stage}"], runs["muon_adamw_ddp"]
    _assert_weights_close(mine["weights"], ddp["weights"])
    torch.testing.assert_close(mine["micro_batch_losses"], ddp["micro_batch_losses"], rtol=RTOL, atol=ATOL)
    assert _max_diff(ddp["weights"], runs["ddp"]["weights"]) > 1e-2  # Muon ran: not the AdamW run's weights


def test_manual_optimization_trains_as_ddp(runs):
    # block_backward_sync(), manual_backward() and self.clip_gradients() by hand, at stage 3.
    manual = runs["manual_stage3"]
    _assert_weights_close(manual["weights"], runs["ddp"]["weights"])
    torch.testing.assert_close(manual["micro_batch_losses"], runs["ddp"]["micro_batch_losses"], rtol=RTOL, atol=ATOL)
    assert manual["synced_backwards"] == STEPS


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_mid_run_ends_as_uninterrupted(runs, stage):
    whole, resumed = runs[f"stage{stage}"], runs[f"stage{stage}_resumed"]
    # Weights, Adam's moments, the LR schedule, the loop counters and the
    # data position all came back: the same steps, to the last bit or nearly.
    _assert_weights_close(resumed["weights"], whole["weights"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(resumed["logged"], whole["logged"][RESUMED_AT:], rtol=1e-6, atol=1e-7)
    assert resumed["global_step"] == STEPS and resumed["lr"] == whole["lr"]
    assert resumed["synced_backwards"] == STEPS - RESUMED_AT


def test_resume_on_one_rank_at_stage_2(runs, one_rank):
    # The stage 3 checkpoint of 2 ranks, on 1 rank at stage 2 over the same global batches.
    _assert_weights_close(one_rank["weights"], runs["stage3"]["weights"])
    assert one_rank["global_step"] == STEPS


def test_fp16_runs_zero_ext_mixed_precision_unchanged(runs):
    # ZeroExtStrategy(mixed_precision="fp16") against the same loop written with zero_ext alone.
    _assert_weights_close(runs["fp16"]["weights"], runs["fp16_hand_written"]["weights"], rtol=0, atol=1e-7)
    assert _max_diff(runs["fp16"]["weights"], runs["stage2"]["weights"]) > 1e-3  # fp16 really ran


def test_best_model_checkpoint_validates_to_its_score(runs):
    best = runs["best"]
    assert len(best["epochs_saved"]) == 1  # save_top_k=1 removed the directories it replaced
    # trainer.validate(ckpt_path="best") into the trained (wrapped) module, and into a fresh one.
    assert best["wrapped"] == pytest.approx(best["score"], rel=1e-6)
    assert best["fresh"] == pytest.approx(best["score"], rel=1e-6)


def test_registry_and_refusals(runs):
    checks = runs["checks"]
    assert checks["registered"] == "ZeroExtStrategy stage 2"
    assert checks["bf16_mixed"].startswith("ValueError") and "mixed_precision='bf16'" in checks["bf16_mixed"]

