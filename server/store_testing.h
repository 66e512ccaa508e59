// What the ParameterStore's tests share: a ReplySink that keeps every reply
// and failure (Wait(n) blocks up to 30 s until `n` replies have arrived), a
// fixture with a one-tensor SGD model, and a whole sync step of seeded
// gradients. Test-only.
#ifndef SHARDPS_SERVER_STORE_TESTING_H_
#define SHARDPS_SERVER_STORE_TESTING_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/encoding.h"
#include "gtest/gtest.h"
#include "server/parameter_store.h"

namespace shardps::server {

class CollectingSink : public ReplySink {
 public:
  void Deliver(ChunkReply reply) override {
    absl::MutexLock lock(&mu_);
    replies_.push_back(std::move(reply));
  }
  void Fail(const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    failures_.push_back(status);
  }
  // The replies so far, once there are `n` of them or 30 s passed.
  std::vector<ChunkReply> Wait(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return replies_.size() >= n;
    };
    mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(30));
    return replies_;
  }
  size_t count() {
    absl::MutexLock lock(&mu_);
    return replies_.size();
  }
  std::vector<absl::Status> failures() {
    absl::MutexLock lock(&mu_);
    return failures_;
  }

 private:
  absl::Mutex mu_;
  std::vector<ChunkReply> replies_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> failures_ ABSL_GUARDED_BY(mu_);
};

inline std::vector<float> Floats(const WeightsBuffer& weights) {
  return weights == nullptr ? std::vector<float>() : *weights;
}

inline std::string Bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

// Pushes step `step` of ranks [0, workers) to chunks [first, last) of four
// floats each, rank after rank, and waits for every reply. Element j of chunk
// c from rank r is 0.01 * (j + chunk_stride * c + r + step).
inline void PushSyncStep(ParameterStore* store, int64_t step, uint32_t workers,
                         uint32_t first, uint32_t last, uint32_t chunk_stride) {
  auto sink = std::make_shared<CollectingSink>();
  for (uint32_t rank = 0; rank < workers; ++rank) {
    for (uint32_t chunk = first; chunk < last; ++chunk) {
      std::vector<float> g(4);
      for (size_t i = 0; i < g.size(); ++i) {
        g[i] =
            0.01f * static_cast<float>(i + chunk_stride * chunk + rank + step);
      }
      const std::string bytes = Bytes(g);
      StringByteSource payload(bytes);
      PushArgs args;
      args.rank = rank;
      args.step = step;
      args.chunk_id = chunk;
      args.payload = &payload;
      ASSERT_TRUE(store->Push(args, sink).ok());
    }
  }
  const size_t replies = size_t{workers} * (last - first);
  ASSERT_EQ(sink->Wait(replies).size(), replies);
}

// What a test push sets besides its rank, step and chunk (PushArgs).
struct PushFlags {
  StepHyperparameters hyperparameters;
  bool no_gradient = false;
  bool initial_values = false;
  bool push_only = false;
};

// Pushes the fp32 `payload` to `chunk` of `store`.
inline absl::Status PushTo(ParameterStore* store, uint32_t rank, int64_t step,
                           uint32_t chunk, const std::vector<float>& payload,
                           const std::shared_ptr<CollectingSink>& sink,
                           const PushFlags& flags = {}) {
  const std::string bytes = Bytes(payload);
  StringByteSource source(bytes);
  PushArgs args;
  args.rank = rank;
  args.step = step;
  args.chunk_id = chunk;
  args.hyperparameters = flags.hyperparameters;
  args.no_gradient = flags.no_gradient;
  args.initial_values = flags.initial_values;
  args.push_only = flags.push_only;
  args.payload = &source;
  return store->Push(args, sink);
}
inline absl::Status PushTo(ParameterStore* store, uint32_t rank, int64_t step,
                           uint32_t chunk, const std::vector<float>& payload,
                           const std::shared_ptr<CollectingSink>& sink,
                           const StepHyperparameters& hyperparameters) {
  PushFlags flags;
  flags.hyperparameters = hyperparameters;
  return PushTo(store, rank, step, chunk, payload, sink, flags);
}

// The weights of `chunk` (empty, failing the test, when it cannot be read).
inline std::vector<float> WeightsOf(const ParameterStore& store,
                                    uint32_t chunk) {
  absl::StatusOr<ChunkReply> r = store.Read(chunk);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? Floats(r->weights) : std::vector<float>();
}

// A store of `workers` workers, nothing declared yet.
inline std::unique_ptr<ParameterStore> MakeStore(
    uint32_t workers, v1::Consistency mode = v1::CONSISTENCY_SYNC) {
  StoreOptions o;
  o.num_workers = workers;
  o.mode = mode;
  return std::make_unique<ParameterStore>(o);
}

// One tensor "w" of `n` elements initialised to 1.0, SGD with lr = 1 so the
// new weights are 1 - mean(gradients).
inline v1::DeclareRequest SgdDeclaration(int64_t n, uint64_t chunk_bytes,
                                         uint32_t num_shards, uint32_t shard) {
  v1::DeclareRequest req;
  v1::TensorSpec* t = req.mutable_layout()->add_tensors();
  t->set_name("w");
  t->add_shape(n);
  t->mutable_init()->set_kind(v1::InitSpec::KIND_CONSTANT);
  t->mutable_init()->set_value(1.0f);
  req.mutable_layout()->set_chunk_bytes(chunk_bytes);
  req.mutable_optimizer()->set_kind(v1::OptimizerSpec::KIND_SGD);
  req.mutable_optimizer()->set_learning_rate(1.0f);
  req.set_num_shards(num_shards);
  req.set_shard_index(shard);
  return req;
}

class StoreFixture : public ::testing::Test {
 protected:
  void Make(uint32_t workers, v1::Consistency mode = v1::CONSISTENCY_SYNC,
            int64_t staleness = 0) {
    StoreOptions o;
    o.num_workers = workers;
    o.mode = mode;
    o.staleness = staleness;
    store_ = std::make_unique<ParameterStore>(o);
    ASSERT_TRUE(store_->Declare(SgdDeclaration(4, 0, 1, 0)).ok());
  }
  absl::Status Push(uint32_t rank, int64_t step, std::vector<float> grad,
                    std::shared_ptr<CollectingSink> sink, uint32_t chunk = 0,
                    uint64_t incarnation = 0, uint64_t rollback_id = 0) {
    std::string bytes = Bytes(grad);
    StringByteSource payload(bytes);
    PushArgs args;
    args.rank = rank;
    args.step = step;
    args.chunk_id = chunk;
    args.incarnation = incarnation;
    args.rollback_id = rollback_id;
    args.payload = &payload;
    return store_->Push(args, sink);
  }
  std::vector<float> Weights() {
    absl::StatusOr<ChunkReply> r = store_->Read(0);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? Floats(r->weights) : std::vector<float>();
  }

  std::unique_ptr<ParameterStore> store_;
};

// A view of one worker per entry of `incarnations` from coordinator
// incarnation `coordinator`.
inline v1::ClusterView WorkersView(uint64_t generation,
                                   std::vector<uint64_t> incarnations,
                                   std::vector<bool> alive,
                                   uint64_t coordinator = 9) {
  v1::ClusterView view;
  view.set_generation(generation);
  view.set_coordinator_incarnation(coordinator);
  view.set_num_workers(static_cast<uint32_t>(incarnations.size()));
  for (size_t r = 0; r < incarnations.size(); ++r) {
    v1::WorkerSlot* w = view.add_workers();
    w->set_rank(static_cast<uint32_t>(r));
    w->set_incarnation(incarnations[r]);
    w->set_alive(alive[r]);
  }
  return view;
}

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_STORE_TESTING_H_
