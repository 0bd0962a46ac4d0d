#include "stall_post.h"

#include <sstream>

namespace zero_ext {

std::string format_stall_post(int slot, int64_t seq, const int64_t* issued, const std::string& what) {
  std::ostringstream out;
  out << slot << ' ' << seq;
  for (int g = 0; g < kGroupSlots; ++g) out << ' ' << issued[g];
  out << '|' << what;
  return out.str();
}

StallPost parse_stall_post(const std::string& text) {
  StallPost post;
  const auto bar = text.find('|');
  if (text.empty() || bar == std::string::npos) {
    return post;
  }
  std::istringstream in(text.substr(0, bar));
  in >> post.slot >> post.seq;
  for (auto& n : post.issued) in >> n;
  post.present = static_cast<bool>(in);
  post.what = text.substr(bar + 1);
  return post;
}

const char* slot_name(int slot) {
  static const char* const kNames[] = {"gradient reductions", "parameter gathers", "across replicas",
                                       "parameter regathers within a subgroup", "expert gathers and reductions",
                                       "headers of gradient reductions", "headers of parameter gathers",
                                       "headers across replicas", "headers of parameter regathers",
                                       "headers of expert collectives"};
  return slot >= 0 && slot < kGroupSlots ? kNames[slot] : "?";
}

std::string format_raised_post(const RaisedPost& post) {
  std::ostringstream out;
  for (auto n : post.submitted) out << n << ' ';
  for (auto n : post.issued) out << n << ' ';
  out << (post.settled ? 1 : 0) << '|' << post.where;
  return out.str();
}

RaisedPost parse_raised_post(const std::string& text) {
  RaisedPost post;
  const auto bar = text.find('|');
  if (text.empty() || bar == std::string::npos) {
    return post;
  }
  std::istringstream in(text.substr(0, bar));
  for (auto& n : post.submitted) in >> n;
  for (auto& n : post.issued) in >> n;
  int settled = 0;
  in >> settled;
  post.settled = settled != 0;
  post.present = static_cast<bool>(in);
  post.where = text.substr(bar + 1);
  return post;
}

} // namespace zero_ext
