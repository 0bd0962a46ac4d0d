"""Builds zero_ext._C against the torch that is already installed (CPU or CUDA).

The extension is pure C++: CUDA streams are reached through c10's device-generic
interfaces at run time, so no nvcc is needed and one build serves CPU and GPU.
The compiler and torch it was built with are recorded in
zero_ext/_build_info.json, for the build's self-check (zero_ext/selfcheck.py)
and the error messages that name them.

Builds are incremental: objects live in build/incremental/<key> (key: torch,
compiler, flags, Python), where ninja recompiles only the translation units
whose sources, headers or command changed, also under `pip install -e .`,
which would otherwise compile everything in a fresh temporary directory. A
different torch or compiler gets a new key, so a clean build.
"""
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

here = os.path.dirname(os.path.abspath(__file__))
sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
# -fopenmp: at::parallel_for is inline and parallelizes with OpenMP pragmas,
# which without the flag compile to a serial loop.
extra = ["-O3", "-fno-math-errno", "-fopenmp", "-Wno-deprecated-declarations"]
if os.environ.get("ZERO_EXT_DEBUG"):
    extra = ["-O0", "-g", "-fopenmp", "-Wno-deprecated-declarations"]


def compiler_info() -> dict:
    # torch.utils.cpp_extension compiles with $CXX, else `c++`.
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx.split()[0]) or cxx
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        version = "version unknown"
    return {"cxx": path, "cxx_realpath": os.path.realpath(path), "cxx_version": version,
            "torch": torch.__version__}


class IncrementalBuild(BuildExtension):
    """BuildExtension in a persistent directory keyed by what the objects
    depend on besides their sources."""

    def finalize_options(self) -> None:
        super().finalize_options()
        key = hashlib.sha256(json.dumps(
            [info, extra, torch.__file__, sys.version, os.environ.get("CC"), os.environ.get("CFLAGS"),
             os.environ.get("CXXFLAGS")]).encode()).hexdigest()[:16]
        root = os.path.join(here, "build", "incremental")
        self.build_temp = os.path.join(root, key)
        for other in glob.glob(os.path.join(root, "*")):
            if other != self.build_temp:
                shutil.rmtree(other, ignore_errors=True)  # objects of another torch or compiler: never reusable
        # BuildExtension forces every build and lets ninja skip unchanged
        # objects, but the link and the copy of the .so into the package still
        # run. Instead setuptools rebuilds only when a source or header (the
        # extension's depends) is newer than the built .so, then ninja
        # recompiles only what changed; a new key (another torch or compiler)
        # has no objects yet, so it builds. An up-to-date .so is left alone,
        # which also spares processes that have it loaded.
        self.force = not os.path.isdir(self.build_temp)


info = compiler_info()
with open(os.path.join(here, "zero_ext", "_build_info.json"), "w") as f:
    json.dump(info, f, indent=1)

setup(
    ext_modules=[
        CppExtension(
            "zero_ext._C",
            sources,
            include_dirs=[os.path.join(here, "csrc")],
            depends=sorted(glob.glob(os.path.join("csrc", "*.h"))),
            extra_compile_args={"cxx": extra},
            extra_link_args=["-fopenmp"],
        )
    ],
    package_data={"zero_ext": ["_build_info.json"]},
    cmdclass={"build_ext": IncrementalBuild},
)
