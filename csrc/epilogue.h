#pragma once
// The backward epilogue: work that must run once after the autograd engine has
// executed every node of a backward, whatever form that backward took
// (loss.backward(), tensor.backward(g), torch.autograd.backward([...])).
//
// [Note: epilogue ownership]
// The engine runs callbacks queued with queue_callback() when the *current*
// graph task finishes. A reentrant activation checkpoint runs an inner graph
// task inside the outer one, and its callbacks fire early. So an Epilogue is
// armed from the first event of a backward that reaches the model (a hook on
// the forward outputs, else the first gradient hook) and stays owned by that
// graph task: later events from nested tasks see it pending and do nothing.
// If a node throws, the engine runs no callback: the owner resets stale state
// at the next forward or step (see is_stale()).

#include <cstdint>
#include <functional>
#include <vector>

namespace zero_ext {

struct BackwardInfo {
  int64_t graph_task_id = -1;  // -1: not inside a backward
  bool keep_graph = false;     // retain_graph=True (or create_graph=True)
};

// Reads the running backward from the engine's thread-local graph task.
// Outside a backward the engine reports keep_graph=true; we report false there.
BackwardInfo current_backward();

// Whether the running backward will execute any of these nodes. False for
// torch.autograd.grad(...) and backward(inputs=...) that leave them out:
// those accumulate nothing, so they must not start a reduction.
bool current_backward_executes_any(const std::vector<const void*>& nodes);
// Whether the running backward runs every node it reaches (loss.backward(),
// not torch.autograd.grad or backward(inputs=...)).
bool current_backward_accumulates_all();

class Epilogue {
 public:
  // Arms `fn` on the running backward unless one is already pending.
  // Returns false (and does nothing) outside a backward.
  bool arm(const std::function<void()>& fn);
  // Called first thing by the callback itself.
  void fired() { pending_ = false; }
  bool pending() const { return pending_; }
  // Pending, but no backward is running: the owning backward threw.
  bool is_stale() const;
  void reset() { pending_ = false; }
  int64_t owner_graph_task() const { return owner_; }

 private:
  bool pending_ = false;
  int64_t owner_ = -1;
};

} // namespace zero_ext
