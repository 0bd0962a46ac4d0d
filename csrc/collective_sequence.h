#pragma once
// CollectiveSequence: the checks that make every rank's next collective on a
// group the same one before any rank issues it. The order across a model's
// groups is SequenceOrder's (sequence_order.h), the work that stands for a
// collective held back SequencedWork's (sequenced_work.h), the words of a
// header and how they read in errors are in sequence_headers.{h,cpp}.
//
// [Note: collectives that prove what they are]
// Collectives pair by their order on a group, not by their meaning. If rank 0
// gathers unit 3 while rank 1 gathers unit 5, both get the other's bytes when
// the sizes match, and gloo aborts the process from a thread when they do not,
// before any later check can run. Data-dependent forwards do this in real code
// (an MoE expert no token was routed to, `if rank == 0: model.generate()`,
// evaluation loops of different lengths). So nothing is issued on a data group
// until every rank is known to issue the same collective (CollectiveId) at the
// same position:
// - A header is a fixed-size all-gather of int64 words on a header group of
//   its own (gloo, the same ranks): every rank sees every rank's header, and a
//   header can never abort the backend, whatever the others send.
// - A round is what a phase of training issues on the group: a forward, a
//   backward, a step, one call from Python. Its plan is the sequence of ids the
//   last round of the same kind issued. A round starts with the ranks agreeing
//   on (kind, plan); after that, a collective that is the plan's next one is
//   issued at once, and any other first exchanges a SINGLE header that all
//   ranks must match.
// - Agreeing on a round costs no waiting in steady state: at the start of each
//   round every rank sends an AHEAD header predicting the next round (what
//   followed the longest earlier repeat of the recent rounds: B B P S B B P S
//   ... predicts itself, gradient accumulation and clipping included; and that
//   kind's plan). At the next round start that exchange is long complete: if
//   every rank predicted the same, this rank's actual next round is that one,
//   and this rank's last round issued exactly its plan, the round starts at
//   once; otherwise a ROUND header establishes it.
// - Nothing ever blocks where a collective is submitted (a gradient hook, a
//   unit's pre-forward): ranks reach the collectives of different groups (or
//   models) in different orders, and a rank blocked in one header while its
//   peer blocks in another's would deadlock. Headers are sent at once (the
//   state they depend on is advanced as if they will match), and a collective
//   waiting for its headers goes out once they are verified, from whichever
//   thread notices first: a wait on it, a poll, or the header's completion
//   callback on a gloo thread. A round start waits only for the AHEAD
//   exchange sent one round earlier.
// Why this is safe: the state that decides what a rank issues without a header
// (position, plans, predictions) is the same on every rank that passed every
// exchange so far, so two ranks that both skip the header issue the same id.
// A rank whose actual collective or round differs from that agreement issues
// nothing on the data group: it sends a header, which pairs with the next
// header of the others, whatever that is, and the contents differ, so every
// rank that reads it finds the report; the others, blocked on data the first
// rank never sends, read the report it posted through the stall diagnosis.
// Every rank ends in zero_ext's error naming each rank's collective; none
// ever reads another collective's data.
// - The collectives of a model's groups go out in the order they were
//   submitted, across groups (SequenceOrder): NCCL deadlocks when ranks
//   issue work on two communicators in different orders ([Note: issue
//   order] in grad_reducer.cpp), and a collective held back for its headers
//   holds back the ones submitted after it, on any group of the model. That
//   is safe only for groups whose collectives every rank submits at the same
//   points relative to the others' (then a rank held back has sent the
//   headers its peers wait for): not for the all-reduces across replicas on
//   gloo, submitted when a host poll sees a reduction done, so they go out
//   in their own group's order only (gloo needs no more).
// Cost: one asynchronous header per round per group; a collective waits for
// a header only where the ranks' behaviour changed (the first step, an
// evaluation loop starting), never per unit in steady state.

#include <atomic>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Stream.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "collective_id.h"
#include "communicator.h"
#include "sequence_order.h"
#include "sequenced_work.h"
#include "step_gate.h"

namespace zero_ext {

// What phase of training a round is: kind << 32 | detail.
enum class RoundKind : int64_t {
  kUnknown = 0,
  kForward,   // detail: grad enabled
  kBackward,
  kStep,
  kZeroGrad,
  kInspect,   // state_dict(), full_params(), gather_all
  kSettle,    // gradients read outside the step (clip, full_grads, found_nonfinite)
  kPython,    // a collective Python asked for; detail: hash of its description
  kLoad,      // checkpoint or weights loaded
};
int64_t round_key(RoundKind kind, int64_t detail = 0);

class CollectiveSequence : public std::enable_shared_from_this<CollectiveSequence> {
 public:
  // data: the group whose collectives are checked; header_group_name: a
  // gloo group over the same ranks; group_description: how errors name it.
  // `in_order`: its collectives go out in the model's submission order,
  // across groups (see the note).
  CollectiveSequence(Communicator& data, std::string group_description, const std::string& header_group_name,
                     GroupSlot header_slot, std::shared_ptr<IssueCounts> counts,
                     std::shared_ptr<SequenceOrder> order, bool in_order,
                     std::function<std::string(const CollectiveId&, const std::string&)> describe,
                     std::function<Progress()> progress);

  Communicator& headers() { return *headers_; }
  const Communicator& headers() const { return *headers_; }
  // The caller enters a new phase: the next submitted collective starts a
  // round of this kind.
  void begin_round(int64_t key, const std::string& label);
  // Issues `issue()` (collective `id`, on `device`'s tensors) once every rank
  // is known to issue `id` at this position: at once when the agreed plan
  // says so and nothing waits before it, else later. Never blocks. Raises if
  // the ranks were found apart already.
  c10::intrusive_ptr<c10d::Work> submit(const CollectiveId& id, const std::string& label, c10::Device device,
                                        std::function<c10::intrusive_ptr<c10d::Work>()> issue);
  // The collective `work` stands for, issued: waits for its headers if need
  // be (bounded, stall-diagnosed waits on the header group; `what` names
  // it); raises on every rank if the ranks are apart. `work` itself when it
  // is no SequencedWork.
  c10::intrusive_ptr<c10d::Work> issued_work(const c10::intrusive_ptr<c10d::Work>& work,
                                             const std::function<std::string()>& what);
  // Progress without waiting: verifies the headers that completed, decides
  // and issues what they allow. Called on every submit and poll, and from
  // each header's completion callback, so no rank depends on another
  // rank's main thread to issue what it already submitted.
  void advance();
  bool failed() const { return failed_.load(); }
  // Why it failed (the ranks' difference, found here or posted by a peer);
  // empty while it has not.
  std::string failure_report() const;
  // The data group is going away: nothing more is issued on it.
  void detach();

  // Counters for tests and benchmarks: headers that data waited for (ROUND,
  // SINGLE), and the ones sent ahead.
  int64_t blocking_headers() const { return blocking_headers_.load(); }
  int64_t ahead_headers() const { return ahead_headers_.load(); }

 private:
  friend class SequenceOrder;
  enum HeaderType : int64_t { kAhead = 1, kRound = 2, kSingle = 3 };
  using Header = std::vector<int64_t>;

  // One header exchange in flight.
  struct Exchange {
    int64_t serial = 0;
    bool ahead = false;
    Header mine;
    at::Tensor in, out;
    c10::intrusive_ptr<c10d::Work> work;
    bool verified = false;
    bool predicted = false;  // AHEAD, verified: every rank predicted the same next round
  };
  // A round start or a collective, in submission order.
  struct Item {
    bool round = false;
    int64_t key = 0;  // round
    std::string label;
    CollectiveId id;  // collective
    std::function<c10::intrusive_ptr<c10d::Work>()> issue;
    std::optional<c10::Stream> stream;  // accelerator: the stream current at submit
    c10::intrusive_ptr<SequencedWork> handle;
    bool decided = false;
    int64_t gate = 0;  // the gating headers up to this serial must be verified first
  };

  bool verify_completed_locked();
  // Decides `item`: a collective by the plan or a SINGLE header, a round
  // start by the last AHEAD or a ROUND header (then sends the next AHEAD).
  // False: it cannot be decided yet.
  bool decide_locked(Item& item);
  bool decide_collective_locked(Item& item);
  bool decide_round_locked(Item& item);
  // Decides what it can (sends headers); whether anything was decided.
  bool decide_all_locked();
  // Drops the round starts at the front; whether `work` (a SequencedWork)
  // is next and may go out, and issues it.
  bool issue_front_locked(const c10d::Work* work);
  // Issues its next collective if decided and its headers are verified.
  bool issue_next_locked();
  Exchange& send_locked(Header mine, bool ahead);
  // Marks the sequence failed, posts `report`, fails every waiting collective.
  void fail_locked(const std::string& report);
  // Headers (sequence_headers.cpp): this rank's from the decided state, the
  // exchange's split per rank, one in words, and the report of the ranks'
  // headers (then fail_locked).
  Header header(HeaderType type, int64_t seq) const;
  std::vector<Header> split(const at::Tensor& all) const;
  std::string render(const Header& h) const;
  void fail_locked(const std::vector<Header>& all);
  int64_t predict_next() const;
  std::vector<uint64_t> plan_of(int64_t key) const;
  void watch(const c10::intrusive_ptr<c10d::Work>& work);
  int64_t next_seq() const;
  // Frees what a failure dropped (dropped_), outside the lock, on the
  // threads that submit and wait (never a completion callback's), as they
  // leave: returning or raising.
  void release_dropped();
  struct ReleaseDroppedOnExit {
    CollectiveSequence* sequence;
    ~ReleaseDroppedOnExit() { sequence->release_dropped(); }
  };

  Communicator& data_;
  const std::string group_description_;
  std::unique_ptr<Communicator> headers_;
  std::function<std::string(const CollectiveId&, const std::string&)> describe_;
  std::function<Progress()> progress_;

  std::shared_ptr<SequenceOrder> order_;  // its lock guards everything below
  const bool in_order_;
  bool detached_ = false;
  std::atomic<bool> failed_{false};
  std::string report_;

  // Decided state: the same on every rank that passed every exchange so far.
  bool round_open_ = false;
  int64_t key_ = 0;
  std::string label_;
  int64_t round_index_ = 0;
  std::vector<uint64_t> plan_;  // ids the last round of this kind issued
  uint64_t plan_hash_ = 0;
  size_t position_ = 0;          // collectives decided in this round
  std::vector<uint64_t> recorded_;
  std::map<int64_t, std::vector<uint64_t>> history_;  // per round kind: its last round's ids
  std::vector<int64_t> round_log_;                   // the kinds of the rounds so far (bounded)
  int64_t decided_collectives_ = 0;                  // the data group's sequence, as decided

  bool pending_round_ = false;  // announced by begin_round, not submitted yet
  int64_t pending_key_ = 0;
  std::string pending_label_;

  std::deque<Item> queue_;  // not issued yet, in order
  std::deque<Exchange> exchanges_;  // sent and not verified, or the last AHEAD
  int64_t serial_ = 0;
  int64_t last_ahead_serial_ = -1;  // the AHEAD the next round start reads
  int64_t last_gating_serial_ = -1;  // ROUND and SINGLE headers gate the data after them
  bool any_round_ = false;          // a round item was ever queued

  std::atomic<int64_t> blocking_headers_{0};
  std::atomic<int64_t> ahead_headers_{0};

  // Collectives a failure took off queue_. Their issue functions hold the
  // caller's tensors, often Python's, and releasing one of those can take
  // the GIL: a gloo thread (the failure found on a header's completion
  // callback) must not, since once Python is finalizing a thread that takes
  // the GIL is ended by pthread_exit, which aborts the process from inside
  // a destructor; and it would deadlock with a caller holding the GIL while
  // waiting for this lock. So they wait here for the caller's thread.
  std::deque<Item> dropped_;
  std::atomic<bool> any_dropped_{false};  // set under the lock with dropped_; read without it
};

uint64_t plan_hash(const std::vector<uint64_t>& plan);

} // namespace zero_ext
