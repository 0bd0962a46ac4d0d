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
#include "core_config.h"
#include "core_ops.h"
#include "core_views.h"
#include "cpu_adam.h"
#include "diagnosis_store.h"
#include "layout.h"
#include "reusable_blocks.h"
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
  // The end of wrap() and load(): [Note: reusable host blocks].
  m.def("release_idle_host_blocks() -> ()", [] { ReusableBlocks::get().release_idle(); });
  // with_ops: the ATen-op path (what CUDA runs) on any device, for tests.
  m.def("quantize_blocks(Tensor values, int bits, int block, Tensor(a!)? residual, bool with_ops=False) -> Tensor",
        &quantize_blocks_op);
  m.def("dequantize_blocks(Tensor payload, int numel, int bits, int block, bool with_ops=False) -> Tensor",
        &dequantize_blocks_op);
  define_core_config(m);
  // The model itself offers no methods: Python reaches it by concern
  // (core_views.h); the registered ops take it (core_ops.h).
  m.class_<ShardedModel>("ShardedModel")
      .def(torch::init<std::vector<at::Tensor>, std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>,
                       std::vector<int64_t>, std::vector<int64_t>, c10::intrusive_ptr<CoreConfig>>())
      // Identity: torch's fake-tensor dispatch cache compares the arguments
      // of an op (the core ops take this object) with ==.
      .def("__eq__", [](const c10::intrusive_ptr<ShardedModel>& self, const c10::intrusive_ptr<ShardedModel>& other) {
        return self.get() == other.get();
      });
  define_core_views(m);
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
