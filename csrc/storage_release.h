#pragma once
// Growing and shrinking a flat parameter buffer's storage in place.
//
// [Note: release by resize]
// Stage 3 frees a unit's full parameters by shrinking the storage they view to
// zero bytes, and gathers them by growing it back and writing into it. The
// parameter tensors, and every tensor autograd saved that views them, stay the
// same objects with the same version counters, so a graph kept with
// retain_graph=True, or a reentrant checkpoint's recompute, sees the gathered
// values again.
//
// [Note: unreadable released parameters]
// A released parameter must never be read through the freed buffer (print(p),
// p.norm() or p.numpy() outside forward would dereference nothing). While its
// unit is released, each parameter tensor points at a storage of its own that
// holds no memory and raises an error naming zero_ext.full_params on any data
// access (torch's custom data-pointer error, the mechanism fake tensors use);
// gathering points it back at the unit's buffer. Only the parameter tensors
// move: views autograd saved keep the buffer's storage and see it regrown.
// The storage claims the bytes the tensor needs: views are bounds-checked
// against the storage's size before any data is read (F.linear transposes
// the weight first), so a storage of 0 bytes would end such an op in torch's
// "out of bounds for storage of size 0" instead of the message. Such a
// storage is never resizable, which is how Python tells it apart.

#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Storage.h>

namespace zero_ext {

// Frees the memory behind `tensor`'s storage; its views keep their metadata.
void release_storage(const at::Tensor& tensor);
// Gives the storage `nbytes` of fresh (uninitialized) memory from its own
// allocator, so this works for any device without device-specific code.
void grow_storage(const at::Tensor& tensor, size_t nbytes);
// The same from `allocator` (growth_allocator: [Note: reusable host blocks]).
void grow_storage(const at::Tensor& tensor, size_t nbytes, c10::Allocator* allocator);
bool storage_is_released(const at::Tensor& tensor);
// A storage of no memory that claims `nbytes` and whose data access raises `message`.
c10::Storage unreadable_storage(c10::Device device, size_t nbytes, const std::string& message);
// Points `tensor` at `storage`, keeping its sizes, strides, offset and version counter.
void point_at(const at::Tensor& tensor, const c10::Storage& storage);
// A tensor of `like`'s shape, dtype and device with no memory, whose data
// access raises `message`.
at::Tensor unreadable_like(const at::Tensor& like, const std::string& message);
// The same from a shape: torch.ops.zero_ext.unreadable_tensor, what a meta
// parameter becomes on its device before wrap() gives it a bucket.
at::Tensor unreadable_tensor(std::vector<int64_t> sizes, c10::ScalarType dtype, c10::Device device,
                             std::string message);

} // namespace zero_ext
