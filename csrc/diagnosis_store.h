#pragma once
// DiagnosisStore: the c10d store the stall diagnosis and the sequence checks'
// reports go through ([Note: stall diagnosis] in communicator.h), called so
// that a store that went away ends in zero_ext's own error, quietly.
//
// Under torchrun (env://) the store is a TCPStore served by rank 0's process.
// When rank 0 dies, a TCPStore client's next call logs the socket error
// ("recvValue failed", "sendBytes failed") as a c10d warning carrying the C++
// stack trace of the exception it then throws, before zero_ext can turn that
// exception into its one-line error. So every call here runs with c10d's
// warnings muted for its duration (a store round trip) and throws
// StoreUnreachable on any failure; after one failure the store counts as
// gone and later calls throw at once, never touching it again. The mute is
// the process-wide c10 log level (c10 has no other): raised to ERROR by the
// first call in flight, put back by the last one unless someone changed it
// meanwhile, so warnings other threads log during those microseconds are
// lost, and nothing else.

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/custom_class.h>

namespace zero_ext {

// The store failed (its host, rank 0 under torchrun, may have died).
struct StoreUnreachable : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class DiagnosisStore {
 public:
  explicit DiagnosisStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}

  bool check(const std::vector<std::string>& keys);
  std::vector<uint8_t> get(const std::string& key);
  void set(const std::string& key, const std::vector<uint8_t>& value);
  int64_t add(const std::string& key, int64_t value);
  // Sets `key` to `desired` unless it holds a value already; returns the
  // value it holds after the call (the first caller's, whoever that was).
  std::vector<uint8_t> set_once(const std::string& key, const std::vector<uint8_t>& desired);
  bool remove(const std::string& key);
  // Whether a call failed: the store is not called again.
  bool lost() const { return lost_.load(); }

 private:
  template <typename Call>
  auto quietly(Call&& call) -> decltype(call());

  c10::intrusive_ptr<c10d::Store> store_;
  std::atomic<bool> lost_{false};
};

// torch.classes.zero_ext.QuietStore(group_name): the same quiet calls for
// Python's own exchanges through the job's store (the asynchronous save's
// writer threads, files/asynchronous.py; wrap()'s arrival,
// groups/arrival.py), on the store of a process group resolved by name,
// under that group's prefix (which holds an elastic restart's attempt). Values are str (callers
// encode bytes as text). Every failure raises zero_ext's RuntimeError, once
// quietly; later calls raise at once.
class QuietStore : public torch::CustomClassHolder {
 public:
  explicit QuietStore(const std::string& group_name);
  void set(const std::string& key, const std::string& value);
  std::string get(const std::string& key);
  bool check(const std::vector<std::string>& keys);
  int64_t add(const std::string& key, int64_t value);
  bool delete_key(const std::string& key);
  bool lost() const { return store_.lost(); }

 private:
  DiagnosisStore store_;
};

} // namespace zero_ext
