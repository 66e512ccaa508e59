"""pytest set-up: the built shardps package on sys.path, and clusters of
real daemons (tests/python/cluster.py) that are stopped after each test."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cluster  # noqa: E402

sys.path.insert(0, os.path.join(cluster.BUILD, "worker", "python"))


@pytest.fixture
def make_cluster(request):
    made = []

    def make(**kwargs):
        c = cluster.Cluster(**kwargs)
        made.append(c)
        return c

    yield make
    failed = request.node.rep_call.failed if hasattr(
        request.node, "rep_call") else False
    for c in made:
        if failed:
            print(c.logs())
        c.stop()


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, "rep_" + report.when, report)
