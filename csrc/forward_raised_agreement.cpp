// A forward of the model that raised: whether the ranks stand at the same
// point (ShardedModel::forward_raised, below), compared through the store
// the stall diagnosis uses (Communicator::agree_where_forward_raised).
#include <algorithm>
#include <chrono>
#include <sstream>
#include <thread>
#include <vector>

#include "communicator.h"
#include "sharded_model.h"
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

// Every rank's post of this occurrence (this rank's own: `now`); whether all posted.
bool Communicator::read_raised_posts(const std::string& prefix, int64_t me, const RaisedPost& now,
                                     std::vector<RaisedPost>& raised) const {
  bool all = true;
  for (int64_t m = 0; m < static_cast<int64_t>(raised.size()); ++m) {
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
  return all;
}

// The stalls of the ranks that did not raise; whether one of them waits
// beyond where a rank that raised stopped (it went on: the ranks are apart).
bool Communicator::read_stalls_past_raised(const std::vector<RaisedPost>& raised,
                                           std::vector<StallPost>& stalls) const {
  bool passed = false;
  for (int64_t m = 0; m < static_cast<int64_t>(stalls.size()); ++m) {
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
  return passed;
}

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
      const bool all = read_raised_posts(prefix, me, now, raised);
      const bool passed = read_stalls_past_raised(raised, stalls);
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
  if (!outcome.in_step) {
    // The posts as they stand now: a rank that adopted another's decision
    // may not have read the stall post that decided it (seen under load).
    try {
      read_raised_posts(prefix, me, mine(), raised);
      read_stalls_past_raised(raised, stalls);
    } catch (const StoreUnreachable&) {
      // what was read before stands
    }
    outcome.positions = describe_raised_positions(raised, stalls, timed_out, limit);
  }
  return outcome;
}

std::string Communicator::describe_raised_positions(const std::vector<RaisedPost>& raised,
                                                    const std::vector<StallPost>& stalls, bool timed_out,
                                                    std::chrono::milliseconds limit) const {
  std::ostringstream out;
  for (int64_t m = 0; m < static_cast<int64_t>(raised.size()); ++m) {
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
  return out.str();
}

// [Note: a forward that raised]
// A forward of the model that raises once its first collectives went out
// (stage 3 gathers and prefetches) may leave the ranks out of step. Raised
// on some ranks only (an input of another shape there, data-dependent
// code), this rank's collectives are a prefix of the others': they go on
// with the rest of that forward, its backward and step, and if this rank
// caught the error and went on, its next forward's gathers would pair with
// whatever the others issue next (when that is the same collective, the
// header checks pass: training went on with ranks one forward apart).
// Raised on every rank at the same point (the same bad batch everywhere,
// FSDP2's reset after an exception, accelerate's find_executable_batch_size
// retrying smaller after an out-of-memory error), nothing is out of step.
// Which one it was, the ranks establish through the store the stall
// diagnosis uses, before the error leaves the forward: each rank whose
// forward raised posts how many collectives it submitted on each group
// (Communicator::agree_where_forward_raised) and waits, at most the model's
// timeout, for
// - every rank's post: the same counts everywhere and training goes on,
//   anything else and every rank breaks;
// - a rank that did not raise: it went on, and once its wait for a
//   collective that a rank which raised never issues stalls, it posts where
//   it waits ([Note: stall diagnosis] in communicator.h); a rank that raised
//   reads that and breaks;
// - another rank's report, raised as it is.
// The first rank to conclude writes the decision once (DiagnosisStore::
// set_once) and every rank abides by it, so a rank that gave up waiting and
// one that saw every post a moment later never decide apart. Without timed
// waits (NCCL) a rank that went on posts nothing, so the wait is bounded by
// the ranks' skew (twice the stall interval, at least 10 s) rather than the
// timeout: a rank that alone ran out of memory raises within seconds, and
// torchrun then ends the others.
// A rank that breaks refuses every later entry point with the report
// (check_usable()) and posts it where the others' stalled waits read it, so
// every rank ends with it within the stall interval, not the timeout. A
// forward that had submitted nothing (a check before its first gather;
// stages 0-2; one rank) leaves nothing out of step, and the model goes on.
void ShardedModel::forward_raised(std::string error) {
  if (forward_marks_.empty()) {
    return;
  }
  const int64_t before = forward_marks_.back();
  forward_marks_.pop_back();
  if (collectives_submitted() == before || failed() || round_.state() == RoundState::kBroken) {
    return;  // nothing issued, or an earlier failure already stops this rank with its own report
  }
  const int64_t me = mesh_.rank();
  const std::string where =
      (units_ ? units_->forward_position() : std::string("in its forward")) + " (" + error + ")";
  auto position = [this, &where] {
    RaisedPost post;
    post.present = true;
    const Communicator* data[kDataSlots] = {&comm_, &gather_comm_, &replica_comm_, &regather_comm_, &expert_comm_};
    post.settled = true;
    for (int g = 0; g < kDataSlots; ++g) {
      post.submitted[g] = data[g]->submitted();
      post.settled = post.settled && data[g]->issued() == data[g]->submitted();
    }
    post.issued = comm_.issued_counts();
    post.where = where;
    return post;
  };
  const auto limit = std::chrono::milliseconds(static_cast<int64_t>(raised_forward_limit_s_ * 1000));
  const RaisedForwardOutcome outcome = comm_.agree_where_forward_raised(++raised_forwards_, position, limit);
  if (outcome.in_step) {
    return;  // every rank raised at the same point: the next forward starts afresh everywhere
  }
  std::string report = outcome.report;
  if (report.empty()) {
    report = "zero_ext: rank " + std::to_string(me) + " cannot go on training: the model's forward raised on it " +
             where + " after zero_ext had issued the first collectives of that forward (stage 3 parameter " +
             "gathers), and the ranks did not all raise at that point:" + outcome.positions +
             "\nTheir collectives are out of step, so every rank stops with this error instead of waiting out the "
             "timeout. Fix what raised on rank " + std::to_string(me) + " (an input of another shape or type on "
             "some ranks only, data-dependent code) and restart every rank from the last checkpoint: catching "
             "the error and going on cannot work, as this rank's next collectives would pair with other ones of "
             "the other ranks. (A forward that raises alike on every rank, at the same point, leaves the ranks "
             "in step: zero_ext finds that out and training goes on.)";
  }
  round_.mark_unusable(report);
  comm_.post_report(report);  // the model's groups share one report key; the first report stays
}

}  // namespace zero_ext
