// The stall diagnosis of a Communicator's host waits ([Note: stall
// diagnosis] and [Note: whereabouts] in communicator.h): what a stalled wait
// posts to the model's store, the stuck set computed from every rank's
// posts, and the errors that end a wait no rank can finish. Apart from the
// collectives and their waits (communicator.cpp): none of this runs unless a
// wait stalls, but for the report a failed sequence check posts. The same
// keys serve the agreement of a forward that raised
// (forward_raised_agreement.cpp).
#include "communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "collective_sequence.h"
#include "stall_post.h"

namespace zero_ext {

void Communicator::enable_stall_diagnosis(double seconds, const std::string& key_space,
                                          std::vector<int64_t> mesh_ranks, int64_t replicas, int64_t shard_size,
                                          bool timed_waits, int64_t subgroup_size) {
  if (!group_) {
    return;
  }
  TORCH_CHECK(static_cast<int64_t>(mesh_ranks.size()) == size_, "zero_ext internal: ", mesh_ranks.size(),
              " mesh ranks for a group of ", size_);
  if (sequence_) {  // header waits are host waits (gloo) whatever the data's device
    sequence_->headers().enable_stall_diagnosis(seconds, key_space, mesh_ranks, replicas, shard_size, true,
                                                subgroup_size);
  }
  mesh_ranks_ = std::move(mesh_ranks);
  replicas_ = replicas;
  shard_size_ = shard_size;
  subgroup_size_ = subgroup_size;
  // A model's groups each prefix their store; the base store lets a rank
  // stalled on the gather group see one stalled on the reduction group.
  c10::intrusive_ptr<c10d::Store> store = group_->getStore();
  if (auto prefixed = c10::dynamic_intrusive_pointer_cast<c10d::PrefixStore>(store)) {
    store = prefixed->getUnderlyingNonPrefixStore();
  }
  store_ = std::make_shared<DiagnosisStore>(std::move(store));
  stall_interval_ = std::chrono::milliseconds(timed_waits ? static_cast<int64_t>(seconds * 1000) : 0);
  stall_keys_ = "zero_ext_stall/" + key_space + "/rank";
  query_key_ = "zero_ext_stall/" + key_space + "/query";
  whereabouts_keys_ = "zero_ext_stall/" + key_space + "/where";
  report_key_ = "zero_ext_stall/" + key_space + "/report";
  raised_keys_ = "zero_ext_stall/" + key_space + "/raised";
}

void Communicator::set_expert_partition(std::vector<int64_t> group_of_mesh_rank) {
  if (sequence_) sequence_->headers().set_expert_partition(group_of_mesh_rank);
  expert_group_of_ = std::move(group_of_mesh_rank);
}

std::vector<int64_t> Communicator::members_of(int slot, int64_t mesh_rank) const {
  std::vector<int64_t> out;
  const bool expert = slot == static_cast<int>(GroupSlot::kExpert) ||
                      slot == static_cast<int>(GroupSlot::kExpertHeaders);
  if (expert && mesh_rank < static_cast<int64_t>(expert_group_of_.size())) {
    for (int64_t m = 0; m < static_cast<int64_t>(expert_group_of_.size()); ++m) {
      if (expert_group_of_[m] == expert_group_of_[mesh_rank]) out.push_back(m);
    }
    return out;
  }
  const bool across_replicas = slot == static_cast<int>(GroupSlot::kReplica) ||
                               slot == static_cast<int>(GroupSlot::kReplicaHeaders);
  const bool in_subgroup = slot == static_cast<int>(GroupSlot::kRegather) ||
                           slot == static_cast<int>(GroupSlot::kRegatherHeaders);
  const int64_t row = mesh_rank / shard_size_;
  const int64_t column = mesh_rank % shard_size_;
  if (across_replicas) {
    for (int64_t r = 0; r < replicas_; ++r) out.push_back(r * shard_size_ + column);
  } else if (in_subgroup && subgroup_size_ > 0) {
    const int64_t first = row * shard_size_ + column / subgroup_size_ * subgroup_size_;
    for (int64_t s = 0; s < subgroup_size_; ++s) out.push_back(first + s);
  } else {
    for (int64_t s = 0; s < shard_size_; ++s) out.push_back(row * shard_size_ + s);
  }
  return out;
}

void Communicator::post_report(const std::string& report) const {
  failed_ = true;
  if (store_ && !report_key_.empty()) {
    try {
      if (!store_->check({report_key_})) {  // the first report names the first difference
        store_->set(report_key_, std::vector<uint8_t>(report.begin(), report.end()));
      }
    } catch (const std::exception&) {
      // The store is gone with rank 0: this rank's own error still says it all.
    }
  }
}

std::string Communicator::posted_report() const {
  if (!store_ || report_key_.empty()) {
    return {};
  }
  try {
    if (!store_->check({report_key_})) {
      return {};
    }
    const auto bytes = store_->get(report_key_);
    return std::string(bytes.begin(), bytes.end());
  } catch (const std::exception&) {
    return {};
  }
}

int64_t Communicator::stall_queries() const {
  if (!store_ || size_ < 2) {
    return 0;
  }
  return store_->add(query_key_, 0);  // reads the counter (made at 0 if absent)
}

void Communicator::post_whereabouts(int64_t query, bool blocked, const std::string& where) const {
  if (!store_ || size_ < 2) {
    return;
  }
  const std::string answer = std::to_string(query) + (blocked ? "|1|" : "|0|") + where;
  store_->set(whereabouts_keys_ + std::to_string(mesh_ranks_[rank_]),
              std::vector<uint8_t>(answer.begin(), answer.end()));
}

bool Communicator::read_whereabouts(const std::vector<std::string>& posts, int64_t query,
                                    std::vector<std::string>& whereabouts) const {
  bool any = false;
  for (int64_t r = 0; r < size_; ++r) {
    if (r == rank_ || !posts[r].empty()) {
      continue;  // stalled in zero_ext: the posts speak for it
    }
    const std::string key = whereabouts_keys_ + std::to_string(mesh_ranks_[r]);
    if (!store_->check({key})) {
      return false;
    }
    const auto bytes = store_->get(key);
    const std::string answer(bytes.begin(), bytes.end());
    const auto bar = answer.find('|');
    // Only an answer to this query (or a later one) says where the rank is now.
    if (bar == std::string::npos || answer.size() < bar + 3 || std::stoll(answer.substr(0, bar)) < query ||
        answer[bar + 1] != '1') {
      return false;
    }
    whereabouts[r] = answer.substr(bar + 3);
    any = true;
  }
  return any;
}

void Communicator::wait_out_stall(const c10::intrusive_ptr<c10d::Work>& work,
                                  const std::function<std::string()>& what) const {
  // Raises if the ranks wait for each other, or the ones missing are
  // stuck elsewhere; asks again after 2x, 4x, ... the interval, as a rank
  // busy at the first look may be stuck by the next.
  const std::string described = what();
  const int64_t seq = seq_of(work);
  auto pause = stall_interval_;
  while (true) {
    try {
      diagnose_stall(work, seq, described);
    } catch (const StoreUnreachable&) {
      break;  // its host is gone (a peer died): the wait after this fails, or completes
    }
    if (work->isCompleted()) {
      break;
    }
    pause *= 2;
    try {
      work->wait(pause);
    } catch (const std::exception&) {
    }
    if (work->isCompleted()) {
      break;
    }
  }
}

void Communicator::clear_stall_post() const {
  try {
    store_->set(stall_keys_ + std::to_string(mesh_ranks_[rank_]), std::vector<uint8_t>());  // no longer stalled
  } catch (const StoreUnreachable&) {
    // nobody is left to read it
  }
}

namespace {

// The stuck set ([Note: stall diagnosis]): a stalled rank waits for the
// members of its group that have not issued its collective yet. It is stuck
// if every one of those is stalled and stuck itself (a rank that posted
// nothing may still come). The stuck set is the largest one closed under
// that rule: if a rank is in it, the ranks wait for each other and none can
// go on. A rank merely behind (its wait is on a collective the others
// already issued) never counts, however slow it is. By mesh rank.
std::vector<bool> stuck_set(const std::vector<StallPost>& posts,
                            const std::function<std::vector<int64_t>(int, int64_t)>& members_of) {
  const int64_t world = static_cast<int64_t>(posts.size());
  std::vector<bool> stuck(world);
  for (int64_t m = 0; m < world; ++m) stuck[m] = posts[m].present;
  for (bool changed = true; changed;) {
    changed = false;
    for (int64_t m = 0; m < world; ++m) {
      if (!stuck[m]) continue;
      bool waits_for_someone = false;
      bool could_come = false;
      for (int64_t q : members_of(posts[m].slot, m)) {
        if (q == m) continue;
        const bool issued = posts[q].present && posts[q].issued[posts[m].slot] > posts[m].seq;
        if (issued) continue;
        waits_for_someone = true;
        could_come = could_come || !stuck[q];
      }
      if (!waits_for_someone || could_come) {
        stuck[m] = false;
        changed = true;
      }
    }
  }
  return stuck;
}

// Each rank's position, one line each, for the error of ranks stuck waiting for each other.
std::string describe_positions(const std::vector<StallPost>& posts) {
  std::ostringstream out;
  for (size_t m = 0; m < posts.size(); ++m) {
    out << "\n  rank " << m << ": ";
    if (!posts[m].present) {
      out << "not waiting in a zero_ext collective (busy, in another collective, or gone)";
      continue;
    }
    out << "waiting in " << posts[m].what << " (collective #" << posts[m].seq << " of the "
        << slot_name(posts[m].slot) << "; it has issued";
    const char* sep = " ";
    for (int g = 0; g < kGroupSlots; ++g) {
      if (posts[m].issued[g] > 0) {
        out << sep << posts[m].issued[g] << " on the " << slot_name(g);
        sep = ", ";
      }
    }
    out << ")";
  }
  return out.str();
}

}  // namespace

std::string Communicator::post_stall(int64_t seq, const std::string& what) const {
  int64_t issued[kGroupSlots];
  for (int g = 0; g < kGroupSlots; ++g) issued[g] = (*counts_)[g].load();
  const std::string mine = format_stall_post(static_cast<int>(slot_), seq, issued, what);
  store_->set(stall_keys_ + std::to_string(mesh_ranks_[rank_]), std::vector<uint8_t>(mine.begin(), mine.end()));
  return mine;
}

void Communicator::read_stall_posts(const std::string& mine, std::vector<StallPost>& posts) const {
  // Posts are overwritten with "" once a wait completes (never deleted, so
  // a get() cannot block on a key that just vanished), and re-read each
  // round: only ranks stalled right now count.
  const int64_t me = mesh_ranks_[rank_];
  for (int64_t m = 0; m < static_cast<int64_t>(posts.size()); ++m) {
    const std::string key = stall_keys_ + std::to_string(m);
    std::string text;
    if (m == me) {
      text = mine;
    } else if (store_->check({key})) {
      auto bytes = store_->get(key);
      text.assign(bytes.begin(), bytes.end());
    }
    posts[m] = parse_stall_post(text);
  }
}

void Communicator::diagnose_stall(const c10::intrusive_ptr<c10d::Work>& work, int64_t seq,
                                  const std::string& what) const {
  const int64_t me = mesh_ranks_[rank_];
  const std::string mine = post_stall(seq, what);
  const int64_t query = store_->add(query_key_, 1);  // see [Note: whereabouts]
  std::vector<StallPost> posts(replicas_ * shard_size_);
  std::vector<std::string> group_posts(size_);  // this group's members, by group rank
  std::vector<std::string> whereabouts(size_);
  bool deadlock = false;
  bool stranded = false;  // every rank not in a zero_ext wait is blocked in a world collective
  // Long enough for the answering threads (one poll a second) to answer.
  const auto until = std::chrono::steady_clock::now() + std::max(stall_interval_, std::chrono::milliseconds(2500));
  const auto members = [this](int slot, int64_t mesh_rank) { return members_of(slot, mesh_rank); };
  while (true) {
    const bool completed = work->isCompleted();
    const std::string report = posted_report();
    if (!report.empty()) {
      failed_ = true;  // a sequence check on another rank found the difference
      abandon({work});  // every rank stops: none joins it now ([Note: abandoned collectives])
      TORCH_CHECK(false, report);
    }
    read_stall_posts(mine, posts);
    for (int64_t r = 0; r < size_; ++r) {
      group_posts[r] = posts[mesh_ranks_[r]].present ? posts[mesh_ranks_[r]].what : std::string();
    }
    deadlock = stuck_set(posts, members)[me];
    stranded = read_whereabouts(group_posts, query, whereabouts);
    if (deadlock || stranded || completed || std::chrono::steady_clock::now() >= until) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if ((!deadlock && !stranded) || (work->isCompleted() && !work->exception())) {
    return;  // some rank is busy elsewhere or merely behind, or it matched
  }
  failed_ = true;
  abandon({work});  // this rank raises with it in flight: see [Note: abandoned collectives]
  if (!deadlock) {
    raise_stranded(what, group_posts, whereabouts);
  }
  const std::string ranks = describe_positions(posts);
  TORCH_CHECK(false, "zero_ext: the ranks are stalled waiting for each other in collectives that none of them "
              "can finish, so they took different paths through the training loop (a different number of "
              "forward or backward passes or steps, or modules run on some ranks only):", ranks,
              advice(ranks), "\nThis rank stops here instead of waiting out the timeout. ", divergence_causes());
}

void Communicator::raise_stranded(const std::string& what, const std::vector<std::string>& group_posts,
                                  const std::vector<std::string>& whereabouts) const {
  std::ostringstream out;
  for (int64_t r = 0; r < size_; ++r) {
    if (r != rank_ && group_posts[r].empty()) {
      out << "\n  rank " << mesh_ranks_[r] << ": " << whereabouts[r];
    }
  }
  TORCH_CHECK(false, "zero_ext: ", what, " waits for ranks that are not running this model:", out.str(),
              "\nThose ranks wait in a collective of their own, which needs this rank: neither can go on. "
              "Every rank must make the same calls on a model wrapped by zero_ext. Typical causes: a call "
              "made on one rank only (`if rank == 0: ...`) of what gathers at stage 3 (every forward, "
              "generate() too, state_dict(), save_pretrained()): make the call on every rank (and write "
              "files on rank 0 only), read weights with `with zero_ext.full_params(model):` or "
              "zero_ext.full_state_dict(model) on every rank, save with zero_ext.save_weights(model, path) "
              "on every rank; or ranks running a different number of steps (uneven data: one rank ran out "
              "of batches and waits in a barrier): give every rank the same number of batches (drop_last, "
              "a DistributedSampler). This rank stops here instead of waiting out the timeout.");
}

} // namespace zero_ext
