#include "server/ctl.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "common/grpc_status.h"
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
  return absl::Status(status.code(), absl::StrCat(address, ": ", message));
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
         absl::StrCat(s.rejected_total()), HumanBytes(s.bytes_in_total()),
         HumanBytes(s.bytes_out_total())});
  }
  return FormatTable(rows);
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
