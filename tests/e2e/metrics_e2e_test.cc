// Prometheus metrics of a running job: a coordinator, a server and two
// workers, every daemon with --metrics_port=0, scraped over HTTP while the
// workers train. The expositions parse (and pass `promtool check metrics`
// where promtool is installed), counters move between two scrapes, and the
// gauges agree with the job. Also: a metrics port already in use is a
// one-line error naming --metrics_port and exit code 1, for every daemon.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon.h"
#include "tests/testing/e2e.h"
#include "tests/testing/exposition.h"
#include "tests/testing/http_get.h"
#include "tests/testing/test_cluster.h"

namespace shardps {
namespace {

using ::shardps::testing::ClusterOptions;
using ::shardps::testing::CommandResult;
using ::shardps::testing::Daemon;
using ::shardps::testing::HttpGet;
using ::shardps::testing::MustRun;
using ::shardps::testing::ParseExposition;
using ::shardps::testing::SampleOr;
using ::shardps::testing::Samples;
using ::shardps::testing::TestCluster;
using ::shardps::testing::WaitForPortFile;

// Waits allow a loaded 2-core machine; none is a timing assertion.
constexpr absl::Duration kWait = absl::Seconds(120);

// The flags that serve metrics on a free port, reported in `port_file`.
std::vector<std::string> MetricsArgs(const std::string& port_file) {
  return {"--metrics_port=0", "--metrics_port_file=" + port_file};
}

// Runs `promtool check metrics` on `text`; "" when it passes or promtool is
// not installed (then *skipped is set), else what promtool said.
std::string Promtool(const std::string& text, const std::string& dir,
                     bool* skipped) {
  if (std::system("command -v promtool >/dev/null 2>&1") != 0) {
    *skipped = true;
    return "";
  }
  const std::string in = dir + "/exposition.txt";
  const std::string out = dir + "/promtool.out";
  std::ofstream(in) << text;
  const int rc = std::system(
      absl::StrCat("promtool check metrics < ", in, " > ", out, " 2>&1")
          .c_str());
  if (rc == 0) return "";
  std::ifstream result(out);
  std::stringstream ss;
  ss << result.rdbuf();
  return absl::StrCat("promtool exit ", rc, ": ", ss.str());
}

// Scrapes /metrics on `port` and parses it; empty samples (and a test
// failure) when either fails.
Samples Scrape(int port, std::string* text = nullptr) {
  absl::StatusOr<std::string> body = HttpGet(port, "/metrics");
  EXPECT_TRUE(body.ok()) << body.status();
  if (!body.ok()) return {};
  absl::StatusOr<Samples> samples = ParseExposition(*body);
  EXPECT_TRUE(samples.ok()) << samples.status() << "\n" << *body;
  if (text != nullptr) *text = *body;
  return samples.ok() ? *samples : Samples();
}

// Scrapes until `series` reaches at least `at_least`; the last scrape.
Samples ScrapeUntil(int port, const std::string& series, double at_least) {
  const absl::Time deadline = absl::Now() + kWait;
  Samples s = Scrape(port);
  while (SampleOr(s, series) < at_least && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
    s = Scrape(port);
  }
  EXPECT_GE(SampleOr(s, series), at_least) << series;
  return s;
}

TEST(MetricsE2eTest, CountersMoveAndGaugesMatchTheJob) {
  const std::string dir = ::shardps::testing::MakeTempDir("metrics_e2e");
  ClusterOptions o;
  o.coordinated = true;
  o.job_id = "metrics";
  o.num_workers = 2;
  // Heartbeats every half second (a third of the timeout).
  o.coordinator_flags = {"--heartbeat_timeout_ms=1500"};
  o.checkpoint_dir = dir + "/ckpt";
  o.checkpoint_every_steps = 5;
  // Slow steps keep the job running while the test scrapes it.
  o.worker_flags = {"--dataset=fashion-mnist", "--model=mlp:784-32-10",
                    "--train_limit=4096", "--test_limit=100", "--batch_size=32",
                    "--max_steps=120", "--fault_step_delay_ms=25",
                    "--backend=cpu",
                    // Two-phase steps under a bound no norm reaches, over
                    // gRPC (speculative weights are asked over the network
                    // only): every speculative update is kept.
                    "--clip_grad_norm=1000", "--shared_memory=false"};
  TestCluster job(std::move(o));
  ASSERT_NE(job.StartCoordinator(MetricsArgs(dir + "/coordinator.mport")),
            nullptr);
  ASSERT_NE(job.StartServer(MetricsArgs(dir + "/server.mport")), nullptr);
  for (int r = 0; r < 2; ++r) {
    std::vector<std::string> args =
        MetricsArgs(absl::StrCat(dir, "/worker", r, ".mport"));
    args.push_back(absl::StrCat("--rank=", r));
    ASSERT_NE(job.StartWorker(args), nullptr);
  }
  Daemon* coordinator = &job.coordinator();
  Daemon* server = &job.server(0);
  Daemon* worker = &job.worker(0);
  const int coordinator_port =
      WaitForPortFile(dir + "/coordinator.mport", kWait);
  const int server_port = WaitForPortFile(dir + "/server.mport", kWait);
  const int worker_port = WaitForPortFile(dir + "/worker0.mport", kWait);
  ASSERT_GT(coordinator_port, 0) << coordinator->ReadLog();
  ASSERT_GT(server_port, 0) << server->ReadLog();
  ASSERT_GT(worker_port, 0) << worker->ReadLog();

  // Two scrapes of each, at least ten steps apart.
  const Samples w1 = ScrapeUntil(worker_port, "shardps_worker_steps_total", 5);
  const Samples s1 = Scrape(server_port);
  const double steps1 = SampleOr(w1, "shardps_worker_steps_total");
  const Samples w2 =
      ScrapeUntil(worker_port, "shardps_worker_steps_total", steps1 + 10);
  std::string server_text;
  const Samples s2 = Scrape(server_port, &server_text);
  std::string coordinator_text;
  const Samples c2 =
      ScrapeUntil(coordinator_port, "shardps_coordinator_heartbeats_total", 1);
  Scrape(coordinator_port, &coordinator_text);

  for (const char* counter :
       {"shardps_server_pushes_total", "shardps_server_received_bytes_total",
        "shardps_server_sent_bytes_total",
        "shardps_server_aggregation_seconds_count",
        "shardps_server_step_seconds_count"}) {
    EXPECT_GT(SampleOr(s2, counter), SampleOr(s1, counter)) << counter;
  }
  for (const char* counter :
       {"shardps_worker_steps_total", "shardps_worker_samples_total",
        "shardps_worker_pushed_bytes_total",
        "shardps_worker_pulled_bytes_total",
        "shardps_worker_step_seconds_count"}) {
    EXPECT_GT(SampleOr(w2, counter), SampleOr(w1, counter)) << counter;
  }
  // 32 samples per step, 16 on each worker.
  EXPECT_EQ(SampleOr(w2, "shardps_worker_samples_total"),
            16 * SampleOr(w2, "shardps_worker_steps_total"));
  EXPECT_EQ(SampleOr(w2, "shardps_worker_step"),
            SampleOr(w2, "shardps_worker_steps_total"));
  EXPECT_GT(SampleOr(w2, "shardps_worker_loss"), 0);

  // The server's step follows the workers'; its view matches the
  // coordinator's.
  EXPECT_GE(SampleOr(s2, "shardps_server_step"), steps1);
  EXPECT_GT(SampleOr(s2, "shardps_server_step"),
            SampleOr(s1, "shardps_server_step"));
  EXPECT_EQ(SampleOr(s2, "shardps_server_live_workers"), 2);
  // The default receive budget, 256 MiB, of which the job's reads took some.
  EXPECT_EQ(SampleOr(s2, "shardps_server_receive_budget_bytes"), 256 << 20);
  EXPECT_GT(SampleOr(s2, "shardps_server_receive_budget_peak_bytes"), 0);
  EXPECT_GE(SampleOr(s2, "shardps_server_receive_budget_waited_reads"), 0);
  const std::string kept =
      "shardps_server_speculative_updates_total{outcome=\"kept\"}";
  EXPECT_GT(SampleOr(s2, kept), SampleOr(s1, kept));
  EXPECT_EQ(SampleOr(s2,
                     "shardps_server_speculative_updates_total{outcome="
                     "\"recomputed\"}"),
            0);
  EXPECT_EQ(SampleOr(c2, "shardps_coordinator_members{role=\"worker\"}"), 2);
  EXPECT_EQ(SampleOr(c2, "shardps_coordinator_members{role=\"server\"}"), 1);
  EXPECT_GE(SampleOr(c2, "shardps_coordinator_generation"), 4);  // 3 joins
  EXPECT_EQ(SampleOr(s2, "shardps_server_generation"),
            SampleOr(c2, "shardps_coordinator_generation"));
  EXPECT_EQ(
      SampleOr(c2,
               "shardps_coordinator_membership_events_total{event=\"joined\"}"),
      3);

  // One server: it commits every checkpoint it writes.
  const Samples s3 =
      ScrapeUntil(server_port, "shardps_checkpoint_last_committed_step", 5);
  EXPECT_GT(SampleOr(s3, "shardps_checkpoint_duration_seconds_count"), 0);
  EXPECT_GT(SampleOr(s3, "shardps_checkpoint_bytes_total"), 0);

  std::string worker_text;
  Scrape(worker_port, &worker_text);
  bool skipped = false;
  for (const std::string* text :
       {&server_text, &coordinator_text, &worker_text}) {
    EXPECT_EQ(Promtool(*text, dir, &skipped), "") << *text;
  }
  if (skipped) std::cerr << "promtool not installed: check skipped\n";

  job.ExpectWorkersExitZero(kWait);
}

// Listens on a free port of 127.0.0.1 until destroyed.
class TakenPort {
 public:
  TakenPort() : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (bind(fd_, reinterpret_cast<sockaddr*>(&addr), len) == 0 &&
        listen(fd_, 1) == 0 &&
        getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      port_ = ntohs(addr.sin_port);
    }
  }
  ~TakenPort() { close(fd_); }
  int port() const { return port_; }

 private:
  const int fd_;
  int port_ = 0;
};

TEST(MetricsE2eTest, TakenMetricsPortIsAClearErrorForEveryDaemon) {
  TakenPort taken;
  ASSERT_GT(taken.port(), 0);
  const std::string flag = absl::StrCat("--metrics_port=", taken.port());
  struct Case {
    std::string name;
    std::string binary;
    std::vector<std::string> args;
  };
  const std::vector<Case> cases = {
      {"coordinator", SHARDPS_COORDINATOR_BIN, {flag}},
      {"server", SHARDPS_SERVER_BIN, {flag}},
      {"worker", SHARDPS_WORKER_BIN, {flag, "--servers=127.0.0.1:1"}},
      {"server-bad-value", SHARDPS_SERVER_BIN, {"--metrics_port=-2"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const CommandResult r = MustRun(c.binary, c.args, kWait);
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_TRUE(absl::StrContains(r.output, "--metrics_port=")) << r.output;
  }
}

}  // namespace
}  // namespace shardps
