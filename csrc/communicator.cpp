#include "communicator.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

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

c10::intrusive_ptr<c10d::Work> Communicator::all_reduce_sum(at::Tensor& tensor) {
  if (!group_) {
    return nullptr;
  }
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  ++collectives_issued_;
  return group_->allreduce(tensors, opts);
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
  return group_->_reduce_scatter_base(shard_out, full_in, opts);
}

c10::intrusive_ptr<c10d::Work> Communicator::all_gather(at::Tensor& full_out,
                                                        at::Tensor& shard_in) {
  TORCH_CHECK(full_out.numel() == shard_in.numel() * size_,
              "zero_ext internal: all-gather output is not world_size shards");
  if (!group_) {
    if (!shard_in.is_same(full_out)) {
      full_out.copy_(shard_in);
    }
    return nullptr;
  }
  ++collectives_issued_;
  ++all_gathers_issued_;
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
  return group_->broadcast(tensors, opts);
}

void Communicator::wait(const c10::intrusive_ptr<c10d::Work>& work,
                        const std::string& what) const {
  if (!work) {
    return;
  }
  try {
    work->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "zero_ext: ", what, " failed on rank ", rank_, " of ", size_,
                " (a peer may have died, raised, or taken a different code path): ",
                e.what());
  }
}

} // namespace zero_ext
