#include "abandoned_collectives.h"

#include <algorithm>
#include <mutex>

namespace zero_ext {

namespace {

struct Kept {
  std::mutex mutex;
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
};

// Allocated once and never destroyed: a static's destructor would free the
// groups at exit, which is what they are kept from ([Note: abandoned collectives]).
Kept& kept() {
  static Kept* registry = new Kept();
  return *registry;
}

} // namespace

void keep_until_exit(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                     const std::vector<c10::intrusive_ptr<c10d::Work>>& pending) {
  std::vector<c10::intrusive_ptr<c10d::Work>> running;
  for (const auto& work : pending) {
    if (work && !work->isCompleted()) running.push_back(work);
  }
  if (!group || running.empty()) {
    return;  // nothing in flight: the group's destructor has nothing to wait for
  }
  Kept& registry = kept();
  std::lock_guard<std::mutex> lock(registry.mutex);
  if (std::find(registry.groups.begin(), registry.groups.end(), group) == registry.groups.end()) {
    registry.groups.push_back(group);
  }
  for (const auto& work : running) {
    if (std::find(registry.works.begin(), registry.works.end(), work) == registry.works.end()) {
      registry.works.push_back(work);
    }
  }
}

} // namespace zero_ext
