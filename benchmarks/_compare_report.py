"""compare.py's report: the table it prints and the PNG it draws."""
from __future__ import annotations

from typing import Dict, Optional

from _accounting import stage_of
from _models import describe


def print_table(args, results: Dict[str, Dict], numel: int) -> None:
    mib = 2 ** 20
    malloc = f"glibc mmap threshold {args.mmap_threshold}" if args.mmap_threshold else "default glibc malloc"
    print(f"{describe(args.model)}: {numel / 1e6:.1f}M parameters; world size {args.world} (gloo, CPU, "
          f"{args.threads} thread(s) per rank, {malloc}); {args.batch}x{args.seq} tokens per rank; "
          f"median of {args.steps} steps after {args.warmup}")
    header = (f"{'system':<12} {'ms/step':>8} {'vs DDP':>7} {'vs FSDP2':>8} {'tok/s':>7} {'peak RSS':>9} "
              f"{'state MiB':>10} {'ZeRO MiB':>9} {'ratio':>6} {'sent MiB':>9} {'theory':>7} {'loss':>7}")
    print(header)
    print("-" * len(header))

    def ms_of(name):
        r = results.get(name)
        return r["ms_per_step"] if r and "error" not in r else None

    ddp = ms_of("ddp")
    for system, r in results.items():
        if "error" in r:
            print(f"{system:<12} not run: {r['error']}")
            continue
        fsdp = ms_of("fsdp2-keep" if system == "fsdp2-keep" or stage_of(system) < 3 else "fsdp2")
        vs = lambda base: f"{r['ms_per_step'] / base:.2f}x" if base else "-"  # noqa: E731
        print(f"{system:<12} {r['ms_per_step']:>8.1f} {vs(ddp):>7} {vs(fsdp):>8} {r['tokens_per_s']:>7.0f} "
              f"{r['peak_rss_mib']:>8.0f}M {r['state_bytes'] / mib:>10.1f} {r['zero_formula_bytes'] / mib:>9.1f} "
              f"{r['state_vs_formula']:>6.3f} {r['sent_bytes'] / mib:>9.1f} {r['theory_sent_bytes'] / mib:>7.1f} "
              f"{r['losses'][-1]:>7.4f}")
    print("vs FSDP2: against fsdp2-keep for stages 0-2 and fsdp2-keep, against fsdp2 for stage 3.")
    grouped = {k: r for k, r in results.items() if "error" not in r and r.get("sent_by_group")}
    if grouped:
        print("\nzero_ext, MiB sent per rank per step by group (counted from its issue log; theory on gloo):")
        print(f"{'system':<16} {'within row':>11} {'theory':>7} {'across replicas':>16} {'theory':>7}")
        for system, r in grouped.items():
            got, want = r["sent_by_group"]["measured"], r["sent_by_group"]["theory"]
            print(f"{system:<16} {got['within_row'] / mib:>11.2f} {want['within_row'] / mib:>7.2f} "
                  f"{got['across_replicas'] / mib:>16.2f} {want['across_replicas'] / mib:>7.2f}")


def plot(args, results: Dict[str, Dict], path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = {s: r for s, r in results.items() if "error" not in r}
    if not ok:
        return None
    names = list(ok)
    colors = ["#4c72b0" if s == "ddp" else "#55a868" if s.startswith("fsdp2") else
              "#c44e52" if s.startswith("deepspeed") else "#8172b2" for s in names]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    panels = [
        (axes[0][0], [ok[s]["ms_per_step"] for s in names], "ms per step (lower is better)"),
        (axes[0][1], [ok[s]["state_bytes"] / 2 ** 20 for s in names], "model-state MiB per rank"),
        (axes[1][0], [ok[s]["sent_bytes"] / 2 ** 20 for s in names], "MiB sent per rank per step"),
    ]
    for ax, values, title in panels:
        ax.bar(names, values, color=colors)
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=45)
    for ax, key, label in ((axes[0][1], "zero_formula_bytes", "ZeRO formula"),
                           (axes[1][0], "theory_sent_bytes", "theory (gloo)")):
        marks = [ok[s][key] / 2 ** 20 for s in names]
        ax.scatter(names, marks, color="black", marker="_", s=400, label=label, zorder=3)
        top = max(marks + [p.get_height() for p in ax.patches])
        ax.set_ylim(0, 1.3 * top)  # room for the legend above the marks
        ax.legend(loc="upper right")
    ax = axes[1][1]
    for s in names:
        ax.plot(range(1, len(ok[s]["losses"]) + 1), ok[s]["losses"], label=s,
                linestyle="--" if s.startswith("zero_ext") else "-")
    ax.set_title("training loss (global batch)")
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    fig.suptitle(f"{describe(args.model)}, world size {args.world} (gloo, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
