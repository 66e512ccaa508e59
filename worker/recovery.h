// How a worker of a coordinated job gets back in step with the job: a worker
// new to a running job joins it at an epoch start; after a refused push it
// waits for the job's rollback to a checkpoint (every shard reset) and takes
// the weights, or joins again when the servers dropped it. It asks the shards
// where they are by declaring again (Client::Redeclare) and the coordinator's
// view through a function. Used by the Trainer; thread-compatible.
#ifndef SHARDPS_WORKER_RECOVERY_H_
#define SHARDPS_WORKER_RECOVERY_H_

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/client.h"

namespace shardps::worker {

// How long recovery waits, and how often it looks.
struct RecoveryOptions {
  // Until every shard has reset to a rollback's step. A shard restores the
  // checkpoint before it serves again, which takes seconds; one that has
  // not after this long is not coming back by itself.
  absl::Duration rollback_timeout = absl::Seconds(120);
  // How long the shards may keep failing (restarting, restoring) while a
  // worker waits for the job to reach its join step: a restart with a
  // restore takes well under it, and a joining worker has nothing else to do.
  absl::Duration shard_away_timeout = absl::Minutes(5);
  // After a refused push, how long the coordinator's view may take to show
  // the rollback or the drop that explains it: the view trails the shards'
  // refusal by a heartbeat or two.
  absl::Duration explanation_timeout = absl::Seconds(30);
  // How often a worker waiting for its join step declares it again, for a
  // shard that restarted and lost it (a no-op on the others).
  absl::Duration redeclare_join_every = absl::Seconds(2);
  // How often a waiting worker logs what it waits for.
  absl::Duration log_every = absl::Seconds(10);
  // How often the shards are asked while waiting: a sync step takes
  // milliseconds, and every worker of the job waits on the slowest to go on.
  absl::Duration shard_poll = absl::Milliseconds(20);
  // How often the coordinator's view is read while waiting for a refusal's
  // explanation (a local read: heartbeats refresh it).
  absl::Duration view_poll = absl::Milliseconds(100);
};

// The job's newest rollback as (rollback id, step): ClusterView.rollback_id
// and rollback_step.
using RollbackNews = std::function<std::pair<uint64_t, int64_t>()>;

// The first epoch start at or after `step`, at most `total_steps`: where a
// worker joins, so that every worker splits an epoch's batches over the
// workers there at its start.
int64_t EpochStartAtOrAfter(int64_t step, int64_t steps_per_epoch,
                            int64_t total_steps);

// The smallest version over the shards' answers (0 for none).
int64_t MinVersion(const std::vector<v1::DeclareResponse>& shards);

// Whether the shards combine pushes synchronously (sync mode, or no answer
// that says otherwise).
bool IsSync(const std::vector<v1::DeclareResponse>& shards);

// Where the shards stand with rollback `id` to `step`.
struct RollbackProgress {
  bool applied = false;  // every shard has applied it (or a later one)
  // Every shard's versions are back at `step` (sync mode; async and ssp
  // versions count every update, so there only `applied` tells).
  bool there = false;
};
RollbackProgress RollbackProgressOf(
    const std::vector<v1::DeclareResponse>& shards, uint64_t id, int64_t step,
    bool sync);

// The ranks sharing the global batch now, ascending, `self` included: those
// the shards wait for at their current step (joins and leaves as the
// servers applied them; asked with Client::Redeclare), else `view_ranks()`
// (the coordinator's view; may be empty), else every rank of
// `num_workers`.
std::vector<uint32_t> RanksSharingTheBatch(
    Client* client, const std::function<std::vector<uint32_t>()>& view_ranks,
    uint32_t num_workers, uint32_t self);

class Recovery {
 public:
  // `client` must outlive this; `weights` are the trainer's buffers that a
  // recovered worker pulls the job's weights into. `rollback` empty: the job
  // never rolls back. `rejoin_when_dropped`: a worker the servers dropped
  // joins again instead of failing (with a coordinator).
  Recovery(RecoveryOptions options, Client* client, Tensors weights,
           int64_t steps_per_epoch, int64_t total_steps, RollbackNews rollback,
           bool rejoin_when_dropped);
  // The same with the buffers asked for at each use (they may move, as
  // Client::WeightBuffers() do).
  Recovery(RecoveryOptions options, Client* client,
           std::function<Tensors()> weights, int64_t steps_per_epoch,
           int64_t total_steps, RollbackNews rollback,
           bool rejoin_when_dropped);

  // After the first Client::Declare: notes the job's consistency mode and
  // the rollback the job is at (later pushes say they know of it).
  void Start();

  // A worker new to a running job (Client::must_join): declares the first
  // epoch start the servers have not passed as its join step, waits for the
  // job to get there and returns that step.
  absl::StatusOr<int64_t> JoinRunningJob();

  // After the push of step `at` failed with `why`: when the job rolled
  // back, the rollback's step once every shard is there (the weights
  // pulled); when the servers dropped this worker, declares again and
  // returns the epoch start it joins at; otherwise (or when neither shows
  // within explanation_timeout) returns `why`. An INVALID_ARGUMENT `why`
  // (the request itself was refused: ranks that disagree on a step's
  // learning rate, a gradient the shard cannot take) is returned at once:
  // no rollback or drop explains it.
  absl::StatusOr<int64_t> Recover(const absl::Status& why, int64_t at);

  // The step this worker joined a running job at; -1 when it did not.
  int64_t join_step() const { return join_step_; }

 private:
  // Waits until every shard applied rollback `id` to `step`, then takes the
  // weights (true). False when every shard applied it long ago (it needed
  // no reset, or the job moved on): nothing to go back to. `at`: the step
  // this worker was at.
  absl::StatusOr<bool> AwaitRollback(uint64_t id, int64_t step, int64_t at);
  // Waits until every chunk of every shard is at `step` at least, declaring
  // the join at `step` again now and then; tolerates shards that are away
  // for up to shard_away_timeout.
  absl::Status AwaitJobAt(int64_t step);
  void SeeRollback(uint64_t id);

  const RecoveryOptions options_;
  Client* const client_;
  const std::function<Tensors()> weights_;
  const int64_t steps_per_epoch_;
  const int64_t total_steps_;
  const RollbackNews rollback_;
  const bool rejoin_when_dropped_;
  bool sync_ = true;            // the shards' consistency mode is sync
  uint64_t seen_rollback_ = 0;  // the last rollback id acted on
  int64_t join_step_ = -1;
};

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_RECOVERY_H_
