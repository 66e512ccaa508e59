#include "worker/compression.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/codec.h"

namespace shardps {

absl::StatusOr<v1::Encoding> ParseGradientCompression(absl::string_view spec,
                                                      double* topk_ratio) {
  *topk_ratio = 0;
  if (spec == "none" || spec == "fp32") return v1::ENCODING_FP32;
  if (spec == "bf16") return v1::ENCODING_BF16;
  if (spec == "fp16") return v1::ENCODING_FP16;
  if (spec == "int8") return v1::ENCODING_INT8;
  if (absl::ConsumePrefix(&spec, "topk:")) {
    double ratio = 0;
    if (absl::SimpleAtod(spec, &ratio) && ratio > 0 && ratio <= 1) {
      *topk_ratio = ratio;
      return v1::ENCODING_TOPK;
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "compression topk:", spec, " needs a ratio in (0, 1], e.g. topk:0.01"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown compression \"", spec,
                   "\"; one of none, bf16, fp16, int8, topk:RATIO"));
}

absl::StatusOr<v1::Encoding> ParseWeightEncoding(absl::string_view spec,
                                                 double* topk_ratio) {
  *topk_ratio = 0;
  if (spec == "fp32") return v1::ENCODING_FP32;
  if (spec == "bf16") return v1::ENCODING_BF16;
  if (absl::StartsWith(spec, "topk:")) {
    return ParseGradientCompression(spec, topk_ratio);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown weight encoding \"", spec, "\"; one of fp32, bf16, topk:RATIO"));
}

absl::Status ValidateCompression(const Compression& c) {
  switch (c.gradients) {
    case v1::ENCODING_FP32:
    case v1::ENCODING_BF16:
    case v1::ENCODING_FP16:
    case v1::ENCODING_INT8:
      break;
    case v1::ENCODING_TOPK:
      if (!(c.topk_ratio > 0 && c.topk_ratio <= 1)) {
        return absl::InvalidArgumentError(
            absl::StrCat("top-k ratio ", c.topk_ratio, " is not in (0, 1]"));
      }
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "gradients cannot be sent as ", v1::Encoding_Name(c.gradients)));
  }
  if (c.min_elements < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the smallest chunk to compress, ", c.min_elements,
                     " elements, is negative"));
  }
  if (c.topk_warmup_steps < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "top-k warmup of ", c.topk_warmup_steps, " steps is negative"));
  }
  if (c.weights == v1::ENCODING_TOPK) {
    if (!(c.weights_topk_ratio > 0 && c.weights_topk_ratio <= 1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sparse weights' ratio ", c.weights_topk_ratio, " is not in (0, 1]"));
    }
  } else if (c.weights != v1::ENCODING_FP32 && c.weights != v1::ENCODING_BF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("weights cannot be received as ",
                     v1::Encoding_Name(c.weights), ": fp32, bf16 or topk"));
  }
  return absl::OkStatus();
}

int WireBytesPerElement(const Compression& c) {
  const bool gradients_half = c.gradients == v1::ENCODING_BF16 ||
                              c.gradients == v1::ENCODING_FP16 ||
                              c.gradients == v1::ENCODING_INT8;
  return gradients_half && c.weights == v1::ENCODING_BF16 ? 2 : 4;
}

std::string CompressionName(const Compression& c) {
  std::string name;
  switch (c.gradients) {
    case v1::ENCODING_BF16:
      name = "bf16";
      break;
    case v1::ENCODING_FP16:
      name = "fp16";
      break;
    case v1::ENCODING_INT8:
      name = "int8";
      break;
    case v1::ENCODING_TOPK:
      name = absl::StrFormat("topk:%g", c.topk_ratio);
      if (c.topk_warmup_steps > 0) {
        absl::StrAppend(&name, " after ", c.topk_warmup_steps, " warmup steps");
      }
      break;
    default:
      name = "fp32";
  }
  if (c.gradients != v1::ENCODING_FP32 && !c.error_feedback) {
    absl::StrAppend(&name, " without error feedback");
  }
  if (c.weights == v1::ENCODING_BF16) absl::StrAppend(&name, ", bf16 weights");
  if (c.weights == v1::ENCODING_TOPK) {
    absl::StrAppend(&name,
                    absl::StrFormat(", topk:%g weights", c.weights_topk_ratio));
  }
  return name;
}

GradientCompressor::GradientCompressor(const Compression& c,
                                       std::vector<ChunkSpec> chunks)
    : c_(c), chunks_(std::move(chunks)), codecs_(chunks_.size()) {}

absl::Status GradientCompressor::CheckValues(uint32_t id, const float* gradient,
                                             int64_t step) const {
  const ChunkCodec& codec = codecs_[id];
  // What Encode will encode: the gradient plus the committed residual.
  const float* residual = codec.step == step || codec.residual.empty()
                              ? nullptr
                              : codec.residual.data();
  return CheckEncodableWithin(c_.gradients, gradient, residual,
                              codec.residual_max, chunks_[id].num_elements);
}

double GradientCompressor::TopkRatioAt(int64_t step) const {
  const int64_t w = c_.topk_warmup_steps;
  if (step < 0 || step >= w) return c_.topk_ratio;
  return std::pow(c_.topk_ratio, static_cast<double>(step + 1) / w);
}

absl::StatusOr<absl::string_view> GradientCompressor::Encode(
    uint32_t id, const float* gradient, int64_t step) {
  ChunkCodec& codec = codecs_[id];
  // The step pushed again (a retry, or the step redone after a failure):
  // the shard may hold its first payload, and ignores another, so the same
  // bytes go again and the residual stays the one of that payload.
  if (codec.step == step) return absl::string_view(codec.payload);
  const int64_t n = chunks_[id].num_elements;
  const float* residual = nullptr;
  float* pending = nullptr;
  if (c_.error_feedback) {
    if (codec.residual.empty()) codec.residual.assign(n, 0.0f);
    codec.pending.resize(n);  // all written by the encoder
    residual = codec.residual.data();
    pending = codec.pending.data();
  }
  // Into the spare payload: on error the last payload stays whole for a
  // retry of its step, and a Commit finds nothing to commit (pending may
  // hold anything).
  float y_max = 0;
  absl::Status s = EncodePayloadTo(c_.gradients, gradient, n, TopkRatioAt(step),
                                   residual, pending, &codec.spare, &y_max);
  if (!s.ok()) {
    codec.encoded = false;
    return s;
  }
  codec.pending_max = ResidualBound(c_.gradients, y_max);
  std::swap(codec.payload, codec.spare);
  codec.step = step;
  codec.encoded = true;
  return absl::string_view(codec.payload);
}

void GradientCompressor::Commit(uint32_t id) {
  ChunkCodec& codec = codecs_[id];
  if (!codec.encoded) return;  // committed already (a repeated reply)
  codec.encoded = false;
  if (c_.error_feedback) {
    std::swap(codec.residual, codec.pending);
    codec.residual_max = codec.pending_max;
  }
}

bool GradientCompressor::SameChunks(
    const std::vector<ChunkSpec>& chunks) const {
  if (chunks.size() != chunks_.size()) return false;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (chunks[i].tensor != chunks_[i].tensor ||
        chunks[i].offset != chunks_[i].offset ||
        chunks[i].num_elements != chunks_[i].num_elements) {
      return false;
    }
  }
  return true;
}

void GradientCompressor::Reset() {
  for (ChunkCodec& codec : codecs_) {
    codec.residual.clear();
    codec.pending.clear();
    codec.residual_max = 0;
    codec.encoded = false;
    codec.step = -1;
  }
}

}  // namespace shardps
