// NewCudaBackend and the GEMM roofline in CUDA builds: they load
// libshardps_cuda.so (next to the binary, or on the library path) on first
// use, and only when the GPU driver (libcuda.so.1) is present, so that a
// worker without a GPU never maps cuBLAS.
#include <dlfcn.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "worker/backend.h"
#include "worker/gemm_roofline.h"

namespace shardps::worker {
namespace {

constexpr char kLibrary[] = "libshardps_cuda.so";

std::string ExecutableDir() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  std::string path(buf, n);
  return path.substr(0, path.rfind('/'));
}

// The loaded library, or why it cannot be loaded. Loaded once; never
// unloaded.
absl::StatusOr<void*> Library() {
  static absl::Mutex mu(absl::kConstInit);
  static void* handle = nullptr;
  static absl::Status* failure = nullptr;
  absl::MutexLock lock(&mu);
  if (handle != nullptr) return handle;
  if (failure != nullptr) return *failure;
  if (dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL) == nullptr) {
    failure = new absl::Status(absl::FailedPreconditionError(
        "no CUDA device: the GPU driver (libcuda.so.1) is not installed"));
    return *failure;
  }
  const std::string beside = absl::StrCat(ExecutableDir(), "/", kLibrary);
  handle = dlopen(beside.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) handle = dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    failure = new absl::Status(absl::FailedPreconditionError(
        absl::StrCat("cannot load the CUDA backend (", beside, " or ", kLibrary,
                     " on the library path): ", dlerror())));
    return *failure;
  }
  return handle;
}

template <typename Fn>
absl::StatusOr<Fn*> Symbol(const char* name) {
  absl::StatusOr<void*> lib = Library();
  if (!lib.ok()) return lib.status();
  void* sym = dlsym(*lib, name);
  if (sym == nullptr) {
    return absl::InternalError(absl::StrCat(kLibrary, " has no symbol ", name));
  }
  return reinterpret_cast<Fn*>(sym);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(int device) {
  absl::StatusOr<void* (*)(int, absl::Status*)> fn =
      Symbol<void*(int, absl::Status*)>("shardps_cuda_new_backend");
  if (!fn.ok()) return fn.status();
  absl::Status status;
  void* backend = (*fn)(device, &status);
  if (!status.ok()) return status;
  return std::unique_ptr<Backend>(static_cast<Backend*>(backend));
}

absl::StatusOr<absl::Duration> CublasStepGemmTime(const ModelSpec& spec,
                                                  int batch, int device,
                                                  int repeats) {
  absl::StatusOr<int64_t (*)(const void*, int, int, int, absl::Status*)> fn =
      Symbol<int64_t(const void*, int, int, int, absl::Status*)>(
          "shardps_cuda_gemm_time_ns");
  if (!fn.ok()) return fn.status();
  absl::Status status;
  const int64_t ns = (*fn)(&spec, batch, device, repeats, &status);
  if (!status.ok()) return status;
  return absl::Nanoseconds(ns);
}

}  // namespace shardps::worker
