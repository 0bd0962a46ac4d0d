#pragma once
// SwapSpace: the buffers of one wrapped model that offload_*="nvme" keeps in
// its offload file (swap_file.h) between uses: parameter shards, fp32
// masters, gradient accumulators. Each is a "slot": a tensor whose storage
// holds memory only while the slot is resident.
//
// [Note: swapped buffers]
// - park(slot, dirty) writes the value unless the file holds it already, and
//   lets go of the memory once the write is done (write-behind: the caller
//   goes on; at most max_writing_bytes are in flight, past that the oldest
//   write is waited for).
// - prefetch(slot) grows the memory and starts reading (read-ahead);
//   ensure(slot) returns with the value in memory. ensure_memory(slot) is
//   for a caller about to overwrite every byte (no read).
// - The storage is released and regrown in place ([Note: release by resize]
//   in storage_release.h): views of the tensor keep their metadata and see
//   the value again once resident. Nothing may read them while parked; the
//   owners point the views they hand out elsewhere (ParamStore's segments,
//   GradReducer's segment gradients).
// - A failed write keeps the value in memory (the slot stays resident and
//   dirty) and raises the file's error, which names the file, the region and
//   errno: a full disk ends the step that hit it, never with a value lost.

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>

#include "swap_file.h"

namespace zero_ext {

class SwapSpace {
 public:
  SwapSpace(std::string path, int64_t threads, int64_t chunk_bytes, int64_t max_writing_bytes);
  // Waits out every transfer in flight: the I/O threads use the slots' memory.
  ~SwapSpace();
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  // Before open(): `tensor` (contiguous CPU memory, its storage's own first
  // byte) gets a region of the file; `what` names it in errors.
  int64_t add(const at::Tensor& tensor, std::string what);
  // Creates the file with every region reserved (errors name the file and
  // the bytes), then parks every slot: written, memory released.
  void open();
  bool is_open() const { return file_.defined(); }

  void park(int64_t slot, bool dirty);
  void prefetch(int64_t slot);
  void ensure(int64_t slot);
  void ensure_memory(int64_t slot);
  // The value is no longer needed (zero_grad): memory released, nothing written.
  void discard(int64_t slot);
  // Whether the slot's memory holds its value now (resident, or being written; not while a read lands).
  bool resident(int64_t slot) const;
  // Every write done; raises the first failure.
  void drain();

  const std::string& path() const { return path_; }
  int64_t file_bytes() const { return file_.defined() ? file_->bytes() : 0; }
  int64_t bytes_written() const { return file_.defined() ? file_->bytes_written() : 0; }
  int64_t bytes_read() const { return file_.defined() ? file_->bytes_read() : 0; }
  int64_t resident_bytes() const { return resident_bytes_; }
  int64_t peak_resident_bytes() const { return peak_resident_bytes_; }
  int64_t io_buffer_bytes() const { return threads_ * chunk_bytes_; }
  int64_t num_slots() const { return static_cast<int64_t>(slots_.size()); }
  void reset_peak() { peak_resident_bytes_ = resident_bytes_; }
  // [Note: recycled host blocks] Memory for slots and for the buffers that
  // come and go with them (stage 3's full buffers): a block released is kept
  // for the next request of its size, up to a cap, instead of going back to
  // the system and coming again as fresh pages (a page fault per 4 KiB, and
  // the kernel zeroing them: ~1.5 ms per 4 MiB block, five blocks per unit
  // and step). What is cached counts in resident memory: the cap is
  // max(8 MiB, 2 x the largest slot).
  void grow_tensor(const at::Tensor& tensor, size_t nbytes);
  void release_tensor(const at::Tensor& tensor);
  // Called with the file's error when a transfer fails, before it is raised
  // (ShardedModel stops the rank and tells the others: [Note: an offload file that failed]).
  void on_failure(std::function<void(const std::string&)> callback) { on_failure_ = std::move(callback); }
  // Test-only: see SwapFile::fail_writes_after.
  void fail_writes_after(int64_t bytes) { file_->fail_writes_after(bytes); }

 private:
  enum class SlotState : int8_t { kResident, kReading, kWriting, kParked, kEmpty };
  struct Slot {
    at::Tensor tensor;
    int64_t offset = 0;
    int64_t bytes = 0;
    SlotState state = SlotState::kResident;
    int64_t ticket = 0;
    bool in_file = false;  // the file holds the value the memory holds (or held)
    std::string what;
  };

  Slot& slot_at(int64_t slot);
  // Releases the memory of slots whose writes are done; with `all`, waits for every write.
  void reap(bool all);
  // Waits for the slot's transfer in flight and settles its state.
  void finish(Slot& slot);
  void grow(Slot& slot);
  void release(Slot& slot);

  std::string path_;
  int64_t threads_;
  int64_t chunk_bytes_;
  int64_t max_writing_bytes_;
  c10::intrusive_ptr<SwapFile> file_;
  std::vector<Slot> slots_;
  int64_t planned_bytes_ = 0;
  std::deque<int64_t> writing_;  // slots whose writes are in flight, oldest first
  int64_t writing_bytes_ = 0;
  int64_t resident_bytes_ = 0;
  int64_t peak_resident_bytes_ = 0;
  std::function<void(const std::string&)> on_failure_;
  std::unordered_map<size_t, std::vector<at::DataPtr>> free_blocks_;  // by size
  int64_t cached_bytes_ = 0;
  int64_t max_cached_bytes_ = 8 << 20;
};

} // namespace zero_ext
