#pragma once
// SequenceOrder: the collectives of one model's checked groups go out in the
// order they were submitted, across groups, under one lock ([Note:
// collectives that prove what they are] in collective_sequence.h).

#include <deque>
#include <mutex>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/Work.hpp>

namespace zero_ext {

class CollectiveSequence;

// The sequences of one model's groups: one lock, and the order in which
// their collectives go out (submission order, across groups).
class SequenceOrder {
 public:
  void add(CollectiveSequence* sequence);
  void remove(CollectiveSequence* sequence);
  // Verifies, decides and issues what it can, for every sequence; never waits.
  void advance();

 private:
  friend class CollectiveSequence;
  void advance_locked();
  std::recursive_mutex mutex_;  // a completion callback may run inline, under it
  bool advancing_ = false;      // a callback inline in advance() leaves it to the loop
  std::vector<CollectiveSequence*> sequences_;
  std::deque<std::pair<CollectiveSequence*, const c10d::Work*>> order_;  // collectives not issued yet
};

} // namespace zero_ext
