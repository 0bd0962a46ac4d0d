"""zero_ext.load_weights: every source kind at world sizes 1, 2 and 4 and in
every stage equals loading the weights into a plain model; each rank reads
its own byte ranges of a safetensors file; strict errors; crafted files."""
import functools
import os

import pytest
import torch

import zero_ext
from dist_harness import run_on_ranks
from weights_scenarios import CONFIGS, SOURCES, build, pretrained, write_sources


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("weights"))
    write_sources(root)
    return root


@functools.lru_cache(maxsize=None)
def _results(world: int, root: str):
    return run_on_ranks(world, "weights_scenarios:load_every_source", (root,), deadline_s=600)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_source_in_every_stage_loads_what_a_plain_model_would(world, sources):
    results = _results(world, sources)
    failures = [f"rank {r} {label}: {problem}" for r, per_rank in enumerate(results)
                for label, problem in per_rank.items() if problem]
    assert len(results[0]) == len(CONFIGS) * len(SOURCES)
    assert not failures, "\n".join(failures)


def test_an_error_on_one_rank_raises_on_every_rank(sources):
    messages = run_on_ranks(2, "weights_scenarios:error_on_one_rank", (sources,), deadline_s=120)
    for rank, message in enumerate(messages):
        mis_shaped, loose = message["mis-shaped"], message["loose-strict"]
        assert mis_shaped.startswith("ValueError: ") and "size mismatch for 'embed.weight'" in mis_shaped \
            and "raised on rank 1" in mis_shaped, (rank, mis_shaped)
        # Issue 54: strict is a bool; a loose one on one rank is refused on every rank.
        assert loose.startswith("TypeError: zero_ext.load_weights: strict must be True or False, got 'False'") \
            and "raised on rank 1" in loose, (rank, loose)


def _wrapped(stage=2):
    model = build(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return zero_ext.wrap(model, opt, stage=stage)


def test_strict_names_missing_unexpected_and_mismatched_keys():
    model, _ = _wrapped()
    weights = pretrained()
    del weights["head.weight"], weights["embed.weight"]  # both names of the tied parameter
    weights["extra.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"missing key\(s\): 'embed.weight', 'head.weight'.*"
                                         r"unexpected key\(s\): 'extra.weight'"):
        zero_ext.load_weights(model, weights)
    result = zero_ext.load_weights(model, weights, strict=False)
    assert result.missing_keys == ["embed.weight", "head.weight"] and result.unexpected_keys == ["extra.weight"]
    weights = pretrained()
    weights["blocks.0.ff.weight"] = torch.zeros(1, 1)
    with pytest.raises(ValueError, match=r"size mismatch for 'blocks.0.ff.weight'"):
        zero_ext.load_weights(model, weights, strict=False)


def test_strict_false_leaves_missing_parameters_alone():
    model, _ = _wrapped(stage=3)
    before = zero_ext.full_state_dict(model)
    weights = {"running": torch.full((3,), 9.0)}
    zero_ext.load_weights(model, weights, strict=False)
    after = zero_ext.full_state_dict(model)
    assert torch.equal(after["running"], weights["running"])
    assert all(torch.equal(after[n], before[n]) for n in before if n != "running")


class Payload:
    def __reduce__(self):
        return (os.system, ("echo unsafe",))


def test_pickled_code_in_a_pt_file_is_refused(tmp_path):
    model, _ = _wrapped()
    path = str(tmp_path / "evil.pt")
    torch.save({"embed.weight": Payload()}, path)
    with pytest.raises(ValueError, match="weights_only=True"):
        zero_ext.load_weights(model, path)


def test_a_bin_index_naming_a_path_outside_is_refused(tmp_path):
    model, _ = _wrapped()
    torch.save(pretrained(), str(tmp_path / "elsewhere.bin"))
    d = tmp_path / "model"
    d.mkdir()
    (d / "pytorch_model.bin.index.json").write_text('{"weight_map": {"embed.weight": "../elsewhere.bin"}}')
    with pytest.raises(ValueError, match="only .bin/.pt files in its own directory"):
        zero_ext.load_weights(model, str(d))
    os.unlink(d / "pytorch_model.bin.index.json")
    os.symlink(tmp_path / "elsewhere.bin", d / "pytorch_model.bin")
    with pytest.raises(ValueError, match="links"):
        zero_ext.load_weights(model, str(d))


def test_a_source_that_is_not_weights_is_named(tmp_path):
    model, _ = _wrapped()
    with pytest.raises(FileNotFoundError, match="holds none of"):
        zero_ext.load_weights(model, str(tmp_path))
    with pytest.raises(TypeError, match="state dict, a file or a directory"):
        zero_ext.load_weights(model, 3)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_save_weights_in_every_stage_is_what_the_package_reads(world, tmp_path):
    results = run_on_ranks(world, "weights_scenarios:save_in_every_stage", (str(tmp_path),), deadline_s=600)
    failures = [f"rank {r} {label}: {problem}" for r, per_rank in enumerate(results)
                for label, problem in per_rank.items() if problem]
    assert len(results[0]) == len(CONFIGS)
    assert not failures, "\n".join(failures)


def test_save_weights_replaces_an_earlier_layout(tmp_path):
    model, _ = _wrapped(stage=3)
    out = str(tmp_path / "out")
    zero_ext.save_weights(model, out, max_shard_size=600)
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 2
    zero_ext.save_weights(model, out)  # now one file: the shards and the index go
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    with pytest.raises(ValueError, match="max_shard_size"):
        zero_ext.save_weights(model, out, max_shard_size="lots")


def test_save_weights_of_a_transformers_model_writes_its_config_for_from_pretrained(tmp_path):
    """save_weights(model, "out") then from_pretrained("out") (docs/huggingface.md):
    config.json and generation_config.json beside the weights, naming the class
    before wrap() and the dtype written; the model's own config is left alone."""
    transformers = pytest.importorskip("transformers")
    import json

    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model, _ = zero_ext.wrap(model, torch.optim.AdamW(model.parameters()), stage=3, mixed_precision="bf16")
    architectures_before = model.config.architectures
    out = str(tmp_path / "out")
    zero_ext.save_weights(model, out)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    assert written["architectures"] == ["GPT2LMHeadModel"] and written["dtype"] == "float32", written
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is transformers.GPT2LMHeadModel
    full = zero_ext.full_state_dict(model)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, full[name]), name
    assert model.config.architectures == architectures_before
    # Cast on the way out: the config says so, as save_pretrained of a bf16 model would.
    zero_ext.save_weights(model, str(tmp_path / "bf16"), dtype=torch.bfloat16)
    with open(tmp_path / "bf16" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    # One .safetensors file: nothing beside it; a model without a config: weights only.
    zero_ext.save_weights(model, str(tmp_path / "one" / "weights.safetensors"))
    assert os.listdir(tmp_path / "one") == ["weights.safetensors"]
    plain, _ = _wrapped(stage=3)
    zero_ext.save_weights(plain, str(tmp_path / "plain"))
    assert os.listdir(tmp_path / "plain") == ["model.safetensors"]
