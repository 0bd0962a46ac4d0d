#include "sharded_model.h"

#include "core_ops.h"

#include <algorithm>
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
                   bool offload, const Communicator& comm) {
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : params) shapes.push_back(p.sizes().vec());
  // Stage 0 keeps DDP's layout (param.grad is the reduced buffer) only when
  // gradients are reduced in the parameters' own fp32.
  const bool masters_or_low_precision_reduce =
      compute_dtype.has_value() || offload || reduce_dtype.value_or(at::kFloat) != at::kFloat;
  return Layout(std::move(shapes), std::move(names), std::move(trainable), params_per_bucket, unit_of_bucket,
                stage, grad_layout_for(stage, masters_or_low_precision_reduce), comm.rank(), comm.size());
}

} // namespace

ShardedModel::ShardedModel(std::vector<at::Tensor> params, std::vector<std::string> names,
                           std::vector<int64_t> trainable, std::vector<int64_t> params_per_bucket,
                           std::vector<int64_t> unit_of_bucket, int64_t stage, std::string group_name,
                           std::string gather_group_name, int64_t prefetch,
                           std::optional<c10::ScalarType> compute_dtype,
                           std::optional<c10::ScalarType> reduce_dtype, bool offload)
    : comm_(group_name),
      gather_comm_(gather_group_name.empty() ? group_name : gather_group_name),
      layout_(make_layout(params, std::move(names), std::move(trainable), params_per_bucket, unit_of_bucket,
                          stage, compute_dtype, reduce_dtype, offload, comm_)),
      store_(std::move(params), layout_, comm_, gate_.progress(), compute_dtype, offload),
      reducer_(layout_, store_, comm_, gate_, reduce_dtype),
      units_(layout_.params_sharded()
                 ? std::make_unique<UnitScheduler>(layout_, store_, gather_comm_, reducer_, gate_, prefetch,
                                                   [this] { round_.check_usable(); })
                 : nullptr),
      agreement_(layout_, comm_, gate_),
      hooks_(store_.params(), layout_, reducer_,
             [this](int64_t i) {
               const at::Tensor& grad = store_.param(i).grad();
               if (grad.defined()) {
                 dispatch::accumulate_grad(self(), i, grad);
               } else {
                 on_grad_ready(i);  // nothing to accumulate; arms the epilogue
               }
             }),
      round_(layout_, store_, reducer_, units_.get(), agreement_, gate_, hooks_, faults_, comm_, gather_comm_) {}

// --- autograd ----------------------------------------------------------------

c10::intrusive_ptr<ShardedModel> ShardedModel::self() {
  return c10::intrusive_ptr<ShardedModel>::unsafe_reclaim_from_nonowning(this);
}

void ShardedModel::arm_epilogue() {
  if (round_.armed()) {
    return;
  }
  round_.arm([model = self()]() { dispatch::run_epilogue(model); });
}

void ShardedModel::run_epilogue() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (units_) drain_deferred_uses();
  round_.run_epilogue(sync_);
}

void ShardedModel::on_grad_ready(int64_t i) {
  std::lock_guard<std::mutex> lock(mutex_);
  round_.check_usable();
  try {
    arm_epilogue();  // fallback when no forward output was hooked
    if (faults_.armed()) {
      faults_.maybe_raise("grad_hook", gate_.progress().step_index, comm_.rank());
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

// --- stage 3 units --------------------------------------------------------------

void ShardedModel::pre_forward(int64_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;  // stages 0-2: parameters are never released
  drain_deferred_uses();
  units_->pre_forward(u);
}

void ShardedModel::hook_for_pre_backward(const at::Tensor& output, int64_t u) {
  c10::weak_intrusive_ptr<ShardedModel> weak(c10::intrusive_ptr<ShardedModel>::unsafe_reclaim_from_nonowning(this));
  output.register_hook([weak, u](const at::Tensor& /*grad*/) {
    if (auto model = weak.lock()) {
      dispatch::gather_unit(model, u, /*backward=*/true);
    }
  });
}

void ShardedModel::post_forward(int64_t u, std::vector<at::Tensor> outputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;
  const bool grad_enabled = at::GradMode::is_enabled();
  if (grad_enabled) {
    for (const auto& output : outputs) {
      if (output.requires_grad()) {
        hook_for_pre_backward(output, u);
      }
    }
  }
  units_->post_forward(u, grad_enabled, !outputs.empty());
}

void ShardedModel::pre_backward(int64_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;  // stages 0-2: parameters are never released
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
  units_->post_backward_use(u, units_->use_round(), round_.owner_graph_task());
}

void ShardedModel::use_done(int64_t u, int64_t round) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;
  drain_deferred_uses();
  units_->post_backward_use(u, round, round_.owner_graph_task());
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
  units_->gather_all();
}

void ShardedModel::gather_units_of(std::vector<int64_t> param_indices) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!units_) return;  // stages 0-2: parameters are never released
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
bool ShardedModel::found_nonfinite() { return gate_.found_nonfinite(); }

void ShardedModel::set_skip_nonfinite(bool skip) {
  std::lock_guard<std::mutex> lock(mutex_);
  gate_.set_skip_nonfinite(skip);
}

int64_t ShardedModel::begin_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  round_.check_usable();
  return static_cast<int64_t>(gate_.decide());
}

void ShardedModel::check_before_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  round_.reset_if_stale();
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

void ShardedModel::refresh_params(bool every_bucket) {
  if (layout_.ddp_in_place()) {
    return;  // the optimizer updated the parameters themselves
  }
  store_.refresh_compute_copies();
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
    // Untouched: the optimizer skipped every parameter in it, on every rank.
    return std::any_of(has_grad.begin() + shape.first, has_grad.begin() + shape.first + shape.count,
                       [](uint8_t g) { return g != 0; });
  });
}

void ShardedModel::after_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  refresh_params(/*every_bucket=*/false);
  if (!layout_.ddp_in_place()) {  // there the optimizer's in-place update bumped them
    const auto& has_grad = reducer_.global_has_grad();
    store_.bump_versions([&](int64_t i) { return layout_.trainable(i) && has_grad[i]; });
  }
}

void ShardedModel::note_compute_copy_written() {
  std::lock_guard<std::mutex> lock(mutex_);
  store_.note_compute_copy_written();
}

std::vector<at::Tensor> ShardedModel::segment_compute_copies() { return store_.segment_compute_copies(); }
void ShardedModel::check_param_shapes() { store_.check_shapes(); }

void ShardedModel::enable_stall_diagnosis(double seconds, std::string key_space) {
  if (!store_.device().is_cpu()) {
    return;  // NCCL: the watchdog bounds waits; a timed wait would block the host
  }
  comm_.enable_stall_diagnosis(seconds, key_space);
  gather_comm_.enable_stall_diagnosis(seconds, key_space);
}

// --- training-loop controls -------------------------------------------------

void ShardedModel::set_sync(bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_ = sync;
}

bool ShardedModel::sync() { return sync_; }

void ShardedModel::zero_grad(bool set_to_none) {
  std::lock_guard<std::mutex> lock(mutex_);
  round_.check_not_running();
  round_.reset_if_stale();  // never zero buffers a collective may still write
  gate_.clear_nonfinite();
  reducer_.zero_grad(set_to_none);
}

bool ShardedModel::reset_if_stale() {
  std::lock_guard<std::mutex> lock(mutex_);
  return round_.reset_if_stale();
}

// --- inspection and checkpoints ---------------------------------------------

std::vector<at::Tensor> ShardedModel::segments() { return store_.segments(); }

std::vector<int64_t> ShardedModel::segment_param_indices() {
  std::vector<int64_t> out;
  for (const auto& piece : layout_.segments()) out.push_back(piece.param);
  return out;
}

std::vector<int64_t> ShardedModel::segment_param_starts() {
  std::vector<int64_t> out;
  for (const auto& piece : layout_.segments()) out.push_back(piece.param_start);
  return out;
}

std::vector<at::Tensor> ShardedModel::full_grads() {
  std::lock_guard<std::mutex> lock(mutex_);
  return reducer_.full_grads();
}

std::vector<bool> ShardedModel::has_grad() {
  const auto& global = reducer_.global_has_grad();
  return std::vector<bool>(global.begin(), global.end());
}

bool ShardedModel::has_masters() { return store_.has_masters(); }
bool ShardedModel::replicated() { return layout_.replicated(); }

std::vector<at::Tensor> ShardedModel::full_masters() {
  std::lock_guard<std::mutex> lock(mutex_);
  return store_.full_masters();
}

void ShardedModel::load_masters(std::vector<at::Tensor> full_params) {
  std::lock_guard<std::mutex> lock(mutex_);
  store_.load_masters(full_params);
}

std::vector<at::Tensor> ShardedModel::local_value_shards() { return store_.local_value_shards(); }

std::vector<int64_t> ShardedModel::local_pieces() {
  std::vector<int64_t> out;
  for (const auto& piece : layout_.local_pieces()) {
    out.insert(out.end(), {piece.param, piece.param_start, piece.bucket, piece.shard_offset, piece.length});
  }
  return out;
}

std::vector<int64_t> ShardedModel::owned_ranges(int64_t rank) {
  std::vector<int64_t> out;
  for (const auto& [param, start, end] : layout_.owned_ranges(rank)) {
    out.insert(out.end(), {param, start, end});
  }
  return out;
}

std::vector<int64_t> ShardedModel::bucket_layout() {
  std::vector<int64_t> out;
  for (const auto& bucket : layout_.buckets()) {
    out.insert(out.end(), {bucket.first, bucket.count, bucket.padded});
  }
  return out;
}

std::vector<double> ShardedModel::loss_scaler_state() {
  const LossScaler& scaler = gate_.scaler();
  return {scaler.scale(), static_cast<double>(scaler.clean_steps()), static_cast<double>(scaler.skipped_steps())};
}

void ShardedModel::restore_loss_scaler(double scale, int64_t clean_steps, int64_t skipped_steps) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (gate_.scaler().enabled()) {
    gate_.scaler().restore(scale, clean_steps, skipped_steps);
  }
}

void ShardedModel::refresh_params_from_shards() {
  std::lock_guard<std::mutex> lock(mutex_);
  reducer_.forget_accumulated();  // a loaded model starts with no gradient
  store_.forget_compute_copy_written();
  refresh_params(/*every_bucket=*/true);
  store_.bump_versions([](int64_t) { return true; });
}

std::string ShardedModel::grad_layout() { return grad_layout_name(layout_.grad_layout()); }

c10::Dict<std::string, int64_t> ShardedModel::stats() {
  c10::Dict<std::string, int64_t> out;
  out.insert("epilogues", round_.epilogues_run());
  out.insert("synced_epilogues", round_.synced_epilogues());
  out.insert("late_rounds", round_.late_rounds());
  out.insert("last_graph_task", round_.last_graph_task());
  out.insert("last_keep_graph", round_.last_keep_graph() ? 1 : 0);
  out.insert("collectives", comm_.collectives_issued());
  out.insert("all_gathers", comm_.all_gathers_issued());
  out.insert("param_gathers", units_ ? units_->param_gathers() : 0);
  out.insert("buckets", layout_.num_buckets());
  int64_t host_bytes = reducer_.host_bytes();
  if (store_.offload()) host_bytes += store_.master_bytes();
  out.insert("host_bytes", host_bytes);  // offload: of the above, in host memory
  out.insert("host_landing_buffers", reducer_.host_landing_buffers());
  out.insert("nonfinite_backwards", gate_.nonfinite_backwards());
  out.insert("skipped_steps", gate_.skipped_steps());
  out.insert("step_index", gate_.progress().step_index);
  out.insert("param_bytes", store_.param_bytes());
  out.insert("master_bytes", store_.master_bytes());
  out.insert("grad_bytes", reducer_.grad_bytes());
  out.insert("units", units_ ? units_->num_units() : 0);
  out.insert("gathered_units", units_ ? units_->gathered_units() : 0);
  out.insert("peak_gathered_units_forward", units_ ? units_->peak_gathered_forward() : 0);
  out.insert("peak_gathered_units_backward", units_ ? units_->peak_gathered_backward() : 0);
  return out;
}

void ShardedModel::set_test_fault(std::string point, int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  faults_.arm(point, step);
}

// --- Python's collectives on zero_ext's own group ----------------------------

void ShardedModel::group_all_reduce(at::Tensor tensor, bool max, std::string what) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto work = max ? comm_.all_reduce_max(tensor) : comm_.all_reduce_sum(tensor);
  comm_.wait(work, [&what] { return what; });
}

void ShardedModel::group_broadcast_from_rank0(at::Tensor tensor, std::string what) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto work = comm_.broadcast_from_rank0(tensor);
  comm_.wait(work, [&what] { return what; });
}

void ShardedModel::group_all_gather(at::Tensor out, at::Tensor in, std::string what) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto work = comm_.all_gather(out, in);
  comm_.wait(work, [&what] { return what; });
}

} // namespace zero_ext
