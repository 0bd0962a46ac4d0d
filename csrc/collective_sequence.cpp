// CollectiveSequence (collective_sequence.h): a group's collectives
// submitted, decided against the agreed plan or a header, and issued once
// their headers are verified; rounds, plans and predictions. The headers'
// words and the reports are in sequence_headers.cpp.
#include "collective_sequence.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "sequence_headers.h"

namespace zero_ext {

using namespace header_words;

int64_t round_key(RoundKind kind, int64_t detail) {
  return (static_cast<int64_t>(kind) << 32) | (detail & 0xffffffff);
}

uint64_t plan_hash(const std::vector<uint64_t>& plan) {
  return hash_words(plan.size(), reinterpret_cast<const int64_t*>(plan.data()), plan.size());
}

// --- CollectiveSequence -------------------------------------------------------------------

CollectiveSequence::CollectiveSequence(Communicator& data, std::string group_description,
                                       const std::string& header_group_name, GroupSlot header_slot,
                                       std::shared_ptr<IssueCounts> counts, std::shared_ptr<SequenceOrder> order,
                                       bool in_order,
                                       std::function<std::string(const CollectiveId&, const std::string&)> describe,
                                       std::function<Progress()> progress)
    : data_(data),
      group_description_(std::move(group_description)),
      headers_(std::make_unique<Communicator>(header_group_name, header_slot, std::move(counts))),
      describe_(std::move(describe)),
      progress_(std::move(progress)),
      order_(std::move(order)),
      in_order_(in_order) {
  TORCH_CHECK(headers_->size() == data_.size() && headers_->rank() == data_.rank(),
              "zero_ext internal: the header group does not span the data group's ranks");
  order_->add(this);
}

void CollectiveSequence::detach() {
  std::deque<Item> queue, dropped;  // freed on this thread, after the lock (see dropped_)
  std::lock_guard<std::recursive_mutex> lock(order_->mutex_);
  detached_ = true;
  queue.swap(queue_);
  dropped.swap(dropped_);
  order_->remove(this);
}

void CollectiveSequence::release_dropped() {
  if (!any_dropped_.exchange(false)) {
    return;  // the usual case: one atomic read per submit
  }
  std::deque<Item> dropped;  // freed after the lock is released
  std::lock_guard<std::recursive_mutex> lock(order_->mutex_);
  dropped.swap(dropped_);
}

void CollectiveSequence::begin_round(int64_t key, const std::string& label) {
  std::lock_guard<std::recursive_mutex> lock(order_->mutex_);
  pending_round_ = true;
  pending_key_ = key;
  pending_label_ = label;
}

c10::intrusive_ptr<c10d::Work> CollectiveSequence::submit(const CollectiveId& id, const std::string& label,
                                                          c10::Device device,
                                                          std::function<c10::intrusive_ptr<c10d::Work>()> issue) {
  ReleaseDroppedOnExit release{this};  // runs after the lock below is released
  std::lock_guard<std::recursive_mutex> lock(order_->mutex_);
  TORCH_CHECK(!failed_.load(), report_);
  TORCH_CHECK(!detached_, "zero_ext internal: a collective submitted to a group that is gone");
  // Steady state: the agreed plan's next collective, nothing waiting before
  // it (in this group, or across the model's groups when in order): issued
  // at once, with no bookkeeping beyond the plan's position.
  const uint64_t h = id.hash();
  if (!pending_round_ && any_round_ && queue_.empty() && (!in_order_ || order_->order_.empty()) &&
      position_ < plan_.size() && plan_[position_] == h &&
      std::none_of(exchanges_.begin(), exchanges_.end(), [&](const Exchange& e) {
        return !e.ahead && !e.verified && e.serial <= last_gating_serial_;
      })) {
    recorded_.push_back(h);
    ++position_;
    ++decided_collectives_;
    return issue();
  }
  if (pending_round_ || !any_round_) {
    Item round;
    round.round = true;
    round.key = pending_round_ ? pending_key_ : 0;
    round.label = pending_round_ ? pending_label_ : std::string();
    pending_round_ = false;
    any_round_ = true;
    queue_.push_back(std::move(round));
  }
  Item item;
  item.id = id;
  item.label = label;
  item.issue = std::move(issue);
  if (!device.is_cpu()) {
    item.stream = c10::impl::VirtualGuardImpl(device.type()).getStream(device);
  }
  item.handle = c10::make_intrusive<SequencedWork>(weak_from_this());
  c10::intrusive_ptr<SequencedWork> handle = item.handle;
  queue_.push_back(std::move(item));
  if (in_order_) {
    order_->order_.emplace_back(this, handle.get());
  }
  order_->advance();
  TORCH_CHECK(!failed_.load(), report_);
  if (auto issued = handle->issued()) {
    return issued;  // the usual case: agreed on, issued at once
  }
  return handle;
}

c10::intrusive_ptr<c10d::Work> CollectiveSequence::issued_work(const c10::intrusive_ptr<c10d::Work>& work,
                                                               const std::function<std::string()>& what) {
  auto* handle = dynamic_cast<SequencedWork*>(work.get());
  if (!handle) {
    return work;
  }
  ReleaseDroppedOnExit release{this};
  while (true) {
    advance();
    TORCH_CHECK(!failed_.load(), report_);
    if (auto issued = handle->issued()) {
      return issued;
    }
    if (auto error = handle->exception()) {
      std::rethrow_exception(error);
    }
    // A header not verified yet holds it back: its own group's first, else
    // one of another group of this model, whose collective goes out first.
    c10::intrusive_ptr<c10d::Work> blocker;
    CollectiveSequence* of = nullptr;
    std::string about;
    {
      std::lock_guard<std::recursive_mutex> lock(order_->mutex_);
      std::vector<CollectiveSequence*> candidates{this};
      for (CollectiveSequence* other : order_->sequences_) {
        if (other != this) candidates.push_back(other);
      }
      for (CollectiveSequence* sequence : candidates) {
        for (const Exchange& exchange : sequence->exchanges_) {
          if (!exchange.verified) {
            blocker = exchange.work;
            of = sequence;
            about = sequence->render(exchange.mine);
            break;
          }
        }
        if (blocker) break;
      }
    }
    TORCH_INTERNAL_ASSERT(blocker, "zero_ext internal: a collective waits with no header in flight");
    of->headers_->wait(blocker, [&] {
      return "the header exchange of " + of->group_description_ + " (" + about + ") before " + what();
    });
  }
}

void CollectiveSequence::advance() {
  order_->advance();
}

bool CollectiveSequence::decide_all_locked() {
  bool any = false;
  for (Item& item : queue_) {
    if (item.decided) continue;
    if (!decide_locked(item)) break;
    any = true;
  }
  return any;
}

CollectiveSequence::Exchange& CollectiveSequence::send_locked(Header mine, bool ahead) {
  Exchange exchange;
  exchange.serial = serial_++;
  exchange.ahead = ahead;
  exchange.mine = std::move(mine);
  exchange.in = at::tensor(exchange.mine, at::kLong);
  exchange.out = at::empty({data_.size() * kWords}, at::kLong);
  exchange.work = headers_->all_gather(exchange.out, exchange.in, Purpose::kHeader);
  exchanges_.push_back(std::move(exchange));
  watch(exchanges_.back().work);
  return exchanges_.back();
}

void CollectiveSequence::watch(const c10::intrusive_ptr<c10d::Work>& work) {
  // The completion callback runs on a gloo thread: the rank goes on with
  // what it submitted even while its main thread waits elsewhere (another
  // group or model), as a collective issued at once would have.
  std::weak_ptr<CollectiveSequence> weak = weak_from_this();
  try {
    work->getFuture()->addCallback([weak](c10::ivalue::Future& /*future*/) {
      if (auto sequence = weak.lock()) {
        try {
          sequence->advance();
        } catch (...) {
          // Failures are recorded in the sequence and raised where it is waited on.
        }
      }
    });
  } catch (const std::exception&) {
    // No future on this backend: waits and polls drive the sequence.
  }
}

bool CollectiveSequence::verify_completed_locked() {
  bool any = false;
  for (Exchange& exchange : exchanges_) {
    if (exchange.verified || !exchange.work->isCompleted()) continue;
    any = true;
    if (auto error = exchange.work->exception()) {
      std::string cause = "unknown";
      try {
        std::rethrow_exception(error);
      } catch (const c10::Error& e) {
        cause = e.what_without_backtrace();
      } catch (const std::exception& e) {
        cause = e.what();
      }
      fail_locked("zero_ext: the header exchange of " + group_description_ + " (" + render(exchange.mine) +
                  ") failed on rank " + std::to_string(data_.rank()) + " of " + std::to_string(data_.size()) +
                  " (a peer may have died, raised, or taken a different code path): " + cause);
      return true;
    }
    const std::vector<Header> all = split(exchange.out);
    for (const Header& theirs : all) {
      if (!std::equal(exchange.mine.begin(), exchange.mine.begin() + kAlignedWords, theirs.begin())) {
        fail_locked(all);
        return true;
      }
    }
    exchange.verified = true;
    if (exchange.ahead) {
      exchange.predicted = std::all_of(all.begin(), all.end(), [&](const Header& theirs) {
        return std::equal(theirs.begin() + kNextKey, theirs.begin() + kNextPlanLength + 1,
                          exchange.mine.begin() + kNextKey);
      });
    }
  }
  // Keep only what is still in flight, and the AHEAD the next round start reads.
  exchanges_.erase(std::remove_if(exchanges_.begin(), exchanges_.end(),
                                  [&](const Exchange& e) { return e.verified && e.serial != last_ahead_serial_; }),
                   exchanges_.end());
  return any;
}

std::vector<uint64_t> CollectiveSequence::plan_of(int64_t key) const {
  auto it = history_.find(key);
  return it == history_.end() ? std::vector<uint64_t>() : it->second;
}

int64_t CollectiveSequence::predict_next() const {
  constexpr size_t kMaxContext = 32;
  const size_t n = round_log_.size();
  int64_t best = 0;
  size_t best_length = 0;
  for (size_t j = 0; j + 1 < n; ++j) {  // round j as the current one: round j + 1 comes next
    size_t length = 0;
    while (length < kMaxContext && length <= j && round_log_[j - length] == round_log_[n - 1 - length]) {
      ++length;
    }
    if (length > 0 && length >= best_length) {  // ties: the most recent
      best_length = length;
      best = round_log_[j + 1];
    }
  }
  return best;
}

bool CollectiveSequence::decide_locked(Item& item) {
  return item.round ? decide_round_locked(item) : decide_collective_locked(item);
}

bool CollectiveSequence::decide_collective_locked(Item& item) {
  const uint64_t h = item.id.hash();
  if (position_ >= plan_.size() || plan_[position_] != h) {
    Header mine = header(kSingle, decided_collectives_);
    mine[kPurpose] = static_cast<int64_t>(item.id.purpose);
    mine[kSubject] = item.id.subject;
    mine[kOp] = static_cast<int64_t>(item.id.op);
    mine[kNumel] = item.id.numel;
    mine[kDtype] = item.id.dtype;
    set_label(mine, item.label);
    last_gating_serial_ = send_locked(std::move(mine), /*ahead=*/false).serial;
    ++blocking_headers_;
  }
  item.gate = last_gating_serial_;
  recorded_.push_back(h);
  ++position_;
  ++decided_collectives_;
  item.decided = true;
  return true;
}

bool CollectiveSequence::decide_round_locked(Item& item) {
  // A round start needs the AHEAD exchange of the last one: whether every
  // rank predicted this round is the same everywhere only once it is in.
  const Exchange* ahead = nullptr;
  for (const Exchange& exchange : exchanges_) {
    if (exchange.serial == last_ahead_serial_) ahead = &exchange;
  }
  if (ahead && !ahead->verified) {
    return false;
  }
  const bool issued_its_plan = round_open_ && position_ == plan_.size();
  if (round_open_) {
    history_[key_] = std::move(recorded_);
  }
  const std::vector<uint64_t> plan = plan_of(item.key);
  const bool predicted = ahead && ahead->predicted && ahead->mine[kNextKey] == item.key &&
                         ahead->mine[kNextPlanHash] == static_cast<int64_t>(plan_hash(plan)) &&
                         ahead->mine[kNextPlanLength] == static_cast<int64_t>(plan.size());
  key_ = item.key;
  label_ = item.label.empty() ? round_name(key_) : item.label;
  plan_ = plan;
  plan_hash_ = plan_hash(plan_);
  ++round_index_;
  position_ = 0;
  recorded_.clear();
  if (!(predicted && issued_its_plan)) {
    Header mine = header(kRound, decided_collectives_);
    set_label(mine, label_);
    last_gating_serial_ = send_locked(std::move(mine), /*ahead=*/false).serial;
    ++blocking_headers_;
  }
  round_open_ = true;
  constexpr size_t kLogLimit = 512;
  if (round_log_.size() >= kLogLimit) {
    round_log_.erase(round_log_.begin(), round_log_.begin() + kLogLimit / 2);
  }
  round_log_.push_back(key_);
  // Sent at every round start, read at the next: what this rank predicts
  // comes after this round.
  Header next = header(kAhead, decided_collectives_);
  const int64_t next_key = predict_next();
  if (next_key != 0) {
    const std::vector<uint64_t> next_plan = plan_of(next_key);
    next[kNextKey] = next_key;
    next[kNextPlanHash] = static_cast<int64_t>(plan_hash(next_plan));
    next[kNextPlanLength] = static_cast<int64_t>(next_plan.size());
  }
  set_label(next, label_);
  last_ahead_serial_ = send_locked(std::move(next), /*ahead=*/true).serial;
  ++ahead_headers_;
  item.decided = true;
  return true;
}

bool CollectiveSequence::issue_front_locked(const c10d::Work* work) {
  while (!queue_.empty() && queue_.front().round && queue_.front().decided) {
    queue_.pop_front();  // a round start has no data of its own
  }
  if (queue_.empty() || queue_.front().handle.get() != work) {
    return queue_.empty();  // failed and cleared: nothing to hold back
  }
  return issue_next_locked();
}

bool CollectiveSequence::issue_next_locked() {
  while (!queue_.empty() && queue_.front().round && queue_.front().decided) {
    queue_.pop_front();
  }
  if (queue_.empty()) {
    return false;
  }
  Item& item = queue_.front();
  if (!item.decided) {
    return false;
  }
  const bool gated = std::any_of(exchanges_.begin(), exchanges_.end(), [&](const Exchange& e) {
    return !e.ahead && !e.verified && e.serial <= item.gate;
  });
  if (gated) {
    return false;
  }
  std::optional<c10::StreamGuard> on_its_stream;
  if (item.stream) on_its_stream.emplace(*item.stream);
  try {
    item.handle->set_issued(item.issue());
  } catch (...) {
    item.handle->set_failed(std::current_exception());
    dropped_.push_back(std::move(item));  // not issued: its tensors go to the caller's thread (see dropped_)
    any_dropped_ = true;
  }
  queue_.pop_front();
  return true;
}

std::string CollectiveSequence::failure_report() const {
  std::lock_guard<std::recursive_mutex> lock(order_->mutex_);
  return failed_.load() ? report_ : std::string();
}

void CollectiveSequence::fail_locked(const std::string& report) {
  if (failed_.exchange(true)) {
    return;
  }
  report_ = report;
  data_.post_report(report);
  // Headers in flight that no rank may ever pair now (one sent ahead, say)
  // would hold the header group's destructor: [Note: abandoned collectives].
  std::vector<c10::intrusive_ptr<c10d::Work>> sent;
  for (const Exchange& exchange : exchanges_) {
    sent.push_back(exchange.work);
  }
  headers_->abandon(sent);
  for (Item& item : queue_) {
    if (item.handle) item.handle->set_failed(std::make_exception_ptr(std::runtime_error(report)));
    dropped_.push_back(std::move(item));  // freed by the caller's thread, not here (see dropped_)
  }
  queue_.clear();
  any_dropped_ = !dropped_.empty();
}

} // namespace zero_ext
