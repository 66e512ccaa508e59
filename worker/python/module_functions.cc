// The _shardps module's free functions: the data order shardps-worker
// uses, and writing safetensors and log lines as the daemons do.
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common/log.h"
#include "common/safetensors.h"
#include "worker/dataset.h"
#include "worker/python/binding_util.h"

namespace shardps::python {

void DefineFunctions(py::module_& m) {
  m.def(
      "epoch_permutation",
      [](int64_t n, uint64_t seed, int64_t epoch) {
        std::vector<int64_t> perm = worker::EpochPermutation(n, seed, epoch);
        py::array_t<int64_t> out(static_cast<py::ssize_t>(perm.size()));
        std::copy(perm.begin(), perm.end(), out.mutable_data());
        return out;
      },
      py::arg("n"), py::arg("seed"), py::arg("epoch"),
      "The seeded permutation of range(n) of an epoch (from 1), as "
      "shardps-worker orders its data.");
  m.def(
      "worker_slice",
      [](int64_t begin, int64_t size, int position, int workers) {
        const worker::IndexRange r =
            worker::WorkerSlice(begin, size, position, workers);
        return std::make_pair(r.begin, r.end);
      },
      py::arg("begin"), py::arg("size"), py::arg("position"),
      py::arg("workers"),
      "The part [begin, end) of the global batch [begin, begin + size) that "
      "the worker at `position` of `workers` trains on.");
  m.def(
      "write_safetensors",
      [](const std::string& path, const std::vector<std::string>& names,
         const std::vector<std::vector<int64_t>>& shapes,
         const py::list& arrays,
         const std::map<std::string, std::string>& metadata) {
        std::vector<SafetensorsTensor> tensors;
        for (size_t i = 0; i < names.size(); ++i) {
          const absl::Span<float> span =
              Check(FloatSpan(arrays[i].cast<py::buffer>(), false, names[i]));
          tensors.push_back({names[i], shapes[i], span.data()});
        }
        Check(WriteSafetensors(path, tensors, metadata));
      },
      py::arg("path"), py::arg("names"), py::arg("shapes"), py::arg("arrays"),
      py::arg("metadata"), "Writes float32 tensors as a safetensors file.");
  m.def(
      "init_log",
      [](const std::string& name, int rank) { InitLog(name, rank, false); },
      py::arg("name"), py::arg("rank"),
      "Names this process in shardps's log lines.");
}

}  // namespace shardps::python
