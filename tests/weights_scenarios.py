"""Rank-side half of tests/test_weights.py: zero_ext.load_weights from every
source kind, in every stage, with and without bf16 and offload, against the
same weights loaded into a plain model."""
from __future__ import annotations

import os
from typing import Dict, List, Optional

import torch

import zero_ext
from parity_scenarios import VOCAB, Blocks
from zero_ext.files.weights import safetensors as st
from zero_ext.files.plan import local_views as _local_views

SOURCES = ["state_dict", "safetensors", "safetensors_sharded", "pt", "bin_sharded"]
CONFIGS = [(stage, precision, offload) for stage in (0, 1, 2, 3)
           for precision, offload in ((None, False), ("bf16", False), ("bf16", True))]


def build(seed: int) -> Blocks:
    model = Blocks(seed=seed)
    model.register_buffer("running", torch.arange(3, dtype=torch.float32) + seed)
    return model


def pretrained() -> Dict[str, torch.Tensor]:
    """The weights to load, as a plain model's state dict (tied names: both)."""
    return {k: v.clone() for k, v in build(seed=7).state_dict().items()}


def write_sources(root: str) -> None:
    """Each source kind on disk, as Hugging Face writes them: the tied
    alias head.weight dropped (the model's other name for embed.weight)."""
    weights = pretrained()
    del weights["head.weight"]
    st.save_file(os.path.join(root, "model.safetensors"), weights)
    sharded = os.path.join(root, "sharded")
    os.makedirs(sharded, exist_ok=True)
    entries = [(n, t.dtype, tuple(t.shape)) for n, t in weights.items()]
    weight_map = {}
    for file, group in st.split_into_files(entries, max_bytes=600):
        st.save_file(os.path.join(sharded, file), {entries[i][0]: weights[entries[i][0]] for i in group})
        weight_map.update({entries[i][0]: file for i in group})
    assert len(set(weight_map.values())) > 2, "the sharded source should span several files"
    st.write_index(sharded, weight_map, total_size=sum(t.numel() * 4 for t in weights.values()))
    torch.save(weights, os.path.join(root, "model.pt"))
    bins = os.path.join(root, "bins")
    os.makedirs(bins, exist_ok=True)
    names = list(weights)
    halves = {"pytorch_model-00001-of-00002.bin": names[:len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for file, part in halves.items():
        torch.save({n: weights[n] for n in part}, os.path.join(bins, file))
    import json
    with open(os.path.join(bins, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: file for file, part in halves.items() for n in part}}, f)


def source_of(kind: str, root: str):
    return {"state_dict": pretrained(), "safetensors": os.path.join(root, "model.safetensors"),
            "safetensors_sharded": os.path.join(root, "sharded"), "pt": os.path.join(root, "model.pt"),
            "bin_sharded": os.path.join(root, "bins")}[kind]


def header_bytes(kind: str, root: str) -> int:
    if kind == "safetensors":
        files = [os.path.join(root, "model.safetensors")]
    else:
        d = os.path.join(root, "sharded")
        files = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors")]
    total = 0
    for path in files:
        with st.SafetensorsFile(path) as f:
            total += f.bytes_read
    return total


def load_every_source(rank: int, world: int, root: str) -> Dict[str, Optional[str]]:
    """Per configuration and source: None, or what went wrong."""
    want = pretrained()
    tokens = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    reference = build(seed=7)
    expected_out = reference(tokens)
    results: Dict[str, Optional[str]] = {}
    for stage, precision, offload in CONFIGS:
        for kind in SOURCES:
            label = f"stage{stage}-{precision or 'fp32'}{'-offload' if offload else ''}-{kind}"
            try:
                model = build(seed=0)
                opt = torch.optim.AdamW(model.parameters(), lr=0.01)
                model, opt = zero_ext.wrap(model, opt, stage=stage, mixed_precision=precision, bucket_mb=0.002,
                                           offload_optimizer="cpu" if offload else None, timeout=20)
                result = zero_ext.load_weights(model, source_of(kind, root))
                problems: List[str] = []
                if result.missing_keys or result.unexpected_keys:
                    problems.append(f"keys: {result}")
                full = zero_ext.full_state_dict(model)
                for name, value in want.items():
                    if not torch.equal(full[name].float(), value):
                        problems.append(f"{name} differs")
                if precision is None and not torch.equal(model(tokens), expected_out):
                    problems.append("forward differs from the plain model's")
                if kind.startswith("safetensors"):
                    state = model._zero_ext
                    mine = sum(view.numel() for _, _, view in _local_views(state)) * 4 + 3 * 4  # + the buffer
                    read = result.bytes_read - header_bytes(kind, root)
                    if read != mine:
                        problems.append(f"read {read} data bytes, holds {mine}")
                    total = sum(t.numel() * 4 for n, t in want.items() if n != "head.weight")
                    if stage > 0 and world > 1 and not read < total:
                        problems.append(f"read {read} of {total} bytes: not only its shard")
                elif result.bytes_read and kind == "state_dict":
                    problems.append("a state dict counts no file bytes")
                results[label] = "; ".join(problems) or None
            except Exception as error:  # noqa: BLE001 - reported per label
                results[label] = f"{type(error).__name__}: {error}"
    return results


def error_on_one_rank(rank: int, world: int, root: str) -> Dict[str, str]:
    """Rank 1's source has a mis-shaped tensor, then rank 1 alone passes
    strict="False" (bool() would make it True): every rank raises, none
    hangs. {case: "Kind: message"}."""
    model = build(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = zero_ext.wrap(model, opt, stage=3, bucket_mb=0.002, timeout=20)
    out = {}
    for case in ("mis-shaped", "loose-strict"):
        source, strict = pretrained(), False
        if rank == 1 and case == "mis-shaped":
            source["embed.weight"] = torch.zeros(3, 3)
        if rank == 1 and case == "loose-strict":
            strict = "False"
        try:
            zero_ext.load_weights(model, source, strict=strict)
            out[case] = "no error"
        except Exception as error:  # noqa: BLE001 - the test judges it
            out[case] = f"{type(error).__name__}: {error}"
    return out


def save_in_every_stage(rank: int, world: int, root: str) -> Dict[str, Optional[str]]:
    """save_weights in every configuration: what the safetensors package
    reads back is the model's fp32 weights (each tied parameter once), in
    Hugging Face's sharded layout past max_shard_size or as one file, cast
    when asked; load_weights reads it back into a fresh wrapped model."""
    from safetensors.torch import load_file

    want = pretrained()
    del want["head.weight"]
    results: Dict[str, Optional[str]] = {}
    for stage, precision, offload in CONFIGS:
        label = f"stage{stage}-{precision or 'fp32'}{'-offload' if offload else ''}"
        problems: List[str] = []
        try:
            def wrapped(seed: int):
                model = build(seed=seed)
                opt = torch.optim.AdamW(model.parameters(), lr=0.01)
                return zero_ext.wrap(model, opt, stage=stage, mixed_precision=precision, bucket_mb=0.002,
                                     offload_optimizer="cpu" if offload else None, timeout=20)[0]
            model = wrapped(seed=7)
            out = os.path.join(root, label)
            zero_ext.save_weights(model, out, max_shard_size=600)
            single = os.path.join(root, label + "-bf16.safetensors")
            zero_ext.save_weights(model, single, dtype=torch.bfloat16)
            if rank == 0:
                files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
                if len(files) < 3 or not os.path.exists(os.path.join(out, st.INDEX)):
                    problems.append(f"not the sharded layout: {os.listdir(out)}")
                got = {}
                for f in files:
                    got.update(load_file(os.path.join(out, f)))
                if set(got) != set(want):
                    problems.append(f"keys {sorted(set(got) ^ set(want))} differ")
                problems += [f"{n} differs" for n in want if n in got and not torch.equal(got[n], want[n])]
                cast = load_file(single)
                problems += [f"bf16 {n} differs" for n in want
                             if not torch.equal(cast[n], want[n].to(torch.bfloat16))]
            fresh = wrapped(seed=0)
            zero_ext.load_weights(fresh, out)
            full = zero_ext.full_state_dict(fresh)
            problems += [f"round trip: {n} differs" for n in want if not torch.equal(full[n].float(), want[n])]
        except Exception as error:  # noqa: BLE001 - reported per label
            problems.append(f"{type(error).__name__}: {error}")
        results[label] = "; ".join(problems) or None
    return results
