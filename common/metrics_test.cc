#include "common/metrics.h"

#include <atomic>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "tests/testing/exposition.h"
#include "tests/testing/http_get.h"

namespace shardps {
namespace {

using ::shardps::testing::HttpGet;
using ::shardps::testing::ParseExposition;
using ::shardps::testing::Samples;

prometheus::Counter& TestCounter(MetricsExporter* exporter) {
  return prometheus::BuildCounter()
      .Name("shardps_test_events_total")
      .Help("Events counted by the test.")
      .Register(exporter->registry())
      .Add({});
}

TEST(MetricsExporterTest, ServesTheRegistryOnAPortTheKernelPicked) {
  absl::StatusOr<std::unique_ptr<MetricsExporter>> exporter =
      MetricsExporter::Serve("127.0.0.1", 0);
  SHARDPS_ASSERT_OK(exporter);
  ASSERT_GT((*exporter)->port(), 0);
  TestCounter(exporter->get()).Increment(3);
  prometheus::BuildHistogram()
      .Name("shardps_test_wait_seconds")
      .Help("Waits.")
      .Register((*exporter)->registry())
      .Add({}, LatencyBuckets())
      .Observe(0.002);

  absl::StatusOr<std::string> body = HttpGet((*exporter)->port(), "/metrics");
  SHARDPS_ASSERT_OK(body);
  absl::StatusOr<Samples> samples = ParseExposition(*body);
  SHARDPS_ASSERT_OK(samples);
  EXPECT_EQ(samples->at("shardps_test_events_total"), 3);
  EXPECT_EQ(samples->at("shardps_test_wait_seconds_count"), 1);
  EXPECT_EQ(samples->at("shardps_test_wait_seconds_bucket{le=\"0.0025\"}"), 1);
  EXPECT_EQ(samples->at("shardps_test_wait_seconds_bucket{le=\"0.001\"}"), 0);
  // The endpoint adds its own exposer_* metrics to what Scrape() returns.
  absl::StatusOr<Samples> direct = ParseExposition((*exporter)->Scrape());
  SHARDPS_ASSERT_OK(direct);
  for (const auto& [series, value] : *direct) {
    EXPECT_EQ(samples->count(series), 1) << series;
  }
}

TEST(MetricsExporterTest, TakenPortIsUnavailableNamingTheFlag) {
  absl::StatusOr<std::unique_ptr<MetricsExporter>> first =
      MetricsExporter::Serve("127.0.0.1", 0);
  SHARDPS_ASSERT_OK(first);
  absl::StatusOr<std::unique_ptr<MetricsExporter>> second =
      MetricsExporter::Serve("127.0.0.1", (*first)->port());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(second.status().message(), "--metrics_port="))
      << second.status();
}

TEST(MetricsExporterTest, RejectsBadPortsAndHosts) {
  EXPECT_EQ(MetricsExporter::Serve("127.0.0.1", 70000).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MetricsExporter::Serve("no-such-host.invalid", 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MetricsExporterTest, ResolvesHostNames) {
  absl::StatusOr<std::unique_ptr<MetricsExporter>> exporter =
      MetricsExporter::Serve("localhost", 0);
  SHARDPS_ASSERT_OK(exporter);
  EXPECT_GT((*exporter)->port(), 0);
}

TEST(MetricsExporterTest, ScrapeHooksRunBeforeEveryScrapeUntilDestroyed) {
  MetricsExporter exporter;
  prometheus::Gauge& gauge = prometheus::BuildGauge()
                                 .Name("shardps_test_generation")
                                 .Help("A value read at scrape time.")
                                 .Register(exporter.registry())
                                 .Add({});
  std::atomic<int> generation{4};
  std::unique_ptr<ScrapeHook> hook =
      exporter.OnScrape([&] { gauge.Set(generation.load()); });
  absl::StatusOr<Samples> samples = ParseExposition(exporter.Scrape());
  SHARDPS_ASSERT_OK(samples);
  EXPECT_EQ(samples->at("shardps_test_generation"), 4);
  generation = 5;
  samples = ParseExposition(exporter.Scrape());
  SHARDPS_ASSERT_OK(samples);
  EXPECT_EQ(samples->at("shardps_test_generation"), 5);
  hook.reset();
  generation = 6;
  samples = ParseExposition(exporter.Scrape());
  SHARDPS_ASSERT_OK(samples);
  EXPECT_EQ(samples->at("shardps_test_generation"), 5);
}

TEST(ExpositionTest, RejectsMalformedText) {
  EXPECT_FALSE(ParseExposition("no_type_line 1\n").ok());
  EXPECT_FALSE(ParseExposition("# TYPE x counter\nx one\n").ok());
  EXPECT_FALSE(ParseExposition("# TYPE x counter\nx 1\nx 2\n").ok());
  EXPECT_FALSE(ParseExposition("# TYPE 1x counter\n").ok());
  SHARDPS_EXPECT_OK(
      ParseExposition("# HELP x h\n# TYPE x gauge\nx{a=\"b\"} 1\n"));
}

}  // namespace
}  // namespace shardps
