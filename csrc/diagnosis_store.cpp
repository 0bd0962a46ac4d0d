#include "diagnosis_store.h"

#include <mutex>

#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace zero_ext {

namespace {

// c10's log level is one process-wide int; calls from several threads (a
// stalled wait, the whereabouts thread) nest their mutes.
constexpr int kErrorLevel = 2;  // c10::GLOG_ERROR: c10d's warnings (level 1) are not logged
std::mutex mute_mutex;
int mute_depth = 0;
int level_before = 0;

struct WarningsMuted {
  WarningsMuted() {
    std::lock_guard<std::mutex> lock(mute_mutex);
    if (mute_depth++ == 0) {
      level_before = FLAGS_caffe2_log_level;
      if (level_before < kErrorLevel) FLAGS_caffe2_log_level = kErrorLevel;
    }
  }
  ~WarningsMuted() {
    std::lock_guard<std::mutex> lock(mute_mutex);
    // Put back unless the level was changed meanwhile (that change stays).
    if (--mute_depth == 0 && level_before < kErrorLevel && FLAGS_caffe2_log_level == kErrorLevel) {
      FLAGS_caffe2_log_level = level_before;
    }
  }
};

} // namespace

template <typename Call>
auto DiagnosisStore::quietly(Call&& call) -> decltype(call()) {
  if (lost_.load()) {
    throw StoreUnreachable("zero_ext: the store is unreachable (an earlier call failed)");
  }
  WarningsMuted muted;
  try {
    return call();
  } catch (const c10::Error& e) {
    lost_ = true;
    throw StoreUnreachable(std::string("zero_ext: the store is unreachable: ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    lost_ = true;
    throw StoreUnreachable(std::string("zero_ext: the store is unreachable: ") + e.what());
  }
}

bool DiagnosisStore::check(const std::vector<std::string>& keys) {
  return quietly([&] { return store_->check(keys); });
}

std::vector<uint8_t> DiagnosisStore::get(const std::string& key) {
  return quietly([&] { return store_->get(key); });
}

void DiagnosisStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  quietly([&] { store_->set(key, value); });
}

int64_t DiagnosisStore::add(const std::string& key, int64_t value) {
  return quietly([&] { return store_->add(key, value); });
}

std::vector<uint8_t> DiagnosisStore::set_once(const std::string& key, const std::vector<uint8_t>& desired) {
  // c10d's compareSet with an empty expected value sets a key that is absent.
  return quietly([&] { return store_->compareSet(key, std::vector<uint8_t>(), desired); });
}

bool DiagnosisStore::remove(const std::string& key) {
  return quietly([&] { return store_->deleteKey(key); });
}

namespace {

// The group's store as the group sees it, prefixes kept: torchrun's agent
// store outlives a restart, and torch prefixes each attempt's keys, so keys
// an earlier attempt left (a wrap's arrival counts) are not read again.
c10::intrusive_ptr<c10d::Store> store_of(const std::string& group_name) {
  auto group = c10d::resolve_process_group(group_name);
  TORCH_CHECK(group, "zero_ext: process group '", group_name, "' is not registered");
  return group->getStore();
}

// StoreUnreachable as the RuntimeError Python sees, with c10's message form.
template <typename Call>
auto raising(Call&& call) -> decltype(call()) {
  try {
    return call();
  } catch (const StoreUnreachable& e) {
    TORCH_CHECK(false, e.what());
    throw;  // not reached
  }
}

}  // namespace

QuietStore::QuietStore(const std::string& group_name) : store_(store_of(group_name)) {}

void QuietStore::set(const std::string& key, const std::string& value) {
  raising([&] { store_.set(key, std::vector<uint8_t>(value.begin(), value.end())); });
}

std::string QuietStore::get(const std::string& key) {
  return raising([&] {
    const auto bytes = store_.get(key);
    return std::string(bytes.begin(), bytes.end());
  });
}

bool QuietStore::check(const std::vector<std::string>& keys) {
  return raising([&] { return store_.check(keys); });
}

int64_t QuietStore::add(const std::string& key, int64_t value) {
  return raising([&] { return store_.add(key, value); });
}

bool QuietStore::delete_key(const std::string& key) {
  return raising([&] { return store_.remove(key); });
}

} // namespace zero_ext
