#pragma once
// What a rank posts to the model's store when it stops where the others
// can read it: a wait that stalled ([Note: stall diagnosis] in
// communicator.h) or a forward that raised ([Note: a forward that raised]
// in forward_raised_agreement.cpp). Both say how many collectives the rank
// issued on each of the model's groups, so a reader can tell whether the
// ranks stand at the same point of one sequence of collectives.

#include <array>
#include <cstdint>
#include <string>

#include "communicator.h"

namespace zero_ext {

// A stalled rank: the group and position it waits at, how many collectives
// it issued on each of the model's groups, and what it waits in.
struct StallPost {
  bool present = false;
  int slot = -1;
  int64_t seq = -1;
  std::array<int64_t, kGroupSlots> issued{};
  std::string what;
};

std::string format_stall_post(int slot, int64_t seq, const int64_t* issued, const std::string& what);
StallPost parse_stall_post(const std::string& text);
// "gradient reductions", "parameter gathers", ...: a group slot in words.
const char* slot_name(int slot);

// A rank whose forward raised: the collectives it had submitted on each data
// group (what the ranks must agree on), issued on each group (what a stalled
// rank's position compares with), whether every submitted one was issued
// (the issued counts are final), and where and what it raised.
struct RaisedPost {
  bool present = false;
  std::array<int64_t, kDataSlots> submitted{};
  std::array<int64_t, kGroupSlots> issued{};
  bool settled = false;
  std::string where;
};

std::string format_raised_post(const RaisedPost& post);
RaisedPost parse_raised_post(const std::string& text);

} // namespace zero_ext
