// The one place that exposes the C++ core to Python, as torch custom classes
// (torch.classes.zero_ext.*) and ops (torch.ops.zero_ext.*), so it needs no
// pybind and shows in the profiler.
#include <Python.h>

#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "autograd_boundaries.h"
#include "block_quantization.h"
#include "core_ops.h"
#include "cpu_adam.h"
#include "diagnosis_store.h"
#include "layout.h"
#include "sharded_model.h"
#include "step_gate.h"
#include "storage_release.h"
#include "swap_file.h"

namespace zero_ext {

namespace {

// Shape checks only: lets torch.compile and opcheck trace the op.
void adam_step_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double,
                    double, double, double, double, int64_t, bool, bool, bool) {}

GradLayout parse_grad_layout(const std::string& name) {
  for (auto layout : {GradLayout::kDdpInPlace, GradLayout::kReplicated, GradLayout::kShardedPersistent,
                      GradLayout::kShardedTransient}) {
    if (name == grad_layout_name(layout)) return layout;
  }
  TORCH_CHECK(false, "zero_ext: unknown gradient layout '", name, "'");
}

// The layout arithmetic alone, for tests against a Python reference.
struct LayoutProbe : torch::CustomClassHolder {
  Layout layout;
  LayoutProbe(std::vector<std::vector<int64_t>> shapes, std::vector<int64_t> trainable,
              std::vector<int64_t> params_per_bucket, std::vector<int64_t> unit_of_bucket, int64_t stage,
              const std::string& grad_layout, int64_t rank, int64_t world, std::vector<int64_t> owner_of_param)
      : layout(shapes, std::vector<std::string>(shapes.size(), "p"), std::move(trainable), params_per_bucket,
               unit_of_bucket, stage, parse_grad_layout(grad_layout), rank, world, owner_of_param) {}
  std::vector<int64_t> owned_ranges(int64_t rank) {
    std::vector<int64_t> out;
    for (const auto& [param, start, end] : layout.owned_ranges(rank)) out.insert(out.end(), {param, start, end});
    return out;
  }
  std::vector<int64_t> pieces(bool segments_only) {
    std::vector<int64_t> out;
    for (const auto& p : segments_only ? layout.segments() : layout.local_pieces()) {
      out.insert(out.end(), {p.param, p.param_start, p.bucket, p.shard_offset, p.length});
    }
    return out;
  }
  std::vector<int64_t> gaps(int64_t b) {
    std::vector<int64_t> out;
    for (const auto& [start, length] : layout.gaps(b)) out.insert(out.end(), {start, length});
    return out;
  }
  std::vector<int64_t> buckets() {
    std::vector<int64_t> out;
    for (const auto& b : layout.buckets()) {
      out.insert(out.end(), {b.first, b.count, b.numel, b.padded, b.shard, b.trainable, b.unit});
    }
    return out;
  }
};

// The step gate alone, for tests of its decisions and the loss scaler.
struct StepGateProbe : torch::CustomClassHolder {
  StepGate gate;
  void enable_loss_scaling(double initial_scale, double growth_factor, double backoff_factor,
                           int64_t growth_interval, double min_scale, int64_t hysteresis, bool dynamic) {
    gate.scaler().enable(LossScalerOptions{initial_scale, growth_factor, backoff_factor, growth_interval,
                                           min_scale, hysteresis, dynamic});
  }
};

// [Note: quantized payloads] as ops, for tests and benchmarks: a 1-D fp32
// tensor to its payload (the residual, if given, filled), and back.
at::Tensor quantize_blocks_op(const at::Tensor& values, int64_t bits, int64_t block,
                              const std::optional<at::Tensor>& residual, bool with_ops) {
  const QuantFormat format{bits, block};
  TORCH_CHECK((bits == 8 || bits == 4) && block >= 2 && block % 2 == 0,
              "zero_ext.quantize_blocks: bits must be 8 or 4 and block an even number, got ", bits, " and ", block);
  at::Tensor flat = values.to(at::kFloat).contiguous().view(-1);
  at::Tensor payload = at::empty({format.payload_bytes(flat.numel())}, flat.options().dtype(at::kByte));
  quantize_blocks(flat, payload, format, residual.has_value() ? *residual : at::Tensor(), with_ops);
  return payload;
}

at::Tensor dequantize_blocks_op(const at::Tensor& payload, int64_t numel, int64_t bits, int64_t block,
                                bool with_ops) {
  const QuantFormat format{bits, block};
  TORCH_CHECK((bits == 8 || bits == 4) && block >= 2 && block % 2 == 0,
              "zero_ext.dequantize_blocks: bits must be 8 or 4 and block an even number, got ", bits, " and ", block);
  at::Tensor out = at::empty({numel}, payload.options().dtype(at::kFloat));
  dequantize_blocks(payload.contiguous(), out, format, false, with_ops);
  return out;
}

} // namespace

TORCH_LIBRARY(zero_ext, m) {
  m.def(
      "adam_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? max_exp_avg_sq, Tensor(e!)? param_lowp, float lr, float beta1, float beta2, "
      "float eps, float weight_decay, int step, bool decoupled_weight_decay, bool amsgrad, "
      "bool maximize) -> ()");
  m.def("unreadable_tensor(int[] size, ScalarType dtype, Device device, str message) -> Tensor",
        &unreadable_tensor);
  m.def("cpu_adam_isa() -> str", &cpu_adam_isa);
  // with_ops: the ATen-op path (what CUDA runs) on any device, for tests.
  m.def("quantize_blocks(Tensor values, int bits, int block, Tensor(a!)? residual, bool with_ops=False) -> Tensor",
        &quantize_blocks_op);
  m.def("dequantize_blocks(Tensor payload, int numel, int bits, int block, bool with_ops=False) -> Tensor",
        &dequantize_blocks_op);
  m.class_<ShardedModel>("ShardedModel")
      .def(torch::init<std::vector<at::Tensor>, std::vector<std::string>, std::vector<int64_t>,
                       std::vector<int64_t>, std::vector<int64_t>, int64_t, std::string, std::string,
                       std::string, std::string, int64_t, std::optional<c10::ScalarType>, std::optional<c10::ScalarType>, bool,
                       bool, std::vector<int64_t>>())
      .def("enable_loss_scaling", &ShardedModel::enable_loss_scaling)
      .def("disable_loss_scaling", &ShardedModel::disable_loss_scaling)
      .def("loss_scale", &ShardedModel::loss_scale)
      .def("loss_scaling", &ShardedModel::loss_scaling)
      .def("on_output_grad", &ShardedModel::on_output_grad)
      .def("found_nonfinite", &ShardedModel::found_nonfinite)
      .def("note_nonfinite_elsewhere", &ShardedModel::note_nonfinite_elsewhere)
      .def("begin_step", &ShardedModel::begin_step)
      .def("set_skip_nonfinite", &ShardedModel::set_skip_nonfinite)
      .def("enable_stall_diagnosis", &ShardedModel::enable_stall_diagnosis)
      .def("enable_collective_checks", &ShardedModel::enable_collective_checks)
      .def("set_unit_names", &ShardedModel::set_unit_names)
      .def("set_unit_advice", &ShardedModel::set_unit_advice)
      .def("stall_queries", &ShardedModel::stall_queries)
      .def("post_whereabouts", &ShardedModel::post_whereabouts)
      .def("note_compute_copy_written", &ShardedModel::note_compute_copy_written)
      .def("segment_compute_copies", &ShardedModel::segment_compute_copies)
      .def("replicated", &ShardedModel::replicated)
      .def("params_sharded", &ShardedModel::params_sharded)
      .def("whole_params", &ShardedModel::whole_params)
      .def("failed", &ShardedModel::failed)
      .def("grad_layout", &ShardedModel::grad_layout)
      .def("local_pieces", &ShardedModel::local_pieces)
      .def("owned_ranges", &ShardedModel::owned_ranges)
      .def("local_value_shards", &ShardedModel::local_value_shards)
      .def("segment_param_starts", &ShardedModel::segment_param_starts)
      .def("loss_scaler_state", &ShardedModel::loss_scaler_state)
      .def("restore_loss_scaler", &ShardedModel::restore_loss_scaler)
      .def("refresh_params_from_shards", &ShardedModel::refresh_params_from_shards)
      .def("has_masters", &ShardedModel::has_masters)
      .def("full_masters", &ShardedModel::full_masters)
      .def("full_masters_of", &ShardedModel::full_masters_of)
      .def("load_masters", &ShardedModel::load_masters)
      // The unit actions go through their registered ops (core_ops.h).
      .def("begin_forward", &ShardedModel::begin_forward)
      .def("end_forward", &ShardedModel::end_forward)
      .def("forward_raised", &ShardedModel::forward_raised)
      .def("pre_forward",
           [](const c10::intrusive_ptr<ShardedModel>& self, int64_t unit) {
             dispatch::gather_unit(self, unit, /*backward=*/false);
           })
      // A stage 3 unit's forward begins: gather it, and pass its inputs that
      // require grad through a boundary node that reports the end of this use.
      .def("enter_unit",
           [](const c10::intrusive_ptr<ShardedModel>& self, int64_t unit, std::vector<at::Tensor> inputs) {
             dispatch::gather_unit(self, unit, /*backward=*/false);
             return track_unit_inputs(self, unit, inputs);
           })
      // The same without the gather (a later member of a merged unit).
      .def("track_unit_inputs",
           [](const c10::intrusive_ptr<ShardedModel>& self, int64_t unit, std::vector<at::Tensor> inputs) {
             return track_unit_inputs(self, unit, inputs);
           })
      .def("hook_regather", &ShardedModel::hook_regather)
      .def("scale_outputs", [](const c10::intrusive_ptr<ShardedModel>& self, std::vector<at::Tensor> outputs) {
        return scale_at_outputs(self, outputs);
      })
      .def("post_forward",
           [](const c10::intrusive_ptr<ShardedModel>& self, int64_t unit, std::vector<at::Tensor> outputs) {
             dispatch::release_unit(self, unit, outputs);
           })
      .def("add_pending_use", &ShardedModel::add_pending_use)
      .def("post_backward_use", &ShardedModel::post_backward_use)
      .def("note_untracked_use", &ShardedModel::note_untracked_use)
      .def("gather_all", &ShardedModel::gather_all)
      .def("gather_units_of", &ShardedModel::gather_units_of)
      .def("unpin_units_of", &ShardedModel::unpin_units_of)
      .def("release_all", &ShardedModel::release_all)
      .def("keep_gathered_after_forward", &ShardedModel::keep_gathered_after_forward)
      .def("reshard_to_subgroup", &ShardedModel::reshard_to_subgroup)
      .def("set_prefetch", &ShardedModel::set_prefetch)
      .def("unshard", &ShardedModel::unshard)
      .def("wait_unshard", &ShardedModel::wait_unshard)
      .def("write_back_shards", &ShardedModel::write_back_shards)
      .def("begin_materialize", &ShardedModel::begin_materialize)
      .def("end_materialize", &ShardedModel::end_materialize)
      .def("set_sync", &ShardedModel::set_sync)
      .def("sync", &ShardedModel::sync)
      .def("set_replica_sync", &ShardedModel::set_replica_sync)
      .def("set_gradient_divide_factor", &ShardedModel::set_gradient_divide_factor)
      .def("enable_compression", &ShardedModel::enable_compression)
      .def("traffic", &ShardedModel::traffic)
      .def("residual_bytes", &ShardedModel::residual_bytes)
      .def("replica_sync", &ShardedModel::replica_sync)
      .def("zero_grad", &ShardedModel::zero_grad)
      .def("after_step", &ShardedModel::after_step)
      .def("check_before_step", &ShardedModel::check_before_step)
      .def("segments", &ShardedModel::segments)
      .def("segment_param_indices", &ShardedModel::segment_param_indices)
      .def("full_grads", &ShardedModel::full_grads)
      .def("settle", &ShardedModel::settle)
      .def("has_grad", &ShardedModel::has_grad)
      .def("bucket_layout", &ShardedModel::bucket_layout)
      .def("stats", &ShardedModel::stats)
      .def("group_all_reduce", &ShardedModel::group_all_reduce)
      .def("group_broadcast_from_rank0", &ShardedModel::group_broadcast_from_rank0)
      .def("group_all_gather", &ShardedModel::group_all_gather)
      .def("mesh_all_reduce", &ShardedModel::mesh_all_reduce)
      .def("mesh_broadcast_from_rank0", &ShardedModel::mesh_broadcast_from_rank0)
      .def("mesh_all_gather", &ShardedModel::mesh_all_gather)
      .def("set_max_in_flight_bytes", &ShardedModel::set_max_in_flight_bytes)
      .def("enable_swap", &ShardedModel::enable_swap)
      .def("swapped", &ShardedModel::swapped)
      .def("set_max_live_bytes", &ShardedModel::set_max_live_bytes)
      .def("swap_in", &ShardedModel::swap_in)
      .def("swap_prefetch", &ShardedModel::swap_prefetch)
      .def("swap_out", &ShardedModel::swap_out)
      .def("swap_in_grads", &ShardedModel::swap_in_grads)
      .def("swap_out_grads", &ShardedModel::swap_out_grads)
      .def("swap_stats", &ShardedModel::swap_stats)
      .def("swap_drain", &ShardedModel::swap_drain)
      .def("swap_reset_peak", &ShardedModel::swap_reset_peak)
      .def("swap_fail_writes_after", &ShardedModel::swap_fail_writes_after)
      .def("set_test_fault", &ShardedModel::set_test_fault)
      .def("log_issues", &ShardedModel::log_issues)
      .def("take_issue_log", &ShardedModel::take_issue_log)
      // Identity: torch's fake-tensor dispatch cache compares the arguments
      // of an op (the core ops take this object) with ==.
      .def("__eq__", [](const c10::intrusive_ptr<ShardedModel>& self, const c10::intrusive_ptr<ShardedModel>& other) {
        return self.get() == other.get();
      });
  m.class_<UnitUse>("UnitUse");
  define_core_ops(m);
  m.class_<LayoutProbe>("Layout")
      .def(torch::init<std::vector<std::vector<int64_t>>, std::vector<int64_t>, std::vector<int64_t>,
                       std::vector<int64_t>, int64_t, std::string, int64_t, int64_t, std::vector<int64_t>>())
      .def("owned_ranges", &LayoutProbe::owned_ranges)
      .def("pieces", &LayoutProbe::pieces)
      .def("gaps", &LayoutProbe::gaps)
      .def("buckets", &LayoutProbe::buckets);
  using Gate = c10::intrusive_ptr<StepGateProbe>;
  m.class_<StepGateProbe>("StepGate")
      .def(torch::init<>())
      .def("enable_loss_scaling", &StepGateProbe::enable_loss_scaling)
      .def("set_skip_nonfinite", [](const Gate& self, bool skip) { self->gate.set_skip_nonfinite(skip); })
      .def("note_nonfinite_backward", [](const Gate& self) { self->gate.note_nonfinite_backward(); })
      .def("clear_nonfinite", [](const Gate& self) { self->gate.clear_nonfinite(); })
      .def("decide", [](const Gate& self) { return static_cast<int64_t>(self->gate.decide()); })
      .def("loss_scale", [](const Gate& self) { return self->gate.scaler().scale(); })
      .def("skipped_steps", [](const Gate& self) { return self->gate.skipped_steps(); })
      .def("step_index", [](const Gate& self) { return self->gate.progress().step_index; });
  m.class_<QuietStore>("QuietStore")
      .def(torch::init<std::string>())
      .def("set", &QuietStore::set)
      .def("get", &QuietStore::get)
      .def("check", &QuietStore::check)
      .def("add", &QuietStore::add)
      .def("delete_key", &QuietStore::delete_key)
      .def("lost", &QuietStore::lost);
  m.class_<SwapFile>("SwapFile")
      .def(torch::init<std::string, int64_t, int64_t, int64_t>())
      .def("write", &SwapFile::write)
      .def("read", &SwapFile::read)
      .def("wait", &SwapFile::wait)
      .def("idle", &SwapFile::idle)
      .def("done", &SwapFile::done)
      .def("fail_writes_after", &SwapFile::fail_writes_after)
      .def("path", [](const c10::intrusive_ptr<SwapFile>& self) { return self->path(); })
      .def("bytes", &SwapFile::bytes)
      .def("direct", &SwapFile::direct)
      .def("bytes_written", &SwapFile::bytes_written)
      .def("bytes_read", &SwapFile::bytes_read);
}

TORCH_LIBRARY_IMPL(zero_ext, CPU, m) {
  m.impl("adam_step_", &adam_step_);
}

TORCH_LIBRARY_IMPL(zero_ext, Meta, m) {
  m.impl("adam_step_", &adam_step_meta);
  register_core_op_meta_kernels(m);
}

} // namespace zero_ext

// Importing zero_ext._C runs the registration above.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
