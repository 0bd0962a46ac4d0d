#include "autograd_boundaries.h"

#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "sharded_model.h"

namespace zero_ext {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct UnitInputBoundary : public torch::autograd::Function<UnitInputBoundary> {
  // `inputs` must be an at::TensorList: Function::apply counts a
  // std::vector<Tensor> argument as one non-tensor argument, so the node
  // would get no inputs and the outputs no gradient edge at all.
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, c10::intrusive_ptr<UnitUse> use) {
    ctx->saved_data["use"] = c10::IValue(std::move(use));
    ctx->set_materialize_grads(false);  // pass undefined gradients through as they are
    // Detached aliases, not the inputs themselves: an input returned as-is
    // would be a view made inside a custom function, which autograd forbids
    // modifying in place (a block starting with relu_ on its input).
    variable_list out;
    out.reserve(inputs.size());
    for (const auto& input : inputs) {
      out.push_back(input.detach());
    }
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    ctx->saved_data["use"].toCustomClass<UnitUse>()->report();
    grads.emplace_back();  // for the token
    return grads;
  }
};

struct LossScaleBoundary : public torch::autograd::Function<LossScaleBoundary> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& tensor, c10::intrusive_ptr<ShardedModel> model) {
    ctx->saved_data["model"] = c10::IValue(std::move(model));
    ctx->saved_data["dtype"] = static_cast<int64_t>(tensor.scalar_type());
    return tensor.scalar_type() == at::kHalf ? tensor.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true)
                                             : tensor.view_as(tensor);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const double scale = ctx->saved_data["model"].toCustomClass<ShardedModel>()->on_output_grad();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    at::Tensor grad = grads[0];
    if (scale != 1.0) {
      grad = grad.to(at::kFloat) * scale;
    }
    return {grad.to(dtype), at::Tensor()};
  }
};

} // namespace

UnitUse::UnitUse(const c10::intrusive_ptr<ShardedModel>& model, int64_t unit, int64_t round)
    : model_(model), unit_(unit), round_(round) {}

UnitUse::~UnitUse() {
  if (!reported_.exchange(true)) {
    if (auto model = model_.lock()) {
      model->defer_use_done(unit_, round_);  // the graph died without a backward through it
    }
  }
}

void UnitUse::report() {
  if (!reported_.exchange(true)) {
    if (auto model = model_.lock()) {
      model->use_done(unit_, round_);
    }
  }
}

std::vector<at::Tensor> track_unit_inputs(const c10::intrusive_ptr<ShardedModel>& model, int64_t unit,
                                          const std::vector<at::Tensor>& inputs) {
  variable_list tracked;
  std::vector<size_t> where;
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (inputs[k].defined() && inputs[k].requires_grad()) {
      tracked.push_back(inputs[k]);
      where.push_back(k);
    }
  }
  if (!at::GradMode::is_enabled()) {
    return inputs;  // no graph: nothing to track
  }
  if (tracked.empty()) {
    model->note_untracked_use(unit);
    return inputs;
  }
  const int64_t round = model->add_pending_use(unit);
  auto use = c10::make_intrusive<UnitUse>(model, unit, round);
  variable_list passed = UnitInputBoundary::apply(at::TensorList(tracked), use);
  std::vector<at::Tensor> out = inputs;
  for (size_t j = 0; j < where.size(); ++j) {
    out[where[j]] = passed[j];
  }
  return out;
}

std::vector<at::Tensor> scale_at_outputs(const c10::intrusive_ptr<ShardedModel>& model,
                                         const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> out;
  out.reserve(outputs.size());
  for (const auto& tensor : outputs) {
    out.push_back(LossScaleBoundary::apply(tensor, model));
  }
  return out;
}

} // namespace zero_ext
