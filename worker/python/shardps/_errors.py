"""Exceptions raised by shardps: one class per gRPC status code."""


class Error(Exception):
    """A shardps call failed.

    Attributes:
        code: the gRPC status code's name, e.g. ``"UNAVAILABLE"``.
        message: what the server or the client said, naming the shard,
            chunk or tensor involved.
    """

    code = "UNKNOWN"

    def __init__(self, message, code=None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self):
        return f"{self.code}: {self.message}"


class InvalidArgument(Error, ValueError):
    """A malformed call: a wrong size, dtype, name or setting."""
    code = "INVALID_ARGUMENT"


class FailedPrecondition(Error):
    """The call does not fit the job's state (e.g. another model declared)."""
    code = "FAILED_PRECONDITION"


class GradientChanged(FailedPrecondition, RuntimeError):
    """p.grad changed between backward and step(): the step was taken with
    the gradients as backward produced them (shardps.torch)."""


class NotFound(Error):
    code = "NOT_FOUND"


class OutOfRange(Error):
    code = "OUT_OF_RANGE"


class Aborted(Error):
    """This process is no longer the job's (rejoin), or the job rolled back."""
    code = "ABORTED"


class Unavailable(Error):
    """A server or the coordinator cannot be reached (after retries)."""
    code = "UNAVAILABLE"


class DeadlineExceeded(Error, TimeoutError):
    """A wait passed its timeout (servers unreachable, members missing)."""
    code = "DEADLINE_EXCEEDED"


class Unauthenticated(Error):
    code = "UNAUTHENTICATED"


class PermissionDenied(Error):
    code = "PERMISSION_DENIED"


class ResourceExhausted(Error):
    code = "RESOURCE_EXHAUSTED"


class Internal(Error):
    code = "INTERNAL"


class Cancelled(Error):
    code = "CANCELLED"


_BY_CODE = {cls.code: cls for cls in (
    InvalidArgument, FailedPrecondition, NotFound, OutOfRange, Aborted,
    Unavailable, DeadlineExceeded, Unauthenticated, PermissionDenied,
    ResourceExhausted, Internal, Cancelled)}


def error_for(code, message):
    """The exception for a status code name (used by the C++ binding)."""
    return _BY_CODE.get(code, Error)(message, code)
