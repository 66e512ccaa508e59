"""What an example's run records: a progress line every --log_every steps,
metrics.csv (those steps and the evaluations, a row as each happens) and,
at the end, loss.png drawn from metrics.csv. Only the lead records.

metrics.csv, one header and then rows of two kinds:
  kind   "step": the steps since the previous row (--log_every of them, or
         the rest at the end); "eval": an epoch and its evaluation
  epoch, step         1-based epoch; the job's step after the row's last step
  train_loss          mean over the row's steps (under shardps the lead's
                      slice of each global batch, as the epoch line's)
  lr                  the last step's learning rate ("step" rows)
  grad_norm           mean global gradient norm before clipping (when
                      clipping; the servers' under shardps)
  <items>_per_s       tokens or samples per second of step time
  ms_per_step         mean wall time of a step, evaluations excluded
  epoch_s, eval_s     "eval" rows: the epoch's step time, the evaluation's
                      (with the GPT's sample)
  <metric>            "eval" rows: val_loss, test_accuracy
Empty cells are "not measured". A job resumed from a checkpoint appends to
the file (rows from before the restart stay, so a step may appear twice);
one that starts at step 0 starts it over.
"""
import csv
import os
import sys
import time


def run_dir(flag: str, example: str) -> str:
    """The directory for metrics.csv and loss.png: --run_dir, else
    <shardps-local's run directory>/<example> when launched by it (its own
    metrics.csv there is the launcher's, which reads it for its final
    line), else the current directory."""
    launcher = os.environ.get("SHARDPS_RUN_DIR", "")
    if flag:
        if launcher and os.path.realpath(flag) == os.path.realpath(launcher):
            sys.exit(f"--run_dir={flag} is shardps-local's run directory, "
                     "whose metrics.csv the launcher reads as shardps-worker's"
                     f": use a folder inside it (the default: {example})")
        return flag
    return os.path.join(launcher, example) if launcher else "."


def _cell(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


class RunLog:
    """The lead's record of a run (a no-op on the other ranks).

    Args:
      directory: where metrics.csv and loss.png go; created if missing.
      enabled: this rank records (the lead).
      log_every: a "step" row and line every this many steps (0: none).
      items: what the throughput counts ("tokens", "samples").
      metric: the evaluation's figure ("val_loss", "test_accuracy").
      resumed: the job starts past step 0 (append to metrics.csv).
      max_grad_norm: the clipping bound, drawn on the norm panel (0: off).
    """

    def __init__(self, directory: str, enabled: bool, log_every: int,
                 items: str, metric: str, resumed: bool = False,
                 max_grad_norm: float = 0.0):
        self.enabled, self.log_every = enabled, log_every
        self.items, self.metric = items, metric
        self.max_grad_norm = max_grad_norm
        self.csv_path = os.path.join(directory, "metrics.csv")
        self.png_path = os.path.join(directory, "loss.png")
        self.header = ["kind", "epoch", "step", "train_loss", "lr",
                       "grad_norm", f"{items}_per_s", "ms_per_step",
                       "epoch_s", "eval_s", metric]
        self._reset()
        self.lr, self.file = 0.0, None
        if not enabled:
            return
        os.makedirs(directory, exist_ok=True)
        append = resumed and self._same_header()
        # Line-buffered, so that a run that dies leaves its rows.
        self.file = open(self.csv_path, "a" if append else "w", newline="",
                         buffering=1)
        self.writer = csv.writer(self.file, lineterminator="\n")
        if not append:
            self.writer.writerow(self.header)

    def _same_header(self) -> bool:
        try:
            with open(self.csv_path, newline="") as f:
                return next(csv.reader(f), None) == self.header
        except OSError:
            return False

    def _reset(self):
        self.steps, self.seconds, self.count = 0, 0.0, 0
        self.loss_sum, self.norm_sum, self.norm_n = 0.0, 0.0, 0

    def step(self, epoch: int, step: int, loss: float, lr: float, norm,
             items: int, seconds: float) -> None:
        """Records one step (its loss, learning rate, gradient norm or None,
        items and wall seconds); every log_every steps of the job's count
        writes a row and prints a line."""
        if not self.enabled or not self.log_every:
            return
        self.steps += 1
        self.seconds += seconds
        self.count += items
        self.loss_sum += loss
        if norm is not None:
            self.norm_sum += norm
            self.norm_n += 1
        self.lr = lr
        if step % self.log_every == 0:
            self._write_steps(epoch, step)

    def flush(self, epoch: int, step: int) -> None:
        """Writes the steps since the last row, if any (the run's end)."""
        if self.enabled and self.steps:
            self._write_steps(epoch, step)

    def _write_steps(self, epoch: int, step: int) -> None:
        loss = self.loss_sum / self.steps
        norm = self.norm_sum / self.norm_n if self.norm_n else None
        rate = self.count / self.seconds if self.seconds > 0 else None
        ms = 1000 * self.seconds / self.steps
        fields = [f"step {step}", f"loss {loss:.4f}", f"lr {self.lr:.3e}"]
        if norm is not None:
            fields.append(f"grad_norm {norm:.4f}")
        if rate is not None:
            fields.append(f"{self.items}/s {rate:.0f}")
        print(" ".join(fields + [f"ms/step {ms:.1f}"]), flush=True)
        self.writer.writerow(
            ["step", epoch, step, f"{loss:.6f}", f"{self.lr:.6g}",
             _cell(norm, ".6f"), _cell(rate, ".1f"), f"{ms:.2f}", "", "",
             ""])
        self._reset()

    def evaluation(self, epoch: int, step: int, train_loss: float, norm,
                   rate: float, ms_per_step: float, epoch_s: float,
                   eval_s: float, value: float) -> None:
        """The "eval" row of an epoch (what its progress line says)."""
        if not self.enabled:
            return
        self.writer.writerow(
            ["eval", epoch, step, f"{train_loss:.6f}", "", _cell(norm, ".6f"),
             f"{rate:.1f}", f"{ms_per_step:.2f}", f"{epoch_s:.3f}",
             f"{eval_s:.3f}", f"{value:.6f}"])

    def finish(self, title: str) -> None:
        """Closes metrics.csv and draws loss.png from it; without matplotlib
        says so and leaves the CSV alone."""
        if not self.enabled:
            return
        self.file.close()
        start = time.perf_counter()
        try:
            import matplotlib
            matplotlib.use("Agg")  # files only: no display needed
            import matplotlib.pyplot as plt
        except ImportError as e:
            print(f"wrote {self.csv_path}; no loss.png: matplotlib is missing "
                  f"({e}; apt-get install python3-matplotlib)", flush=True)
            return
        with open(self.csv_path, newline="") as f:
            rows = list(csv.DictReader(f))
        plot(plt, rows, self.metric, self.max_grad_norm, title, self.png_path)
        print(f"wrote {self.csv_path} and {self.png_path} "
              f"({time.perf_counter() - start:.1f} s)", flush=True)


def _series(rows, kind: str, column: str):
    """(steps, values) of the rows of `kind` with a value in `column`."""
    points = [(int(r["step"]), float(r[column])) for r in rows
              if r["kind"] == kind and r.get(column)]
    return [p[0] for p in points], [p[1] for p in points]


def plot(plt, rows, metric: str, max_grad_norm: float, title: str,
         path: str) -> None:
    """loss.png: the training loss per logged step and the evaluation per
    epoch above (a loss on the same axis, an accuracy on its own); the
    gradient norm (when clipping) and the learning rate below."""
    fig, (top, bottom) = plt.subplots(
        2, 1, sharex=True, figsize=(9, 6.5),
        gridspec_kw={"height_ratios": [2, 1]})
    top.plot(*_series(rows, "step", "train_loss"), lw=1, color="tab:blue",
             label="train loss (per logged step)")
    evals = _series(rows, "eval", metric)
    label = metric.replace("_", " ") + " (per epoch)"
    if "loss" in metric:
        top.plot(*evals, "o-", color="tab:orange", label=label)
    else:
        right = top.twinx()
        right.plot(*evals, "o-", color="tab:orange", label=label)
        right.set_ylabel(metric.replace("_", " "))
        right.legend(loc="center right")
    top.set_ylabel("loss")
    top.legend(loc="upper right")
    top.grid(alpha=0.3)
    top.set_title(title, fontsize=10)
    norms = _series(rows, "step", "grad_norm")
    if norms[0]:
        bottom.plot(*norms, lw=1, color="tab:green", label="grad norm")
        if max_grad_norm:
            bottom.axhline(max_grad_norm, ls="--", lw=1, color="gray",
                           label=f"clip at {max_grad_norm:g}")
        bottom.set_ylabel("global grad norm")
        bottom.legend(loc="upper left")
        lr_axis = bottom.twinx()
    else:
        lr_axis = bottom
    lr_axis.plot(*_series(rows, "step", "lr"), lw=1, color="tab:red",
                 label="learning rate")
    lr_axis.set_ylabel("learning rate")
    lr_axis.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    lr_axis.legend(loc="upper right")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
