#pragma once
// C++ autograd nodes zero_ext puts around a model's tensors in forward, so
// that its backward runs no Python at all (stage 3 and fp16 included).
//
//   unit input boundary  inserted over a stage 3 unit's inputs that require
//                        grad; its backward runs once the gradients of all of
//                        them are complete: that use of the unit is over
//                        ([Note: when a unit's backward is over] in units.cpp).
//                        If the graph is dropped without a backward, its
//                        UnitUse token reports the use over when it dies.
//   loss-scale boundary  fp16: between the model and each floating tensor it
//                        returns; its backward multiplies the gradient
//                        entering the model by the loss scale, in fp32 before
//                        the cast back to fp16 where small gradients would
//                        already have underflowed. One node per returned
//                        tensor, so a returned tensor that other returned
//                        tensors were computed from is not scaled twice.

#include <atomic>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/custom_class.h>

#include "sharded_model.h"

namespace zero_ext {

// One grad-enabled forward of a stage 3 unit whose inputs require grad
// (torch.classes.zero_ext.UnitUse: an IValue the boundary node can hold).
class UnitUse : public torch::CustomClassHolder {
 public:
  // round: the use-tracking round it was counted in (see UnitScheduler::use_round).
  UnitUse(const c10::intrusive_ptr<ShardedModel>& model, int64_t unit, int64_t round);
  ~UnitUse() override;
  // The boundary's backward ran: report the use over, once.
  void report();

 private:
  c10::weak_intrusive_ptr<ShardedModel> model_;
  int64_t unit_;
  int64_t round_;
  std::atomic<bool> reported_{false};
};

// The unit's inputs, passed through a unit input boundary (those requiring
// grad; the rest unchanged).
std::vector<at::Tensor> track_unit_inputs(const c10::intrusive_ptr<ShardedModel>& model, int64_t unit,
                                          const std::vector<at::Tensor>& inputs);
// Each tensor through its own loss-scale boundary (fp16 outputs become fp32).
std::vector<at::Tensor> scale_at_outputs(const c10::intrusive_ptr<ShardedModel>& model,
                                         const std::vector<at::Tensor>& outputs);

} // namespace zero_ext
