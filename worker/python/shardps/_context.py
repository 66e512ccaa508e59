"""The process's part in a shardps job: init(), the Context it returns, and
what happens to the rank at exit. Module state: the one Context of the
process (shardps.torch.init() makes it)."""

import atexit
import os
import sys
import threading

from . import _errors
from . import _shardps

_context = None


class Context:
    """This process's part in a shardps job (what init() returns).

    Attributes:
        rank: this worker's rank.
        num_workers: the job's number of workers.
        session: the underlying _shardps.Session.
    """

    def __init__(self, session):
        self.session = session
        self.rank = session.rank
        self.num_workers = session.num_workers
        self.grad_scale = 1.0  # set by the sampler for uneven slices
        self._done = False
        self._optimizer = None  # the job's DistributedOptimizer
        self.scaler = None  # the job's GradScaler, once it scaled a loss
        self.wire_given = False  # init() chose the wire's encodings

    @property
    def is_lead(self):
        """True on the worker that evaluates and saves: the lowest rank in
        the job (rank 0 unless it left)."""
        return self.session.is_lead

    @property
    def step(self):
        """The job's step this worker pushes next."""
        return self.session.step

    def finish(self):
        """Tells the coordinator this rank completed its training (the job
        ends when every rank has). Called at exit if the script did not."""
        if not self._done:
            self._done = True
            self.session.finish()

    def leave(self):
        """Leaves the job: the other workers stop waiting for this one."""
        if not self._done:
            self._done = True
            self.session.leave()


def _env(name, default=None):
    value = os.environ.get(name)
    return default if value in (None, "") else value


def _env_flag(name, default):
    value = _env(name)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise _errors.InvalidArgument(
        "%s=%s is not a boolean (true/false, 1/0)" % (name, value))


def init(coordinator=None, servers=None, rank=None, num_workers=None,
         job_id=None, connect_timeout_s=None, rpc_timeout_s=None,
         compression=None, error_feedback=None, topk_warmup_steps=None,
         compression_min_elements=None, weight_encoding=None,
         shared_memory=None, speculative_weights=None, link_rate=None):
    """Joins the shardps job this process is a worker of.

    Arguments default to the environment that shardps-local, Compose and
    Kubernetes set: SHARDPS_COORDINATOR (host:port) or SHARDPS_SERVERS
    (host:port,... for a static job), SHARDPS_RANK (-1 or unset: any free
    rank with a coordinator, 0 without), SHARDPS_NUM_WORKERS, SHARDPS_JOB_ID,
    SHARDPS_TLS_CERT, SHARDPS_TLS_KEY, SHARDPS_TLS_CA,
    SHARDPS_AUTH_TOKEN_FILE, SHARDPS_TLS_SERVER_NAME,
    SHARDPS_CONNECT_TIMEOUT_S (default 120: how long to wait for the
    coordinator, the other members and the servers),
    SHARDPS_RPC_TIMEOUT_S (default 300: the longest one step may take),
    SHARDPS_COMPRESSION (default "none"), SHARDPS_ERROR_FEEDBACK (default
    1), SHARDPS_TOPK_WARMUP_STEPS (default 0),
    SHARDPS_COMPRESSION_MIN_ELEMENTS (default 0),
    SHARDPS_WEIGHT_ENCODING (default "fp32"), SHARDPS_SHARED_MEMORY
    (default 1), SHARDPS_SPECULATIVE_WEIGHTS (default 1) and
    SHARDPS_LINK_RATE (default unset; shardps-local --emulate_hosts sets
    its --link).

    `link_rate` is the slowest network link between workers and servers,
    as tc writes rates ("100mbit", "1gbit"; every rank the same). With
    automatic chunks (DistributedOptimizer's chunk_bytes=None), a link
    slower than 1 Gbit/s gets chunks down to what it carries in 0.5 ms
    (16 KiB at 100 Mbit/s), so that each step's pipeline fills and drains
    fast; a faster or unknown link keeps them at 64 KiB or more (sizes
    of wire bytes: with 2-byte gradients and weight_encoding="bf16" a
    chunk holds twice the elements, so every rank needs the same
    encodings when its DistributedOptimizer is made). A known
    link also gives every connection to a server a TCP receive buffer of
    what the link carries in 2.5 ms (30.5 KiB at 100 Mbit/s), so that the
    servers' replies converging on this worker do not overflow the queue
    before its link (this needs net.core.rmem_max at half of it, or
    CAP_NET_ADMIN).

    With `shared_memory` (the default), payloads to a server on this
    machine go through shared memory and only their headers over gRPC;
    servers elsewhere get everything over gRPC.

    With `speculative_weights` (the default), a clipped or loss-scaled step
    (a two-phase step) has the servers send, with each chunk's part of the
    gradient norm, the weights of the update that neither clips nor skips,
    and keep them when the step turns out so: the weights then travel while
    later gradients are still pushed, as in a step without clipping. The
    result is bitwise the same either way, and a step that clips costs
    about what it would without. It is asked of servers reached over the
    network (not through shared memory), unless the last two steps both
    clipped (a run that clips every step costs the servers nothing), and
    never with weight_encoding="topk:RATIO".

    `compression` is how gradients cross the wire: "none" (fp32, exact),
    "bf16", "fp16", "int8" (a scale per chunk) or "topk:RATIO" (the RATIO
    largest of each chunk, e.g. "topk:0.01"). With `error_feedback` (the
    default) what a step's encoding dropped is added to the next step's
    gradient, so nothing is lost over time. With "topk:RATIO",
    `topk_warmup_steps=N` starts dense and lowers the fraction sent
    exponentially to RATIO over the first N steps. Chunks of fewer than
    `compression_min_elements` elements (small tensors: biases, norms, an
    output layer) go as fp32. `weight_encoding="bf16"`
    has the
    servers send the weights rounded to bf16 (they keep fp32 master weights
    and optimizer state; the model then trains on the rounded copy);
    "topk:RATIO" sends, each step, only the RATIO of each chunk's weights
    that changed most (sync mode; every worker holds the same copy, which
    the servers keep, and the rest of each change follows in later steps).

    Returns the Context (also kept for DistributedOptimizer and
    DistributedSampler).

    Raises:
        shardps.DeadlineExceeded: the job's members or servers did not come
            within the timeout.
        shardps.InvalidArgument: a bad setting (a compression, encoding or
            link_rate that is not one, or no job to join).
        shardps.FailedPrecondition: link_rate's receive buffers are over
            net.core.rmem_max and the process may not exceed it.
    """
    global _context
    if _context is not None:
        raise RuntimeError("shardps.torch.init() was already called")
    coordinator = coordinator if coordinator is not None else _env(
        "SHARDPS_COORDINATOR", "")
    if servers is None:
        servers = [s for s in _env("SHARDPS_SERVERS", "").split(",") if s]
    if rank is None:
        rank = int(_env("SHARDPS_RANK", "-1"))
    if num_workers is None and _env("SHARDPS_NUM_WORKERS") is not None:
        num_workers = int(_env("SHARDPS_NUM_WORKERS"))
    if not coordinator and not servers:
        raise _errors.InvalidArgument(
            "no job to join: set SHARDPS_COORDINATOR=host:port (or "
            "SHARDPS_SERVERS=host:port,... for a static job), e.g. by "
            "running the script under shardps-local --workers=N -- python3 "
            "train.py")
    _shardps.init_log("worker", max(rank, 0))
    session = _shardps.Session(
        coordinator=coordinator, servers=servers, rank=rank,
        num_workers=num_workers,
        job_id=job_id or _env("SHARDPS_JOB_ID", "default"),
        tls_cert=_env("SHARDPS_TLS_CERT", ""),
        tls_key=_env("SHARDPS_TLS_KEY", ""),
        tls_ca=_env("SHARDPS_TLS_CA", ""),
        auth_token_file=_env("SHARDPS_AUTH_TOKEN_FILE", ""),
        tls_server_name=_env("SHARDPS_TLS_SERVER_NAME", ""),
        connect_timeout_s=float(connect_timeout_s or _env(
            "SHARDPS_CONNECT_TIMEOUT_S", "120")),
        rpc_timeout_s=float(rpc_timeout_s or _env("SHARDPS_RPC_TIMEOUT_S",
                                                  "300")),
        compression=compression or _env("SHARDPS_COMPRESSION", "none"),
        error_feedback=_env_flag("SHARDPS_ERROR_FEEDBACK", True)
        if error_feedback is None else bool(error_feedback),
        topk_warmup_steps=int(topk_warmup_steps if topk_warmup_steps
                              is not None else _env(
                                  "SHARDPS_TOPK_WARMUP_STEPS", "0")),
        compression_min_elements=int(
            compression_min_elements if compression_min_elements is not None
            else _env("SHARDPS_COMPRESSION_MIN_ELEMENTS", "0")),
        weight_encoding=weight_encoding or _env("SHARDPS_WEIGHT_ENCODING",
                                                "fp32"),
        shared_memory=_env_flag("SHARDPS_SHARED_MEMORY", True)
        if shared_memory is None else bool(shared_memory),
        speculative_weights=_env_flag("SHARDPS_SPECULATIVE_WEIGHTS", True)
        if speculative_weights is None else bool(speculative_weights),
        link_rate=link_rate if link_rate is not None else _env(
            "SHARDPS_LINK_RATE", ""))
    _context = Context(session)
    # An encoding the caller chose is kept; otherwise DistributedOptimizer
    # may pick bf16 for a bf16 model (exact).
    _context.wire_given = any(
        v is not None for v in (compression, weight_encoding,
                                os.environ.get("SHARDPS_COMPRESSION"),
                                os.environ.get("SHARDPS_WEIGHT_ENCODING")))
    _watch_exit(_context)
    return _context


def _failing_status(code):
    # As the interpreter reads SystemExit's code: None and 0 are success,
    # another int and anything else (a message, printed) a failure.
    return code is not None and not (isinstance(code, int) and code == 0)


def _watch_exit(ctx):
    # At exit the rank finishes, or leaves (the others stop waiting for
    # it) when the script died of an exception (sys.excepthook sees it,
    # KeyboardInterrupt included) or asked for a failing exit status.
    # SystemExit reaches neither sys.excepthook nor atexit with its status,
    # so sys.exit is wrapped to note the status the main thread asks for
    # (argparse and most libraries exit through it). Not seen:
    # `raise SystemExit(n)` written out, exit()/quit() (the interactive
    # shell's), os._exit (no atexit at all: the coordinator drops the rank
    # when its heartbeats stop).
    failed = []
    previous_hook = sys.excepthook
    previous_exit = sys.exit

    def excepthook(kind, value, tb):
        failed.append(kind)
        previous_hook(kind, value, tb)

    def exit(*status):
        if threading.current_thread() is threading.main_thread():
            if status and _failing_status(status[0]):
                failed.append(SystemExit)
        previous_exit(*status)

    exit.__doc__ = previous_exit.__doc__
    sys.excepthook = excepthook
    sys.exit = exit

    def at_exit():
        try:
            if failed:
                ctx.leave()
            else:
                ctx.finish()
        except _errors.Error as e:
            print(f"shardps: at exit: {e}", file=sys.stderr)

    atexit.register(at_exit)


def _context_or(context):
    if context is not None:
        return context
    if _context is None:
        raise RuntimeError("call shardps.torch.init() first")
    return _context


def current():
    """The process's Context, or None before init()."""
    return _context
