"""The GPU tests' pytest set-up: tests/python's (the built package on
sys.path, make_cluster), loaded under a name of its own."""

import importlib.util
import os

_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                     "python", "conftest.py")
_spec = importlib.util.spec_from_file_location("shardps_python_conftest",
                                               _path)
_python = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_python)

make_cluster = _python.make_cluster
pytest_runtest_makereport = _python.pytest_runtest_makereport
