#pragma once
// A process group resolved by name, or none for a single process.
//
// Every collective zero_ext issues goes through here so that a failure names
// what was being reduced or gathered. Waits are bounded by the group's own
// timeout (zero_ext creates its groups with the one wrap() was given; an
// explicit wait timeout would block the host on NCCL). World size 1 (no
// torch.distributed) is a real mode, not a special case at call sites: the
// collectives degrade to local copies.

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace zero_ext {

class Communicator {
 public:
  // group_name "" means no process group: rank 0 of 1.
  explicit Communicator(const std::string& group_name);

  int64_t rank() const { return rank_; }
  int64_t size() const { return size_; }
  bool distributed() const { return static_cast<bool>(group_); }
  // Whether wait() on a collective over tensors of this device type blocks
  // the host until it is done (gloo, any CPU backend), rather than ordering
  // the current stream after it (NCCL). False without a group.
  bool waits_on_host(c10::DeviceType device_type) const;
  // Polls until `work` is done or `limit` passes, never raising: whether it
  // is done. A bounded host wait where a full one could deadlock.
  static bool done_within(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds limit);

  // Each returns the in-flight work, or nullptr when the result is already
  // in place (single process). Inputs must stay alive until wait().
  c10::intrusive_ptr<c10d::Work> all_reduce_sum(at::Tensor& tensor);
  c10::intrusive_ptr<c10d::Work> all_reduce_max(at::Tensor& tensor);
  c10::intrusive_ptr<c10d::Work> reduce_scatter_sum(at::Tensor& shard_out, at::Tensor& full_in);
  c10::intrusive_ptr<c10d::Work> all_gather(at::Tensor& full_out, at::Tensor& shard_in);
  c10::intrusive_ptr<c10d::Work> broadcast_from_rank0(at::Tensor& tensor);

  // Waits (within the group's timeout); on failure raises naming `what`.
  // [Note: stall diagnosis] A host wait still blocked after the stall
  // interval posts `what` (which collective, at which step and backward) to
  // the group's store and reads what the other ranks posted: ranks stalled in
  // different collectives took different paths, and every rank raises at
  // once with each rank's position instead of sitting out the timeout.
  // Nothing else touches the store unless a wait stalls. Host (gloo) waits only:
  // a timed wait on an NCCL work would block the host on the GPU.
  // `what` is only called on a stall or a failure: waits sit on the hot path.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::function<std::string()>& what) const;
  // Stall interval (0: off), the key space shared by a model's groups, and
  // the mesh rank of each member (by group rank): posts are keyed by mesh
  // rank, so the groups of a hybrid mesh (rows and columns) read each other's.
  void enable_stall_diagnosis(double seconds, const std::string& key_space, std::vector<int64_t> mesh_ranks);

  // [Note: whereabouts] A rank stalled in a collective also asks the ranks
  // that posted nothing (not waiting in zero_ext) where they are: each rank
  // runs a thread (zero_ext/_whereabouts.py) that polls the query counter
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

  // Whether a wait on this group failed: its collectives are out of step.
  bool failed() const { return failed_; }

  // Test-only: appends "<tag> <kind> <numel>" for every collective issued,
  // to check that ranks issue the same sequence (nullptr: off).
  void log_issues_to(std::vector<std::string>* log, std::string tag) {
    issue_log_ = log;
    issue_tag_ = std::move(tag);
  }

  // Counters for tests and benchmarks: collectives issued and bytes sent.
  int64_t collectives_issued() const { return collectives_issued_; }
  int64_t all_gathers_issued() const { return all_gathers_issued_; }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int64_t rank_ = 0;
  int64_t size_ = 1;
  int64_t collectives_issued_ = 0;
  int64_t all_gathers_issued_ = 0;
  std::vector<std::string>* issue_log_ = nullptr;
  std::string issue_tag_;
  void note_issue(const char* kind, const at::Tensor& tensor) {
    if (issue_log_) issue_log_->push_back(issue_tag_ + " " + kind + " " + std::to_string(tensor.numel()));
  }
  std::chrono::milliseconds stall_interval_{0};
  std::string stall_keys_;
  std::string query_key_;
  std::string whereabouts_keys_;
  std::vector<int64_t> mesh_ranks_;  // of the members, by group rank
  c10::intrusive_ptr<c10d::Store> store_;

  mutable bool failed_ = false;

  // Posts `what` and reads the other ranks' posts until `work` completes or
  // another interval passes; raises if a rank is stalled elsewhere.
  void diagnose_stall(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) const;
  // True when every rank that posted no stall answered `query` (or later)
  // as blocked in a world collective; fills `whereabouts` with their answers.
  bool read_whereabouts(const std::vector<std::string>& posts, int64_t query,
                        std::vector<std::string>& whereabouts) const;
};

} // namespace zero_ext
