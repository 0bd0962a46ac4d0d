#include "backward_round.h"

#include <exception>
#include <string>

#include <ATen/ATen.h>
#include <ATen/record_function.h>

namespace zero_ext {

BackwardRound::BackwardRound(const Layout& layout, ParamStore& store, GradReducer& reducer,
                             UnitScheduler* units, RankAgreement& agreement, StepGate& gate,
                             const GradHooks& hooks, FaultInjector& faults, const Mesh& mesh,
                             const Communicator& gather_comm, const Communicator& regather_comm,
                             const Communicator& expert_comm)
    : layout_(layout), store_(store), reducer_(reducer), units_(units), agreement_(agreement), gate_(gate),
      hooks_(hooks), faults_(faults), mesh_(mesh), comm_(mesh.shard()),
      gather_comm_(gather_comm), regather_comm_(regather_comm), expert_comm_(expert_comm) {}

RoundState BackwardRound::state() const {
  if (!broken_.empty() || !unusable_report_.empty()) return RoundState::kBroken;
  if (in_second_round_) return RoundState::kSecondRound;
  return epilogue_.pending() ? RoundState::kArmed : RoundState::kIdle;
}

void BackwardRound::run_epilogue(bool sync) {
  RECORD_USER_SCOPE("zero_ext::epilogue");
  epilogue_.fired();
  const auto info = current_backward();
  last_graph_task_ = info.graph_task_id;
  last_keep_graph_ = info.keep_graph;
  ++epilogues_run_;
  try {
    TORCH_CHECK(!gate_.scaler().enabled() || output_hook_task_ == info.graph_task_id,
                "zero_ext: fp16 loss scaling scales the gradient where it enters the model, at "
                "its forward outputs, and this backward reached the model's parameters without "
                "passing through any of them (a loss built from parameters directly?). Its "
                "gradients would be unscaled wrongly. Compute the loss from the model's outputs, "
                "or pass mixed_precision=zero_ext.MixedPrecision(torch.float16, loss_scale=1.0) "
                "and scale the loss yourself (torch.amp.GradScaler).");
    // no_sync(): nothing to reduce. (A backward that accumulates nothing
    // here, like torch.autograd.grad, never armed the epilogue. Whether to
    // reduce must not depend on what this rank happened to receive, or ranks
    // would disagree on the collectives.)
    if (!sync) {
      hooks_.verify_accumulators();
      reducer_.note_unsynced_backward();
      reducer_.start_round();
      if (units_) units_->release_after_backward(info.keep_graph);
      return;
    }
    reduce_round();
  } catch (...) {
    // Collectives of this backward may be in flight or skipped here while the
    // other ranks go on: this rank's sequence no longer matches theirs.
    in_second_round_ = false;
    mark_broken();
    abandon(/*peers_in_step=*/false);
    throw;
  }
  reducer_.start_round();
  if (units_) units_->release_after_backward(info.keep_graph);
}

void BackwardRound::reduce_round() {
  ++synced_epilogues_;
  gate_.note_synced_backward(reducer_.defers_replica_sync());
  if (faults_.armed()) {
    faults_.maybe_raise("epilogue", gate_.progress().step_index, mesh_.rank());
  }
  reducer_.flush();
  // The exchange is read later (settle(); see [Note: host syncs] in
  // rank_agreement.h): until then every trainable parameter shows a
  // gradient, and late ones wait in param.grad for the next round.
  const bool check_nonfinite = checks_nonfinite();
  agreement_.start(reducer_, units_, check_nonfinite ? reducer_.local_nonfinite() : at::Tensor(),
                   store_.device(), TrainableSignature::of(store_.params()));
  if (check_nonfinite) {
    reducer_.mark_nonfinite_on_device(agreement_.last_nonfinite_sum());
  }
  reducer_.publish(/*provisional=*/true);
  hooks_.verify_accumulators();
  if (!reducer_.late()) {
    reducer_.check_no_unreduced_grads();
  }
}

bool BackwardRound::any_rank_pending(bool mine) {
  // One flag over the mesh, so ranks that ran no backward since the last
  // read (a backward on some data-parallel ranks only) reduce with the
  // others, their gradients zeros, as an unused parameter's are.
  at::Tensor flag = at::full({1}, mine ? 1 : 0, at::TensorOptions().dtype(at::kInt).device(store_.device()));
  try {
    mesh_.all_reduce(flag, /*max=*/true, Purpose::kAgreement, "reduce at read: gradients pending",
                     [] { return std::string("the exchange of whether any rank holds gradients to reduce"); });
  } catch (...) {
    mark_broken();
    throw;
  }
  return flag.item<int>() > 0;
}

void BackwardRound::reduce_at_read_now() {
  RECORD_USER_SCOPE("zero_ext::reduce at read");
  try {
    reduce_round();
  } catch (...) {
    mark_broken();
    abandon(/*peers_in_step=*/false);
    throw;
  }
  reducer_.start_round();
  if (units_) units_->release_held();  // the step's last microbatch is over
}

bool BackwardRound::checks_nonfinite() const {
  return !layout_.ddp_in_place() || gate_.skip_nonfinite();
}

void BackwardRound::settle(bool keep) {
  if (keep && reduce_at_read_ && any_rank_pending(reducer_.adopt_written_grads() || reducer_.unsynced_since_reduce())) {
    reduce_at_read_now();  // [Note: reductions at read]; its exchange is read below
  }
  reducer_.finish_host_adds();  // offload: the host gradients are read next
  if (!agreement_.pending()) {
    if (keep && reducer_.has_deferred()) {
      sync_deferred();
    }
    return;
  }
  try {
    const Agreed agreed = agreement_.settle(reducer_);
    for (int64_t k = 0; k < agreed.nonfinite_backwards; ++k) {
      gate_.note_nonfinite_backward();
    }
    if (!keep) {
      return;  // the gradients are being dropped, late ones with them
    }
    if (agreed.late) {
      // Collective: every rank settles at the same call (a step, clip,
      // full_grads) and read the same flag.
      ++late_rounds_;
      in_second_round_ = true;
      reducer_.rerun_all();
      reducer_.start_round();  // the next backward's round
      in_second_round_ = false;
      if (checks_nonfinite() && agreement_.any_nonfinite(reducer_.local_nonfinite(), store_.device())) {
        gate_.note_nonfinite_backward();
        reducer_.mark_nonfinite_everywhere();
      }
    }
    if (reducer_.has_deferred()) {
      sync_deferred();  // after the check above: the ranks agreed they deferred alike
    }
    if (agreed.nonfinite_backwards > 0) {
      // Where the epilogue could not mark it on the device (offload:
      // mark_nonfinite_on_device), the landed host shard is marked now.
      reducer_.mark_nonfinite_everywhere();
    }
    reducer_.publish(/*provisional=*/false);
    reducer_.check_no_unreduced_grads();
  } catch (...) {
    in_second_round_ = false;
    mark_broken();
    throw;
  }
}

void BackwardRound::sync_deferred() {
  // Collective across replicas: every rank of the mesh settles at the same
  // call (a step, clip, full_grads), with the same buckets kept back.
  try {
    reducer_.sync_deferred();
  } catch (...) {
    mark_broken();
    throw;
  }
}

std::exception_ptr BackwardRound::abandon(bool peers_in_step) {
  std::exception_ptr failure = reducer_.abandon(/*wait=*/peers_in_step);
  epilogue_.reset();
  if (peers_in_step && units_) {
    units_->release_after_backward(false);
  }
  return failure;
}

bool BackwardRound::reset_if_stale() {
  if (!epilogue_.is_stale()) {
    return false;
  }
  // A failed wait is raised after the cleanup: the group is unusable then.
  if (std::exception_ptr failure = abandon(/*peers_in_step=*/true)) {
    std::rethrow_exception(failure);
  }
  return true;
}

void BackwardRound::check_not_running() const {
  TORCH_CHECK(!epilogue_.pending() || epilogue_.is_stale(),
              "zero_ext: zero_grad() was called while a backward is running; call it "
              "between steps");
}

void BackwardRound::mark_broken() {
  try {
    throw;
  } catch (const std::exception& e) {
    const std::string what = e.what();
    broken_ = what.substr(0, what.find('\n'));
  } catch (...) {
    broken_ = "an unknown error";
  }
}

void BackwardRound::mark_unusable(const std::string& report) {
  if (unusable_report_.empty()) {
    unusable_report_ = report;
  }
}

void BackwardRound::check_usable() const {
  TORCH_CHECK(unusable_report_.empty(), unusable_report_);
  // A collective that failed where no call of the user's saw it (a check of
  // the ranks' headers on a completion thread, a prefetch): its cause, as
  // the call that waited on it would have raised it.
  const Communicator* comms[] = {&mesh_.shard(), &mesh_.replica(), &gather_comm_, &regather_comm_,
                                   &expert_comm_};
  for (const Communicator* comm : comms) {
    const std::string report = comm->failure_report();
    TORCH_CHECK(report.empty(), report);
  }
  TORCH_CHECK(!mesh_.failed() && !gather_comm_.failed() && !regather_comm_.failed() && !expert_comm_.failed(),
              "zero_ext: rank ", mesh_.rank(),
              " cannot go on training: an earlier collective of this model failed (see the first "
              "error), so this rank's collectives are out of step with the other ranks'. Restart "
              "every rank from the last checkpoint.");
  TORCH_CHECK(broken_.empty(), "zero_ext: rank ", mesh_.rank(), " cannot go on training: an earlier "
              "error inside zero_ext's gradient hooks or reduction (", broken_, ") left this rank's "
              "collectives out of step with the other ranks', which wait for the ones it skipped "
              "and fail within the process group's timeout. Restart every rank from the last "
              "checkpoint.");
}

} // namespace zero_ext
