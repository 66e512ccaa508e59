#include "server/parameter_service.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/codec.h"
#include "common/encoding.h"
#include "common/grpc_status.h"
#include "common/message_ring.h"
#include "common/shared_memory.h"
#include "common/status.h"
#include "common/wire.h"
#include "server/server_metrics.h"

namespace shardps::server {
namespace {

using PushPullReactorBase =
    grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>;

void ReleaseWeights(void* holder) {
  delete static_cast<WeightsBuffer*>(holder);
}

void ReleaseBf16(void* holder) { delete[] static_cast<uint16_t*>(holder); }

void ReleaseChanges(void* holder) {
  delete static_cast<std::shared_ptr<const std::string>*>(holder);
}

// InvalidArgument unless weights can be sent in `encoding`: FP32 or BF16,
// and for PushPull replies (`sparse`) TOPK.
absl::Status CheckReplyEncoding(v1::Encoding encoding, bool sparse) {
  encoding = EffectiveEncoding(encoding);
  if (encoding == v1::ENCODING_FP32 || encoding == v1::ENCODING_BF16 ||
      (sparse && encoding == v1::ENCODING_TOPK)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "weights cannot be sent as ", EncodingName(encoding),
      sparse ? ": ask for ENCODING_FP32, ENCODING_BF16 or ENCODING_TOPK"
             : ": ask for ENCODING_FP32 or ENCODING_BF16"));
}

// A PushPullResponse whose payload is the reply's weights in `encoding`
// (checked by CheckReplyEncoding): FP32 references the weights buffer, BF16
// is a rounded copy, TOPK references the update's changes (or, for a reply
// without them, is the weights as FP32). With `region` and `at` (the push
// asked for its reply in shared memory) the payload is copied there instead,
// when it fits. Counts the bytes sent in `store`.
// `header` gets the reply's fields and `payload` what goes in the message
// (empty when there is none or it went into the region).
void EncodeReply(ChunkReply reply, v1::Encoding encoding, ParameterStore* store,
                 ServerMetrics* metrics, SharedRegion* region,
                 std::optional<uint64_t> at, v1::PushPullResponse* header,
                 grpc::Slice* payload_out) {
  encoding = EffectiveEncoding(encoding);
  if (encoding == v1::ENCODING_TOPK && reply.changes == nullptr) {
    encoding = v1::ENCODING_FP32;
  }
  header->Clear();
  header->set_chunk_id(reply.chunk_id);
  header->set_version(reply.version);
  header->set_encoding(encoding);
  *payload_out = grpc::Slice();
  if (reply.weights == nullptr) return;
  const std::vector<float>& w = *reply.weights;
  grpc::Slice payload;
  if (encoding == v1::ENCODING_TOPK) {
    const std::string& changes = *reply.changes;
    auto* holder = new std::shared_ptr<const std::string>(reply.changes);
    payload =
        ReferenceSlice(changes.data(), changes.size(), ReleaseChanges, holder);
  } else if (encoding == v1::ENCODING_BF16) {
    auto* bf16 = new uint16_t[w.size()];
    EncodeBf16(w.data(), static_cast<int64_t>(w.size()), bf16);
    payload = ReferenceSlice(bf16, w.size() * 2, ReleaseBf16, bf16);
  } else {
    // The slice keeps the buffer alive until gRPC has sent it.
    auto* holder = new WeightsBuffer(std::move(reply.weights));
    payload = ReferenceSlice(w.data(), w.size() * 4, ReleaseWeights, holder);
  }
  store->CountSent(w.size() * 4, payload.size());
  if (metrics != nullptr) metrics->Sent(payload.size(), w.size() * 4);
  if (region != nullptr && at.has_value() &&
      region->Contains(*at, payload.size())) {
    std::memcpy(region->data() + *at, payload.begin(), payload.size());
    header->set_shm_bytes(payload.size());
    return;
  }
  *payload_out = std::move(payload);
}

grpc::ByteBuffer EncodeReply(ChunkReply reply, v1::Encoding encoding,
                             ParameterStore* store, ServerMetrics* metrics,
                             SharedRegion* region = nullptr,
                             std::optional<uint64_t> at = std::nullopt) {
  v1::PushPullResponse header;
  grpc::Slice payload;
  EncodeReply(std::move(reply), encoding, store, metrics, region, at, &header,
              &payload);
  return EncodeWithPayload(header, std::move(payload));
}

// Where a PushPull stream's message rings lie in its region.
struct RingPlace {
  uint64_t offset = 0;
  uint64_t bytes = 0;  // each
};

// The rings the call's metadata places in `region`; none when it names
// none. UNAVAILABLE with kSharedMemoryErrorPrefix (the client goes on
// without shared memory) for rings without a region, a malformed place,
// or rings that do not lie in the region as MessageRing::Check wants.
absl::StatusOr<std::optional<RingPlace>> CallRings(
    const grpc::CallbackServerContext* ctx, const SharedRegion* region) {
  const auto& md = ctx->client_metadata();
  auto it = md.find(kSharedMemoryRingsMetadata);
  if (it == md.end()) return std::optional<RingPlace>();
  const absl::string_view named(it->second.data(), it->second.size());
  auto refuse = [&](absl::string_view why) {
    return absl::UnavailableError(absl::StrCat(kSharedMemoryErrorPrefix,
                                               kSharedMemoryRingsMetadata,
                                               " \"", named, "\": ", why));
  };
  if (region == nullptr) {
    return refuse(absl::StrCat("the call names no region (",
                               kSharedMemoryMetadata, " metadata)"));
  }
  std::vector<absl::string_view> parts = absl::StrSplit(named, ' ');
  RingPlace place;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &place.offset) ||
      !absl::SimpleAtoi(parts[1], &place.bytes)) {
    return refuse("not \"<offset> <bytes>\"");
  }
  if (place.bytes > region->size() / 2 ||
      !region->Contains(place.offset, 2 * place.bytes)) {
    return refuse(absl::StrCat("two rings there do not lie in the region of ",
                               region->size(), " bytes"));
  }
  for (uint64_t at : {place.offset, place.offset + place.bytes}) {
    const absl::Status ok =
        MessageRing::Check(region->data() + at, place.bytes);
    if (!ok.ok()) return refuse(ok.message());
  }
  return std::optional<RingPlace>(place);
}

// One PushPull stream. Accepted pushes are answered by the store through
// Deliver(); the stream finishes once the client has half-closed and every
// accepted push has been answered, or at the first rejected push. Shared
// ownership: gRPC's reference ends at OnDone, the store's waiters may hold
// theirs longer (Deliver after the finish is a no-op).
//
// With message rings (a co-located worker; see PushPullRequest) a thread of
// the stream's own reads the pushes from the requests' ring and Deliver
// writes the replies into the replies' ring; gRPC's read only sees the
// client's half-close. The stream finishes only after that thread has
// stopped, so nothing of the stream runs once gRPC is done with it.
class PushPullReactor final
    : public PushPullReactorBase,
      public ReplySink,
      public std::enable_shared_from_this<PushPullReactor> {
 public:
  static PushPullReactor* Start(ParameterStore* store,
                                ParameterService* service,
                                std::unique_ptr<SharedRegion> region,
                                std::optional<RingPlace> rings,
                                std::unique_ptr<SharedRegion> gradients,
                                std::unique_ptr<SharedRegion> weights) {
    auto reactor = std::make_shared<PushPullReactor>(
        store, service, std::move(region), rings, std::move(gradients),
        std::move(weights));
    reactor->self_ = reactor;
    reactor->StartRead(&reactor->buffer_);
    if (reactor->requests_ != nullptr) {
      std::thread([reactor] { reactor->ReadRing(); }).detach();
    }
    return reactor.get();
  }
  PushPullReactor(ParameterStore* store, ParameterService* service,
                  std::unique_ptr<SharedRegion> region,
                  std::optional<RingPlace> rings,
                  std::unique_ptr<SharedRegion> gradients,
                  std::unique_ptr<SharedRegion> weights)
      : store_(store),
        service_(service),
        region_(std::move(region)),
        gradient_region_(std::move(gradients)),
        weight_region_(std::move(weights)),
        requests_(rings.has_value()
                      ? std::make_unique<MessageRing>(
                            region_->data() + rings->offset, rings->bytes)
                      : nullptr),
        replies_(rings.has_value()
                     ? std::make_unique<MessageRing>(
                           region_->data() + rings->offset + rings->bytes,
                           rings->bytes)
                     : nullptr),
        ring_reader_done_(!rings.has_value()) {}

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override {
    RequestFinish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  }
  void OnDone() override { self_.reset(); }  // may delete this

  // Queues a reply; called by the store from any thread.
  void Deliver(ChunkReply reply) override;
  // Ends the stream with `status` (the shard was reset).
  void Fail(const absl::Status& status) override {
    RequestFinish(ToGrpcStatus(status));
  }
  // The store keeps a gradient of this stream until other workers' arrive:
  // no more reads until it is released.
  void Hold() override {
    absl::MutexLock lock(&mu_);
    ++holds_;
  }
  void Release() override;

 private:
  // Every StartRead, StartWrite and Finish is decided under mu_ and issued
  // outside it (gRPC may run reactions inline). Finish is issued only when
  // no write is in flight and no StartRead is being issued: once Finish
  // completes, gRPC may free the call, so nothing may start after it.
  void Pump();
  void RequestFinish(grpc::Status status);
  void ReadNext();
  // Takes the push in request_ and payload_ (`decoded`: whether it
  // parsed), counted in unanswered_ by the caller: hands it to the store,
  // or finishes the stream with the error. False when the stream is to
  // read no more.
  bool Take(absl::Status decoded);
  // The ring thread: takes pushes from requests_ until the stream is to
  // finish, or the client half-closed and left none.
  void ReadRing();
  // `region`: where the reply's payload goes (the stream's or the weight
  // region), at `at`.
  void DeliverToRing(ChunkReply reply, v1::Encoding encoding,
                     SharedRegion* region, std::optional<uint64_t> at);
  // Records the first push's reply encoding; InvalidArgument for one that
  // cannot be sent or differs from it.
  absl::Status TakeReplyEncoding(v1::Encoding asked);
  // The request's shared-memory fields: points `shared` at its payload in
  // the region (when shm_bytes > 0) and records where its reply goes.
  // InvalidArgument for bytes outside the region, or without one.
  absl::Status TakeSharedMemory(absl::string_view* shared);

  ParameterStore* const store_;
  ParameterService* const service_;
  // The worker's region for this stream (null: payloads in the messages).
  // The pointer is fixed; the shard reads gradients from it in read
  // reactions and writes replies into it in Deliver.
  const std::unique_ptr<SharedRegion> region_;
  // The worker's gradient region, mapped read-only (null: none); pushes
  // with shm_in_gradient_region read their payload from it.
  const std::unique_ptr<SharedRegion> gradient_region_;
  // The worker's weight region (null: none); replies asked there
  // (reply_in_weight_region) are written into it in Deliver.
  const std::unique_ptr<SharedRegion> weight_region_;
  // The message rings in region_ (null: none): the requests' one is read by
  // the ring thread only, the replies' one written under mu_.
  const std::unique_ptr<MessageRing> requests_;
  const std::unique_ptr<MessageRing> replies_;
  std::shared_ptr<PushPullReactor> self_;  // gRPC's reference, until OnDone
  // Only touched by read reactions (with rings: by the ring thread).
  grpc::ByteBuffer buffer_;
  v1::PushPullRequest request_;
  PayloadView payload_;
  std::string ring_message_;

  absl::Mutex mu_;
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
  // The reply encoding the stream's first push asked for.
  std::optional<v1::Encoding> reply_encoding_ ABSL_GUARDED_BY(mu_);
  // By chunk id: where the reply to its push goes, in region_ or (second)
  // in weight_region_.
  absl::flat_hash_map<uint32_t, std::pair<uint64_t, bool>> reply_at_
      ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  int starting_read_ ABSL_GUARDED_BY(mu_) = 0;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> finish_wanted_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  int64_t unanswered_ ABSL_GUARDED_BY(mu_) = 0;
  // Gradients the store holds (Hold, not yet Release); while any is held
  // the next read waits (read_paused_), so a stream keeps at most one
  // early gradient in the store.
  int holds_ ABSL_GUARDED_BY(mu_) = 0;
  bool read_paused_ ABSL_GUARDED_BY(mu_) = false;
  // The ring thread has stopped (true without rings).
  bool ring_reader_done_ ABSL_GUARDED_BY(mu_);
  std::string reply_bytes_ ABSL_GUARDED_BY(mu_);  // a ring reply's
};

absl::Status PushPullReactor::TakeReplyEncoding(v1::Encoding asked) {
  SHARDPS_RETURN_IF_ERROR(CheckReplyEncoding(asked, /*sparse=*/true));
  asked = EffectiveEncoding(asked);
  absl::MutexLock lock(&mu_);
  if (!reply_encoding_.has_value()) reply_encoding_ = asked;
  if (*reply_encoding_ == asked) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "push of chunk ", request_.chunk_id(), " from rank ", request_.rank(),
      " asks for weights as ", EncodingName(asked), " but this stream's first",
      " push asked for ", EncodingName(*reply_encoding_)));
}

absl::Status PushPullReactor::TakeSharedMemory(absl::string_view* shared) {
  const v1::PushPullRequest& r = request_;
  if (r.shm_bytes() == 0 && !r.has_reply_shm_offset() &&
      !r.shm_in_gradient_region() && !r.reply_in_weight_region()) {
    return absl::OkStatus();
  }
  // Named only on an error: no string built per push.
  auto what = [&r] {
    return absl::StrCat("push of chunk ", r.chunk_id(), " from rank ",
                        r.rank());
  };
  const bool in_gradients = r.shm_in_gradient_region();
  // Where the payload lies: the worker's gradient region or the stream's.
  const SharedRegion* source =
      in_gradients ? gradient_region_.get() : region_.get();
  if (in_gradients && r.shm_bytes() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what(), " names the gradient region but no bytes in it"));
  }
  const bool in_weights = r.reply_in_weight_region();
  // Where the reply goes: the worker's weight region or the stream's.
  const SharedRegion* target =
      in_weights ? weight_region_.get() : region_.get();
  if (in_weights && !r.has_reply_shm_offset()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what(),
                     " asks its reply in the weight region but gives no "
                     "reply_shm_offset"));
  }
  if (in_weights &&
      EffectiveEncoding(r.reply_encoding()) != v1::ENCODING_FP32) {
    return absl::InvalidArgumentError(
        absl::StrCat(what(), " asks its reply in the weight region as ",
                     EncodingName(r.reply_encoding()),
                     ": replies there are ENCODING_FP32 only"));
  }
  // `name` (named by the metadata `key`) is needed but the stream has none.
  auto no_region = [&what](absl::string_view name, absl::string_view key) {
    return absl::InvalidArgumentError(absl::StrCat(
        what(), " refers to shared memory, but its stream names no ", name,
        " (", key, " metadata)"));
  };
  if (r.shm_bytes() > 0 && source == nullptr) {
    return in_gradients
               ? no_region("gradient region", kSharedMemoryGradientsMetadata)
               : no_region("region", kSharedMemoryMetadata);
  }
  if (r.has_reply_shm_offset() && target == nullptr) {
    return in_weights ? no_region("weight region", kSharedMemoryWeightsMetadata)
                      : no_region("region", kSharedMemoryMetadata);
  }
  if (r.shm_bytes() > 0) {
    if (payload_.size() != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what(), " has both a payload and ", r.shm_bytes(),
                       " bytes in shared memory"));
    }
    if (!source->Contains(r.shm_offset(), r.shm_bytes())) {
      return absl::InvalidArgumentError(
          absl::StrCat(what(), ": shared-memory bytes [", r.shm_offset(), ", +",
                       r.shm_bytes(), ") lie outside the ",
                       in_gradients ? "gradient region" : "stream's region",
                       " of ", source->size(), " bytes"));
    }
    *shared = absl::string_view(source->data() + r.shm_offset(), r.shm_bytes());
    if (in_gradients) service_->CountGradientRegionPush();
  }
  if (r.has_reply_shm_offset()) {
    if (r.reply_shm_offset() >= target->size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what(), ": reply_shm_offset ", r.reply_shm_offset(),
                       " lies outside the ",
                       in_weights ? "weight region" : "stream's region", " of ",
                       target->size(), " bytes"));
    }
    if (in_weights) service_->CountWeightRegionReply();
    absl::MutexLock lock(&mu_);
    reply_at_[r.chunk_id()] = {r.reply_shm_offset(), in_weights};
  }
  return absl::OkStatus();
}

void PushPullReactor::OnReadDone(bool ok) {
  bool misplaced = false;
  {
    absl::MutexLock lock(&mu_);
    if (!ok) reads_done_ = true;
    // A stream being finished takes no more pushes.
    if (!ok || finish_wanted_.has_value() || finished_) {
      ok = false;
    } else if (requests_ != nullptr) {
      misplaced = true;
    } else {
      ++unanswered_;  // counted first: the store may answer before Push returns
    }
  }
  if (misplaced) {
    buffer_.Clear();
    RequestFinish(grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        "a push came through gRPC on a stream whose pushes go through its "
        "message rings"));
    return;
  }
  if (!ok) {
    Pump();
    return;
  }
  if (!Take(DecodeWithPayload(buffer_, &request_, &payload_))) return;
  {
    absl::MutexLock lock(&mu_);
    if (holds_ > 0) {
      read_paused_ = true;  // Release reads on
      return;
    }
  }
  ReadNext();
}

bool PushPullReactor::Take(absl::Status status) {
  if (status.ok()) status = TakeReplyEncoding(request_.reply_encoding());
  absl::string_view shared;
  if (status.ok()) status = TakeSharedMemory(&shared);
  if (status.ok() && requests_ != nullptr && !request_.push_only() &&
      !request_.has_reply_shm_offset()) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "push of chunk ", request_.chunk_id(), " from rank ", request_.rank(),
        " came through the stream's message ring without reply_shm_offset: "
        "its reply could not carry the weights"));
  }
  // The store copies the bytes out of the region before it checks them.
  StringByteSource shared_payload(shared);
  if (status.ok()) {
    PushArgs args;
    args.rank = request_.rank();
    args.incarnation = request_.incarnation();
    args.rollback_id = request_.rollback_id();
    args.step = request_.step();
    args.chunk_id = request_.chunk_id();
    args.encoding = request_.encoding();
    args.push_only = request_.push_only();
    if (request_.has_learning_rate()) {
      args.learning_rate = request_.learning_rate();
    }
    args.no_gradient = request_.no_gradient();
    args.initial_values = request_.initial_values();
    args.payload = request_.shm_bytes() > 0
                       ? static_cast<const ByteSource*>(&shared_payload)
                       : &payload_;
    status = store_->Push(args, shared_from_this());
  }
  // The store has copied what it keeps: let go of the received slices.
  payload_.Clear();
  buffer_.Clear();
  if (!status.ok()) {
    if (service_->metrics() != nullptr) service_->metrics()->Rejected(status);
    {
      absl::MutexLock lock(&mu_);
      --unanswered_;
    }
    RequestFinish(ToGrpcStatus(status));
    return false;
  }
  return true;
}

void PushPullReactor::ReadRing() {
  for (;;) {
    const uint32_t seen = requests_->wakeups();
    bool half_closed;
    {
      absl::MutexLock lock(&mu_);
      if (finish_wanted_.has_value() || finished_) break;
      half_closed = reads_done_;
    }
    absl::StatusOr<bool> popped = requests_->Pop(&ring_message_);
    if (!popped.ok()) {
      RequestFinish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                 absl::StrCat("the stream's request ring: ",
                                              popped.status().message())));
      break;
    }
    if (!*popped) {
      if (half_closed) break;  // and nothing left behind
      requests_->WaitSince(seen, absl::Milliseconds(200));
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      if (finish_wanted_.has_value() || finished_) break;
      ++unanswered_;
    }
    payload_.Clear();
    if (!Take(request_.ParseFromString(ring_message_)
                  ? absl::OkStatus()
                  : absl::InvalidArgumentError(
                        "malformed PushPullRequest in the stream's request "
                        "ring"))) {
      break;
    }
    // As a paused read: at most one early gradient of this stream waits in
    // the store.
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](PushPullReactor* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu_) {
          return r->holds_ == 0 || r->finish_wanted_.has_value() ||
                 r->finished_;
        },
        this));
  }
  {
    absl::MutexLock lock(&mu_);
    ring_reader_done_ = true;
  }
  Pump();
}

void PushPullReactor::Release() {
  {
    absl::MutexLock lock(&mu_);
    if (--holds_ > 0 || !read_paused_) return;
    read_paused_ = false;
  }
  ReadNext();
}

void PushPullReactor::ReadNext() {
  {
    absl::MutexLock lock(&mu_);
    if (finish_wanted_.has_value() || finished_) return;
    ++starting_read_;
  }
  StartRead(&buffer_);
  {
    absl::MutexLock lock(&mu_);
    --starting_read_;
  }
  Pump();  // a finish may have been requested meanwhile
}

void PushPullReactor::Deliver(ChunkReply reply) {
  v1::Encoding encoding;
  std::optional<uint64_t> at;
  SharedRegion* region = region_.get();
  {
    absl::MutexLock lock(&mu_);
    if (finished_ || finish_wanted_.has_value()) return;
    encoding = reply_encoding_.value_or(v1::ENCODING_FP32);
    auto it = reply_at_.find(reply.chunk_id);
    if (it != reply_at_.end()) {
      at = it->second.first;
      if (it->second.second) region = weight_region_.get();
    }
  }
  if (replies_ != nullptr) {
    DeliverToRing(std::move(reply), encoding, region, at);
    return;
  }
  // Encoded outside the lock: a BF16 reply converts the whole chunk.
  grpc::ByteBuffer message = EncodeReply(std::move(reply), encoding, store_,
                                         service_->metrics(), region, at);
  {
    absl::MutexLock lock(&mu_);
    if (finished_ || finish_wanted_.has_value()) return;
    queue_.push_back(std::move(message));
  }
  Pump();
}

void PushPullReactor::DeliverToRing(ChunkReply reply, v1::Encoding encoding,
                                    SharedRegion* region,
                                    std::optional<uint64_t> at) {
  const uint32_t id = reply.chunk_id;
  v1::PushPullResponse header;
  grpc::Slice payload;
  EncodeReply(std::move(reply), encoding, store_, service_->metrics(), region,
              at, &header, &payload);
  std::optional<grpc::Status> fail;
  {
    absl::MutexLock lock(&mu_);
    if (finished_ || finish_wanted_.has_value()) return;
    if (payload.size() > 0) {
      fail = grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("the weights of chunk ", id,
                       " do not fit where its push asked for them in the "
                       "stream's region"));
    } else if (service_->DropNextReply()) {
      fail = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "injected fault: reply dropped");
    } else {
      header.SerializeToString(&reply_bytes_);
      const absl::Status appended = replies_->Append(reply_bytes_);
      if (appended.ok()) {
        replies_->Publish();
        --unanswered_;
      } else {
        fail = grpc::Status(
            grpc::StatusCode::UNAVAILABLE,
            absl::StrCat(kSharedMemoryErrorPrefix,
                         "the stream's reply ring: ", appended.message()));
      }
    }
  }
  if (fail.has_value()) {
    RequestFinish(*std::move(fail));
  } else {
    Pump();
  }
}

void PushPullReactor::OnWriteDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    queue_.pop_front();
    --unanswered_;
  }
  if (!ok) {
    RequestFinish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                               "stream broke while writing a reply"));
    return;
  }
  Pump();
}

void PushPullReactor::RequestFinish(grpc::Status status) {
  {
    absl::MutexLock lock(&mu_);
    if (!finish_wanted_.has_value()) finish_wanted_ = std::move(status);
  }
  Pump();
}

void PushPullReactor::Pump() {
  const grpc::ByteBuffer* next = nullptr;
  std::optional<grpc::Status> finish;
  bool drop = false;
  bool stop_ring = false;
  {
    absl::MutexLock lock(&mu_);
    if (finished_ || writing_) return;
    if (finish_wanted_.has_value()) {
      if (starting_read_ > 0) return;  // ReadNext pumps again
      if (!ring_reader_done_) {
        stop_ring = true;  // the ring thread pumps again as it stops
      } else {
        finished_ = true;
        finish = *finish_wanted_;
      }
    } else if (!queue_.empty()) {
      drop = service_->DropNextReply();
      if (!drop) {
        writing_ = true;
        next = &queue_.front();  // deque references survive push_back
      }
    } else if (reads_done_ && unanswered_ == 0) {
      if (!ring_reader_done_) {
        stop_ring = true;
      } else {
        finished_ = true;
        finish = grpc::Status::OK;
      }
    }
  }
  if (stop_ring) {
    requests_->Interrupt();
  } else if (drop) {
    RequestFinish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                               "injected fault: reply dropped"));
  } else if (next != nullptr) {
    StartWrite(next);
  } else if (finish.has_value()) {
    Finish(*finish);
  }
}

// Streams the requested chunks one message at a time; with `region`, the
// weights of each chunk that has an offset in `reply_at` (by position in
// `chunk_ids`) go there instead of into the message.
class PullReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  PullReactor(ParameterStore* store, std::vector<uint32_t> chunk_ids,
              v1::Encoding encoding, ServerMetrics* metrics,
              std::unique_ptr<SharedRegion> region,
              std::vector<std::optional<uint64_t>> reply_at)
      : store_(store),
        chunk_ids_(std::move(chunk_ids)),
        encoding_(encoding),
        metrics_(metrics),
        region_(std::move(region)),
        reply_at_(std::move(reply_at)) {
    WriteNext();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed"));
      return;
    }
    WriteNext();
  }
  void OnDone() override { delete this; }

 private:
  void WriteNext() {
    if (next_ == chunk_ids_.size()) {
      Finish(grpc::Status::OK);
      return;
    }
    const size_t i = next_++;
    absl::StatusOr<ChunkReply> reply = store_->Read(chunk_ids_[i]);
    if (!reply.ok()) {
      if (metrics_ != nullptr) metrics_->Rejected(reply.status());
      Finish(ToGrpcStatus(reply.status()));
      return;
    }
    if (metrics_ != nullptr) metrics_->Pulled();
    response_ = EncodeReply(*std::move(reply), encoding_, store_, metrics_,
                            region_.get(),
                            i < reply_at_.size() ? reply_at_[i] : std::nullopt);
    StartWrite(&response_);
  }

  ParameterStore* const store_;
  const std::vector<uint32_t> chunk_ids_;
  const v1::Encoding encoding_;
  ServerMetrics* const metrics_;
  const std::unique_ptr<SharedRegion> region_;  // null: none
  const std::vector<std::optional<uint64_t>> reply_at_;
  size_t next_ = 0;
  grpc::ByteBuffer response_;
};

// Finishes a PushPull stream at once with an error.
class FailedPushPull final : public PushPullReactorBase {
 public:
  explicit FailedPushPull(const absl::Status& status) {
    Finish(ToGrpcStatus(status));
  }
  void OnDone() override { delete this; }
};

// Finishes a streaming RPC at once with an error.
class FailedPull final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  FailedPull(const absl::Status& status, ServerMetrics* metrics) {
    if (metrics != nullptr) metrics->Rejected(status);
    Finish(ToGrpcStatus(status));
  }
  void OnDone() override { delete this; }
};

// The offsets of `req` by position in `ids` (the chunks the Pull reads);
// InvalidArgument naming the chunk for an offset of a chunk not read, one
// outside `region`, or any without a region.
absl::Status ReplyOffsets(const v1::PullRequest& req,
                          const std::vector<uint32_t>& ids,
                          const SharedRegion* region,
                          std::vector<std::optional<uint64_t>>* reply_at) {
  if (region == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Pull gives reply_shm_offsets, but its call names no region (",
        kSharedMemoryMetadata, " metadata)"));
  }
  reply_at->assign(ids.size(), std::nullopt);
  size_t found = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    auto it = req.reply_shm_offsets().find(ids[i]);
    if (it == req.reply_shm_offsets().end()) continue;
    if (it->second >= region->size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Pull: reply_shm_offsets of chunk ", ids[i], " (", it->second,
          ") lies outside the call's region of ", region->size(), " bytes"));
    }
    (*reply_at)[i] = it->second;
    ++found;
  }
  if (found != static_cast<size_t>(req.reply_shm_offsets().size())) {
    for (const auto& [id, at] : req.reply_shm_offsets()) {
      if (std::find(ids.begin(), ids.end(), id) == ids.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("Pull: reply_shm_offsets names chunk ", id,
                         ", which this Pull does not read"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status NoSharedMemory() {
  return absl::FailedPreconditionError(
      "this shard was started with --shared_memory=false");
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedRegion>> ParameterService::NamedRegion(
    const grpc::CallbackServerContext* ctx, absl::string_view key,
    uint64_t limit, absl::string_view needs,
    SharedRegion::Mapping mapping) const {
  const auto& md = ctx->client_metadata();
  auto it = md.find(grpc::string_ref(key.data(), key.size()));
  if (it == md.end()) return std::unique_ptr<SharedRegion>();
  const absl::string_view named(it->second.data(), it->second.size());
  auto refuse = [](const absl::Status& why) {
    return absl::UnavailableError(
        absl::StrCat(kSharedMemoryErrorPrefix, why.message()));
  };
  if (!options_.shared_memory) return refuse(NoSharedMemory());
  std::vector<absl::string_view> parts =
      absl::StrSplit(named, absl::MaxSplits(' ', 1));
  uint64_t bytes = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[1], &bytes)) {
    return refuse(absl::InvalidArgumentError(absl::StrCat(
        key, " metadata \"", named, "\" is not \"<path> <bytes>\"")));
  }
  if (bytes > limit) {
    return refuse(absl::ResourceExhaustedError(
        absl::StrCat("a region of ", bytes, " bytes is more than ", needs,
                     " need (", limit, "), named by ", key)));
  }
  absl::StatusOr<std::unique_ptr<SharedRegion>> region =
      SharedRegion::Open(parts[0], bytes, mapping);
  if (!region.ok()) return refuse(region.status());
  return region;
}

absl::StatusOr<std::unique_ptr<SharedRegion>> ParameterService::CallRegion(
    const grpc::CallbackServerContext* ctx, const ParameterStore* store) const {
  // One call's region holds gradients and weights of chunks this shard
  // owns, each at a cache line: at most twice its bytes, plus padding.
  // And two message rings for as many headers as chunks.
  const auto [owned_bytes, owned_chunks] = store->OwnedSize();
  const uint64_t limit =
      2 * (owned_bytes + 64 * owned_chunks) + 64 +
      2 * MessageRing::BytesFor(owned_chunks, kRingMessageBytes);
  return NamedRegion(ctx, kSharedMemoryMetadata, limit, "this shard's chunks",
                     SharedRegion::Mapping::kReadWrite);
}

absl::StatusOr<std::unique_ptr<SharedRegion>> ParameterService::GradientRegion(
    const grpc::CallbackServerContext* ctx, const ParameterStore* store) const {
  // The whole model's gradients, each tensor (or chunk) at a cache line.
  const auto [model_bytes, model_chunks] = store->ModelSize();
  return NamedRegion(ctx, kSharedMemoryGradientsMetadata,
                     model_bytes + 64 * model_chunks + 64,
                     "the model's gradients", SharedRegion::Mapping::kReadOnly);
}

absl::StatusOr<std::unique_ptr<SharedRegion>> ParameterService::WeightRegion(
    const grpc::CallbackServerContext* ctx, const ParameterStore* store) const {
  const auto [model_bytes, model_chunks] = store->ModelSize();
  return NamedRegion(
      ctx, kSharedMemoryWeightsMetadata, model_bytes + 64 * model_chunks + 64,
      "the model's weights", SharedRegion::Mapping::kReadWriteLazy);
}

absl::Status ParameterService::NotReady() const {
  absl::MutexLock lock(&mu_);
  return absl::UnavailableError(
      absl::StrCat("this shard is not serving yet: ", waiting_, "; retry"));
}

bool ParameterService::DropNextReply() {
  if (options_.drop_reply_every <= 0) return false;
  return (replies_.fetch_add(1) + 1) % options_.drop_reply_every == 0;
}

grpc::ServerUnaryReactor* ParameterService::Declare(
    grpc::CallbackServerContext* ctx, const v1::DeclareRequest* req,
    v1::DeclareResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  ParameterStore* store = this->store();
  if (store == nullptr) {
    reactor->Finish(ToGrpcStatus(NotReady()));
    return reactor;
  }
  absl::StatusOr<v1::DeclareResponse> result = store->Declare(*req);
  if (result.ok()) {
    *resp = *std::move(result);
    if (!req->shared_memory_probe().empty()) {
      absl::StatusOr<std::unique_ptr<SharedRegion>> probe =
          options_.shared_memory
              ? SharedRegion::Open(req->shared_memory_probe(), 16)
              : NoSharedMemory();
      if (probe.ok()) {
        resp->set_shared_memory_token((*probe)->data(), 16);
        resp->set_shared_memory_rings(options_.shared_memory_rings);
      } else {
        resp->set_shared_memory_error(std::string(probe.status().message()));
      }
    }
  }
  reactor->Finish(ToGrpcStatus(result.status()));
  return reactor;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
ParameterService::PushPull(grpc::CallbackServerContext* ctx) {
  ParameterStore* store = this->store();
  if (store == nullptr) return new FailedPushPull(NotReady());
  push_streams_.fetch_add(1, std::memory_order_relaxed);
  absl::StatusOr<std::unique_ptr<SharedRegion>> region = CallRegion(ctx, store);
  if (!region.ok()) return new FailedPushPull(region.status());
  absl::StatusOr<std::optional<RingPlace>> rings =
      CallRings(ctx, region->get());
  if (!rings.ok()) return new FailedPushPull(rings.status());
  if (rings->has_value() && !options_.shared_memory_rings) {
    return new FailedPushPull(absl::UnavailableError(absl::StrCat(
        kSharedMemoryErrorPrefix,
        "this shard was started with --shared_memory_rings=false")));
  }
  absl::StatusOr<std::unique_ptr<SharedRegion>> gradients =
      GradientRegion(ctx, store);
  if (!gradients.ok()) return new FailedPushPull(gradients.status());
  absl::StatusOr<std::unique_ptr<SharedRegion>> weights =
      WeightRegion(ctx, store);
  if (!weights.ok()) return new FailedPushPull(weights.status());
  if (*region != nullptr) shm_streams_.fetch_add(1, std::memory_order_relaxed);
  if (rings->has_value()) {
    shm_ring_streams_.fetch_add(1, std::memory_order_relaxed);
  }
  return PushPullReactor::Start(store, this, *std::move(region), *rings,
                                *std::move(gradients), *std::move(weights));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* ParameterService::Pull(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request) {
  ParameterStore* store = this->store();
  if (store == nullptr) return new FailedPull(NotReady(), metrics());
  v1::PullRequest parsed;
  grpc::ByteBuffer copy(*request);  // Deserialize consumes its argument
  if (!grpc::SerializationTraits<v1::PullRequest>::Deserialize(&copy, &parsed)
           .ok()) {
    return new FailedPull(absl::InvalidArgumentError("malformed PullRequest"),
                          metrics());
  }
  const v1::PullRequest* req = &parsed;
  absl::Status encoding = CheckReplyEncoding(req->encoding(), /*sparse=*/false);
  if (!encoding.ok()) return new FailedPull(encoding, metrics());
  std::vector<uint32_t> ids(req->chunk_ids().begin(), req->chunk_ids().end());
  if (ids.empty()) {
    ids = store->OwnedChunks();
    if (ids.empty()) {
      return new FailedPull(
          absl::FailedPreconditionError(
              "no model is declared on this shard yet: call Declare first"),
          metrics());
    }
  }
  // Reject unknown chunks, and chunks still awaiting their initial values,
  // before streaming anything.
  for (uint32_t id : ids) {
    absl::Status readable = store->CheckReadable(id);
    if (!readable.ok()) return new FailedPull(readable, metrics());
  }
  absl::StatusOr<std::unique_ptr<SharedRegion>> region = CallRegion(ctx, store);
  if (!region.ok()) return new FailedPull(region.status(), metrics());
  std::vector<std::optional<uint64_t>> reply_at;
  if (!req->reply_shm_offsets().empty()) {
    absl::Status offsets = ReplyOffsets(*req, ids, region->get(), &reply_at);
    if (!offsets.ok()) return new FailedPull(offsets, metrics());
  }
  if (*region != nullptr) shm_streams_.fetch_add(1, std::memory_order_relaxed);
  return new PullReactor(store, std::move(ids),
                         EffectiveEncoding(req->encoding()), metrics(),
                         *std::move(region), std::move(reply_at));
}

grpc::ServerUnaryReactor* ParameterService::GetStatus(
    grpc::CallbackServerContext* ctx, const v1::GetStatusRequest* req,
    v1::GetStatusResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  ParameterStore* store = this->store();
  if (store == nullptr) {
    reactor->Finish(ToGrpcStatus(NotReady()));
    return reactor;
  }
  *resp = store->Report();
  resp->set_push_streams_total(push_streams_.load(std::memory_order_relaxed));
  resp->set_shared_memory_streams_total(
      shm_streams_.load(std::memory_order_relaxed));
  resp->set_shared_memory_ring_streams_total(
      shm_ring_streams_.load(std::memory_order_relaxed));
  resp->set_shared_memory_gradient_pushes_total(
      shm_gradient_pushes_.load(std::memory_order_relaxed));
  resp->set_shared_memory_weight_replies_total(
      shm_weight_replies_.load(std::memory_order_relaxed));
  const ShardCheckpointer* checkpoints = checkpoints_.load();
  if (checkpoints != nullptr) {
    const CheckpointProgress progress = checkpoints->Progress();
    resp->set_checkpoint_dir(checkpoints->dir());
    resp->set_last_checkpoint_step(progress.written_step);
    resp->set_last_committed_checkpoint_step(progress.committed_step);
    resp->set_failed_checkpoint_step(progress.failed_step);
    resp->set_checkpoint_error(progress.error);
  }
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* ParameterService::Checkpoint(
    grpc::CallbackServerContext* ctx, const v1::CheckpointRequest* req,
    v1::CheckpointResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  ParameterStore* store = this->store();
  if (store == nullptr) {
    reactor->Finish(ToGrpcStatus(NotReady()));
    return reactor;
  }
  const absl::Status status = store->RequestCheckpoint(req->step());
  if (status.ok()) resp->set_step(req->step());
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace shardps::server
