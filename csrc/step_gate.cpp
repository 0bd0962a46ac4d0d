#include "step_gate.h"

#include <sstream>
#include <string>

namespace zero_ext {

std::string Progress::where() const {
  std::ostringstream out;
  out << "step " << step_index << ", synced backward " << synced_in_step << " of the step";
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
