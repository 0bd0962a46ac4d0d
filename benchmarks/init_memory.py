"""Peak memory and time per rank to build, shard and load a pretrained model
too big to want whole on every rank: zero_ext (empty_init + wrap stage 3 +
load_weights) against DeepSpeed (zero.Init + ZeRO-3 + Hugging Face's way of
loading into it) and FSDP2 (meta init + fully_shard + to_empty +
set_model_state_dict broadcast from rank 0), on CPU ranks with gloo.

    python benchmarks/init_memory.py --world 2 4
    python benchmarks/init_memory.py --layers 2 --hidden 256 --world 2   # a quick run

The weights (a Llama config, random values) are written once as safetensors
in Hugging Face's sharded layout. Each system runs in fresh processes; the
peak is VmHWM reset after the imports, so it counts what building, sharding
and loading add. A loss on a fixed batch checks that every system loaded the
same weights.

Systems:
  zero_ext           with zero_ext.empty_init(): build; wrap(stage=3,
                     param_init_fn=zero_ext.skip_init): no unit whole, nothing
                     broadcast; zero_ext.load_weights(directory): each rank
                     reads its own byte ranges.
  zero_ext-whole     the model built normally (random init) on every rank,
                     then wrap(stage=3) and load_weights: what deferred init saves.
  deepspeed-3        with deepspeed.zero.Init(): build (initialized, then
                     partitioned, one parameter at a time); deepspeed.initialize
                     (stage 3); then, as transformers loads into ZeRO-3, per
                     module GatheredParameters(modifier_rank=0) and rank 0
                     copies the tensors it reads from the files.
  fsdp2              with torch.device("meta"): build; fully_shard per
                     decoder layer and the root; to_empty(cpu); rank 0 reads
                     the files whole, set_model_state_dict(full_state_dict=True,
                     broadcast_from_rank0=True).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from contextlib import nullcontext
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _accounting import proc_status_kib as kib, reset_peak_rss as reset_peak  # noqa: E402

ALL_SYSTEMS = ["zero_ext", "zero_ext-whole", "deepspeed-3", "fsdp2"]


def llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.heads, max_position_embeddings=256, tie_word_embeddings=False)


def write_weights(args, directory: str) -> int:
    """Random weights for every parameter, streamed to safetensors one tensor
    at a time (never the whole model in memory); the parameter count."""
    from transformers import LlamaForCausalLM

    from zero_ext.files.weights.safetensors import ModelWriter, parse_size

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(args))
    entries = [(n, torch.float32, tuple(p.shape)) for n, p in model.named_parameters()]
    writer = ModelWriter(directory, entries, parse_size(args.max_shard_size))
    g = torch.Generator().manual_seed(0)
    for i, (name, _, shape) in enumerate(entries):
        writer.put(i, torch.randn(shape, generator=g) * 0.02 if not name.endswith("norm.weight") else torch.ones(shape))
    writer.finish()
    with open(os.path.join(directory, "config.json"), "w") as f:
        f.write(llama_config(args).to_json_string())
    return sum(p.numel() for p in model.parameters())


def probe_loss(model, args) -> float:
    tokens = torch.randint(0, args.vocab, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()))


class PhaseClock:
    """Each phase's seconds and the peak RSS it added over the baseline (KiB),
    read once every rank has finished it; the next phase's clock starts then."""

    def __init__(self, baseline_kib: int) -> None:
        self.baseline = baseline_kib
        self.phases: List = []
        self.start = time.perf_counter()

    def done(self, name: str) -> None:
        dist.barrier()
        self.phases.append((name, time.perf_counter() - self.start, kib("VmHWM") - self.baseline))
        self.start = time.perf_counter()


def zero_ext_system(system: str, config, directory: str, rank: int, clock: PhaseClock):
    """zero_ext: built under empty_init (or, zero_ext-whole, normally), wrapped
    at stage 3, then load_weights."""
    from transformers import LlamaForCausalLM

    import zero_ext

    deferred = system == "zero_ext"
    with zero_ext.empty_init() if deferred else nullcontext():
        model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    clock.done("build")
    model, opt = zero_ext.wrap(model, opt, stage=3, **({"param_init_fn": zero_ext.skip_init} if deferred else {}))
    clock.done("shard")
    zero_ext.load_weights(model, directory)
    clock.done("load")
    return model, opt


def deepspeed_load(model, directory: str, rank: int) -> None:
    """As transformers loads into ZeRO-3: per module, GatheredParameters with
    rank 0 copying the tensors it reads from the files."""
    import deepspeed
    from safetensors import safe_open

    files = {}
    index = os.path.join(directory, "model.safetensors.index.json")
    weight_map = json.load(open(index))["weight_map"] if os.path.exists(index) else None
    for prefix, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        if not params:
            continue
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
            if rank == 0:
                for name, p in params:
                    key = f"{prefix}.{name}" if prefix else name
                    file = weight_map[key] if weight_map else "model.safetensors"
                    if file not in files:
                        files[file] = safe_open(os.path.join(directory, file), "pt")
                    with torch.no_grad():
                        p.copy_(files[file].get_tensor(key))
    files.clear()


def deepspeed_system(system: str, config, directory: str, rank: int, clock: PhaseClock):
    import deepspeed
    from safetensors import safe_open  # noqa: F401  (deepspeed_load's, imported in the build phase)
    from transformers import LlamaForCausalLM

    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = LlamaForCausalLM(config)
    clock.done("build")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    clock.done("shard")
    deepspeed_load(model, directory, rank)
    clock.done("load")
    return engine.module, engine


def full_state_of_files(directory: str) -> Dict:
    """Every tensor of the safetensors files, read whole."""
    from safetensors.torch import load_file

    full = {}
    index = os.path.join(directory, "model.safetensors.index.json")
    names = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) \
        else ["model.safetensors"]
    for name in names:
        full.update(load_file(os.path.join(directory, name)))
    return full


def fsdp2_system(system: str, config, directory: str, rank: int, clock: PhaseClock):
    from safetensors.torch import load_file  # noqa: F401  (full_state_of_files', imported in the build phase)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    clock.done("build")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    # to_empty leaves the rotary buffers uninitialized; take them from a fresh module.
    rotary = model.model.rotary_emb
    fresh = type(rotary)(config)
    rotary.inv_freq.copy_(fresh.inv_freq)
    rotary.original_inv_freq.copy_(fresh.original_inv_freq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    clock.done("shard")
    full = full_state_of_files(directory) if rank == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    clock.done("load")
    return model, opt


# Each builds, shards and loads (phases "build", "shard", "load"): (model, its optimizer or engine).
SYSTEMS = {"zero_ext": zero_ext_system, "zero_ext-whole": zero_ext_system, "deepspeed-3": deepspeed_system,
           "fsdp2": fsdp2_system}


def run_system(system: str, args, directory: str, rank: int, world: int) -> Dict:
    from transformers import LlamaForCausalLM  # noqa: F401  imported before the baseline, like the others

    import zero_ext  # noqa: F401
    if system.startswith("deepspeed"):
        import deepspeed  # noqa: F401  imported before the baseline, like the others
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system}")
    baseline = kib("VmRSS")
    reset_peak()
    config = llama_config(args)
    clock = PhaseClock(baseline)
    # The system's optimizer (DeepSpeed: its engine) lives on to the probe, as the model does.
    model, _kept = SYSTEMS[system](system, config, directory, rank, clock)
    loss = probe_loss(model, args)
    return {"phases": clock.phases, "loss": loss, "baseline_mib": baseline / 1024}


def rank_main(rank: int, world: int, system: str, args, directory: str, init_file: str, out_dir: str) -> None:
    log = os.open(os.path.join(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.timeout))
        if system.startswith("deepspeed"):
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
        result = run_system(system, args, directory, rank, world)
    except Exception as error:  # noqa: BLE001 - reported in the table
        traceback.print_exc()
        result = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # some systems abort in teardown; the result is written


def run(system: str, world: int, args, directory: str) -> List[Dict]:
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=rank_main, args=(r, world, system, args, directory, os.path.join(tmp, "rdv"), tmp))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(args.timeout + 60)
            if p.is_alive():
                p.kill()
        out = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.json")
            if os.path.exists(path):
                out.append(json.load(open(path)))
            else:
                tail = open(os.path.join(tmp, f"rank{r}.log")).read()[-600:]
                out.append({"error": f"rank {r} wrote no result: {tail}"})
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", default=ALL_SYSTEMS, choices=ALL_SYSTEMS)
    parser.add_argument("--world", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5504)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max-shard-size", default="1GB")
    parser.add_argument("--weights", default=None, help="reuse a directory written by an earlier run")
    parser.add_argument("--whole-max-world", type=int, default=2,
                        help="zero_ext-whole only up to this world size (every rank holds the model)")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    directory = args.weights or tempfile.mkdtemp(prefix="init_memory_")
    if args.weights and os.path.exists(os.path.join(directory, "config.json")):
        from transformers import LlamaForCausalLM

        with torch.device("meta"):
            params = sum(p.numel() for p in LlamaForCausalLM(llama_config(args)).parameters())
    else:
        t = time.perf_counter()
        params = write_weights(args, directory)
        print(f"wrote {params / 1e9:.3f}B parameters ({params * 4 / 2**30:.2f} GiB fp32) to {directory} "
              f"in {time.perf_counter() - t:.0f} s", flush=True)
    whole_gib = params * 4 / 2**30
    rows = []
    print(f"\nLlama {params / 1e9:.3f}B (fp32 {whole_gib:.2f} GiB whole), torch {torch.__version__}, "
          f"CPU gloo ranks, peak RSS added per rank (MiB, max over ranks) and time (s)\n")
    print("| system | world | build MiB | shard MiB | load MiB | peak / (whole/world) | build s | shard s | load s | probe loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for world in args.world:
        for system in args.systems:
            if system == "zero_ext-whole" and world > args.whole_max_world:
                continue
            results = run(system, world, args, directory)
            errors = [r["error"] for r in results if "error" in r]
            if errors:
                print(f"| {system} | {world} | error: {errors[0][:200]} |", flush=True)
                rows.append({"system": system, "world": world, "error": errors[0]})
                continue
            peaks = [max(p[2] for p in r["phases"][:k + 1]) / 1024 for r in results for k in range(3)]
            per_phase = [max(max(p[2] for p in r["phases"][:k + 1]) / 1024 for r in results) for k in range(3)]
            seconds = [max(r["phases"][k][1] for r in results) for k in range(3)]
            ratio = per_phase[2] / (whole_gib * 1024 / world)
            print(f"| {system} | {world} | {per_phase[0]:.0f} | {per_phase[1]:.0f} | {per_phase[2]:.0f} | {ratio:.2f} | "
                  f"{seconds[0]:.1f} | {seconds[1]:.1f} | {seconds[2]:.1f} | {results[0]['loss']:.5f} |", flush=True)
            rows.append({"system": system, "world": world, "peak_mib_by_phase": per_phase, "seconds": seconds,
                         "loss": results[0]["loss"], "per_rank": results, "max_rank_peak_mib": max(peaks)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": params, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
