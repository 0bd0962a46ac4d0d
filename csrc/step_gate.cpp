#include "step_gate.h"

#include <sstream>
#include <string>

namespace zero_ext {

std::string Progress::where() const {
  std::ostringstream out;
  // Counted from 0, and said so: "step 5" alone reads as the fifth.
  out << "step " << step_index << " (counted from 0: " << step_index << " optimizer step(s) done), synced backward "
      << synced_in_step << " of the step (counted from 0)";
  return out.str();
}

StepDecision StepGate::decide() {
  StepDecision decision = StepDecision::kStep;
  if (found_nonfinite_ && scaler_.enabled()) {
    decision = StepDecision::kSkipOverflow;
  } else if (found_nonfinite_ && skip_nonfinite_) {
    decision = StepDecision::kSkipNonfinite;
    ++nonfinite_skips_;
  }
  scaler_.update(found_nonfinite_);
  ++progress_.step_index;
  progress_.synced_in_step = 0;
  progress_.deferred_in_step = 0;
  return decision;
}

} // namespace zero_ext
