"""Nothing crashes or trains silently wrong (issue 12, outside checkpoints):
stage 3 reads, dtype changes after wrap(), torch's clip on sharded gradients,
copies of a wrapped model, option types, tensors added after wrap(), and
full_params' writeback under mixed precision."""
import copy
import io
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import zero_ext


def make(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def backward(model):
    model(torch.randn(3, 4)).square().mean().backward()


# --- stage 3 parameters never crash the process --------------------------------

STAGE3_READS = textwrap.dedent("""
    import torch, torch.nn as nn, zero_ext
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    zero_ext.wrap(model, opt, stage=3, units={nn.Linear})
    w = model[0].weight
    F = torch.nn.functional
    x = torch.randn(3, 4)
    compiled_linear = torch.compile(lambda x, w: F.linear(x, w), backend="eager")
    reads = {
        "print": lambda: print(w),
        "norm": lambda: w.norm(),
        "clone": lambda: w.clone(),
        "parameters_to_vector": lambda: torch.nn.utils.parameters_to_vector(model.parameters()),
        "numpy": lambda: w.detach().numpy().sum(),
        "data": lambda: w.data.sum(),
        "ema": lambda: [p.detach().mul(0.9) for p in model.parameters()],
        # Ops that view the weight before reading it (a transpose, a reshape):
        # bounds-checked against the storage first.
        "linear": lambda: F.linear(x, w),
        "matmul": lambda: x @ w.t(),
        "mm": lambda: torch.mm(w, x.t()),
        "bmm": lambda: torch.bmm(w.unsqueeze(0), x.t().unsqueeze(0)),
        "embedding": lambda: F.embedding(torch.tensor([0, 1]), w),
        "conv1d": lambda: F.conv1d(torch.randn(1, 4, 5), w.unsqueeze(-1)),
        "layer_norm": lambda: F.layer_norm(x, (4,), weight=w[0]),
        "indexing": lambda: w[2, 1:].sum(),
        "view": lambda: w.view(-1)[:3].sum(),
        "compiled": lambda: compiled_linear(x, w),
    }
    for when in ("right after wrap", "after a step"):
        for name, read in reads.items():
            try:
                read()
                print(f"NO ERROR {name} {when}")
            except RuntimeError as error:
                assert "zero_ext.full_params" in str(error), str(error)
                print(f"refused {name} {when}")
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with zero_ext.full_params(model):
        inside = {n: p.detach().clone() for n, p in model.named_parameters()}
        print("norm inside", float(w.norm()))
    full = zero_ext.full_state_dict(model)
    assert all(torch.equal(inside[n], full[n]) for n in full), "full_params differs from full_state_dict"
    print("full_params ok")
""")


def test_stage3_reads_outside_forward_raise_instead_of_crashing():
    done = subprocess.run([sys.executable, "-c", STAGE3_READS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "NO ERROR" not in done.stdout, done.stdout
    assert done.stdout.count("refused") == 2 * 17 and "full_params ok" in done.stdout, done.stdout


PARENT_CALLS_A_UNITS_WEIGHT = textwrap.dedent("""
    import torch, torch.nn as nn, torch.nn.functional as F, zero_ext

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            # The unit's forward never runs: its weight is read here directly.
            return self.head(F.linear(x, self.proj.weight, self.proj.bias))

    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    zero_ext.wrap(model, opt, stage=3, units={nn.Linear})
    try:
        model(torch.randn(3, 4))
        print("NO ERROR")
    except RuntimeError as error:
        assert "zero_ext.full_params" in str(error) and "'proj." in str(error), str(error)
        print("refused")
""")


def test_a_units_parameter_read_outside_its_forward_raises_zero_ext_error():
    """A units= entry whose forward never runs (the parent reads its weight
    with F.linear): zero_ext's message naming the parameter and
    full_params, not torch's "out of bounds for storage of size 0"."""
    done = subprocess.run([sys.executable, "-c", PARENT_CALLS_A_UNITS_WEIGHT], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip() == "refused", done.stdout


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("change", ["double", "half", "to_float64"])
def test_changing_the_model_dtype_after_wrap_is_refused(stage, change):
    model, opt = make()
    zero_ext.wrap(model, opt, stage=stage)
    before = zero_ext.full_state_dict(model)
    with pytest.raises(RuntimeError, match="changing the model's dtype or device after zero_ext.wrap"):
        {"double": model.double, "half": model.half,
         "to_float64": lambda: model.to(torch.float64)}[change]()
    after = zero_ext.full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) and after[k].dtype == torch.float32 for k in before)
    model.to("cpu")  # a change of nothing passes
    backward(model)
    opt.step()


# --- torch.nn.utils.clip_grad_norm_ on sharded gradients is not silent -----------

@pytest.mark.parametrize("stage,precision", [(1, None), (2, None), (3, None), (0, "bf16")])
def test_torch_clip_on_sharded_gradients_raises_and_training_goes_on(stage, precision):
    model, opt = make()
    zero_ext.wrap(model, opt, stage=stage, mixed_precision=precision)
    backward(model)
    with pytest.raises(RuntimeError, match=r"zero_ext.clip_grad_norm_\(model.parameters\(\), max_norm\)"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    # zero_ext's clip works, and so do more backward passes, zero_grad and steps.
    assert float(zero_ext.clip_grad_norm_(model.parameters(), 1.0)) > 0
    backward(model)
    opt.step()
    opt.zero_grad(set_to_none=False)
    model.zero_grad(set_to_none=False)
    backward(model)
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_stage0_fp32_gradients_are_real_and_both_clips_agree():
    norms = []
    for clip in (torch.nn.utils.clip_grad_norm_, zero_ext.clip_grad_norm_):
        model, opt = make()
        zero_ext.wrap(model, opt, stage=0)
        torch.manual_seed(5)
        backward(model)
        norms.append(clip(model.parameters(), 0.1))
        norms.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.equal(norms[0], norms[2]) and torch.equal(norms[1], norms[3])


# --- copies, option types, tensors added after wrap ------------------------------

@pytest.mark.parametrize("stage", [0, 3])
def test_deepcopy_and_pickle_of_a_wrapped_model_name_the_way(stage):
    model, opt = make()
    zero_ext.wrap(model, opt, stage=stage)
    with pytest.raises(TypeError, match=r"copy.deepcopy\(\) of a wrapped model.*full_state_dict.*zero_ext.save"):
        copy.deepcopy(model)
    with pytest.raises(TypeError, match=r"pickling \(torch.save\) of a wrapped model.*full_params"):
        torch.save(model, io.BytesIO())


@pytest.mark.parametrize("option,value,error,message", [
    ("bucket_mb", math.inf, ValueError, "bucket_mb must be finite"),
    ("bucket_mb", math.nan, ValueError, "bucket_mb must be finite"),
    ("bucket_mb", "25", TypeError, "bucket_mb must be a number"),
    ("bucket_mb", True, TypeError, "bucket_mb must be a number"),
    ("timeout", math.inf, ValueError, "timeout must be a finite positive"),
    ("timeout", "10", TypeError, "timeout must be seconds"),
    ("prefetch", "1", TypeError, "prefetch must be an int"),
    ("prefetch", 1.5, TypeError, "prefetch must be an int"),
    ("prefetch", -1, ValueError, "prefetch must be >= 0"),
])
def test_option_types_and_non_finite_values(option, value, error, message):
    model, opt = make()
    with pytest.raises(error, match=message):
        zero_ext.wrap(model, opt, stage=3, **{option: value})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_tensor_added_to_the_optimizer_after_wrap_is_refused_at_step(stage):
    model, opt = make()
    zero_ext.wrap(model, opt, stage=stage)
    extra = nn.Parameter(torch.zeros(5))
    opt.add_param_group({"params": [extra]})
    (model(torch.randn(3, 4)).square().mean() + extra.sum()).backward()
    with pytest.raises(ValueError, match=r"holds 1 tensor\(s\) that zero_ext does not manage.*\(5,\)"):
        opt.step()


# --- full_params -----------------------------------------------------------------

def test_full_params_writeback_keeps_fp32_masters_of_unchanged_parameters():
    model, opt = make()
    zero_ext.wrap(model, opt, stage=3, mixed_precision="bf16")
    backward(model)
    opt.step()
    before = zero_ext.full_state_dict(model)
    version = model[2].weight._version
    with torch.no_grad(), zero_ext.full_params(model, writeback=True):
        assert model[2].weight.dtype == torch.bfloat16
        model[2].weight.data.fill_(0.25)  # through .data: zero_ext still sees the change
    after = zero_ext.full_state_dict(model)
    assert torch.equal(after["2.weight"], torch.full_like(before["2.weight"], 0.25))
    for name in ("0.weight", "0.bias", "2.bias"):
        assert torch.equal(after[name], before[name]), name  # fp32 precision kept
    assert model[2].weight._version > version


def test_full_params_refuses_a_module_zero_ext_does_not_know():
    model, _ = make()
    with pytest.raises(ValueError, match="neither a model wrapped by zero_ext nor a submodule"):
        with zero_ext.full_params(model):
            pass


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_checkpoint_load_bumps_versions_so_a_graph_from_before_raises(stage, tmp_path):
    """As load_state_dict's in-place copy would in plain PyTorch."""
    model, opt = make()
    zero_ext.wrap(model, opt, stage=stage)
    backward(model)
    opt.step()
    opt.zero_grad()
    zero_ext.save(str(tmp_path / "ckpt"), model, opt)
    stale = model(torch.randn(3, 4)).square().mean()
    zero_ext.load(str(tmp_path / "ckpt"), model, opt)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stale.backward()
    opt.zero_grad()
    backward(model)  # a graph built after the load is fine
    opt.step()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_parameter_listed_twice_saves_and_loads(stage, tmp_path):
    import warnings
    model, _ = make()
    params = list(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's duplicate-parameter warning
        opt = torch.optim.Adam([{"params": params + [params[0]]}], lr=0.1)
    zero_ext.wrap(model, opt, stage=stage)
    backward(model)
    opt.step()
    opt.zero_grad()
    zero_ext.save(str(tmp_path / "ckpt"), model, opt)
    saved = zero_ext.full_state_dict(model)
    backward(model)
    opt.step()
    zero_ext.load(str(tmp_path / "ckpt"), model, opt)
    assert all(torch.equal(saved[k], v) for k, v in zero_ext.full_state_dict(model).items())


def test_full_params_nests_and_survives_state_dict_inside():
    model, opt = make()
    zero_ext.wrap(model, opt, stage=3, units={nn.Linear})
    with torch.no_grad(), zero_ext.full_params(model, writeback=True):
        model[0].weight.data.fill_(7.0)
        model.state_dict()  # gathers and releases for itself: must not release what full_params holds
        full = zero_ext.full_state_dict(model)
        with zero_ext.full_params(model[2]):
            pass
        assert torch.equal(model[2].weight, full["2.weight"])  # still gathered, with its values
        assert torch.equal(model[0].weight, torch.full((8, 4), 7.0))
    assert torch.equal(zero_ext.full_state_dict(model)["0.weight"], torch.full((8, 4), 7.0))
    with pytest.raises(RuntimeError, match="zero_ext.full_params"):
        model[0].weight.sum()  # released again after the outermost context


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_load_state_dict_strict_false_keeps_masters_of_missing_parameters(stage):
    model, opt = make()
    zero_ext.wrap(model, opt, stage=stage, mixed_precision="bf16")
    backward(model)
    opt.step()
    before = zero_ext.full_state_dict(model)
    model.load_state_dict({"0.weight": torch.ones(8, 4)}, strict=False)
    after = zero_ext.full_state_dict(model)
    assert torch.equal(after["0.weight"], torch.ones(8, 4))
    for name in ("0.bias", "2.weight", "2.bias"):
        assert torch.equal(after[name], before[name]), name
