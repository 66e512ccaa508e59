#include "tests/bench/aggregate_bench.h"

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/encoding.h"
#include "common/status.h"
#include "common/transport.h"
#include "server/optimizer.h"
#include "server/parameter_store.h"

namespace shardps::bench {
namespace {

template <typename Fn>
absl::Duration BestOf(int n, Fn fn) {
  absl::Duration best = absl::InfiniteDuration();
  for (int i = 0; i < n; ++i) {
    const absl::Time start = absl::Now();
    fn();
    best = std::min(best, absl::Now() - start);
  }
  return best;
}

// The baseline: one read of g, one read and one write of w per element.
__attribute__((noinline)) void AddInPlace(float* __restrict w,
                                          const float* __restrict g,
                                          int64_t n) {
  for (int64_t i = 0; i < n; ++i) w[i] += g[i];
}

// Counts the replies of a step's pushes.
class CountingSink : public server::ReplySink {
 public:
  void Deliver(server::ChunkReply) override {
    absl::MutexLock lock(&mu_);
    ++replies_;
  }
  void Fail(const absl::Status&) override {
    absl::MutexLock lock(&mu_);
    ++replies_;
    failed_ = true;
  }
  // Waits for `n` replies in all; false when one was a failure.
  bool Await(int64_t n) {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](CountingSink* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
          return s->replies_ >= s->wanted_;
        },
        this));
    return !failed_;
  }
  void Expect(int64_t n) {
    absl::MutexLock lock(&mu_);
    wanted_ = n;
  }

 private:
  absl::Mutex mu_;
  int64_t replies_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t wanted_ ABSL_GUARDED_BY(mu_) = 0;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
};

// The sync shard's whole path without the network: every rank pushes every
// 4 MiB chunk, chunk by chunk (decoded, checked and added to the
// rank-ordered sum; with `reverse` the ranks come last first, so all but
// rank 0 are kept until it arrives), and the updates run (one update
// thread). The best time of a step.
absl::StatusOr<absl::Duration> StoreSteps(const AggregateOptions& o,
                                          const v1::OptimizerSpec& spec,
                                          uint32_t workers, bool reverse,
                                          const std::vector<float>& grad) {
  server::StoreOptions so;
  so.num_workers = workers;
  so.update_threads = 1;
  server::ParameterStore store(so);
  v1::DeclareRequest d;
  v1::TensorSpec* t = d.mutable_layout()->add_tensors();
  t->set_name("w");
  t->add_shape(o.bytes / 4);
  t->mutable_init()->set_kind(v1::InitSpec::KIND_CONSTANT);
  t->mutable_init()->set_value(0.5f);
  d.mutable_layout()->set_chunk_bytes(4 << 20);
  *d.mutable_optimizer() = spec;
  d.set_num_shards(1);
  SHARDPS_RETURN_IF_ERROR(store.Declare(d).status());
  const int64_t chunk_elements = (4 << 20) / 4;
  const int64_t chunks = (o.bytes / 4 + chunk_elements - 1) / chunk_elements;
  auto sink = std::make_shared<CountingSink>();
  int64_t step = 0, expected = 0;
  absl::Status status;
  const absl::Duration best = BestOf(o.repeats, [&] {
    expected += chunks * workers;
    sink->Expect(expected);
    // Chunk by chunk, as the streams' flow control paces a real shard.
    for (int64_t c = 0; c < chunks && status.ok(); ++c) {
      for (uint32_t i = 0; i < workers && status.ok(); ++i) {
        const uint32_t rank = reverse ? workers - 1 - i : i;
        const int64_t begin = c * chunk_elements;
        const int64_t len = std::min(chunk_elements, o.bytes / 4 - begin);
        StringByteSource payload(absl::string_view(
            reinterpret_cast<const char*>(&grad[begin]), len * 4));
        server::PushArgs args;
        args.rank = rank;
        args.step = step;
        args.chunk_id = static_cast<uint32_t>(c);
        args.payload = &payload;
        status = store.Push(args, sink);
      }
    }
    if (status.ok() && !sink->Await(expected)) {
      status = absl::InternalError("a push failed");
    }
    ++step;
  });
  SHARDPS_RETURN_IF_ERROR(status);
  return best;
}

}  // namespace

absl::Status RunAggregateBench(const AggregateOptions& o) {
  ConfigureProcessMemory();  // the server's allocator settings
  const int64_t n = o.bytes / 4;
  std::vector<float> w(n, 0.5f);
  std::vector<std::vector<float>> grads(4, std::vector<float>(n, 1e-3f));
  std::vector<std::vector<float>> slots(2, std::vector<float>(n, 0.0f));
  const absl::Duration base =
      BestOf(o.repeats, [&] { AddInPlace(w.data(), grads[0].data(), n); });
  const double base_gbs = o.bytes / 1e9 / absl::ToDoubleSeconds(base);
  absl::PrintF(
      "aggregate: %.0f MiB per contribution, one thread, best of %d\n"
      "baseline w += g: %.2f GB/s of gradient (%.1f ms)\n",
      o.bytes / 1048576.0, o.repeats, base_gbs,
      absl::ToDoubleMilliseconds(base));
  struct Config {
    const char* name;
    v1::OptimizerSpec::Kind kind;
    float momentum;
  };
  for (Config c : {Config{"sgd-momentum", v1::OptimizerSpec::KIND_SGD, 0.9f},
                   Config{"adam", v1::OptimizerSpec::KIND_ADAM, 0.0f}}) {
    v1::OptimizerSpec spec;
    spec.set_kind(c.kind);
    spec.set_learning_rate(1e-3f);
    spec.set_momentum(c.momentum);
    SHARDPS_ASSIGN_OR_RETURN(std::unique_ptr<server::Optimizer> opt,
                             server::Optimizer::Create(spec));
    std::vector<float*> slot_ptrs;
    for (int s = 0; s < opt->num_slots(); ++s)
      slot_ptrs.push_back(slots[s].data());
    for (int contributions : {2, 4}) {
      std::vector<const float*> g;
      for (int r = 0; r < contributions; ++r) g.push_back(grads[r].data());
      int64_t update = 0;
      const absl::Duration d = BestOf(
          o.repeats, [&] { opt->Apply(update++, g, w.data(), slot_ptrs, n); });
      const double gbs =
          contributions * o.bytes / 1e9 / absl::ToDoubleSeconds(d);
      absl::PrintF(
          "%-13s %d contributions: %6.2f GB/s of gradient (%.1f ms)  ratio = "
          "%.2f of w += g\n",
          c.name, contributions, gbs, absl::ToDoubleMilliseconds(d),
          gbs / base_gbs);
    }
    for (uint32_t workers : {2u, 4u, 8u}) {
      for (bool reverse : {false, true}) {
        SHARDPS_ASSIGN_OR_RETURN(
            absl::Duration d, StoreSteps(o, spec, workers, reverse, grads[0]));
        const double gbs = workers * o.bytes / 1e9 / absl::ToDoubleSeconds(d);
        absl::PrintF(
            "%-13s shard, %d pushes each in %s rank order: %6.2f GB/s of "
            "gradient (%.1f ms)  ratio = %.2f of w += g\n",
            c.name, workers, reverse ? "reverse" : "", gbs,
            absl::ToDoubleMilliseconds(d), gbs / base_gbs);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace shardps::bench
