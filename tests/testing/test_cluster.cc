#include "tests/testing/test_cluster.h"

#include <signal.h>
#include <sys/stat.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/testing/e2e.h"

namespace shardps::testing {

bool HaveFashionMnist() {
  struct stat st;
  return stat(kFashionMnist, &st) == 0;
}

TestCluster::TestCluster(ClusterOptions options)
    : options_(std::move(options)), dir_(MakeTempDir("shardps-cluster")) {}

TestCluster::~TestCluster() {
  // Workers first, so that no server is stopped under a training worker.
  for (Member& w : workers_) w.daemon.reset();
  for (Member& s : servers_) s.daemon.reset();
  coordinator_.daemon.reset();
}

Daemon* TestCluster::StartMember(Member* member) {
  absl::StatusOr<std::unique_ptr<Daemon>> d =
      member->await == Await::kPort
          ? Daemon::Start(member->name, member->binary, member->args,
                          absl::Seconds(30), dir_)
          : Daemon::StartProcess(member->name, member->binary, member->args,
                                 dir_);
  member->daemon = Must(std::move(d));
  return member->daemon.get();
}

Daemon* TestCluster::StartCoordinator(std::vector<std::string> flags) {
  coordinator_.name = "coordinator";
  coordinator_.binary = SHARDPS_COORDINATOR_BIN;
  coordinator_.args = {absl::StrCat("--job_id=", options_.job_id),
                       absl::StrCat("--num_servers=", options_.num_servers),
                       absl::StrCat("--num_workers=", options_.num_workers)};
  if (options_.coordinator_port > 0) {
    coordinator_.args.push_back(
        absl::StrCat("--port=", options_.coordinator_port));
  }
  coordinator_.args.insert(coordinator_.args.end(),
                           options_.coordinator_flags.begin(),
                           options_.coordinator_flags.end());
  coordinator_.args.insert(coordinator_.args.end(), flags.begin(), flags.end());
  return StartMember(&coordinator_);
}

Daemon* TestCluster::StartServer(std::vector<std::string> flags, Await await) {
  Member m;
  const int index = num_servers();
  m.name = absl::StrCat("server-", index);
  m.binary = SHARDPS_SERVER_BIN;
  m.await = await;
  if (options_.coordinated) {
    m.args = {absl::StrCat("--job_id=", options_.job_id),
              "--coordinator=" + coordinator_address()};
  } else {
    m.args = {absl::StrCat("--shard_index=", index),
              absl::StrCat("--num_shards=", options_.num_servers),
              absl::StrCat("--num_workers=", options_.num_workers)};
  }
  if (!options_.mode.empty()) m.args.push_back("--mode=" + options_.mode);
  if (!options_.checkpoint_dir.empty()) {
    m.args.push_back("--checkpoint_dir=" + options_.checkpoint_dir);
  }
  if (options_.checkpoint_every_steps > 0) {
    m.args.push_back(absl::StrCat("--checkpoint_every_steps=",
                                  options_.checkpoint_every_steps));
  }
  m.args.insert(m.args.end(), options_.server_flags.begin(),
                options_.server_flags.end());
  m.args.insert(m.args.end(), flags.begin(), flags.end());
  servers_.push_back(std::move(m));
  return StartMember(&servers_.back());
}

Daemon* TestCluster::StartWorker(std::vector<std::string> flags) {
  Member m;
  const int rank = num_workers();
  m.name = absl::StrCat("worker-", rank);
  m.binary = SHARDPS_WORKER_BIN;
  m.await = Await::kStart;
  if (options_.coordinated) {
    m.args = {absl::StrCat("--job_id=", options_.job_id),
              "--coordinator=" + coordinator_address()};
  } else {
    m.args = {servers_flag(), absl::StrCat("--rank=", rank),
              absl::StrCat("--num_workers=", options_.num_workers)};
  }
  m.args.insert(m.args.end(), options_.worker_flags.begin(),
                options_.worker_flags.end());
  m.args.insert(m.args.end(), flags.begin(), flags.end());
  workers_.push_back(std::move(m));
  return StartMember(&workers_.back());
}

bool TestCluster::StartServers() {
  for (int s = 0; s < options_.num_servers; ++s) {
    if (StartServer() == nullptr) return false;
  }
  return true;
}

bool TestCluster::StartWorkers(
    const std::vector<std::vector<std::string>>& rank_flags) {
  for (int r = 0; r < options_.num_workers; ++r) {
    const size_t i = static_cast<size_t>(r);
    if (StartWorker(i < rank_flags.size()
                        ? rank_flags[i]
                        : std::vector<std::string>()) == nullptr) {
      return false;
    }
  }
  return true;
}

bool TestCluster::Start() {
  if (options_.coordinated && StartCoordinator() == nullptr) return false;
  return StartServers() && StartWorkers();
}

TestCluster::Member* TestCluster::Find(const Daemon* daemon) {
  if (coordinator_.daemon.get() == daemon) return &coordinator_;
  for (std::vector<Member>* role : {&servers_, &workers_}) {
    for (Member& m : *role) {
      if (m.daemon.get() == daemon) return &m;
    }
  }
  return nullptr;
}

absl::Status TestCluster::Kill(Daemon* member) {
  Member* m = member == nullptr ? nullptr : Find(member);
  if (m == nullptr) {
    return absl::NotFoundError("the daemon to kill is not of this cluster");
  }
  m->killed = true;
  absl::StatusOr<int> code = member->Stop(SIGKILL, absl::Seconds(10));
  return code.ok() ? absl::OkStatus() : code.status();
}

Daemon* TestCluster::Restart(Daemon* member) {
  Member* m = member == nullptr ? nullptr : Find(member);
  if (m == nullptr) {
    ADD_FAILURE() << "the daemon to restart is not of this cluster";
    return nullptr;
  }
  if (member->port() > 0) {
    m->args.push_back(absl::StrCat("--port=", member->port()));
  }
  m->restarts += 1;
  m->killed = false;
  const std::string name = m->name;
  m->name = absl::StrCat(name, "-restart-", m->restarts);
  Daemon* again = StartMember(m);
  m->name = name;
  return again;
}

absl::StatusOr<std::vector<int>> TestCluster::WaitForWorkers(
    absl::Duration timeout) {
  std::vector<int> codes;
  for (Member& w : workers_) {
    if (w.daemon == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat(w.name, " not started"));
    }
    absl::StatusOr<int> code = w.daemon->Wait(timeout);
    if (!code.ok()) {
      return absl::DeadlineExceededError(absl::StrCat(
          w.name, " still runs after ", absl::FormatDuration(timeout), ":\n",
          w.daemon->ReadLog()));
    }
    codes.push_back(*code);
  }
  return codes;
}

absl::Status TestCluster::WorkersSucceed(absl::Duration timeout) {
  absl::StatusOr<std::vector<int>> codes = WaitForWorkers(timeout);
  if (!codes.ok()) return codes.status();
  for (size_t r = 0; r < codes->size(); ++r) {
    if ((*codes)[r] != 0) {
      return absl::InternalError(absl::StrCat(workers_[r].name, " exited with ",
                                              (*codes)[r], ":\n",
                                              workers_[r].daemon->ReadLog()));
    }
  }
  return absl::OkStatus();
}

void TestCluster::ExpectWorkersExitZero(absl::Duration timeout) {
  for (Member& w : workers_) {
    if (!w.killed) ExpectExitsZero(w.daemon.get(), timeout);
  }
}

void TestCluster::ExpectJobEnds(absl::Duration timeout,
                                absl::Duration self_exit_timeout) {
  ExpectWorkersExitZero(timeout);
  for (Member& s : servers_) {
    if (!s.killed) ExpectExitsZero(s.daemon.get(), self_exit_timeout);
  }
  if (!coordinator_.name.empty() && !coordinator_.killed) {
    ExpectExitsZero(coordinator_.daemon.get(), self_exit_timeout);
  }
}

absl::StatusOr<std::vector<LoadedTensor>> TestCluster::ReadModel() const {
  return ReadSafetensors(model_path());
}

std::string TestCluster::ModelBytes() const { return ReadFile(model_path()); }

std::string TestCluster::coordinator_address() const {
  if (coordinator_.daemon != nullptr) return coordinator_.daemon->address();
  return absl::StrCat("127.0.0.1:", options_.coordinator_port);
}

std::vector<std::string> TestCluster::server_addresses() const {
  std::vector<std::string> addresses;
  for (const Member& s : servers_) {
    if (s.daemon != nullptr) addresses.push_back(s.daemon->address());
  }
  return addresses;
}

std::string TestCluster::servers_flag() const {
  return "--servers=" + absl::StrJoin(server_addresses(), ",");
}

std::string TestCluster::FinalLine(const Daemon& member) {
  std::string last;
  for (absl::string_view line : absl::StrSplit(member.ReadLog(), '\n')) {
    if (!line.empty()) last = std::string(line);
  }
  return last;
}

}  // namespace shardps::testing
