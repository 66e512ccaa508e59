// What the _shardps binding's files share: raising a status as the
// shardps.Error subclass of its code, float32 views of Python buffers,
// calls without the GIL, and the module's free functions (module_functions.cc).
#ifndef SHARDPS_WORKER_PYTHON_BINDING_UTIL_H_
#define SHARDPS_WORKER_PYTHON_BINDING_UTIL_H_

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"

namespace shardps::python {

namespace py = pybind11;

// Raises the shardps.Error subclass for `status` (shardps._errors.error_for).
[[noreturn]] inline void Raise(const absl::Status& status) {
  py::object error =
      py::module_::import("shardps._errors")
          .attr("error_for")(absl::StatusCodeToString(status.code()),
                             std::string(status.message()));
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())),
                  error.ptr());
  throw py::error_already_set();
}

inline void Check(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}

template <typename T>
T Check(absl::StatusOr<T> value) {
  if (!value.ok()) Raise(value.status());
  return *std::move(value);
}

// A C-contiguous float32 view of `buffer`; InvalidArgument naming `what`
// otherwise. The memory belongs to the buffer's object: the caller keeps it.
inline absl::StatusOr<absl::Span<float>> FloatSpan(const py::buffer& buffer,
                                                   bool writable,
                                                   const std::string& what) {
  py::buffer_info info;
  try {
    info = buffer.request(writable);
  } catch (const py::error_already_set& e) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a ",
                                                   writable ? "writable " : "",
                                                   "buffer (", e.what(), ")"));
  }
  if (info.format != py::format_descriptor<float>::format() ||
      info.itemsize != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " holds values of format '", info.format, "' (",
                     info.itemsize, " bytes each): shardps takes float32"));
  }
  py::ssize_t expected = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] > 1 && info.strides[d] != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " is not contiguous: shardps takes C-contiguous buffers"));
    }
    expected *= info.shape[d];
  }
  return absl::MakeSpan(static_cast<float*>(info.ptr), info.size);
}

template <typename F>
auto Unlocked(F f) {
  py::gil_scoped_release release;
  return f();
}

// epoch_permutation, worker_slice, write_safetensors, init_log.
void DefineFunctions(py::module_& m);

}  // namespace shardps::python

#endif  // SHARDPS_WORKER_PYTHON_BINDING_UTIL_H_
