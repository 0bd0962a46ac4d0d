#include "core_ops.h"

#include <mutex>
#include <unordered_map>

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

// The model's forward boundaries as ops, for a forward torch.compile traces
// ([Note: the model's forward in a compiled graph]).
// `grad`: grad mode where the graph was traced (it runs under no_grad).
void begin_forward_kernel(int64_t model, bool grad, bool detached_reads) {
  model_of_handle(model, "begin_forward")->begin_graph_forward(grad, detached_reads);
}

void end_forward_kernel(int64_t model) {
  model_of_handle(model, "end_forward")->end_graph_forward();
}

// Stage 3: a parameter's read in a graph ([Note: stage 3 in a compiled graph]
// in units_graph.cpp). `param` (the parameter itself, whose storage holds nothing
// while released) is never read: it makes the read depend on the
// parameter, and gives the result's shape and dtype to fake tensors.
at::Tensor gathered_param_kernel(int64_t model, int64_t index, const at::Tensor& /*param*/) {
  return model_of_handle(model, "gathered_param")->gathered_param(index);
}

at::Tensor gathered_param_meta(int64_t /*model*/, int64_t /*index*/, const at::Tensor& param) {
  return at::empty(param.sizes(), param.options());
}

// A gradient of a parameter read in a compiled graph ([Note: gradients
// handed over in the graph] in sharded_model_graph.cpp).
at::Tensor grad_arrived_kernel(int64_t model, int64_t index, const at::Tensor& grad) {
  return model_of_handle(model, "grad_arrived")->grad_arrived(index, grad);
}

at::Tensor grad_arrived_meta(int64_t /*model*/, int64_t /*index*/, const at::Tensor& grad) {
  return at::empty(grad.sizes(), grad.options());  // contiguous, as the kernel's zeros or copy
}

// Under compiled autograd ([Note: compiled autograd] in sharded_model_graph.cpp):
// a read's gradient handed over, and a zero token returned as the gradient
// of the model's anchor (a CPU scalar, whatever the gradient's device: the
// anchor is one for the model); the anchor's hook ends the backward.
at::Tensor hand_over_grad_kernel(int64_t model, int64_t index, const at::Tensor& grad) {
  model_of_handle(model, "hand_over_grad")->hand_over_grad(index, grad);
  return at::zeros({}, at::TensorOptions().dtype(at::kFloat));
}

at::Tensor backward_over_kernel(int64_t model, const at::Tensor& tokens) {
  model_of_handle(model, "backward_over")->backward_over();
  return at::zeros_like(tokens);
}

void backward_begins_kernel(int64_t model, const at::Tensor& /*grad*/) {
  model_of_handle(model, "backward_begins")->on_output_grad();
}

// fp16 with loss scaling: backward_begins, and the output's gradient scaled
// by the loss scale (1 where the backward reaches no parameter: autograd.grad
// gets true gradients) in fp32, then in the output's dtype `dtype` (fp16
// outputs leave the model in fp32), as LossScaleBoundary's backward
// (autograd_boundaries.cpp) does eagerly.
at::Tensor scale_output_grad_kernel(int64_t model, const at::Tensor& grad, at::ScalarType dtype) {
  const double scale = model_of_handle(model, "scale_output_grad")->on_output_grad();
  return scale != 1.0 ? (grad.to(at::kFloat) * scale).to(dtype) : grad.to(dtype, /*non_blocking=*/false, /*copy=*/true);
}

at::Tensor scale_output_grad_meta(int64_t /*model*/, const at::Tensor& grad, at::ScalarType dtype) {
  return at::empty_like(grad, grad.options().dtype(dtype));
}

void begin_forward_meta(int64_t /*model*/, bool /*grad*/, bool /*detached_reads*/) {}
void end_forward_meta(int64_t /*model*/) {}
void backward_begins_meta(int64_t /*model*/, const at::Tensor& /*grad*/) {}

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
  // [Note: the model's forward in a compiled graph]
  // Eagerly, the root module's hooks call the model's begin_forward and
  // end_forward, and end_forward hooks the outputs' gradients to learn when a
  // backward reaches the model (arming the epilogue). Inside a graph
  // torch.compile traces, a hook on an output would hook a tensor of the
  // trace, not the one the user backpropagates from; so there the hooks call
  // these ops, and the outputs pass through an autograd function whose
  // backward calls backward_begins with the outputs' gradient (the gradient
  // as an argument puts the call in the backward graph: the partitioner
  // moves a node that reads no tangent into the forward). They take the
  // model's handle (model_handle), not the ShardedModel object: a graph
  // bakes an int in as a constant, while a TorchScript object passed from
  // the forward graph to the backward one is refused by AOTAutograd (torch
  // 2.13: "expected all opaque_object_outs to be opaque types"). Python
  // marks them side-effectful so that no graph pass drops them
  // (zero_ext/runtime/compiled_forward.py).
  m.def("begin_forward(int model, bool grad=True, bool detached_reads=False) -> ()");
  m.impl("begin_forward", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(begin_forward_kernel));
  m.def("end_forward(int model) -> ()");
  m.impl("end_forward", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(end_forward_kernel));
  m.def("backward_begins(int model, Tensor grad) -> ()");
  m.impl("backward_begins", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(backward_begins_kernel));
  m.def("scale_output_grad(int model, Tensor grad, ScalarType dtype) -> Tensor");
  m.impl("scale_output_grad", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(scale_output_grad_kernel));
  m.def("gathered_param(int model, int index, Tensor param) -> Tensor");
  m.impl("gathered_param", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(gathered_param_kernel));
  m.def("grad_arrived(int model, int index, Tensor grad) -> Tensor");
  m.impl("grad_arrived", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(grad_arrived_kernel));
  m.def("hand_over_grad(int model, int index, Tensor grad) -> Tensor");
  m.impl("hand_over_grad", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(hand_over_grad_kernel));
  m.def("backward_over(int model, Tensor tokens) -> Tensor");
  m.impl("backward_over", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(backward_over_kernel));
}

void register_core_op_meta_kernels(torch::Library& m) {
  m.impl("accumulate_grad", TORCH_FN(accumulate_grad_meta));
  m.impl("release_unit", TORCH_FN(release_unit_meta));
  m.impl("gather_unit", TORCH_FN(gather_unit_meta));
  m.impl("run_epilogue", TORCH_FN(run_epilogue_meta));
  m.impl("begin_forward", TORCH_FN(begin_forward_meta));
  m.impl("end_forward", TORCH_FN(end_forward_meta));
  m.impl("backward_begins", TORCH_FN(backward_begins_meta));
  m.impl("scale_output_grad", TORCH_FN(scale_output_grad_meta));
  m.impl("gathered_param", TORCH_FN(gathered_param_meta));
  m.impl("grad_arrived", TORCH_FN(grad_arrived_meta));
  // hand_over_grad and backward_over: fake kernels in Python
  // (zero_ext/runtime/compiled_units.py), since their token is a CPU scalar
  // whatever the gradient's device, which a Meta kernel cannot say.
}

// --- model handles ---------------------------------------------------------------

namespace {

struct HandleTable {
  std::mutex mutex;
  int64_t next = 1;
  std::unordered_map<int64_t, c10::weak_intrusive_ptr<ShardedModel>> models;  // a few entries: one per model
};

HandleTable& handle_table() {
  static auto* table = new HandleTable();  // never destroyed: ops may run during interpreter exit
  return *table;
}

} // namespace

int64_t model_handle(const ModelPtr& model) {
  HandleTable& table = handle_table();
  std::lock_guard<std::mutex> lock(table.mutex);
  for (auto it = table.models.begin(); it != table.models.end();) {
    if (it->second.expired()) {
      it = table.models.erase(it);  // its model is gone: forgotten
    } else if (it->second.lock().get() == model.get()) {
      return it->first;
    } else {
      ++it;
    }
  }
  const int64_t handle = table.next++;  // never reused: a stale graph cannot reach another model
  table.models.emplace(handle, c10::weak_intrusive_ptr<ShardedModel>(model));
  return handle;
}

ModelPtr model_of_handle(int64_t handle, const char* op) {
  HandleTable& table = handle_table();
  std::lock_guard<std::mutex> lock(table.mutex);
  auto found = table.models.find(handle);
  ModelPtr model = found == table.models.end() ? ModelPtr() : found->second.lock();
  TORCH_CHECK(model, "zero_ext.", op, ": no wrapped model has handle ", handle,
              " any more (the model it was compiled for is gone). Compile the model you train: "
              "torch.compile(model) after zero_ext.wrap(model, ...), and call torch._dynamo.reset() before "
              "compiling a new model in the same process if a graph was cached for an old one");
  return model;
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
