#include "worker/dataset.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <system_error>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/splitmix64.h"
#include "common/status.h"

namespace shardps::worker {
namespace {

// ---- IDX files --------------------------------------------------------------

constexpr uint32_t kIdxImagesMagic = 0x803;  // uint8 data, 3 dimensions
constexpr uint32_t kIdxLabelsMagic = 0x801;  // uint8 data, 1 dimension

using GzFile = std::unique_ptr<gzFile_s, int (*)(gzFile)>;

// zlib reads plain files unchanged, so one reader serves "x.gz" and "x".
absl::StatusOr<GzFile> OpenGz(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) {
    const std::string why =
        std::error_code(errno, std::generic_category()).message();
    return errno == ENOENT ? absl::NotFoundError(absl::StrCat(path, ": ", why))
                           : absl::InvalidArgumentError(
                                 absl::StrCat("open ", path, ": ", why));
  }
  return GzFile(file, gzclose);
}

// Reads exactly `n` bytes of `what` into `out`. Only bytes that arrive take
// memory, so a corrupt size field fails as truncation, not as a huge
// allocation.
absl::Status ReadExactly(gzFile file, const std::string& path, uint64_t n,
                         absl::string_view what, std::vector<uint8_t>* out) {
  constexpr uint64_t kChunk = uint64_t{1} << 20;
  out->clear();
  out->reserve(std::min<uint64_t>(n, 64 * kChunk));
  while (out->size() < n) {
    const size_t old_size = out->size();
    const unsigned want =
        static_cast<unsigned>(std::min<uint64_t>(n - old_size, kChunk));
    out->resize(old_size + want);
    const int got = gzread(file, out->data() + old_size, want);
    out->resize(old_size + static_cast<size_t>(std::max(got, 0)));
    if (got == static_cast<int>(want)) continue;
    int err = Z_OK;
    const char* message = gzerror(file, &err);
    if (err != Z_OK && err != Z_BUF_ERROR) {  // Z_BUF_ERROR: stream cut short
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": gzip error: ", message));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": truncated: expected ", n, " bytes of ", what,
                     ", got ", out->size()));
  }
  return absl::OkStatus();
}

// Fails unless `file` is at its end (which also makes zlib check the CRC).
absl::Status ExpectEnd(gzFile file, const std::string& path,
                       absl::string_view what) {
  uint8_t extra[64];
  const int got = gzread(file, extra, sizeof(extra));
  int err = Z_OK;
  const char* message = gzerror(file, &err);
  if (got < 0 || (err != Z_OK && err != Z_BUF_ERROR)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": gzip error: ", message));
  }
  if (got > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": unexpected bytes after ", what));
  }
  return absl::OkStatus();
}

uint32_t BigEndian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) |
         (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// Reads the magic number and `num_dims` big-endian sizes of an IDX file.
absl::StatusOr<std::vector<uint32_t>> ReadIdxHeader(gzFile file,
                                                    const std::string& path,
                                                    uint32_t magic,
                                                    int num_dims) {
  std::vector<uint8_t> header;
  SHARDPS_RETURN_IF_ERROR(
      ReadExactly(file, path, 4 + 4 * num_dims, "IDX header", &header));
  if (BigEndian32(header.data()) != magic) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": bad magic number 0x", absl::Hex(BigEndian32(header.data())),
        ", expected 0x", absl::Hex(magic), " (IDX uint8, ", num_dims,
        num_dims == 1 ? " dimension)" : " dimensions)"));
  }
  std::vector<uint32_t> dims;
  for (int i = 0; i < num_dims; ++i) {
    dims.push_back(BigEndian32(header.data() + 4 + 4 * i));
  }
  return dims;
}

struct IdxImages {
  int64_t count = 0;
  int64_t num_features = 0;
  std::vector<uint8_t> pixels;
};

absl::StatusOr<IdxImages> ReadIdxImages(const std::string& path) {
  SHARDPS_ASSIGN_OR_RETURN(GzFile file, OpenGz(path));
  SHARDPS_ASSIGN_OR_RETURN(std::vector<uint32_t> dims,
                           ReadIdxHeader(file.get(), path, kIdxImagesMagic, 3));
  IdxImages images;
  images.count = dims[0];
  images.num_features = int64_t{dims[1]} * dims[2];
  if (images.num_features == 0 || images.num_features > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": unsupported image size ", dims[1], "x", dims[2]));
  }
  const std::string what = absl::StrCat("pixels for ", dims[0], " images of ",
                                        dims[1], "x", dims[2]);
  SHARDPS_RETURN_IF_ERROR(ReadExactly(file.get(), path,
                                      images.count * images.num_features, what,
                                      &images.pixels));
  SHARDPS_RETURN_IF_ERROR(ExpectEnd(file.get(), path, what));
  return images;
}

absl::StatusOr<std::vector<int32_t>> ReadIdxLabels(const std::string& path) {
  SHARDPS_ASSIGN_OR_RETURN(GzFile file, OpenGz(path));
  SHARDPS_ASSIGN_OR_RETURN(std::vector<uint32_t> dims,
                           ReadIdxHeader(file.get(), path, kIdxLabelsMagic, 1));
  const std::string what = absl::StrCat(dims[0], " labels");
  std::vector<uint8_t> bytes;
  SHARDPS_RETURN_IF_ERROR(ReadExactly(file.get(), path, dims[0], what, &bytes));
  SHARDPS_RETURN_IF_ERROR(ExpectEnd(file.get(), path, what));
  return std::vector<int32_t>(bytes.begin(), bytes.end());
}

// "dir/name.gz" if it exists, else "dir/name" if that exists.
absl::StatusOr<std::string> FindIdxFile(const std::string& dir,
                                        const std::string& name) {
  const std::string plain = absl::StrCat(dir, "/", name);
  const std::string gz = plain + ".gz";
  std::error_code ignored;
  if (std::filesystem::exists(gz, ignored)) return gz;
  if (std::filesystem::exists(plain, ignored)) return plain;
  return absl::NotFoundError(
      absl::StrCat("neither ", gz, " nor ", plain, " exists"));
}

// ---- text files ------------------------------------------------------------

// Calls parse(line_number, line) for each non-blank line of `path`, prefixing
// any error with "path:line: ".
template <typename ParseLine>
absl::Status ForEachLine(const std::string& path, ParseLine parse) {
  std::ifstream in(path);
  if (!in) {
    std::error_code ignored;
    return std::filesystem::exists(path, ignored)
               ? absl::InvalidArgumentError(absl::StrCat("cannot read ", path))
               : absl::NotFoundError(absl::StrCat(path, " does not exist"));
  }
  std::string line;
  for (int64_t line_number = 1; std::getline(in, line); ++line_number) {
    const absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty()) continue;
    SHARDPS_RETURN_IF_ERROR(WithPrefix(absl::StrCat(path, ":", line_number),
                                       parse(line_number, text)));
  }
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat("read ", path));
  return absl::OkStatus();
}

absl::Status ParseLabel(absl::string_view field, int num_classes,
                        int32_t* label) {
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(field), label)) {
    return absl::InvalidArgumentError(
        absl::StrCat("label \"", field, "\" is not an integer"));
  }
  if (*label < 0 || (num_classes > 0 && *label >= num_classes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("label ", *label, " is outside [0, ",
                     num_classes > 0 ? absl::StrCat(num_classes) : "inf", ")"));
  }
  return absl::OkStatus();
}

absl::Status ParseValue(absl::string_view field, float* value) {
  if (!absl::SimpleAtof(absl::StripAsciiWhitespace(field), value) ||
      !std::isfinite(*value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", field, "\" is not a finite number"));
  }
  return absl::OkStatus();
}

struct DenseRows {
  int64_t num_features = 0;
  std::vector<float> values;
  std::vector<int32_t> labels;
};

absl::Status ParseCsvLine(int64_t line_number, absl::string_view text,
                          DatasetShape expect, DenseRows* rows) {
  const std::vector<absl::string_view> fields = absl::StrSplit(text, ',');
  int32_t label = 0;
  if (absl::Status s = ParseLabel(fields[0], expect.num_classes, &label);
      !s.ok()) {
    // A first line that does not start with a number is a header.
    float ignored = 0;
    if (line_number == 1 && !absl::SimpleAtof(fields[0], &ignored)) {
      return absl::OkStatus();
    }
    return s;
  }
  const int64_t count = static_cast<int64_t>(fields.size()) - 1;
  if (count == 0) {
    return absl::InvalidArgumentError("no features after the label");
  }
  if (rows->num_features == 0) rows->num_features = count;
  if (count != rows->num_features) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expected ", rows->num_features, " features, got ", count));
  }
  for (int64_t f = 1; f <= count; ++f) {
    float value = 0;
    SHARDPS_RETURN_IF_ERROR(WithPrefix(absl::StrCat("field ", f + 1),
                                       ParseValue(fields[f], &value)));
    rows->values.push_back(value);
  }
  rows->labels.push_back(label);
  return absl::OkStatus();
}

struct SparseRows {
  std::vector<int64_t> row_begin = {0};
  std::vector<int32_t> indices;
  std::vector<float> values;
  std::vector<int32_t> labels;
  int64_t max_index = 0;  // 1-based
};

absl::Status ParseLibsvmLine(absl::string_view text, DatasetShape expect,
                             SparseRows* rows) {
  text = text.substr(0, text.find('#'));  // svmlight comments
  const std::vector<absl::string_view> tokens =
      absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty());
  if (tokens.empty()) return absl::OkStatus();  // a comment line
  int32_t label = 0;
  SHARDPS_RETURN_IF_ERROR(ParseLabel(tokens[0], expect.num_classes, &label));
  int64_t previous = 0;
  for (size_t t = 1; t < tokens.size(); ++t) {
    const std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(tokens[t], absl::MaxSplits(':', 1));
    int64_t index = 0;
    float value = 0;
    if (!absl::SimpleAtoi(kv.first, &index) || kv.second.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("\"", tokens[t], "\" is not index:value"));
    }
    const int64_t limit =
        expect.num_features > 0 ? expect.num_features : int64_t{INT32_MAX};
    if (index <= previous || index > limit) {
      return absl::InvalidArgumentError(
          absl::StrCat("index ", index, " must exceed ", previous,
                       " and be at most ", limit, " (1-based, increasing)"));
    }
    SHARDPS_RETURN_IF_ERROR(ParseValue(kv.second, &value));
    rows->indices.push_back(static_cast<int32_t>(index - 1));
    rows->values.push_back(value);
    previous = index;
  }
  rows->max_index = std::max(rows->max_index, previous);
  rows->labels.push_back(label);
  rows->row_begin.push_back(static_cast<int64_t>(rows->indices.size()));
  return absl::OkStatus();
}

}  // namespace

// ---- Dataset ----------------------------------------------------------------

void Dataset::Truncate(int64_t n) {
  if (n < 0 || n >= num_samples()) return;
  const size_t rows = static_cast<size_t>(n);
  switch (storage_) {
    case Storage::kPixels:
      pixels_.resize(rows * num_features_);
      pixels_.shrink_to_fit();
      break;
    case Storage::kDense:
      values_.resize(rows * num_features_);
      values_.shrink_to_fit();
      break;
    case Storage::kSparse: {
      const size_t nnz = static_cast<size_t>(row_begin_[rows]);
      row_begin_.resize(rows + 1);
      indices_.resize(nnz);
      values_.resize(nnz);
      indices_.shrink_to_fit();
      values_.shrink_to_fit();
      break;
    }
  }
  labels_.resize(rows);
  labels_.shrink_to_fit();
}

absl::StatusOr<Dataset> Dataset::FromPixels(int64_t num_features,
                                            int num_classes,
                                            std::vector<uint8_t> pixels,
                                            std::vector<int32_t> labels) {
  Dataset d;
  d.storage_ = Storage::kPixels;
  d.num_features_ = num_features;
  d.num_classes_ = num_classes;
  d.pixels_ = std::move(pixels);
  d.labels_ = std::move(labels);
  SHARDPS_RETURN_IF_ERROR(d.Validate());
  return d;
}

absl::StatusOr<Dataset> Dataset::FromDense(int64_t num_features,
                                           int num_classes,
                                           std::vector<float> values,
                                           std::vector<int32_t> labels) {
  Dataset d;
  d.storage_ = Storage::kDense;
  d.num_features_ = num_features;
  d.num_classes_ = num_classes;
  d.values_ = std::move(values);
  d.labels_ = std::move(labels);
  SHARDPS_RETURN_IF_ERROR(d.Validate());
  return d;
}

absl::StatusOr<Dataset> Dataset::FromSparse(int64_t num_features,
                                            int num_classes,
                                            std::vector<int64_t> row_begin,
                                            std::vector<int32_t> indices,
                                            std::vector<float> values,
                                            std::vector<int32_t> labels) {
  Dataset d;
  d.storage_ = Storage::kSparse;
  d.num_features_ = num_features;
  d.num_classes_ = num_classes;
  d.row_begin_ = std::move(row_begin);
  d.indices_ = std::move(indices);
  d.values_ = std::move(values);
  d.labels_ = std::move(labels);
  SHARDPS_RETURN_IF_ERROR(d.Validate());
  return d;
}

absl::Status Dataset::Validate() {
  const uint64_t n = labels_.size();
  if (n == 0) return absl::InvalidArgumentError("dataset has no samples");
  if (num_features_ < 1 || num_features_ > INT32_MAX || num_classes_ < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad shape: ", num_features_, " features, ", num_classes_, " classes"));
  }
  const uint64_t dense = n * static_cast<uint64_t>(num_features_);
  if ((storage_ == Storage::kPixels && pixels_.size() != dense) ||
      (storage_ == Storage::kDense && values_.size() != dense)) {
    return absl::InvalidArgumentError(absl::StrCat(
        n, " samples of ", num_features_, " features need ", dense, " values"));
  }
  if (storage_ == Storage::kSparse) {
    if (row_begin_.size() != n + 1 || row_begin_[0] != 0 ||
        static_cast<uint64_t>(row_begin_[n]) != indices_.size() ||
        indices_.size() != values_.size()) {
      return absl::InvalidArgumentError("inconsistent sparse rows");
    }
    for (uint64_t i = 0; i < n; ++i) {
      for (int64_t k = row_begin_[i]; k < row_begin_[i + 1]; ++k) {
        if (indices_[k] < 0 || indices_[k] >= num_features_ ||
            (k > row_begin_[i] && indices_[k] <= indices_[k - 1])) {
          return absl::InvalidArgumentError(absl::StrCat(
              "sample ", i, ": feature index ", indices_[k],
              " out of order or outside [0, ", num_features_, ")"));
        }
      }
    }
  }
  if (num_classes_ == 0) {
    num_classes_ = 1 + *std::max_element(labels_.begin(), labels_.end());
  }
  for (uint64_t i = 0; i < n; ++i) {
    if (labels_[i] < 0 || labels_[i] >= num_classes_) {
      return absl::InvalidArgumentError(
          absl::StrCat("sample ", i, " has label ", labels_[i],
                       ", outside [0, ", num_classes_, ")"));
    }
  }
  return absl::OkStatus();
}

void Dataset::FillBatch(absl::Span<const int64_t> indices, float* x,
                        int32_t* labels) const {
  const int64_t f = num_features_;
  for (size_t j = 0; j < indices.size(); ++j) {
    const int64_t i = indices[j];
    float* row = x + static_cast<int64_t>(j) * f;
    labels[j] = labels_[i];
    switch (storage_) {
      case Storage::kPixels: {
        const uint8_t* p = pixels_.data() + i * f;
        for (int64_t k = 0; k < f; ++k) row[k] = p[k] / 255.0f;
        break;
      }
      case Storage::kDense:
        std::copy_n(values_.data() + i * f, f, row);
        break;
      case Storage::kSparse:
        std::fill_n(row, f, 0.0f);
        for (int64_t k = row_begin_[i]; k < row_begin_[i + 1]; ++k) {
          row[indices_[k]] = values_[k];
        }
        break;
    }
  }
}

// ---- loaders ---------------------------------------------------------------

absl::StatusOr<Dataset> LoadIdx(const std::string& images_path,
                                const std::string& labels_path,
                                DatasetShape expect) {
  SHARDPS_ASSIGN_OR_RETURN(IdxImages images, ReadIdxImages(images_path));
  SHARDPS_ASSIGN_OR_RETURN(std::vector<int32_t> labels,
                           ReadIdxLabels(labels_path));
  if (static_cast<int64_t>(labels.size()) != images.count) {
    return absl::InvalidArgumentError(
        absl::StrCat(images_path, " holds ", images.count, " images but ",
                     labels_path, " holds ", labels.size(), " labels"));
  }
  if (expect.num_features > 0 && images.num_features != expect.num_features) {
    return absl::InvalidArgumentError(
        absl::StrCat(images_path, ": images have ", images.num_features,
                     " pixels, expected ", expect.num_features));
  }
  absl::StatusOr<Dataset> d =
      Dataset::FromPixels(images.num_features, expect.num_classes,
                          std::move(images.pixels), std::move(labels));
  if (!d.ok()) return WithPrefix(labels_path, d.status());
  return d;
}

absl::StatusOr<Dataset> LoadIdxDir(const std::string& dir, bool train,
                                   DatasetShape expect) {
  const std::string split = train ? "train" : "t10k";
  SHARDPS_ASSIGN_OR_RETURN(std::string images,
                           FindIdxFile(dir, split + "-images-idx3-ubyte"));
  SHARDPS_ASSIGN_OR_RETURN(std::string labels,
                           FindIdxFile(dir, split + "-labels-idx1-ubyte"));
  return LoadIdx(images, labels, expect);
}

absl::StatusOr<Dataset> LoadFashionMnist(const std::string& dir, bool train) {
  return LoadIdxDir(dir, train, DatasetShape{784, 10});
}

absl::StatusOr<Dataset> LoadCsv(const std::string& path, DatasetShape expect) {
  DenseRows rows;
  rows.num_features = expect.num_features;
  SHARDPS_RETURN_IF_ERROR(
      ForEachLine(path, [&](int64_t line_number, absl::string_view text) {
        return ParseCsvLine(line_number, text, expect, &rows);
      }));
  absl::StatusOr<Dataset> d =
      Dataset::FromDense(rows.num_features, expect.num_classes,
                         std::move(rows.values), std::move(rows.labels));
  if (!d.ok()) return WithPrefix(path, d.status());
  return d;
}

absl::StatusOr<Dataset> LoadLibsvm(const std::string& path,
                                   DatasetShape expect) {
  SparseRows rows;
  SHARDPS_RETURN_IF_ERROR(
      ForEachLine(path, [&](int64_t, absl::string_view text) {
        return ParseLibsvmLine(text, expect, &rows);
      }));
  const int64_t num_features =
      expect.num_features > 0 ? expect.num_features : rows.max_index;
  absl::StatusOr<Dataset> d = Dataset::FromSparse(
      num_features, expect.num_classes, std::move(rows.row_begin),
      std::move(rows.indices), std::move(rows.values), std::move(rows.labels));
  if (!d.ok()) return WithPrefix(path, d.status());
  return d;
}

absl::StatusOr<Dataset> LoadDatasetSpec(absl::string_view spec, bool train,
                                        DatasetShape expect) {
  const std::pair<absl::string_view, absl::string_view> kind_arg =
      absl::StrSplit(spec, absl::MaxSplits(':', 1));
  const absl::string_view kind = kind_arg.first;
  const std::string arg(kind_arg.second);
  if (kind == "fashion-mnist" && arg.empty()) {
    return LoadFashionMnist(kFashionMnistDir, train);
  }
  if (kind == "idx" && !arg.empty()) return LoadIdxDir(arg, train, expect);
  if ((kind == "csv" || kind == "libsvm") && !arg.empty()) {
    const std::vector<std::string> files = absl::StrSplit(arg, ',');
    if (files.size() > 2 || files[0].empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dataset \"", spec, "\": expected ", kind, ":TRAIN[,TEST]"));
    }
    if (!train && files.size() < 2) {
      return absl::NotFoundError(absl::StrCat(
          "dataset \"", spec, "\" names no test file (", kind, ":TRAIN,TEST)"));
    }
    const std::string& path = files[train ? 0 : 1];
    return kind == "csv" ? LoadCsv(path, expect) : LoadLibsvm(path, expect);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dataset \"", spec,
                   "\": want fashion-mnist, idx:DIR, csv:TRAIN[,TEST] or "
                   "libsvm:TRAIN[,TEST]"));
}

// ---- epochs and slices -----------------------------------------------------

namespace {

// Uniform in [0, bound), unbiased: draws below 2^64 mod bound are redrawn, so
// the accepted range holds a whole number of copies of [0, bound).
uint64_t UniformBelow(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;
  for (;;) {
    const uint64_t r = rng();
    if (r >= threshold) return r % bound;
  }
}

}  // namespace

std::vector<int64_t> EpochPermutation(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> perm(static_cast<size_t>(std::max<int64_t>(n, 0)));
  std::iota(perm.begin(), perm.end(), int64_t{0});
  std::mt19937_64 rng(
      SplitMix64(seed ^ SplitMix64(static_cast<uint64_t>(epoch))));
  for (int64_t i = n - 1; i > 0; --i) {
    const uint64_t j = UniformBelow(rng, static_cast<uint64_t>(i) + 1);
    std::swap(perm[i], perm[j]);
  }
  return perm;
}

IndexRange WorkerSlice(int64_t global_batch_begin, int64_t global_batch_size,
                       int rank, int num_workers) {
  const int64_t base = global_batch_size / num_workers;
  const int64_t extra = global_batch_size % num_workers;
  const int64_t begin =
      global_batch_begin + rank * base + std::min<int64_t>(rank, extra);
  return IndexRange{begin, begin + base + (rank < extra ? 1 : 0)};
}

}  // namespace shardps::worker
