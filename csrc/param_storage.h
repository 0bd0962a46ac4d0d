#pragma once
// Growing and shrinking a flat parameter buffer's storage in place.
//
// [Note: release by resize]
// Stage 3 frees a unit's full parameters by shrinking the storage they view to
// zero bytes, and gathers them by growing it back and writing into it. The
// parameter tensors, and every tensor autograd saved that views them, stay the
// same objects with the same version counters, so a graph kept with
// retain_graph=True, or a reentrant checkpoint's recompute, sees the gathered
// values again. Reading a released parameter is invalid (it holds no memory):
// zero_ext gathers units before their forward and backward, and
// zero_ext.full_state_dict() gathers for inspection.

#include <ATen/ATen.h>

namespace zero_ext {

// Frees the memory behind `tensor`'s storage; its views keep their metadata.
void release_storage(const at::Tensor& tensor);
// Gives the storage `nbytes` of fresh (uninitialized) memory from its own
// allocator, so this works for any device without device-specific code.
void grow_storage(const at::Tensor& tensor, size_t nbytes);
bool storage_is_released(const at::Tensor& tensor);

} // namespace zero_ext
