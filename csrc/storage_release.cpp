#include "storage_release.h"

#include <c10/core/Allocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <utility>

namespace zero_ext {

void release_storage(const at::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(0);
}

void grow_storage(const at::Tensor& tensor, size_t nbytes) {
  grow_storage(tensor, nbytes, tensor.storage().unsafeGetStorageImpl()->allocator());
}

void grow_storage(const at::Tensor& tensor, size_t nbytes, c10::Allocator* allocator) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  TORCH_CHECK(allocator != nullptr, "zero_ext internal: parameter storage has no allocator to grow from");
  // Allocators take the current device: make it the storage's own.
  c10::OptionalDeviceGuard guard(storage->device());
  storage->set_data_ptr_noswap(allocator->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

bool storage_is_released(const at::Tensor& tensor) {
  return tensor.storage().nbytes() == 0;
}

c10::Storage unreadable_storage(c10::Device device, size_t nbytes, const std::string& message) {
  auto impl = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), 0,
                                                    at::DataPtr(nullptr, device), nullptr,
                                                    /*resizable=*/false);
  impl->release_data_and_set_meta_custom_data_ptr_error_msg_(message);
  impl->set_nbytes(nbytes);  // views are bounds-checked against it: see the note
  return c10::Storage(std::move(impl));
}

at::Tensor unreadable_like(const at::Tensor& like, const std::string& message) {
  return unreadable_tensor(like.sizes().vec(), like.scalar_type(), like.device(), message);
}

at::Tensor unreadable_tensor(std::vector<int64_t> sizes, c10::ScalarType dtype, c10::Device device,
                             std::string message) {
  at::Tensor out = at::empty({0}, at::TensorOptions().dtype(dtype).device(device));
  int64_t numel = 1;
  for (int64_t d : sizes) numel *= d;
  c10::TensorImpl* impl = out.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(unreadable_storage(device, numel * c10::elementSize(dtype), message));
  impl->set_sizes_contiguous(sizes);
  return out;
}

void point_at(const at::Tensor& tensor, const c10::Storage& storage) {
  c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
  if (impl->storage().unsafeGetStorageImpl() != storage.unsafeGetStorageImpl()) {
    impl->set_storage_keep_dtype(storage);
  }
}

} // namespace zero_ext
