#include "autograd_hooks.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

// Include what you use: Node's hook methods need function.h, which some
// torch releases pull in through other headers and others (2.11) do not.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include "epilogue.h"

namespace zero_ext {
namespace {

// Compiled autograd asks each hook to describe itself (compiled_args) so that
// it can trace the hook into its graph; torch implements that for Python
// hooks only, and its own refusal names no way out.
[[noreturn]] void refuse_compiled_autograd() {
  TORCH_CHECK(false,
              "zero_ext: compiled autograd (torch._dynamo.config.compiled_autograd) cannot trace zero_ext's "
              "gradient hooks yet: they are C++ hooks on the parameters' gradient accumulators. Compile the "
              "forward instead (torch.compile(model), or a function that runs the forward and the loss) and call "
              "loss.backward() as usual: AOTAutograd compiles the backward with the forward, and zero_ext's "
              "hooks run after it (docs/torch-compile-and-profiling.md)");
}

class ParamReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ParamReadyHook(const std::function<void(int64_t)>* on_ready, int64_t index)
      : on_ready_(on_ready), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    (*on_ready_)(index_);
    return outputs;
  }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {
    refuse_compiled_autograd();
  }

 private:
  const std::function<void(int64_t)>* on_ready_;  // GradHooks removes this hook in its destructor
  int64_t index_;
};

// Before the engine accumulates a gradient into param.grad: a gradient that
// a compiled graph already handed to zero_ext in this backward (GradHooks::
// mark_taken) is dropped, and zero_ext's gradient stand-in ([Note: gradient
// stand-ins] in grad_reducer.h) is cleared so that the engine does not add to it.
class AccumulatorPreHook : public torch::autograd::FunctionPreHook {
 public:
  AccumulatorPreHook(at::Tensor param, at::Tensor stand_in, std::shared_ptr<std::vector<int64_t>> taken_by,
                     int64_t index)
      : param_(std::move(param)), stand_in_(std::move(stand_in)), taken_by_(std::move(taken_by)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    int64_t& taken_by = (*taken_by_)[index_];
    if (taken_by >= 0 && taken_by == current_backward().graph_task_id) {
      taken_by = -1;
      return {at::Tensor()};  // AccumulateGrad returns at once on an undefined gradient
    }
    if (stand_in_.defined()) {
      at::Tensor& grad = param_.mutable_grad();
      if (grad.defined() && grad.unsafeGetTensorImpl() == stand_in_.unsafeGetTensorImpl()) {
        grad = at::Tensor();
      }
    }
    return grads;
  }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {
    refuse_compiled_autograd();
  }

 private:
  at::Tensor param_;  // the node holds it strongly already
  at::Tensor stand_in_;
  std::shared_ptr<std::vector<int64_t>> taken_by_;  // shared: the node may outlive the model
  int64_t index_;
};

} // namespace

GradHooks::GradHooks(const std::vector<at::Tensor>& params, const Layout& layout, const GradReducer& reducer,
                     std::function<void(int64_t)> on_grad_ready)
    : params_(params), layout_(layout), on_grad_ready_(std::move(on_grad_ready)) {
  const int64_t n = layout_.num_params();
  taken_by_ = std::make_shared<std::vector<int64_t>>(n, -1);
  accumulators_.resize(n);
  hook_keys_.assign(n, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (!layout_.trainable(i)) {
      continue;
    }
    auto node = torch::autograd::impl::grad_accumulator(params_[i]);
    TORCH_CHECK(node, "zero_ext: parameter '", layout_.name(i),
                "' has no gradient accumulator; is it a leaf that requires grad?");
    hook_keys_[i] = node->add_post_hook(std::make_unique<ParamReadyHook>(&on_grad_ready_, i));
    node->add_pre_hook(std::make_unique<AccumulatorPreHook>(params_[i], reducer.stand_in(i), taken_by_, i));
    accumulator_nodes_.push_back(node.get());
    accumulators_[i] = std::move(node);
  }
}

GradHooks::~GradHooks() {
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    if (accumulators_[i]) {
      accumulators_[i]->del_post_hook(hook_keys_[i]);
    }
  }
}

bool GradHooks::backward_reaches_params() const {
  return current_backward_executes_any(accumulator_nodes_);
}

bool GradHooks::accumulates(int64_t i) const {
  return accumulators_[i] && current_backward_executes_any({accumulators_[i].get()});
}

void GradHooks::mark_taken(int64_t i) {
  (*taken_by_)[i] = current_backward().graph_task_id;
}

void GradHooks::verify_accumulators() const {
  for (int64_t i = 0; i < layout_.num_params(); ++i) {
    if (!layout_.trainable(i)) {
      continue;
    }
    auto current = torch::autograd::impl::try_get_grad_accumulator(params_[i]);
    TORCH_CHECK(!current || current.get() == accumulators_[i].get(), "zero_ext: parameter '", layout_.name(i),
                "' got a gradient that zero_ext never saw: its autograd accumulator was "
                "re-created after zero_ext.wrap() (its .data was replaced by a tensor of "
                "another dtype or device, or it was re-registered). Its gradient would "
                "silently miss the reduction. Change parameters in place "
                "(param.data.copy_(...)) or wrap the model after changing them.");
  }
}

} // namespace zero_ext
