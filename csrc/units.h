#pragma once
// UnitScheduler: stage 3's units, gathered before use and released after.
//
// A unit is a block of the model (a transformer layer, say) whose buckets are
// all-gathered as one before its forward and again before its backward, and
// released after each ([Note: release by resize] in storage_release.h). The
// order units ran in the last forward drives prefetch: the next `prefetch`
// units' gathers start while the current one computes (forward order ahead,
// reverse order in backward). Gathers run on a communicator of their own:
// they are issued from forward/backward hooks and reductions as buckets fill,
// and the engine may interleave the two differently on ranks whose graphs
// differ; two groups keep each sequence identical on every rank.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "communicator.h"
#include "grad_reducer.h"
#include "layout.h"
#include "param_store.h"
#include "step_gate.h"

namespace zero_ext {

// kPartial: after the forward of a unit resharded to a subgroup, only this
// rank's part of the subgroup's copy is held ([Note: resharding to a subgroup]).
enum class UnitState : int8_t { kReleased, kGathering, kGathered, kPartial };

class UnitScheduler {
 public:
  UnitScheduler(const Layout& layout, ParamStore& store, Communicator& gather_comm, Communicator& regather_comm,
                Communicator& expert_comm, const GradReducer& reducer, const StepGate& gate, int64_t prefetch,
                std::function<void()> check_usable);

  // Around a unit's forward (u = 0: the root). `grad_enabled`: its graph is
  // recorded; `hooked_outputs`: a tensor of its output carries the hook that
  // gathers it again before its backward.
  void pre_forward(int64_t u);
  void post_forward(int64_t u, bool grad_enabled, bool hooked_outputs);
  // Where the model's forward is, for a forward that raised: "inside unit 3
  // 'blocks.1'", the innermost unit whose forward began and did not end.
  std::string forward_position() const;
  void pre_backward(int64_t u);
  // A forward torch.compile traced ([Note: stage 3 in a compiled graph] in
  // units_graph.cpp): the parameters of unit u are read now (in a forward, or a
  // backward's recompute) and copied out.
  void begin_graph_forward();
  void gather_for_graph(int64_t u, bool in_backward);
  // After each read: the unit's buffer is released once every parameter of it was read.
  void after_graph_read(int64_t u);
  void end_graph_forward();
  // reshard_after_forward=False for these units: a forward that records a
  // graph leaves them gathered until their backward is over (no second
  // gather); other units release after each forward. Set at wrap().
  void keep_gathered_after_forward(const std::vector<int64_t>& units);
  // Pipeline stages ([Note: reductions at read] in backward_round.h): the
  // units kept after forward also stay gathered after each microbatch's
  // backward, so a step gathers them once whatever the number of
  // microbatches (FSDP2's reshard_after_forward=False under a schedule,
  // which sets reshard_after_backward False); released by release_held()
  // when the step reads its gradients.
  void hold_kept_until_step(bool hold) { hold_kept_ = hold; }
  void release_held();
  // reshard_after_forward=<the regather group's size> for these units.
  void reshard_to_subgroup(const std::vector<int64_t>& units);
  // FSDP2's set_modules_to_forward/backward_prefetch: when unit u's forward
  // (or backward) begins, these units' gathers start, in place of the
  // automatic prefetch of the next units in the last forward's order.
  void set_prefetch(int64_t u, bool forward, const std::vector<int64_t>& units);
  // wrap(compress_weights=): gathers send block-quantized int8 ([Note:
  // quantized collectives]); before the first forward.
  void set_compression(const QuantFormat& format) { weight_format_ = format; }
  // [Note: live budget] The most bytes of full parameters gathered at once
  // that prefetch may reach: a unit's gather ahead of use waits until it
  // fits (the units in use are always gathered). 0: the prefetch count alone.
  void set_max_live_bytes(int64_t bytes) { max_live_bytes_ = bytes; }
  int64_t live_bytes() const;
  // Bytes of the parts held by units resharded to a subgroup.
  int64_t partial_bytes() const;
  int64_t units_holding_parts() const {
    return std::count_if(units_.begin(), units_.end(), [](const Unit& u) { return u.state == UnitState::kPartial; });
  }

  // Use tracking (see [Note: when a unit's backward is over]): a use whose
  // inputs require grad, its completion, and a use whose inputs do not.
  // `epilogue_owner`: the graph task that owns the running backward's epilogue.
  // Returns the use-tracking round the use counts in: releasing every unit
  // at the end of a backward starts a new round, and a report from an older
  // one (a graph that died later, say) no longer counts.
  int64_t add_pending_use(int64_t u);
  void note_untracked_use(int64_t u);
  // Returns whether that was the unit's last use whose inputs required grad
  // (its reductions may launch: [Note: issue order] in grad_reducer.cpp).
  bool post_backward_use(int64_t u, int64_t round, int64_t epilogue_owner);
  int64_t use_round() const { return use_round_; }
  const std::vector<int64_t>& buckets_of(int64_t u) const { return units_[u].buckets; }
  // The last gradient of a bucket of unit u arrived.
  void on_bucket_complete(int64_t b, int64_t epilogue_owner);
  // The backward is over: release every unit unless its graph is kept.
  void release_after_backward(bool keep_graph);

  // For inspection and full_params: not part of the training peaks.
  void gather_all();
  // model.unshard(): starts every unit's gather without waiting (an explicit
  // prefetch); a unit's forward, or finish_gathers(), waits for it.
  void start_gather_all();
  // The units holding these parameters stay gathered (pinned) until
  // unpin_units_of() with the same indices; pins nest.
  void gather_units_of(const std::vector<int64_t>& param_indices);
  void unpin_units_of(const std::vector<int64_t>& param_indices);
  void release_all();
  // After an optimizer step or a load: full buffers are stale. Drops them
  // all; pinned units (a step inside full_params) gather the new values.
  void drop_stale();
  // Waits for every gather in flight (a prefetch reads the shard that an
  // optimizer step or a load is about to overwrite).
  void finish_gathers();

  // Gathers of each unit since the last call (for the divergence check).
  std::vector<int64_t> take_gather_counts();
  int64_t num_units() const { return static_cast<int64_t>(units_.size()); }
  int64_t kept_after_forward() const {
    return std::count(kept_after_forward_.begin(), kept_after_forward_.end(), true);
  }
  int64_t gathered_units() const;
  int64_t param_gathers() const { return param_gathers_; }
  int64_t peak_gathered_forward() const { return peak_gathered_forward_; }
  int64_t peak_gathered_backward() const { return peak_gathered_backward_; }

 private:
  struct Unit {
    std::vector<int64_t> buckets;
    UnitState state = UnitState::kReleased;
    int64_t pending_uses = 0;    // uses whose input gradients are not complete yet
    bool tracked_use = false;    // some use since the last epilogue had such inputs
    bool untracked_use = false;  // some use had no input requiring grad
    int64_t pins = 0;            // open zero_ext.full_params contexts holding it gathered
    bool quantized = false;      // its gathered values came through compress_weights
  };

  Unit& unit_at(int64_t u);
  void start_gather(int64_t u);
  void finish_gather(int64_t u);
  // Inspection sees exact values: a unit gathered quantized for compute is
  // gathered again, exact, in place ([Note: quantized collectives]).
  void gather_exact_for_inspection(int64_t u);
  // A pinned unit stays gathered (full_params) unless `even_pinned`.
  void release(int64_t u, bool even_pinned = false);
  // A gathered unit opened for inspection: its shard_is_flat buckets'
  // parameters view a copy (ParamStore::open_inspection_copy).
  void inspect(int64_t u);
  bool backward_done(int64_t u, int64_t epilogue_owner) const;
  void maybe_release_after_backward(int64_t u, int64_t epilogue_owner);
  bool has_trainable(int64_t u) const;
  void prefetch_around(int64_t u, bool forward);
  void read_ahead(int64_t u);
  // Units whose swapped shards are read ahead of their gather (offload files):
  // two keep the drive's queue full between units (one left it idle a third of the time).
  static constexpr int64_t kReadAheadUnits = 2;
  bool fits_live_budget(int64_t u) const;
  int64_t unit_bytes(int64_t u) const;
  int64_t max_live_bytes_ = 0;
  // Swapped shards read ahead for units that were not gathered after all
  // (the backward ended, a step comes) go back to their file.
  void park_read_ahead();
  void finish_forward_order();
  int64_t graph_unit_ = -1;  // the unit a compiled graph reads now: released when it reads another
  int64_t graph_reads_left_ = 0;  // reads of graph_unit_ before each of its parameters was read once
  std::vector<bool> graph_gathered_;  // by unit: gathered for a graph (by its read or prefetch), its to release
  std::vector<int64_t> units_of(const std::vector<int64_t>& param_indices) const;

  const Layout& layout_;
  ParamStore& store_;
  Communicator& gather_comm_;
  const GradReducer& reducer_;
  const StepGate& gate_;
  const int64_t prefetch_;
  std::function<void()> check_usable_;  // before any new gather: refuses a broken rank
  std::vector<Unit> units_;
  std::vector<bool> kept_after_forward_;  // by unit: reshard_after_forward=False
  bool hold_kept_ = false;                // kept units stay gathered until release_held()
  bool held(int64_t u) const {
    return hold_kept_ && u < static_cast<int64_t>(kept_after_forward_.size()) && kept_after_forward_[u];
  }
  std::vector<bool> resharded_to_subgroup_;  // by unit: reshard_after_forward=<int>
  Communicator& regather_comm_;  // the subgroup those units gather in again
  Communicator& expert_comm_;    // expert buckets gather in it ([Note: expert buckets] in layout.h)
  Communicator& gather_comm_of(int64_t b) const { return layout_.expert(b) ? expert_comm_ : gather_comm_; }
  QuantFormat weight_format_;     // bits 0: gathers send the compute dtype
  std::vector<at::Tensor> partial_;  // by bucket: this rank's part of the subgroup's copy
  std::vector<bool> regathering_;    // by bucket: gather_work_ is on regather_comm_
  // Per unit, the units set_prefetch named (set: given, even if empty).
  struct ExplicitPrefetch {
    bool set = false;
    std::vector<int64_t> units;
  };
  std::vector<ExplicitPrefetch> forward_prefetch_;
  std::vector<ExplicitPrefetch> backward_prefetch_;
  // Whether unit u's gathers ahead follow an explicit list (and started them).
  bool prefetch_explicitly(int64_t u, bool forward);
  void keep_partial(int64_t u);
  std::vector<c10::intrusive_ptr<c10d::Work>> gather_work_;  // per bucket
  std::vector<int64_t> gathers_since_exchange_;  // one per unit with parameters, fixed at wrap()
  std::vector<int64_t> forward_order_;       // being recorded
  std::vector<int64_t> open_in_forward_;     // units whose forward began and did not end, innermost last
  std::vector<int64_t> last_forward_order_;  // complete
  int64_t forward_cursor_ = 0;
  int64_t backward_cursor_ = 0;
  int64_t param_gathers_ = 0;  // bucket all-gathers
  bool replaying_retained_graph_ = false;  // the last backward kept its graph
  int64_t use_round_ = 0;
  bool gathering_for_inspection_ = false;
  int64_t peak_gathered_forward_ = 0;   // most units gathered at once, outside backward
  int64_t peak_gathered_backward_ = 0;  // and inside
};

} // namespace zero_ext
