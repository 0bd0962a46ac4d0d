// ShardedModel's entry points for inspection, checkpoints and Python's
// collectives on zero_ext's own group: what zero_ext/files/checkpoint.py,
// full_params, full_grads and clip_grad_norm_ call. The training path's entry
// points are in sharded_model.cpp.
#include "sharded_model.h"
#include "reusable_blocks.h"

#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace zero_ext {

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
  begin_round(RoundKind::kSettle, 1);
  round_.settle(/*keep=*/true);
  return reducer_.full_grads();
}

std::vector<bool> ShardedModel::has_grad() {
  std::lock_guard<std::mutex> lock(mutex_);
  round_.settle(/*keep=*/true);
  const auto& global = reducer_.global_has_grad();
  return std::vector<bool>(global.begin(), global.end());
}

bool ShardedModel::has_masters() { return store_.has_masters(); }
bool ShardedModel::replicated() { return layout_.replicated(); }
bool ShardedModel::params_sharded() { return layout_.params_sharded(); }
bool ShardedModel::whole_params() { return layout_.whole_params(); }

std::vector<at::Tensor> ShardedModel::full_masters() {
  std::lock_guard<std::mutex> lock(mutex_);
  begin_round(RoundKind::kInspect, 1);
  return store_.full_masters();
}

std::vector<at::Tensor> ShardedModel::full_masters_of(std::vector<int64_t> buckets) {
  std::lock_guard<std::mutex> lock(mutex_);
  begin_round(RoundKind::kInspect, 2);
  return store_.full_masters_of(buckets);
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

void ShardedModel::settle() {
  std::lock_guard<std::mutex> lock(mutex_);
  round_.check_usable();
  begin_round(RoundKind::kSettle);
  round_.settle(/*keep=*/true);
}

void ShardedModel::refresh_params_from_shards() {
  std::lock_guard<std::mutex> lock(mutex_);
  begin_round(RoundKind::kLoad);
  round_.settle(/*keep=*/false);
  reducer_.forget_accumulated();  // a loaded model starts with no gradient
  store_.forget_compute_copy_written();
  refresh_params(/*every_bucket=*/true);
  store_.bump_versions([](int64_t) { return true; });
}

void ShardedModel::begin_materialize(std::vector<int64_t> buckets) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t b : buckets) {
    TORCH_CHECK(b >= 0 && b < layout_.num_buckets(), "zero_ext internal: no bucket ", b);
    store_.begin_materialize(b);
  }
}

void ShardedModel::end_materialize(std::vector<int64_t> buckets) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t b : buckets) {
    TORCH_CHECK(b >= 0 && b < layout_.num_buckets(), "zero_ext internal: no bucket ", b);
  }
  store_.end_materialize(buckets);
}

std::string ShardedModel::grad_layout() { return grad_layout_name(layout_.grad_layout()); }

bool ShardedModel::failed() {
  return mesh_.failed() || gather_comm_.failed() || regather_comm_.failed() || expert_comm_.failed();
}

c10::Dict<std::string, int64_t> ShardedModel::stats() {
  c10::Dict<std::string, int64_t> out;
  out.insert("epilogues", round_.epilogues_run());
  out.insert("synced_epilogues", round_.synced_epilogues());
  out.insert("late_rounds", round_.late_rounds());
  out.insert("agreement_reads", agreement_.host_reads());
  out.insert("blocking_headers", comm_.blocking_headers() + gather_comm_.blocking_headers() +
                                     replica_comm_.blocking_headers() + regather_comm_.blocking_headers() +
                                     expert_comm_.blocking_headers());
  out.insert("ahead_headers", comm_.ahead_headers() + gather_comm_.ahead_headers() + replica_comm_.ahead_headers() +
                                  regather_comm_.ahead_headers() + expert_comm_.ahead_headers());
  out.insert("last_graph_task", round_.last_graph_task());
  out.insert("last_keep_graph", round_.last_keep_graph() ? 1 : 0);
  out.insert("collectives", comm_.collectives_issued());
  out.insert("replica_collectives", replica_comm_.collectives_issued());
  out.insert("mesh_rank", mesh_.rank());
  out.insert("mesh_size", mesh_.size());
  out.insert("all_gathers", comm_.all_gathers_issued());
  out.insert("param_gathers", units_ ? units_->param_gathers() : 0);
  out.insert("buckets", layout_.num_buckets());
  int64_t host_bytes = reducer_.host_bytes();
  if (store_.offload()) host_bytes += store_.master_bytes() + store_.host_compute_bytes();
  out.insert("host_bytes", host_bytes);  // offload: of the above, in host memory
  out.insert("host_landing_buffers", reducer_.host_landing_buffers());
  out.insert("nonfinite_backwards", gate_.nonfinite_backwards());
  out.insert("skipped_steps", gate_.skipped_steps());
  out.insert("step_index", gate_.progress().step_index);
  // With units resharded to a subgroup: the parts they keep between forward and backward.
  out.insert("param_bytes", store_.param_bytes() + (units_ ? units_->partial_bytes() : 0));
  out.insert("regathers", regather_comm_.all_gathers_issued());
  out.insert("expert_collectives", expert_comm_.collectives_issued());
  out.insert("master_bytes", store_.master_bytes());
  out.insert("materializing_bytes", store_.materializing_bytes());
  out.insert("grad_bytes", reducer_.grad_bytes());
  out.insert("peak_staging_bytes", reducer_.peak_staging_bytes());
  out.insert("max_in_flight_bytes", reducer_.max_in_flight_bytes());
  out.insert("bound_lifts", reducer_.bound_lifts());
  out.insert("frozen_skips", reducer_.frozen_skips());
  out.insert("units", units_ ? units_->num_units() : 0);
  out.insert("units_kept_after_forward", units_ ? units_->kept_after_forward() : 0);
  out.insert("units_holding_parts", units_ ? units_->units_holding_parts() : 0);
  out.insert("gathered_units", units_ ? units_->gathered_units() : 0);
  out.insert("peak_gathered_units_forward", units_ ? units_->peak_gathered_forward() : 0);
  out.insert("peak_gathered_units_backward", units_ ? units_->peak_gathered_backward() : 0);
  // The process's reusable host blocks ([Note: reusable host blocks]), shared by every wrapped model.
  const ReusableBlocks::Stats blocks = ReusableBlocks::get().stats();
  out.insert("host_blocks_in_use_bytes", blocks.in_use_bytes);
  out.insert("host_blocks_idle_bytes", blocks.idle_bytes);
  out.insert("host_blocks_mapped", blocks.mapped_total);
  out.insert("host_blocks_reused", blocks.reused_total);
  return out;
}

void ShardedModel::set_max_in_flight_bytes(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(bytes >= 0, "zero_ext: the bound on reductions in flight is a number of bytes >= 0");
  reducer_.set_max_in_flight_bytes(bytes);
}

void ShardedModel::log_issues(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  comm_.log_issues_to(on ? &issue_log_ : nullptr, "reduce");
  gather_comm_.log_issues_to(on ? &issue_log_ : nullptr, "gather");
  replica_comm_.log_issues_to(on ? &issue_log_ : nullptr, "replicate");
  regather_comm_.log_issues_to(on ? &issue_log_ : nullptr, "regather");
  expert_comm_.log_issues_to(on ? &issue_log_ : nullptr, "expert");
}

std::vector<std::string> ShardedModel::take_issue_log() {
  std::lock_guard<std::mutex> lock(issue_log_.mutex);
  std::vector<std::string> out;
  out.swap(issue_log_.lines);
  return out;
}

void ShardedModel::set_test_fault(std::string point, int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  faults_.arm(point, step);
}

// --- Python's collectives on zero_ext's own group ----------------------------

// Each call is a round of its own (see [Note: collectives that prove what
// they are] in collective_sequence.h), keyed by its description.
void ShardedModel::group_all_reduce(at::Tensor tensor, bool max, std::string what) {
  std::lock_guard<std::mutex> lock(mutex_);
  begin_python_round(what);
  const auto subject = static_cast<int64_t>(hash_text(what));
  auto work = max ? comm_.all_reduce_max(tensor, Purpose::kPython, subject, what)
                  : comm_.all_reduce_sum(tensor, Purpose::kPython, subject, what);
  comm_.wait(work, [&what] { return what; });
}

void ShardedModel::group_broadcast_from_rank0(at::Tensor tensor, std::string what) {
  std::lock_guard<std::mutex> lock(mutex_);
  begin_python_round(what);
  auto work = comm_.broadcast_from_rank0(tensor, Purpose::kPython, static_cast<int64_t>(hash_text(what)), what);
  comm_.wait(work, [&what] { return what; });
}

void ShardedModel::group_all_gather(at::Tensor out, at::Tensor in, std::string what) {
  std::lock_guard<std::mutex> lock(mutex_);
  begin_python_round(what);
  auto work = comm_.all_gather(out, in, Purpose::kPython, static_cast<int64_t>(hash_text(what)), what);
  comm_.wait(work, [&what] { return what; });
}

void ShardedModel::mesh_all_reduce(at::Tensor tensor, bool max, std::string what) {
  std::lock_guard<std::mutex> lock(mutex_);
  begin_python_round(what);
  mesh_.all_reduce(tensor, max, Purpose::kPython, what, [&what] { return what; });
}

void ShardedModel::mesh_broadcast_from_rank0(at::Tensor tensor, std::string what) {
  std::lock_guard<std::mutex> lock(mutex_);
  begin_python_round(what);
  mesh_.broadcast_from_rank0({tensor}, Purpose::kPython, {}, [&what](size_t) { return what; }, what);
}

void ShardedModel::mesh_all_gather(at::Tensor out, at::Tensor in, std::string what) {
  std::lock_guard<std::mutex> lock(mutex_);
  begin_python_round(what);
  mesh_.all_gather(out, in, Purpose::kPython, what, [&what] { return what; });
}

} // namespace zero_ext
