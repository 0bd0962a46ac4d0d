// The one place that exposes the C++ core to Python, as torch custom classes
// (torch.classes.zero_ext.*) so it needs no pybind and shows in the profiler.
#include <Python.h>

#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "cpu_adam.h"
#include "grad_buckets.h"

namespace zero_ext {

namespace {

// Shape checks only: lets torch.compile and opcheck trace the op.
void adam_step_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double,
                    double, double, double, double, int64_t, bool, bool, bool) {}

} // namespace

TORCH_LIBRARY(zero_ext, m) {
  m.def(
      "adam_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? max_exp_avg_sq, Tensor(e!)? param_lowp, float lr, float beta1, float beta2, "
      "float eps, float weight_decay, int step, bool decoupled_weight_decay, bool amsgrad, "
      "bool maximize) -> ()");
  m.class_<GradBuckets>("GradBuckets")
      .def(torch::init<std::vector<at::Tensor>, std::vector<std::string>, std::vector<int64_t>,
                       std::vector<int64_t>, std::vector<int64_t>, int64_t, std::string, std::string,
                       int64_t, int64_t, int64_t, bool>())
      .def("enable_loss_scaling", &GradBuckets::enable_loss_scaling)
      .def("disable_loss_scaling", &GradBuckets::disable_loss_scaling)
      .def("loss_scale", &GradBuckets::loss_scale)
      .def("loss_scaling", &GradBuckets::loss_scaling)
      .def("on_output_grad", &GradBuckets::on_output_grad)
      .def("found_nonfinite", &GradBuckets::found_nonfinite)
      .def("begin_step", &GradBuckets::begin_step)
      .def("set_skip_nonfinite", &GradBuckets::set_skip_nonfinite)
      .def("check_param_shapes", &GradBuckets::check_param_shapes)
      .def("enable_stall_diagnosis", &GradBuckets::enable_stall_diagnosis)
      .def("note_compute_copy_written", &GradBuckets::note_compute_copy_written)
      .def("segment_compute_copies", &GradBuckets::segment_compute_copies)
      .def("offloaded", &GradBuckets::offloaded)
      .def("replicated", &GradBuckets::replicated)
      .def("local_value_shards", &GradBuckets::local_value_shards)
      .def("local_value_starts", &GradBuckets::local_value_starts)
      .def("segment_param_starts", &GradBuckets::segment_param_starts)
      .def("loss_scaler_state", &GradBuckets::loss_scaler_state)
      .def("restore_loss_scaler", &GradBuckets::restore_loss_scaler)
      .def("refresh_params_from_shards", &GradBuckets::refresh_params_from_shards)
      .def("has_masters", &GradBuckets::has_masters)
      .def("full_masters", &GradBuckets::full_masters)
      .def("load_masters", &GradBuckets::load_masters)
      .def("pre_forward", &GradBuckets::pre_forward)
      .def("post_forward", &GradBuckets::post_forward)
      .def("add_pending_use", &GradBuckets::add_pending_use)
      .def("post_backward_use", &GradBuckets::post_backward_use)
      .def("note_untracked_use", &GradBuckets::note_untracked_use)
      .def("gather_all", &GradBuckets::gather_all)
      .def("gather_units_of", &GradBuckets::gather_units_of)
      .def("unpin_units_of", &GradBuckets::unpin_units_of)
      .def("release_all", &GradBuckets::release_all)
      .def("write_back_shards", &GradBuckets::write_back_shards)
      .def("attach_output_hook", &GradBuckets::attach_output_hook)
      .def("set_sync", &GradBuckets::set_sync)
      .def("sync", &GradBuckets::sync)
      .def("zero_grad", &GradBuckets::zero_grad)
      .def("after_step", &GradBuckets::after_step)
      .def("check_before_step", &GradBuckets::check_before_step)
      .def("reset_if_stale", &GradBuckets::reset_if_stale)
      .def("segments", &GradBuckets::segments)
      .def("segment_param_indices", &GradBuckets::segment_param_indices)
      .def("full_grads", &GradBuckets::full_grads)
      .def("has_grad", &GradBuckets::has_grad)
      .def("bucket_layout", &GradBuckets::bucket_layout)
      .def("stats", &GradBuckets::stats)
      .def("rank", &GradBuckets::rank)
      .def("world_size", &GradBuckets::world_size);
}

TORCH_LIBRARY_IMPL(zero_ext, CPU, m) {
  m.impl("adam_step_", &adam_step_);
}

TORCH_LIBRARY_IMPL(zero_ext, Meta, m) {
  m.impl("adam_step_", &adam_step_meta);
}

} // namespace zero_ext

// Importing zero_ext._C runs the registration above.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
