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
import shlex
import shutil
import subprocess
import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

here = os.path.dirname(os.path.abspath(__file__))
sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
# -fopenmp: at::parallel_for is inline and parallelizes with OpenMP pragmas,
# which without the flag compile to a serial loop. -g0 overrides the -g that
# Python's own CFLAGS often carry: debug info for torch's templates costs a
# third of the compile time and 4x the object size (ZERO_EXT_DEBUG keeps it).
extra = ["-O3", "-g0", "-fno-math-errno", "-fopenmp", "-Wno-deprecated-declarations"]
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

    def build_extensions(self) -> None:
        compile_with_precompiled_header()
        super().build_extensions()


# [Note: the precompiled header] Parsing torch's headers (ATen.h alone
# declares every operator) is about three quarters of each translation unit's
# compile time. GCC compiles them once into csrc/precompiled.h's .gch in the
# build directory, with the very flags ninja compiles the sources with
# (taken from torch's BuildExtension at the moment it writes build.ninja), and
# every source is compiled with `-include` of it: a fresh build on 2 cores
# takes about half as long. The .gch is used only where a probe shows the
# compiler accepts it (gcc's -H marks a used one with "!"); a compiler that
# would not (clang, another gcc) builds without it, as before, never wrongly.
PRECOMPILED = os.path.join(here, "csrc", "precompiled.h")


def precompile_header(cxx: list, cflags: list, post_cflags: list, build_dir: str, objects: list):
    """Returns the -include flags for csrc/precompiled.h compiled into
    build_dir, or [] where this compiler cannot use it. A new .gch removes
    the objects: gcc's dependency files leave out what came from a .gch, so
    ninja would not see that they changed."""
    if os.environ.get("ZERO_EXT_NO_PCH") or shutil.which("ccache") or shutil.which("sccache"):
        return []  # a compiler cache would be bypassed by a precompiled header
    # ninja's command, less its -c (the .gch and the probe name their own mode)
    flags = [f for f in shlex.split(" ".join(cflags)) + shlex.split(" ".join(post_cflags)) if f != "-c"]
    pch_dir = os.path.join(build_dir, "precompiled")
    os.makedirs(pch_dir, exist_ok=True)
    header = os.path.join(pch_dir, "zero_ext_precompiled.h")
    gch, stamp = header + ".gch", os.path.join(pch_dir, "recipe.json")
    with open(PRECOMPILED) as f:
        text = f.read()
    recipe = json.dumps([cxx, flags, text])
    if not (os.path.exists(gch) and os.path.exists(stamp) and _read(stamp) == recipe):
        for stale in [gch, stamp] + list(objects):
            if os.path.exists(stale):
                os.remove(stale)
        with open(header, "w") as f:
            f.write(text)
        made = subprocess.run(cxx + flags + ["-x", "c++-header", header, "-o", gch], capture_output=True, text=True)
        if made.returncode != 0:
            print("zero_ext: building without a precompiled header (it did not compile)", file=sys.stderr)
            return []
        with open(stamp, "w") as f:
            f.write(recipe)
    probe = subprocess.run(cxx + flags + ["-include", header, "-H", "-fsyntax-only", "-x", "c++", os.devnull],
                           capture_output=True, text=True)
    if probe.returncode != 0 or f"! {gch}" not in probe.stderr:
        print("zero_ext: building without a precompiled header (this compiler does not use it)",
              file=sys.stderr)
        return []
    return ["-include", header]


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def compile_with_precompiled_header() -> None:
    """Adds the precompiled header to the flags torch writes into build.ninja."""
    import torch.utils.cpp_extension as cpp_extension

    write = getattr(cpp_extension, "_write_ninja_file_and_compile_objects", None)
    if write is None or getattr(write, "zero_ext_precompiled", False):
        return  # another torch: builds as before

    def write_with_precompiled_header(**kwargs):
        if not kwargs.get("with_cuda") and not kwargs.get("with_sycl"):
            cxx = [getattr(cpp_extension, "get_cxx_compiler", lambda: os.environ.get("CXX", "c++"))()]
            # torch's headers as system headers (for gcc, -isystem overrides
            # -I): their warnings, which a .gch would replay in every source,
            # stay theirs.
            system = [f for d in cpp_extension.include_paths() for f in ("-isystem", d)]
            post_cflags = list(kwargs["post_cflags"]) + system
            kwargs["post_cflags"] = post_cflags + precompile_header(
                cxx, kwargs["cflags"], post_cflags, kwargs["build_directory"], kwargs["objects"])
        return write(**kwargs)

    write_with_precompiled_header.zero_ext_precompiled = True
    cpp_extension._write_ninja_file_and_compile_objects = write_with_precompiled_header


info = compiler_info()
with open(os.path.join(here, "zero_ext", "_build_info.json"), "w") as f:
    json.dump(info, f, indent=1)

setup(
    ext_modules=[
        CppExtension(
            "zero_ext._C",
            sources,
            include_dirs=[os.path.join(here, "csrc")],
            depends=sorted(glob.glob(os.path.join("csrc", "*.h"))),  # precompiled.h among them
            extra_compile_args={"cxx": extra},
            extra_link_args=["-fopenmp"],
        )
    ],
    package_data={"zero_ext": ["_build_info.json"]},
    cmdclass={"build_ext": IncrementalBuild},
)
