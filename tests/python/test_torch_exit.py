"""How a torch worker's end reaches the coordinator: a normal end or a
successful exit status finishes the rank; an exception, KeyboardInterrupt
or a failing sys.exit status makes it leave (the others stop waiting)."""

import re
import time

import pytest

import cluster

ENDINGS = {
    "end": ("pass", 0),
    "exit0": ("sys.exit(0)", 0),
    "exit_none": ("sys.exit()", 0),
    "exit3": ("sys.exit(3)", 3),
    "exit_message": ("sys.exit('bad data')", 1),
    "exception": ("raise RuntimeError('boom')", 1),
    "interrupt": ("raise KeyboardInterrupt", None),  # dies of SIGINT
    "exit_in_a_thread": ("t = threading.Thread(target=sys.exit, args=(2,))\n"
                         "t.start(); t.join()", 0),
}
FINISHED = ("end", "exit0", "exit_none", "exit_in_a_thread")


def membership_of_rank0(c, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        log = c.coordinator.log()
        if re.search(r"worker 0 \(\S+\) finished its training and left", log):
            return "finished"
        if re.search(r"worker 0 \(\S+\) left", log):
            return "left"
        time.sleep(0.05)
    raise TimeoutError(c.logs())


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_the_exit_status_decides_finished_or_left(make_cluster, tmp_path,
                                                  ending):
    code, status = ENDINGS[ending]
    script = tmp_path / "job.py"
    script.write_text(
        "import sys, threading\n"
        "import shardps.torch as spt\n"
        "ctx = spt.init()\n" + code + "\n")
    c = make_cluster(num_servers=1, num_workers=1, coordinated=True)
    (proc,) = c.run_workers(str(script))
    (got,) = c.wait_workers([proc], timeout=60)
    if status is None:
        assert got != 0, c.logs()
    else:
        assert got == status, c.logs()
    want = "finished" if ending in FINISHED else "left"
    assert membership_of_rank0(c) == want, c.logs()
