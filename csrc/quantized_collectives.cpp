#include "quantized_collectives.h"

#include <initializer_list>
#include <vector>

#include <c10/core/impl/VirtualGuardImpl.h>

#include "continued_work.h"

namespace zero_ext {
namespace {

// On an accelerator the continuation's kernels run on the stream current in
// the callback, after it returns: the buffers they read (held by the
// closure alone) must not go back to the caching allocator before those
// kernels ran. A no-op on the CPU, where the callback finishes the work.
void keep_for_current_stream(std::initializer_list<at::Tensor> tensors) {
  for (const at::Tensor& t : tensors) {
    if (t.defined() && !t.is_cpu()) {
      at::Tensor held = t;
      held.record_stream(c10::impl::VirtualGuardImpl(t.device().type()).getStream(t.device()));
    }
  }
}

} // namespace

c10::intrusive_ptr<c10d::Work> start_quantized_reduce_scatter(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                              const at::Tensor& shard_out, const at::Tensor& full_in,
                                                              const QuantFormat& format, const at::Tensor& residual) {
  const int64_t ranks = group->getSize(), rank = group->getRank();
  TORCH_CHECK(full_in.is_contiguous() && shard_out.is_contiguous() && full_in.numel() == shard_out.numel() * ranks,
              "zero_ext internal: a quantized reduce-scatter needs contiguous buffers of one shard per rank");
  const int64_t n = shard_out.numel(), bytes = format.payload_bytes(n);
  // What this rank sends: its gradients plus what the last reduction's
  // rounding kept back (read only when no residual: full_in itself if fp32).
  at::Tensor wanted = residual.defined() ? full_in.to(at::kFloat) + residual : full_in.to(at::kFloat);
  at::Tensor payload = at::empty({ranks * bytes}, full_in.options().dtype(at::kByte));
  for (int64_t r = 0; r < ranks; ++r) {
    at::Tensor out = payload.narrow(0, r * bytes, bytes);
    if (r == rank) {
      out.zero_();  // to itself: never on the wire, summed exact below
      continue;
    }
    quantize_blocks(wanted.narrow(0, r * n, n), out, format,
                    residual.defined() ? residual.narrow(0, r * n, n) : at::Tensor());
  }
  if (residual.defined()) {
    residual.narrow(0, rank * n, n).zero_();
  }
  at::Tensor own = wanted.narrow(0, rank * n, n);
  at::Tensor received = at::empty_like(payload);  // row r: rank r's payload for this rank
  std::vector<int64_t> even;  // no split sizes: equal chunks
  auto exchange = group->alltoall_base(received, payload, even, even);
  auto summed = exchange->getFuture()->then(
      [received, payload, own, shard_out, ranks, rank, n, bytes, format](c10::ivalue::Future& done) -> c10::IValue {
        if (done.hasError()) {
          std::rethrow_exception(done.exception_ptr());  // then() hands it on to the summed future
        }
        keep_for_current_stream({received, payload, own});
        at::Tensor sum = shard_out.scalar_type() == at::kFloat ? shard_out : at::empty({n}, own.options());
        for (int64_t r = 0; r < ranks; ++r) {  // in rank order: the same sum on every run
          if (r == rank) {
            r == 0 ? sum.copy_(own) : sum.add_(own);
          } else {
            dequantize_blocks(received.narrow(0, r * bytes, bytes), sum, format, /*accumulate=*/r > 0);
          }
        }
        if (!sum.is_same(shard_out)) {
          at::Tensor out = shard_out;
          out.copy_(sum);
        }
        return c10::IValue(shard_out);
      },
      c10::TensorType::get());
  return c10::make_intrusive<ContinuedWork>(std::move(exchange), std::move(summed), c10d::OpType::REDUCE_SCATTER);
}

c10::intrusive_ptr<c10d::Work> start_quantized_all_gather(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                          const at::Tensor& full_out, const at::Tensor& shard_in,
                                                          const QuantFormat& format) {
  const int64_t ranks = group->getSize();
  TORCH_CHECK(full_out.is_contiguous() && full_out.numel() == shard_in.numel() * ranks,
              "zero_ext internal: a quantized all-gather needs a contiguous output of one shard per rank");
  const int64_t n = shard_in.numel(), bytes = format.payload_bytes(n);
  at::Tensor payload = at::empty({bytes}, shard_in.options().dtype(at::kByte));
  quantize_blocks(shard_in.to(at::kFloat).contiguous().view(-1), payload, format, at::Tensor());
  at::Tensor gathered = at::empty({ranks * bytes}, payload.options());
  auto gather = group->_allgather_base(gathered, payload, c10d::AllgatherOptions());
  auto unpacked = gather->getFuture()->then(
      [gathered, payload, full_out, ranks, n, bytes, format](c10::ivalue::Future& done) -> c10::IValue {
        if (done.hasError()) {
          std::rethrow_exception(done.exception_ptr());
        }
        keep_for_current_stream({gathered, payload});
        const bool fp32 = full_out.scalar_type() == at::kFloat;
        at::Tensor values = fp32 ? at::Tensor() : at::empty({n}, full_out.options().dtype(at::kFloat));
        for (int64_t r = 0; r < ranks; ++r) {
          at::Tensor part = full_out.view(-1).narrow(0, r * n, n);
          dequantize_blocks(gathered.narrow(0, r * bytes, bytes), fp32 ? part : values, format, false);
          if (!fp32) {
            part.copy_(values);
          }
        }
        return c10::IValue(full_out);
      },
      c10::TensorType::get());
  return c10::make_intrusive<ContinuedWork>(std::move(gather), std::move(unpacked), c10d::OpType::_ALLGATHER_BASE);
}

c10::intrusive_ptr<c10d::Work> start_quantized_all_reduce(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                          const at::Tensor& tensor, const QuantFormat& format,
                                                          const at::Tensor& residual) {
  const int64_t ranks = group->getSize();
  TORCH_CHECK(tensor.is_contiguous(), "zero_ext internal: a quantized all-reduce needs a contiguous tensor");
  const int64_t n = tensor.numel(), bytes = format.payload_bytes(n);
  at::Tensor flat = tensor.view(-1);
  at::Tensor wanted = residual.defined() ? flat.to(at::kFloat) + residual : flat.to(at::kFloat).contiguous();
  at::Tensor payload = at::empty({bytes}, tensor.options().dtype(at::kByte));
  quantize_blocks(wanted, payload, format, residual);
  at::Tensor gathered = at::empty({ranks * bytes}, payload.options());
  auto gather = group->_allgather_base(gathered, payload, c10d::AllgatherOptions());
  auto summed = gather->getFuture()->then(
      [gathered, payload, flat, ranks, n, bytes, format](c10::ivalue::Future& done) -> c10::IValue {
        if (done.hasError()) {
          std::rethrow_exception(done.exception_ptr());
        }
        keep_for_current_stream({gathered, payload});
        // Every rank sums the same dequantized values in rank order: the replicas stay identical.
        at::Tensor sum = flat.scalar_type() == at::kFloat ? flat : at::empty({n}, flat.options().dtype(at::kFloat));
        for (int64_t r = 0; r < ranks; ++r) {
          dequantize_blocks(gathered.narrow(0, r * bytes, bytes), sum, format, /*accumulate=*/r > 0);
        }
        if (!sum.is_same(flat)) {
          at::Tensor out = flat;
          out.copy_(sum);
        }
        return c10::IValue(flat);
      },
      c10::TensorType::get());
  return c10::make_intrusive<ContinuedWork>(std::move(gather), std::move(summed), c10d::OpType::ALLREDUCE);
}

} // namespace zero_ext
