"""Compression from the PyTorch layer: SHARDPS_COMPRESSION and
SHARDPS_WEIGHT_ENCODING (or init's arguments) change what crosses the wire,
the training stays close to fp32 and bitwise repeatable, and bad values are
refused before anything is sent."""

import os
import subprocess

import numpy as np
import pytest

import cluster
import safetensors_read
from test_torch_errors import shard_table

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_job.py")


def run(make_cluster, tmp_path, name, env):
    c = make_cluster(num_servers=2, num_workers=2)
    out = str(tmp_path / f"{name}.safetensors")
    procs = c.run_workers(JOB, ["--model=cnn", "--optimizer=sgd",
                                "--steps=16", f"--out={out}"],
                          extra_env=env)
    assert c.wait_workers(procs, timeout=300) == [0, 0], c.logs()
    return safetensors_read.read(out)[0], shard_table(c)


def max_diff(a, b):
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.mark.parametrize("compression,weights", [
    ("int8", "bf16"),
    ("topk:0.1", "topk:0.25"),
])
def test_compressed_training_is_close_to_fp32_and_repeatable(
        make_cluster, tmp_path, compression, weights):
    env = {"SHARDPS_COMPRESSION": compression,
           "SHARDPS_WEIGHT_ENCODING": weights}
    fp32, fp32_shards = run(make_cluster, tmp_path, "fp32", {})
    ours, shards = run(make_cluster, tmp_path, "ours", env)
    again, _ = run(make_cluster, tmp_path, "again", env)
    for k in ours:
        assert np.array_equal(ours[k], again[k]), k
    diff = max_diff(ours, fp32)
    print(f"{compression} gradients, {weights} weights: max |dw| vs fp32 = "
          f"{diff:.3g}; shard 0 took {shards[0]['BYTES IN']} and sent "
          f"{shards[0]['BYTES OUT']} (fp32: {fp32_shards[0]['BYTES IN']}, "
          f"{fp32_shards[0]['BYTES OUT']})")
    assert 0 < diff < 0.05
    # The shards say what the bytes stood for as fp32.
    assert "as fp32" in shards[0]["BYTES IN"]
    assert "as fp32" in shards[0]["BYTES OUT"]
    assert "as fp32" not in fp32_shards[0]["BYTES IN"]


def test_bad_compression_settings_are_refused(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import sys, shardps, shardps.torch as spt\n"
        "try:\n"
        "    spt.init(compression=sys.argv[1], weight_encoding=sys.argv[2])\n"
        "except shardps.InvalidArgument as e:\n"
        "    print('refused:', e)\n"
        "    sys.exit(3)\n")
    # Nothing listens there: a refusal comes before any connection.
    env = cluster.python_env({"SHARDPS_SERVERS": "127.0.0.1:1",
                              "SHARDPS_CONNECT_TIMEOUT_S": "30"})
    for compression, weights, message in [
            ("zstd", "fp32", 'unknown compression "zstd"'),
            ("topk:1.5", "fp32", "needs a ratio in (0, 1]"),
            ("none", "int8", 'unknown weight encoding "int8"')]:
        out = subprocess.run([cluster.PYTHON, str(script), compression,
                              weights], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 3, out.stdout + out.stderr
        assert message in out.stdout, out.stdout
    # A link rate that is not one, from the environment shardps-local sets.
    out = subprocess.run([cluster.PYTHON, str(script), "none", "fp32"],
                         env={**env, "SHARDPS_LINK_RATE": "1gbps"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "link_rate=1gbps" in out.stdout, out.stdout
