"""Parameters on a CUDA device: their gradients go to host memory as
backward produces them, and the pushes go from there on a thread of their
own; the new weights go back to the device in step().

For each gradient the backward thread (DistributedOptimizer's hook) only
enqueues work: on a side stream that waits for the gradient to be ready
(an event of the stream backward ran on), the gradient is made float32 and
scaled there (as _precision.copy_gradient computes it) and copied into
pinned host memory, without waiting; an event marks the copy's end. The
pusher thread takes the gradients in the order backward produced them,
waits for each copy's event (not for the rest of backward), copies the
values into the push buffer (the client's gradient region, which a server
on this machine reads in place) and pushes it. So the copies and the
pushes overlap the rest of backward, as the CPU path's do. Every push of a
staged job, a no-gradient one too, goes through the one pusher thread: the
session sees one caller at a time. step() (and clip_grad_norm_) waits for
the last push before it talks to the servers.

Nothing here imports or touches torch.cuda unless a parameter is on a CUDA
device. SHARDPS_TORCH_STAGING=1 sends CPU parameters through the same
thread and queue, with plain copies for the CUDA ones, so that this path
is tested where no GPU is (tests/python/test_torch_staging.py).
"""

import os
import queue
import threading

import torch

from . import _precision


def device_of(named_params):
    """The one device of the parameters (torch.device); ValueError for
    parameters on several devices or on a device type shardps cannot
    copy from."""
    devices = {}
    for name, p in named_params:
        devices.setdefault(p.device, name)
    if len(devices) > 1:
        shown = ", ".join(f"{n} on {d}" for d, n in devices.items())
        raise ValueError(
            f"the parameters are on {len(devices)} devices ({shown}): "
            "shardps.torch trains a model on one device per process "
            "(model.to(f'cuda:{local_rank}'), one process per GPU); a "
            "model split over devices is not supported")
    device = next(iter(devices), torch.device("cpu"))
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"parameter {devices[device]} is on {device}: "
                         "shardps.torch trains CPU and CUDA parameters")
    return device


def staging_for(device, params):
    """A Stager for parameters on `device`, or None for the CPU path."""
    if device.type == "cuda":
        return Stager(device, params)
    if os.environ.get("SHARDPS_TORCH_STAGING") == "1":
        return Stager(device, params)
    return None


class Stager:
    """The device path of one DistributedOptimizer (see the module
    docstring). stage() and push() are called on the thread running
    backward (or step()), drain() on step()'s."""

    def __init__(self, device, params):
        self.device = device
        self.cuda = device.type == "cuda"
        pin = self.cuda
        # Pinned host copies of the gradients (float32, flat).
        self._host = [torch.empty(p.numel(), dtype=torch.float32,
                                  pin_memory=pin) for p in params]
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._queue = queue.Queue()
        self._error = None
        self._thread = None

    def _start(self):
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="shardps-pusher", daemon=True)
            self._thread.start()

    def stage(self, i, g, scale, buffer, push):
        """Enqueues the copy of gradient g (parameter i's, on the device)
        times `scale` into host memory, and its push from `buffer` (the
        (array, float32 tensor view) the client pushes) with push(array).
        Returns a fingerprint of the staged float32 values (a device
        scalar; None off CUDA) to tell later whether p.grad changed."""
        self._start()
        host = self._host[i]
        fingerprint, done = None, None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                staged = _precision.as_pushed(g, scale).reshape(-1)
                host.copy_(staged, non_blocking=True)
                # Bit patterns summed: changes when p.grad's values do.
                fingerprint = staged.view(torch.int32).sum()
                # g and staged are used on the side stream: their memory
                # must not be reused before the copy ends.
                g.record_stream(self._stream)
                staged.record_stream(self._stream)
                done = torch.cuda.Event()
                done.record(self._stream)
        else:
            _precision.copy_gradient(g.reshape(-1), host, scale)
        self._queue.put((push, done, host, buffer))
        return fingerprint

    def push(self, push):
        """Enqueues a push without a gradient: push(None)."""
        self._start()
        self._queue.put((push, None, None, None))

    def _run(self):
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                push, done, host, buffer = item
                if self._error is not None:
                    continue  # a push failed: the step is lost
                if done is not None:
                    done.synchronize()
                array = None
                if buffer is not None:
                    buffer[1].view(-1).copy_(host)
                    array = buffer[0]
                push(array)
            except BaseException as e:  # re-raised by drain()
                self._error = e
            finally:
                self._queue.task_done()

    def drain(self):
        """Waits until every enqueued push is done; raises the first error
        of this step's pushes."""
        if self._thread is None:
            return
        self._queue.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def reset(self):
        """A refused step: waits for what was enqueued, drops its error."""
        if self._thread is not None:
            self._queue.join()
        self._error = None

    def changed(self, g, scale, fingerprint, buffer):
        """Whether gradient g (times scale) differs from what was staged."""
        now = _precision.as_pushed(g, scale).reshape(-1)
        if self.cuda:
            return bool(now.view(torch.int32).sum() != fingerprint)
        return not torch.equal(now.view(torch.int32),
                               buffer[1].reshape(-1).view(torch.int32))
