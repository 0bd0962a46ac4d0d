#pragma once
// A process group resolved by name, or none for a single process.
//
// Every collective zero_ext issues goes through here so that a failure names
// what was being reduced or gathered. Waits are bounded by the group's own
// timeout (zero_ext creates its groups with the one wrap() was given; an
// explicit wait timeout would block the host on NCCL). World size 1 (no
// torch.distributed) is a real mode, not a special case at call sites: the
// collectives degrade to local copies. So do those of a group of one rank
// (world size 1 under torch.distributed): the backend would only copy, at a
// cost measured at 9% of a small model's step on CPU (docs/benchmarks.md).
// The collectives and waits are defined in communicator.cpp, the stall
// diagnosis of a wait ([Note: stall diagnosis]) in stall_diagnosis.cpp.

#include <array>
#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "block_quantization.h"
#include "collective_id.h"
#include "diagnosis_store.h"
#include "step_gate.h"

namespace zero_ext {

class CollectiveSequence;
class SequenceOrder;
struct RaisedPost;
struct StallPost;

// How the ranks stand after a forward raised on this one.
struct RaisedForwardOutcome {
  bool in_step = false;   // every rank raised at the same point: nothing is out of step
  std::string positions;  // each rank's position, one line each (when not in step)
  std::string report;     // another rank's report, which this rank raises as it is
};

// The groups of one model, each a slot in the issue counts a stalled rank
// posts ([Note: stall diagnosis]): the data groups, then their header groups
// ([Note: collectives that prove what they are] in collective_sequence.h).
// kRegather: stage 3 units resharded to subgroups of the shard group after
// forward (reshard_after_forward=<int>) gather again within them. kExpert:
// the expert group (wrap(expert_process_group=)), over which the expert
// buckets are sharded ([Note: expert buckets] in layout.h).
enum class GroupSlot : int {
  kShard = 0, kGather, kReplica, kRegather, kExpert,
  kShardHeaders, kGatherHeaders, kReplicaHeaders, kRegatherHeaders, kExpertHeaders
};
constexpr int kDataSlots = 5;  // a data group's headers are at slot + kDataSlots
constexpr int kGroupSlots = 2 * kDataSlots;
// Collectives may be issued from a header's completion callback (a gloo
// thread; collective_sequence.h), so what they count is shared safely.
using IssueCounts = std::array<std::atomic<int64_t>, kGroupSlots>;

// [Note: traffic] Bytes a rank sends, counted when a collective goes out,
// by what the collective does for the model (a reduce-scatter carried out as
// an all-to-all counts as a reduce-scatter). Each kind counts what this rank
// sends under the bandwidth-optimal algorithm for a group of n ranks and a
// buffer of B bytes (what benchmarks/compare.py computes from the profiler):
// an all-gather (n - 1) x its part, a reduce-scatter and a broadcast
// (n - 1) / n x B, an all-reduce 2 (n - 1) / n x B; quantized collectives
// count their payloads. The sequence checks' headers count apart.
enum class TrafficKind : int { kAllGather = 0, kReduceScatter, kAllReduce, kBroadcast, kHeaders, kCount };
struct Traffic {
  std::array<std::atomic<int64_t>, static_cast<int>(TrafficKind::kCount)> bytes{};
};

// Test-only: every collective issued, in order ("<tag> <kind> <numel>").
struct IssueLog {
  std::mutex mutex;
  std::vector<std::string> lines;
};

class Communicator {
 public:
  // group_name "" means no process group: rank 0 of 1. `slot`: which of
  // the model's groups this is; `counts`: the model's issue counts, shared
  // by its communicators (null: counted here only).
  explicit Communicator(const std::string& group_name, GroupSlot slot = GroupSlot::kShard,
                        std::shared_ptr<IssueCounts> counts = nullptr);
  ~Communicator();

  int64_t rank() const { return rank_; }
  int64_t size() const { return size_; }
  bool distributed() const { return static_cast<bool>(group_); }
  // Whether collectives run here, as copies: no group, or a group of one.
  bool local() const { return !group_ || one_rank_local_; }
  // Whether wait() on a collective over tensors of this device type blocks
  // the host until it is done (gloo, any CPU backend), rather than ordering
  // the current stream after it (NCCL). False without a group.
  bool waits_on_host(c10::DeviceType device_type) const;
  // The group's backend for the device ("gloo", "nccl"), "" when none is registered.
  std::string backend_name(c10::DeviceType device_type) const;
  // Polls until `work` is done or `limit` passes, never raising: whether it
  // is done. A bounded host wait where a full one could deadlock.
  static bool done_within(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds limit);

  // Each returns the in-flight work, or nullptr when the result is already
  // in place (single process). Inputs must stay alive until wait().
  // `purpose`, `subject` (and `label`, for kPython) say what it is: with
  // sequence checks on, every rank's collective at this position must be
  // the same one before it is issued (collective_sequence.h), or every
  // rank raises. The work returned may then stand for a collective issued
  // later, once its headers are verified: never blocks here.
  c10::intrusive_ptr<c10d::Work> all_reduce_sum(at::Tensor& tensor, Purpose purpose, int64_t subject = 0,
                                                const std::string& label = {});
  c10::intrusive_ptr<c10d::Work> all_reduce_max(at::Tensor& tensor, Purpose purpose, int64_t subject = 0,
                                                const std::string& label = {});
  c10::intrusive_ptr<c10d::Work> reduce_scatter_sum(at::Tensor& shard_out, at::Tensor& full_in, Purpose purpose,
                                                    int64_t subject = 0);
  // Whether reduce_scatter_sum and all_gather on `device`'s tensors run as
  // gloo all-to-alls ([Note: gloo's reduce-scatter as an exchange], [Note:
  // gloo's all-gather as an exchange]); the reduce-scatter's holds a receive
  // buffer the size of its input while in flight.
  bool collectives_by_exchange(c10::Device device) const;
  c10::intrusive_ptr<c10d::Work> all_gather(at::Tensor& full_out, at::Tensor& shard_in, Purpose purpose,
                                            int64_t subject = 0, const std::string& label = {});
  c10::intrusive_ptr<c10d::Work> broadcast_from_rank0(at::Tensor& tensor, Purpose purpose, int64_t subject = 0,
                                                      const std::string& label = {});
  // [Note: quantized collectives] (quantized_collectives.h): the same
  // results as reduce_scatter_sum and all_gather, sent as block-quantized
  // integers; `residual` carries what rounding lost to the next call
  // (undefined: none). Local groups copy, exact.
  c10::intrusive_ptr<c10d::Work> quantized_reduce_scatter_sum(at::Tensor& shard_out, at::Tensor& full_in,
                                                              const QuantFormat& format, const at::Tensor& residual,
                                                              Purpose purpose, int64_t subject = 0);
  // Whether quantized_all_reduce_sum of `tensor` sends fewer bytes than the exact all-reduce.
  bool quantized_all_reduce_pays(const at::Tensor& tensor, const QuantFormat& format) const;
  c10::intrusive_ptr<c10d::Work> quantized_all_reduce_sum(at::Tensor& tensor, const QuantFormat& format,
                                                          const at::Tensor& residual, Purpose purpose,
                                                          int64_t subject = 0);
  c10::intrusive_ptr<c10d::Work> quantized_all_gather(at::Tensor& full_out, at::Tensor& shard_in,
                                                      const QuantFormat& format, Purpose purpose,
                                                      int64_t subject = 0);
  // [Note: traffic] Counts this group's bytes (and its headers') into `traffic`.
  void count_traffic_to(std::shared_ptr<Traffic> traffic);

  // [Note: collectives that prove what they are] Turns the checks on:
  // headers go over the group named `header_group_name` (a gloo group over
  // the same ranks); `describe` renders a collective for error messages,
  // `progress` reads where training is (step, synced backwards) for headers.
  // `order`: shared by the model's groups; `in_order`: this group's
  // collectives go out in the model's submission order across groups.
  void enable_sequence_checks(const std::string& header_group_name, std::shared_ptr<SequenceOrder> order,
                              bool in_order,
                              std::function<std::string(const CollectiveId&, const std::string&)> describe,
                              std::function<Progress()> progress);
  bool sequence_checked() const { return static_cast<bool>(sequence_); }
  // `advise(report)`: what to add to an error that finds the ranks apart,
  // about the units its report names (Layout::advice_for); shared with the
  // header group of the sequence checks.
  void set_advice(std::function<std::string(const std::string&)> advise);
  std::string advice(const std::string& report) const { return advise_ ? advise_(report) : std::string(); }
  // The caller enters a new phase (a forward, a backward, a step, a call
  // from Python): the next collective starts a round of this kind. Free
  // when no collective follows.
  void begin_round(int64_t key, const std::string& label);
  // Collectives issued on this group so far.
  int64_t issued() const { return issued_; }
  // Collectives submitted on this group so far (issued, or waiting for their
  // headers): whether a forward that raised had begun its collectives.
  int64_t submitted() const { return submitted_; }
  // This rank leaves `works` (on this group) for good: if one still runs,
  // the group is kept until the process exits ([Note: abandoned
  // collectives] in abandoned_collectives.h).
  void abandon(const std::vector<c10::intrusive_ptr<c10d::Work>>& works) const;
  // Marks this group failed and posts the report a sequence check composed
  // to the stall diagnosis' store, where the other ranks' stalled waits
  // read it; see collective_sequence.h.
  void post_report(const std::string& report) const;

  // Waits (within the group's timeout); on failure raises naming `what`.
  // [Note: stall diagnosis] A host wait still blocked after the stall
  // interval posts what it waits in, its position in this group's sequence
  // and how many collectives it issued on each of the model's groups, to the
  // group's store, and reads what the other ranks posted. A stalled rank
  // waits for the members of its group that have not issued its collective
  // yet; when every rank it waits for is stalled waiting in turn for ranks
  // that have not issued theirs (the stuck set, a fixpoint in
  // stall_diagnosis.cpp), none can go on and every rank raises at once with
  // each rank's position instead of sitting out the timeout. A rank that is
  // merely slow (its collective was issued by everyone) is never taken for
  // a divergence. A report another rank's sequence check posted is raised
  // as it is. Nothing else touches the store unless a wait stalls. Host
  // (gloo) waits only: a timed wait on an NCCL work would block the host on
  // the GPU. `what` is only called on a stall or a failure: waits sit on the
  // hot path.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::function<std::string()>& what) const;
  // Stall interval (0: off), the key space shared by a model's groups, and
  // the mesh rank of each member (by group rank): posts are keyed by mesh
  // rank, so the groups of a hybrid mesh (rows and columns) read each other's.
  // `replicas` x `shard_size`: the mesh's shape (a flat group: 1 x size),
  // so a rank can tell which ranks each posted wait needs.
  // `timed_waits` false (NCCL): no timed waits, only the keys for reports.
  // `subgroup_size`: of the regather subgroups (consecutive shard ranks), 0 if none.
  void enable_stall_diagnosis(double seconds, const std::string& key_space, std::vector<int64_t> mesh_ranks,
                              int64_t replicas, int64_t shard_size, bool timed_waits, int64_t subgroup_size = 0);
  // The expert group (its index) of each mesh rank, so that any of the
  // model's groups can tell which ranks a posted expert wait needs.
  void set_expert_partition(std::vector<int64_t> group_of_mesh_rank);

  // [Note: whereabouts] A rank stalled in a collective also asks the ranks
  // that posted nothing (not waiting in zero_ext) where they are: each rank
  // runs a thread (zero_ext/groups/stall_query.py) that polls the query counter
  // once a second and answers with what its main thread is doing. If every
  // such rank is blocked in a torch.distributed collective of the whole world
  // (`if rank == 0: model.generate(...)` followed by `dist.barrier()`), they
  // can never join this one: it raises at once, naming the fix. Nothing is
  // exchanged unless a wait stalls, but for the answering thread's read of
  // one counter a second. Limit: a rank that issued this very collective
  // asynchronously and then blocked in a world collective counts as missing,
  // so a zero_ext collective slower than the interval (5 s at most) plus 2.5 s
  // overlapping such a wait would raise; zero_ext waits on its own work
  // before returning to user code, so this needs a stage 3 prefetch or
  // bucket left in flight across a user collective.
  // The count of queries so far (0: none, or no diagnosis here).
  int64_t stall_queries() const;
  // This rank's answer to query `query`: blocked in a world collective, where.
  void post_whereabouts(int64_t query, bool blocked, const std::string& where) const;

  // [Note: a forward that raised] in forward_raised_agreement.cpp: this rank's forward
  // raised after its collectives began. Posts where it stopped (`mine`,
  // re-read each round: its issued counts settle as pending collectives go
  // out) as the model's raised forward number `occurrence`, and waits at
  // most `limit` for every rank of the mesh to post where its forward raised,
  // or for a sign that some rank went past this point (it waits, stalled,
  // for a collective that a rank which raised never issued), or for another
  // rank's report. Errors of the store count as out of step.
  RaisedForwardOutcome agree_where_forward_raised(int64_t occurrence, const std::function<RaisedPost()>& mine,
                                                  std::chrono::milliseconds limit) const;
  // What this rank has issued on each of the model's groups.
  std::array<int64_t, kGroupSlots> issued_counts() const;

  // Whether a wait on this group failed, or a sequence check found the
  // ranks apart: its collectives are out of step.
  bool failed() const;
  // Once failed: what the sequence check found (or a peer posted) about the
  // ranks' difference, the cause a later call should name; else empty.
  std::string failure_report() const;

  // Test-only: appends "<tag> <kind> <numel>" for every collective issued,
  // to check that ranks issue the same sequence (nullptr: off).
  void log_issues_to(IssueLog* log, std::string tag) {
    issue_tag_ = std::move(tag);
    issue_log_ = log;
  }

  // Counters for tests and benchmarks: collectives issued and bytes sent.
  int64_t collectives_issued() const { return collectives_issued_; }
  int64_t all_gathers_issued() const { return all_gathers_issued_; }
  // Sequence checks: header exchanges that blocked, and the ones sent ahead.
  int64_t blocking_headers() const;
  int64_t ahead_headers() const;

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int64_t rank_ = 0;
  int64_t size_ = 1;
  bool one_rank_local_ = false;  // a group of one: collectives are local copies
  std::atomic<int64_t> collectives_issued_{0};
  std::atomic<int64_t> all_gathers_issued_{0};
  std::atomic<IssueLog*> issue_log_{nullptr};
  std::string issue_tag_;
  GroupSlot slot_;
  std::shared_ptr<IssueCounts> counts_;
  std::atomic<int64_t> issued_{0};
  std::atomic<int64_t> submitted_{0};
  std::shared_ptr<CollectiveSequence> sequence_;
  std::function<std::string(const std::string&)> advise_;
  // Works in flight and their position in this group's sequence, for the
  // stall diagnosis (pruned at wait; bounded).
  mutable std::mutex seq_mutex_;
  mutable std::deque<std::pair<const c10d::Work*, int64_t>> in_flight_seq_;
  int64_t replicas_ = 1;
  int64_t shard_size_ = 1;
  int64_t subgroup_size_ = 0;
  // The expert group of each mesh rank (empty: no expert group), for members_of.
  std::vector<int64_t> expert_group_of_;
  // Issues a collective through the sequence checks (now or once its headers
  // are verified), counted and logged when it goes out; nullptr without a group.
  // `wire_bytes`: what the collective sends ([Note: traffic]); -1: the
  // plain collective's bytes for `sent`.
  c10::intrusive_ptr<c10d::Work> submit(CollectiveOp op, Purpose purpose, int64_t subject,
                                        const at::Tensor& sent, const std::string& label, const char* kind,
                                        const at::Tensor& logged,
                                        std::function<c10::intrusive_ptr<c10d::Work>()> issue,
                                        int64_t wire_bytes = -1);
  // The collective goes out now: counted, logged, its position noted.
  c10::intrusive_ptr<c10d::Work> issue_now(const char* kind, int64_t numel, TrafficKind traffic_kind,
                                           int64_t wire_bytes,
                                           const std::function<c10::intrusive_ptr<c10d::Work>()>& issue);
  std::shared_ptr<Traffic> traffic_;
  int64_t seq_of(const c10::intrusive_ptr<c10d::Work>& work) const;
  void forget_seq(const c10::intrusive_ptr<c10d::Work>& work) const;
  // The mesh ranks of the group a rank waiting on `slot` waits with.
  std::vector<int64_t> members_of(int slot, int64_t mesh_rank) const;
  // agree_where_forward_raised's steps (forward_raised_agreement.cpp).
  bool read_raised_posts(const std::string& prefix, int64_t me, const RaisedPost& now,
                         std::vector<RaisedPost>& raised) const;
  bool read_stalls_past_raised(const std::vector<RaisedPost>& raised, std::vector<StallPost>& stalls) const;
  std::string describe_raised_positions(const std::vector<RaisedPost>& raised, const std::vector<StallPost>& stalls,
                                        bool timed_out, std::chrono::milliseconds limit) const;
  std::chrono::milliseconds stall_interval_{0};
  std::string stall_keys_;
  std::string query_key_;
  std::string whereabouts_keys_;
  std::string report_key_;
  std::string raised_keys_;
  std::vector<int64_t> mesh_ranks_;  // of the members, by group rank
  std::shared_ptr<DiagnosisStore> store_;  // throws StoreUnreachable, quietly, once the store is gone

  mutable bool failed_ = false;

  // The stall diagnosis (stall_diagnosis.cpp). A wait that stalled: posts,
  // reads and raises as diagnose_stall does, again after 2x, 4x, ... the
  // interval, until `work` completes (or the store is gone).
  void wait_out_stall(const c10::intrusive_ptr<c10d::Work>& work, const std::function<std::string()>& what) const;
  // Posts `what` (with this rank's position in every group) and reads the
  // other ranks' posts until `work` completes or another interval passes;
  // raises if the stalled ranks wait for each other.
  void diagnose_stall(const c10::intrusive_ptr<c10d::Work>& work, int64_t seq, const std::string& what) const;
  // Posts this rank's stall (position `seq`, waiting in `what`); returns the post.
  std::string post_stall(int64_t seq, const std::string& what) const;
  // Every mesh rank's stall post (this rank's is `mine`); absent where none.
  void read_stall_posts(const std::string& mine, std::vector<StallPost>& posts) const;
  // Raises: the ranks that posted no stall (`group_posts` empty) are blocked
  // in a world collective (`whereabouts`), so `what` can never complete.
  void raise_stranded(const std::string& what, const std::vector<std::string>& group_posts,
                      const std::vector<std::string>& whereabouts) const;
  // The wait that stalled completed: this rank's post is emptied.
  void clear_stall_post() const;
  // A sequence check's report another rank posted, if any.
  std::string posted_report() const;
  // True when every rank that posted no stall answered `query` (or later)
  // as blocked in a world collective; fills `whereabouts` with their answers.
  bool read_whereabouts(const std::vector<std::string>& posts, int64_t query,
                        std::vector<std::string>& whereabouts) const;
};

} // namespace zero_ext
