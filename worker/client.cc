#include "worker/client.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/encoding.h"
#include "common/grpc_status.h"
#include "common/partitioner.h"
#include "common/status.h"
#include "common/transport.h"
#include "common/wire.h"
#include "grpcpp/support/sync_stream.h"

namespace shardps {

struct Client::Stream {
  uint32_t shard = 0;
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::ParameterServer::Stub> stub;
  std::vector<uint32_t> chunk_ids;  // the chunks this lane carries
  v1::PushPullResponse response;    // header fields of the last reply
  PayloadView payload;              // payload of the last reply

  // Gradient slices gRPC still references; a step returns only once it is
  // zero, so the caller's gradient buffers may then be reused.
  absl::Mutex mu;
  int64_t slices_in_flight ABSL_GUARDED_BY(mu) = 0;
  absl::Time writes_done;  // when the last attempt finished writing
  static void ReleaseSlice(void* lane) {
    Stream* s = static_cast<Stream*>(lane);
    absl::MutexLock lock(&s->mu);
    --s->slices_in_flight;
  }
  // True once gRPC released every gradient slice (false after `timeout`).
  bool AwaitSlicesReleased(absl::Duration timeout) {
    absl::MutexLock lock(&mu);
    return mu.AwaitWithTimeout(
        absl::Condition(
            +[](int64_t* n) { return *n == 0; }, &slices_in_flight),
        timeout);
  }
};

namespace {

// Raw (byte buffer) forms of the data-path methods; see common/wire.h.
constexpr char kPushPullMethod[] = "/shardps.v1.ParameterServer/PushPull";
constexpr char kPullMethod[] = "/shardps.v1.ParameterServer/Pull";
// Uploads up to this size are written before reading replies, on one thread.
constexpr int64_t kInlineUploadBytes = 1 << 20;

std::chrono::system_clock::time_point Deadline(absl::Duration d) {
  return absl::ToChronoTime(absl::Now() + d);
}

// Runs fn(i) for i in [0, n) on n threads; returns the first error.
absl::Status RunParallel(size_t n,
                         const std::function<absl::Status(size_t)>& fn) {
  std::vector<absl::Status> statuses(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  // The calling thread takes the last item itself.
  for (size_t i = 0; i + 1 < n; ++i) {
    threads.emplace_back([&, i] { statuses[i] = fn(i); });
  }
  if (n > 0) statuses[n - 1] = fn(n - 1);
  for (std::thread& t : threads) t.join();
  for (absl::Status& s : statuses) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

Client::Client(ClientOptions options) : options_(std::move(options)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Create(ClientOptions options) {
  if (options.servers.empty()) {
    return absl::InvalidArgumentError("no parameter servers given");
  }
  if (options.streams_per_shard < 1 || options.streams_per_shard > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("streams_per_shard=", options.streams_per_shard,
                     " must be in [1, 64]"));
  }
  if (options.max_attempts < 1) {
    return absl::InvalidArgumentError("max_attempts must be at least 1");
  }
  for (const std::string& s : options.servers) {
    if (s.empty() || s.find(':') == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("server address \"", s, "\" is not host:port"));
    }
  }
  std::unique_ptr<Client> client(new Client(std::move(options)));
  const int max_message = kMaxChunkBytes + kMessageOverheadBytes;
  const ClientOptions& o = client->options_;
  for (uint32_t shard = 0; shard < o.servers.size(); ++shard) {
    for (int k = 0; k < o.streams_per_shard; ++k) {
      auto lane = std::make_unique<Stream>();
      lane->shard = shard;
      lane->address = o.servers[shard];
      lane->channel = MakeChannel(o.servers[shard], o.security,
                                  ClientChannelArguments(max_message, k));
      lane->stub = v1::ParameterServer::NewStub(lane->channel);
      client->lanes_.push_back(std::move(lane));
    }
  }
  return client;
}

absl::Status Client::DeclareOn(size_t shard, const v1::DeclareRequest& req,
                               absl::Time deadline, v1::DeclareResponse* resp) {
  Stream& lane = *lanes_[shard * options_.streams_per_shard];
  absl::Duration backoff = options_.initial_backoff;
  while (true) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    ctx.set_wait_for_ready(true);  // servers may still be starting
    const absl::Status s = FromGrpcStatus(lane.stub->Declare(&ctx, req, resp));
    // UNAVAILABLE from the shard itself: it has not yet seen the
    // coordinator's view that admitted this process. Ask again.
    if (!absl::IsUnavailable(s) || absl::Now() + backoff > deadline) {
      return WithPrefix(
          absl::StrCat("Declare on shard ", shard, " at ", lane.address), s);
    }
    absl::SleepFor(backoff);
    backoff = std::min(2 * backoff, absl::Seconds(1));
  }
}

v1::DeclareRequest Client::DeclareRequestFor(size_t shard) const {
  v1::DeclareRequest req;
  *req.mutable_layout() = layout_;
  *req.mutable_optimizer() = optimizer_;
  req.set_num_shards(static_cast<uint32_t>(options_.servers.size()));
  req.set_shard_index(static_cast<uint32_t>(shard));
  req.set_rank(options_.rank);
  req.set_incarnation(options_.incarnation);
  return req;
}

absl::Status Client::Declare(const v1::Layout& layout,
                             const v1::OptimizerSpec& optimizer) {
  SHARDPS_RETURN_IF_ERROR(ValidateLayout(layout));
  const uint32_t num_shards = static_cast<uint32_t>(options_.servers.size());
  std::vector<ChunkSpec> chunks = MakeChunks(layout);
  std::vector<uint32_t> shard_of = PartitionChunks(chunks, num_shards);
  const int k = options_.streams_per_shard;
  layout_ = layout;
  optimizer_ = optimizer;
  std::vector<v1::DeclareResponse> declared(num_shards);
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  SHARDPS_RETURN_IF_ERROR(RunParallel(num_shards, [&](size_t shard) {
    v1::DeclareResponse& resp = declared[shard];
    SHARDPS_RETURN_IF_ERROR(
        DeclareOn(shard, DeclareRequestFor(shard), deadline, &resp));
    std::vector<uint32_t> want;
    for (size_t i = 0; i < chunks.size(); ++i) {
      if (shard_of[i] == shard) want.push_back(static_cast<uint32_t>(i));
    }
    if (std::vector<uint32_t>(resp.chunk_ids().begin(),
                              resp.chunk_ids().end()) != want) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shard ", shard, " at ", lanes_[shard * k]->address,
          " owns other chunks than this worker computed: is it started with "
          "--shard_index=",
          shard, " --num_shards=", num_shards, "?"));
    }
    return absl::OkStatus();
  }));
  must_join_ = false;
  max_version_ = 0;
  int64_t lo = declared[0].next_step();
  int64_t hi = lo;
  for (const v1::DeclareResponse& resp : declared) {
    must_join_ = must_join_ || resp.must_join();
    max_version_ = std::max(max_version_, resp.max_version());
    lo = std::min(lo, resp.next_step());
    hi = std::max(hi, resp.next_step());
  }
  // Resume where the servers are (a restored checkpoint's step). A worker
  // that died mid-step may have left one shard a step ahead: start from the
  // lowest, which that shard answers as a retry.
  if (hi - lo > 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("the shards are at steps ", lo, " to ", hi,
                     ": restore every shard from the same checkpoint"));
  }
  start_step_ = lo;
  declared_states_ = std::move(declared);
  // Spread each shard's chunks over its lanes, largest first.
  for (auto& lane : lanes_) lane->chunk_ids.clear();
  std::vector<int64_t> lane_bytes(lanes_.size(), 0);
  std::vector<size_t> order(chunks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return chunks[a].num_elements > chunks[b].num_elements;
  });
  for (size_t i : order) {
    const size_t first = shard_of[i] * k;
    size_t best = first;
    for (size_t l = first; l < first + k; ++l) {
      if (lane_bytes[l] < lane_bytes[best]) best = l;
    }
    lanes_[best]->chunk_ids.push_back(static_cast<uint32_t>(i));
    lane_bytes[best] += chunks[i].bytes();
  }
  for (auto& lane : lanes_) {
    std::sort(lane->chunk_ids.begin(), lane->chunk_ids.end());
  }
  chunks_ = std::move(chunks);
  shard_of_ = std::move(shard_of);
  declared_ = true;
  return absl::OkStatus();
}

absl::Status Client::CheckTensors(const ConstTensors& gradients,
                                  const Tensors* weights) const {
  if (!declared_) {
    return absl::FailedPreconditionError("call Declare before any step");
  }
  const int n = layout_.tensors_size();
  if (static_cast<int>(gradients.size()) != n ||
      (weights != nullptr && static_cast<int>(weights->size()) != n)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the model has ", n, " tensors; got ", gradients.size(), " gradients",
        weights ? absl::StrCat(" and ", weights->size(), " weight buffers")
                : ""));
  }
  for (int t = 0; t < n; ++t) {
    const int64_t want = NumElements(layout_.tensors(t));
    if (static_cast<int64_t>(gradients[t].size()) != want ||
        (weights != nullptr &&
         static_cast<int64_t>((*weights)[t].size()) != want)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", layout_.tensors(t).name(), " has ", want,
                       " elements; a buffer given for it has another size"));
    }
  }
  return absl::OkStatus();
}

absl::Status Client::Attempt(Stream* lane, int64_t step,
                             const ConstTensors& gradients,
                             const Tensors* weights,
                             std::vector<uint32_t>* pending) {
  std::vector<bool> answered(chunks_.size(), false);
  absl::Status reply_error;
  absl::Status status;
  {  // The call lives in this scope; its end drops gRPC's slice references.
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(options_.rpc_timeout));
    const grpc::internal::RpcMethod method(
        kPushPullMethod, grpc::internal::RpcMethod::BIDI_STREAMING);
    std::unique_ptr<
        grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>
        stream(grpc::internal::ClientReaderWriterFactory<
               grpc::ByteBuffer, grpc::ByteBuffer>::Create(lane->channel.get(),
                                                           method, &ctx));
    // Payload slices point into the caller's gradients: no copy. For large
    // uploads the writes run beside the reads so replies flow while later
    // chunks upload; small ones are written first, saving a thread. (Writes
    // never wait for reads: the server reads every message as it arrives.)
    int64_t upload_bytes = 0;
    for (uint32_t id : *pending) upload_bytes += chunks_[id].bytes();
    auto write_all = [&] {
      v1::PushPullRequest header;
      header.set_rank(options_.rank);
      header.set_incarnation(options_.incarnation);
      header.set_rollback_id(rollback_id_);
      header.set_step(step);
      header.set_encoding(v1::ENCODING_FP32);
      header.set_push_only(weights == nullptr);
      for (uint32_t id : *pending) {
        const ChunkSpec& c = chunks_[id];
        header.set_chunk_id(id);
        {
          absl::MutexLock lock(&lane->mu);
          ++lane->slices_in_flight;
        }
        grpc::ByteBuffer message = EncodeWithPayload(
            header, ReferenceSlice(gradients[c.tensor].data() + c.offset,
                                   c.bytes(), &Stream::ReleaseSlice, lane));
        if (!stream->Write(message)) return;  // broken: Finish says why
      }
      stream->WritesDone();
      lane->writes_done = absl::Now();
    };
    std::thread writer;
    if (upload_bytes > kInlineUploadBytes) {
      writer = std::thread(write_all);
    } else {
      write_all();
    }
    grpc::ByteBuffer buffer;
    while (stream->Read(&buffer)) {
      reply_error = DecodeWithPayload(buffer, &lane->response, &lane->payload);
      const uint32_t id = lane->response.chunk_id();
      if (reply_error.ok() &&
          (id >= chunks_.size() ||
           std::find(pending->begin(), pending->end(), id) == pending->end())) {
        reply_error = absl::InternalError(
            absl::StrCat("server sent chunk ", id, " which was not pushed"));
      }
      if (reply_error.ok() && weights != nullptr) {
        const ChunkSpec& c = chunks_[id];
        reply_error = CheckPayload(EffectiveEncoding(lane->response.encoding()),
                                   lane->payload.size(), c.num_elements);
        if (reply_error.ok()) {
          lane->payload.CopyTo(
              reinterpret_cast<char*>((*weights)[c.tensor].data() + c.offset));
        }
      }
      if (!reply_error.ok()) {
        reply_error = absl::InternalError(
            absl::StrCat("bad reply: ", reply_error.message()));
        ctx.TryCancel();
        break;
      }
      answered[id] = true;
    }
    if (writer.joinable()) writer.join();
    status = FromGrpcStatus(stream->Finish());
  }
  // The caller may reuse its gradient buffers once this returns.
  if (!lane->AwaitSlicesReleased(absl::Seconds(60))) {
    return absl::InternalError(
        "gRPC still references gradient buffers 60 s after the call ended");
  }
  pending->erase(std::remove_if(pending->begin(), pending->end(),
                                [&](uint32_t id) { return answered[id]; }),
                 pending->end());
  if (!reply_error.ok()) return reply_error;
  if (status.ok() && !pending->empty()) {
    return absl::InternalError(absl::StrCat("stream ended without replies for ",
                                            pending->size(), " chunks"));
  }
  return status;
}

absl::Status Client::Step(int64_t step, const ConstTensors& gradients,
                          const Tensors* weights) {
  SHARDPS_RETURN_IF_ERROR(CheckTensors(gradients, weights));
  const absl::Time start = absl::Now();
  absl::Status status = RunParallel(lanes_.size(), [&](size_t l) {
    Stream* lane = lanes_[l].get();
    std::vector<uint32_t> pending = lane->chunk_ids;
    absl::Duration backoff = options_.initial_backoff;
    absl::Status lane_status;
    for (int attempt = 1; !pending.empty(); ++attempt) {
      lane_status = Attempt(lane, step, gradients, weights, &pending);
      if (lane_status.ok() || !IsRetryable(lane_status) ||
          attempt >= options_.max_attempts) {
        break;
      }
      retries_.fetch_add(1);
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, options_.max_backoff);
    }
    return WithPrefix(absl::StrCat("step ", step, " on shard ", lane->shard,
                                   " at ", lane->address),
                      lane_status);
  });
  absl::Time pushed = start;
  for (const auto& lane : lanes_) pushed = std::max(pushed, lane->writes_done);
  last_push_time_ = pushed - start;
  return status;
}

absl::Status Client::PushPull(int64_t step, const ConstTensors& gradients,
                              const Tensors& weights) {
  return Step(step, gradients, &weights);
}

absl::Status Client::Push(int64_t step, const ConstTensors& gradients) {
  return Step(step, gradients, nullptr);
}

absl::Status Client::PullShard(uint32_t shard, const Tensors& weights) {
  Stream& lane = *lanes_[shard * options_.streams_per_shard];
  absl::Duration backoff = options_.initial_backoff;
  absl::Status status;
  for (int attempt = 1;; ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(options_.rpc_timeout));
    v1::PullRequest req;
    req.set_encoding(v1::ENCODING_FP32);
    grpc::ByteBuffer request;
    bool own = false;
    grpc::SerializationTraits<v1::PullRequest>::Serialize(req, &request, &own)
        .IgnoreError();
    const grpc::internal::RpcMethod method(
        kPullMethod, grpc::internal::RpcMethod::SERVER_STREAMING);
    std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
        grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
            lane.channel.get(), method, &ctx, request));
    grpc::ByteBuffer buffer;
    size_t received = 0;
    absl::Status reply_error;
    while (reader->Read(&buffer)) {
      reply_error = DecodeWithPayload(buffer, &lane.response, &lane.payload);
      const uint32_t id = lane.response.chunk_id();
      if (reply_error.ok() &&
          (id >= chunks_.size() || shard_of_[id] != shard)) {
        reply_error = absl::InternalError(
            absl::StrCat("server sent chunk ", id, " which it does not own"));
      }
      if (reply_error.ok()) {
        reply_error =
            CheckPayload(EffectiveEncoding(lane.response.encoding()),
                         lane.payload.size(), chunks_[id].num_elements);
      }
      if (!reply_error.ok()) {
        ctx.TryCancel();
        break;
      }
      const ChunkSpec& c = chunks_[id];
      lane.payload.CopyTo(
          reinterpret_cast<char*>(weights[c.tensor].data() + c.offset));
      ++received;
    }
    status = FromGrpcStatus(reader->Finish());
    if (!reply_error.ok()) status = reply_error;
    const size_t owned = std::count(shard_of_.begin(), shard_of_.end(), shard);
    if (status.ok() && received != owned) {
      status = absl::InternalError(absl::StrCat(
          "Pull returned ", received, " chunks; the shard owns ", owned));
    }
    if (status.ok()) break;
    if (!IsRetryable(status) || attempt >= options_.max_attempts) break;
    retries_.fetch_add(1);
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
  return WithPrefix(
      absl::StrCat("Pull from shard ", shard, " at ", lane.address), status);
}

absl::Status Client::Pull(const Tensors& weights) {
  ConstTensors shapes(weights.begin(), weights.end());
  SHARDPS_RETURN_IF_ERROR(CheckTensors(shapes, nullptr));
  return RunParallel(options_.servers.size(), [&](size_t shard) {
    return PullShard(static_cast<uint32_t>(shard), weights);
  });
}

absl::Status Client::JoinAt(int64_t step) {
  if (!declared_) {
    return absl::FailedPreconditionError("call Declare before JoinAt");
  }
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  SHARDPS_RETURN_IF_ERROR(
      RunParallel(options_.servers.size(), [&](size_t shard) {
        v1::DeclareRequest req = DeclareRequestFor(shard);
        req.set_join(true);
        req.set_join_step(step);
        v1::DeclareResponse resp;
        return DeclareOn(shard, req, deadline, &resp);
      }));
  must_join_ = false;
  start_step_ = step;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::DeclareResponse>> Client::Redeclare() {
  if (!declared_) {
    return absl::FailedPreconditionError("call Declare before Redeclare");
  }
  std::vector<v1::DeclareResponse> out(options_.servers.size());
  const absl::Time deadline = absl::Now() + options_.probe_timeout;
  SHARDPS_RETURN_IF_ERROR(RunParallel(out.size(), [&](size_t shard) {
    return DeclareOn(shard, DeclareRequestFor(shard), deadline, &out[shard]);
  }));
  return out;
}

absl::StatusOr<std::vector<v1::GetStatusResponse>> Client::ShardStatus() {
  std::vector<v1::GetStatusResponse> out(options_.servers.size());
  SHARDPS_RETURN_IF_ERROR(RunParallel(out.size(), [&](size_t shard) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(options_.probe_timeout));
    Stream& lane = *lanes_[shard * options_.streams_per_shard];
    return WithPrefix(
        absl::StrCat("GetStatus of shard ", shard, " at ", lane.address),
        FromGrpcStatus(
            lane.stub->GetStatus(&ctx, v1::GetStatusRequest(), &out[shard])));
  }));
  return out;
}

}  // namespace shardps
