"""spt.all_reduce, broadcast and barrier through a real coordinator: the
results against numpy in rank order, bitwise the same on every rank; a
mismatch refused; a rank that dies fails the others' collective within the
heartbeat timeout; one that never calls times out naming it; the 1 MiB
limit; and BatchNorm buffers equal to rank 0's on every rank."""

import os
import re
import signal
import time

import numpy as np

import collective_job

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                   "collective_job.py")


def run(make_cluster, tmp_path, mode, workers=2):
    c = make_cluster(num_servers=1, num_workers=workers, coordinated=True)
    procs = c.run_workers(JOB, [f"--mode={mode}", f"--out={tmp_path}"])
    return c, procs


def in_rank_order(op, values):
    acc = values[0].copy()
    for v in values[1:]:
        if op == "sum":
            acc = acc + v
        elif op == "max":
            acc = np.maximum(acc, v)
        else:
            acc = np.minimum(acc, v)
    return acc


def test_collectives_equal_numpy_in_rank_order_on_every_rank(make_cluster,
                                                             tmp_path):
    c, procs = run(make_cluster, tmp_path, "reference", workers=3)
    assert c.wait_workers(procs, timeout=120) == [0, 0, 0], c.logs()
    mine = [collective_job.rank_tensors(r) for r in range(3)]
    f32 = [m["f32"] for m in mine]
    want = {
        "f32_sum": in_rank_order("sum", f32),
        "f32_mean": in_rank_order("sum", f32) / np.float32(3),
        "f32_max": in_rank_order("max", f32),
        "f32_min": in_rank_order("min", f32),
        "f64_sum": in_rank_order("sum", [m["f64"] for m in mine]),
        "i64_sum": in_rank_order("sum", [m["i64"] for m in mine]),
        "i64_max": in_rank_order("max", [m["i64"] for m in mine]),
        "scalar_mean": in_rank_order(
            "sum", [m["scalar"] for m in mine]) / np.float32(3),
        "broadcast_src1": mine[1]["f64"],
        "after_refusals": np.array([3, 3]),
    }
    for r in range(3):
        got = np.load(tmp_path / f"rank{r}.npz")
        for k, v in want.items():
            assert got[k].dtype == np.asarray(v).dtype, (r, k)
            assert got[k].tobytes() == np.asarray(v).tobytes(), (r, k)
    log = c.worker_log(0)
    assert "ValueError: all_reduce: the tensor is torch.int32" in log, log
    assert "over the collectives' limit of 1048576 (1 MiB)" in log, log
    assert re.search(r"ResourceExhausted: .*all_reduce\(sum\) float32 "
                     r"\[262145\] is over the collectives' limit", log), log


def test_a_mismatch_is_refused_naming_both_calls(make_cluster, tmp_path):
    c, procs = run(make_cluster, tmp_path, "mismatch")
    codes = c.wait_workers(procs, timeout=120)
    assert codes == [3, 3], c.logs()
    # Whichever came second is refused; the first then fails at once,
    # naming it, since the refused rank left the job with its error.
    logs = [c.worker_log(0), c.worker_log(1)]
    refused = 0 if "error InvalidArgument" in logs[0] else 1
    other = 1 - refused
    ops = {0: "sum", 1: "max"}
    assert (f"collective 1: rank {refused} calls all_reduce({ops[refused]}) "
            f"float32 [4] but rank {other} called all_reduce({ops[other]}) "
            "float32 [4]: every rank must call the same collectives in the "
            "same order") in logs[refused], c.logs()
    assert re.search(r"error Aborted: .*cannot complete: rank "
                     f"{refused} left the job before calling it",
                     logs[other]), c.logs()


def wait_for(c, rank, text, procs, timeout=60):
    deadline = time.time() + timeout
    while text not in c.worker_log(rank):
        assert all(p.poll() is None for p in procs), c.logs()
        assert time.time() < deadline, c.logs()
        time.sleep(0.05)


def test_a_rank_that_dies_fails_the_others_collective(make_cluster,
                                                      tmp_path):
    c, procs = run(make_cluster, tmp_path, "dead")
    wait_for(c, 1, "waiting", procs)
    wait_for(c, 0, "calling", procs)
    procs[1].send_signal(signal.SIGKILL)
    # The coordinator's --heartbeat_timeout_ms=3000, then the notifier.
    assert c.wait_workers(procs[:1], timeout=60) == [3], c.logs()
    log = c.worker_log(0)
    assert re.search(r"error Aborted: .*collective 1 \(all_reduce\(sum\) "
                     r"float32 \[4\]\) cannot complete: rank 1 left the job "
                     r"before calling it \(rank 0 called it\)", log), log
    seconds = float(re.search(r"after ([\d.]+) s", log).group(1))
    assert seconds < 30, log
    print(f"rank 0's collective failed {seconds} s after it was called")


def test_a_rank_that_never_calls_times_out_by_name(make_cluster, tmp_path):
    c, procs = run(make_cluster, tmp_path, "missing")
    assert c.wait_workers(procs[:1], timeout=60) == [3], c.logs()
    log = c.worker_log(0)
    assert re.search(r"error DeadlineExceeded: .*collective 1 "
                     r"\(all_reduce\(sum\) float32 \[4\]\) timed out: rank 1 "
                     r"did not call it \(rank 0 did\)", log), log


def test_batchnorm_buffers_are_rank_0s_on_every_rank(make_cluster, tmp_path):
    c, procs = run(make_cluster, tmp_path, "batchnorm")
    assert c.wait_workers(procs, timeout=120) == [0, 0], c.logs()
    r0 = np.load(tmp_path / "rank0.npz")
    r1 = np.load(tmp_path / "rank1.npz")
    keys = [k for k in r0.files if k.startswith("after.")]
    assert {k[len("after."):] for k in keys} == {
        "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    for k in keys:
        assert r0[k].tobytes() == r1[k].tobytes(), k
        # Rank 0's own statistics of the step, broadcast to rank 1 (whose
        # own, from another slice of the batch, differed).
        assert r0[k].tobytes() == r0["before." + k[6:]].tobytes(), k
    assert r1["before.bn.running_mean"].tobytes() != \
        r1["after.bn.running_mean"].tobytes()
