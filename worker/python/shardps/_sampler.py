"""DistributedSampler: this rank's indices of each global batch, as
shardps-worker splits them."""

import torch

from . import _shardps
from ._context import _context_or


class DistributedSampler:
    """This rank's part of each global batch, as shardps-worker splits it.

    Each epoch is a seeded permutation of range(num_samples) (the same as
    shardps-worker's for the same seed); global batch s of the epoch is
    positions [s*batch_size, (s+1)*batch_size) of it, the last partial
    batch dropped, and each rank takes a contiguous slice of it. The ranks
    sharing the batches are asked at every epoch start, so the data is
    re-sharded when workers leave or join.

    The sampler follows the job's step: `start_epoch` is where the servers
    are (a restored checkpoint's epoch), epoch(e) starts at the position
    inside it, and after a rollback it goes back to the step the job went
    back to. Call opt.step() once for every batch it yields. A job resumed
    from a torch.save file starts its servers at step 0: load_state_dict
    puts the data where the file's job was (the offset holds for the
    job's life).

    Create it after the DistributedOptimizer (a worker that joins a running
    job waits here for the next epoch start).
    """

    def __init__(self, num_samples, batch_size, seed=0, context=None):
        self._ctx = _context_or(context)
        if batch_size < 1 or batch_size > num_samples:
            raise ValueError(f"batch_size={batch_size} must be in [1, "
                             f"num_samples={num_samples}]")
        if batch_size < self._ctx.num_workers:
            raise ValueError(
                f"batch_size={batch_size} is smaller than the "
                f"{self._ctx.num_workers} workers: each needs a sample")
        self.num_samples = int(num_samples)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.steps_per_epoch = self.num_samples // self.batch_size
        self._started = False
        # The epoch and step of the batch yielded last: after a rollback
        # across an epoch's start, epoch(e) yields the earlier epoch's
        # remaining batches first.
        self.batch_epoch, self.batch_step = None, None
        # Data step - job step: from load_state_dict.
        self._offset = 0
        self._perm = (None, None)   # (epoch, permutation)
        self._ranks = (None, None)  # (epoch, ranks)

    def _start(self):
        if not self._started:
            if self._ctx._optimizer is None:
                raise RuntimeError("create the DistributedOptimizer before "
                                   "using the DistributedSampler")
            # A worker new to a running job joins here, at an epoch start,
            # and takes the job's weights.
            self._ctx.session.start_epochs(self.steps_per_epoch)
            self._ctx._optimizer._load_weights()
            self._started = True

    def __len__(self):
        return self.steps_per_epoch

    @property
    def start_epoch(self):
        """The epoch (from 0) the job is in: 0 for a new job, the restored
        checkpoint's epoch after a restart."""
        self._start()
        return self._data_step() // self.steps_per_epoch

    def _data_step(self):
        return self._ctx.session.step + self._offset

    def state_dict(self):
        """Where the data is (the global batch the next step trains, from
        the first epoch's first) and the sampler's settings; save it with
        the model and the optimizer's state_dict."""
        return {"step": self._data_step(), "num_samples": self.num_samples,
                "batch_size": self.batch_size, "seed": self.seed}

    def load_state_dict(self, state_dict):
        """Continues at a state_dict's position: this job's next step
        trains the batch the saved job's next step would have. Call it on
        every rank, before the first epoch().

        Raises:
            ValueError: another num_samples, batch_size or seed (another
                data order), or a step that is missing, not an int or < 0.
        """
        for key in ("num_samples", "batch_size", "seed"):
            if state_dict.get(key) != getattr(self, key):
                raise ValueError(
                    f"the sampler's state_dict has {key}="
                    f"{state_dict.get(key)!r}; this sampler has "
                    f"{getattr(self, key)!r} (another data order)")
        step = state_dict.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"the sampler's state_dict has step {step!r}: "
                             "an int >= 0 is expected")
        self._offset = step - self._ctx.session.step

    def _permutation(self, epoch):
        if self._perm[0] != epoch:
            # shardps-worker numbers its epochs from 1.
            self._perm = (epoch, _shardps.epoch_permutation(
                self.num_samples, self.seed, epoch + 1))
        return self._perm[1]

    def epoch(self, epoch):
        """Yields this rank's indices (a torch.LongTensor) of each global
        batch of `epoch` (from 0) that the job has not trained yet."""
        self._start()
        session = self._ctx.session
        spe = self.steps_per_epoch
        fresh = True
        while True:
            job_step = session.step
            step = self._data_step()
            at = step // spe
            if at > epoch:
                return
            if fresh or self._ranks[0] != at or step % spe == 0:
                self._ranks = (at, session.active_ranks())
            fresh = False
            ranks = self._ranks[1]
            position = ranks.index(self._ctx.rank)
            begin, end = _shardps.worker_slice(
                (step - at * spe) * self.batch_size, self.batch_size,
                position, len(ranks))
            self._ctx.grad_scale = (len(ranks) * (end - begin) /
                                    self.batch_size)
            perm = self._permutation(at)
            self.batch_epoch, self.batch_step = at, step
            yield torch.from_numpy(perm[begin:end])
            if session.step == job_step:
                raise RuntimeError(
                    f"opt.step() was not called for the batch of step {step}: "
                    "call it once for every batch the sampler yields")
            if session.step != job_step + 1:
                fresh = True  # the job went back (or on): ask the ranks
            session.set_progress(session.step,
                                 self._data_step() // spe + 1)
