#pragma once
// StepGate: whether an optimizer step goes ahead, and where training is.
//
// Non-finite gradients are found once per synced backward (a flag that rides
// the gradient-mask exchange, see rank_agreement.h), so every rank decides
// alike. A step is skipped when some rank's gradient was non-finite and fp16
// loss scaling (which then lowers its scale) or skip_nonfinite is on.

#include <cstdint>
#include <string>

#include "loss_scaler.h"

namespace zero_ext {

enum class StepDecision : int8_t {
  kStep,
  kSkipOverflow,   // fp16 loss scaling: the scale overflowed; it is lowered
  kSkipNonfinite,  // skip_nonfinite=True: an fp32/bf16 gradient held inf/nan
};

// Where this rank is, for error messages and the divergence check.
struct Progress {
  int64_t step_index = 0;      // optimizer steps taken
  int64_t synced_in_step = 0;  // synced backwards since the last step
  int64_t deferred_in_step = 0;  // of those, hybrid ones that kept the replica all-reduce back
  std::string where() const;   // "step N, synced backward K of the step"
};

class StepGate {
 public:
  LossScaler& scaler() { return scaler_; }
  const LossScaler& scaler() const { return scaler_; }
  const Progress& progress() const { return progress_; }

  void set_skip_nonfinite(bool skip) { skip_nonfinite_ = skip; }
  bool skip_nonfinite() const { return skip_nonfinite_; }

  // A synced backward's reduction starts (counted for the divergence check);
  // `deferred`: without the all-reduce across replicas ([Note: deferred
  // replica all-reduce] in grad_reducer.h).
  void note_synced_backward(bool deferred) {
    ++progress_.synced_in_step;
    progress_.deferred_in_step += deferred ? 1 : 0;
  }
  // Some rank's reduced gradient of this backward held inf/nan.
  void note_nonfinite_backward() {
    found_nonfinite_ = true;
    ++nonfinite_backwards_;
  }
  // Another group's gradients were non-finite (a tensor-parallel model's
  // other tp ranks: zero_ext/groups/tensor_parallel.py), so this step is
  // decided as theirs.
  void note_nonfinite_elsewhere() { found_nonfinite_ = true; }
  // Since the last zero_grad().
  bool found_nonfinite() const { return found_nonfinite_; }
  void clear_nonfinite() { found_nonfinite_ = false; }

  // Once per optimizer.step(): the decision; updates the loss scale and
  // moves to the next step.
  StepDecision decide();

  int64_t nonfinite_backwards() const { return nonfinite_backwards_; }
  int64_t skipped_steps() const { return scaler_.skipped_steps() + nonfinite_skips_; }

 private:
  LossScaler scaler_;
  Progress progress_;
  bool found_nonfinite_ = false;
  bool skip_nonfinite_ = false;
  int64_t nonfinite_backwards_ = 0;
  int64_t nonfinite_skips_ = 0;
};

} // namespace zero_ext
