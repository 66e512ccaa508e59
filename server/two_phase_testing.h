// What the tests of two-phase steps over raw PushPull streams share: a
// two-worker shard served in-process, the requests of a step's two phases,
// the shard's counters and weights, a refusal that must change nothing, and
// the mean and sum of squares computed as the protocol specifies them
// (DESIGN.md, "The step's second phase"). Test-only.
#ifndef SHARDPS_SERVER_TWO_PHASE_TESTING_H_
#define SHARDPS_SERVER_TWO_PHASE_TESTING_H_

#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "server/service_testing.h"
#include "server/shard_server.h"
#include "server/store_testing.h"
#include "shardps/v1/parameter_server.grpc.pb.h"

namespace shardps::server {

// Ten floats per chunk (40-byte chunks): the sum of squares' eight lanes
// and a tail.
constexpr int64_t kChunkElements = 10;

// `chunks` chunks of one tensor "w", all 1.0, SGD with lr 1 (the new
// weights are 1 - the gradient used, exactly).
inline v1::DeclareRequest SgdModel(uint32_t chunks) {
  return SgdDeclaration(kChunkElements * chunks, 4 * kChunkElements, 1, 0);
}

// As SgdModel, with Adam at lr 0.01 (two optimizer slots).
inline v1::DeclareRequest AdamModel(uint32_t chunks) {
  v1::DeclareRequest d = SgdModel(chunks);
  d.mutable_optimizer()->set_kind(v1::OptimizerSpec::KIND_ADAM);
  d.mutable_optimizer()->set_learning_rate(0.01f);
  return d;
}

// Rank `rank`'s gradient of a chunk at `step`: values that floats round,
// different for every rank, chunk and step.
inline std::vector<float> GradientOf(uint32_t rank, uint32_t chunk,
                                     int64_t step) {
  std::vector<float> g(kChunkElements);
  for (int64_t j = 0; j < kChunkElements; ++j) {
    g[j] = 0.1f * static_cast<float>(j + 1) * (rank == 0 ? 1.3f : -0.7f) +
           0.01f * static_cast<float>(step + 3 * chunk);
  }
  return g;
}

// The two ranks' mean as the shard takes it ((g0 + g1) * 0.5f in float),
// then times `inv_loss_scale` (skipped when 1, as the shard does).
inline std::vector<float> MeanOf(const std::vector<float>& g0,
                                 const std::vector<float>& g1,
                                 float inv_loss_scale = 1) {
  std::vector<float> m(g0.size());
  for (size_t j = 0; j < m.size(); ++j) {
    m[j] = (g0[j] + g1[j]) * 0.5f;
    if (inv_loss_scale != 1) m[j] *= inv_loss_scale;
  }
  return m;
}

// The sum of the squares of `mean` in double as DESIGN.md specifies it:
// eight running sums by element index mod 8, added in order.
inline double SumOfSquares(const std::vector<float>& mean) {
  double lanes[8] = {};
  for (size_t j = 0; j < mean.size(); ++j) {
    lanes[j % 8] += static_cast<double>(mean[j]) * mean[j];
  }
  double total = 0;
  for (double lane : lanes) total += lane;
  return total;
}

inline std::vector<float> Values(const std::string& bytes) {
  std::vector<float> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), v.size() * 4);
  return v;
}

// A gradient push of `rank` for `chunk` at `step`: a two-phase one, with
// `loss_scale` when set.
inline v1::PushPullRequest Push(uint32_t rank, int64_t step, uint32_t chunk,
                                const std::vector<float>& gradient,
                                std::optional<float> loss_scale = {}) {
  v1::PushPullRequest r;
  r.set_rank(rank);
  r.set_step(step);
  r.set_chunk_id(chunk);
  r.set_encoding(v1::ENCODING_FP32);
  r.set_second_phase(true);
  if (loss_scale.has_value()) r.set_loss_scale(*loss_scale);
  r.set_payload(Bytes(gradient));
  return r;
}

// The same push as a one-phase step's.
inline v1::PushPullRequest OnePhase(uint32_t rank, int64_t step, uint32_t chunk,
                                    const std::vector<float>& gradient) {
  v1::PushPullRequest r = Push(rank, step, chunk, gradient);
  r.set_second_phase(false);
  return r;
}

// `rank`'s decision for `chunk`'s sealed `step`, as a worker sends it.
inline v1::PushPullRequest Decision(uint32_t rank, int64_t step, uint32_t chunk,
                                    float clip_coefficient, bool skip = false) {
  v1::PushPullRequest r;
  r.set_rank(rank);
  r.set_step(step);
  r.set_chunk_id(chunk);
  r.mutable_decision()->set_clip_coefficient(clip_coefficient);
  r.mutable_decision()->set_skip(skip);
  return r;
}

inline v1::StepDecision Decided(float clip_coefficient, bool skip = false) {
  v1::StepDecision d;
  d.set_clip_coefficient(clip_coefficient);
  d.set_skip(skip);
  return d;
}

// One PushPull stream, kept open across requests (30 s deadline); a
// worker's stream that a test can also cut.
class PushStream {
 public:
  explicit PushStream(v1::ParameterServer::Stub* stub) {
    ctx_.set_deadline(std::chrono::system_clock::now() +
                      std::chrono::seconds(30));
    stream_ = stub->PushPull(&ctx_);
  }
  ~PushStream() {
    if (!finished_) Cancel();
  }
  bool Write(const v1::PushPullRequest& r) { return stream_->Write(r); }
  // The next reply; false once the stream has ended.
  bool Read(v1::PushPullResponse* r) { return stream_->Read(r); }
  // Half-closes, drops any replies left and returns the stream's status.
  grpc::Status Finish() {
    stream_->WritesDone();
    return Drain();
  }
  // The worker dies: the call is cancelled under the shard's feet.
  grpc::Status Cancel() {
    ctx_.TryCancel();
    return Drain();
  }

 private:
  grpc::Status Drain() {
    v1::PushPullResponse ignored;
    while (stream_->Read(&ignored)) {
    }
    finished_ = true;
    return stream_->Finish();
  }

  grpc::ClientContext ctx_;
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::PushPullRequest, v1::PushPullResponse>>
      stream_;
  bool finished_ = false;
};

// A shard of two workers (ranks 0 and 1), served and declared in-process.
class TwoPhaseShard {
 public:
  // Call with ASSERT_NO_FATAL_FAILURE.
  void Start(const v1::DeclareRequest& declare, ShardServerOptions o = {}) {
    o.store.num_workers = 2;
    ASSERT_NO_FATAL_FAILURE(shard_.Serve(std::move(o), declare));
    num_chunks_ = shard_.declared().chunk_ids_size();
  }
  v1::ParameterServer::Stub* stub() const { return shard_.stub(); }

  v1::GetStatusResponse Status() const {
    grpc::ClientContext ctx;
    v1::GetStatusResponse s;
    const grpc::Status got =
        stub()->GetStatus(&ctx, v1::GetStatusRequest(), &s);
    EXPECT_TRUE(got.ok()) << got.error_message();
    return s;
  }
  // The weights of `chunk`, pulled.
  std::vector<float> Weights(uint32_t chunk) const {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(30));
    v1::PullRequest req;
    req.add_chunk_ids(chunk);
    auto reader = stub()->Pull(&ctx, req);
    v1::PushPullResponse r;
    std::vector<float> w;
    while (reader->Read(&r)) w = Values(r.payload());
    const grpc::Status s = reader->Finish();
    EXPECT_TRUE(s.ok()) << s.error_message();
    return w;
  }
  std::vector<std::vector<float>> AllWeights() const {
    std::vector<std::vector<float>> w;
    for (uint32_t c = 0; c < num_chunks_; ++c) w.push_back(Weights(c));
    return w;
  }
  // One request on a stream of its own: its reply, or how it was refused.
  grpc::Status Once(const v1::PushPullRequest& req,
                    v1::PushPullResponse* resp) const {
    return PushPullOnce(stub(), req, resp);
  }
  // Waits (up to 30 s) until the shard has taken `n` pushes in all: a push
  // written on a stream that gets no reply yet is in the step then.
  void AwaitPushes(uint64_t n) const {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (Status().pushes_total() < n && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(Status().pushes_total(), n);
  }
  // `req` is refused with `code` and a message containing `part`, and
  // changes nothing but rejected_total (one more): no push or update
  // counted, versions and every chunk's weights as they were.
  void ExpectRefused(const v1::PushPullRequest& req, grpc::StatusCode code,
                     const std::string& part) const {
    const v1::GetStatusResponse before = Status();
    const std::vector<std::vector<float>> weights = AllWeights();
    v1::PushPullResponse resp;
    const grpc::Status s = Once(req, &resp);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr(part));
    const v1::GetStatusResponse after = Status();
    EXPECT_EQ(after.pushes_total(), before.pushes_total());
    EXPECT_EQ(after.updates_total(), before.updates_total());
    EXPECT_EQ(after.rejected_total(), before.rejected_total() + 1);
    EXPECT_EQ(after.min_version(), before.min_version());
    EXPECT_EQ(after.max_version(), before.max_version());
    EXPECT_EQ(AllWeights(), weights);
  }
  // Rank 0 pushes `push0` and rank 1 `push1`, each on a stream of its own;
  // their replies (the sums of squares of a two-phase step). Call with
  // ASSERT_NO_FATAL_FAILURE.
  void PushBoth(const v1::PushPullRequest& push0,
                const v1::PushPullRequest& push1, v1::PushPullResponse* reply0,
                v1::PushPullResponse* reply1) const {
    PushStream rank0(stub()), rank1(stub());
    ASSERT_TRUE(rank0.Write(push0));
    ASSERT_TRUE(rank1.Write(push1));
    ASSERT_TRUE(rank0.Read(reply0));
    ASSERT_TRUE(rank1.Read(reply1));
    EXPECT_TRUE(rank0.Finish().ok());
    EXPECT_TRUE(rank1.Finish().ok());
  }
  // A whole two-phase step of `chunk`: rank r pushes gradient gr (with
  // `loss_scale` when set), then rank 0 sends `decision`; the weights after
  // it. Call with ASSERT_NO_FATAL_FAILURE.
  void Step(int64_t step, uint32_t chunk, const std::vector<float>& g0,
            const std::vector<float>& g1, std::optional<float> loss_scale,
            const v1::StepDecision& decision,
            std::vector<float>* weights) const {
    v1::PushPullResponse r0, r1;
    ASSERT_NO_FATAL_FAILURE(PushBoth(Push(0, step, chunk, g0, loss_scale),
                                     Push(1, step, chunk, g1, loss_scale), &r0,
                                     &r1));
    ASSERT_TRUE(r0.has_sum_of_squares());
    v1::PushPullResponse decided;
    const grpc::Status s = Once(
        Decision(0, step, chunk, decision.clip_coefficient(), decision.skip()),
        &decided);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(decided.version(), step + 1);
    *weights = Values(decided.payload());
  }

  // Starts with one chunk over the inline update limit (256 KiB), so that
  // its update runs on the pool (a decision then finds the one before it
  // most likely pending), and seals its step 0 with a push of each rank,
  // g_r[j] = scale_r * (j % mod_r), returned in *g0 and *g1.
  void StartSealedBig(float scale0, int mod0, float scale1, int mod1,
                      std::vector<float>* g0, std::vector<float>* g1) {
    constexpr int64_t kBig = 96 << 10;
    ASSERT_NO_FATAL_FAILURE(
        Start(SgdDeclaration(kBig, 4 * kBig, /*num_shards=*/1, 0)));
    g0->resize(kBig);
    g1->resize(kBig);
    for (int64_t j = 0; j < kBig; ++j) {
      (*g0)[j] = scale0 * static_cast<float>(j % mod0);
      (*g1)[j] = scale1 * static_cast<float>(j % mod1);
    }
    v1::PushPullResponse r0, r1;
    ASSERT_NO_FATAL_FAILURE(
        PushBoth(Push(0, 0, 0, *g0), Push(1, 0, 0, *g1), &r0, &r1));
  }

 private:
  ServedShard shard_;
  uint32_t num_chunks_ = 0;
};

}  // namespace shardps::server

#endif  // SHARDPS_SERVER_TWO_PHASE_TESTING_H_
