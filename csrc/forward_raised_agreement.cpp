// Communicator::agree_where_forward_raised: the ranks compare where a
// forward that raised left them ([Note: a forward that raised] in
// sharded_model.cpp), through the store the stall diagnosis uses.
#include <chrono>
#include <sstream>
#include <thread>
#include <vector>

#include "communicator.h"
#include "stall_post.h"

namespace zero_ext {

std::array<int64_t, kGroupSlots> Communicator::issued_counts() const {
  std::array<int64_t, kGroupSlots> out{};
  for (int g = 0; g < kGroupSlots; ++g) out[g] = (*counts_)[g].load();
  return out;
}

namespace {

// Whether stalled rank `m` waits for a collective that a rank which raised
// will never issue: that rank stopped before it, so `m` went past the point
// where the forward raised. A data group's position compares with what the
// raised rank submitted (final: it submits nothing more); a header group's
// with what it issued, once every collective it submitted went out.
bool waits_for_a_stopped_rank(const StallPost& stall, const RaisedPost& raised) {
  if (stall.slot < 0 || stall.slot >= kGroupSlots) {
    return false;
  }
  if (stall.slot < kDataSlots) {
    return raised.submitted[stall.slot] <= stall.seq;
  }
  return raised.settled && raised.issued[stall.slot] <= stall.seq;
}

std::string describe_raised(const RaisedPost& post) {
  std::ostringstream out;
  out << "its forward raised " << post.where << " after submitting";
  const char* sep = " ";
  for (int g = 0; g < kDataSlots; ++g) {
    out << sep << post.submitted[g] << " " << slot_name(g);
    sep = ", ";
  }
  return out.str();
}

}  // namespace

RaisedForwardOutcome Communicator::agree_where_forward_raised(int64_t occurrence,
                                                              const std::function<RaisedPost()>& mine,
                                                              std::chrono::milliseconds limit) const {
  RaisedForwardOutcome outcome;
  if (!store_ || raised_keys_.empty()) {
    outcome.positions = "\n  (no store to compare the ranks' positions through)";
    return outcome;
  }
  const int64_t me = mesh_ranks_[rank_];
  const int64_t world = replicas_ * shard_size_;
  const std::string prefix = raised_keys_ + std::to_string(occurrence) + "/";
  const std::string decision_key = prefix + "decision";
  const std::vector<uint8_t> kInStep = {'1'}, kApart = {'0'};
  std::vector<RaisedPost> raised(world);
  std::vector<StallPost> stalls(world);
  std::string posted;
  const auto until = std::chrono::steady_clock::now() + limit;
  bool timed_out = false;
  std::vector<uint8_t> decided;
  try {
    while (decided.empty()) {
      const RaisedPost now = mine();
      const std::string text = format_raised_post(now);
      if (text != posted) {  // re-posted when this rank's issued counts settle
        store_->set(prefix + "rank" + std::to_string(me), std::vector<uint8_t>(text.begin(), text.end()));
        posted = text;
      }
      outcome.report = posted_report();
      if (!outcome.report.empty()) {
        return outcome;
      }
      if (store_->check({decision_key})) {  // another rank decided: every rank abides by the first decision
        decided = store_->get(decision_key);
        break;
      }
      bool all = true;
      for (int64_t m = 0; m < world; ++m) {
        raised[m] = RaisedPost();
        const std::string key = prefix + "rank" + std::to_string(m);
        if (m == me) {
          raised[m] = now;
        } else if (store_->check({key})) {
          const auto bytes = store_->get(key);
          raised[m] = parse_raised_post(std::string(bytes.begin(), bytes.end()));
        }
        all = all && raised[m].present;
      }
      bool passed = false;  // a rank waits beyond where a rank that raised stopped
      for (int64_t m = 0; m < world; ++m) {
        stalls[m] = StallPost();
        const std::string key = stall_keys_ + std::to_string(m);
        if (raised[m].present || !store_->check({key})) {
          continue;
        }
        const auto bytes = store_->get(key);
        stalls[m] = parse_stall_post(std::string(bytes.begin(), bytes.end()));
        if (!stalls[m].present) {
          continue;
        }
        for (int64_t q : members_of(stalls[m].slot, m)) {
          passed = passed || (q != m && raised[q].present && waits_for_a_stopped_rank(stalls[m], raised[q]));
        }
      }
      timed_out = !all && !passed && std::chrono::steady_clock::now() >= until;
      if (all || passed || timed_out) {
        bool same = all;
        for (int64_t m = 0; same && m < world; ++m) same = raised[m].submitted == raised[me].submitted;
        // The first rank to decide decides for all: a rank that gave up
        // waiting and one that saw every post a moment later agree.
        decided = store_->set_once(decision_key, same ? kInStep : kApart);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const StoreUnreachable& e) {
    outcome.positions = std::string("\n  (the ranks' positions could not be compared: ") + e.what() + ")";
    return outcome;
  }
  outcome.in_step = decided == kInStep;
  if (outcome.in_step) {
    return outcome;
  }
  std::ostringstream out;
  for (int64_t m = 0; m < world; ++m) {
    out << "\n  rank " << m << ": ";
    if (raised[m].present) {
      out << describe_raised(raised[m]);
    } else if (stalls[m].present) {
      out << "its forward did not raise; it went on and waits in " << stalls[m].what << " (collective #"
          << stalls[m].seq << " of the " << slot_name(stalls[m].slot) << ")";
    } else {
      out << "reported nothing" << (timed_out ? " within " + std::to_string(limit.count() / 1000) + " s" : "")
          << " (its forward did not raise there, or it is busy elsewhere, or gone)";
    }
  }
  outcome.positions = out.str();
  return outcome;
}

}  // namespace zero_ext
