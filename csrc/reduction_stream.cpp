#include "reduction_stream.h"

#include <cstdlib>
#include <cstring>

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace zero_ext {
namespace {

bool reduction_stream_requested() {
  const char* value = std::getenv("ZERO_EXT_REDUCTION_STREAM");
  return value == nullptr || std::strcmp(value, "0") != 0;
}

// Accelerators whose backends keep a stream pool and events (CPU has neither).
bool has_stream_pool(const c10::Device& device) {
  return device.is_cuda() || device.is_xpu();
}

}  // namespace

ReductionStream::ReductionStream(c10::Device device) : device_(device) {
  if (has_stream_pool(device) && reduction_stream_requested()) {
    c10::impl::VirtualGuardImpl impl(device.type());
    reduction_ = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/true);
  }
}

c10::Stream ReductionStream::compute() const {
  return c10::impl::VirtualGuardImpl(device_.type()).getStream(device_);
}

void ReductionStream::wait(const c10::Stream& waiter, const c10::Stream& signaler) {
  if (waiter == signaler) {
    return;
  }
  c10::Event event(signaler.device_type());
  event.record(signaler);
  event.block(waiter);
}

} // namespace zero_ext
