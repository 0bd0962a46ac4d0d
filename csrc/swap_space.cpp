#include "swap_space.h"

#include <algorithm>
#include <exception>
#include <utility>

#include <c10/util/Exception.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "storage_release.h"

namespace zero_ext {

// [Note: memory handed back]
// What offload parks must leave the process, not wait in the allocator: glibc
// serves blocks under its mmap threshold from the heap and keeps them once
// freed, and it raises that threshold to the size of each mmapped block
// freed (up to 32 MiB), so after a few bucket-sized buffers came and went
// every later one stays resident. A fixed threshold (which also turns the
// raising off) gives every block of 1 MiB and up its own mapping, returned
// to the system when freed. Process-wide; set once offload to files is on,
// the setting that asks for memory to be given back.
SwapSpace::SwapSpace(std::string path, int64_t threads, int64_t chunk_bytes, int64_t max_writing_bytes)
    : path_(std::move(path)), threads_(threads), chunk_bytes_(chunk_bytes), max_writing_bytes_(max_writing_bytes) {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
#endif
}

SwapSpace::~SwapSpace() {
  if (!file_) return;
  for (Slot& slot : slots_) {
    if (slot.state == SlotState::kReading || slot.state == SlotState::kWriting) {
      try {
        file_->wait(slot.ticket);
      } catch (...) {  // nobody is left to tell; the memory is what must outlive the transfer
      }
    }
  }
}

int64_t SwapSpace::add(const at::Tensor& tensor, std::string what) {
  TORCH_CHECK(!is_open(), "zero_ext internal: a swap slot added after the offload file was made");
  TORCH_CHECK(tensor.device().is_cpu() && tensor.is_contiguous() && tensor.storage_offset() == 0,
              "zero_ext internal: a swap slot is a contiguous CPU tensor at the start of its storage");
  Slot slot;
  slot.tensor = tensor;
  slot.bytes = tensor.nbytes();
  slot.offset = planned_bytes_;
  slot.what = std::move(what);
  slot.state = storage_is_released(tensor) ? SlotState::kEmpty : SlotState::kResident;
  if (slot.state == SlotState::kResident) resident_bytes_ += slot.bytes;
  planned_bytes_ += (std::max<int64_t>(slot.bytes, 1) + SwapFile::kAlign - 1) / SwapFile::kAlign * SwapFile::kAlign;
  max_cached_bytes_ = std::max<int64_t>(max_cached_bytes_, 2 * slot.bytes);
  slots_.push_back(std::move(slot));
  peak_resident_bytes_ = std::max(peak_resident_bytes_, resident_bytes_);
  return static_cast<int64_t>(slots_.size()) - 1;
}

void SwapSpace::open() {
  TORCH_CHECK(!is_open(), "zero_ext internal: the offload file is made once");
  file_ = c10::make_intrusive<SwapFile>(path_, planned_bytes_, threads_, chunk_bytes_);
  for (int64_t s = 0; s < num_slots(); ++s) {
    park(s, /*dirty=*/true);
  }
  drain();
}

SwapSpace::Slot& SwapSpace::slot_at(int64_t slot) {
  TORCH_CHECK(slot >= 0 && slot < num_slots(), "zero_ext internal: no swap slot ", slot);
  return slots_[slot];
}

void SwapSpace::grow_tensor(const at::Tensor& tensor, size_t nbytes) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  auto found = free_blocks_.find(nbytes);
  if (found == free_blocks_.end() || found->second.empty()) {
    grow_storage(tensor, nbytes);
    return;
  }
  storage->set_data_ptr_noswap(std::move(found->second.back()));
  found->second.pop_back();
  cached_bytes_ -= static_cast<int64_t>(nbytes);
  storage->set_nbytes(nbytes);
}

void SwapSpace::release_tensor(const at::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  const size_t nbytes = storage->nbytes();
  at::DataPtr block = storage->set_data_ptr(at::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(0);
  if (block.get() != nullptr && cached_bytes_ + static_cast<int64_t>(nbytes) <= max_cached_bytes_) {
    free_blocks_[nbytes].push_back(std::move(block));
    cached_bytes_ += static_cast<int64_t>(nbytes);
  }  // else freed here, as the block goes out of scope
}

void SwapSpace::grow(Slot& slot) {
  grow_tensor(slot.tensor, slot.bytes);
  resident_bytes_ += slot.bytes;
  peak_resident_bytes_ = std::max(peak_resident_bytes_, resident_bytes_);
}

void SwapSpace::release(Slot& slot) {
  release_tensor(slot.tensor);
  resident_bytes_ -= slot.bytes;
}

void SwapSpace::finish(Slot& slot) {
  if (slot.state != SlotState::kReading && slot.state != SlotState::kWriting) {
    return;
  }
  const bool writing = slot.state == SlotState::kWriting;
  if (writing) {
    const int64_t index = &slot - slots_.data();
    writing_.erase(std::find(writing_.begin(), writing_.end(), index));
    writing_bytes_ -= slot.bytes;
  }
  try {
    file_->wait(slot.ticket);
  } catch (const std::exception& e) {
    if (on_failure_) on_failure_(e.what());
    if (writing) {
      slot.state = SlotState::kResident;  // the value is still in memory: nothing lost
      slot.in_file = false;
    } else {
      release(slot);  // what was read is garbage; the file still holds the value
      slot.state = SlotState::kParked;
    }
    throw;
  }
  slot.state = SlotState::kResident;
  slot.in_file = true;
}

void SwapSpace::reap(bool all) {
  while (!writing_.empty()) {
    Slot& slot = slots_[writing_.front()];
    const bool over_bound = writing_bytes_ > max_writing_bytes_;
    if (!all && !over_bound && !file_->done(slot.ticket)) {
      return;
    }
    finish(slot);
    release(slot);
    slot.state = SlotState::kParked;
  }
}

void SwapSpace::park(int64_t index, bool dirty) {
  Slot& slot = slot_at(index);
  finish(slot);  // a read in flight lands first
  if (slot.state != SlotState::kResident) {
    return;  // parked, or being written already
  }
  if (!dirty && slot.in_file) {
    release(slot);
    slot.state = SlotState::kParked;
    return;
  }
  slot.ticket = file_->write(slot.offset, slot.tensor);
  slot.state = SlotState::kWriting;
  writing_.push_back(index);
  writing_bytes_ += slot.bytes;
  reap(/*all=*/false);
}

void SwapSpace::prefetch(int64_t index) {
  Slot& slot = slot_at(index);
  if (slot.state != SlotState::kParked) {
    return;
  }
  reap(/*all=*/false);
  grow(slot);
  slot.ticket = file_->read(slot.offset, slot.tensor);
  slot.state = SlotState::kReading;
}

void SwapSpace::ensure(int64_t index) {
  Slot& slot = slot_at(index);
  TORCH_CHECK(slot.state != SlotState::kEmpty, "zero_ext internal: ", slot.what,
              " was read from the offload file before any value was written");
  prefetch(index);
  finish(slot);
}

void SwapSpace::ensure_memory(int64_t index) {
  Slot& slot = slot_at(index);
  finish(slot);
  if (slot.state == SlotState::kParked || slot.state == SlotState::kEmpty) {
    grow(slot);
    slot.state = SlotState::kResident;
  }
  slot.in_file = false;  // the caller overwrites it
}

void SwapSpace::discard(int64_t index) {
  Slot& slot = slot_at(index);
  finish(slot);
  if (slot.state == SlotState::kResident) {
    release(slot);
  }
  slot.state = SlotState::kEmpty;
  slot.in_file = false;
}

bool SwapSpace::resident(int64_t index) const {
  const SlotState state = slots_.at(index).state;
  return state == SlotState::kResident || state == SlotState::kWriting;
}

void SwapSpace::drain() {
  if (!is_open()) return;
  reap(/*all=*/true);
#if defined(__GLIBC__)
  // [Note: memory handed back] The step's small blocks (a bias's state, its
  // temporaries) leave free holes inside the heap that only a trim returns.
  malloc_trim(0);
#endif
}

} // namespace zero_ext
