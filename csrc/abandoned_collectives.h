#pragma once
// Groups with collectives this rank abandoned, kept until the process exits.
//
// [Note: abandoned collectives]
// A rank that raises zero_ext's error while one of its own collectives is
// still in flight (the stall diagnosis found the others in a collective of
// their own, `if rank == 0: model(x)` followed by dist.barrier(); or a
// header exchange sent ahead that no other rank will pair) leaves a gloo
// worker thread blocked in it until the group's timeout, 30 minutes by
// default. ProcessGroupGloo's destructor joins its worker threads, and
// torch 2.13's gloo has no abort(), so freeing that group (at
// destroy_process_group(), or when the interpreter clears torch's registry
// at exit) waited out the timeout: the rank that raised could not exit,
// and a peer waiting for it in dist.barrier() waited with it, where the
// closed connection of an exited rank would have ended its barrier at once.
// So such a group, with the work it abandoned, is held here by a registry
// that is never destroyed: the group is never freed, its threads end with
// the process, and the abandoned work (its tensors) is never let go of on
// a gloo thread while Python finalizes ([Note: tensors a backend thread
// lets go of] in zero_ext/groups/process_groups.py). Only a failed model's
// groups come here, and the Python pool never hands those to another model.

#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace zero_ext {

// Keeps `group` and those of `pending` (its works) still running until
// exit; nothing if none is.
void keep_until_exit(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                     const std::vector<c10::intrusive_ptr<c10d::Work>>& pending);

} // namespace zero_ext
