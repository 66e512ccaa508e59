// A labelled classification dataset held in memory in its compact file form
// (uint8 pixels, dense floats or sparse CSR rows), converted to float batches
// on demand, plus the loaders for IDX, CSV and libsvm files and the helpers
// that split each epoch's batches between workers. A Dataset is immutable
// after loading, so threads may share it.
#ifndef SHARDPS_WORKER_DATASET_H_
#define SHARDPS_WORKER_DATASET_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace shardps::worker {

// Shape a loader must find; 0 means "take it from the file". Loading a test
// set with the training set's shape keeps the two consistent.
struct DatasetShape {
  int64_t num_features = 0;
  // Labels must lie in [0, num_classes); 0 means 1 + the largest label.
  int num_classes = 0;
};

// Move-only: a training set is tens of megabytes.
class Dataset {
 public:
  Dataset(Dataset&&) = default;
  Dataset& operator=(Dataset&&) = default;
  Dataset(const Dataset&) = delete;
  Dataset& operator=(const Dataset&) = delete;

  // Samples as uint8 values scaled by 1/255 (IDX images), row-major
  // (num_samples x num_features). InvalidArgument if the sizes disagree or a
  // label is outside [0, num_classes) (num_classes 0: 1 + largest label).
  static absl::StatusOr<Dataset> FromPixels(int64_t num_features,
                                            int num_classes,
                                            std::vector<uint8_t> pixels,
                                            std::vector<int32_t> labels);
  // Dense float samples, row-major (num_samples x num_features).
  static absl::StatusOr<Dataset> FromDense(int64_t num_features,
                                           int num_classes,
                                           std::vector<float> values,
                                           std::vector<int32_t> labels);
  // Sparse samples in CSR form: row i holds the (0-based, strictly
  // increasing) feature indices indices[row_begin[i], row_begin[i + 1]) with
  // the matching values; row_begin has num_samples + 1 entries.
  static absl::StatusOr<Dataset> FromSparse(int64_t num_features,
                                            int num_classes,
                                            std::vector<int64_t> row_begin,
                                            std::vector<int32_t> indices,
                                            std::vector<float> values,
                                            std::vector<int32_t> labels);

  int64_t num_samples() const { return static_cast<int64_t>(labels_.size()); }
  int64_t num_features() const { return num_features_; }
  int num_classes() const { return num_classes_; }
  absl::Span<const int32_t> labels() const { return labels_; }

  // Keeps only the first `n` samples (all when n >= num_samples()), freeing
  // the rest. The number of classes stays as it was.
  void Truncate(int64_t n);

  // Writes sample indices[j] as row j of x (indices.size() x num_features
  // floats, pixels scaled to [0, 1]) and its label as labels[j].
  // REQUIRES: every index in [0, num_samples()).
  void FillBatch(absl::Span<const int64_t> indices, float* x,
                 int32_t* labels) const;

 private:
  enum class Storage { kPixels, kDense, kSparse };
  Dataset() = default;
  absl::Status Validate();

  Storage storage_ = Storage::kDense;
  int64_t num_features_ = 0;
  int num_classes_ = 0;
  std::vector<uint8_t> pixels_;     // kPixels
  std::vector<float> values_;       // kDense; kSparse: nonzero values
  std::vector<int64_t> row_begin_;  // kSparse
  std::vector<int32_t> indices_;    // kSparse
  std::vector<int32_t> labels_;
};

// Reads IDX files (gzip-compressed or plain): images with magic 0x803
// (n x rows x cols uint8) and labels with magic 0x801 (n uint8).
// InvalidArgument naming the file for a bad magic number, a truncated file or
// trailing bytes, differing counts, or a shape or label that `expect` rules
// out; NotFound if a file is missing.
absl::StatusOr<Dataset> LoadIdx(const std::string& images_path,
                                const std::string& labels_path,
                                DatasetShape expect = {});

// The four standard IDX files of `dir` ("train-images-idx3-ubyte" and so on,
// each with or without ".gz"); the training or the test split. The shape is
// whatever the files hold unless `expect` says otherwise.
absl::StatusOr<Dataset> LoadIdxDir(const std::string& dir, bool train,
                                   DatasetShape expect = {});

// Fashion-MNIST from `dir` (784 features, 10 classes).
absl::StatusOr<Dataset> LoadFashionMnist(const std::string& dir, bool train);

// One sample per line: an integer label, then the features, comma-separated.
// A first line whose label field is not a number is a header and is skipped;
// blank lines are skipped. InvalidArgument "path:line: ..." for a malformed
// line.
absl::StatusOr<Dataset> LoadCsv(const std::string& path,
                                DatasetShape expect = {});

// libsvm/svmlight lines "label index:value ...", 1-based increasing indices.
// num_features 0 means the largest index in the file. InvalidArgument
// "path:line: ..." for a malformed line or an index beyond num_features.
absl::StatusOr<Dataset> LoadLibsvm(const std::string& path,
                                   DatasetShape expect = {});

// Default location of Fashion-MNIST.
inline constexpr char kFashionMnistDir[] = "/usr/share/datasets/fashion-mnist";

// Loads the training (train = true) or test split named by `spec`:
//   "fashion-mnist"       Fashion-MNIST from kFashionMnistDir
//   "idx:DIR"             the standard IDX file names in DIR
//   "csv:TRAIN[,TEST]"    CSV files
//   "libsvm:TRAIN[,TEST]" libsvm files
// InvalidArgument for an unknown spec; NotFound for a test split that the
// spec does not name.
absl::StatusOr<Dataset> LoadDatasetSpec(absl::string_view spec, bool train,
                                        DatasetShape expect = {});

// A half-open range [begin, end) of positions in an epoch's permutation.
struct IndexRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

// A permutation of [0, n) that depends only on (n, seed, epoch): Fisher-Yates
// driven by std::mt19937_64, whose output the C++ standard fixes, with our own
// unbiased bounded draws (std::uniform_int_distribution and std::shuffle vary
// between standard libraries).
std::vector<int64_t> EpochPermutation(int64_t n, uint64_t seed, int64_t epoch);

// The contiguous part of the global batch [begin, begin + size) that worker
// `rank` of `num_workers` trains on. Parts differ in size by at most one, the
// lower ranks taking the extra samples, and together cover the batch exactly.
// REQUIRES: size >= 0, 0 <= rank < num_workers.
IndexRange WorkerSlice(int64_t global_batch_begin, int64_t global_batch_size,
                       int rank, int num_workers);

}  // namespace shardps::worker

#endif  // SHARDPS_WORKER_DATASET_H_
