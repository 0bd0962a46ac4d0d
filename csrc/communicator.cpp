// Communicator: a process group's collectives, each submitted through the
// sequence checks (collective_sequence.h), counted and logged as it goes
// out, and its bounded wait. What a stalled wait does is in
// stall_diagnosis.cpp.
#include "communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "abandoned_collectives.h"
#include "collective_sequence.h"
#include "exchange_all_gather.h"
#include "exchange_reduce_scatter.h"
#include "quantized_collectives.h"

namespace zero_ext {

Communicator::Communicator(const std::string& group_name, GroupSlot slot, std::shared_ptr<IssueCounts> counts)
    : slot_(slot), counts_(counts ? std::move(counts) : std::make_shared<IssueCounts>()) {
  if (group_name.empty()) {
    return;
  }
  group_ = c10d::resolve_process_group(group_name);
  TORCH_CHECK(group_, "zero_ext: process group '", group_name,
              "' is not registered; pass a group created by torch.distributed");
  rank_ = group_->getRank();
  size_ = group_->getSize();
  // ZERO_EXT_ONE_RANK_COLLECTIVES=1 sends a group of one's collectives
  // through its backend all the same: tests/cuda exercises NCCL's path on one GPU.
  const char* forced = std::getenv("ZERO_EXT_ONE_RANK_COLLECTIVES");
  one_rank_local_ = size_ == 1 && !(forced != nullptr && std::strcmp(forced, "1") == 0);
}

Communicator::~Communicator() {
  if (sequence_) {
    sequence_->detach();  // a header's completion callback may still hold the sequence
  }
}

void Communicator::enable_sequence_checks(
    const std::string& header_group_name, std::shared_ptr<SequenceOrder> order, bool in_order,
    std::function<std::string(const CollectiveId&, const std::string&)> describe,
    std::function<Progress()> progress) {
  if (!group_ || size_ < 2 || header_group_name.empty()) {
    return;  // a single rank cannot disagree with itself
  }
  static const char* const kDescriptions[] = {"the gradient reduction group", "the parameter gather group (stage 3)",
                                              "the group across replicas",
                                              "the parameter regather subgroup (reshard_after_forward=<int>)",
                                              "the expert group (expert_process_group)"};
  const int slot = static_cast<int>(slot_);
  TORCH_INTERNAL_ASSERT(slot < kDataSlots, "sequence checks are for data groups");
  sequence_ = std::make_shared<CollectiveSequence>(*this, kDescriptions[slot], header_group_name,
                                                   static_cast<GroupSlot>(slot + kDataSlots), counts_, std::move(order),
                                                   in_order, std::move(describe), std::move(progress));
  sequence_->headers().set_advice(advise_);
  if (traffic_) {
    sequence_->headers().count_traffic_to(traffic_);
  }
}

void Communicator::set_advice(std::function<std::string(const std::string&)> advise) {
  advise_ = std::move(advise);
  if (sequence_) {
    sequence_->headers().set_advice(advise_);
  }
}

void Communicator::begin_round(int64_t key, const std::string& label) {
  if (sequence_) {
    sequence_->begin_round(key, label);
  }
}

void Communicator::abandon(const std::vector<c10::intrusive_ptr<c10d::Work>>& works) const {
  keep_until_exit(group_, works);
}

bool Communicator::failed() const {
  return failed_ || (sequence_ && (sequence_->failed() || sequence_->headers().failed()));
}

std::string Communicator::failure_report() const {
  if (!failed()) {
    return {};
  }
  std::string report = sequence_ ? sequence_->failure_report() : std::string();
  return report.empty() ? posted_report() : report;
}

int64_t Communicator::blocking_headers() const { return sequence_ ? sequence_->blocking_headers() : 0; }
int64_t Communicator::ahead_headers() const { return sequence_ ? sequence_->ahead_headers() : 0; }

c10::intrusive_ptr<c10d::Work> Communicator::issue_now(
    const char* kind, int64_t numel, TrafficKind traffic_kind, int64_t wire_bytes,
    const std::function<c10::intrusive_ptr<c10d::Work>()>& issue) {
  const int64_t seq = issued_++;
  ++collectives_issued_;
  if (traffic_) {
    traffic_->bytes[static_cast<int>(traffic_kind)] += wire_bytes;
  }
  (*counts_)[static_cast<int>(slot_)] = seq + 1;
  if (IssueLog* log = issue_log_.load()) {
    std::lock_guard<std::mutex> lock(log->mutex);
    log->lines.push_back(issue_tag_ + " " + kind + " " + std::to_string(numel));
  }
  c10::intrusive_ptr<c10d::Work> work = issue();
  if (work && store_) {  // positions matter only to the stall diagnosis
    std::lock_guard<std::mutex> lock(seq_mutex_);
    if (in_flight_seq_.size() > 4096) {
      in_flight_seq_.pop_front();
    }
    in_flight_seq_.emplace_back(work.get(), seq);
  }
  return work;
}

c10::intrusive_ptr<c10d::Work> Communicator::submit(CollectiveOp op, Purpose purpose, int64_t subject,
                                                    const at::Tensor& sent, const std::string& label,
                                                    const char* kind, const at::Tensor& logged,
                                                    std::function<c10::intrusive_ptr<c10d::Work>()> issue,
                                                    int64_t wire_bytes) {
  if (local()) {
    return nullptr;  // the result is already in place
  }
  ++submitted_;
  const int64_t numel = logged.numel();
  TrafficKind traffic_kind = purpose == Purpose::kHeader ? TrafficKind::kHeaders : TrafficKind::kAllReduce;
  if (wire_bytes < 0) {  // the plain collective's bytes ([Note: traffic])
    const int64_t bytes = static_cast<int64_t>(sent.nbytes()), n = size_;
    wire_bytes = op == CollectiveOp::kAllGather ? (n - 1) * bytes
                 : op == CollectiveOp::kAllReduceSum || op == CollectiveOp::kAllReduceMax ? 2 * (n - 1) * bytes / n
                                                                                        : (n - 1) * bytes / n;
  }
  if (purpose != Purpose::kHeader) {
    traffic_kind = op == CollectiveOp::kAllGather       ? TrafficKind::kAllGather
                   : op == CollectiveOp::kReduceScatter ? TrafficKind::kReduceScatter
                   : op == CollectiveOp::kBroadcast     ? TrafficKind::kBroadcast
                                                        : TrafficKind::kAllReduce;
  }
  if (!sequence_) {
    return issue_now(kind, numel, traffic_kind, wire_bytes, issue);
  }
  CollectiveId id;
  id.purpose = purpose;
  id.subject = subject;
  id.op = op;
  id.numel = sent.numel();
  id.dtype = static_cast<int64_t>(sent.scalar_type());
  return sequence_->submit(id, label, sent.device(),
                           [this, kind, numel, traffic_kind, wire_bytes, issue = std::move(issue)] {
                             return issue_now(kind, numel, traffic_kind, wire_bytes, issue);
                           });
}

int64_t Communicator::seq_of(const c10::intrusive_ptr<c10d::Work>& work) const {
  std::lock_guard<std::mutex> lock(seq_mutex_);
  for (auto it = in_flight_seq_.rbegin(); it != in_flight_seq_.rend(); ++it) {
    if (it->first == work.get()) {
      return it->second;
    }
  }
  return -1;
}

void Communicator::forget_seq(const c10::intrusive_ptr<c10d::Work>& work) const {
  std::lock_guard<std::mutex> lock(seq_mutex_);
  for (auto it = in_flight_seq_.begin(); it != in_flight_seq_.end(); ++it) {
    if (it->first == work.get()) {
      in_flight_seq_.erase(it);
      return;
    }
  }
}

bool Communicator::waits_on_host(c10::DeviceType device_type) const {
  if (!group_) {
    return false;
  }
  if (device_type == c10::DeviceType::CPU) {
    return true;
  }
  return backend_name(device_type) != "nccl";  // "" (no backend for the device yet): the general case
}

std::string Communicator::backend_name(c10::DeviceType device_type) const {
  if (!group_) {
    return "";
  }
  try {
    return group_->getBackend(device_type)->getBackendName();
  } catch (const c10::Error&) {
    return "";
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

c10::intrusive_ptr<c10d::Work> Communicator::all_reduce_sum(at::Tensor& tensor, Purpose purpose, int64_t subject,
                                                            const std::string& label) {
  auto group = group_;
  return submit(CollectiveOp::kAllReduceSum, purpose, subject, tensor, label, "all_reduce", tensor,
                [group, tensor] { return all_reduce(group, const_cast<at::Tensor&>(tensor), c10d::ReduceOp::SUM); });
}

c10::intrusive_ptr<c10d::Work> Communicator::all_reduce_max(at::Tensor& tensor, Purpose purpose, int64_t subject,
                                                            const std::string& label) {
  auto group = group_;
  return submit(CollectiveOp::kAllReduceMax, purpose, subject, tensor, label, "all_reduce_max", tensor,
                [group, tensor] { return all_reduce(group, const_cast<at::Tensor&>(tensor), c10d::ReduceOp::MAX); });
}

c10::intrusive_ptr<c10d::Work> Communicator::reduce_scatter_sum(at::Tensor& shard_out, at::Tensor& full_in,
                                                                Purpose purpose, int64_t subject) {
  TORCH_CHECK(full_in.numel() == shard_out.numel() * size_,
              "zero_ext internal: reduce-scatter input is not world_size shards");
  if (local()) {
    if (!shard_out.is_same(full_in)) {  // one rank staging into its accumulator: already there
      shard_out.copy_(full_in);
    }
    return nullptr;
  }
  auto group = group_;
  if (collectives_by_exchange(full_in.device())) {
    return submit(CollectiveOp::kReduceScatter, purpose, subject, full_in, {}, "reduce_scatter", full_in,
                  [group, shard_out, full_in] { return start_exchange_reduce_scatter(group, shard_out, full_in); });
  }
  return submit(CollectiveOp::kReduceScatter, purpose, subject, full_in, {}, "reduce_scatter", full_in,
                [group, shard_out, full_in] {
                  c10d::ReduceScatterOptions opts;
                  opts.reduceOp = c10d::ReduceOp::SUM;
                  at::Tensor out = shard_out, in = full_in;
                  return group->_reduce_scatter_base(out, in, opts);
                });
}

bool Communicator::collectives_by_exchange(c10::Device device) const {
  return !local() && device.is_cpu() && backend_name(c10::DeviceType::CPU) == "gloo";
}

c10::intrusive_ptr<c10d::Work> Communicator::all_gather(at::Tensor& full_out, at::Tensor& shard_in, Purpose purpose,
                                                        int64_t subject, const std::string& label) {
  TORCH_CHECK(full_out.numel() == shard_in.numel() * size_,
              "zero_ext internal: all-gather output is not world_size shards");
  if (local()) {
    if (shard_in.data_ptr() != full_out.data_ptr()) {  // in place: already there
      full_out.copy_(shard_in);
    }
    return nullptr;
  }
  ++all_gathers_issued_;
  auto group = group_;
  if (purpose != Purpose::kHeader && collectives_by_exchange(full_out.device())) {
    // gloo on CPU: [Note: gloo's all-gather as an exchange]; headers are a few words
    return submit(CollectiveOp::kAllGather, purpose, subject, shard_in, label, "all_gather", full_out,
                  [group, full_out, shard_in] { return start_exchange_all_gather(group, full_out, shard_in); });
  }
  return submit(CollectiveOp::kAllGather, purpose, subject, shard_in, label, "all_gather", full_out,
                [group, full_out, shard_in] {
                  at::Tensor out = full_out, in = shard_in;
                  return group->_allgather_base(out, in, c10d::AllgatherOptions());
                });
}

c10::intrusive_ptr<c10d::Work> Communicator::broadcast_from_rank0(at::Tensor& tensor, Purpose purpose,
                                                                  int64_t subject, const std::string& label) {
  auto group = group_;
  return submit(CollectiveOp::kBroadcast, purpose, subject, tensor, label, "broadcast", tensor, [group, tensor] {
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = 0;
    return group->broadcast(tensors, opts);
  });
}

c10::intrusive_ptr<c10d::Work> Communicator::quantized_reduce_scatter_sum(at::Tensor& shard_out, at::Tensor& full_in,
                                                                          const QuantFormat& format,
                                                                          const at::Tensor& residual, Purpose purpose,
                                                                          int64_t subject) {
  if (local()) {
    return reduce_scatter_sum(shard_out, full_in, purpose, subject);  // a copy: nothing to round
  }
  TORCH_CHECK(full_in.numel() == shard_out.numel() * size_,
              "zero_ext internal: reduce-scatter input is not world_size shards");
  auto group = group_;
  const int64_t wire_bytes = (size_ - 1) * format.payload_bytes(shard_out.numel());
  return submit(
      CollectiveOp::kReduceScatter, purpose, subject, full_in, {}, "reduce_scatter", full_in,
      [group, shard_out, full_in, format, residual] {
        return start_quantized_reduce_scatter(group, shard_out, full_in, format, residual);
      },
      wire_bytes);
}

bool Communicator::quantized_all_reduce_pays(const at::Tensor& tensor, const QuantFormat& format) const {
  // (R - 1) payloads against 2 (R - 1) / R x the tensor's bytes.
  return !local() && format.enabled() &&
         size_ * format.payload_bytes(tensor.numel()) < 2 * static_cast<int64_t>(tensor.nbytes());
}

c10::intrusive_ptr<c10d::Work> Communicator::quantized_all_reduce_sum(at::Tensor& tensor, const QuantFormat& format,
                                                                      const at::Tensor& residual, Purpose purpose,
                                                                      int64_t subject) {
  if (local()) {
    return nullptr;  // the sum over one rank is in place
  }
  auto group = group_;
  const int64_t wire_bytes = (size_ - 1) * format.payload_bytes(tensor.numel());
  return submit(
      CollectiveOp::kAllReduceSum, purpose, subject, tensor, {}, "all_reduce", tensor,
      [group, tensor, format, residual] { return start_quantized_all_reduce(group, tensor, format, residual); },
      wire_bytes);
}

c10::intrusive_ptr<c10d::Work> Communicator::quantized_all_gather(at::Tensor& full_out, at::Tensor& shard_in,
                                                                  const QuantFormat& format, Purpose purpose,
                                                                  int64_t subject) {
  if (local()) {
    return all_gather(full_out, shard_in, purpose, subject);
  }
  TORCH_CHECK(full_out.numel() == shard_in.numel() * size_,
              "zero_ext internal: all-gather output is not world_size shards");
  ++all_gathers_issued_;
  auto group = group_;
  const int64_t wire_bytes = (size_ - 1) * format.payload_bytes(shard_in.numel());
  return submit(
      CollectiveOp::kAllGather, purpose, subject, shard_in, {}, "all_gather", full_out,
      [group, full_out, shard_in, format] { return start_quantized_all_gather(group, full_out, shard_in, format); },
      wire_bytes);
}

void Communicator::count_traffic_to(std::shared_ptr<Traffic> traffic) {
  traffic_ = std::move(traffic);
  if (sequence_) {
    sequence_->headers().count_traffic_to(traffic_);
  }
}

void Communicator::wait(const c10::intrusive_ptr<c10d::Work>& submitted,
                        const std::function<std::string()>& what) const {
  if (!submitted) {
    return;
  }
  c10::intrusive_ptr<c10d::Work> work = submitted;
  if (sequence_) {
    // A collective that waits for its headers: wait for them first (the
    // header group's own bounded, diagnosed waits), then for it.
    work = sequence_->issued_work(submitted, what);
    if (!work) {
      return;
    }
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
    wait_out_stall(work, what);  // stall_diagnosis.cpp
  }
  try {
    work->wait();
  } catch (const std::exception& e) {
    failed_ = true;
    abandon({work});  // if it still runs: the wait gave up on it
    forget_seq(work);
    // A rank whose sequence check found the difference posted it before
    // leaving: that, not the broken connection, is the cause.
    const std::string report = posted_report();
    TORCH_CHECK(report.empty(), report);
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    TORCH_CHECK(false, "zero_ext: ", what(), " failed on rank ", rank_, " of ", size_,
                " (a peer may have died, raised, or taken a different code path): ",
                error ? error->what_without_backtrace() : e.what());
  }
  forget_seq(work);
  if (stalled) {
    clear_stall_post();
  }
}

} // namespace zero_ext
