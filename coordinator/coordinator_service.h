// The Coordinator gRPC service: thin callback handlers over a Membership and
// the job's Collectives, and WatchCluster streams fed by a notifier thread
// that wakes every open stream when the generation changes (and fails the
// collectives that wait for a member gone, or past their timeout), so no
// callback thread ever blocks.
#ifndef SHARDPS_COORDINATOR_COORDINATOR_SERVICE_H_
#define SHARDPS_COORDINATOR_COORDINATOR_SERVICE_H_

#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "coordinator/collectives.h"
#include "coordinator/membership.h"
#include "shardps/v1/coordinator.grpc.pb.h"

namespace shardps::coordinator {

class CoordinatorMetrics;
class WatchReactor;

// `membership` (and `metrics`, when not null) must outlive the service. The
// service must outlive the grpc::Server it is registered with (watch streams
// call back into it until their OnDone).
class CoordinatorService final : public v1::Coordinator::CallbackService {
 public:
  // Starts the notifier thread.
  explicit CoordinatorService(Membership* membership,
                              CoordinatorMetrics* metrics = nullptr);
  // Calls Shutdown().
  ~CoordinatorService() override;

  // Ends every open WatchCluster stream and pending Collective call with
  // UNAVAILABLE (later ones end at once) and stops the notifier. Call before
  // grpc::Server::Shutdown, which would otherwise wait for the streams until
  // its deadline. Idempotent.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* ctx,
                                 const v1::JoinRequest* request,
                                 v1::JoinResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* ctx,
                                  const v1::LeaveRequest* request,
                                  v1::LeaveResponse* response) override;
  grpc::ServerWriteReactor<v1::ClusterView>* WatchCluster(
      grpc::CallbackServerContext* ctx,
      const v1::WatchRequest* request) override;
  grpc::ServerUnaryReactor* ReportProgress(
      grpc::CallbackServerContext* ctx, const v1::ProgressRequest* request,
      v1::ProgressResponse* response) override;
  grpc::ServerUnaryReactor* GetJobStatus(grpc::CallbackServerContext* ctx,
                                         const v1::JobStatusRequest* request,
                                         v1::JobStatus* response) override;
  // Answered when every participant called it (or it failed): the reactor
  // is finished by whichever thread completes the collective.
  grpc::ServerUnaryReactor* Collective(
      grpc::CallbackServerContext* ctx, const v1::CollectiveRequest* request,
      v1::CollectiveResponse* response) override;

  // For WatchReactor::OnDone: forgets a finished stream.
  void Unregister(WatchReactor* reactor) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Offers each new view to every registered stream, and fails the
  // collectives it (or the time) ends, until Shutdown.
  void NotifyLoop();
  std::vector<std::shared_ptr<WatchReactor>> Watchers() const
      ABSL_LOCKS_EXCLUDED(mu_);

  Membership* const membership_;
  CoordinatorMetrics* const metrics_;
  absl::Notification stop_;
  Collectives collectives_;

  mutable absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<WatchReactor*, std::shared_ptr<WatchReactor>> watchers_
      ABSL_GUARDED_BY(mu_);
  // Last member: started once everything it reads is constructed.
  std::thread notifier_;
};

}  // namespace shardps::coordinator

#endif  // SHARDPS_COORDINATOR_COORDINATOR_SERVICE_H_
