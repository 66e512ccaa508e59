// Durable whole-file writes: a reader (or a restart after a crash) sees either
// the old file or the whole new one, never a part. Used for checkpoints,
// model files and port files. Stateless functions; concurrent writers of one
// path each write their own temporary file and the last rename wins.
#ifndef SHARDPS_COMMON_ATOMIC_FILE_H_
#define SHARDPS_COMMON_ATOMIC_FILE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace shardps {

// Writes `pieces`, one after the other, to a temporary file in the directory
// of `path`, fsyncs it, renames it over `path` and fsyncs the directory. The
// temporary file is removed when a step fails. Errors name the path and the
// failed operation, with codes as FileError gives them.
absl::Status WriteFileAtomically(const std::string& path,
                                 absl::Span<const absl::string_view> pieces);
// The same with one piece.
absl::Status WriteFileAtomically(const std::string& path,
                                 absl::string_view contents);

// Makes the entries of `dir` (a completed rename) durable.
absl::Status SyncDirectory(const std::string& dir);

// "<op> <path>: <errno text>" as a Status: FailedPrecondition for what the
// operator must fix (permissions, a read-only file system, a path through a
// regular file, an existing file in the way), NotFound for a missing path,
// Internal for other I/O failures.
absl::Status FileError(absl::string_view op, const std::string& path, int err);

}  // namespace shardps

#endif  // SHARDPS_COMMON_ATOMIC_FILE_H_
