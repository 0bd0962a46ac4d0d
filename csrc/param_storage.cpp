#include "param_storage.h"

#include <c10/core/Allocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>

namespace zero_ext {

void release_storage(const at::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(0);
}

void grow_storage(const at::Tensor& tensor, size_t nbytes) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  TORCH_CHECK(storage->allocator() != nullptr,
              "zero_ext internal: parameter storage has no allocator to grow from");
  // Allocators take the current device: make it the storage's own.
  c10::OptionalDeviceGuard guard(storage->device());
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

bool storage_is_released(const at::Tensor& tensor) {
  return tensor.storage().nbytes() == 0;
}

} // namespace zero_ext
