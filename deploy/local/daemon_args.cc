#include "deploy/local/daemon_args.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "deploy/local/emulated_hosts.h"

namespace shardps::local {

std::vector<std::string> CoordinatorArgs(const LaunchOptions& o,
                                         const RunDir& dir, int port) {
  std::vector<std::string> args = {
      absl::StrCat("--num_servers=", o.num_servers),
      absl::StrCat("--num_workers=", o.num_workers),
      absl::StrCat("--port=", port),
      absl::StrCat("--port_file=", dir.PortPath("coordinator")),
      absl::StrCat("--log_format=", o.log_format)};
  if (o.emulate_hosts) {
    args.push_back(absl::StrCat("--host=", DaemonHost(o, "coordinator")));
  }
  args.insert(args.end(), o.security_args.begin(), o.security_args.end());
  return args;
}

std::vector<std::string> ServerArgs(const LaunchOptions& o, const RunDir& dir,
                                    int index, const std::string& coordinator) {
  // The index is given even with a coordinator, so that server-i's log is
  // shard i's; the job's shape comes from the coordinator.
  std::vector<std::string> args = {absl::StrCat("--shard_index=", index)};
  if (coordinator.empty()) {
    args.push_back(absl::StrCat("--num_shards=", o.num_servers));
    args.push_back(absl::StrCat("--num_workers=", o.num_workers));
  } else {
    args.push_back(absl::StrCat("--coordinator=", coordinator));
  }
  args.push_back(absl::StrCat("--mode=", o.mode));
  if (!o.checkpoint_dir.empty()) {
    args.push_back(absl::StrCat("--checkpoint_dir=", o.checkpoint_dir));
    args.push_back(
        absl::StrCat("--checkpoint_every_steps=", o.checkpoint_every_steps));
    args.push_back(absl::StrCat("--keep_checkpoints=", o.keep_checkpoints));
  }
  args.push_back("--port=0");
  args.push_back(absl::StrCat("--port_file=",
                              dir.PortPath(absl::StrCat("server-", index))));
  args.push_back(absl::StrCat("--log_format=", o.log_format));
  if (o.emulate_hosts) {
    // Binding its host's address is also what it advertises to workers.
    args.push_back(
        absl::StrCat("--host=", DaemonHost(o, absl::StrCat("server-", index))));
    // Hosts share this machine's /proc; machines would not.
    args.push_back("--shared_memory=false");
    // Sizes the TCP receive buffers of its workers' connections.
    args.push_back(absl::StrCat("--link_rate=", o.link_bits_per_second, "bit"));
  }
  args.insert(args.end(), o.security_args.begin(), o.security_args.end());
  return args;
}

std::vector<std::string> WorkerArgs(const LaunchOptions& o, const RunDir& dir,
                                    int rank, const std::string& coordinator,
                                    const std::vector<std::string>& servers) {
  // The rank is given even with a coordinator: worker-0 is rank 0, whose log
  // the launcher relays.
  std::vector<std::string> args = {absl::StrCat("--rank=", rank)};
  if (coordinator.empty()) {
    args.push_back(absl::StrCat("--servers=", absl::StrJoin(servers, ",")));
    args.push_back(absl::StrCat("--num_workers=", o.num_workers));
  } else {
    args.push_back(absl::StrCat("--coordinator=", coordinator));
  }
  bool link_rate_given = false;
  for (const std::string& arg : o.training_args) {
    // Hosts share this machine's /proc; machines would not.
    if (o.emulate_hosts && absl::StartsWith(arg, "--shared_memory=")) continue;
    if (absl::StartsWith(arg, "--link_rate=")) {
      if (arg == "--link_rate=") continue;  // not given
      link_rate_given = true;
    }
    args.push_back(arg);
  }
  if (o.emulate_hosts) {
    args.push_back("--shared_memory=false");
    // The links' rate sizes automatic chunks, unless the user gave one.
    if (!link_rate_given) {
      args.push_back(
          absl::StrCat("--link_rate=", o.link_bits_per_second, "bit"));
    }
  }
  // Every worker gets the output paths: only the lead writes them (rank 0,
  // or with a coordinator the lowest rank left, which takes over when rank 0
  // dies), so one file has one writer at a time.
  args.push_back(absl::StrCat("--metrics_csv=", dir.MetricsPath()));
  args.push_back(absl::StrCat("--model_out=", dir.ModelPath()));
  args.push_back(absl::StrCat("--log_format=", o.log_format));
  args.insert(args.end(), o.security_args.begin(), o.security_args.end());
  args.insert(args.end(), o.worker_extra_args.begin(),
              o.worker_extra_args.end());
  return args;
}

}  // namespace shardps::local
