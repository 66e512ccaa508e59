"""Mixed precision through shardps: a bfloat16 (or mixed float32, bfloat16
and float16) model trains with float32 master weights on the servers,
torch.autocast with float32 parameters trains as in torch, and torch's
GradScaler, disabled as it is without CUDA, changes nothing.

As tests/python/test_torch_equivalence.py, two workers run
tests/python/torch_job.py against real servers, and the reference is the
same script with --plain=halves: one torch process that averages the two
ranks' half-batch gradients. For a model that is not all float32 that
process keeps float32 master weights, as the servers do: the model's
gradients made float32 (exact) are averaged, a float32 torch optimizer
steps the master, and the model gets the master rounded to nearest even.
"""

import os
import re
import subprocess

import numpy as np
import pytest
import torch

import cluster
import safetensors_read

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_job.py")

# The parameters' dtypes in the model (float32 unless named).
LOW = {"bf16": {"": torch.bfloat16},
       "mixed": {"fc2.": torch.bfloat16, "scale": torch.float16}}


def dtype_of(kind, name):
    for prefix, dtype in LOW.get(kind, {}).items():
        if name.startswith(prefix):
            return dtype
    return torch.float32


WIRE = {}  # the last shardps run's "wire ..." line of rank 0


def run(make_cluster, tmp_path, args, plain=False):
    """(the float32 weights, the model's values as float32) after the run:
    the servers' weights and the lead's model, or the plain process's
    master and model."""
    out = str(tmp_path / ("plain" if plain else "shardps"))
    files = [f"--out={out}.safetensors", f"--values_out={out}-values"]
    if plain:
        subprocess.run([cluster.PYTHON, JOB, "--plain=halves"] + files + args,
                       check=True, env=cluster.python_env(), timeout=300)
    else:
        c = make_cluster(num_servers=2, num_workers=2)
        codes = c.wait_workers(c.run_workers(JOB, files + args), timeout=300)
        assert codes == [0, 0], c.logs()
        WIRE["line"] = re.search(r"wire (\S+ \S+)", c.worker_log(0)).group(1)
    return (safetensors_read.read(f"{out}.safetensors")[0],
            safetensors_read.read(f"{out}-values")[0])


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.mark.parametrize("model,kind", [
    ("cnn", "bf16"), ("gpt", "bf16"), ("mixed", "mixed")])
def test_low_precision_models_train_on_float32_master_weights(
        make_cluster, tmp_path, model, kind):
    args = [f"--model={model}", "--optimizer=sgd", "--steps=10"]
    if kind == "bf16":
        args.append("--dtype=bf16")
    master, values = run(make_cluster, tmp_path, args)
    # An all-bf16 model goes bf16 both ways (exact for it); others fp32.
    assert WIRE["line"] == ("ENCODING_BF16 ENCODING_BF16" if kind == "bf16"
                            else "ENCODING_FP32 ENCODING_FP32"), WIRE
    plain_master, plain_values = run(make_cluster, tmp_path, args, plain=True)
    for name in master:
        # The model holds the servers' weights rounded to nearest even.
        dtype = dtype_of(kind, name)
        rounded = torch.from_numpy(master[name].copy()).to(dtype).float()
        assert np.array_equal(rounded.numpy(), values[name]), name
    # The gradients are the plain process's bitwise (the same low-precision
    # weights, ops and half batch) and become float32 exactly; only the
    # servers' float32 update rounds differently from torch's SGD, by an
    # ulp, as in the float32 tests. Rounded to bfloat16 those ulps vanish
    # in these runs: no master weight lands within an ulp of a bfloat16
    # rounding midpoint, so the models are bitwise equal.
    diff = max_diff(master, plain_master)
    low = [n for n in values if dtype_of(kind, n) != torch.float32]
    same = all(np.array_equal(values[n], plain_values[n]) for n in low)
    print(f"{model} {kind}: max |dw| of the float32 weights vs the plain "
          f"master {diff:.3g}; low-precision values bitwise equal: {same}")
    assert diff <= 1e-6
    assert same


@pytest.mark.parametrize("model", ["cnn", "gpt"])
def test_autocast_trains_as_in_torch(make_cluster, tmp_path, model):
    args = [f"--model={model}", "--optimizer=sgd", "--steps=10",
            "--autocast"]
    ours, _ = run(make_cluster, tmp_path, args)
    plain, _ = run(make_cluster, tmp_path, args, plain=True)
    # Parameters and gradients are float32, so the float32 tests' ulps of
    # the servers' update (1e-5 there) apply, but autocast rounds every
    # weight to bfloat16 at each forward: a weight within an ulp of a
    # rounding midpoint rounds the other way in one run, and the later
    # gradients differ at bfloat16 precision (the tiny GPT's do by step 5,
    # the CNN's not in 10 steps). Bound: the two runs agree to within half
    # a bfloat16 ulp of each tensor's largest weight (2^-9 relative).
    for name in ours:
        tolerance = 2.0**-9 * float(np.max(np.abs(plain[name])))
        assert float(np.max(np.abs(ours[name] - plain[name]))) <= tolerance, \
            name
    print(f"{model} autocast bf16: max |dw| vs the plain process "
          f"{max_diff(ours, plain):.3g}")


def test_a_disabled_torch_grad_scaler_changes_nothing(make_cluster, tmp_path):
    # torch.cuda.amp.GradScaler disables itself without CUDA: scale(loss)
    # is the loss, and step(opt) calls opt.step(). The weights are the
    # run's without it, bitwise (an enabled one is refused: see
    # grad_change_job.py, which cannot make a real one here either).
    args = ["--model=cnn", "--optimizer=sgd", "--steps=10", "--autocast"]
    with_scaler, _ = run(make_cluster, tmp_path, args + ["--torch_scaler"])
    (tmp_path / "without").mkdir()
    without, _ = run(make_cluster, tmp_path / "without", args)
    assert max_diff(with_scaler, without) == 0.0
