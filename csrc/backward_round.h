#pragma once
// BackwardRound: one backward pass as zero_ext sees it, from the first event
// that reaches the model to the epilogue the engine runs once every node is
// done ([Note: epilogue ownership] in epilogue.h).
//
// The epilogue flushes the buckets not yet launched (missing gradients count
// as zeros), waits in stream order, starts the exchange with the other
// ranks on which parameters got gradients and whether any was non-finite,
// publishes the results provisionally and (stage 3) releases the units.
// settle() reads the exchange later, once per step, and runs a second round
// for late gradients then. An error
// inside it, or inside a gradient hook, leaves this rank's collectives out of
// step with the other ranks': the round is then broken for good, and every
// later entry point refuses to go on, as after a forward of the model that
// raised once its collectives had begun. A backward that raised in the engine
// before its epilogue leaves a stale round, abandoned at the next forward,
// zero_grad or step.

#include <cstdint>
#include <exception>
#include <functional>
#include <string>

#include <ATen/ATen.h>

#include "autograd_hooks.h"
#include "communicator.h"
#include "mesh.h"
#include "epilogue.h"
#include "fault_injection.h"
#include "grad_reducer.h"
#include "layout.h"
#include "param_store.h"
#include "rank_agreement.h"
#include "step_gate.h"
#include "units.h"

namespace zero_ext {

enum class RoundState : int8_t {
  kIdle,         // no backward has reached the model since the last epilogue
  kArmed,        // a backward reached it: its epilogue is queued on the engine
  kSecondRound,  // inside the epilogue, reducing gradients that came late
  kBroken,       // an error left this rank's collectives out of step
};

class BackwardRound {
 public:
  BackwardRound(const Layout& layout, ParamStore& store, GradReducer& reducer, UnitScheduler* units,
                RankAgreement& agreement, StepGate& gate, const GradHooks& hooks, FaultInjector& faults,
                const Mesh& mesh, const Communicator& gather_comm, const Communicator& regather_comm,
                const Communicator& expert_comm);

  RoundState state() const;
  // Queues `epilogue` on the running backward unless one is pending.
  void arm(const std::function<void()>& epilogue) { epilogue_.arm(epilogue); }
  bool armed() const { return epilogue_.pending(); }
  int64_t owner_graph_task() const { return epilogue_.owner_graph_task(); }
  // A gradient passed a forward output's hook: records the graph task, for
  // the fp16 check that the loss went through the outputs.
  void note_output_grad() { output_hook_task_ = current_backward().graph_task_id; }

  // The epilogue's body. `sync`: false under no_sync() (nothing is reduced).
  void run_epilogue(bool sync);
  // [Note: reductions at read]
  // Pipeline stages: torch.distributed.pipelining runs a backward per
  // microbatch (stage_backward calls autograd itself), never says which is
  // the step's last, and then divides each param.grad by the microbatch
  // count. So with reduce_at_read every backward accumulates locally, as
  // under no_sync() (the schedule's division acts on what param.grad holds:
  // the local sum, or stage 0's staging views), and settle(keep), the first
  // read of the step's gradients (optimizer.step(), clip, full_grads), runs
  // the reduction a synced epilogue would have run: one per step whatever
  // the number of microbatches, the bytes of one backward. FSDP2 under a
  // schedule does the same (set_requires_gradient_sync(False), then its
  // post_backward at the schedule's REDUCE_GRAD). Every rank of the group
  // reads at the same call and first agrees whether any rank has gradients
  // to reduce (any_rank_pending): one that ran no backward reduces zeros with
  // the others, as for a parameter some ranks did not use.
  void set_reduce_at_read(bool on) { reduce_at_read_ = on; }
  bool reduce_at_read() const { return reduce_at_read_; }
  // Reads what the ranks agreed on in the backwards since the last read and
  // finishes their gradients: a second round for late ones, the final
  // .grad (None where no rank had a gradient). Collective when `keep`; with
  // `keep` false (zero_grad, a load) only checks that the ranks were in step.
  void settle(bool keep);
  // Abandons a round whose backward raised before its epilogue. Returns
  // whether there was one.
  bool reset_if_stale();
  // zero_grad() is refused while a backward runs.
  void check_not_running() const;

  // Called inside a catch block: remembers the error that left this rank's
  // collectives out of step; check_usable() then refuses to go on.
  void mark_broken();
  // This rank cannot go on: its forward raised after some of its
  // collectives went out ([Note: a forward that raised] in forward_raised_agreement.cpp),
  // or its offload file failed ([Note: an offload file that failed]):
  // check_usable() then raises `report`.
  void mark_unusable(const std::string& report);
  void check_usable() const;

  int64_t epilogues_run() const { return epilogues_run_; }
  int64_t synced_epilogues() const { return synced_epilogues_; }
  int64_t late_rounds() const { return late_rounds_; }
  int64_t last_graph_task() const { return last_graph_task_; }
  bool last_keep_graph() const { return last_keep_graph_; }

 private:
  // The one way a round is dropped. `peers_in_step`: the other ranks issued
  // the same collectives (a backward that raised in the engine), so what is
  // in flight is waited out and units are released; otherwise (this rank
  // broke) nothing waits on collectives the peers may never issue.
  std::exception_ptr abandon(bool peers_in_step);
  bool checks_nonfinite() const;
  // A synced epilogue's reduction: flush the buckets, start the exchange,
  // publish. Inside the epilogue or, at read, outside any backward.
  void reduce_round();
  // [Note: reductions at read]: what the step's backwards accumulated.
  void reduce_at_read_now();
  // Collective over the mesh: whether any rank has gradients to reduce.
  bool any_rank_pending(bool mine);
  // What hybrid backwards kept back from the replicas goes across now
  // ([Note: deferred replica all-reduce] in grad_reducer.h).
  void sync_deferred();

  const Layout& layout_;
  ParamStore& store_;
  GradReducer& reducer_;
  UnitScheduler* units_;  // stage 3 only
  RankAgreement& agreement_;
  StepGate& gate_;
  const GradHooks& hooks_;
  FaultInjector& faults_;
  const Mesh& mesh_;
  const Communicator& comm_;  // the shard group
  const Communicator& gather_comm_;
  const Communicator& regather_comm_;
  const Communicator& expert_comm_;
  Epilogue epilogue_;
  bool in_second_round_ = false;
  std::string broken_;  // first line of the error that broke this rank
  std::string unusable_report_;  // why this rank cannot go on (a forward that raised mid-way, an offload file that failed)
  int64_t output_hook_task_ = -1;  // last graph task whose gradient passed an output hook
  int64_t epilogues_run_ = 0;
  int64_t synced_epilogues_ = 0;
  int64_t late_rounds_ = 0;
  int64_t last_graph_task_ = -1;
  bool last_keep_graph_ = false;
  bool reduce_at_read_ = false;
};

} // namespace zero_ext
