"""Sharded checkpoints: each task writes what it holds, and reads what it needs.

`ShardedCheckpoint` saves a model's weights and its optimizer's variables as
one TensorFlow checkpoint of full-shape tensors, but no task ever holds a
whole tensor to do it: each task writes the pieces its replicas hold (a ZeRO
element shard, a tensor rank's slice, a stage's weights) as slices of the
full tensor, each piece once (by its first holder), and the committing task
merges the tasks' files into one checkpoint (`MergeV2Checkpoints`: the files
are renamed, not copied). Loading reads, for each of a task's shards, only
the slices it covers (`RestoreV2` assembles a slice from the pieces it
overlaps), so a checkpoint loads into any mesh, `zero` level, tensor or
pipeline size, number of workers, or one device and plain Keras.

A save is atomic: every task writes into a staging directory, and the
committing task (the one holding replica 0) renames it into place once every
task's part is there and then points `latest` at it. A task killed during a
save leaves the previous checkpoint whole and `latest` on it. With
`asynchronous=True` (the default) `save` returns once the pieces are read;
the files are written on a thread while training goes on, and the next
`save`, `wait` or `restore` waits for them.

The checkpoint's tensors are named `model/<i>` (the i-th of `model.weights`),
`optimizer/<i>` (of `model.optimizer.variables`) and `state/<name>` (the
step's per-replica state, `tfdist.sharding.replica_state`: error-feedback
residuals, one row per replica); `index.json` beside them
records each one's Keras path, shape and dtype, and `metadata`. State saved
but not yet made when `restore` runs (`fit` restores a backup before its
first step prepares the step) is restored when the step makes it. Any
TensorFlow reader gives the full tensors:
`tf.train.load_checkpoint(path + "/ckpt").get_tensor("model/0")`.

Example:

```python
checkpoints = tfdist.checkpoint.ShardedCheckpoint(model, "/shared/ckpt")
checkpoints.save()               # returns once this task's shards are read
...
checkpoints.restore()            # in another job, on any mesh: {'step': 1000}
```
"""

import concurrent.futures
import json
import os
import shutil
import time
import uuid

import numpy as np
import tensorflow as tf

from tfdist._compat import tf_variables
from tfdist._compat.tf_distribute import lost_peer, replica_id_in_sync_group
from tfdist.cluster.agreement import gather_from_tasks
from tfdist.sharding.layout import AxisLayout, MeshShardLayout, ShardLayout
from tfdist.sharding.replica_state import state_of
from tfdist.sharding.storage import ShardedStorage

_FORMAT = "tfdist-sharded-checkpoint-1"
_STATE = "state/"  # the prefix of the step's per-replica state's keys
_LATEST = "latest"
_POLL_SECONDS = 0.05
_PEER_CHECK_SECONDS = 1.0  # how often a save's wait asks whether its peers are alive


class ShardedCheckpoint:
    """Saves and restores `model`'s state in `directory`, each task its shards.

    Args:
        model: a built Keras model (compiled, for its optimizer's state),
            under any tfdist strategy, or none.
        directory: where checkpoints go; under `MultiWorkerStrategy` one
            directory every task reads and writes (a shared volume).
        max_to_keep: how many committed checkpoints to keep (the oldest are
            deleted after each commit).
        asynchronous: write the files on a thread while training goes on.
        timeout_seconds: how long a save waits for the other tasks' files
            (default: the strategy's `timeout_seconds`, else 300).

    Example:

    ```python
    checkpoints = ShardedCheckpoint(model, "/shared/ckpt", max_to_keep=2)
    checkpoints.save(step=1000, metadata={"epoch": 3})
    checkpoints.wait()               # the files are written and committed
    ShardedCheckpoint(other_model, "/shared/ckpt").restore()   # {'step': 1000, 'epoch': 3}
    ```
    """

    def __init__(self, model, directory, max_to_keep: int = 3, asynchronous: bool = True,
                 timeout_seconds: float | None = None):
        strategy = model.distribute_strategy
        if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
            raise NotImplementedError(
                "`ShardedCheckpoint` does not support ParameterServerStrategy (its "
                "variables live on the parameter servers); save with "
                "`model.save_weights` from the chief.")
        if "://" in os.fspath(directory):
            raise ValueError(
                f"`directory` must be a path of a POSIX file system every task shares, got "
                f"{os.fspath(directory)!r}: a commit renames a directory, which object "
                f"stores do not do atomically. Mount the bucket, or save with "
                f"`model.save_weights`.")
        if not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"`max_to_keep` must be an int >= 1, got {max_to_keep!r}.")
        self.model = model
        self.directory = os.fspath(directory)
        self.max_to_keep = max_to_keep
        self.asynchronous = asynchronous
        self.timeout_seconds = (timeout_seconds if timeout_seconds is not None else
                                getattr(strategy, "timeout_seconds", 300.0))
        self._strategy = strategy
        # The sync-group id of each local replica (one replica without a strategy).
        try:
            local = len(strategy.extended.worker_devices)
        except RuntimeError:  # the default strategy (a model made outside any scope)
            local = 0
        self._replicas = [replica_id_in_sync_group(strategy.extended, i)
                          for i in range(local)] or [0]
        self.task = self._replicas[0] // len(self._replicas)
        self.tasks = strategy.num_replicas_in_sync // len(self._replicas)
        self._writer = None  # one thread for every asynchronous save
        self._pending = None  # the last save's future

    def save(self, step: int | None = None, metadata: dict | None = None) -> str:
        """Saves the current state as checkpoint `step` (default: the
        optimizer's step count) with `metadata` (a JSON-serialisable dict,
        returned by `restore`). Every task must call it at the same point.
        Returns the checkpoint's directory name.

        Example:

        ```python
        checkpoints.save(metadata={"epoch": epoch})
        ```
        """
        self.wait()
        if step is None:
            optimizer = getattr(self.model, "optimizer", None)
            step = optimizer.iterations.numpy() if optimizer is not None else 0
        save_id = uuid.uuid4().hex
        if self.tasks > 1:
            save_id = gather_from_tasks(self._strategy, {"id": save_id}, self.timeout_seconds,
                                        "agreeing on a checkpoint's name")[0]["id"]
        name = f"ckpt-{int(step)}-{save_id[:8]}"
        variables = self._variables()
        names, slices, tensors = [], [], []
        for key, variable in variables:
            for spec, tensor in _own_pieces(variable, self._replicas):
                names.append(key)
                slices.append(spec)
                tensors.append(tensor)
        index = {"format": _FORMAT, "step": int(step), "id": save_id,
                 "metadata": dict(metadata or {}), "tasks": self.tasks,
                 "variables": [{"key": key, "path": getattr(v, "path", v.name),
                                "shape": list(v.shape),
                                "dtype": tf.as_dtype(v.dtype).name} for key, v in variables]}
        # (Here, not on the thread, a metadata that is not JSON-serialisable is refused.)
        work = (name, save_id, names, slices, tensors, json.dumps(index))
        if self.asynchronous:
            if self._writer is None:  # (Python's exit waits for its last save)
                self._writer = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="tfdist-checkpoint")
            self._pending = self._writer.submit(self._write, *work)
        else:
            self._write(*work)
        return name

    def wait(self):
        """Waits until the last `save` is committed; raises what stopped it.

        Example:

        ```python
        checkpoints.wait()
        ```
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def latest(self) -> str | None:
        """The directory name of the last committed checkpoint, or None.

        Example:

        ```python
        checkpoints.latest()   # 'ckpt-100-3f2a9c1e'
        ```
        """
        path = os.path.join(self.directory, _LATEST)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return f.read().strip() or None

    def restore(self, name: str | None = None) -> dict | None:
        """Loads checkpoint `name` (default: the latest) into the model, each
        replica reading only its own pieces. Returns the checkpoint's
        metadata with its `step`, or None when there is no checkpoint yet.

        Example:

        ```python
        found = checkpoints.restore()
        initial_epoch = found["epoch"] if found else 0
        ```
        """
        self.wait()
        index = self._index(name)
        if index is None:
            return None
        path = os.path.join(self.directory, index["name"])
        optimizer = getattr(self.model, "optimizer", None)
        saved_optimizer = any(v["key"].startswith("optimizer/") for v in index["variables"])
        if saved_optimizer and optimizer is not None and not optimizer.built:
            with self._strategy.scope():
                optimizer.build(self.model.trainable_variables)
        variables = self._variables()
        state = [v for v in index["variables"] if v["key"].startswith(_STATE)]
        _check_match([v for v in index["variables"] if v not in state],
                     [(k, v) for k, v in variables if not k.startswith(_STATE)], path)
        prefix = os.path.join(path, "ckpt")
        for key, variable in variables:
            if not key.startswith(_STATE):
                _restore_variable(prefix, key, variable, self._replicas)
        self._restore_state(prefix, state, dict(variables), path)
        return {"step": index["step"], **index["metadata"]}

    def _restore_state(self, prefix, saved, variables, path):
        """Restores the step's saved per-replica state: now where it exists,
        else when the step makes it (`ReplicaState.pending`)."""
        replica_state = state_of(self.model)
        for entry in saved:
            key = entry["key"]

            def restore(variable, key=key, entry=entry):
                if entry["shape"][0] != variable.shape[0]:
                    raise ValueError(
                        f"The checkpoint {path!r} holds the step's {key} of "
                        f"{entry['shape'][0]} replicas (one row each: a compression's "
                        f"residuals), but this job has {variable.shape[0]}: resume on "
                        f"{entry['shape'][0]} replicas, or load the weights alone "
                        f"(`model.load_weights`) and start with zero residuals.")
                _check_match([entry], [(key, variable)], path)
                _restore_variable(prefix, key, variable, self._replicas)

            if key in variables:
                restore(variables[key])
            else:
                replica_state.pending[key[len(_STATE):]] = restore

    def metadata(self, name: str | None = None) -> dict | None:
        """The metadata and `step` of checkpoint `name` (default: the latest),
        without loading it; None when there is no checkpoint yet.

        Example:

        ```python
        checkpoints.metadata()   # {'step': 1000, 'epoch': 3}
        ```
        """
        index = self._index(name)
        return None if index is None else {"step": index["step"], **index["metadata"]}

    def _index(self, name):
        name = name or self.latest()
        if name is None:
            return None
        with open(os.path.join(self.directory, name, "index.json")) as f:
            return {**json.load(f), "name": name}

    def _variables(self):
        """(key, variable) of the model's weights, its optimizer's variables
        and its step's per-replica state."""
        found = [(f"model/{i}", v) for i, v in enumerate(self.model.weights)]
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            found += [(f"optimizer/{i}", v) for i, v in enumerate(optimizer.variables)]
        found += [(f"{_STATE}{name}", v) for name, v in state_of(self.model).variables.items()]
        return found

    def _write(self, name, save_id, names, slices, tensors, index_json):
        """Writes this task's part; the committing task then merges and commits."""
        staging = os.path.join(self.directory, f".staging-{save_id}")
        os.makedirs(staging, exist_ok=True)
        prefix = _part_prefix(staging, self.task)
        if names:
            tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=slices,
                              tensors=tensors)
        _write_atomically(os.path.join(staging, f"task-{self.task}.done"), "")
        if self.task == 0:
            self._commit(name, staging, index_json)
        else:  # committed once `latest` names it (task 0 renames the directory first)
            _wait_for(lambda: self.latest() == name, self.timeout_seconds,
                      f"task 0 to commit checkpoint {name!r} in {self.directory!r}",
                      lambda: lost_peer(self._strategy))

    def _commit(self, name, staging, index_json):
        done = [os.path.join(staging, f"task-{t}.done") for t in range(self.tasks)]
        _wait_for(lambda: all(os.path.exists(p) for p in done), self.timeout_seconds,
                  lambda: (f"the other tasks' parts of checkpoint {name!r} (missing: " + ", ".join(
                      f"task {t}" for t, p in enumerate(done) if not os.path.exists(p)) + ")"),
                  lambda: lost_peer(self._strategy))
        # (A task that holds no piece wrote no part.)
        parts = [prefix for prefix in (_part_prefix(staging, t) for t in range(self.tasks))
                 if os.path.exists(f"{prefix}.index")]
        tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=parts,
                                      destination_prefix=os.path.join(staging, "ckpt"),
                                      delete_old_dirs=True)
        for marker in done:
            os.remove(marker)
        _write_atomically(os.path.join(staging, "index.json"), index_json)
        os.rename(staging, os.path.join(self.directory, name))
        _write_atomically(os.path.join(self.directory, _LATEST), name)
        self._prune(name)

    def _prune(self, newest):
        """Deletes the oldest checkpoints beyond `max_to_keep`, and staging
        directories of saves that never committed."""
        committed = []
        for entry in os.listdir(self.directory):
            path = os.path.join(self.directory, entry)
            if entry.startswith(".staging-"):
                shutil.rmtree(path, ignore_errors=True)
            elif entry.startswith("ckpt-") and entry != newest and \
                    os.path.exists(os.path.join(path, "index.json")):
                committed.append((os.path.getmtime(os.path.join(path, "index.json")), entry))
        for _, entry in sorted(committed)[:max(0, len(committed) + 1 - self.max_to_keep)]:
            shutil.rmtree(os.path.join(self.directory, entry), ignore_errors=True)


def _part_prefix(staging, task):
    """Where task `task` writes its part of a save being staged in `staging`."""
    return os.path.join(staging, f"task-{task}", "part")


def flat_rectangles(start: int, stop: int, shape) -> list:
    """The elements `[start, stop)` of a row-major tensor of `shape` as
    rectangles `(offsets, lengths)`, in element order: at most 2 per axis.

    Example:

    >>> flat_rectangles(3, 12, (3, 5))   # row 0's last 2, row 1, row 2's first 2
    [([0, 3], [1, 2]), ([1, 0], [1, 5]), ([2, 0], [1, 2])]
    """
    shape = list(shape)
    if start >= stop:
        return []
    if not shape:
        return [([], [])]
    if len(shape) == 1:
        return [([start], [stop - start])]
    inner = int(np.prod(shape[1:]))
    first, offset = divmod(start, inner)
    last, end = divmod(stop, inner)
    if first == last:
        return [([first, *o], [1, *n]) for o, n in flat_rectangles(offset, end, shape[1:])]
    found = []
    if offset:
        found += [([first, *o], [1, *n]) for o, n in flat_rectangles(offset, inner, shape[1:])]
        first += 1
    if last > first:
        found.append(([first, *[0] * (len(shape) - 1)], [last - first, *shape[1:]]))
    if end:
        found += [([last, *o], [1, *n]) for o, n in flat_rectangles(0, end, shape[1:])]
    return found


def _slice_spec(shape, offsets, lengths) -> str:
    """TensorFlow's `shape_and_slices` entry: "" for the whole tensor."""
    if list(lengths) == list(shape):
        return ""
    return " ".join(map(str, shape)) + " " + ":".join(
        f"{o},{n}" for o, n in zip(offsets, lengths))


def _shard_rectangles(layout, replica: int):
    """(rectangles of the full tensor, in the order of the shard's elements;
    whether replica `replica` is the first to hold them)."""
    shape = layout.shape.as_list()
    if isinstance(layout, ShardLayout):
        return _element_rectangles(layout, replica), True
    if isinstance(layout, AxisLayout):
        rank = replica % layout.parts
        offsets, lengths = [0] * len(shape), list(shape)
        offsets[layout.axis] = rank * layout.shard_shape[layout.axis]
        lengths[layout.axis] = layout.shard_shape[layout.axis]
        return [(offsets, lengths)], replica < layout.parts
    if isinstance(layout, MeshShardLayout):
        rank = replica % layout.tensor
        found = _element_rectangles(layout.part, replica // layout.tensor)
        if layout.split is None:
            return found, rank == 0
        axis, width = layout.split.axis, layout.split.shard_shape[layout.split.axis]
        for offsets, _ in found:
            offsets[axis] += rank * width
        return found, True
    raise NotImplementedError(f"No sharded checkpoint for a layout of type "
                              f"{type(layout).__name__}.")


def _element_rectangles(layout, index):
    """The rectangles of `layout`'s (a `ShardLayout`) shard `index`, padding left out."""
    start = index * layout.shard_size
    return flat_rectangles(start, min(layout.size, start + layout.shard_size),
                           layout.shape.as_list())


def _own_pieces(variable, replicas):
    """(slice spec, tensor) of what this task writes of `variable`."""
    storage = _storage(variable)
    shape = list(variable.shape)
    if isinstance(storage, ShardedStorage):
        pieces = []
        for component, replica in zip(storage.values, replicas):
            rectangles, first = _shard_rectangles(storage.layout, replica)
            if not first:
                continue
            with tf.device(component.device):
                flat = tf.reshape(component.read_value(), [-1])
                at = 0
                for offsets, lengths in rectangles:
                    size = int(np.prod(lengths))
                    pieces.append((_slice_spec(shape, offsets, lengths),
                                   tf.reshape(flat[at:at + size], lengths)))
                    at += size
        return pieces
    on_read = isinstance(storage, tf_variables.SyncOnReadVariable)
    if replicas[0] != 0 and not on_read:
        return []
    value = tf.convert_to_tensor(variable)  # (on-read: every task takes part in the read)
    return [("", value)] if replicas[0] == 0 else []


def _storage(variable):
    """The TensorFlow variable behind `variable`: a Keras variable's storage,
    or the step's replica state itself (a `ShardedStorage`)."""
    return variable if isinstance(variable, ShardedStorage) else \
        tf_variables.storage_of(variable)


def _restore_variable(prefix, key, variable, replicas):
    """Assigns `variable` from the checkpoint, reading only its replicas' pieces."""
    storage = _storage(variable)
    shape = list(variable.shape)
    dtype = tf.as_dtype(variable.dtype)
    if not isinstance(storage, ShardedStorage):
        (value,) = tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=[key],
                                        shape_and_slices=[""], dtypes=[dtype])
        variable.assign(value)
        return
    layout = storage.layout
    for component, replica in zip(storage.values, replicas):
        rectangles, _ = _shard_rectangles(layout, replica)
        specs = [_slice_spec(shape, o, n) for o, n in rectangles]
        pieces = tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=[key] * len(specs),
                                      shape_and_slices=specs,
                                      dtypes=[dtype] * len(specs)) if specs else []
        with tf.device(component.device):
            flat = tf.concat([tf.reshape(p, [-1]) for p in pieces], 0) if pieces else \
                tf.zeros([0], dtype)
            missing = int(np.prod(layout.shard_shape)) - int(flat.shape[0])
            if missing:
                flat = tf.pad(flat, [[0, missing]])
            component.assign(tf.reshape(flat, layout.shard_shape))


def _check_match(saved, variables, path):
    """Raises ValueError naming the first variable whose shape or dtype differs."""
    if len(saved) != len(variables):
        counts = {kind: (sum(v["key"].startswith(kind) for v in saved),
                         sum(k.startswith(kind) for k, _ in variables))
                  for kind in ("model/", "optimizer/")}
        raise ValueError(
            f"The checkpoint {path!r} holds {counts['model/'][0]} model weights and "
            f"{counts['optimizer/'][0]} optimizer variables; this model has "
            f"{counts['model/'][1]} and {counts['optimizer/'][1]}. Restore into the model "
            f"(and optimizer) it was saved from.")
    for entry, (key, variable) in zip(saved, variables):
        own = (list(variable.shape), tf.as_dtype(variable.dtype).name)
        if (entry["shape"], entry["dtype"]) != own:
            raise ValueError(
                f"The checkpoint {path!r} holds {key} ({entry['path']!r}) of shape "
                f"{tuple(entry['shape'])} and dtype {entry['dtype']}, but this model's "
                f"{getattr(variable, 'path', variable.name)!r} has shape {tuple(own[0])} "
                f"and dtype {own[1]}.")


def _write_atomically(path, text):
    partial = f"{path}.partial-{uuid.uuid4().hex[:8]}"
    with open(partial, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def _wait_for(ready, timeout_seconds, what, lost):
    """Polls `ready()` until true; TimeoutError naming `what` after
    `timeout_seconds`, and RuntimeError as soon as `lost()` (asked every
    `_PEER_CHECK_SECONDS`) names a task that is down or has restarted: its
    part of the save will never come."""
    def described():
        return what() if callable(what) else what

    deadline = time.monotonic() + timeout_seconds
    check = time.monotonic() + _PEER_CHECK_SECONDS
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"Waited {timeout_seconds:g} s for {described()}: a task "
                               f"stopped or cannot write to the checkpoint directory.")
        if time.monotonic() > check:
            gone = lost()
            if gone is not None:
                raise RuntimeError(f"Stopped waiting for {described()}: task {gone} is down "
                                   f"or has restarted since the save began; the save is "
                                   f"abandoned.")
            check = time.monotonic() + _PEER_CHECK_SECONDS
        time.sleep(_POLL_SECONDS)
