#include "rank_agreement.h"

#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace zero_ext {

namespace {
// A row: step, synced backwards in the step, deferred ones among them, then
// stage 3's gathers per unit.
constexpr int64_t kUnitColumns = 5;  // step, synced, deferred, trainable count, trainable hash
}  // namespace

RankAgreement::RankAgreement(const Layout& layout, const Mesh& mesh, const StepGate& gate)
    : layout_(layout), mesh_(mesh), gate_(gate) {}

TrainableSignature TrainableSignature::of(const std::vector<at::Tensor>& params) {
  TrainableSignature signature;
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over the flags
  for (const auto& p : params) {
    const bool trainable = p.requires_grad();
    signature.count += trainable ? 1 : 0;
    hash = (hash ^ (trainable ? 1u : 2u)) * 1099511628211ull;
  }
  signature.hash = static_cast<int64_t>(hash & ((uint64_t{1} << 23) - 1));
  return signature;
}

void RankAgreement::start(const GradReducer& reducer, UnitScheduler* units, const at::Tensor& nonfinite,
                          const c10::Device& device, const TrainableSignature& trainable) {
  const int64_t n = layout_.num_params();
  const std::vector<int64_t> gathers = units ? units->take_gather_counts() : std::vector<int64_t>();
  const int64_t width = kUnitColumns + static_cast<int64_t>(gathers.size());
  TORCH_INTERNAL_ASSERT(pending_.empty() || width == width_, "exchange rows changed width");
  width_ = width;
  const int64_t world = mesh_.size();
  // Pinned when it goes to an accelerator: a pageable host-to-device copy
  // waits for the stream, a host sync in the middle of backward.
  const bool to_device = !device.is_cpu();
  at::Tensor mask = at::zeros({n + 2 + world * width}, at::TensorOptions().dtype(at::kFloat).pinned_memory(to_device));
  float* data = mask.data_ptr<float>();
  const auto& local = reducer.local_has_grad();
  for (int64_t i = 0; i < n; ++i) {
    data[i] = static_cast<float>(local[i]);
  }
  data[n] = reducer.late() ? 1.0f : 0.0f;
  data[n + 1] = 0.0f;
  const Progress& progress = gate_.progress();
  float* row = data + n + 2 + mesh_.rank() * width;
  row[0] = static_cast<float>(progress.step_index % (int64_t{1} << 23));  // exact in a float
  row[1] = static_cast<float>(progress.synced_in_step);
  row[2] = static_cast<float>(progress.deferred_in_step);
  row[3] = static_cast<float>(trainable.count);
  row[4] = static_cast<float>(trainable.hash);
  for (size_t u = 0; u < gathers.size(); ++u) {
    row[kUnitColumns + u] = static_cast<float>(gathers[u]);
  }
  // The collective runs on the parameters' device (NCCL cannot reduce CPU
  // tensors); the non-finite flag joins it there.
  Exchange exchange;
  exchange.values = to_device ? mask.to(device, /*non_blocking=*/true) : mask;
  if (nonfinite.defined()) {
    exchange.values.narrow(0, n + 1, 1).copy_(nonfinite.reshape({1}));
  }
  exchange.work = mesh_.shard().all_reduce_sum(exchange.values, Purpose::kAgreement);
  if (mesh_.hybrid()) {
    exchange.replica_pending = true;
    if (!mesh_.shard().waits_on_host(device.type())) {
      issue_across_replicas(exchange);  // NCCL: a stream wait, no host sync
    }
  }
  pending_.push_back(std::move(exchange));
}

std::string RankAgreement::describe() const {
  return "exchange of which parameters got gradients (stage " + std::to_string(layout_.stage()) + ", " +
         gate_.progress().where() + ")";
}

void RankAgreement::issue_across_replicas(Exchange& exchange) {
  mesh_.shard().wait(exchange.work, [&] { return describe(); });
  exchange.work.reset();
  exchange.replica_work = mesh_.replica().all_reduce_sum(exchange.values, Purpose::kAgreement);
  exchange.replica_pending = false;
}

void RankAgreement::wait(Exchange& exchange) {
  if (exchange.waited) {
    return;
  }
  if (exchange.replica_pending) {
    issue_across_replicas(exchange);
  }
  mesh_.shard().wait(exchange.work, [&] { return describe(); });
  mesh_.replica().wait(exchange.replica_work, [&] { return describe() + " across replicas"; });
  exchange.work.reset();
  exchange.replica_work.reset();
  exchange.waited = true;
}

at::Tensor RankAgreement::last_nonfinite_sum() {
  TORCH_INTERNAL_ASSERT(!pending_.empty(), "no exchange was started");
  wait(pending_.back());
  return pending_.back().values.narrow(0, layout_.num_params() + 1, 1);
}

Agreed RankAgreement::settle(GradReducer& reducer) {
  Agreed agreed;
  if (pending_.empty()) {
    return agreed;
  }
  std::vector<at::Tensor> values;
  for (auto& exchange : pending_) {
    wait(exchange);
    values.push_back(exchange.values);
  }
  pending_.clear();
  ++host_reads_;
  // The one host read: every exchange since the last one, in one copy.
  const at::Tensor all = (values.size() == 1 ? values[0] : at::stack(values)).cpu().contiguous();
  const int64_t n = layout_.num_params();
  const int64_t length = values[0].numel();
  auto& global = reducer.global_has_grad();
  for (size_t e = 0; e < values.size(); ++e) {
    const float* data = all.data_ptr<float>() + e * length;
    check_in_step(data + n + 2, width_);
    for (int64_t i = 0; i < n; ++i) {
      global[i] = global[i] || data[i] > 0.0f;
    }
    agreed.late = data[n] > 0.0f;  // the last backward's counts: earlier late ones joined later rounds
    agreed.nonfinite_backwards += data[n + 1] > 0.0f ? 1 : 0;
  }
  return agreed;
}

bool RankAgreement::any_nonfinite(const at::Tensor& nonfinite, const c10::Device& device) {
  at::Tensor flag = nonfinite.reshape({1}).to(device);
  mesh_.all_reduce(flag, /*max=*/false, Purpose::kNonfiniteFlag, {},
                   [] { return std::string("exchange of the non-finite gradient flag"); });
  return flag.item<float>() > 0.0f;
}

void RankAgreement::check_in_step(const float* rows, int64_t width) const {
  const int64_t world = mesh_.size();
  auto ranks_where = [&](int64_t column, float value) {
    std::ostringstream out;
    const char* sep = "";
    for (int64_t r = 0; r < world; ++r) {
      if (rows[r * width + column] == value) {
        out << sep << r;
        sep = ", ";
      }
    }
    return out.str();
  };
  for (int64_t r = 1; r < world; ++r) {
    const float* mine = rows + r * width;
    if (mine[0] != rows[0] || mine[1] != rows[1] || mine[2] != rows[2]) {
      std::ostringstream out;
      for (int64_t q = 0; q < world; ++q) {
        out << (q ? "; " : "") << "rank " << q << " at step " << rows[q * width] << " after "
            << rows[q * width + 1] << " synced backward(s) in the step";
        if (rows[q * width + 2] > 0) {
          out << " (" << rows[q * width + 2] << " without the all-reduce across replicas)";
        }
      }
      TORCH_CHECK(false, "zero_ext: the ranks have diverged (stage ", layout_.stage(), "): ", out.str(),
                  ". Every rank must run the same number of backward passes between optimizer "
                  "steps and the same number of steps (a loop whose length depends on the rank's "
                  "data, or an exception caught on some ranks only, breaks this), with the same "
                  "no_sync() and set_requires_all_reduce() settings; their "
                  "gradient reductions were paired with each other's and are discarded.");
    }
  }
  for (int64_t r = 1; r < world; ++r) {
    const float* mine = rows + r * width;
    if (mine[3] != rows[3] || mine[4] != rows[4]) {
      std::ostringstream out;
      for (int64_t q = 0; q < world; ++q) {
        out << (q ? "; " : "") << "rank " << q << ": " << rows[q * width + 3] << " of "
            << layout_.num_params() << " parameters require grad (flags hash " << rows[q * width + 4] << ")";
      }
      TORCH_CHECK(false, "zero_ext: the ranks' trainable parameters differ in this backward (",
                  gate_.progress().where(), "): ", out.str(), ". requires_grad may change between "
                  "steps, but alike on every rank (the same requires_grad_() calls before the same "
                  "step); the gradients of a parameter frozen on some ranks only would be averaged "
                  "with zeros from them. This step's gradients are discarded.");
    }
  }
  for (int64_t u = 0; u < width - kUnitColumns; ++u) {
    for (int64_t r = 1; r < world; ++r) {
      const float mine = rows[r * width + kUnitColumns + u];
      const float first = rows[kUnitColumns + u];
      if (mine != first) {
        TORCH_CHECK(false, "zero_ext: stage 3 ", layout_.describe_unit(u), " was gathered ", first,
                    " time(s) on rank(s) ", ranks_where(kUnitColumns + u, first), " but ", mine,
                    " time(s) on rank(s) ", ranks_where(kUnitColumns + u, mine), " since the last gradient "
                    "exchange (", gate_.progress().where(), "): the ranks ran different modules, so "
                    "their parameter gathers were paired with each other's. In stage 3 every rank "
                    "must run the same units in each forward and backward: run a module that is "
                    "skipped on some ranks (rank-dependent control flow, an expert no token was "
                    "routed to) on every rank, or leave it out of units= so it stays gathered with "
                    "its parent.");
      }
    }
  }
}

} // namespace zero_ext
