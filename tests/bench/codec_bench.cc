#include "tests/bench/codec_bench.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/codec.h"
#include "common/splitmix64.h"
#include "common/status.h"

namespace shardps::bench {
namespace {

// A noisy neighbour only ever slows a run down; the median shrugs that off
// where the mean would not.
absl::Duration Median(std::vector<absl::Duration> times) {
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

template <typename Fn>
absl::Duration Time(Fn fn) {
  const absl::Time start = absl::Now();
  fn();
  return absl::Now() - start;
}

// Normal-ish gradients of standard deviation about 1e-3: the sum of four
// uniforms in [-1, 1) (Irwin-Hall), scaled, from splitmix64.
std::vector<float> Gradients(int64_t n) {
  std::vector<float> g(n);
  for (int64_t i = 0; i < n; ++i) {
    float sum = 0;
    for (int j = 0; j < 4; ++j) {
      const uint64_t u = SplitMix64(static_cast<uint64_t>(4 * i + j));
      sum += static_cast<float>(u >> 40) * 0x1p-23f - 1.0f;
    }
    g[i] = sum * 0.87e-3f;
  }
  return g;
}

__attribute__((noinline)) void Copy(char* dst, const float* src, int64_t n) {
  std::memcpy(dst, src, n * 4);
}

struct Codec {
  const char* name;
  v1::Encoding encoding;
  bool feedback;
};

}  // namespace

absl::Status RunCodecBench(const CodecOptions& o) {
  const int64_t n = o.bytes / 4;
  const std::vector<float> grad = Gradients(n);
  std::vector<float> residual(n, 0.0f);
  std::vector<float> next_residual(n);
  std::vector<float> decoded(n);
  std::vector<char> copy(o.bytes);
  absl::PrintF(
      "codec: %.0f MiB chunk (%d floats), one thread, median of %d; each "
      "row's memcpy of the chunk is timed alternately with its codec\n"
      "GB/s are of fp32 input (encode) or output (decode); ratio = codec "
      "GB/s / memcpy GB/s\n"
      "%-19s %8s %9s %7s %9s %7s %10s\n",
      o.bytes / 1048576.0, n, o.repeats, "codec", "memcpy", "encode", "ratio",
      "decode", "ratio", "payload");
  const std::string topk = absl::StrFormat("topk:%g", o.topk_ratio);
  const std::string topk_feedback = topk + " +feedback";
  const Codec codecs[] = {
      {"fp32 (copy)", v1::ENCODING_FP32, false},
      {"bf16", v1::ENCODING_BF16, false},
      {"bf16 +feedback", v1::ENCODING_BF16, true},
      {"fp16", v1::ENCODING_FP16, false},
      {"fp16 +feedback", v1::ENCODING_FP16, true},
      {"int8", v1::ENCODING_INT8, false},
      {"int8 +feedback", v1::ENCODING_INT8, true},
      {topk.c_str(), v1::ENCODING_TOPK, false},
      {topk_feedback.c_str(), v1::ENCODING_TOPK, true},
  };
  std::string payload;
  for (const Codec& c : codecs) {
    std::fill(residual.begin(), residual.end(), 0.0f);
    // As a worker encodes: the committed residual read, the next written to
    // another buffer (a chunk's two, swapped when the shard acknowledges).
    const float* r = c.feedback ? residual.data() : nullptr;
    float* r_next = c.feedback ? next_residual.data() : nullptr;
    absl::Status status;
    auto encode = [&] {
      absl::Status s = EncodePayloadTo(c.encoding, grad.data(), n, o.topk_ratio,
                                       r, r_next, &payload);
      if (!s.ok()) status = s;
    };
    auto decode = [&] {
      absl::Status s = DecodePayload(c.encoding, payload, n,
                                     /*allow_nonfinite=*/false, decoded.data());
      if (!s.ok()) status = s;
    };
    // Warm: the payload's buffer is allocated once, and every page touched.
    Copy(copy.data(), grad.data(), n);
    encode();
    decode();
    // Interleaved, so that all three see the same load on a shared machine.
    std::vector<absl::Duration> copies, encodes, decodes;
    for (int i = 0; i < o.repeats; ++i) {
      copies.push_back(Time([&] { Copy(copy.data(), grad.data(), n); }));
      encodes.push_back(Time(encode));
      decodes.push_back(Time(decode));
    }
    SHARDPS_RETURN_IF_ERROR(status);
    const double gb = o.bytes / 1e9;
    const double copy_gbs = gb / absl::ToDoubleSeconds(Median(copies));
    const double enc_gbs = gb / absl::ToDoubleSeconds(Median(encodes));
    const double dec_gbs = gb / absl::ToDoubleSeconds(Median(decodes));
    absl::PrintF("%-19s %8.2f %9.2f %7.2f %9.2f %7.2f %10d\n", c.name, copy_gbs,
                 enc_gbs, enc_gbs / copy_gbs, dec_gbs, dec_gbs / copy_gbs,
                 payload.size());
  }
  return absl::OkStatus();
}

}  // namespace shardps::bench
