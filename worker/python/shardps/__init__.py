"""shardps: data-parallel training through sharded parameter servers.

The C++ engine is the `_shardps` extension (a worker's Session: joining the
job, declaring the model, pushing gradients tensor by tensor, recovering
from rollbacks). `shardps.torch` is the PyTorch layer over it. The extension
takes float32 buffers, never torch tensors, so it works with any torch.
"""

from ._errors import (Aborted, Cancelled, DeadlineExceeded, Error,
                      FailedPrecondition, GradientChanged, Internal,
                      InvalidArgument, NotFound, OutOfRange, PermissionDenied,
                      ResourceExhausted, Unauthenticated, Unavailable)
from ._shardps import (Session, epoch_permutation, worker_slice,
                       write_safetensors)

__all__ = [
    "Aborted", "Cancelled", "DeadlineExceeded", "Error", "FailedPrecondition",
    "GradientChanged", "Internal", "InvalidArgument", "NotFound",
    "OutOfRange", "PermissionDenied", "ResourceExhausted", "Session",
    "Unauthenticated", "Unavailable", "epoch_permutation", "worker_slice",
    "write_safetensors",
]
