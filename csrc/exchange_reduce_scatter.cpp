#include "exchange_reduce_scatter.h"

#include "continued_work.h"
#include "reusable_blocks.h"

#include <vector>

namespace zero_ext {

c10::intrusive_ptr<c10d::Work> start_exchange_reduce_scatter(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                             const at::Tensor& shard_out, const at::Tensor& full_in) {
  const int64_t ranks = group->getSize();
  TORCH_CHECK(full_in.is_contiguous() && shard_out.is_contiguous() && full_in.numel() == shard_out.numel() * ranks,
              "zero_ext internal: reduce-scatter by exchange needs contiguous buffers of one shard per rank");
  at::Tensor received = reusable_empty(full_in.sizes(), full_in.options());  // row r: rank r's chunk for this rank
  at::Tensor in = full_in;
  std::vector<int64_t> even;  // no split sizes: equal chunks
  auto exchange = group->alltoall_base(received, in, even, even);
  auto summed = exchange->getFuture()->then(
      [received, shard_out, ranks](c10::ivalue::Future& done) -> c10::IValue {
        if (done.hasError()) {
          std::rethrow_exception(done.exception_ptr());  // then() hands it on to the summed future
        }
        at::Tensor out = shard_out;
        at::sum_out(out, received.view({ranks, -1}), 0);
        return c10::IValue(out);
      },
      c10::TensorType::get());
  return c10::make_intrusive<ContinuedWork>(std::move(exchange), std::move(summed), c10d::OpType::REDUCE_SCATTER);
}

} // namespace zero_ext
