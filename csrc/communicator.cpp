#include "communicator.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace zero_ext {

Communicator::Communicator(const std::string& group_name) {
  if (group_name.empty()) {
    return;
  }
  group_ = c10d::resolve_process_group(group_name);
  TORCH_CHECK(group_, "zero_ext: process group '", group_name,
              "' is not registered; pass a group created by torch.distributed");
  rank_ = group_->getRank();
  size_ = group_->getSize();
}

bool Communicator::waits_on_host(c10::DeviceType device_type) const {
  if (!group_) {
    return false;
  }
  if (device_type == c10::DeviceType::CPU) {
    return true;
  }
  try {
    return group_->getBackend(device_type)->getBackendName() != "nccl";
  } catch (const c10::Error&) {
    return true;  // no backend registered for the device yet: assume the general case
  }
}

bool Communicator::done_within(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds limit) {
  if (!work) {
    return true;
  }
  const auto until = std::chrono::steady_clock::now() + limit;
  auto pause = std::chrono::microseconds(20);
  while (!work->isCompleted()) {
    if (std::chrono::steady_clock::now() >= until) {
      return false;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(2000));
  }
  return true;
}

namespace {

c10::intrusive_ptr<c10d::Work> all_reduce(const c10::intrusive_ptr<c10d::ProcessGroup>& group, at::Tensor& tensor,
                                          c10d::ReduceOp::RedOpType op) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  return group->allreduce(tensors, opts);
}

} // namespace

c10::intrusive_ptr<c10d::Work> Communicator::all_reduce_sum(at::Tensor& tensor) {
  if (!group_) {
    return nullptr;
  }
  ++collectives_issued_;
  note_issue("all_reduce", tensor);
  return all_reduce(group_, tensor, c10d::ReduceOp::SUM);
}

c10::intrusive_ptr<c10d::Work> Communicator::all_reduce_max(at::Tensor& tensor) {
  if (!group_) {
    return nullptr;
  }
  ++collectives_issued_;
  note_issue("all_reduce_max", tensor);
  return all_reduce(group_, tensor, c10d::ReduceOp::MAX);
}

c10::intrusive_ptr<c10d::Work> Communicator::reduce_scatter_sum(at::Tensor& shard_out,
                                                                at::Tensor& full_in) {
  TORCH_CHECK(full_in.numel() == shard_out.numel() * size_,
              "zero_ext internal: reduce-scatter input is not world_size shards");
  if (!group_) {
    shard_out.copy_(full_in);
    return nullptr;
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  ++collectives_issued_;
  note_issue("reduce_scatter", full_in);
  return group_->_reduce_scatter_base(shard_out, full_in, opts);
}

c10::intrusive_ptr<c10d::Work> Communicator::all_gather(at::Tensor& full_out,
                                                        at::Tensor& shard_in) {
  TORCH_CHECK(full_out.numel() == shard_in.numel() * size_,
              "zero_ext internal: all-gather output is not world_size shards");
  if (!group_) {
    if (shard_in.data_ptr() != full_out.data_ptr()) {  // in place: already there
      full_out.copy_(shard_in);
    }
    return nullptr;
  }
  ++collectives_issued_;
  ++all_gathers_issued_;
  note_issue("all_gather", full_out);
  return group_->_allgather_base(full_out, shard_in, c10d::AllgatherOptions());
}

c10::intrusive_ptr<c10d::Work> Communicator::broadcast_from_rank0(at::Tensor& tensor) {
  if (!group_) {
    return nullptr;
  }
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = 0;
  ++collectives_issued_;
  note_issue("broadcast", tensor);
  return group_->broadcast(tensors, opts);
}

void Communicator::enable_stall_diagnosis(double seconds, const std::string& key_space,
                                          std::vector<int64_t> mesh_ranks) {
  if (!group_ || seconds <= 0) {
    return;
  }
  TORCH_CHECK(static_cast<int64_t>(mesh_ranks.size()) == size_, "zero_ext internal: ", mesh_ranks.size(),
              " mesh ranks for a group of ", size_);
  mesh_ranks_ = std::move(mesh_ranks);
  store_ = group_->getStore();
  // A model's groups each prefix their store; the base store lets a rank
  // stalled on the gather group see one stalled on the reduction group.
  if (auto prefixed = c10::dynamic_intrusive_pointer_cast<c10d::PrefixStore>(store_)) {
    store_ = prefixed->getUnderlyingNonPrefixStore();
  }
  stall_interval_ = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  stall_keys_ = "zero_ext_stall/" + key_space + "/rank";
  query_key_ = "zero_ext_stall/" + key_space + "/query";
  whereabouts_keys_ = "zero_ext_stall/" + key_space + "/where";
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

void Communicator::diagnose_stall(const c10::intrusive_ptr<c10d::Work>& work,
                                  const std::string& what) const {
  const std::string mine = stall_keys_ + std::to_string(mesh_ranks_[rank_]);
  store_->set(mine, std::vector<uint8_t>(what.begin(), what.end()));
  const int64_t query = store_->add(query_key_, 1);  // see [Note: whereabouts]
  std::vector<std::string> whereabouts(size_);
  bool stranded = false;  // every rank not in a zero_ext wait is blocked in a world collective
  // Posts are overwritten with "" once a wait completes (never deleted, so a
  // get() cannot block on a key that just vanished), and re-read each round:
  // only ranks stalled right now count.
  std::vector<std::string> posts(size_);
  bool differ = false;
  // Long enough for the answering threads (one poll a second) to answer.
  const auto until = std::chrono::steady_clock::now() + std::max(stall_interval_, std::chrono::milliseconds(2500));
  while (true) {
    // Completion is read before the posts: a peer that found the difference
    // first may already have failed this collective by leaving, and its post
    // (kept on failure) still says where it was.
    const bool completed = work->isCompleted();
    for (int64_t r = 0; r < size_; ++r) {
      const std::string key = stall_keys_ + std::to_string(mesh_ranks_[r]);
      posts[r].clear();
      if (r == rank_) {
        posts[r] = what;
      } else if (store_->check({key})) {
        auto bytes = store_->get(key);
        posts[r].assign(bytes.begin(), bytes.end());
      }
      differ = differ || (!posts[r].empty() && posts[r] != what);
    }
    stranded = read_whereabouts(posts, query, whereabouts);
    if (differ || stranded || completed || std::chrono::steady_clock::now() >= until) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if ((!differ && !stranded) || (work->isCompleted() && !work->exception())) {
    return;  // everyone stalls on this collective, some rank is busy elsewhere, or it matched
  }
  failed_ = true;
  if (stranded && !differ) {
    std::ostringstream out;
    for (int64_t r = 0; r < size_; ++r) {
      if (r != rank_ && posts[r].empty()) {
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
  std::ostringstream out;
  for (int64_t r = 0; r < size_; ++r) {
    out << "\n  rank " << mesh_ranks_[r] << ": "
        << (posts[r].empty() ? std::string("not waiting in a zero_ext collective (busy, in another "
                                           "collective, or gone)")
                             : "waiting in " + posts[r]);
  }
  TORCH_CHECK(false, "zero_ext: the ranks are stalled in different collectives, so they took "
              "different paths through the training loop (a different number of backward passes "
              "or steps, or modules run on some ranks only):", out.str(),
              "\nEvery rank must issue the same collectives in the same order; this rank stops "
              "here instead of waiting out the timeout.");
}

void Communicator::wait(const c10::intrusive_ptr<c10d::Work>& work,
                        const std::function<std::string()>& what) const {
  if (!work) {
    return;
  }
  bool stalled = false;
  if (store_ && stall_interval_.count() > 0 && !work->isCompleted()) {
    try {
      work->wait(stall_interval_);
    } catch (const std::exception&) {
      stalled = !work->isCompleted();  // still running; a real failure is raised below
    }
  }
  if (stalled) {
    // Raises if the ranks are stalled in different collectives or the ones
    // missing are stuck elsewhere; asks again after 2x, 4x, ... the interval,
    // as a rank busy at the first look may be stuck by the next.
    const std::string described = what();
    auto pause = stall_interval_;
    while (true) {
      diagnose_stall(work, described);
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
  try {
    work->wait();
  } catch (const c10::Error& e) {
    failed_ = true;
    TORCH_CHECK(false, "zero_ext: ", what(), " failed on rank ", rank_, " of ", size_,
                " (a peer may have died, raised, or taken a different code path): ",
                e.what_without_backtrace());
  } catch (const std::exception& e) {
    failed_ = true;
    TORCH_CHECK(false, "zero_ext: ", what(), " failed on rank ", rank_, " of ", size_,
                " (a peer may have died, raised, or taken a different code path): ", e.what());
  }
  if (stalled) {
    store_->set(stall_keys_ + std::to_string(mesh_ranks_[rank_]), std::vector<uint8_t>());  // no longer stalled
  }
}

} // namespace zero_ext
