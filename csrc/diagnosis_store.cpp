#include "diagnosis_store.h"

#include <mutex>

#include <c10/util/Logging.h>

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

} // namespace zero_ext
