#include "server/ctl/ctl.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/status.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/client_context.h"
#include "grpcpp/generic/generic_stub.h"
#include "shardps/v1/coordinator.grpc.pb.h"
#include "shardps/v1/parameter_server.grpc.pb.h"

namespace shardps::ctl {
namespace {

using ::google::protobuf::internal::WireFormatLite;

constexpr char kHealthCheckMethod[] = "/grpc.health.v1.Health/Check";

std::shared_ptr<grpc::Channel> Channel(const std::string& address,
                                       const SecurityOptions& security) {
  return MakeChannel(address, security, grpc::ChannelArguments());
}

void SetDeadline(grpc::ClientContext* ctx, absl::Duration timeout) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    absl::ToChronoMilliseconds(timeout));
}

// The status of a failed call of `method`, naming the address it went to.
absl::Status CallError(const std::string& address, absl::string_view method,
                       const grpc::Status& s) {
  const absl::Status status = FromGrpcStatus(s);
  std::string message(status.message());
  if (message.empty()) {
    message = status.code() == absl::StatusCode::kUnimplemented
                  ? absl::StrCat("does not serve ", method)
                  : absl::StrCat(method, " failed");
  }
  return WithPrefix(address, absl::Status(status.code(), message));
}

std::string Seconds(int64_t ms) {
  return absl::StrFormat("%.1f s", static_cast<double>(ms) / 1000.0);
}

std::string HumanBytes(uint64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes) / 1024;
  int u = 0;
  while (v >= 1024 && u < 3) {
    v /= 1024;
    ++u;
  }
  return absl::StrFormat("%.1f %s", v, units[u]);
}

std::vector<std::string> MemberRow(const v1::MemberStatus& m) {
  const bool never = m.heartbeat_age_ms() < 0;
  return {m.role() == v1::ROLE_SERVER ? "server" : "worker",
          absl::StrCat(m.index()),
          m.address().empty() ? "-" : m.address(),
          m.alive() ? "alive"
                    : (m.finished() ? "finished" : (never ? "vacant" : "gone")),
          never ? "-" : absl::StrCat(Seconds(m.heartbeat_age_ms()), " ago"),
          never ? "-" : absl::StrCat(m.step()),
          never ? "-" : absl::StrCat(m.epoch())};
}

int CountAlive(const v1::JobStatus& status, v1::Role role) {
  return static_cast<int>(std::count_if(status.members().begin(),
                                        status.members().end(),
                                        [role](const v1::MemberStatus& m) {
                                          return m.role() == role && m.alive();
                                        }));
}

int CountFinished(const v1::JobStatus& status) {
  return static_cast<int>(
      std::count_if(status.members().begin(), status.members().end(),
                    [](const v1::MemberStatus& m) { return m.finished(); }));
}

// Bytes sent or received, with the fp32 bytes they stand for when
// compression made them fewer: "1.0 MiB (4.0 MiB as fp32)".
std::string BytesOnWire(uint64_t wire, uint64_t fp32) {
  if (fp32 == 0 || fp32 == wire) return HumanBytes(wire);
  return absl::StrCat(HumanBytes(wire), " (", HumanBytes(fp32), " as fp32)");
}

}  // namespace

absl::StatusOr<v1::JobStatus> FetchJobStatus(const std::string& coordinator,
                                             const SecurityOptions& security,
                                             absl::Duration timeout) {
  std::unique_ptr<v1::Coordinator::Stub> stub =
      v1::Coordinator::NewStub(Channel(coordinator, security));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, timeout);
  v1::JobStatus status;
  grpc::Status s = stub->GetJobStatus(&ctx, v1::JobStatusRequest(), &status);
  if (!s.ok()) {
    return CallError(coordinator, "shardps.v1.Coordinator/GetJobStatus", s);
  }
  return status;
}

std::string FormatJobStatus(const v1::JobStatus& status) {
  const v1::ClusterView& view = status.view();
  std::string out = absl::StrFormat(
      "job %s  generation %d  protocol %d  uptime %s\n"
      "complete: %s (servers %d/%d alive, workers %d/%d alive)\n"
      "progress: global step %d, epoch %d\n"
      "job state: %s (workers %d/%d finished)\n"
      "heartbeat timeout: %d ms\n\n",
      view.job_id(), view.generation(), status.protocol_version(),
      Seconds(status.uptime_ms()), view.complete() ? "yes" : "no",
      CountAlive(status, v1::ROLE_SERVER), view.num_shards(),
      CountAlive(status, v1::ROLE_WORKER), view.num_workers(),
      view.global_step(), view.epoch(),
      view.job_finished() ? "finished" : "running", CountFinished(status),
      view.num_workers(), status.heartbeat_timeout_ms());
  std::vector<std::vector<std::string>> rows = {
      {"ROLE", "INDEX", "ADDRESS", "STATE", "LAST HEARTBEAT", "STEP", "EPOCH"}};
  std::string stalled;
  for (const v1::MemberStatus& m : status.members()) {
    rows.push_back(MemberRow(m));
    if (!m.stalled().empty()) {
      absl::StrAppend(&stalled, "  server ", m.index(), ": ", m.stalled(),
                      "\n");
    }
  }
  out += FormatTable(rows);
  if (!stalled.empty()) absl::StrAppend(&out, "\nstalled steps:\n", stalled);
  return out;
}

std::string HealthStateName(HealthState state) {
  switch (state) {
    case HealthState::kServing:
      return "SERVING";
    case HealthState::kNotServing:
      return "NOT_SERVING";
    case HealthState::kUnknown:
      break;
  }
  return "UNKNOWN";
}

std::string EncodeHealthCheckRequest(absl::string_view service) {
  std::string bytes;
  if (service.empty()) return bytes;  // proto3 omits default fields
  google::protobuf::io::StringOutputStream raw(&bytes);
  google::protobuf::io::CodedOutputStream out(&raw);
  out.WriteTag(WireFormatLite::MakeTag(
      1, WireFormatLite::WIRETYPE_LENGTH_DELIMITED));  // string service = 1
  out.WriteVarint32(static_cast<uint32_t>(service.size()));
  out.WriteRaw(service.data(), static_cast<int>(service.size()));
  out.Trim();
  return bytes;
}

absl::StatusOr<HealthState> DecodeHealthCheckResponse(absl::string_view bytes) {
  google::protobuf::io::CodedInputStream in(
      reinterpret_cast<const uint8_t*>(bytes.data()),
      static_cast<int>(bytes.size()));
  uint32_t status = 0;  // ServingStatus status = 1; UNKNOWN when absent
  const uint32_t status_tag =
      WireFormatLite::MakeTag(1, WireFormatLite::WIRETYPE_VARINT);
  while (const uint32_t tag = in.ReadTag()) {
    if (tag == status_tag) {
      if (!in.ReadVarint32(&status)) break;
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      break;
    }
  }
  if (!in.ConsumedEntireMessage()) {
    return absl::InvalidArgumentError("malformed HealthCheckResponse");
  }
  if (status == 1) return HealthState::kServing;
  if (status == 2) return HealthState::kNotServing;
  return HealthState::kUnknown;
}

absl::StatusOr<HealthState> CheckHealth(const std::string& address,
                                        const std::string& service,
                                        const SecurityOptions& security,
                                        absl::Duration timeout) {
  grpc::GenericStub stub(Channel(address, security));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, timeout);
  const std::string encoded = EncodeHealthCheckRequest(service);
  grpc::Slice slice(encoded);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::Status status;
  absl::Notification done;
  stub.UnaryCall(&ctx, kHealthCheckMethod, grpc::StubOptions(), &request,
                 &response, [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  // The deadline bounds the call, so this wait ends.
  done.WaitForNotification();
  if (!status.ok()) {
    return CallError(address, "grpc.health.v1.Health/Check", status);
  }
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) {
    return absl::InternalError("cannot read the health response");
  }
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return DecodeHealthCheckResponse(bytes);
}

std::vector<ShardReport> FetchShardReports(
    const std::vector<std::string>& addresses, const SecurityOptions& security,
    absl::Duration timeout) {
  std::vector<ShardReport> reports;
  for (const std::string& address : addresses) {
    std::unique_ptr<v1::ParameterServer::Stub> stub =
        v1::ParameterServer::NewStub(Channel(address, security));
    grpc::ClientContext ctx;
    SetDeadline(&ctx, timeout);
    v1::GetStatusResponse response;
    grpc::Status s = stub->GetStatus(&ctx, v1::GetStatusRequest(), &response);
    ShardReport report{address, std::move(response)};
    if (!s.ok()) {
      report.status =
          CallError(address, "shardps.v1.ParameterServer/GetStatus", s);
    }
    reports.push_back(std::move(report));
  }
  return reports;
}

std::string FormatShardReports(const std::vector<ShardReport>& reports) {
  std::vector<std::vector<std::string>> rows = {
      {"ADDRESS", "SHARD", "WORKERS", "MODE", "GENERATION", "DECLARED",
       "CHUNKS", "OWNED", "VERSIONS", "PUSHES", "UPDATES", "REJECTED",
       "BYTES IN", "BYTES OUT"}};
  for (const ShardReport& r : reports) {
    if (!r.status.ok()) {
      rows.push_back(
          {r.address, absl::StrCat("error: ", r.status.status().ToString())});
      continue;
    }
    const v1::GetStatusResponse& s = *r.status;
    rows.push_back(
        {r.address, absl::StrCat(s.shard_index(), "/", s.num_shards()),
         absl::StrCat(s.num_workers()), s.mode(), absl::StrCat(s.generation()),
         s.declared() ? "yes" : "no", absl::StrCat(s.num_chunks()),
         HumanBytes(s.owned_bytes()),
         absl::StrCat(s.min_version(), "..", s.max_version()),
         absl::StrCat(s.pushes_total()), absl::StrCat(s.updates_total()),
         absl::StrCat(s.rejected_total()),
         BytesOnWire(s.bytes_in_total(), s.bytes_in_fp32_total()),
         BytesOnWire(s.bytes_out_total(), s.bytes_out_fp32_total())});
  }
  return FormatTable(rows);
}

std::string FormatShardLoad(const std::vector<ShardReport>& reports) {
  std::vector<std::vector<std::string>> rows = {
      {"SHARD", "ADDRESS", "STEP", "CHUNKS", "OWNED", "PUSHES", "UPDATES",
       "REJECTED", "BYTES IN", "BYTES OUT", "CHECKPOINT"}};
  std::string errors;
  for (const ShardReport& r : reports) {
    if (!r.status.ok()) {
      rows.push_back({"-", r.address,
                      absl::StrCat("error: ", r.status.status().ToString())});
      continue;
    }
    const v1::GetStatusResponse& s = *r.status;
    std::string checkpoint = "off";
    if (!s.checkpoint_dir().empty()) {
      checkpoint = s.last_committed_checkpoint_step() > 0
                       ? absl::StrCat(s.last_committed_checkpoint_step())
                       : "none";
    }
    rows.push_back(
        {absl::StrCat(s.shard_index(), "/", s.num_shards()), r.address,
         s.min_version() == s.max_version()
             ? absl::StrCat(s.max_version())
             : absl::StrCat(s.min_version(), "..", s.max_version()),
         absl::StrCat(s.num_chunks()), HumanBytes(s.owned_bytes()),
         absl::StrCat(s.pushes_total()), absl::StrCat(s.updates_total()),
         absl::StrCat(s.rejected_total()),
         BytesOnWire(s.bytes_in_total(), s.bytes_in_fp32_total()),
         BytesOnWire(s.bytes_out_total(), s.bytes_out_fp32_total()),
         checkpoint});
    if (s.failed_checkpoint_step() > 0) {
      absl::StrAppend(&errors, "  shard ", s.shard_index(), ": step ",
                      s.failed_checkpoint_step(), ": ", s.checkpoint_error(),
                      "\n");
    }
  }
  std::string out = FormatTable(rows);
  if (!errors.empty()) absl::StrAppend(&out, "\nfailed checkpoints:\n", errors);
  return out;
}

std::vector<std::string> LiveServers(const v1::JobStatus& status) {
  std::vector<std::string> addresses;
  for (const v1::ServerSlot& slot : status.view().servers()) {
    if (slot.alive()) addresses.push_back(slot.address());
  }
  return addresses;
}

absl::StatusOr<std::vector<std::string>> AllServers(
    const v1::JobStatus& status) {
  const v1::ClusterView& view = status.view();
  std::vector<std::string> addresses;
  for (const v1::ServerSlot& slot : view.servers()) {
    if (!slot.alive()) {
      return absl::FailedPreconditionError(
          absl::StrCat("shard ", slot.shard_index(),
                       " has no live server; a checkpoint needs every shard"));
    }
    addresses.push_back(slot.address());
  }
  if (addresses.empty() || addresses.size() != view.num_shards()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the coordinator lists ", addresses.size(), " of ",
                     view.num_shards(), " shards"));
  }
  return addresses;
}

absl::StatusOr<int64_t> NextCheckpointStep(
    const std::vector<ShardReport>& reports, int64_t margin) {
  if (reports.empty()) return absl::InvalidArgumentError("no shards given");
  int64_t top = 0;
  for (const ShardReport& r : reports) {
    if (!r.status.ok()) return r.status.status();
    const v1::GetStatusResponse& s = *r.status;
    if (s.checkpoint_dir().empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shard ", s.shard_index(), " at ", r.address,
          " writes no checkpoints: start the servers with --checkpoint_dir"));
    }
    if (!s.declared()) {
      return absl::FailedPreconditionError(
          absl::StrCat("shard ", s.shard_index(), " at ", r.address,
                       " has no model yet: nothing to checkpoint"));
    }
    top = std::max(top, s.max_version());
  }
  return top + margin;
}

CheckpointWait CheckCheckpoint(const std::vector<ShardReport>& reports,
                               int64_t step) {
  CheckpointWait wait;
  wait.committed = !reports.empty();
  std::vector<std::string> shards;
  for (const ShardReport& r : reports) {
    if (!r.status.ok()) {
      wait.committed = false;
      wait.status = r.status.status();
      return wait;
    }
    const v1::GetStatusResponse& s = *r.status;
    if (s.failed_checkpoint_step() == step) {
      wait.committed = false;
      wait.status = absl::AbortedError(
          absl::StrCat("shard ", s.shard_index(), " at ", r.address,
                       " did not write the checkpoint of step ", step, ": ",
                       s.checkpoint_error()));
      return wait;
    }
    if (s.last_committed_checkpoint_step() < step) wait.committed = false;
    shards.push_back(
        absl::StrCat("shard ", s.shard_index(), " at step ", s.max_version(),
                     s.last_checkpoint_step() >= step ? " (written)" : ""));
  }
  wait.line = absl::StrCat("checkpoint of step ", step, ": ",
                           absl::StrJoin(shards, ", "));
  return wait;
}

namespace {

// ParameterServer.Checkpoint of `step` at one shard.
absl::Status AskCheckpoint(const std::string& address,
                           const SecurityOptions& security,
                           absl::Duration timeout, int64_t step) {
  std::unique_ptr<v1::ParameterServer::Stub> stub =
      v1::ParameterServer::NewStub(Channel(address, security));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, timeout);
  v1::CheckpointRequest request;
  request.set_step(step);
  v1::CheckpointResponse response;
  grpc::Status s = stub->Checkpoint(&ctx, request, &response);
  if (!s.ok())
    return CallError(address, "shardps.v1.ParameterServer/Checkpoint", s);
  return absl::OkStatus();
}

// Asks every shard for `step`, the most advanced first: it is the one that
// may already have passed the step, and a shard that accepted keeps the
// request (its file of that step is left uncommitted, and pruned after the
// next commit). REQUIRES: every report is OK (NextCheckpointStep passed).
absl::Status AskEveryShard(const std::vector<std::string>& servers,
                           const std::vector<ShardReport>& reports,
                           const SecurityOptions& security,
                           absl::Duration timeout, int64_t step) {
  std::vector<size_t> order(servers.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return reports[a].status->max_version() > reports[b].status->max_version();
  });
  for (size_t i : order) {
    SHARDPS_RETURN_IF_ERROR(AskCheckpoint(servers[i], security, timeout, step));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CheckpointResult> Checkpoint(
    const std::vector<std::string>& servers, const SecurityOptions& security,
    const CheckpointOptions& options,
    const std::function<void(const std::string&)>& progress) {
  auto tell = [&](const std::string& line) {
    if (progress) progress(line);
  };
  const absl::Time deadline = absl::Now() + options.wait;
  std::vector<ShardReport> reports =
      FetchShardReports(servers, security, options.rpc_timeout);
  // A picked step a fast job has already passed is picked again, further
  // ahead each time.
  constexpr int kAttempts = 5;
  int64_t step = options.step;
  for (int attempt = 1, margin = 2;; ++attempt, margin *= 2) {
    SHARDPS_ASSIGN_OR_RETURN(const int64_t next,
                             NextCheckpointStep(reports, margin));
    if (options.step == 0) step = next;
    const absl::Status asked =
        AskEveryShard(servers, reports, security, options.rpc_timeout, step);
    if (asked.ok()) break;
    if (!absl::IsOutOfRange(asked) || options.step != 0 ||
        attempt == kAttempts) {
      return asked;
    }
    tell(absl::StrCat("step ", step,
                      " was reached before every shard was asked; asking "
                      "for a later step"));
    reports = FetchShardReports(servers, security, options.rpc_timeout);
  }
  const std::string dir = reports.front().status->checkpoint_dir();
  tell(absl::StrCat("asked ", servers.size(),
                    " shard(s) for a checkpoint of step ", step, " in ", dir));
  // A poll a shard does not answer may be a blip; three in a row are not.
  constexpr int kMissedPolls = 3;
  int missed = 0;
  std::string told;
  absl::Time told_at = absl::InfinitePast();
  while (true) {
    reports = FetchShardReports(servers, security, options.rpc_timeout);
    const CheckpointWait wait = CheckCheckpoint(reports, step);
    if (wait.committed) return CheckpointResult{step, dir};
    if (absl::IsAborted(wait.status)) return wait.status;
    missed = wait.status.ok() ? 0 : missed + 1;
    if (missed == kMissedPolls) return wait.status;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the checkpoint of step ", step, " was not committed within ",
          absl::FormatDuration(options.wait), "; ", wait.line));
    }
    // At most one line a second, and only when something moved.
    if (!wait.line.empty() && wait.line != told &&
        absl::Now() - told_at >= absl::Seconds(1)) {
      tell(wait.line);
      told = wait.line;
      told_at = absl::Now();
    }
    absl::SleepFor(options.poll_interval);
  }
}

std::string FormatTable(const std::vector<std::vector<std::string>>& rows) {
  if (rows.empty()) return "";
  const size_t columns = rows[0].size();
  std::vector<size_t> width(columns, 0);
  for (const std::vector<std::string>& row : rows) {
    // A short row's last cell (an error message) does not widen its column.
    const size_t sized = row.size() < columns ? row.size() - 1 : columns;
    for (size_t c = 0; c < sized && c < row.size(); ++c) {
      width[c] = std::max(width[c], row[c].size());
    }
  }
  std::string out;
  for (const std::vector<std::string>& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) {
      out += row[c];
      if (c + 1 < row.size() && c < columns) {
        out.append(width[c] + 2 - row[c].size(), ' ');
      }
    }
    out += "\n";
  }
  return out;
}

}  // namespace shardps::ctl
