#pragma once
// The core's actions as registered torch ops: torch.ops.zero_ext.gather_unit,
// release_unit, accumulate_grad and run_epilogue, declared with full schemas
// in bindings.cpp (after torch.classes.zero_ext.ShardedModel, which they take
// the way c10d's functional ops take a group). zero_ext's own hooks, engine
// callbacks and bindings call them through the dispatcher (the functions in
// `dispatch` below), so each action shows in the profiler under its op name
// and `torch.library.opcheck` can check them (tests/test_core_ops.py).
//
// They mutate state held by the ShardedModel (its parameter buffers, buckets
// and accumulators), not their tensor arguments; accumulate_grad has a Meta
// kernel that checks the gradient's shape, for fake tensors.

#include <cstdint>

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

namespace zero_ext {

class ShardedModel;
using ModelPtr = c10::intrusive_ptr<ShardedModel>;

// Declares the ops in the zero_ext library and registers their kernels.
void define_core_ops(torch::Library& m);
void register_core_op_meta_kernels(torch::Library& m);

// A process-wide int for `model` (the same for its lifetime, never reused),
// and the model of such an int: what the compiled-graph ops take
// ([Note: the model's forward in a compiled graph] in core_ops.cpp).
int64_t model_handle(const ModelPtr& model);
ModelPtr model_of_handle(int64_t handle, const char* op);

namespace dispatch {
void gather_unit(const ModelPtr& model, int64_t unit, bool backward);
void release_unit(const ModelPtr& model, int64_t unit, at::TensorList outputs);
void accumulate_grad(const ModelPtr& model, int64_t param, const at::Tensor& grad);
void run_epilogue(const ModelPtr& model);
} // namespace dispatch

} // namespace zero_ext
