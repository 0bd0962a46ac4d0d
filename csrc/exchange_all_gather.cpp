#include "exchange_all_gather.h"

#include "reusable_blocks.h"

#include <vector>

namespace zero_ext {

c10::intrusive_ptr<c10d::Work> start_exchange_all_gather(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                         const at::Tensor& full_out, const at::Tensor& shard_in) {
  const int64_t ranks = group->getSize();
  TORCH_CHECK(full_out.is_contiguous() && full_out.numel() == shard_in.numel() * ranks,
              "zero_ext internal: all-gather by exchange needs a contiguous output of one shard per rank");
  at::Tensor repeated = reusable_empty({ranks, shard_in.numel()}, shard_in.options());  // row r goes to rank r
  repeated.copy_(shard_in.reshape({1, -1}).expand({ranks, -1}));
  at::Tensor in = repeated.view(-1), out = full_out.view(-1);
  std::vector<int64_t> even;  // no split sizes: equal chunks
  return group->alltoall_base(out, in, even, even);
}

} // namespace zero_ext
