"""Builds zero_ext._C against the torch that is already installed (CPU or CUDA).

The extension is pure C++: CUDA streams are reached through c10's device-generic
interfaces at run time, so no nvcc is needed and one build serves CPU and GPU.
"""
import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

here = os.path.dirname(os.path.abspath(__file__))
sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
# -fopenmp: at::parallel_for is inline and parallelizes with OpenMP pragmas,
# which without the flag compile to a serial loop.
extra = ["-O3", "-fno-math-errno", "-fopenmp", "-Wno-deprecated-declarations"]
if os.environ.get("ZERO_EXT_DEBUG"):
    extra = ["-O0", "-g", "-fopenmp", "-Wno-deprecated-declarations"]

setup(
    ext_modules=[
        CppExtension(
            "zero_ext._C",
            sources,
            include_dirs=[os.path.join(here, "csrc")],
            extra_compile_args={"cxx": extra},
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
