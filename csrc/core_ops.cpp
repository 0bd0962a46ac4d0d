#include "core_ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include "sharded_model.h"

namespace zero_ext {
namespace {

// Kernels. Each is the ShardedModel entry point of the same action.

void gather_unit_kernel(const ModelPtr& model, int64_t unit, bool backward) {
  if (backward) {
    model->pre_backward(unit);
  } else {
    model->pre_forward(unit);
  }
}

void release_unit_kernel(const ModelPtr& model, int64_t unit, at::TensorList outputs) {
  model->post_forward(unit, outputs.vec());
}

void accumulate_grad_kernel(const ModelPtr& model, int64_t param, const at::Tensor& grad) {
  model->accumulate_grad(param, grad);
}

void accumulate_grad_meta(const ModelPtr& model, int64_t param, const at::Tensor& grad) {
  model->check_grad_shape(param, grad);
}

// Under fake tensors (tracing) nothing is gathered, released or reduced:
// there are no real buffers to fill or free.
void gather_unit_meta(const ModelPtr& /*model*/, int64_t /*unit*/, bool /*backward*/) {}
void release_unit_meta(const ModelPtr& /*model*/, int64_t /*unit*/, at::TensorList /*outputs*/) {}
void run_epilogue_meta(const ModelPtr& /*model*/) {}

void run_epilogue_kernel(const ModelPtr& model) {
  model->run_epilogue();
}

template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

} // namespace

void define_core_ops(torch::Library& m) {
  // One real kernel for every backend (CompositeExplicitAutograd; no
  // autograd formula: they return nothing) and a Meta kernel for fake
  // tensors (register_core_op_meta_kernels).
  m.def("gather_unit(__torch__.torch.classes.zero_ext.ShardedModel model, int unit, bool backward=False) -> ()");
  m.impl("gather_unit", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(gather_unit_kernel));
  m.def("release_unit(__torch__.torch.classes.zero_ext.ShardedModel model, int unit, Tensor[] outputs) -> ()");
  m.impl("release_unit", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(release_unit_kernel));
  m.def("run_epilogue(__torch__.torch.classes.zero_ext.ShardedModel model) -> ()");
  m.impl("run_epilogue", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(run_epilogue_kernel));
  m.def("accumulate_grad(__torch__.torch.classes.zero_ext.ShardedModel model, int param, Tensor grad) -> ()");
  m.impl("accumulate_grad", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(accumulate_grad_kernel));
}

void register_core_op_meta_kernels(torch::Library& m) {
  m.impl("accumulate_grad", TORCH_FN(accumulate_grad_meta));
  m.impl("release_unit", TORCH_FN(release_unit_meta));
  m.impl("gather_unit", TORCH_FN(gather_unit_meta));
  m.impl("run_epilogue", TORCH_FN(run_epilogue_meta));
}

namespace dispatch {

void gather_unit(const ModelPtr& model, int64_t unit, bool backward) {
  static const auto handle = op<void(const ModelPtr&, int64_t, bool)>("zero_ext::gather_unit");
  handle.call(model, unit, backward);
}

void release_unit(const ModelPtr& model, int64_t unit, at::TensorList outputs) {
  static const auto handle = op<void(const ModelPtr&, int64_t, at::TensorList)>("zero_ext::release_unit");
  handle.call(model, unit, outputs);
}

void accumulate_grad(const ModelPtr& model, int64_t param, const at::Tensor& grad) {
  static const auto handle = op<void(const ModelPtr&, int64_t, const at::Tensor&)>("zero_ext::accumulate_grad");
  handle.call(model, param, grad);
}

void run_epilogue(const ModelPtr& model) {
  static const auto handle = op<void(const ModelPtr&)>("zero_ext::run_epilogue");
  handle.call(model);
}

} // namespace dispatch
} // namespace zero_ext
