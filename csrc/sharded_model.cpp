#include "sharded_model.h"

#include "core_ops.h"
#include "reusable_blocks.h"

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
                   bool offload, const Communicator& comm, const std::vector<int64_t>& owner_of_param,
                   const std::vector<int64_t>& expert_buckets, const Communicator& expert_comm) {
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : params) shapes.push_back(p.sizes().vec());
  // Stage 0 keeps DDP's layout (param.grad is the reduced buffer) only when
  // gradients are reduced in the parameters' own fp32.
  const bool masters_or_low_precision_reduce =
      compute_dtype.has_value() || offload || reduce_dtype.value_or(at::kFloat) != at::kFloat;
  return Layout(std::move(shapes), std::move(names), std::move(trainable), params_per_bucket, unit_of_bucket,
                stage, grad_layout_for(stage, masters_or_low_precision_reduce), comm.rank(), comm.size(),
                owner_of_param, ExpertGroup{expert_buckets, expert_comm.rank(), expert_comm.size()});
}

} // namespace

ShardedModel::ShardedModel(std::vector<at::Tensor> params, std::vector<std::string> names,
                           std::vector<int64_t> trainable, std::vector<int64_t> params_per_bucket,
                           std::vector<int64_t> unit_of_bucket, std::vector<int64_t> owner_of_param,
                           c10::intrusive_ptr<CoreConfig> config)
    : issue_counts_(std::make_shared<IssueCounts>()),
      traffic_(std::make_shared<Traffic>()),
      comm_(config->shard_group, GroupSlot::kShard, issue_counts_),
      gather_comm_(config->stage == 3 ? (config->gather_group.empty() ? config->shard_group : config->gather_group)
                                      : std::string(),
                   GroupSlot::kGather, issue_counts_),
      replica_comm_(config->replica_group, GroupSlot::kReplica, issue_counts_),
      regather_comm_(config->stage == 3 ? config->regather_group : std::string(), GroupSlot::kRegather, issue_counts_),
      expert_comm_(config->expert_group, GroupSlot::kExpert, issue_counts_),
      mesh_(comm_, replica_comm_),
      layout_(make_layout(params, std::move(names), std::move(trainable), params_per_bucket, unit_of_bucket,
                          config->stage, parse_config_dtype(config->compute_dtype),
                          parse_config_dtype(config->reduce_dtype), config->offload, comm_, owner_of_param,
                          config->expert_buckets, expert_comm_)),
      store_(std::move(params), layout_, mesh_, expert_comm_, gate_.progress(), parse_config_dtype(config->compute_dtype),
             config->offload, config->deferred),
      reducer_(layout_, store_, comm_, replica_comm_, expert_comm_, gate_, parse_config_dtype(config->reduce_dtype)),
      units_(layout_.params_sharded()
                 ? std::make_unique<UnitScheduler>(layout_, store_, gather_comm_, regather_comm_, expert_comm_, reducer_,
                                                   gate_,
                                                   config->prefetch,
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
             regather_comm_, expert_comm_) {
  for (Communicator* comm : {&comm_, &gather_comm_, &replica_comm_, &regather_comm_, &expert_comm_}) {
    comm->count_traffic_to(traffic_);
  }
  apply_config(*config);
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
  // Unless it ran already: a forward traced with compiled autograd on ends
  // its backward inside the graph ([Note: compiled autograd] in
  // sharded_model_graph.cpp), and its backward may be the engine's after all.
  round_.arm([model = self()]() {
    if (model->round_.armed()) {
      dispatch::run_epilogue(model);
    }
  });
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
  expert_comm_.begin_round(key, label);
}

void ShardedModel::begin_python_round(const std::string& what) {
  begin_round(RoundKind::kPython, static_cast<int64_t>(hash_text(what)), what);
}

void ShardedModel::run_epilogue() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (units_) drain_deferred_uses();
  in_backward_round_ = false;  // what follows is no longer this backward's
  hooks_.route().note_backward_over();
  round_.run_epilogue(reduces_in_backward());
}

void ShardedModel::on_grad_ready(int64_t i, bool launch_complete) {
  std::lock_guard<std::mutex> lock(mutex_);
  round_.check_usable();
  try {
    arm_epilogue();  // fallback when no forward output was hooked
    if (faults_.armed()) {
      faults_.maybe_raise("grad_hook", gate_.progress().step_index, mesh_.rank());
    }
    const int64_t completed = reducer_.on_grad_ready(i, reduces_in_backward());
    if (completed >= 0 && units_) {
      units_->on_bucket_complete(completed, round_.owner_graph_task());
      if (launch_complete && reduces_in_backward()) {
        reducer_.launch_buckets({completed});
      }
    }
  } catch (...) {
    round_.mark_broken();
    throw;
  }
}

void ShardedModel::accumulate_grad(int64_t i, const at::Tensor& grad, bool launch_complete) {
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
  on_grad_ready(i, launch_complete);
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
  on_gradient(output, [weak] {
    if (auto self = weak.lock()) {
      self->on_output_grad();
    }
  });
}

// --- the model's forward ----------------------------------------------------------

void ShardedModel::begin_forward() {
  open_forward(at::GradMode::is_enabled(), GradientRoute::Forward::kEager);
  if (units_) {
    dispatch::gather_unit(self(), 0, /*backward=*/false);  // the root unit
  }
}

void ShardedModel::open_forward(bool grad, GradientRoute::Forward kind) {
  forward_marks_.push_back(collectives_submitted());  // first: whatever raises from here on, forward_raised pops it
  if (grad && current_backward().graph_task_id < 0) {
    hooks_.route().note_forward(kind);
  }
  if (units_) {
    round_.check_usable();  // a broken rank refuses before its root unit, which may still be gathered
  }
  reset_if_stale();
  check_param_shapes();
  if (current_backward().graph_task_id < 0) {  // a checkpoint's recompute stays in its backward's round
    std::lock_guard<std::mutex> lock(mutex_);
    in_backward_round_ = false;  // a backward that raised before its epilogue is over
    begin_round(RoundKind::kForward, grad ? 1 : 0);
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
  return comm_.submitted() + gather_comm_.submitted() + regather_comm_.submitted() + replica_comm_.submitted() +
         expert_comm_.submitted();
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
  on_gradient(output, [weak, u, backward] {
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
  if (!reduces_in_backward() || current_backward().graph_task_id < 0 || !hooks_.backward_reaches_params()) {
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
  ReusableBlocks::get().end_step();  // [Note: reusable host blocks]
}

void ShardedModel::note_compute_copy_written() {
  std::lock_guard<std::mutex> lock(mutex_);
  store_.note_compute_copy_written();
}

std::vector<at::Tensor> ShardedModel::segment_compute_copies() { return store_.segment_compute_copies(); }
void ShardedModel::check_param_shapes() { store_.check_shapes(); }

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
