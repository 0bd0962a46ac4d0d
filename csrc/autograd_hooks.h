#pragma once
// GradHooks: zero_ext's hooks on each trainable parameter's AccumulateGrad
// node, in C++ so no Python runs per gradient.
//
// A post hook reports each gradient once the engine has accumulated it into
// param.grad; a pre hook drops the gradient stand-in ([Note: gradient
// stand-ins] in grad_reducer.h) before the engine accumulates, or the
// gradient itself when a compiled graph handed it over already. The nodes are
// held strongly: a tensor holds its AccumulateGrad node only weakly, and a
// hook on a node that was dropped and re-created would never fire.

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include "grad_reducer.h"
#include "gradient_route.h"
#include "layout.h"

namespace zero_ext {

// Calls `fn` when a backward brings `tensor` a gradient, as
// tensor.register_hook would, but refused with zero_ext's message (not
// torch's "compiled_args nyi") under compiled autograd.
void on_gradient(const at::Tensor& tensor, std::function<void()> fn);

// A gradient a compiled graph handed over: the backward (graph task) it was
// in, and what the graph returned to the engine in its place.
struct GradTaken {
  int64_t graph_task = -1;
  at::Tensor returned;
};

class GradHooks {
 public:
  GradHooks(const std::vector<at::Tensor>& params, const Layout& layout, const GradReducer& reducer,
            std::function<void(int64_t)> on_grad_ready);
  ~GradHooks();
  GradHooks(const GradHooks&) = delete;
  GradHooks& operator=(const GradHooks&) = delete;

  // Whether the running backward executes any parameter's AccumulateGrad.
  // False for torch.autograd.grad(...) and backward(inputs=...) that leave
  // them out: those accumulate nothing, so they must not start a reduction.
  bool backward_reaches_params() const;
  // Whether the running backward accumulates parameter i's gradient into
  // param.grad (not torch.autograd.grad, which captures it).
  bool accumulates(int64_t i) const;
  // A compiled graph handed zero_ext parameter i's gradient in this backward
  // ([Note: gradients handed over in the graph] in sharded_model_graph.cpp)
  // and returned `returned` (zeros) to the engine: that is dropped before
  // AccumulateGrad, a gradient summed with it from another use is not.
  void mark_taken(int64_t i, const at::Tensor& returned);
  // The forwards of the next backward, which compiled autograd's view of these hooks depends on.
  GradientRoute& route() { return *route_; }
  // Raises if a parameter's accumulator was re-created since wrap(): its
  // gradients would bypass zero_ext.
  void verify_accumulators() const;

 private:
  // The pointer type changed across torch releases: take whatever it returns.
  using NodeRef = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  const std::vector<at::Tensor>& params_;
  const Layout& layout_;
  std::function<void(int64_t)> on_grad_ready_;
  std::vector<NodeRef> accumulators_;
  std::vector<const void*> accumulator_nodes_;  // the same, for exec_info lookups
  std::vector<uintptr_t> hook_keys_;
  std::shared_ptr<std::vector<GradTaken>> taken_by_;  // by parameter
  std::shared_ptr<GradientRoute> route_;             // shared with the hooks, which may outlive the model
};

} // namespace zero_ext
