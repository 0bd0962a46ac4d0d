// UnitScheduler's side of a graph torch.compile traced: stage 3's units
// gathered by the graph's parameter reads (sharded_model_graph.cpp).
#include "units.h"

#include <vector>

namespace zero_ext {

// [Note: stage 3 in a compiled graph]
// Eagerly, a unit's parameters point at its gathered buffer between its
// pre-forward and post-forward hooks. A graph torch.compile traces reads the
// parameters as its inputs, so a hook that changes what they point at would
// be invisible to it (and a graph break under fullgraph=True). There, each
// read of a parameter is instead the op zero_ext::gathered_param(model,
// index, parameter): it returns a fresh tensor with the parameter's full
// value, gathering its unit first if it is not the unit the graph read last.
// The unit is released once each of its parameters was read (a forward reads
// them all), or else when the graph reads another unit. The result is the graph's own tensor: Inductor
// frees it after its last use and may reuse its memory, and a use of it can
// never move before its gather (it is its input). Backward reads a weight
// again through the same op, recomputed there (a selective activation
// checkpoint, zero_ext/runtime/compiled_units.py) rather than saved: a
// unit's parameters are held from its gather to its last use, as eagerly.
// The gradient goes to the parameter itself, whose C++ hook reduces it as
// in eager mode. Prefetch follows the order of the units' first reads.
void UnitScheduler::begin_graph_forward() {
  forward_order_.clear();
  forward_cursor_ = 0;
  open_in_forward_.clear();
}

// A graph releases only what it gathered (itself or by its prefetch): a unit
// it found gathered belongs to eager hooks around it (a frame Dynamo left
// eager, full_params), which release it themselves.
void UnitScheduler::gather_for_graph(int64_t u, bool in_backward) {
  unit_at(u);
  graph_gathered_.resize(units_.size(), false);
  if (units_[u].state == UnitState::kGathered && (graph_unit_ == u || !graph_gathered_[u])) {
    // Read before, or gathered by eager hooks around this read (a frame
    // Dynamo left eager, with its module's hooks): their schedule, which
    // is the same on every rank, not this read's (how often a graph reads a
    // unit differs between ranks where routing runs other experts).
    return;
  }
  if (graph_unit_ >= 0 && graph_unit_ != u && graph_gathered_[graph_unit_]) {
    release(graph_unit_);
    graph_gathered_[graph_unit_] = units_[graph_unit_].state != UnitState::kReleased;  // pinned: still held
  }
  graph_unit_ = u;
  graph_reads_left_ = 0;
  for (int64_t b : units_[u].buckets) graph_reads_left_ += layout_.bucket(b).count;
  if (!in_backward && forward_order_.size() < 4096) {
    forward_order_.push_back(u);
  }
  if (units_[u].state != UnitState::kGathered) {
    graph_gathered_[u] = true;
  }
  std::vector<UnitState> before(units_.size());
  for (size_t v = 0; v < units_.size(); ++v) before[v] = units_[v].state;
  start_gather(u);
  finish_gather(u);
  prefetch_around(u, /*forward=*/!in_backward);
  for (size_t v = 0; v < units_.size(); ++v) {
    if (before[v] == UnitState::kReleased && units_[v].state != UnitState::kReleased) {
      graph_gathered_[v] = true;  // its prefetch
    }
  }
}

void UnitScheduler::after_graph_read(int64_t u) {
  if (graph_unit_ != u || --graph_reads_left_ > 0) {
    return;
  }
  graph_unit_ = -1;  // every parameter of u read once: the graph holds its copies, the buffer goes
  if (graph_gathered_[u]) {
    release(u);
    graph_gathered_[u] = units_[u].state != UnitState::kReleased;  // pinned: still held
  }
}

void UnitScheduler::end_graph_forward() {
  finish_forward_order();
  graph_unit_ = -1;
  for (int64_t u = 0; u < static_cast<int64_t>(graph_gathered_.size()); ++u) {
    if (graph_gathered_[u]) {
      release(u);  // prefetched for reads that did not come, or the last unit read
      graph_gathered_[u] = false;
    }
  }
}

} // namespace zero_ext
