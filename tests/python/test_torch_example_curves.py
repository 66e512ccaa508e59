"""The examples' records as users get them: the step lines, metrics.csv and
loss.png (worker/python/examples/curves.py), from a short GPT run under
shardps-local (2 servers, 2 workers) and a short plain CNN run. No timing
assertions: the rates are only checked to be numbers."""

import csv
import os
import shutil
import subprocess

import pytest

import cluster

EXAMPLES = os.path.join(cluster.REPO, "worker", "python", "examples")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# A GPT small enough for seconds: 2 epochs of 4 steps, a row every 3 steps.
TINY_GPT = ["--dim=32", "--layers=1", "--heads=2", "--seq_len=32",
            "--epochs=2", "--steps_per_epoch=4", "--log_every=3",
            "--val_windows=16", "--sample_bytes=8"]


def has_matplotlib():
    return subprocess.run([cluster.PYTHON, "-c", "import matplotlib"],
                          capture_output=True).returncode == 0


def read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [dict(zip(rows[0], r)) for r in rows[1:]]


def run(args, cwd, env=None):
    done = subprocess.run(args, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300,
                          env=cluster.python_env(env))
    return done.returncode, done.stdout


needs_fashion_mnist = pytest.mark.skipif(
    not os.path.exists("/usr/share/datasets/fashion-mnist"),
    reason="/usr/share/datasets/fashion-mnist is missing: apt-get install "
    "dataset-fashion-mnist")


@pytest.mark.skipif(shutil.which("bible") is None,
                    reason="the GPT's text is missing: apt-get install "
                    "bible-kjv bible-kjv-text")
def test_gpt_under_shardps_local_writes_its_curves(tmp_path):
    run_dir = tmp_path / "run"
    rc, out = run([cluster.binary("shardps-local"), "--servers=2",
                   "--workers=2", f"--run_dir={run_dir}", "--timeout_s=300",
                   "--", cluster.PYTHON, os.path.join(EXAMPLES, "gpt_kjv.py")]
                  + TINY_GPT, tmp_path)
    assert rc == 0, out
    assert "final: epoch=2 step=8 val_loss=" in out, out
    samples = [line for line in out.splitlines()
               if line.startswith("sample: ")]
    assert len(samples) == 2 and all("And God said" in line
                                     for line in samples), out
    for step in (3, 6, 8):
        assert f"\nstep {step} loss " in out, out
    # The launcher's metrics.csv (shardps-worker's) is left alone: the
    # example's files are in a folder of the run directory.
    assert not (run_dir / "metrics.csv").exists()
    assert "every rank evaluated the first 16 items: val_loss " in out, out
    assert "equal on every rank" in out, out
    header, rows = read_csv(run_dir / "gpt_kjv" / "metrics.csv")
    assert header == ["kind", "epoch", "step", "train_loss", "lr",
                      "grad_norm", "tokens_per_s", "ms_per_step", "epoch_s",
                      "eval_s", "val_loss"]
    # Rows every 3 steps, the rest at the end, an "eval" row per epoch.
    assert [(r["kind"], r["epoch"], r["step"]) for r in rows] == [
        ("step", "1", "3"), ("eval", "1", "4"), ("step", "2", "6"),
        ("step", "2", "8"), ("eval", "2", "8")]
    for r in rows:
        for column in ("train_loss", "grad_norm", "tokens_per_s",
                       "ms_per_step"):
            assert float(r[column]) > 0, (column, r)
        if r["kind"] == "step":
            assert float(r["lr"]) > 0 and r["val_loss"] == "", r
        else:
            assert float(r["val_loss"]) > 0 and float(r["epoch_s"]) > 0, r
    png = run_dir / "gpt_kjv" / "loss.png"
    if has_matplotlib():
        assert png.read_bytes().startswith(PNG_SIGNATURE)
    else:
        assert "no loss.png: matplotlib is missing" in out, out


@needs_fashion_mnist
def test_plain_cnn_without_matplotlib_writes_the_csv_here(tmp_path):
    # A matplotlib that fails to import, ahead of the real one.
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("hidden")\n')
    work = tmp_path / "work"
    work.mkdir()
    rc, out = run([cluster.PYTHON,
                   os.path.join(EXAMPLES, "cnn_fashion_mnist.py"), "--plain",
                   "--threads=1", "--max_steps=12", "--log_every=5"], work,
                  {"PYTHONPATH": f"{tmp_path / 'fake'}:"
                   f"{os.path.join(cluster.BUILD, 'worker', 'python')}"})
    assert rc == 0, out
    assert "final: epoch=1 step=12 test_accuracy=" in out, out
    assert "no loss.png: matplotlib is missing (hidden" in out, out
    assert sorted(os.listdir(work)) == ["metrics.csv"]  # the default: here
    header, rows = read_csv(work / "metrics.csv")
    assert header[-1] == "test_accuracy" and "samples_per_s" in header
    assert [(r["kind"], r["step"]) for r in rows] == [
        ("step", "5"), ("step", "10"), ("step", "12"), ("eval", "12")]
    assert all(r["grad_norm"] == "" for r in rows)  # no clipping
    assert 0 < float(rows[-1]["test_accuracy"]) <= 1


def test_the_launchers_run_directory_is_refused(tmp_path):
    rc, out = run([cluster.PYTHON,
                   os.path.join(EXAMPLES, "cnn_fashion_mnist.py"), "--plain",
                   f"--run_dir={tmp_path}"], tmp_path,
                  {"SHARDPS_RUN_DIR": str(tmp_path)})
    assert rc != 0
    assert "is shardps-local's run directory" in out, out


@needs_fashion_mnist
def test_batchnorm_cnn_evaluates_the_same_on_every_rank(tmp_path):
    """BatchNorm's running statistics follow the lead's: every rank's model
    evaluates bitwise the same (the examples check it at the end)."""
    rc, out = run([cluster.binary("shardps-local"), "--servers=2",
                   "--workers=2", f"--run_dir={tmp_path / 'run'}",
                   "--timeout_s=300", "--", cluster.PYTHON,
                   os.path.join(EXAMPLES, "cnn_fashion_mnist.py"),
                   "--batchnorm", "--max_steps=12", "--epochs=1"], tmp_path)
    assert rc == 0, out
    assert "BatchNorm" in out, out
    assert ("every rank evaluated the first 256 items: test_accuracy "
            in out), out
    assert "equal on every rank" in out, out
