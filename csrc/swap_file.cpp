#include "swap_file.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <c10/util/Exception.h>

namespace zero_ext {

namespace {

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

std::string mib(int64_t bytes) {
  char text[32];
  if (bytes < (1 << 20) / 10) {  // "0.0 MiB" would hide a small region's size
    std::snprintf(text, sizeof(text), "%.1f KiB", static_cast<double>(bytes) / (1 << 10));
  } else {
    std::snprintf(text, sizeof(text), "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  }
  return text;
}

// Opens `path` new, O_DIRECT if the file system takes it.
int open_new(const std::string& path, bool* direct) {
  const int flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC;
#ifdef O_DIRECT
  int fd = ::open(path.c_str(), flags | O_DIRECT, 0600);
  if (fd >= 0) {
    *direct = true;
    return fd;
  }
  if (errno != EINVAL) {
    return -1;
  }
#endif
  *direct = false;
  return ::open(path.c_str(), flags, 0600);
}

} // namespace

SwapFile::SwapFile(std::string path, int64_t bytes, int64_t threads, int64_t chunk_bytes)
    : path_(std::move(path)), bytes_(round_up(std::max<int64_t>(bytes, kAlign), kAlign)),
      chunk_bytes_(round_up(std::max<int64_t>(chunk_bytes, kAlign), kAlign)) {
  TORCH_CHECK(threads >= 1, "zero_ext internal: a swap file needs at least one I/O thread");
  fd_ = open_new(path_, &direct_);
  TORCH_CHECK(fd_ >= 0, "zero_ext: cannot create the offload file ", path_, ": ", std::strerror(errno),
              ". Point offload_path at a writable local directory (an NVMe drive's file system for speed).");
  const int reserved = ::posix_fallocate(fd_, 0, bytes_);
  if (reserved != 0) {
    // EOPNOTSUPP / EINVAL: the file system cannot reserve; size it sparse
    // and let a full disk show at the write that hits it.
    const bool cannot_reserve = reserved == EOPNOTSUPP || reserved == EINVAL;
    const bool sized = cannot_reserve && ::ftruncate(fd_, bytes_) == 0;
    if (!sized) {
      const std::string reason = std::strerror(reserved);
      ::close(fd_);
      ::unlink(path_.c_str());
      TORCH_CHECK(false, "zero_ext: cannot reserve ", mib(bytes_), " for the offload file ", path_, ": ", reason,
                  ". Free space on that file system or point offload_path at one with room (this rank needs ",
                  mib(bytes_), ").");
    }
  }
  // [Note: offload files] gone with the process, however it ends.
  ::unlink(path_.c_str());
  for (int64_t i = 0; i < threads; ++i) {
    threads_.emplace_back([this, i] { run(static_cast<int>(i)); });
  }
}

SwapFile::~SwapFile() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (auto& thread : threads_) {
    thread.join();
  }
  if (fd_ >= 0) {
    ::close(fd_);
  }
}

int64_t SwapFile::write(int64_t offset, const at::Tensor& tensor) { return submit(true, offset, tensor); }

int64_t SwapFile::read(int64_t offset, const at::Tensor& tensor) { return submit(false, offset, tensor); }

int64_t SwapFile::submit(bool write, int64_t offset, const at::Tensor& tensor) {
  TORCH_CHECK(tensor.device().is_cpu() && tensor.is_contiguous(),
              "zero_ext internal: the offload file moves contiguous CPU tensors");
  const int64_t length = tensor.nbytes();
  TORCH_CHECK(offset >= 0 && offset % kAlign == 0 && offset + length <= bytes_,
              "zero_ext internal: offload region [", offset, ", ", offset + length, ") is not an aligned region of ",
              path_, " (", bytes_, " bytes)");
  char* memory = static_cast<char*>(tensor.data_ptr());
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t ticket = next_ticket_++;
  Ticket& entry = tickets_[ticket];
  for (int64_t done = 0; done < length; done += chunk_bytes_) {
    queue_.push_back({ticket, write, offset + done, memory + done, std::min(chunk_bytes_, length - done)});
    ++entry.pending;
  }
  work_ready_.notify_all();
  return ticket;
}

void SwapFile::wait(int64_t ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto found = tickets_.find(ticket);
  TORCH_CHECK(found != tickets_.end(), "zero_ext internal: offload ticket ", ticket, " is unknown or waited twice");
  chunk_done_.wait(lock, [&] { return found->second.pending == 0; });
  const std::string error = found->second.error;
  tickets_.erase(found);
  TORCH_CHECK(error.empty(), error);
}

bool SwapFile::done(int64_t ticket) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = tickets_.find(ticket);
  TORCH_CHECK(found != tickets_.end(), "zero_ext internal: offload ticket ", ticket, " is unknown or waited");
  return found->second.pending == 0;
}

void SwapFile::fail_writes_after(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  write_budget_ = bytes;
}

bool SwapFile::idle() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [ticket, entry] : tickets_) {
    if (entry.pending > 0) {
      return false;
    }
  }
  return true;
}

int64_t SwapFile::bytes_written() {
  std::lock_guard<std::mutex> lock(mutex_);
  return written_;
}

int64_t SwapFile::bytes_read() {
  std::lock_guard<std::mutex> lock(mutex_);
  return read_;
}

void SwapFile::run(int /*index*/) {
  void* aligned = nullptr;
  if (direct_ && ::posix_memalign(&aligned, kAlign, chunk_bytes_) != 0) {
    aligned = nullptr;  // every chunk then reports the failure below
  }
  while (true) {
    Chunk chunk;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) {
        break;  // stopping, nothing left
      }
      chunk = queue_.front();
      queue_.pop_front();
    }
    bool over_budget = false;
    if (chunk.write) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (write_budget_ >= 0) {
        over_budget = write_budget_ < chunk.length;
        write_budget_ = over_budget ? 0 : write_budget_ - chunk.length;
      }
    }
    std::string error = over_budget                ? std::strerror(ENOSPC)
                        : direct_ && !aligned      ? "no memory for the aligned I/O buffer"
                                                   : transfer(chunk, static_cast<char*>(aligned));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      Ticket& entry = tickets_[chunk.ticket];
      if (!error.empty() && entry.error.empty()) {
        entry.error = "zero_ext: " + std::string(chunk.write ? "writing " : "reading ") + mib(chunk.length) +
                      " at offset " + std::to_string(chunk.offset) + " of the offload file " + path_ +
                      " failed: " + error +
                      (chunk.write ? ". The disk may be full or failing: free space on offload_path's file system "
                                     "or point offload_path elsewhere; the step that hit it did not complete."
                                   : ".");
      }
      (chunk.write ? written_ : read_) += error.empty() ? chunk.length : 0;
      --entry.pending;
    }
    chunk_done_.notify_all();
  }
  std::free(aligned);
}

std::string SwapFile::transfer(const Chunk& chunk, char* aligned) {
  // Under O_DIRECT the last chunk of a region is padded to kAlign: the
  // padding is written as whatever the buffer holds and never read back
  // into the tensor (regions are kAlign apart, so it is this region's own).
  const int64_t moved = direct_ ? round_up(chunk.length, kAlign) : chunk.length;
  char* buffer = direct_ ? aligned : chunk.memory;
  if (chunk.write && direct_) {
    std::memcpy(buffer, chunk.memory, chunk.length);
  }
  int64_t done = 0;
  while (done < moved) {
    const ssize_t n = chunk.write ? ::pwrite(fd_, buffer + done, moved - done, chunk.offset + done)
                                  : ::pread(fd_, buffer + done, moved - done, chunk.offset + done);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      return std::strerror(errno);
    }
    if (n == 0) {
      return chunk.write ? "no bytes written" : "end of file (a region read before it was written)";
    }
    done += n;
  }
  if (!chunk.write && direct_) {
    std::memcpy(chunk.memory, buffer, chunk.length);
  }
  return "";
}

} // namespace zero_ext
