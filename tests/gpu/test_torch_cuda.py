"""shardps.torch with the model on a CUDA device (_device.py: gradients
staged to pinned memory on a side stream, pushed from a thread, weights
copied back after step()): two workers train what one CPU torch process
computes from the averaged half batches. Skipped, with the reason, where
torch has no CUDA (Debian's torch is built without it); check.sh runs it.
tests/python/test_torch_staging.py covers the same path with CPU
parameters everywhere."""

import os

import numpy as np
import pytest
import torch

import cluster
import safetensors_read

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                   "python", "torch_job.py")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"torch {torch.__version__} has no usable CUDA "
    f"(torch.version.cuda={torch.version.cuda}): the torch layer's CUDA "
    "path was not run")


@pytest.mark.parametrize("args", [
    ["--model=cnn", "--optimizer=sgd"],
    ["--model=gpt", "--optimizer=adamw", "--warmup", "--lr=0.01"],
    ["--model=gpt", "--optimizer=adamw", "--lr=0.01", "--max_grad_norm=0.3"],
], ids=["cnn-sgd", "gpt-adamw", "gpt-clipped"])
def test_a_cuda_model_trains_as_the_cpu_reference(make_cluster, tmp_path,
                                                  args):
    args = args + ["--steps=20"]
    c = make_cluster(num_servers=2, num_workers=2)
    out = tmp_path / "cuda.safetensors"
    procs = c.run_workers(JOB, [f"--out={out}", "--device=cuda"] + args)
    assert c.wait_workers(procs, timeout=300) == [0, 0], c.logs()
    assert "staged True" in c.worker_log(0)
    ours = safetensors_read.read(str(out))[0]
    ref = tmp_path / "plain.safetensors"
    import subprocess
    subprocess.run([cluster.PYTHON, JOB, "--plain=halves", f"--out={ref}"] +
                   args, check=True, env=cluster.python_env(), timeout=300)
    plain = safetensors_read.read(str(ref))[0]
    diff = max(float(np.max(np.abs(ours[k] - plain[k]))) for k in ours)
    print(f"{' '.join(args)}: max |dw| CUDA vs CPU reference = {diff:.3g}")
    # The GPU's kernels round differently from the CPU's.
    assert diff <= 1e-4
