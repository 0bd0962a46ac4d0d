// Stage 3 units: a unit's parameters are gathered before its forward and its
// backward and released after them (see param_storage.h); prefetch starts the
// next unit's all-gather while the current one computes.
#include "grad_buckets.h"

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>

#include "param_storage.h"

namespace zero_ext {

void GradBuckets::release_after_backward(bool keep_graph) {
  if (stage_ != 3) {
    return;
  }
  // [Note: retain_graph] A backward that keeps its graph may be followed by
  // another over the same saved tensors: keep every gathered unit until a
  // backward that does not keep it ends, or the next step.
  if (!forward_order_.empty()) {
    finish_forward_order();  // units ran without the root's forward hooks
  }
  replaying_retained_graph_ = keep_graph;
  if (!keep_graph) {
    for (size_t u = 0; u < units_.size(); ++u) {
      release_unit(static_cast<int64_t>(u));
      units_[u].pending_uses = 0;
      units_[u].tracked_use = false;
      units_[u].untracked_use = false;
    }
  }
}

bool GradBuckets::unit_has_trainable(int64_t u) const {
  for (int64_t b : units_[u].buckets) {
    if (buckets_[b].trainable > 0) {
      return true;
    }
  }
  return false;
}

// --- stage 3 units ----------------------------------------------------------

void GradBuckets::start_gather(int64_t u) {
  Unit& unit = units_[u];
  if (unit.state != Unit::State::kReleased) {
    return;
  }
  check_usable();
  for (int64_t b : unit.buckets) {
    Bucket& bucket = buckets_[b];
    grow_storage(bucket.param_flat, bucket.padded * bucket.param_flat.element_size());
    bucket.gather_work = gather_comm_.all_gather(bucket.param_flat, bucket.param_shard);
    ++param_gathers_;
  }
  if (u < static_cast<int64_t>(unit_gathers_.size()) && !unit.buckets.empty()) {
    ++unit_gathers_[u];
  }
  unit.state = Unit::State::kGathering;
  if (!gathering_all_) {
    int64_t& peak = current_backward().graph_task_id >= 0 ? peak_gathered_backward_ : peak_gathered_forward_;
    peak = std::max(peak, gathered_units());
  }
}

void GradBuckets::finish_gather(int64_t u) {
  Unit& unit = units_[u];
  if (unit.state != Unit::State::kGathering) {
    return;
  }
  for (int64_t b : unit.buckets) {
    gather_comm_.wait(buckets_[b].gather_work, [&] {
      return "all-gather of the parameters of " + describe_unit(u) + " (" + describe_bucket(b) + ")";
    });
    buckets_[b].gather_work.reset();
    point_params(buckets_[b], /*gathered=*/true);
  }
  unit.state = Unit::State::kGathered;
}

void GradBuckets::point_params(const Bucket& bucket, bool gathered) {
  for (int64_t i = bucket.first; i < bucket.first + bucket.count; ++i) {
    point_at(params_[i], gathered ? bucket.param_flat.storage() : released_[i]);
  }
}

void GradBuckets::release_unit(int64_t u, bool even_pinned) {
  Unit& unit = units_[u];
  if (unit.state == Unit::State::kReleased || (unit.pins > 0 && !even_pinned)) {
    return;
  }
  finish_gather(u);  // never free memory a collective is writing
  for (int64_t b : unit.buckets) {
    point_params(buckets_[b], /*gathered=*/false);
    release_storage(buckets_[b].param_flat);
  }
  unit.state = Unit::State::kReleased;
}

// [Note: when a unit's backward is over]
// Its parameters are read by the nodes of every use of the unit in the graph.
// Those nodes are over once (a) every trainable parameter's AccumulateGrad ran
// (it waits for all its uses) and (b) for each use whose inputs required grad,
// the gradient of those inputs is complete: a multi-grad hook on the inputs,
// registered in the pre-forward hook, reports it (post_backward_use), and so
// does its finalizer if the graph is dropped without a backward. A use
// whose inputs did not require grad reads frozen parameters only on the way
// to trainable ones, so (a) covers it, provided the arrivals came from the
// backward that owns the epilogue (a reentrant checkpoint's inner backward can
// finish before outer nodes that read the same parameters). A graph replayed
// after retain_graph=True fires these events again without a new forward, so
// then releases wait for the epilogue.
bool GradBuckets::unit_backward_done(int64_t u) const {
  const Unit& unit = units_[u];
  if (replaying_retained_graph_ || unit.pending_uses > 0) {
    return false;
  }
  bool any_trainable = false;
  for (int64_t b : unit.buckets) {
    const Bucket& bucket = buckets_[b];
    if (bucket.waiting != 0) {
      return false;
    }
    any_trainable = any_trainable || bucket.trainable > 0;
  }
  if (unit.untracked_use) {
    return any_trainable && current_backward().graph_task_id == epilogue_.owner_graph_task();
  }
  return unit.tracked_use;
}

void GradBuckets::maybe_release_after_unit_backward(int64_t u) {
  if (!current_backward().keep_graph && unit_backward_done(u)) {
    release_unit(u);
  }
}

void GradBuckets::add_pending_use(int64_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  Unit& unit = unit_at(u);
  ++unit.pending_uses;
  unit.tracked_use = true;
}

void GradBuckets::note_untracked_use(int64_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  unit_at(u).untracked_use = true;
}

void GradBuckets::post_backward_use(int64_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  Unit& unit = unit_at(u);
  if (unit.pending_uses > 0) {
    --unit.pending_uses;
  }
  maybe_release_after_unit_backward(u);
}

int64_t GradBuckets::gathered_units() const {
  int64_t n = 0;
  for (const auto& unit : units_) {
    n += unit.state != Unit::State::kReleased ? 1 : 0;
  }
  return n;
}

void GradBuckets::prefetch_around(int64_t u, bool forward) {
  const auto& order = last_forward_order_;
  const int64_t n = static_cast<int64_t>(order.size());
  if (forward) {
    int64_t k = forward_cursor_;
    while (k < n && order[k] != u) ++k;
    if (k == n) return;
    forward_cursor_ = k + 1;
    for (int64_t j = k + 1; j < n && j <= k + prefetch_; ++j) start_gather(order[j]);
  } else {
    if (u == 0) {
      return;  // the root heads the order but runs its backward throughout
    }
    int64_t k = std::min(backward_cursor_, n) - 1;
    while (k >= 0 && order[k] != u) --k;
    if (k < 0) return;
    backward_cursor_ = k;
    for (int64_t j = k - 1; j >= 0 && j >= k - prefetch_; --j) start_gather(order[j]);
  }
}

void GradBuckets::finish_forward_order() {
  if (!forward_order_.empty()) {
    last_forward_order_ = std::move(forward_order_);
    forward_order_.clear();
  }
  forward_cursor_ = 0;
  backward_cursor_ = static_cast<int64_t>(last_forward_order_.size());
}

GradBuckets::Unit& GradBuckets::unit_at(int64_t u) {
  TORCH_CHECK(u >= 0, "zero_ext internal: negative unit index");
  if (u >= static_cast<int64_t>(units_.size())) {
    units_.resize(u + 1);  // a unit whose parameters all belong to an outer one
  }
  return units_[u];
}

void GradBuckets::pre_forward(int64_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  unit_at(u);
  const bool in_backward = current_backward().graph_task_id >= 0;
  if (!in_backward) {
    if (u == 0) {
      forward_order_.clear();
      forward_cursor_ = 0;
    }
    forward_order_.push_back(u);
  }
  start_gather(u);
  finish_gather(u);
  if (!in_backward) {
    prefetch_around(u, /*forward=*/true);
  }
}

void GradBuckets::post_forward(int64_t u, std::vector<at::Tensor> outputs) {
  std::lock_guard<std::mutex> lock(mutex_);
  unit_at(u);
  const bool in_backward = current_backward().graph_task_id >= 0;
  const bool grad_enabled = at::GradMode::is_enabled();
  if (grad_enabled) {
    c10::weak_intrusive_ptr<GradBuckets> weak(
        c10::intrusive_ptr<GradBuckets>::unsafe_reclaim_from_nonowning(this));
    for (const auto& output : outputs) {
      if (output.requires_grad()) {
        output.register_hook([weak, u](const at::Tensor& /*grad*/) {
          if (auto self = weak.lock()) {
            self->pre_backward(u);
          }
        });
      }
    }
  }
  if (u == 0 && !in_backward) {
    finish_forward_order();
  }
  if (in_backward) {
    return;  // a checkpoint's recompute: the backward that follows needs these
  }
  if (u == 0 && grad_enabled) {
    return;  // the root is needed first thing in backward
  }
  if (grad_enabled && outputs.empty() && unit_has_trainable(u)) {
    // No output tensor to hook (an output type zero_ext cannot look into):
    // its backward could not gather it again, so it stays until the epilogue.
    return;
  }
  release_unit(u);
}

void GradBuckets::pre_backward(int64_t u) {
  std::lock_guard<std::mutex> lock(mutex_);
  unit_at(u);
  start_gather(u);
  finish_gather(u);
  prefetch_around(u, /*forward=*/false);
}

void GradBuckets::gather_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  gathering_all_ = true;  // for inspection: not part of the training peaks
  for (size_t u = 0; u < units_.size(); ++u) start_gather(static_cast<int64_t>(u));
  gathering_all_ = false;
  for (size_t u = 0; u < units_.size(); ++u) finish_gather(static_cast<int64_t>(u));
}

std::vector<int64_t> GradBuckets::units_of(const std::vector<int64_t>& param_indices) const {
  std::vector<int64_t> wanted;
  for (int64_t i : param_indices) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(params_.size()), "zero_ext internal: bad parameter index");
    const int64_t u = buckets_[bucket_of_[i]].unit;
    if (u >= 0 && std::find(wanted.begin(), wanted.end(), u) == wanted.end()) {
      wanted.push_back(u);
    }
  }
  std::sort(wanted.begin(), wanted.end());  // the same order on every rank
  return wanted;
}

void GradBuckets::gather_units_of(std::vector<int64_t> param_indices) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::vector<int64_t> wanted = units_of(param_indices);
  gathering_all_ = true;
  for (int64_t u : wanted) start_gather(u);
  gathering_all_ = false;
  for (int64_t u : wanted) {
    finish_gather(u);
    ++units_[u].pins;  // nested contexts, state_dict() or a forward inside keep it gathered
  }
}

void GradBuckets::unpin_units_of(std::vector<int64_t> param_indices) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t u : units_of(param_indices)) {
    units_[u].pins = std::max<int64_t>(units_[u].pins - 1, 0);
    release_unit(u);
  }
}

void GradBuckets::release_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t u = 0; u < units_.size(); ++u) release_unit(static_cast<int64_t>(u));
}

void GradBuckets::write_back_shards() {
  std::lock_guard<std::mutex> lock(mutex_);
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets_) {
    // Gathered buckets only: full_params on a submodule gathers its units alone.
    if (stage_ == 3 && !storage_is_released(bucket.param_flat)) {
      bucket.param_shard.copy_(bucket.param_flat.narrow(0, comm_.rank() * bucket.shard, bucket.shard));
    }
  }
}

} // namespace zero_ext
