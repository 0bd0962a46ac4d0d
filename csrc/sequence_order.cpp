// SequenceOrder (sequence_order.h): the model's sequences advanced together,
// their collectives issued in submission order across groups.
#include "sequence_order.h"

#include <algorithm>
#include <mutex>

#include "collective_sequence.h"

namespace zero_ext {

void SequenceOrder::add(CollectiveSequence* sequence) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  sequences_.push_back(sequence);
}

void SequenceOrder::remove(CollectiveSequence* sequence) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  sequences_.erase(std::remove(sequences_.begin(), sequences_.end(), sequence), sequences_.end());
  order_.erase(std::remove_if(order_.begin(), order_.end(), [&](const auto& t) { return t.first == sequence; }),
               order_.end());
}

void SequenceOrder::advance() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (advancing_) {
    return;  // a completion callback inline in the loop below: the loop sees it
  }
  advancing_ = true;
  try {
    advance_locked();
  } catch (...) {
    advancing_ = false;
    throw;
  }
  advancing_ = false;
}

void SequenceOrder::advance_locked() {
  while (true) {
    bool progress = false;
    for (CollectiveSequence* sequence : sequences_) {
      if (sequence->failed()) continue;
      progress = sequence->verify_completed_locked() || progress;
      progress = sequence->decide_all_locked() || progress;
    }
    // Out in submission order, across the groups in order; a failed
    // sequence's collectives never go out and hold nothing back.
    while (!order_.empty()) {
      auto [sequence, work] = order_.front();
      if (!sequence->failed() && !sequence->issue_front_locked(work)) break;
      order_.pop_front();
      progress = true;
    }
    for (CollectiveSequence* sequence : sequences_) {  // the others: in their own order
      while (!sequence->in_order_ && !sequence->failed() && sequence->issue_next_locked()) {
        progress = true;
      }
    }
    if (!progress) break;
  }
}

} // namespace zero_ext
