#pragma once
// Test-only fault injection: raise inside the gradient hook or the epilogue
// on one rank, to test that the other ranks learn of it within seconds. Off
// unless a test calls ShardedModel.set_test_fault (zero_ext/tools/faults.py).

#include <cstdint>
#include <string>

#include <c10/util/Exception.h>

namespace zero_ext {

class FaultInjector {
 public:
  // point: "grad_hook" or "epilogue"; step: only at that optimizer step (-1: any).
  void arm(const std::string& point, int64_t step) {
    point_ = point;
    step_ = step;
  }
  bool armed() const { return !point_.empty(); }
  void maybe_raise(const char* point, int64_t step_index, int64_t rank) {
    if (point_ != point || (step_ >= 0 && step_ != step_index)) {
      return;
    }
    point_.clear();  // once
    TORCH_CHECK(false, "zero_ext test fault: raised in ", point, " on rank ", rank, " at step ", step_index,
                " (ZERO_EXT_TEST_FAULT)");
  }

 private:
  std::string point_;
  int64_t step_ = -1;
};

} // namespace zero_ext
