"""benchmarks/gpu.py's parent side, after the ranks: one row from the
ranks' results (step time, throughput, model-FLOPs utilization, peak
memory), the machine's facts, and the tables it prints and writes."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import statistics
import subprocess
from typing import List, Optional

import torch

from _gpu_rank import Job
from _models import PRESETS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30


# Dense bf16 tensor-core peaks (no sparsity), for model-FLOPs utilization.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0,
                    "L40S": 362.0, "A10G": 70.0}


def peak_tflops(device_name: str) -> Optional[float]:
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in device_name:
            return PEAK_BF16_TFLOPS[key]
    return None


def train_flops_per_token(model: str, seq: int, n_params: int) -> float:
    """6N for the weights' matmuls (forward 2N, backward 4N) plus attention's
    score and value matmuls, 12 * layers * dim * seq (PaLM's appendix B)."""
    p = PRESETS[model]
    return 6.0 * n_params + 12.0 * p.layers * p.dim * seq


def combine(job: Job, per_rank: List[dict]) -> dict:
    row = {"model": job.model, "system": job.system, "world": job.world, "batch_per_rank": job.batch,
           "seq": job.seq, "log": f"{job.log_prefix}.rank*.log"}
    errors = [r for r in per_rank if r["status"] != "ok"]
    if errors:
        # The first rank to fail is the cause; the others mostly fail waiting on
        # it (broken connections), and ranks we killed come last.
        first = min(errors, key=lambda r: (r.get("failed_at") is None, r.get("failed_at") or 0.0))
        row.update(status="error", error=f"rank {first['rank']}: {first['error']}", per_rank=per_rank)
        return row
    step_s = max(r["median_step_s"] for r in per_rank)  # the slowest rank sets the pace
    tokens_per_rank = job.batch * job.seq / step_s
    peak = peak_tflops(per_rank[0].get("device_name", ""))
    model_tflops = train_flops_per_token(job.model, job.seq, per_rank[0]["params"]) * tokens_per_rank / 1e12
    phases = {name: 1e3 * max(r["median_phase_s"][name] for r in per_rank)
              for name in per_rank[0]["median_phase_s"]}

    def peak_gib(key):
        values = [r[key] for r in per_rank if r[key] is not None]
        return max(values) / GiB if values else None

    row.update(
        status="ok", error=None, params=per_rank[0]["params"],
        precision=per_rank[0]["precision"], optimizer=per_rank[0]["optimizer"],
        collectives=per_rank[0]["collectives"],
        ms_per_step=1e3 * step_s, tokens_per_s_per_rank=tokens_per_rank,
        tokens_per_s_total=tokens_per_rank * job.world,
        model_tflops_per_rank=model_tflops, mfu=model_tflops / peak if peak else None,
        forward_ms=phases["forward"], backward_ms=phases["backward"], optimizer_ms=phases["optimizer"],
        peak_gpu_allocated_gib=peak_gib("peak_gpu_allocated_bytes"),
        peak_gpu_reserved_gib=peak_gib("peak_gpu_reserved_bytes"),
        # Growth of the reserve from the first timed step to the last, worst rank: 0 when flat.
        reserved_growth_mib=(max(r["reserved_after_step_bytes"][-1] - r["reserved_after_step_bytes"][0]
                                 for r in per_rank) / 2 ** 20
                             if per_rank[0].get("reserved_after_step_bytes") else None),
        gpu_after_build_gib=peak_gib("gpu_after_build_bytes"),
        peak_rss_gib=peak_gib("peak_rss_bytes"),
        loss=statistics.mean(r["loss"] for r in per_rank),
        profiled_ms=({k: max(r["profiled_ms"][k] for r in per_rank) for k in per_rank[0]["profiled_ms"]}
                     if per_rank[0].get("profiled_ms") else None),
        per_rank=per_rank,
    )
    return row


def git_facts() -> dict:
    def git(*cmd):
        try:
            return subprocess.run(["git", "-C", REPO, *cmd], capture_output=True, text=True,
                                  timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"zero_ext_commit": git("rev-parse", "HEAD"), "zero_ext_dirty": bool(status)}


def machine_facts(device: str) -> dict:
    """Read after the runs, so the parent's own CUDA context never shares a GPU with a rank."""
    facts = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "device": device,
        **git_facts(),
        "zero_ext_path": getattr(importlib.util.find_spec("zero_ext"), "origin", None),
    }
    try:
        facts["deepspeed"] = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        facts["deepspeed"] = None
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        facts.update(gpu_count=count, gpus=[torch.cuda.get_device_name(i) for i in range(count)],
                     gpu_memory_gib=torch.cuda.get_device_properties(0).total_memory / GiB)
        try:
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - informational only
            facts["nccl"] = None
    else:
        facts.update(gpu_count=0, gpus=[])
    return facts


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: List[dict]) -> None:
    header = (f"{'system':<19} {'model':<10} {'world':>5} {'ms/step':>9} {'fwd/bwd/opt ms':>17} {'tok/s/rank':>11} "
              f"{'tok/s total':>12} {'MFU':>6} {'GPU GiB alloc/resv':>19} {'resv +MiB':>9} {'RSS GiB':>8} {'loss':>7}  status")
    print(header)
    print("-" * len(header))
    for r in rows:
        gpu = "-" if r.get("peak_gpu_allocated_gib") is None else (
            f"{r['peak_gpu_allocated_gib']:.2f}/{r['peak_gpu_reserved_gib']:.2f}")
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['error']}"
        if r.get("bf16_error"):
            status += " (fp32: bf16 failed on CPU)"
        phases = "-" if r.get("forward_ms") is None else (
            f"{r['forward_ms']:.1f}/{r['backward_ms']:.1f}/{r['optimizer_ms']:.1f}")
        print(f"{r['system']:<19} {r['model']:<10} {r['world']:>5} {fmt(r.get('ms_per_step'), '.1f'):>9} "
              f"{phases:>17} {fmt(r.get('tokens_per_s_per_rank'), ',.0f'):>11} "
              f"{fmt(r.get('tokens_per_s_total'), ',.0f'):>12} {fmt(r.get('mfu'), '.1%'):>6} "
              f"{gpu:>19} {fmt(r.get('reserved_growth_mib'), '.0f'):>9} {fmt(r.get('peak_rss_gib'), '.2f'):>8} {fmt(r.get('loss'), '.4f'):>7}  {status[:110]}")
    for line in profile_lines(rows, markdown=False):
        print(line)


PROFILE_COLUMNS = ("hooks", "gather", "epilogue", "opt", "gpu_matmul", "gpu_nccl", "gpu_memcpy", "gpu_other",
                   "gpu_total")


def profile_lines(rows: List[dict], markdown: bool) -> List[str]:
    """The profiled step's breakdown, a line per system that has one (ms)."""
    profiled = [r for r in rows if r.get("profiled_ms")]
    if not profiled:
        return []
    cells = lambda r: [fmt(r["profiled_ms"].get(c), ".1f") for c in PROFILE_COLUMNS]  # noqa: E731
    if markdown:
        lines = ["", "One profiled step, ms: host time inside zero_ext's ranges (hooks = accumulate_grad, gather = "
                 "gather_unit + release_unit, epilogue = run_epilogue, opt = zero_ext::step) and GPU kernel time "
                 "by kind (gpu_total: all kernels; the step's wall time less it is time the GPU waited for the host).", "", "| system | model | " + " | ".join(PROFILE_COLUMNS) + " |",
                 "|---|---|" + "---|" * len(PROFILE_COLUMNS)]
        lines += [f"| {r['system']} | {r['model']} | " + " | ".join(cells(r)) + " |" for r in profiled]
        return lines
    lines = ["", "one profiled step, ms (host time in zero_ext's ranges; GPU kernel time by kind)",
             f"{'system':<19} {'model':<10} " + " ".join(f"{c:>10}" for c in PROFILE_COLUMNS)]
    lines += [f"{r['system']:<19} {r['model']:<10} " + " ".join(f"{v:>10}" for v in cells(r)) for r in profiled]
    return lines


def markdown_table(rows: List[dict], facts: dict) -> str:
    gpus = ", ".join(sorted(set(facts.get("gpus") or []))) or "no GPU"
    lines = [f"torch {facts.get('torch')}, CUDA {facts.get('cuda')}, {facts.get('gpu_count')} x {gpus}, "
             f"zero_ext {(facts.get('zero_ext_commit') or 'unknown')[:10]}"
             f"{' (dirty)' if facts.get('zero_ext_dirty') else ''}", "",
             "| system | model | world | ms/step | fwd/bwd/opt ms | tok/s total | MFU | peak GiB alloc/resv | loss | status |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = r["status"] == "ok"
        lines.append(
            f"| {r['system']} | {r['model']} | {r['world']} | {fmt(r.get('ms_per_step'), '.1f')} | "
            + (f"{r['forward_ms']:.1f}/{r['backward_ms']:.1f}/{r['optimizer_ms']:.1f}" if ok else "-") + " | "
            f"{fmt(r.get('tokens_per_s_total'), ',.0f')} | {fmt(r.get('mfu'), '.1%')} | "
            + (f"{r['peak_gpu_allocated_gib']:.2f}/{r['peak_gpu_reserved_gib']:.2f}"
               if r.get("peak_gpu_allocated_gib") is not None else "-")
            + f" | {fmt(r.get('loss'), '.4f')} | {r['status'] if ok else r['status'] + ': ' + str(r['error'])[:80]} |")
    return "\n".join(lines + profile_lines(rows, markdown=True)) + "\n"
