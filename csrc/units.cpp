#include "units.h"

#include <algorithm>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include "epilogue.h"

namespace zero_ext {

UnitScheduler::UnitScheduler(const Layout& layout, ParamStore& store, Communicator& gather_comm,
                             Communicator& regather_comm, Communicator& expert_comm, const GradReducer& reducer, const StepGate& gate,
                             int64_t prefetch, std::function<void()> check_usable)
    : layout_(layout), store_(store), gather_comm_(gather_comm), reducer_(reducer), gate_(gate),
      prefetch_(prefetch), check_usable_(std::move(check_usable)), regather_comm_(regather_comm),
      expert_comm_(expert_comm) {
  units_.resize(layout_.num_units());
  for (int64_t u = 0; u < layout_.num_units(); ++u) {
    units_[u].buckets = layout_.unit_buckets(u);
  }
  gather_work_.resize(layout_.num_buckets());
  partial_.resize(layout_.num_buckets());
  regathering_.assign(layout_.num_buckets(), false);
  gathers_since_exchange_.assign(units_.size(), 0);  // the same on every rank
}

UnitScheduler::Unit& UnitScheduler::unit_at(int64_t u) {
  TORCH_INTERNAL_ASSERT(u >= 0, "negative unit index");
  if (u >= static_cast<int64_t>(units_.size())) {
    units_.resize(u + 1);  // a unit whose parameters all belong to an outer one
  }
  return units_[u];
}

bool UnitScheduler::has_trainable(int64_t u) const {
  for (int64_t b : units_[u].buckets) {
    if (layout_.bucket(b).trainable > 0) {
      return true;
    }
  }
  return false;
}

int64_t UnitScheduler::gathered_units() const {
  int64_t n = 0;
  for (const auto& unit : units_) {
    n += unit.state == UnitState::kGathering || unit.state == UnitState::kGathered ? 1 : 0;
  }
  return n;
}

void UnitScheduler::start_gather(int64_t u) {
  Unit& unit = units_[u];
  if (unit.state != UnitState::kReleased && unit.state != UnitState::kPartial) {
    return;
  }
  check_usable_();
  RECORD_USER_SCOPE("zero_ext::all_gather unit " + std::to_string(u));  // a profiler label; free when none runs
  // Quantized for compute only: full_params, state_dict and checkpoints see
  // exact values, so inspection gathers (even a kept part's unit) from the
  // shards. A kept part regathers exact: it holds what forward computed with.
  const bool from_partial =
      unit.state == UnitState::kPartial && !(weight_format_.enabled() && gathering_for_inspection_);
  const bool quantized = weight_format_.enabled() && !gathering_for_inspection_ && !from_partial;
  unit.quantized = quantized || (from_partial && unit.quantized);
  for (int64_t b : unit.buckets) {
    store_.regrow_flat(b);
    Communicator& comm = from_partial ? regather_comm_ : gather_comm_of(b);
    // Within the subgroup, from the parts its members kept; else from the shards.
    at::Tensor input = from_partial ? partial_[b] : store_.gather_input(b);
    gather_work_[b] = quantized
                          ? comm.quantized_all_gather(store_.flat_mut(b), input, weight_format_, Purpose::kUnitGather, b)
                          : comm.all_gather(store_.flat_mut(b), input, Purpose::kUnitGather, b);
    regathering_[b] = from_partial;
    ++param_gathers_;
  }
  if (u < static_cast<int64_t>(gathers_since_exchange_.size()) && !unit.buckets.empty()) {
    ++gathers_since_exchange_[u];
  }
  unit.state = UnitState::kGathering;
  if (!gathering_for_inspection_) {
    int64_t& peak = current_backward().graph_task_id >= 0 ? peak_gathered_backward_ : peak_gathered_forward_;
    peak = std::max(peak, gathered_units());
  }
}

void UnitScheduler::finish_gather(int64_t u) {
  Unit& unit = units_[u];
  if (unit.state != UnitState::kGathering) {
    return;
  }
  for (int64_t b : unit.buckets) {
    (regathering_[b] ? regather_comm_ : gather_comm_of(b)).wait(gather_work_[b], [&] {
      return std::string(regathering_[b] ? "all-gather within the subgroup" : "all-gather") +
             " of the parameters of " + layout_.describe_unit(u) + " (" +
             layout_.describe_bucket(b, gate_.progress().where()) + ")";
    });
    gather_work_[b].reset();
    partial_[b].reset();  // the subgroup's copy is whole again
    store_.point_params(b, /*gathered=*/true);
    store_.after_gather(b);  // a swapped shard goes back to its file ([Note: swapped values])
  }
  unit.state = UnitState::kGathered;
}

void UnitScheduler::release(int64_t u, bool even_pinned) {
  Unit& unit = units_[u];
  if (unit.state == UnitState::kReleased || (unit.pins > 0 && !even_pinned)) {
    return;
  }
  finish_gather(u);  // never free memory a collective is writing
  const bool partial = unit.state == UnitState::kPartial;
  for (int64_t b : unit.buckets) {
    partial_[b].reset();
    if (!partial) {
      store_.point_params(b, /*gathered=*/false);
      store_.release_flat(b);
    }
  }
  unit.state = UnitState::kReleased;
}

// [Note: when a unit's backward is over]
// Its parameters are read by the nodes of every use of the unit in the graph.
// Those nodes are over once (a) every trainable parameter's AccumulateGrad ran
// (it waits for all its uses) and (b) for each use whose inputs required grad,
// the gradient of those inputs is complete: the UnitInputBoundary node they
// passed through at the unit's pre-forward (autograd_boundaries.h) runs then
// and reports it (use_done), and so does the node's destruction if the graph
// is dropped without a backward (deferred to the next entry point). Inputs
// pytree cannot rebuild fall back to a Python multi-grad hook
// (post_backward_use). A use whose inputs did
// not require grad reads frozen parameters only on the way to trainable ones,
// so (a) covers it, provided the arrivals came from the backward that owns the
// epilogue (a reentrant checkpoint's inner backward can finish before outer
// nodes that read the same parameters). A graph replayed after
// retain_graph=True fires these events again without a new forward, so then
// releases wait for the epilogue.
bool UnitScheduler::backward_done(int64_t u, int64_t epilogue_owner) const {
  const Unit& unit = units_[u];
  if (replaying_retained_graph_ || unit.pending_uses > 0) {
    return false;
  }
  bool any_trainable = false;
  for (int64_t b : unit.buckets) {
    if (reducer_.waiting(b) != 0) {
      return false;
    }
    any_trainable = any_trainable || layout_.bucket(b).trainable > 0;
  }
  if (unit.untracked_use) {
    return any_trainable && current_backward().graph_task_id == epilogue_owner;
  }
  return unit.tracked_use;
}

void UnitScheduler::maybe_release_after_backward(int64_t u, int64_t epilogue_owner) {
  if (!current_backward().keep_graph && !held(u) && backward_done(u, epilogue_owner)) {
    release(u);
  }
}

void UnitScheduler::on_bucket_complete(int64_t b, int64_t epilogue_owner) {
  const int64_t u = layout_.bucket(b).unit;
  if (u >= 0) {
    maybe_release_after_backward(u, epilogue_owner);
  }
}

int64_t UnitScheduler::add_pending_use(int64_t u) {
  Unit& unit = unit_at(u);
  ++unit.pending_uses;
  unit.tracked_use = true;
  return use_round_;
}

void UnitScheduler::note_untracked_use(int64_t u) {
  unit_at(u).untracked_use = true;
}

bool UnitScheduler::post_backward_use(int64_t u, int64_t round, int64_t epilogue_owner) {
  if (round != use_round_) {
    return false;  // counted in a round that release_after_backward already closed
  }
  Unit& unit = unit_at(u);
  if (unit.pending_uses > 0) {
    --unit.pending_uses;
  }
  const bool last_use = unit.pending_uses == 0 && unit.tracked_use && !unit.untracked_use;
  maybe_release_after_backward(u, epilogue_owner);
  return last_use;
}

void UnitScheduler::release_after_backward(bool keep_graph) {
  // [Note: retain_graph] A backward that keeps its graph may be followed by
  // another over the same saved tensors: keep every gathered unit until a
  // backward that does not keep it ends, or the next step.
  if (!forward_order_.empty()) {
    finish_forward_order();  // units ran without the root's forward hooks
  }
  replaying_retained_graph_ = keep_graph;
  if (keep_graph) {
    return;
  }
  ++use_round_;
  graph_unit_ = -1;
  graph_gathered_.assign(graph_gathered_.size(), false);
  for (int64_t u = 0; u < num_units(); ++u) {
    if (!held(u)) release(u);
    units_[u].pending_uses = 0;
    units_[u].tracked_use = false;
    units_[u].untracked_use = false;
  }
  park_read_ahead();
}

void UnitScheduler::park_read_ahead() {
  if (!store_.swapping()) return;  // once per backward: nothing to walk without offload files
  for (const Unit& unit : units_) {
    if (unit.state != UnitState::kReleased) continue;
    for (int64_t b : unit.buckets) store_.after_gather(b);  // a no-op unless read ahead and never gathered
  }
}

void UnitScheduler::set_prefetch(int64_t u, bool forward, const std::vector<int64_t>& units) {
  TORCH_INTERNAL_ASSERT(u > 0, "bad unit index");
  unit_at(u);
  for (int64_t v : units) unit_at(v);
  auto& lists = forward ? forward_prefetch_ : backward_prefetch_;
  lists.resize(units_.size());
  lists[u] = ExplicitPrefetch{true, units};
}

bool UnitScheduler::prefetch_explicitly(int64_t u, bool forward) {
  const auto& lists = forward ? forward_prefetch_ : backward_prefetch_;
  if (u >= static_cast<int64_t>(lists.size()) || !lists[u].set) {
    return false;
  }
  for (int64_t v : lists[u].units) start_gather(v);
  return true;
}

int64_t UnitScheduler::unit_bytes(int64_t u) const {
  int64_t bytes = 0;
  for (int64_t b : units_[u].buckets) bytes += layout_.bucket(b).padded * store_.bucket(b).flat.element_size();
  return bytes;
}

int64_t UnitScheduler::live_bytes() const {
  int64_t bytes = 0;
  for (int64_t u = 0; u < num_units(); ++u) {
    const UnitState state = units_[u].state;
    if (state == UnitState::kGathering || state == UnitState::kGathered) bytes += unit_bytes(u);
  }
  return bytes;
}

bool UnitScheduler::fits_live_budget(int64_t u) const {
  if (max_live_bytes_ <= 0 || units_[u].state == UnitState::kGathering || units_[u].state == UnitState::kGathered) {
    return true;
  }
  return live_bytes() + unit_bytes(u) <= max_live_bytes_;
}

// The units after the ones being prefetched: their swapped shards start
// coming in from the offload file, so their gathers (the next prefetches)
// find them in memory: the disk is kReadAheadUnits ahead of the network,
// which is `prefetch` ahead of compute.
void UnitScheduler::read_ahead(int64_t u) {
  if (units_[u].state != UnitState::kReleased) return;
  for (int64_t b : units_[u].buckets) store_.prefetch_value(b);
}

void UnitScheduler::prefetch_around(int64_t u, bool forward) {
  if (prefetch_explicitly(u, forward)) {
    return;
  }
  const auto& order = last_forward_order_;
  const int64_t n = static_cast<int64_t>(order.size());
  if (forward) {
    int64_t k = forward_cursor_;
    while (k < n && order[k] != u) ++k;
    if (k == n) return;
    forward_cursor_ = k + 1;
    for (int64_t j = k + 1; j < n && j <= k + prefetch_ && fits_live_budget(order[j]); ++j) start_gather(order[j]);
    for (int64_t j = k + prefetch_ + 1; j < n && j <= k + prefetch_ + kReadAheadUnits; ++j) read_ahead(order[j]);
  } else {
    if (u == 0) {
      return;  // the root heads the order but runs its backward throughout
    }
    int64_t k = std::min(backward_cursor_, n) - 1;
    while (k >= 0 && order[k] != u) --k;
    if (k < 0) return;
    backward_cursor_ = k;
    for (int64_t j = k - 1; j >= 0 && j >= k - prefetch_ && fits_live_budget(order[j]); --j) start_gather(order[j]);
    for (int64_t j = k - prefetch_ - 1; j >= 0 && j >= k - prefetch_ - kReadAheadUnits; --j) read_ahead(order[j]);
  }
}

void UnitScheduler::finish_forward_order() {
  if (!forward_order_.empty()) {
    last_forward_order_ = std::move(forward_order_);
    forward_order_.clear();
  }
  forward_cursor_ = 0;
  backward_cursor_ = static_cast<int64_t>(last_forward_order_.size());
}

void UnitScheduler::pre_forward(int64_t u) {
  unit_at(u);
  const bool in_backward = current_backward().graph_task_id >= 0;
  if (!in_backward) {
    if (u == 0) {
      forward_order_.clear();
      forward_cursor_ = 0;
      open_in_forward_.clear();
    }
    forward_order_.push_back(u);
    if (open_in_forward_.size() < 4096) {  // bounded: units called outside the model's forward never clear it
      open_in_forward_.push_back(u);
    }
  }
  start_gather(u);
  finish_gather(u);
  if (!in_backward) {
    prefetch_around(u, /*forward=*/true);
  }
}

void UnitScheduler::post_forward(int64_t u, bool grad_enabled, bool hooked_outputs) {
  unit_at(u);
  const bool in_backward = current_backward().graph_task_id >= 0;
  if (!in_backward) {
    auto open = std::find(open_in_forward_.rbegin(), open_in_forward_.rend(), u);
    if (open != open_in_forward_.rend()) {
      open_in_forward_.erase(std::next(open).base());
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
  if (grad_enabled && u < static_cast<int64_t>(kept_after_forward_.size()) && kept_after_forward_[u]) {
    return;  // reshard_after_forward=False: its backward finds it gathered
  }
  if (grad_enabled && !hooked_outputs && has_trainable(u)) {
    // No output tensor to hook (an output type zero_ext cannot look into):
    // its backward could not gather it again, so it stays until the epilogue.
    return;
  }
  if (grad_enabled && u < static_cast<int64_t>(resharded_to_subgroup_.size()) && resharded_to_subgroup_[u]) {
    keep_partial(u);
    return;
  }
  release(u);
}

std::string UnitScheduler::forward_position() const {
  if (open_in_forward_.empty()) {
    return "outside any unit";
  }
  return "inside " + layout_.describe_unit(open_in_forward_.back());
}

// [Note: resharding to a subgroup]
// reshard_after_forward=k: the shard group's ranks form subgroups of k
// consecutive ranks, and after a unit's forward each member keeps 1/k of the
// full (padded) bucket, the part at its rank in the subgroup, so the
// subgroup's members together hold a whole copy. The unit's backward (or its
// next use) gathers it again within the subgroup, from those parts: a
// gather among k ranks (a node) instead of the whole group, for 1/k of the
// unit held per rank between forward and backward. Any other release (the
// end of a backward, a step, reshard()) drops the part.
void UnitScheduler::keep_partial(int64_t u) {
  Unit& unit = units_[u];
  finish_gather(u);
  if (unit.state != UnitState::kGathered || unit.pins > 0) {
    return;  // pinned by full_params: stays whole
  }
  const int64_t parts = regather_comm_.size();
  for (int64_t b : unit.buckets) {
    const at::Tensor& flat = store_.bucket(b).flat;
    const int64_t length = flat.numel() / parts;
    partial_[b] = flat.narrow(0, regather_comm_.rank() * length, length).clone();
    store_.point_params(b, /*gathered=*/false);
    store_.release_flat(b);
  }
  unit.state = UnitState::kPartial;
}

void UnitScheduler::reshard_to_subgroup(const std::vector<int64_t>& units) {
  TORCH_INTERNAL_ASSERT(units.empty() || regather_comm_.distributed(), "resharding to a subgroup needs its group");
  for (int64_t u : units) unit_at(u);
  resharded_to_subgroup_.assign(units_.size(), false);
  for (int64_t u : units) resharded_to_subgroup_[u] = true;
}

int64_t UnitScheduler::partial_bytes() const {
  int64_t bytes = 0;
  for (const auto& part : partial_) {
    if (part.defined()) bytes += part.nbytes();
  }
  return bytes;
}

void UnitScheduler::pre_backward(int64_t u) {
  unit_at(u);
  start_gather(u);
  finish_gather(u);
  prefetch_around(u, /*forward=*/false);
}

void UnitScheduler::keep_gathered_after_forward(const std::vector<int64_t>& units) {
  for (int64_t u : units) unit_at(u);  // a unit with no parameters of its own may lie past the layout's last
  kept_after_forward_.assign(units_.size(), false);
  for (int64_t u : units) kept_after_forward_[u] = true;
}

void UnitScheduler::start_gather_all() {
  for (int64_t u = 0; u < num_units(); ++u) start_gather(u);
}

void UnitScheduler::gather_exact_for_inspection(int64_t u) {
  Unit& unit = units_[u];
  if (!unit.quantized || (unit.state != UnitState::kGathering && unit.state != UnitState::kGathered)) {
    return;
  }
  finish_gather(u);
  for (int64_t b : unit.buckets) {  // every rank alike: inspection is collective, `quantized` the same everywhere
    at::Tensor input = store_.gather_input(b);
    Communicator& comm = gather_comm_of(b);
    comm.wait(comm.all_gather(store_.flat_mut(b), input, Purpose::kUnitGather, b), [&] {
      return "exact all-gather for inspection of the parameters of " + layout_.describe_unit(u);
    });
    store_.point_params(b, /*gathered=*/true);
    store_.after_gather(b);
  }
  unit.quantized = false;
}

void UnitScheduler::gather_all() {
  gathering_for_inspection_ = true;
  for (int64_t u = 0; u < num_units(); ++u) gather_exact_for_inspection(u);
  for (int64_t u = 0; u < num_units(); ++u) start_gather(u);
  gathering_for_inspection_ = false;
  for (int64_t u = 0; u < num_units(); ++u) {
    finish_gather(u);
    inspect(u);
  }
}

void UnitScheduler::inspect(int64_t u) {
  if (units_[u].state != UnitState::kGathered) {
    return;
  }
  for (int64_t b : units_[u].buckets) {
    store_.open_inspection_copy(b);
    store_.point_params(b, /*gathered=*/true);
  }
}

std::vector<int64_t> UnitScheduler::units_of(const std::vector<int64_t>& param_indices) const {
  std::vector<int64_t> wanted;
  for (int64_t i : param_indices) {
    TORCH_INTERNAL_ASSERT(i >= 0 && i < layout_.num_params(), "bad parameter index");
    const int64_t u = layout_.bucket(layout_.bucket_of(i)).unit;
    if (u >= 0 && std::find(wanted.begin(), wanted.end(), u) == wanted.end()) {
      wanted.push_back(u);
    }
  }
  std::sort(wanted.begin(), wanted.end());  // the same order on every rank
  return wanted;
}

void UnitScheduler::gather_units_of(const std::vector<int64_t>& param_indices) {
  const std::vector<int64_t> wanted = units_of(param_indices);
  gathering_for_inspection_ = true;
  for (int64_t u : wanted) gather_exact_for_inspection(u);
  for (int64_t u : wanted) start_gather(u);
  gathering_for_inspection_ = false;
  for (int64_t u : wanted) {
    finish_gather(u);
    inspect(u);
    ++units_[u].pins;  // nested contexts, state_dict() or a forward inside keep it gathered
  }
}

void UnitScheduler::unpin_units_of(const std::vector<int64_t>& param_indices) {
  for (int64_t u : units_of(param_indices)) {
    units_[u].pins = std::max<int64_t>(units_[u].pins - 1, 0);
    release(u);
  }
}

void UnitScheduler::release_all() {
  for (int64_t u = 0; u < num_units(); ++u) release(u);
}

void UnitScheduler::release_held() {
  for (int64_t u = 0; u < num_units(); ++u) {
    if (held(u)) release(u);
  }
}

void UnitScheduler::finish_gathers() {
  for (int64_t u = 0; u < num_units(); ++u) {
    finish_gather(u);
  }
}

void UnitScheduler::drop_stale() {
  park_read_ahead();  // the step is about to bring them in its own way
  for (int64_t u = 0; u < num_units(); ++u) {
    release(u, /*even_pinned=*/true);
    if (units_[u].pins > 0) {  // a step inside full_params: gather the new values
      gathering_for_inspection_ = true;
      start_gather(u);
      gathering_for_inspection_ = false;
      finish_gather(u);
      inspect(u);
    }
  }
}

std::vector<int64_t> UnitScheduler::take_gather_counts() {
  std::vector<int64_t> out = gathers_since_exchange_;
  std::fill(gathers_since_exchange_.begin(), gathers_since_exchange_.end(), 0);
  return out;
}

} // namespace zero_ext
