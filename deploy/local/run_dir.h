// The run directory of shardps-local: logs/NAME.log, pids/NAME.pid and
// ports/NAME.port for each process (NAME: server-0, worker-1, ...), plus the
// metrics.csv and model.safetensors that worker 0 writes. Not thread-safe.
#ifndef SHARDPS_DEPLOY_LOCAL_RUN_DIR_H_
#define SHARDPS_DEPLOY_LOCAL_RUN_DIR_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardps::local {

class RunDir {
 public:
  // `root` should be absolute: the paths are handed to other processes.
  explicit RunDir(std::string root) : root_(std::move(root)) {}

  const std::string& root() const { return root_; }
  std::string LogPath(const std::string& name) const;
  std::string PidPath(const std::string& name) const;
  std::string PortPath(const std::string& name) const;
  std::string MetricsPath() const;
  std::string ModelPath() const;

  // Creates the directory and its subdirectories, and removes what an earlier
  // run left that could pass for this run's: metrics, model, pid and port
  // files. FailedPrecondition naming the path that could not be created or
  // removed.
  absl::Status Prepare() const;
  // Writes pids/NAME.pid. FailedPrecondition if it cannot.
  absl::Status WritePid(const std::string& name, pid_t pid) const;
  // The port in ports/NAME.port, or 0 while there is none. Servers write the
  // file atomically, so a number that parses is the whole number.
  int ReadPort(const std::string& name) const;
  // Removes ports/NAME.port if there is one, so that the file of a process
  // that died does not pass for that of its restarted successor.
  void RemovePort(const std::string& name) const;

 private:
  std::string root_;
};

// "final: epoch=E step=S test_accuracy=A train_loss=L wall_s=T\n" from the
// last row of the metrics CSV at `path`, with T = `wall` in seconds. NotFound
// if the file is missing or has no rows; InvalidArgument if the header lacks
// one of those columns or the last row does not match it.
absl::StatusOr<std::string> FinalMetricsLine(const std::string& path,
                                             absl::Duration wall);

}  // namespace shardps::local

#endif  // SHARDPS_DEPLOY_LOCAL_RUN_DIR_H_
