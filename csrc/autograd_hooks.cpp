#include "autograd_hooks.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

// Include what you use: Node's hook methods need function.h, which some
// torch releases pull in through other headers and others (2.11) do not.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/dynamo/compiled_autograd.h>

#include "epilogue.h"

namespace zero_ext {
namespace {

// Compiled autograd asks each hook to describe itself (compiled_args) so that
// it can trace the hook into its graph; torch implements that for Python
// hooks only. After a forward traced with compiled autograd on, parameters
// were read detached ([Note: compiled autograd] in sharded_model_graph.cpp):
// their AccumulateGrad nodes are in the backward but get no gradient, and
// the hooks become one check that none arrives (a parameter used outside the
// model in eager code would put an unreduced gradient into .grad). After a
// forward run any other way they would have to run inside compiled
// autograd's graph: refused with the way out, not torch's "compiled_args nyi".
[[noreturn]] void refuse_compiled_autograd() {
  TORCH_CHECK(false,
              "zero_ext: compiled autograd (torch._dynamo.config.compiled_autograd) reached zero_ext's gradient "
              "hooks, which it cannot trace: this backward's forward ran eagerly, or was compiled while compiled "
              "autograd was off. Call the model inside the function you compile with compiled autograd on (a "
              "train step that runs the forward, the loss and loss.backward()), or turn compiled autograd off "
              "(docs/torch-compile-and-profiling.md)");
}

void describe_for_compiled_autograd(const GradientRoute& route, const std::string& name,
                                    torch::dynamo::autograd::CompiledNodeArgs& args, bool pre_hook) {
  const unsigned kinds = route.for_next_backward();
  if (kinds == 0) {
    return;  // no forward with grad (or the model is gone): a plain parameter's node
  }
  if (kinds == GradientRoute::bit(GradientRoute::Forward::kDetached)) {
    if (pre_hook) {
      args.add_cpp_single_tensor_pre_hook(
          [name](const at::TensorBase& grad) -> at::TensorBase {
            TORCH_CHECK(!grad.defined(), "zero_ext: under compiled autograd, parameter '", name,
                        "' got a gradient from outside the compiled forward (eager code using the parameter "
                        "itself?). zero_ext would never reduce it. Use the parameter inside the compiled "
                        "function, or turn compiled autograd off (docs/torch-compile-and-profiling.md)");
            return grad;
          },
          0);
    }
    return;
  }
  refuse_compiled_autograd();
}

class ParamReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ParamReadyHook(const std::function<void(int64_t)>* on_ready, std::shared_ptr<const GradientRoute> route,
                 std::string name, int64_t index)
      : on_ready_(on_ready), route_(std::move(route)), name_(std::move(name)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    (*on_ready_)(index_);
    return outputs;
  }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    describe_for_compiled_autograd(*route_, name_, args, /*pre_hook=*/false);
  }

 private:
  const std::function<void(int64_t)>* on_ready_;  // GradHooks removes this hook in its destructor
  std::shared_ptr<const GradientRoute> route_;
  std::string name_;
  int64_t index_;
};

// Before the engine accumulates a gradient into param.grad: what a compiled
// graph returned for a gradient it handed to zero_ext in this backward
// (GradHooks::mark_taken: zeros) is dropped, but not a gradient of the same
// parameter from a use outside the graph, which the engine summed with
// those zeros; and zero_ext's gradient stand-in ([Note: gradient stand-ins]
// in grad_reducer.h) is cleared so that the engine does not add to it.
class AccumulatorPreHook : public torch::autograd::FunctionPreHook {
 public:
  AccumulatorPreHook(at::Tensor param, at::Tensor stand_in, std::shared_ptr<std::vector<GradTaken>> taken_by,
                     std::shared_ptr<const GradientRoute> route, std::string name, int64_t index)
      : param_(std::move(param)),
        stand_in_(std::move(stand_in)),
        taken_by_(std::move(taken_by)),
        route_(std::move(route)),
        name_(std::move(name)),
        index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    GradTaken& taken = (*taken_by_)[index_];
    if (taken.graph_task >= 0 && taken.graph_task == current_backward().graph_task_id) {
      const at::Tensor returned = std::move(taken.returned);
      taken = GradTaken();
      const at::Tensor& grad = grads[0];
      // The graph's zeros alone (or several graphs' zeros summed: all zero,
      // so dropping them drops nothing; checked only then, as it reads the
      // values) are dropped: AccumulateGrad returns at once on an undefined
      // gradient. Anything else carries another use's gradient.
      if (!grad.defined() || grad.is_alias_of(returned) || !grad.any().item<bool>()) {
        return {at::Tensor()};
      }
    }
    if (stand_in_.defined()) {
      at::Tensor& grad = param_.mutable_grad();
      if (grad.defined() && grad.unsafeGetTensorImpl() == stand_in_.unsafeGetTensorImpl()) {
        grad = at::Tensor();
      }
    }
    return grads;
  }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    describe_for_compiled_autograd(*route_, name_, args, /*pre_hook=*/true);
  }

 private:
  at::Tensor param_;  // the node holds it strongly already
  at::Tensor stand_in_;
  std::shared_ptr<std::vector<GradTaken>> taken_by_;  // shared: the node may outlive the model
  std::shared_ptr<const GradientRoute> route_;        // shared, likewise
  std::string name_;
  int64_t index_;
};

// A hook on the gradient of one output of a node (what Tensor::register_hook
// installs on a non-leaf), with the refusal above under compiled autograd:
// torch's own C++ tensor hook would stop it with "compiled_args nyi" first.
class GradientArrivedHook : public torch::autograd::FunctionPreHook {
 public:
  explicit GradientArrivedHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  // Whenever the node runs, as torch's C++ tensor hook (an undefined
  // gradient included).
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    fn_();
    return grads;
  }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {
    refuse_compiled_autograd();
  }

 private:
  std::function<void()> fn_;
};

} // namespace

void on_gradient(const at::Tensor& tensor, std::function<void()> fn) {
  const auto& node = tensor.grad_fn();
  if (!node) {  // a leaf that requires grad, returned as it is
    tensor.register_hook([fn = std::move(fn)](const at::Tensor& /*grad*/) { fn(); });
    return;
  }
  node->add_tensor_pre_hook(std::make_unique<GradientArrivedHook>(std::move(fn)));
}

GradHooks::GradHooks(const std::vector<at::Tensor>& params, const Layout& layout, const GradReducer& reducer,
                     std::function<void(int64_t)> on_grad_ready)
    : params_(params), layout_(layout), on_grad_ready_(std::move(on_grad_ready)) {
  const int64_t n = layout_.num_params();
  taken_by_ = std::make_shared<std::vector<GradTaken>>(n);
  route_ = std::make_shared<GradientRoute>();
  accumulators_.resize(n);
  hook_keys_.assign(n, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (!layout_.trainable(i)) {
      continue;
    }
    auto node = torch::autograd::impl::grad_accumulator(params_[i]);
    TORCH_CHECK(node, "zero_ext: parameter '", layout_.name(i),
                "' has no gradient accumulator; is it a leaf that requires grad?");
    hook_keys_[i] = node->add_post_hook(std::make_unique<ParamReadyHook>(&on_grad_ready_, route_, layout_.name(i), i));
    node->add_pre_hook(std::make_unique<AccumulatorPreHook>(params_[i], reducer.stand_in(i), taken_by_, route_,
                                                        layout_.name(i), i));
    accumulator_nodes_.push_back(node.get());
    accumulators_[i] = std::move(node);
  }
}

GradHooks::~GradHooks() {
  route_->detach();  // the pre hooks stay on their nodes: a plain parameter's from now on
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

void GradHooks::mark_taken(int64_t i, const at::Tensor& returned) {
  (*taken_by_)[i] = GradTaken{current_backward().graph_task_id, returned};
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
