#pragma once
// GradientRoute: how the parameter gradients of a model's next backward
// reach zero_ext, which compiled autograd asks before it traces that
// backward ([Note: compiled autograd] in sharded_model_graph.cpp).
//
// A forward zero_ext ran eagerly leaves them for the C++ hooks on the
// parameters' AccumulateGrad nodes; one in a graph torch.compile traced hands
// each over inside its compiled backward (grad_arrived), and one traced with
// compiled autograd on reads the parameters detached (hand_over_grad): their
// AccumulateGrad nodes get nothing. The route of a backward is that of the
// forwards with grad since the last backward's epilogue; a backward over a
// retained graph (no forward since) keeps the route of the one before it.

#include <mutex>

namespace zero_ext {

class GradientRoute {
 public:
  enum class Forward { kEager, kGraph, kDetached };

  void note_forward(Forward kind) {
    std::lock_guard<std::mutex> lock(mutex_);
    since_ |= bit(kind);
  }
  void note_backward_over() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (since_ != 0) {
      last_ = since_;
      since_ = 0;
    }
  }
  // The kinds of forward the next backward is over (bits of Forward); 0: none
  // yet, or the model is gone.
  unsigned for_next_backward() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return since_ != 0 ? since_ : last_;
  }
  void detach() {
    std::lock_guard<std::mutex> lock(mutex_);
    since_ = last_ = 0;
  }
  static unsigned bit(Forward kind) { return 1u << static_cast<unsigned>(kind); }

 private:
  mutable std::mutex mutex_;
  unsigned since_ = 0;
  unsigned last_ = 0;
};

} // namespace zero_ext
