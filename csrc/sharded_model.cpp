#include "sharded_model.h"

#include "core_ops.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>

namespace zero_ext {
namespace {

Layout make_layout(const std::vector<at::Tensor>& params, std::vector<std::string> names,
                   std::vector<int64_t> trainable, const std::vector<int64_t>& params_per_bucket,
                   const std::vector<int64_t>& unit_of_bucket, int64_t stage,
                   std::optional<c10::ScalarType> compute_dtype, std::optional<c10::ScalarType> reduce_dtype,
                   bool offload, const Communicator& comm, const std::vector<int64_t>& owner_of_param) {
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : params) shapes.push_back(p.sizes().vec());
  // Stage 0 keeps DDP's layout (param.grad is the reduced buffer) only when
  // gradients are reduced in the parameters' own fp32.
  const bool masters_or_low_precision_reduce =
      compute_dtype.has_value() || offload || reduce_dtype.value_or(at::kFloat) != at::kFloat;
  return Layout(std::move(shapes), std::move(names), std::move(trainable), params_per_bucket, unit_of_bucket,
                stage, grad_layout_for(stage, masters_or_low_precision_reduce), comm.rank(), comm.size(),
                owner_of_param);
}

} // namespace

ShardedModel::ShardedModel(std::vector<at::Tensor> params, std::vector<std::string> names,
                           std::vector<int64_t> trainable, std::vector<int64_t> params_per_bucket,
                           std::vector<int64_t> unit_of_bucket, int64_t stage, std::string group_name,
                           std::string gather_group_name, std::string replica_group_name,
                           std::string regather_group_name, int64_t prefetch,
                           std::optional<c10::ScalarType> compute_dtype,
                           std::optional<c10::ScalarType> reduce_dtype, bool offload, bool deferred,
                           std::vector<int64_t> owner_of_param)
    : issue_counts_(std::make_shared<IssueCounts>()),
      traffic_(std::make_shared<Traffic>()),
      comm_(group_name, GroupSlot::kShard, issue_counts_),
      gather_comm_(stage == 3 ? (gather_group_name.empty() ? group_name : gather_group_name) : std::string(),
                   GroupSlot::kGather, issue_counts_),
      replica_comm_(replica_group_name, GroupSlot::kReplica, issue_counts_),
      regather_comm_(stage == 3 ? regather_group_name : std::string(), GroupSlot::kRegather, issue_counts_),
      mesh_(comm_, replica_comm_),
      layout_(make_layout(params, std::move(names), std::move(trainable), params_per_bucket, unit_of_bucket,
                          stage, compute_dtype, reduce_dtype, offload, comm_, owner_of_param)),
      store_(std::move(params), layout_, mesh_, gate_.progress(), compute_dtype, offload, deferred),
      reducer_(layout_, store_, comm_, replica_comm_, gate_, reduce_dtype),
      units_(layout_.params_sharded()
                 ? std::make_unique<UnitScheduler>(layout_, store_, gather_comm_, regather_comm_, reducer_, gate_,
                                                   prefetch,
                                                   [this] { round_.check_usable(); })
                 : nullptr),
      agreement_(layout_, mesh_, gate_),
      hooks_(store_.params(), layout_, reducer_,
             [this](int64_t i) {
               const at::Tensor& grad = store_.param(i).grad();
               if (grad.defined()) {
                 dispatch::accumulate_grad(self(), i, grad);
               } else {
                 on_grad_ready(i);  // nothing to accumulate; arms the epilogue
               }
             }),
      round_(layout_, store_, reducer_, units_.get(), agreement_, gate_, hooks_, faults_, mesh_, gather_comm_,
             regather_comm_) {
  for (Communicator* comm : {&comm_, &gather_comm_, &replica_comm_, &regather_comm_}) {
    comm->count_traffic_to(traffic_);
  }
}

// --- autograd ----------------------------------------------------------------

c10::intrusive_ptr<ShardedModel> ShardedModel::self() {
  return c10::intrusive_ptr<ShardedModel>::unsafe_reclaim_from_nonowning(this);
}

void ShardedModel::arm_epilogue() {
  if (round_.armed()) {
    return;
  }
  enter_backward_round();
  round_.arm([model = self()]() { dispatch::run_epilogue(model); });
}

void ShardedModel::enter_backward_round() {
  // Once per backward (its epilogue ends it), not per graph task: a
  // reentrant checkpoint's inner backward is no boundary, since buckets and
  // replica all-reduces may go out on either side of it, differently per rank.
  if (in_backward_round_ || current_backward().graph_task_id < 0 || !hooks_.backward_reaches_params()) {
    return;
  }
  in_backward_round_ = true;
  reducer_.allow_frozen_skip(!agreement_.pending());
  begin_round(RoundKind::kBackward);
}

void ShardedModel::begin_round(RoundKind kind, int64_t detail, const std::string& label) {
  const int64_t key = round_key(kind, detail);
  comm_.begin_round(key, label);
  gather_comm_.begin_round(key, label);
  regather_comm_.begin_round(key, label);
  replica_comm_.begin_round(key, label);
}

void ShardedModel::begin_python_round(const std::string& what) {
  begin_round(RoundKind::kPython, static_cast<int64_t>(hash_text(what)), what);
}

void ShardedModel::run_epilogue() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (units_) drain_deferred_uses();
  in_backward_round_ = false;  // what follows is no longer this backward's
  round_.run_epilogue(sync_);
}

void ShardedModel::on_grad_ready(int64_t i) {
  std::lock_guard<std::mutex> lock(mutex_);
  round_.check_usable();
  try {
    arm_epilogue();  // fallback when no forward output was hooked
    if (faults_.armed()) {
      faults_.maybe_raise("grad_hook", gate_.progress().step_index, mesh_.rank());
    }
    const int64_t completed = reducer_.on_grad_ready(i, sync_);
    if (completed >= 0 && units_) {
      units_->on_bucket_complete(completed, round_.owner_graph_task());
    }
  } catch (...) {
    round_.mark_broken();
    throw;
  }
}

void ShardedModel::accumulate_grad(int64_t i, const at::Tensor& grad) {
  check_grad_shape(i, grad);
  at::Tensor& held = store_.param(i).mutable_grad();
  if (!held.is_same(grad)) {
    // What AccumulateGrad does before the hook runs (the hook passes .grad
    // itself): zero_ext's stand-in is dropped, a real gradient summed into.
    if (!held.defined() || reducer_.holds_stand_in(i)) {
      held = grad;
    } else {
      at::NoGradGuard no_grad;
      held.add_(grad);
    }
  }
  on_grad_ready(i);
}

void ShardedModel::check_grad_shape(int64_t i, const at::Tensor& grad) {
  TORCH_CHECK(i >= 0 && i < layout_.num_params(), "zero_ext.accumulate_grad: no parameter ", i, " (the model has ",
              layout_.num_params(), ")");
  const at::Tensor& param = store_.param(i);
  TORCH_CHECK(grad.sizes() == param.sizes(), "zero_ext.accumulate_grad: a gradient of shape ", grad.sizes(),
              " for parameter ", layout_.name(i), " of shape ", param.sizes());
}

double ShardedModel::on_output_grad() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!hooks_.backward_reaches_params()) {
    return 1.0;  // autograd.grad and the like: the caller gets true gradients
  }
  arm_epilogue();
  round_.note_output_grad();
  return gate_.scaler().scale();
}

void ShardedModel::attach_output_hook(const at::Tensor& output) {
  if (!output.requires_grad()) {
    return;
  }
  c10::weak_intrusive_ptr<ShardedModel> weak(c10::intrusive_ptr<ShardedModel>::unsafe_reclaim_from_nonowning(this));
  output.register_hook([weak](const at::Tensor& /*grad*/) {
    if (auto self = weak.lock()) {
      self->on_output_grad();
    }
  });
}

// --- the model's forward ----------------------------------------------------------

void ShardedModel::begin_forward() {
  forward_marks_.push_back(collectives_submitted());  // first: whatever raises from here on, forward_raised pops it
  if (units_) {
    round_.check_usable();  // a broken rank refuses before its root unit, which may still be gathered
  }
  reset_if_stale();
  check_param_shapes();
  if (current_backward().graph_task_id < 0) {  // a checkpoint's recompute stays in its backward's round
    std::lock_guard<std::mutex> lock(mutex_);
    in_backward_round_ = false;  // a backward that raised before its epilogue is over
    const bool grad = at::GradMode::is_enabled();
    begin_round(RoundKind::kForward, grad ? 1 : 0);
  }
  if (units_) {
    dispatch::gather_unit(self(), 0, /*backward=*/false);  // the root unit
  }
}

void ShardedModel::end_forward(std::vector<at::Tensor> outputs) {
  for (const auto& output : outputs) {
    attach_output_hook(output);
  }
  if (units_) {
    dispatch::release_unit(self(), 0, outputs);
  }
  if (!forward_marks_.empty()) {
    forward_marks_.pop_back();  // last: if anything above raised, forward_raised pops it
  }
}

int64_t ShardedModel::collectives_submitted() const {
  return comm_.submitted() + gather_comm_.submitted() + regather_comm_.submitted() + replica_comm_.submitted();
}

// ShardedModel::forward_raised: forward_raised_agreement.cpp ([Note: a forward that raised]).

// --- stage 3 units --------------------------------------------------------------

void ShardedModel::pre_forward(int64_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;  // stages 0-2: parameters are never released
  enter_backward_round();  // a checkpoint's recompute
  drain_deferred_uses();
  units_->pre_forward(u);
}

void ShardedModel::hook_gather(const at::Tensor& output, int64_t u, bool backward) {
  c10::weak_intrusive_ptr<ShardedModel> weak(self());
  output.register_hook([weak, u, backward](const at::Tensor& /*grad*/) {
    if (auto model = weak.lock()) {
      dispatch::gather_unit(model, u, backward);
    }
  });
}

void ShardedModel::hook_regather(std::vector<at::Tensor> outputs, int64_t u) {
  for (const auto& output : outputs) {
    if (output.requires_grad()) {
      hook_gather(output, u, /*backward=*/false);  // inside a backward: gathers only, no prefetch
    }
  }
}

void ShardedModel::post_forward(int64_t u, std::vector<at::Tensor> outputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;
  const bool grad_enabled = at::GradMode::is_enabled();
  if (grad_enabled) {
    for (const auto& output : outputs) {
      if (output.requires_grad()) {
        hook_gather(output, u, /*backward=*/true);
      }
    }
  }
  units_->post_forward(u, grad_enabled, !outputs.empty());
}

void ShardedModel::pre_backward(int64_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;  // stages 0-2: parameters are never released
  enter_backward_round();
  drain_deferred_uses();
  units_->pre_backward(u);
}

int64_t ShardedModel::add_pending_use(int64_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return 0;  // stages 0-2: parameters are never released
  return units_->add_pending_use(u);
}

void ShardedModel::post_backward_use(int64_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;  // stages 0-2: parameters are never released
  drain_deferred_uses();
  if (units_->post_backward_use(u, units_->use_round(), round_.owner_graph_task())) {
    launch_unit_reductions(u);
  }
}

void ShardedModel::use_done(int64_t u, int64_t round) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;
  drain_deferred_uses();
  if (units_->post_backward_use(u, round, round_.owner_graph_task())) {
    launch_unit_reductions(u);
  }
}

void ShardedModel::launch_unit_reductions(int64_t u) {
  // Inside a synced backward that reaches the parameters only: a use
  // reported as its graph dies (drained later), under no_sync() or in
  // torch.autograd.grad launches nothing.
  if (!sync_ || current_backward().graph_task_id < 0 || !hooks_.backward_reaches_params()) {
    return;
  }
  round_.check_usable();
  try {
    arm_epilogue();
    reducer_.launch_buckets(units_->buckets_of(u));
  } catch (...) {
    round_.mark_broken();
    throw;
  }
}

void ShardedModel::defer_use_done(int64_t u, int64_t round) {
  std::lock_guard<std::mutex> lock(deferred_mutex_);
  deferred_uses_.emplace_back(u, round);
  has_deferred_uses_ = true;
}

void ShardedModel::drain_deferred_uses() {
  if (!has_deferred_uses_.load()) {
    return;
  }
  std::vector<std::pair<int64_t, int64_t>> uses;
  {
    std::lock_guard<std::mutex> lock(deferred_mutex_);
    uses.swap(deferred_uses_);
    has_deferred_uses_ = false;
  }
  for (const auto& [u, round] : uses) {
    units_->post_backward_use(u, round, round_.owner_graph_task());
  }
}

void ShardedModel::note_untracked_use(int64_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;  // stages 0-2: parameters are never released
  units_->note_untracked_use(u);
}

void ShardedModel::gather_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;  // stages 0-2: parameters are never released
  begin_round(RoundKind::kInspect);
  units_->gather_all();
}

void ShardedModel::keep_gathered_after_forward(std::vector<int64_t> units) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;  // stages 0-2: parameters are never released
  units_->keep_gathered_after_forward(units);
}

void ShardedModel::reshard_to_subgroup(std::vector<int64_t> units) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;  // stages 0-2: parameters are never released
  units_->reshard_to_subgroup(units);
}

void ShardedModel::set_prefetch(int64_t unit, bool forward, std::vector<int64_t> units) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;  // stages 0-2: parameters are never released
  units_->set_prefetch(unit, forward, units);
}

void ShardedModel::unshard(bool async_op) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;  // stages 0-2: parameters are never released
  begin_round(RoundKind::kInspect, 3);
  units_->start_gather_all();
  if (!async_op) {
    units_->finish_gathers();
  }
}

void ShardedModel::wait_unshard() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;
  units_->finish_gathers();
}

void ShardedModel::gather_units_of(std::vector<int64_t> param_indices) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;  // stages 0-2: parameters are never released
  begin_round(RoundKind::kInspect);
  units_->gather_units_of(param_indices);
}

void ShardedModel::unpin_units_of(std::vector<int64_t> param_indices) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;  // stages 0-2: parameters are never released
  units_->unpin_units_of(param_indices);
}

void ShardedModel::release_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;  // stages 0-2: parameters are never released
  units_->release_all();
}

void ShardedModel::write_back_shards() {
  std::lock_guard<std::mutex> lock(mutex_);
  store_.write_back_shards();
}

// --- loss scaling, non-finite gradients, the step -----------------------------------

void ShardedModel::enable_loss_scaling(double initial_scale, double growth_factor, double backoff_factor,
                                       int64_t growth_interval, double min_scale, int64_t hysteresis,
                                       bool dynamic) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(!layout_.ddp_in_place(), "loss scaling needs fp32 masters");
  // Option values are validated in Python, where the user passes them.
  TORCH_INTERNAL_ASSERT(initial_scale > 0 && growth_factor >= 1 && backoff_factor > 0 && backoff_factor < 1 &&
                        growth_interval > 0 && min_scale > 0 && hysteresis > 0);
  LossScalerOptions options;
  options.initial_scale = initial_scale;
  options.growth_factor = growth_factor;
  options.backoff_factor = backoff_factor;
  options.growth_interval = growth_interval;
  options.min_scale = min_scale;
  options.hysteresis = hysteresis;
  options.dynamic = dynamic;
  gate_.scaler().enable(options);
}

void ShardedModel::disable_loss_scaling() {
  std::lock_guard<std::mutex> lock(mutex_);
  gate_.scaler().disable();
}

double ShardedModel::loss_scale() { return gate_.scaler().scale(); }
bool ShardedModel::loss_scaling() { return gate_.scaler().enabled(); }
bool ShardedModel::found_nonfinite() {
  std::lock_guard<std::mutex> lock(mutex_);
  begin_round(RoundKind::kSettle);
  round_.settle(/*keep=*/true);  // known once the exchanges are read
  return gate_.found_nonfinite();
}

void ShardedModel::note_nonfinite_elsewhere() {
  std::lock_guard<std::mutex> lock(mutex_);
  gate_.note_nonfinite_elsewhere();
}

void ShardedModel::set_skip_nonfinite(bool skip) {
  std::lock_guard<std::mutex> lock(mutex_);
  gate_.set_skip_nonfinite(skip);
}

int64_t ShardedModel::begin_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  round_.check_usable();
  begin_round(RoundKind::kStep);
  round_.settle(/*keep=*/true);  // the one host read of the step
  if (units_) {
    units_->finish_gathers();  // the step writes shards a prefetch may still read
  }
  return static_cast<int64_t>(gate_.decide());
}

void ShardedModel::check_before_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  round_.reset_if_stale();
  round_.settle(/*keep=*/true);
  store_.wait_host_sources_free();  // the optimizer writes the masters next
  hooks_.verify_accumulators();
  for (int64_t i = 0; i < layout_.num_params(); ++i) {
    if (!layout_.trainable(i)) {
      continue;
    }
    TORCH_CHECK(!reducer_.holds_stray_grad(i), "zero_ext: parameter '", layout_.name(i),
                "' holds a gradient in .grad that zero_ext did not reduce: either the last "
                "backward ran under no_sync() (run one backward outside it before step()), or "
                "the gradient bypassed zero_ext's hook (the parameter's .data was replaced "
                "after wrap()).");
    TORCH_CHECK(store_.still_in_place(i), "zero_ext: the storage of parameter '", layout_.name(i),
                "' was replaced after zero_ext.wrap() (param.data = ...), so optimizer "
                "updates can no longer reach it. Change parameters in place "
                "(param.data.copy_(...)) or use zero_ext.load_full_state_dict().");
  }
}

void ShardedModel::refresh_params(bool every_bucket, const std::vector<uint8_t>& only) {
  if (layout_.ddp_in_place()) {
    return;  // the optimizer updated the parameters themselves
  }
  if (units_) {
    // A unit prefetched but not used this step may still be gathering from
    // the shard the refresh writes.
    units_->finish_gathers();
  }
  store_.refresh_compute_copies(every_bucket);
  if (layout_.replicated()) {
    return;  // the shard is the whole bucket
  }
  if (units_) {
    units_->drop_stale();
    return;
  }
  const auto& has_grad = reducer_.global_has_grad();
  store_.all_gather_updated([&](int64_t b) {
    if (every_bucket) return true;
    const BucketShape& shape = layout_.bucket(b);
    // Untouched: the optimizer skipped every parameter in it, on every rank
    // (or, with several optimizers, it holds none of this one's).
    for (int64_t i = shape.first; i < shape.first + shape.count; ++i) {
      if (has_grad[i] && (only.empty() || only[i])) return true;
    }
    return false;
  });
}

void ShardedModel::after_step(std::vector<int64_t> params) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<uint8_t> only;  // empty: every parameter
  if (!params.empty()) {
    only.assign(layout_.num_params(), 0);
    for (int64_t i : params) {
      TORCH_CHECK(i >= 0 && i < layout_.num_params(), "zero_ext internal: parameter index out of range");
      only[i] = 1;
    }
  }
  refresh_params(/*every_bucket=*/false, only);
  if (!layout_.ddp_in_place()) {  // there the optimizer's in-place update bumped them
    const auto& has_grad = reducer_.global_has_grad();
    store_.bump_versions(
        [&](int64_t i) { return layout_.trainable(i) && has_grad[i] && (only.empty() || only[i]); });
  }
}

void ShardedModel::note_compute_copy_written() {
  std::lock_guard<std::mutex> lock(mutex_);
  store_.note_compute_copy_written();
}

std::vector<at::Tensor> ShardedModel::segment_compute_copies() { return store_.segment_compute_copies(); }
void ShardedModel::check_param_shapes() { store_.check_shapes(); }

void ShardedModel::enable_stall_diagnosis(double seconds, double timeout_seconds, std::string key_space,
                                          std::vector<int64_t> shard_mesh_ranks,
                                          std::vector<int64_t> replica_mesh_ranks) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(timeout_seconds > 0, "zero_ext internal: a timeout of ", timeout_seconds, " s");
  // NCCL: the watchdog bounds waits, and a timed wait would block the host;
  // the stores still carry reports, and header waits are host waits.
  const bool timed = comm_.waits_on_host(store_.device().type());
  // How long a rank whose forward raised waits for the others to say where
  // they stopped ([Note: a forward that raised]): with timed waits (gloo) a
  // rank that went on posts its stall, so up to the timeout only matters for a
  // slow rank; without (NCCL) nothing but the others' own raised forwards
  // can answer, and those come within the ranks' skew.
  raised_forward_limit_s_ = timed ? timeout_seconds : std::min(timeout_seconds, std::max(2 * seconds, 10.0));
  const int64_t replicas = replica_comm_.size();
  const int64_t shard_size = comm_.size();
  const int64_t sub = regather_comm_.distributed() ? regather_comm_.size() : 0;
  comm_.enable_stall_diagnosis(seconds, key_space, shard_mesh_ranks, replicas, shard_size, timed, sub);
  gather_comm_.enable_stall_diagnosis(seconds, key_space, shard_mesh_ranks, replicas, shard_size, timed, sub);
  replica_comm_.enable_stall_diagnosis(seconds, key_space, replica_mesh_ranks, replicas, shard_size, timed, sub);
  if (sub > 0) {  // the subgroup: consecutive members of the shard group
    const auto first = shard_mesh_ranks.begin() + comm_.rank() / sub * sub;
    regather_comm_.enable_stall_diagnosis(seconds, key_space, std::vector<int64_t>(first, first + sub), replicas,
                                          shard_size, timed, sub);
  }
}

void ShardedModel::enable_collective_checks(std::string shard_headers, std::string gather_headers,
                                            std::string replica_headers, std::string regather_headers) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto describe = [this](const CollectiveId& id, const std::string& label) {
    return describe_collective(id, label);
  };
  auto progress = [this] { return gate_.progress(); };
  auto order = std::make_shared<SequenceOrder>();
  // Across replicas on gloo, a bucket's all-reduce is submitted when a host
  // poll sees its reduction done, a moment that differs between ranks: it
  // keeps its own group's order only (collective_sequence.h).
  const bool replicas_in_order = !comm_.waits_on_host(store_.device().type());
  comm_.enable_sequence_checks(shard_headers, order, true, describe, progress);
  gather_comm_.enable_sequence_checks(gather_headers, order, true, describe, progress);
  regather_comm_.enable_sequence_checks(regather_headers, order, true, describe, progress);
  replica_comm_.enable_sequence_checks(replica_headers, order, replicas_in_order, describe, progress);
}

void ShardedModel::set_unit_names(std::vector<std::string> names) {
  std::lock_guard<std::mutex> lock(mutex_);
  layout_.set_unit_names(std::move(names));
}

void ShardedModel::set_unit_advice(std::vector<std::string> advice) {
  std::lock_guard<std::mutex> lock(mutex_);
  layout_.set_unit_advice(std::move(advice));
  // Read only by a failing wait or sequence check, after wrap() set it.
  auto advise = [this](const std::string& report) { return layout_.advice_for(report); };
  for (Communicator* comm : {&comm_, &gather_comm_, &regather_comm_, &replica_comm_}) {
    comm->set_advice(advise);
  }
}

std::string ShardedModel::describe_collective(const CollectiveId& id, const std::string& label) const {
  const std::string op = op_name(id.op);
  const bool bucket = id.subject >= 0 && id.subject < layout_.num_buckets();
  auto bucket_text = [&] {
    return bucket ? layout_.describe_bucket(id.subject, "") : "bucket " + std::to_string(id.subject);
  };
  switch (id.purpose) {
    case Purpose::kUnitGather:
      return "the " + op + " of the parameters of " +
             (bucket ? layout_.describe_unit(layout_.bucket(id.subject).unit) : std::string("a unit")) +
             " (bucket " + std::to_string(id.subject) + ")";
    case Purpose::kGradReduce: return "the gradient " + op + " of " + bucket_text();
    case Purpose::kReplicaReduce: return "the " + op + " across replicas of the gradient of " + bucket_text();
    case Purpose::kDeferredSync: return "the " + op + " across replicas of deferred gradients of " + bucket_text();
    case Purpose::kAgreement: return "the exchange of which parameters got gradients";
    case Purpose::kNonfiniteFlag: return "the exchange of the non-finite gradient flag";
    case Purpose::kStepGather: return "the " + op + " of updated parameters of " + bucket_text();
    case Purpose::kInitBroadcast: return "wrap()'s " + op + " of " + bucket_text();
    case Purpose::kMaterialize: return "the " + op + " of initialized parameters of " + bucket_text();
    case Purpose::kMasters: return "the " + op + " of master weights of " + bucket_text();
    case Purpose::kFullGrads: return "the " + op + " of gradients for full_grads() of " + bucket_text();
    case Purpose::kPython: return "the " + op + " for " + (label.empty() ? std::string("a Python call") : label);
    case Purpose::kHeader: break;
  }
  return op + " (" + std::to_string(id.numel) + " elements)";
}

int64_t ShardedModel::stall_queries() const {
  // The groups share one key space; a group of one (a flat world of 1, the
  // rows of an Nx1 mesh) has no store and reads 0.
  return std::max(comm_.stall_queries(), replica_comm_.stall_queries());
}

void ShardedModel::post_whereabouts(int64_t query, bool blocked, std::string where) const {
  comm_.post_whereabouts(query, blocked, where);  // keyed by mesh rank: the same key for both groups
  replica_comm_.post_whereabouts(query, blocked, where);
}

// --- training-loop controls -------------------------------------------------

void ShardedModel::set_sync(bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_ = sync;
}

bool ShardedModel::sync() { return sync_; }

void ShardedModel::set_replica_sync(bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  reducer_.set_replica_sync(sync);
}

bool ShardedModel::replica_sync() { return reducer_.replica_sync(); }

void ShardedModel::set_gradient_divide_factor(double factor) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(factor == 0.0 || (std::isfinite(factor) && factor > 0.0),
              "zero_ext: the gradient divide factor must be a finite number > 0, got ", factor);
  reducer_.set_divide_factor(factor);
}

void ShardedModel::enable_compression(int64_t weight_bits, int64_t grad_bits, int64_t block) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(weight_bits == 0 || weight_bits == 8, "zero_ext: compress_weights quantizes to 8 bits, got ",
              weight_bits);
  TORCH_CHECK(grad_bits == 0 || grad_bits == 8 || grad_bits == 4, "zero_ext: compress_grads quantizes to 8 or 4 bits, got ",
              grad_bits);
  TORCH_CHECK(block >= 2 && block % 2 == 0, "zero_ext: the quantization block must be an even number of elements, got ",
              block);
  TORCH_CHECK(weight_bits == 0 || units_, "zero_ext: compress_weights needs stage 3 (stages 0-2 gather no parameters)");
  TORCH_CHECK(grad_bits == 0 || (!layout_.replicated() && !layout_.ddp_in_place()),
              "zero_ext: compress_grads needs stage 2 or 3 (their reductions are reduce-scatters)");
  if (units_) {
    units_->set_compression(QuantFormat{weight_bits, block});
  }
  reducer_.set_compression(QuantFormat{grad_bits, block});
}

std::vector<int64_t> ShardedModel::traffic() const {
  std::vector<int64_t> out;
  for (const auto& bytes : traffic_->bytes) {
    out.push_back(bytes.load());
  }
  return out;
}

int64_t ShardedModel::residual_bytes() {
  std::lock_guard<std::mutex> lock(mutex_);
  return reducer_.residual_bytes();
}

void ShardedModel::zero_grad(bool set_to_none) {
  std::lock_guard<std::mutex> lock(mutex_);
  round_.check_not_running();
  begin_round(RoundKind::kZeroGrad);
  round_.reset_if_stale();  // never zero buffers a collective may still write
  round_.settle(/*keep=*/false);
  gate_.clear_nonfinite();
  reducer_.zero_grad(set_to_none);
}

bool ShardedModel::reset_if_stale() {
  std::lock_guard<std::mutex> lock(mutex_);
  return round_.reset_if_stale();
}

} // namespace zero_ext

namespace zero_ext {

void ShardedModel::enable_swap(std::string path, bool params, bool optimizer, int64_t threads, int64_t chunk_bytes,
                               int64_t max_writing_bytes, int64_t persist_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!swap_, "zero_ext internal: enable_swap runs once, at wrap()");
  TORCH_CHECK(store_.device().is_cpu(), "zero_ext: offload_*='nvme' for a model on ", store_.device(),
              " is not available in this version; it runs on CPU models (use offload_optimizer='cpu' on an "
              "accelerator)");
  swap_ = std::make_unique<SwapSpace>(std::move(path), threads, chunk_bytes, max_writing_bytes);
  // [Note: an offload file that failed] A read or write of this rank's file
  // failed (a full disk, a failing drive) somewhere inside a forward,
  // backward or step: what this rank holds is no longer what the other ranks
  // expect (a step half done, a gradient not kept), so, as for a forward that
  // raised, it refuses every later entry point and posts the report, which
  // the other ranks' stalled waits raise within the stall interval.
  swap_->on_failure([this](const std::string& error) {
    const std::string first_line = error.substr(0, error.find('\n'));
    const std::string report =
        "zero_ext: rank " + std::to_string(mesh_.rank()) + " cannot go on training: its offload file failed (" +
        first_line + "). Its shards, gradients or optimizer state no longer match the other ranks' step, so every "
        "rank stops with this error instead of waiting out the timeout. Free space on offload_path's file system "
        "(or point offload_path at a healthy drive) and restart every rank from the last checkpoint; checkpoints "
        "saved before are untouched.";
    round_.mark_unusable(report);
    if (mesh_.size() > 1) comm_.post_report(report);
  });
  store_.enable_swap(*swap_, params && layout_.params_sharded(), optimizer, persist_bytes);
  if (optimizer && !layout_.ddp_in_place() && !layout_.replicated()) reducer_.enable_swap(*swap_, persist_bytes);
  swap_->open();
}

bool ShardedModel::swapped() { return swap_ != nullptr; }

void ShardedModel::set_max_live_bytes(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(bytes >= 0, "zero_ext internal: a live budget is a number of bytes");
  if (units_) units_->set_max_live_bytes(bytes);
}

void ShardedModel::check_buckets(const std::vector<int64_t>& buckets) const {
  for (int64_t b : buckets) {
    TORCH_CHECK(b >= 0 && b < layout_.num_buckets(), "zero_ext internal: no bucket ", b);
  }
}

void ShardedModel::swap_in(std::vector<int64_t> buckets) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!swap_) return;
  check_buckets(buckets);
  at::NoGradGuard no_grad;
  for (int64_t b : buckets) {
    store_.prefetch_value(b);  // every read of the batch in flight before the first wait
    reducer_.prefetch_grads(b);
  }
  for (int64_t b : buckets) {
    store_.hold_value(b);
    reducer_.ensure_grads(b);
  }
}

void ShardedModel::swap_prefetch(std::vector<int64_t> buckets) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!swap_) return;
  check_buckets(buckets);
  for (int64_t b : buckets) {
    store_.prefetch_value(b);
    reducer_.prefetch_grads(b);
  }
}

void ShardedModel::swap_out(std::vector<int64_t> buckets, bool stepped, bool grads_dirty) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!swap_) return;
  check_buckets(buckets);
  for (int64_t b : buckets) {
    store_.unhold_value(b, stepped);
    reducer_.park_grads(b, grads_dirty);
  }
}

void ShardedModel::swap_drain() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (swap_) swap_->drain();
}

void ShardedModel::swap_in_grads(std::vector<int64_t> buckets) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!swap_) return;
  check_buckets(buckets);
  at::NoGradGuard no_grad;
  for (int64_t b : buckets) reducer_.prefetch_grads(b);
  for (int64_t b : buckets) reducer_.ensure_grads(b);
}

void ShardedModel::swap_out_grads(std::vector<int64_t> buckets, bool dirty) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!swap_) return;
  check_buckets(buckets);
  for (int64_t b : buckets) reducer_.park_grads(b, dirty);
}

c10::Dict<std::string, int64_t> ShardedModel::swap_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  c10::Dict<std::string, int64_t> out;
  if (!swap_) return out;
  out.insert("file_bytes", swap_->file_bytes());
  out.insert("bytes_written", swap_->bytes_written());
  out.insert("bytes_read", swap_->bytes_read());
  out.insert("resident_bytes", swap_->resident_bytes());
  out.insert("peak_resident_bytes", swap_->peak_resident_bytes());
  out.insert("io_buffer_bytes", swap_->io_buffer_bytes());
  out.insert("slots", swap_->num_slots());
  return out;
}

void ShardedModel::swap_reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (swap_) swap_->reset_peak();
}

void ShardedModel::swap_fail_writes_after(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(swap_, "zero_ext internal: no offload file");
  swap_->fail_writes_after(bytes);
}

} // namespace zero_ext
