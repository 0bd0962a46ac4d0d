#pragma once
// RankAgreement: the one small all-reduce per synced backward that makes the
// ranks agree on what happened, and checks that they are in step.
//
// Each rank contributes which parameters got a gradient here (the sum says
// which got one anywhere: the ones the optimizer steps), whether a gradient
// came late (a second round runs), whether its reduced shard is non-finite,
// and a row of its own with where it is (step, synced backward, which
// parameters require grad, stage 3 gathers per unit): the sum hands every
// rank every row, so all of them see the same divergence and raise alike
// instead of pairing mismatched collectives.
//
// [Note: host syncs]
// The exchange is issued in the backward's epilogue and read on the host
// only when something needs it: the optimizer step, zero_grad, full_grads,
// clip_grad_norm_ or a load (settle()). Every exchange since the last read is
// copied to the host at once, so a step with any number of backward passes
// costs one host sync, and none falls inside a backward. What has to happen
// before then stays on the device: a non-finite gradient on any rank poisons
// one element of every rank's shard (mark_nonfinite_on_device), so a check
// that reads only local gradients (torch.amp.GradScaler's) agrees
// everywhere. Divergence is reported at that read, not in the backward.

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "communicator.h"
#include "grad_reducer.h"
#include "layout.h"
#include "mesh.h"
#include "step_gate.h"
#include "units.h"

namespace zero_ext {

// Which parameters require grad on this rank now: their count and a 23-bit
// hash of the flags (both exact in a float). requires_grad may change between
// steps (freeze or unfreeze after wrap); a change on some ranks only would
// average the others' gradients with zeros, so the rows of every exchange
// carry it and the read refuses ranks that differ.
struct TrainableSignature {
  int64_t count = 0;
  int64_t hash = 0;
  static TrainableSignature of(const std::vector<at::Tensor>& params);
};

// What the exchanges since the last read said, once read.
struct Agreed {
  bool late = false;                // the last backward left late gradients on some rank
  int64_t nonfinite_backwards = 0;  // backwards whose reduced gradient was non-finite on some rank
};

class RankAgreement {
 public:
  // Over every rank of the mesh: rows are indexed by mesh rank, and the sum
  // runs within the shard group, then across replicas ([Note: hybrid sharding]).
  RankAgreement(const Layout& layout, const Mesh& mesh, const StepGate& gate);

  // Collective: issues this backward's exchange. `nonfinite`: this rank's
  // 0-dim flag on the parameters' device (undefined: not checked). No host
  // sync (the mask goes up from pinned memory).
  // `trainable`: this rank's parameters that require grad now (see
  // TrainableSignature), compared across ranks at the read.
  void start(const GradReducer& reducer, UnitScheduler* units, const at::Tensor& nonfinite,
             const c10::Device& device, const TrainableSignature& trainable);
  // Sum over ranks of the last exchange's non-finite flag, on the device,
  // ordered after the exchange (a stream wait under NCCL).
  at::Tensor last_nonfinite_sum();
  bool pending() const { return !pending_.empty(); }
  int64_t host_reads() const { return host_reads_; }  // settle() calls that read anything
  // Reads every pending exchange (one host sync), checks that the ranks
  // were in step (raises if not) and updates the reducer's global gradient
  // mask.
  Agreed settle(GradReducer& reducer);
  // Collective: whether any rank's flag is set (after a late second round).
  bool any_nonfinite(const at::Tensor& nonfinite, const c10::Device& device);

 private:
  struct Exchange {
    c10::intrusive_ptr<c10d::Work> work;          // within the shard group
    bool replica_pending = false;                 // hybrid: the sum across replicas is not issued yet
    c10::intrusive_ptr<c10d::Work> replica_work;
    at::Tensor values;  // on the parameters' device
    bool waited = false;
  };
  void wait(Exchange& exchange);
  void issue_across_replicas(Exchange& exchange);
  std::string describe() const;
  void check_in_step(const float* rows, int64_t width) const;

  const Layout& layout_;
  const Mesh& mesh_;
  const StepGate& gate_;
  std::vector<Exchange> pending_;
  int64_t width_ = 0;  // row width of the pending exchanges
  int64_t host_reads_ = 0;
};

} // namespace zero_ext
