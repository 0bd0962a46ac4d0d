#pragma once
// ReductionStream: the side stream a wrapped model reduces gradients on, on an
// accelerator, through c10's device-generic Stream/Event (no CUDA code here,
// so the build stays pure C++ and CPU runs without streams).
//
// [Note: the reduction stream]
// With one stream, the division, the reduction's wait, the fold into the
// fp32 accumulator and the offloaded device-to-host copy all queue behind
// backward's compute kernels and hold them up. On the reduction stream:
//   launch   the reduction stream waits for the compute stream (the bucket's
//            gradients are in its staging), then divides and issues the
//            collective, which waits for the reduction stream;
//   retire   the reduction stream waits for the collective; the compute
//            stream then waits for the reduction stream before the staging
//            buffer (allocated on the compute stream) goes back to the
//            caching allocator, so it is reused in stream order with no
//            recordStream (memory stays bounded as FSDP2's does); the fold
//            and the offload copy follow on the reduction stream;
//   epilogue the compute stream waits for the reduction stream once, so the
//            optimizer and the next backward see the accumulators.
// The compute stream therefore waits only for a collective's completion, and
// only where the in-flight bound says so (or when it is already complete);
// the host never waits. Copying gradients into staging stays on the compute
// stream that produced them: an event per parameter would cost more than the
// copy. ZERO_EXT_REDUCTION_STREAM=0 turns the stream off (one stream, as
// before), to compare.
//
// Stage 3's gathers have no stream of their own. A prefetch is issued from
// the hook before the current unit's kernels are queued, so its collective
// already waits only for the compute queued before that unit and runs beside
// it; a gather stream would move only the cast of the master into the full
// buffer's slot, at the price of a second allocator pool for full buffers
// and an event per release to reuse them safely (FSDP2's design).

#include <optional>

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

namespace zero_ext {

class ReductionStream {
 public:
  explicit ReductionStream(c10::Device device);

  bool enabled() const { return reduction_.has_value(); }
  const c10::Stream& reduction() const { return *reduction_; }
  // The stream the caller computes on now (autograd's for the device).
  c10::Stream compute() const;

  // `waiter` waits for everything queued on `signaler` so far (no host wait).
  static void wait(const c10::Stream& waiter, const c10::Stream& signaler);
  void reduction_waits_for_compute() const { wait(*reduction_, compute()); }
  void compute_waits_for_reduction() const { wait(compute(), *reduction_); }

 private:
  c10::Device device_;
  std::optional<c10::Stream> reduction_;
};

} // namespace zero_ext
