#include "coordinator/coordinator_service.h"

#include <optional>
#include <utility>

#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "coordinator/coordinator_metrics.h"

namespace shardps::coordinator {
namespace {

// Finishes a unary call with `result`: its value, or its error.
template <typename Response>
grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx,
                                absl::StatusOr<Response> result,
                                Response* response) {
  if (result.ok()) *response = *std::move(result);
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(result.status()));
  return reactor;
}

grpc::Status ShuttingDown() {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      "the coordinator is shutting down");
}

}  // namespace

// One WatchCluster stream. Holds at most one view waiting to be written: a
// newer view replaces a waiting one, so a slow reader skips generations but
// never holds more than two views. Views are shared, immutable, by every
// stream: a change costs one copy of the view, not one per watcher (the
// view holds every member, so copies per watcher would be O(members^2)).
// StartWrite and Finish are only called by whoever moves the state out of
// "idle" under mu_, so there is never a write after Finish and never a Finish
// during a write. Shared ownership: gRPC's reference ends at OnDone; the
// notifier may hold one while it offers a view.
class WatchReactor final : public grpc::ServerWriteReactor<v1::ClusterView> {
 public:
  static WatchReactor* Start(CoordinatorService* service,
                             std::shared_ptr<WatchReactor>* registered) {
    auto reactor = std::make_shared<WatchReactor>(service);
    reactor->self_ = reactor;
    *registered = reactor;
    return reactor.get();
  }
  explicit WatchReactor(CoordinatorService* service) : service_(service) {}

  // Queues `view` unless a view at least as new was queued or sent.
  void Offer(std::shared_ptr<const v1::ClusterView> view)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Records that the client already has `generation`.
  void Skip(uint64_t generation) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the stream with `status` once the write in flight (if any) is done.
  void RequestFinish(const grpc::Status& status) ABSL_LOCKS_EXCLUDED(mu_);

  void OnWriteDone(bool ok) override;
  void OnCancel() override {
    RequestFinish(grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled"));
  }
  void OnDone() override {
    service_->Unregister(this);
    std::shared_ptr<WatchReactor> self = std::move(self_);  // may delete this
  }

 private:
  // Starts the next write or the finish, as the state allows.
  void Pump() ABSL_LOCKS_EXCLUDED(mu_);

  CoordinatorService* const service_;
  std::shared_ptr<WatchReactor> self_;  // gRPC's reference, until OnDone

  absl::Mutex mu_;
  std::optional<uint64_t> newest_ ABSL_GUARDED_BY(mu_);  // queued or sent
  std::shared_ptr<const v1::ClusterView> waiting_ ABSL_GUARDED_BY(mu_);
  std::optional<grpc::Status> finish_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  // Read by gRPC while writing_; only replaced while not writing.
  std::shared_ptr<const v1::ClusterView> out_;
};

void WatchReactor::Offer(std::shared_ptr<const v1::ClusterView> view) {
  {
    absl::MutexLock lock(&mu_);
    if (finished_ || finish_.has_value()) return;
    if (newest_.has_value() && view->generation() <= *newest_) return;
    newest_ = view->generation();
    waiting_ = std::move(view);
  }
  Pump();
}

void WatchReactor::Skip(uint64_t generation) {
  absl::MutexLock lock(&mu_);
  if (!newest_.has_value() || generation > *newest_) newest_ = generation;
}

void WatchReactor::RequestFinish(const grpc::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    if (finish_.has_value()) return;
    finish_ = status;
  }
  Pump();
}

void WatchReactor::OnWriteDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok && !finish_.has_value()) {
      finish_ = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                             "stream broke while writing a view");
    }
  }
  Pump();
}

void WatchReactor::Pump() {
  std::optional<grpc::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    if (finished_ || writing_) return;
    if (finish_.has_value()) {
      finished_ = true;
      finish = finish_;
    } else if (waiting_ != nullptr) {
      writing_ = true;
      out_ = std::move(waiting_);
    } else {
      return;
    }
  }
  // Outside mu_: gRPC may run the reaction inline.
  if (finish.has_value()) {
    Finish(*finish);
  } else {
    StartWrite(out_.get());
  }
}

CoordinatorService::CoordinatorService(Membership* membership,
                                       CoordinatorMetrics* metrics)
    : membership_(membership),
      metrics_(metrics),
      notifier_([this] { NotifyLoop(); }) {}

CoordinatorService::~CoordinatorService() { Shutdown(); }

void CoordinatorService::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  for (const std::shared_ptr<WatchReactor>& w : Watchers()) {
    w->RequestFinish(ShuttingDown());
  }
  collectives_.Shutdown();
  stop_.Notify();
  notifier_.join();
}

void CoordinatorService::NotifyLoop() {
  uint64_t generation = membership_->generation();
  while (!stop_.HasBeenNotified()) {
    // A bounded wait, so that Shutdown is noticed within it.
    std::optional<v1::ClusterView> view = membership_->AwaitViewAfter(
        generation, absl::Now() + absl::Milliseconds(100));
    // So a collective's timeout is noticed within 100 ms.
    collectives_.ExpireWaits(absl::Now());
    if (!view.has_value()) continue;
    generation = view->generation();
    collectives_.DropDeparted(*view);
    auto shared = std::make_shared<const v1::ClusterView>(*std::move(view));
    for (const std::shared_ptr<WatchReactor>& w : Watchers()) w->Offer(shared);
  }
}

std::vector<std::shared_ptr<WatchReactor>> CoordinatorService::Watchers()
    const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<WatchReactor>> watchers;
  watchers.reserve(watchers_.size());
  for (const auto& [ptr, reactor] : watchers_) watchers.push_back(reactor);
  return watchers;
}

void CoordinatorService::Unregister(WatchReactor* reactor) {
  absl::MutexLock lock(&mu_);
  watchers_.erase(reactor);
}

grpc::ServerWriteReactor<v1::ClusterView>* CoordinatorService::WatchCluster(
    grpc::CallbackServerContext* ctx, const v1::WatchRequest* request) {
  std::shared_ptr<WatchReactor> reactor;
  WatchReactor* raw = WatchReactor::Start(this, &reactor);
  bool shut_down = false;
  {
    absl::MutexLock lock(&mu_);
    shut_down = shut_down_;
    if (!shut_down) watchers_[raw] = reactor;
  }
  if (shut_down) {
    raw->RequestFinish(ShuttingDown());
    return raw;
  }
  // Registered before reading the view, so no later generation is missed.
  auto view = std::make_shared<const v1::ClusterView>(membership_->View());
  if (view->generation() == request->after_generation()) {
    raw->Skip(view->generation());
  } else {
    raw->Offer(std::move(view));
  }
  return raw;
}

grpc::ServerUnaryReactor* CoordinatorService::Join(
    grpc::CallbackServerContext* ctx, const v1::JoinRequest* request,
    v1::JoinResponse* response) {
  return Reply(ctx, membership_->Join(*request), response);
}

grpc::ServerUnaryReactor* CoordinatorService::Heartbeat(
    grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* request,
    v1::HeartbeatResponse* response) {
  if (metrics_ != nullptr) metrics_->Heartbeat();
  return Reply(ctx, membership_->Heartbeat(*request), response);
}

grpc::ServerUnaryReactor* CoordinatorService::Leave(
    grpc::CallbackServerContext* ctx, const v1::LeaveRequest* request,
    v1::LeaveResponse* response) {
  return Reply(ctx, membership_->Leave(*request), response);
}

grpc::ServerUnaryReactor* CoordinatorService::ReportProgress(
    grpc::CallbackServerContext* ctx, const v1::ProgressRequest* request,
    v1::ProgressResponse* response) {
  if (metrics_ != nullptr) metrics_->Heartbeat();
  return Reply(ctx, membership_->ReportProgress(*request), response);
}

grpc::ServerUnaryReactor* CoordinatorService::GetJobStatus(
    grpc::CallbackServerContext* ctx, const v1::JobStatusRequest* request,
    v1::JobStatus* response) {
  *response = membership_->Report();
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* CoordinatorService::Collective(
    grpc::CallbackServerContext* ctx, const v1::CollectiveRequest* request,
    v1::CollectiveResponse* response) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  // `response` lives until Finish; the answer may come from another
  // caller's thread or the notifier.
  collectives_.Call(
      *request, membership_->View(), absl::Now(),
      [reactor, response](absl::StatusOr<v1::CollectiveResponse> result) {
        if (result.ok()) *response = *std::move(result);
        reactor->Finish(ToGrpcStatus(result.status()));
      });
  return reactor;
}

}  // namespace shardps::coordinator
