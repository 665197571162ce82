"""`BackupAndRestore` that every task of a multi-worker job can share."""

import hashlib
import json
import os

import keras
import tensorflow as tf

from tfdist._compat.keras_trainer import resume_at_epoch
from tfdist.checkpoint import ShardedCheckpoint
from tfdist.cluster.agreement import gather_from_tasks
from tfdist.cluster.tf_config import read_tf_config
from tfdist.engine import modes


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """Keras's `BackupAndRestore`, safe for the tasks of one job sharing `backup_dir`.

    Keras 3's callback lets every task write (and, at the end, delete) the
    backup: tasks race on the files, and a task killed just after an epoch keeps
    a backup one epoch older than the others', so after a restart they disagree
    on where to resume and the job hangs. Here only the task that checkpoints
    for the job (the chief, or worker 0 without one: the strategy's
    `extended.should_checkpoint`) writes and deletes the backup, and every task
    restores from it, so all resume at the same step. The backup's files
    are written aside and renamed into place: a save that does not finish
    leaves the previous backup whole, where Keras's in-place write would leave
    a truncated file whose optimizer state a restart silently skips.

    Under a strategy that shards the model's state (`zero`, `tensor`,
    `pipeline`) the backup is a `tfdist.checkpoint.ShardedCheckpoint` in
    `backup_dir/sharded`: each task writes its own shards while training goes
    on, no task gathers a whole tensor, and the restarted job (on any layout)
    reads only its own; so it is too when the step keeps state on each
    replica (the residuals of `compression="topk:..."` / `"powersgd:..."` and
    of `tfdist.optim.OneBitAdam`, which it saves and the restarted job
    continues). Otherwise, and with one task, it is Keras's
    callback.

    Args: as `keras.callbacks.BackupAndRestore`; `backup_dir` must be a
        directory every task reads (a shared volume on Kubernetes, any local
        path under `tfdist launch`).

    Example:

    ```python
    strategy = tfdist.MultiWorkerStrategy()
    with strategy.scope():
        model = build_model()
    model.fit(x, y, epochs=10,
              callbacks=[tfdist.callbacks.BackupAndRestore("/shared/backup")])
    ```
    """

    def on_train_begin(self, logs=None):
        config = getattr(self.model.distribute_strategy, "config", None)
        self._checkpoints = None
        if config is not None and (config.shards_state or
                                   modes.keeps_replica_state(self.model, config)):
            self._checkpoints = ShardedCheckpoint(
                self.model, os.path.join(self.backup_dir, "sharded"),
                max_to_keep=2 if self.double_checkpoint else 1)
        self._check_tasks_restore_one_backup()
        super().on_train_begin(logs)

    def _check_tasks_restore_one_backup(self):
        """Refuses tasks that would resume from different backups (each task its
        own `backup_dir`, not one shared by all): they would train together on
        different weights, and the chief's result would look fine."""
        strategy = self.model.distribute_strategy
        timeout = getattr(strategy, "timeout_seconds", None)
        if timeout is None:
            return  # not a MultiWorkerStrategy: one process reads the files
        found = self._backup_found()
        task = read_tf_config()
        own = {"task": task.task if task else "local", "backup": found}
        backups = gather_from_tasks(strategy, own, timeout,
                                    "comparing the tasks' backups")
        differing = [b for b in backups if b["backup"] != found]
        if differing:
            seen = "; ".join(f"{b['task']}: {_resumes(b['backup'])}"
                             for b in [own, *differing])
            raise ValueError(
                f"The tasks of this job would resume from different backups in "
                f"`backup_dir` {self.backup_dir!r} ({seen}). Every task must read "
                f"one backup: make `backup_dir` a directory all tasks share (a "
                f"shared volume on Kubernetes), or remove the stale backups.")

    def _backup_found(self):
        """The backup's epoch and batch, or None."""
        if self._checkpoints is not None:
            found = self._checkpoints.metadata()
            return None if found is None else {k: found[k] for k in ("epoch", "batch")}
        path = self._training_metadata_path
        if not tf.io.gfile.exists(path):
            return None
        with tf.io.gfile.GFile(path) as f:
            return json.load(f)

    def _writes(self):
        extended = self.model.distribute_strategy.extended
        return getattr(extended, "should_checkpoint", True)

    def _save_model(self):
        if self._checkpoints is not None:
            self._checkpoints.save(metadata={"epoch": self._current_epoch,
                                             "batch": self._last_batch_seen})
        elif self._writes():
            self._save_aside()

    def _save_aside(self):
        """Keras's `_save_model`, each file written aside then renamed over the last."""
        gfile = tf.io.gfile
        gfile.makedirs(self.backup_dir)
        latest = ((self._weights_path, self._prev_weights_path),
                  (self._training_metadata_path, self._prev_training_metadata_path))
        if self.double_checkpoint:
            for path, previous in latest:
                if gfile.exists(path):
                    gfile.copy(path, previous, overwrite=True)
        partial = os.path.join(self.backup_dir, "partial.weights.h5")
        self.model.save_weights(partial, overwrite=True)
        checksum = _sha256(partial)
        gfile.rename(partial, self._weights_path, overwrite=True)
        metadata = {"epoch": self._current_epoch, "batch": self._last_batch_seen,
                    "weights_sha256": checksum}
        partial = os.path.join(self.backup_dir, "partial_training_metadata.json")
        with gfile.GFile(partial, "w") as f:
            f.write(json.dumps(metadata))
        gfile.rename(partial, self._training_metadata_path, overwrite=True)

    def _load_model(self):
        """Keras's, after checking the weights file against the checksum the
        backup recorded: a corrupted or truncated file raises OSError (and
        Keras falls back to the previous backup, if it keeps one) instead of
        loading wrong weights or failing inside h5py."""
        if self._checkpoints is not None:
            found = self._checkpoints.restore()
            if found is not None:
                resume_at_epoch(self.model, found["epoch"])
            return
        gfile = tf.io.gfile
        if gfile.exists(self._training_metadata_path) and gfile.exists(self._weights_path):
            with gfile.GFile(self._training_metadata_path) as f:
                expected = json.load(f).get("weights_sha256")
            if expected is not None and _sha256(self._weights_path) != expected:
                raise OSError(
                    f"The backup's weights file {self._weights_path} does not match "
                    f"the checksum its backup recorded: it was corrupted or cut short "
                    f"after it was written. Remove `backup_dir` "
                    f"{self.backup_dir!r} to start over, or restore it from a copy.")
        super()._load_model()

    def on_train_end(self, logs=None):
        if self._checkpoints is not None:
            self._checkpoints.wait()
            if self._checkpoints.tasks > 1:  # every task is done with the files
                gather_from_tasks(self.model.distribute_strategy, {},
                                  self._checkpoints.timeout_seconds, "ending training's backups")
            if self._checkpoints.task != 0:
                return
        elif not self._writes():
            return
        super().on_train_end(logs)


def _sha256(path):
    digest = hashlib.sha256()
    with tf.io.gfile.GFile(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _resumes(backup):
    if backup is None:
        return "no backup, starts at epoch 1"
    return f"resumes at epoch {backup['epoch'] + 1}"
