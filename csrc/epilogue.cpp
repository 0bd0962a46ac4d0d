#include "epilogue.h"

#include <functional>
#include <vector>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>

namespace zero_ext {

BackwardInfo current_backward() {
  BackwardInfo info;
  info.graph_task_id = torch::autograd::get_current_graph_task_id();
  info.keep_graph =
      info.graph_task_id >= 0 && torch::autograd::get_current_graph_task_keep_graph();
  return info;
}

bool current_backward_executes_any(const std::vector<const void*>& nodes) {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info == nullptr || exec_info->empty()) {
    return true;  // a plain backward runs every node it reaches
  }
  for (const void* node : nodes) {
    auto it = exec_info->find(static_cast<torch::autograd::Node*>(const_cast<void*>(node)));
    // Captured-only leaves (autograd.grad) are not executed: only needed_ counts.
    if (it != exec_info->end() && it->second.needed_) {
      return true;
    }
  }
  return false;
}

bool current_backward_accumulates_all() {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  return exec_info == nullptr || exec_info->empty();
}

bool Epilogue::arm(const std::function<void()>& fn) {
  if (pending_) {
    return true;
  }
  const auto info = current_backward();
  if (info.graph_task_id < 0) {
    return false;
  }
  pending_ = true;
  owner_ = info.graph_task_id;
  torch::autograd::Engine::get_default_engine().queue_callback(fn);
  return true;
}

bool Epilogue::is_stale() const {
  return pending_ && torch::autograd::get_current_graph_task_id() < 0;
}

} // namespace zero_ext
