"""The environment report for bug reports, like DeepSpeed's ds_report:

    python -m zero_ext.env            # aligned "field: value" lines
    python -m zero_ext.env --json     # the same fields as one JSON object

It reports, without starting a process group:
- zero_ext, Python and the platform;
- torch, CUDA, cuDNN, NCCL and the GPUs;
- which torch.distributed backends are built in;
- the build: the torch and compiler it was made with, and whether that is the
  running torch (a build serves only that one);
- the CPU Adam kernel's ISA copy, and the threads and parallel backend;
- the environment variables that change how ranks start and talk;
- the versions of the libraries zero_ext works with.

A core that does not load is reported, not raised: that is when a report is
needed most.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from typing import Dict

import torch
import torch.distributed as dist

from . import build_check

# Prefixes of the environment variables that matter to a distributed run.
ENV_PREFIXES = ("ZERO_EXT_", "NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "GLOO_", "OMP_", "MASTER_", "CUDA_VISIBLE",
                "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_", "SLURM_JOB", "SLURM_NTASKS")
INTEGRATIONS = ("transformers", "accelerate", "lightning", "pytorch-lightning", "deepspeed", "safetensors")


def _version_of(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _gpu_fields() -> Dict[str, str]:
    out = {"cuda (torch built with)": str(torch.version.cuda), "cuda available": str(torch.cuda.is_available())}
    if torch.version.cuda is None:
        return out
    out["cudnn"] = str(torch.backends.cudnn.version())
    try:
        out["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception as error:  # a build without NCCL
        out["nccl"] = f"unavailable ({type(error).__name__})"
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out[f"gpu {i}"] = f"{props.name}, {props.total_memory / 2 ** 30:.1f} GiB, sm_{props.major}{props.minor}"
    return out


def _core_fields() -> Dict[str, str]:
    info = build_check.build_info()
    built = info.get("torch", "unknown")
    out = {
        "zero_ext core": build_check.compiled_core() or "not built (pip install --no-build-isolation .)",
        "built against torch": built,
        "built for the running torch": str(built == torch.__version__),
        "built with": f"{info.get('cxx', 'unknown')} ({info.get('cxx_version', 'version unknown')})",
    }
    try:
        from . import core_loader  # noqa: F401  (loads and checks the core)
        out["cpu adam isa"] = torch.ops.zero_ext.cpu_adam_isa()
    except Exception as error:
        out["core loads"] = f"no: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
    else:
        out["core loads"] = "yes"
    return out


def collect() -> Dict[str, str]:
    """Every field of the report, as strings."""
    from .version import __version__

    out = {
        "zero_ext": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch git": str(getattr(torch.version, "git_version", "unknown")),
    }
    out.update(_gpu_fields())
    for backend in ("gloo", "nccl", "mpi", "ucc"):
        probe = getattr(dist, f"is_{backend}_available", None)
        out[f"backend {backend}"] = str(bool(probe())) if probe is not None else "unknown"
    out.update(_core_fields())
    out["torch threads"] = str(torch.get_num_threads())
    parallel = [line for line in torch.__config__.parallel_info().splitlines() if "parallel backend" in line]
    out["aten parallel backend"] = parallel[0].split(":", 1)[1].strip() if parallel else "unknown"
    out["cpu count"] = str(os.cpu_count())
    for package in INTEGRATIONS:
        out[package] = _version_of(package)
    for name in sorted(os.environ):
        if name.startswith(ENV_PREFIXES):
            out[f"env {name}"] = os.environ[name]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero_ext.env", description="zero_ext's environment report")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of aligned lines")
    args = parser.parse_args(argv)
    report = collect()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        width = max(len(k) for k in report)
        for key, value in report.items():
            print(f"{key.ljust(width)} : {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
