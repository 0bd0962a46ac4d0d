"""python -m zero_ext.env: the environment report's fields, from a fresh process."""
import json
import os
import re
import subprocess
import sys

import torch
import torch.distributed as dist

import zero_ext

# The zero_ext this test imports (the checkout, or the copy the torch-versions
# script built against another torch), and its sources.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(zero_ext.__file__)))


def report(*args, env=None):
    done = subprocess.run([sys.executable, "-m", "zero_ext.env", *args], capture_output=True, text=True, cwd=PACKAGE_ROOT,
                          env={**os.environ, "PYTHONPATH": PACKAGE_ROOT, **(env or {})}, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_report_names_the_versions_the_build_and_the_kernel():
    fields = json.loads(report("--json", env={"OMP_NUM_THREADS": "1", "ZERO_EXT_SELFCHECK": "0"}))
    assert fields["torch"] == torch.__version__
    assert fields["built against torch"] == torch.__version__ and fields["built for the running torch"] == "True"
    assert fields["core loads"] == "yes"
    assert re.match(r"x86-64-v4 \(AVX-512\)|x86-64-v3 \(AVX2, FMA\)|x86-64 baseline|one copy", fields["cpu adam isa"])
    assert fields["backend gloo"] == str(dist.is_gloo_available()) == "True"
    assert fields["cuda (torch built with)"] == str(torch.version.cuda)
    assert fields["torch threads"] == "1" and fields["env OMP_NUM_THREADS"] == "1"
    assert fields["env ZERO_EXT_SELFCHECK"] == "0"
    assert fields["python"] == sys.version.split()[0]


def test_isa_is_the_copy_this_cpu_runs():
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    fields = json.loads(report("--json"))
    if " avx512f " in flags and " avx512bw " in flags:
        assert fields["cpu adam isa"].startswith("x86-64-v4")
    elif " avx2 " in flags and " fma " in flags:
        assert fields["cpu adam isa"].startswith("x86-64-v3")


def test_lines_are_aligned_and_a_core_that_cannot_load_is_reported(tmp_path):
    text = report()
    assert re.search(r"^torch +: " + re.escape(torch.__version__) + "$", text, re.M)
    # A build made for another torch: reported, not raised.
    fake = tmp_path / "zero_ext"
    fake.mkdir()
    for name in os.listdir(os.path.join(PACKAGE_ROOT, "zero_ext")):
        path = os.path.join(PACKAGE_ROOT, "zero_ext", name)
        if name.endswith(".py") or os.path.isfile(os.path.join(path, "__init__.py")):  # modules and subpackages
            os.symlink(path, fake / name)
    (fake / "_build_info.json").write_text(json.dumps({"torch": "1.0.0", "cxx": "/usr/bin/c++"}))
    done = subprocess.run([sys.executable, "-m", "zero_ext.env", "--json"], capture_output=True, text=True,
                          cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=120)
    assert done.returncode == 0, done.stderr
    fields = json.loads(done.stdout)
    assert fields["built for the running torch"] == "False"
    assert fields["core loads"].startswith("no: ImportError") and "built against torch 1.0.0" in fields["core loads"]
