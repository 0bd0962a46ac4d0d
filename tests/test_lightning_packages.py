"""zero_ext.integrations.lightning on each Lightning package and on none.

ZeroExtStrategy's methods are written once (integrations/_lightning_strategy.py)
and put on `lightning.pytorch`'s bases, and on the standalone
`pytorch_lightning`'s by strategy_class("pytorch_lightning") or when that
package is imported first. For each package installed, one process
(tests/lightning_package_scenarios.py) checks what its registry gives for
strategy="zero_ext" (name, base, pickling), the refusal of Lightning's mixed
precision, a one-rank fit against the same loop written with torch alone,
and a saved checkpoint validated into a fresh module. Without Lightning the
import fails with an error that names the install."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import zero_ext

SCENARIOS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_package_scenarios.py")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(zero_ext.__file__)))  # the zero_ext under test
ENV = {**os.environ, "PYTHONPATH": PACKAGE_ROOT}


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package.split(".")[0]) is not None


def test_import_without_lightning_names_the_install():
    probe = (
        "import sys\n"
        "for name in ('lightning', 'lightning.pytorch', 'pytorch_lightning'):\n"
        "    sys.modules[name] = None  # as if not installed\n"
        "import zero_ext.integrations  # the rest of zero_ext imports without Lightning\n"
        "try:\n"
        "    import zero_ext.integrations.lightning\n"
        "except ModuleNotFoundError as error:\n"
        "    print(error.name, '|', error)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    name, message = done.stdout.strip().split(" | ", 1)
    assert name == "lightning"
    assert message.startswith("zero_ext.integrations.lightning needs Lightning")
    assert "pip install lightning" in message and "pip install pytorch-lightning" in message


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lightning_packages"))


@pytest.mark.parametrize("package,strategy_name", [("lightning.pytorch", "ZeroExtStrategy"),
                                                   ("pytorch_lightning", "PytorchLightningZeroExtStrategy")])
def test_strategy_on_package(package, strategy_name, out_dir):
    if not _installed(package):
        pytest.skip(f"{package} is not installed")
    done = subprocess.run([sys.executable, SCENARIOS, package, out_dir], capture_output=True, text=True, timeout=300,
                          cwd=out_dir, env=ENV)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = torch.load(os.path.join(out_dir, f"{package}.pt"), weights_only=True)

    assert result["registered"] == result["strategy"] == result["pickled"] == strategy_name
    assert result["precision"] == strategy_name.replace("Strategy", "Precision")
    assert result["module"] == "zero_ext.integrations.lightning"
    assert result["is_strategy_class"] and result["is_ddp"]
    assert result["bf16_mixed"].startswith(
        "ZeroExtStrategy does not run Lightning's precision plugin MixedPrecision (precision='bf16-mixed')")

    weights, expected, unclipped = result["weights"], result["hand_written"], result["hand_written_unclipped"]
    assert weights.keys() == expected.keys()
    assert max((expected[k] - unclipped[k]).abs().max().item() for k in expected) > 1e-3  # clipping bites
    for name in expected:
        torch.testing.assert_close(weights[name], expected[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert result["restored_val_loss"] == pytest.approx(result["trained_val_loss"], rel=1e-6)
