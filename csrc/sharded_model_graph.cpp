// ShardedModel's entry points for a graph torch.compile traced (the ops of
// zero_ext/runtime/compiled_forward.py and compiled_units.py, registered in
// core_ops.cpp): the model's forward in a graph, stage 3's parameter reads,
// and the gradients a compiled backward hands over.
#include "sharded_model.h"

#include <mutex>

#include "epilogue.h"

namespace zero_ext {

void ShardedModel::begin_graph_forward(bool grad, bool detached_reads) {
  open_forward(grad, detached_reads ? GradientRoute::Forward::kDetached : GradientRoute::Forward::kGraph);
  if (units_) {
    std::lock_guard<std::mutex> lock(mutex_);
    units_->begin_graph_forward();
  }
}

void ShardedModel::end_graph_forward() {
  if (units_) {
    std::lock_guard<std::mutex> lock(mutex_);
    units_->end_graph_forward();
  }
  if (!forward_marks_.empty()) {
    forward_marks_.pop_back();
  }
}

at::Tensor ShardedModel::gathered_param(int64_t param_index) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(units_, "zero_ext.gathered_param: this model's parameters are not sharded (stages 0-2 keep them "
              "whole); the op is for stage 3 graphs");
  TORCH_CHECK(param_index >= 0 && param_index < layout_.num_params(), "zero_ext.gathered_param: no parameter ",
              param_index, " (the model has ", layout_.num_params(), "); recompile after wrapping the model again");
  enter_backward_round();  // a read in the backward graph (recomputed)
  drain_deferred_uses();
  const bool in_backward = current_backward().graph_task_id >= 0;
  const int64_t unit = layout_.bucket(layout_.bucket_of(param_index)).unit;
  units_->gather_for_graph(unit, in_backward);
  at::Tensor value = store_.param(param_index).clone(at::MemoryFormat::Contiguous);
  units_->after_graph_read(unit);
  return value;
}

// [Note: gradients handed over in the graph]
// A compiled backward is one autograd node: the engine accumulates its
// parameter gradients, and zero_ext's hooks see them, only once the whole
// graph has run, so no reduction could overlap the backward's compute. In a
// graph each read of a parameter is an autograd function
// (zero_ext/runtime/compiled_units.py) whose backward calls grad_arrived with
// that read's gradient: zero_ext takes it there, as its hook takes one from
// AccumulateGrad, and a bucket goes out once complete (at stage 3 too, where
// eagerly a unit's backward being over launches its buckets: a graph reads
// each parameter once per forward, compiled_units.py, so a complete bucket
// is final). The graph returns zeros in its place, which the engine's
// AccumulateGrad would add: dropped (GradHooks::mark_taken), unless the
// engine summed them with the gradient of a use of the parameter outside
// the graph (eager code reading the parameter itself), which is then
// accumulated and reaches zero_ext as eagerly. Where
// the running backward does not accumulate into this parameter
// (torch.autograd.grad captures its gradient), it is not zero_ext's: passed
// on untouched (a copy: the graph may reuse the memory of its own tensors).
// What zero_ext keeps in param.grad (no_sync(), a gradient after its bucket
// went out) is a copy too.
at::Tensor ShardedModel::grad_arrived(int64_t param_index, const at::Tensor& grad) {
  check_grad_shape(param_index, grad);
  if (!layout_.trainable(param_index) || !hooks_.accumulates(param_index)) {
    return grad.clone(at::MemoryFormat::Contiguous);  // the fake kernel's strides
  }
  take_graph_grad(param_index, grad);
  // Zeros as what autograd passes on: the engine sums them with the
  // gradient of any use of the parameter outside the graph, which stays the
  // parameter's. Not zeros expanded from one scalar, which would need no
  // memory: a compiler checks the strides against the fake kernel's, and the
  // copy autograd.grad gets (above) is contiguous.
  at::Tensor returned = at::zeros_like(grad, at::MemoryFormat::Contiguous);
  hooks_.mark_taken(param_index, returned);
  return returned;
}

void ShardedModel::take_graph_grad(int64_t param_index, const at::Tensor& grad) {
  accumulate_grad(param_index, grad, /*launch_complete=*/true);
  at::Tensor& held = store_.param(param_index).mutable_grad();
  if (held.defined() && held.is_same(grad)) {
    held = grad.clone();
  }
}

// [Note: compiled autograd]
// Compiled autograd (torch._dynamo.config.compiled_autograd) traces a whole
// backward into one graph and runs that instead of the engine. Two things in
// it do not meet zero_ext's eager design (measured on torch 2.13):
// - callbacks queued on the graph task (Engine::queue_callback, the eager
//   epilogue's trigger) never run: the engine returns from the compiled
//   graph without its post-processing;
// - AccumulateGrad becomes a write to param.grad that Dynamo replays after
//   the graph, so what zero_ext writes into .grad during the backward (or
//   the stand-ins after it) would be overwritten by the graph's own value.
// So a forward traced while compiled autograd is on (zero_ext/runtime/
// compiled_units.py) reads each parameter detached: no AccumulateGrad of a
// parameter is in the backward at all. Its read's backward hands the
// gradient over (hand_over_grad, as grad_arrived does) and returns a token,
// a zero scalar, as the gradient of the model's anchor, one CPU scalar leaf
// that every read takes as an input. The anchor's hook runs once all of its
// tokens arrived, that is after every read's gradient was handed over, and
// calls backward_over, which runs the epilogue the backward armed (the
// compiled graph's output boundary, backward_begins). zero_ext's C++ hooks
// on the parameters' accumulators are never reached then; a backward that
// reaches them under compiled autograd (its forward ran eagerly) is refused
// (autograd_hooks.cpp). The cost: torch.autograd.grad with respect to the
// parameters of such a forward finds them unused.
void ShardedModel::hand_over_grad(int64_t param_index, const at::Tensor& grad) {
  check_grad_shape(param_index, grad);
  if (layout_.trainable(param_index) && current_backward_accumulates_all()) {
    take_graph_grad(param_index, grad);
  }
}

void ShardedModel::backward_over() {
  if (round_.armed() && current_backward().graph_task_id == round_.owner_graph_task()) {
    run_epilogue();
  }
}

} // namespace zero_ext
