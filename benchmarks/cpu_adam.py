"""CPU AdamW step throughput: zero_ext's C++ kernel against torch.optim.AdamW.

    python benchmarks/cpu_adam.py                      # 10M, 50M, 200M parameters
    python benchmarks/cpu_adam.py --sizes 10 --reps 5  # sizes in millions

For each size it times one AdamW step (median of --reps after a warm-up) of:
zero_ext's kernel (fp32, and fp32 + a bf16 parameter copy written in the same
pass), torch.optim.AdamW with foreach=True, and with fused=True, and
DeepSpeed's DeepSpeedCPUAdam when deepspeed is installed
(`pip install --no-deps deepspeed hjson msgpack einops` keeps the installed torch). Beside them it
prints the bound that memory bandwidth sets: a STREAM-like copy measured in
the same run (in-place scale and add, the best of them), divided by the bytes an AdamW step must move per parameter
(read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq in place:
28 bytes; +2 for a bf16 copy). Nothing is asserted.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from zero_ext.optim.cpu_adam import adam_step_


def timed(fn, reps: int) -> float:
    fn()  # warm-up (first touch of state pages)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def stream_bandwidth(n: int, reps: int) -> float:
    """Bytes per second of STREAM-like kernels on all threads, in place like an
    optimizer step (no write-allocate traffic): the best of scale (a *= s:
    8 B per element) and add (a += b: 12 B per element)."""
    a, b = torch.randn(n), torch.randn(n)
    scale = 8 * n / timed(lambda: a.mul_(1.0000001), reps)
    add = 12 * n / timed(lambda: a.add_(b, alpha=1e-7), reps)
    return max(scale, add)


def bench_size(n: int, reps: int) -> dict:
    results = {}
    g = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g)
    m, v = torch.zeros(n), torch.zeros(n)
    low = torch.empty(n, dtype=torch.bfloat16)
    step = [0]

    def ours(lowp=None):
        step[0] += 1
        adam_step_(p, grad, m, v, step=step[0], lr=1e-3, weight_decay=0.01, param_lowp=lowp)

    results["zero_ext fp32"] = timed(ours, reps)
    results["zero_ext fp32+bf16 copy"] = timed(lambda: ours(low), reps)
    del m, v, low
    for name, kwargs in (("torch foreach", {"foreach": True}), ("torch fused", {"fused": True})):
        param = torch.nn.Parameter(p.clone())
        param.grad = grad.clone()
        try:
            opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, **kwargs)
            results[name] = timed(opt.step, reps)
        except (RuntimeError, ValueError) as error:  # fused may be unavailable on this build
            results[name] = f"unavailable: {error}"
        del param, opt
        gc.collect()
    results["DeepSpeedCPUAdam"] = deepspeed_step_time(p, grad, reps)
    return results


def deepspeed_step_time(p: torch.Tensor, grad: torch.Tensor, reps: int):
    """DeepSpeed's CPU Adam (AdamW mode, its AVX kernel), when installed."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as error:  # not installed, or its op cannot build here
        return f"unavailable: {type(error).__name__}: {error}"
    param = torch.nn.Parameter(p.clone())
    param.grad = grad.clone()
    opt = DeepSpeedCPUAdam([param], lr=1e-3, weight_decay=0.01, adamw_mode=True)
    seconds = timed(opt.step, reps)
    del param, opt
    gc.collect()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[10, 50, 200], help="millions of parameters")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    bandwidth = stream_bandwidth(50_000_000, args.reps)
    print(f"{args.threads} threads; STREAM-like bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"bound = bandwidth / 28 B per parameter (30 B with the bf16 copy)")
    header = f"{'params':>8} {'system':<26} {'ms/step':>9} {'Mparams/s':>10} {'of bound':>9}"
    print(header)
    print("-" * len(header))
    table = {"copy_bandwidth_bytes_per_s": bandwidth, "sizes": {}}
    for millions in args.sizes:
        n = int(millions * 1e6)
        results = bench_size(n, args.reps)
        table["sizes"][n] = {}
        for name, seconds in results.items():
            if isinstance(seconds, str):
                print(f"{millions:>7g}M {name:<26} {seconds}")
                continue
            per_param = 30 if "bf16" in name else 28
            rate = n / seconds
            bound = bandwidth / per_param
            print(f"{millions:>7g}M {name:<26} {1e3 * seconds:>9.1f} {rate / 1e6:>10.1f} {rate / bound:>8.0%}")
            table["sizes"][n][name] = {"seconds": seconds, "params_per_s": rate, "fraction_of_bound": rate / bound}
        gc.collect()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=2)


if __name__ == "__main__":
    main()
