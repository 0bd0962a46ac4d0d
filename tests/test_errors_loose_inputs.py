"""Loose inputs of the public calls (issue 54): a bool option is a bool
(bool("False") is True), a str option one of its names, the model a module
and the optimizer an optimizer (a wrapped model and its optimizer carry the
same state, so without a check either passes for the other). Each gets an
error whose message names the problem and the fix, as the bad inputs of
test_errors.py do. Rank-disagreeing cases: checkpoint_trust_collective_scenarios.py
("loose-inputs-rank1") and weights_scenarios.py (error_on_one_rank).
Beside memory_report's options: what process=True reports (issue 56; its
CUDA keys in tests/cuda/test_gpu_data_path.py).
"""
import os
import sys

import pytest
import torch
import torch.nn as nn

import zero_ext
from errors_common import make, train_step


def _trained(stage=2):
    model, opt = make()
    model, opt = zero_ext.wrap(model, opt, stage=stage)
    train_step(model, opt)
    return model, opt


@pytest.mark.parametrize("value", ["yes", "False", 1, 0, None])
def test_save_takes_async_save_as_a_bool_only(value, tmp_path):
    model, opt = _trained()
    with pytest.raises(TypeError, match=r"zero_ext.save: async_save must be True or False, got .*"
                                        + repr(value).replace("(", r"\(") + r".*async_save=True"):
        zero_ext.save(str(tmp_path / "ckpt"), model, opt, async_save=value)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("layout", ["torchtitan", "get-state-dict", None])
def test_dcp_layout_applies_to_format_dcp_only(layout, tmp_path):
    model, opt = _trained()
    with pytest.raises(ValueError, match=r'zero_ext.save: dcp_layout applies to format="dcp" only.*'
                                         r'format="zero_ext"'):
        zero_ext.save(str(tmp_path / "ckpt"), model, opt, dcp_layout=layout)
    assert not (tmp_path / "ckpt").exists()
    zero_ext.save(str(tmp_path / "ckpt"), model, opt, dcp_layout="get_state_dict")  # the default, spelled out


@pytest.mark.parametrize("fmt, error, match", [(1, TypeError, "format must be a str"),
                                                (None, TypeError, "format must be a str"),
                                                (b"dcp", TypeError, "format must be a str"),
                                                ("DCP", ValueError, r"format must be one of \['zero_ext', 'dcp'\]"),
                                                ("pt", ValueError, r"format must be one of \['zero_ext', 'dcp'\]")])
def test_save_format_is_one_of_its_names(fmt, error, match, tmp_path):
    model, opt = _trained()
    with pytest.raises(error, match="zero_ext.save: " + match):
        zero_ext.save(str(tmp_path / "ckpt"), model, opt, format=fmt)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("fmt", ["dcp", "zero_ext"])
def test_load_takes_no_format_it_detects_it(fmt, tmp_path):
    model, opt = _trained()
    zero_ext.save(str(tmp_path / "ckpt"), model, opt, format=fmt)
    with pytest.raises(TypeError, match=r"zero_ext.load takes no format.*detects.*zero_ext's own or a DCP "
                                        r"directory.*drop format="):
        zero_ext.load(str(tmp_path / "ckpt"), model, opt, format=fmt)
    zero_ext.load(str(tmp_path / "ckpt"), model, opt)


@pytest.mark.parametrize("value", ["False", 0, None])
def test_load_and_load_weights_take_strict_as_a_bool_only(value, tmp_path):
    model, opt = _trained()
    zero_ext.save(str(tmp_path / "ckpt"), model, opt)
    with pytest.raises(TypeError, match=r"zero_ext.load: strict must be True or False"):
        zero_ext.load(str(tmp_path / "ckpt"), model, opt, strict=value)
    with pytest.raises(TypeError, match=r"zero_ext.load_weights: strict must be True or False"):
        zero_ext.load_weights(model, zero_ext.full_state_dict(model), strict=value)


def test_traffic_takes_the_model_only():
    model, opt = _trained()
    for wrong in (opt, [opt], None, "model"):
        with pytest.raises(TypeError, match=r"zero_ext.traffic: got .* where the model goes; pass the wrapped "
                                            r"model"):
            zero_ext.traffic(wrong)
    with pytest.raises(TypeError, match=r"an optimizer \(SGD\)"):
        zero_ext.traffic(opt)
    with pytest.raises(ValueError, match="not wrapped"):  # a module zero_ext did not wrap: documented as before
        zero_ext.traffic(nn.Linear(2, 2))
    assert set(zero_ext.traffic(model)) == {"all_gather", "reduce_scatter", "all_reduce", "broadcast",
                                           "sequence_headers"}


def _model_and_optimizer_calls(tmp_path):
    """Each public call taking a model and an optimizer, as f(model, optimizer)."""
    weights = str(tmp_path / "w.safetensors")
    return {
        "save": lambda m, o: zero_ext.save(str(tmp_path / "ckpt"), m, o),
        "load": lambda m, o: zero_ext.load(str(tmp_path / "saved"), m, o),
        "memory_report": lambda m, o: zero_ext.memory_report(m, o),
    }, {
        "full_state_dict": zero_ext.full_state_dict,
        "full_grads": zero_ext.full_grads,
        "load_full_state_dict": lambda m: zero_ext.load_full_state_dict(m, {}),
        "save_weights": lambda m: zero_ext.save_weights(m, weights),
        "load_weights": lambda m: zero_ext.load_weights(m, {}),
        "full_params": lambda m: zero_ext.full_params(m).__enter__(),
        "register_forward_method": lambda m: zero_ext.register_forward_method(m, "forward"),
        "set_modules_to_forward_prefetch": lambda m: zero_ext.set_modules_to_forward_prefetch(m, []),
        "set_modules_to_backward_prefetch": lambda m: zero_ext.set_modules_to_backward_prefetch(m, []),
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_a_model_and_an_optimizer_are_not_taken_for_each_other(stage, tmp_path):
    model, opt = _trained(stage)
    zero_ext.save(str(tmp_path / "saved"), model, opt)
    pairs, models_only = _model_and_optimizer_calls(tmp_path)
    for name, call in pairs.items():
        for m, o, wrong in [(opt, model, "the model"), (model, model, "the optimizer"), (opt, opt, "the model"),
                            (model, [opt, model], "the optimizer"), (model, None, "the optimizer")]:
            with pytest.raises(TypeError, match=rf"zero_ext.{name}: got .* where {wrong} goes; pass the"):
                call(m, o)
    for name, call in models_only.items():
        with pytest.raises(TypeError, match=rf"zero_ext.{name}: got an optimizer \(SGD\) where the model goes"):
            call(opt)
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "w.safetensors").exists()


@pytest.mark.parametrize("option", ["by_dimension", "process"])
def test_memory_report_takes_its_options_as_bools_only(option):
    model, opt = _trained()
    with pytest.raises(TypeError, match=f"zero_ext.memory_report: {option} must be True or False, got 'no'"):
        zero_ext.memory_report(model, opt, **{option: "no"})
    plain, plain_opt = make()  # a model zero_ext did not wrap is reported as before
    assert set(zero_ext.memory_report(plain, plain_opt)) == {"params", "grads", "optimizer_state"}


# memory_report(process=True) (issue 56): the process's resident bytes beside
# the tensors', off by default so the report's values still sum to the tensors.
REPORT_MODULE = sys.modules["zero_ext.runtime.memory_report"]  # zero_ext.runtime.memory_report is the function


def _status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


@pytest.mark.parametrize("wrap", [True, False])
def test_memory_report_process_gives_vmrss_and_vmhwm_in_bytes(wrap, tmp_path, monkeypatch):
    """The values are /proc/self/status's VmRSS and VmHWM, kB as KiB, beside
    the tensors' bytes, which stay what they are without process=True; a CPU
    model has no cuda_* keys."""
    model, opt = _trained() if wrap else make()
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t  999999 kB\nVmHWM:\t   204800 kB\nVmRSS:\t   102400 kB\n"
                      "RssAnon:\t   5 kB\n")
    monkeypatch.setattr(REPORT_MODULE, "_PROC_STATUS", str(status))
    report = zero_ext.memory_report(model, opt, process=True)
    assert report == {**zero_ext.memory_report(model, opt), "process_rss": 102400 * 1024,
                      "process_peak_rss": 204800 * 1024}
    assert list(report)[3:] == ["process_rss", "process_peak_rss"]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux's /proc")
def test_memory_report_process_is_what_this_process_holds():
    """Read live: the peak is VmHWM between a read before and one after the
    call (it only grows), VmRSS within a MiB of those reads, and the process
    holds at least the report's own tensors."""
    model, opt = _trained(3)
    hwm, rss = _status_kib("VmHWM"), _status_kib("VmRSS")
    report = zero_ext.memory_report(model, opt, process=True)
    hwm_after, rss_after = _status_kib("VmHWM"), _status_kib("VmRSS")
    assert hwm * 1024 <= report["process_peak_rss"] <= hwm_after * 1024
    assert (min(rss, rss_after) - 1024) * 1024 <= report["process_rss"] <= (max(rss, rss_after) + 1024) * 1024
    assert report["process_peak_rss"] >= report["process_rss"] > report["params"] + report["grads"] \
        + report["optimizer_state"] > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB (Linux)")
def test_memory_report_process_without_proc_status_says_what_is_missing(tmp_path, monkeypatch):
    """Without /proc/self/status (another OS) the peak is getrusage's
    ru_maxrss and the current RSS is left out, with a warning naming it."""
    import resource
    model, opt = _trained()
    monkeypatch.setattr(REPORT_MODULE, "_PROC_STATUS", str(tmp_path / "missing"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.warns(RuntimeWarning, match=r"zero_ext.memory_report: process_rss left out: .*missing does not "
                                            r"give it on this platform \(linux\); process_peak_rss is getrusage"):
        report = zero_ext.memory_report(model, opt, process=True)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert set(report) == {"params", "grads", "optimizer_state", "process_peak_rss"}
    assert before * 1024 <= report["process_peak_rss"] <= after * 1024


@pytest.mark.parametrize("stage", [2, 3])
def test_model_methods_take_bools_only(stage):
    model, opt = _trained(stage)
    with pytest.raises(TypeError, match="require_backward_grad_sync must be True or False, got 'False'"):
        model.require_backward_grad_sync = "False"
    assert model.require_backward_grad_sync is True
    with pytest.raises(TypeError, match="set_requires_all_reduce: requires_all_reduce must be True or False, "
                                        "got 'no'"):
        model.set_requires_all_reduce("no")
    with pytest.raises(TypeError, match="unshard: async_op must be True or False, got 'no'"):
        model.unshard("no")
    for zero_grad in (model.zero_grad, opt.zero_grad):
        with pytest.raises(TypeError, match="zero_grad: set_to_none must be True or False, got 'yes'"):
            zero_grad("yes")
    model.require_backward_grad_sync = False
    assert model.require_backward_grad_sync is False
    model.require_backward_grad_sync = True
    train_step(model, opt)


def test_names_and_module_lists_are_checked_at_every_stage():
    model, opt = _trained(stage=2)  # stages 0-2 prefetch nothing, but a wrong argument is still refused
    with pytest.raises(TypeError, match="zero_ext.register_forward_method: name must be a str"):
        zero_ext.register_forward_method(model, 1)
    with pytest.raises(TypeError, match="zero_ext.set_modules_to_forward_prefetch: pass a list of modules"):
        zero_ext.set_modules_to_forward_prefetch(model, "0")
    zero_ext.set_modules_to_forward_prefetch(model, [model[0]])  # at stage 2: accepted, nothing to do


def test_clipping_takes_parameters_not_a_model_or_optimizer():
    model, opt = _trained()
    for clip in (lambda p: zero_ext.clip_grad_norm_(p, 1.0), lambda p: zero_ext.clip_grad_value_(p, 1.0)):
        for wrong in (model, opt):
            with pytest.raises(TypeError, match=r"zero_ext.clip_grad_(norm|value)_: got .* where the parameters "
                                                r"go; pass model.parameters\(\)"):
                clip(wrong)
        clip(model.parameters())


@pytest.mark.parametrize("dtype", ["bf16", torch.int32, torch.bool])
def test_convert_takes_a_floating_dtype_only(dtype, tmp_path):
    from zero_ext.convert import convert

    model, opt = _trained()
    zero_ext.save(str(tmp_path / "ckpt"), model, opt)
    with pytest.raises(TypeError, match="zero_ext.convert: dtype must be a floating torch.dtype or None"):
        convert(str(tmp_path / "ckpt"), str(tmp_path / "out.pt"), dtype=dtype)
    assert not (tmp_path / "out.pt").exists()
    with pytest.raises(TypeError, match="zero_ext.convert: format must be a str"):
        convert(str(tmp_path / "ckpt"), str(tmp_path / "out.pt"), format=1)
