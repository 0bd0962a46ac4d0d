#pragma once
// SwapFile: one rank's offload file for offload_*="nvme": byte regions at
// fixed offsets, written and read asynchronously by a small pool of I/O
// threads, so a step can read the next bucket's state while it computes on
// this one.
//
// [Note: offload files]
// - Space is reserved when the file is made (posix_fallocate): a disk too
//   small is an error at wrap() naming the file and the bytes, not a write
//   that fails mid-step. Where the file system cannot reserve (no
//   fallocate), the file is sized sparse and a full disk surfaces at the
//   wait on the write that hit it, naming the file, the region and errno.
// - The file is unlinked as soon as it is open: it lives while the process
//   holds it and is gone when the process ends, however it ends (exit, an
//   exception, SIGTERM from torchrun, SIGKILL). Nothing is left under
//   offload_path, and nothing can delete it under a running training.
// - O_DIRECT where the file system takes it (the page cache would otherwise
//   keep what was offloaded in host memory: the memory offload saves would
//   come back as cache). O_DIRECT needs 4 KiB-aligned offsets, lengths and
//   buffers: regions start at multiples of kAlign, and each I/O thread moves
//   data through one aligned buffer of its own (chunk_bytes), so the memory
//   the engine holds is threads x chunk_bytes whatever the model. Without
//   O_DIRECT (tmpfs, some network file systems) the threads read and write
//   the tensors' memory directly.
// - A request is split into chunks spread over the threads (the queue depth
//   an NVMe drive needs). The I/O threads never touch a tensor object, only
//   its memory: the caller keeps the tensor alive until wait() returns
//   ([Note: tensors a backend thread lets go of] in process_groups.py).

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <torch/custom_class.h>

namespace zero_ext {

class SwapFile : public torch::CustomClassHolder {
 public:
  static constexpr int64_t kAlign = 4096;

  // Creates `path` (which must not exist), reserves `bytes` (rounded up to
  // kAlign) and unlinks it. `threads` I/O threads, each moving at most
  // `chunk_bytes` (a multiple of kAlign) per system call.
  SwapFile(std::string path, int64_t bytes, int64_t threads, int64_t chunk_bytes);
  ~SwapFile() override;

  // Asynchronous: a ticket to wait on. `offset` a multiple of kAlign;
  // `tensor` contiguous CPU memory that stays alive (and, for a write,
  // unchanged) until wait(ticket) returns.
  int64_t write(int64_t offset, const at::Tensor& tensor);
  int64_t read(int64_t offset, const at::Tensor& tensor);
  // Blocks until every chunk of the ticket is done; raises the first
  // failure, naming the file, the region and the system's error.
  void wait(int64_t ticket);
  // Whether every ticket issued so far is done (failed ones included).
  bool idle();
  // Whether the ticket's chunks are all done (wait() then returns at once
  // and reports a failure). Never blocks.
  bool done(int64_t ticket);
  // Test-only (zero_ext/tools/faults.py): writes past `bytes` more bytes
  // fail with ENOSPC, as on a disk that fills up mid-training.
  void fail_writes_after(int64_t bytes);

  const std::string& path() const { return path_; }
  int64_t bytes() const { return bytes_; }
  bool direct() const { return direct_; }
  // Bytes written and read so far (for benchmarks and tests).
  int64_t bytes_written();
  int64_t bytes_read();

 private:
  struct Chunk {
    int64_t ticket;
    bool write;
    int64_t offset;   // in the file
    char* memory;     // the tensor's bytes for this chunk
    int64_t length;   // bytes of the tensor in this chunk
  };
  struct Ticket {
    int64_t pending = 0;
    std::string error;  // the first failure, if any
  };

  int64_t submit(bool write, int64_t offset, const at::Tensor& tensor);
  void run(int index);
  // One chunk: the system calls, through the thread's aligned buffer under
  // O_DIRECT. Returns "" or what failed.
  std::string transfer(const Chunk& chunk, char* aligned);

  std::string path_;
  int64_t bytes_ = 0;
  int64_t chunk_bytes_ = 0;
  int fd_ = -1;
  bool direct_ = false;

  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable chunk_done_;
  std::deque<Chunk> queue_;
  std::map<int64_t, Ticket> tickets_;
  int64_t next_ticket_ = 1;
  int64_t written_ = 0;
  int64_t read_ = 0;
  int64_t write_budget_ = -1;  // fail_writes_after: bytes still writable (-1: no limit)
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

} // namespace zero_ext
