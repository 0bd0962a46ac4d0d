#pragma once
// RankAgreement: the one small all-reduce per synced backward that makes the
// ranks agree on what happened, and checks that they are in step.
//
// Each rank contributes which parameters got a gradient here (the sum says
// which got one anywhere: the ones the optimizer steps), whether a gradient
// came late (a second round runs), whether its reduced shard is non-finite,
// and a row of its own with where it is (step, synced backward, stage 3
// gathers per unit): the sum hands every rank every row, so all of them see
// the same divergence and raise alike instead of pairing mismatched
// collectives.

#include <cstdint>

#include <ATen/ATen.h>

#include "communicator.h"
#include "grad_reducer.h"
#include "layout.h"
#include "step_gate.h"
#include "units.h"

namespace zero_ext {

class RankAgreement {
 public:
  RankAgreement(const Layout& layout, Communicator& comm, const StepGate& gate);

  // Collective. Updates the reducer's global gradient mask and late flag;
  // returns whether any rank's reduced shard is non-finite. `nonfinite`: this
  // rank's 0-dim flag on the parameters' device (undefined: not checked).
  bool exchange(GradReducer& reducer, UnitScheduler* units, const at::Tensor& nonfinite,
                const c10::Device& device);
  // Collective: whether any rank's flag is set (after a late second round).
  bool any_nonfinite(const at::Tensor& nonfinite, const c10::Device& device);

 private:
  void check_in_step(const float* rows, int64_t width) const;

  const Layout& layout_;
  Communicator& comm_;
  const StepGate& gate_;
};

} // namespace zero_ext
