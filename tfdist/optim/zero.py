"""`ZeroUpdate`: the reduce and apply phases of a step with sharded optimizer state.

With `zero` >= 1 the optimizer state of every trainable variable is split
element by element across the N replicas (`ShardLayout`): replica r holds
shard r of every slot (Adam's `m` and `v`, SGD's momentum, ...) and nothing
else. One step, in replica context:

1. **reduce**: `zero=1` all-reduces the gradients (one packed collective) and
   each replica takes its shard of them; `zero=2` reduce-scatters them (one
   packed all-to-all and a local sum), so each replica only ever holds the
   reduced gradient of its own shard.
2. **apply**: each replica copies its shard of every parameter into a shard
   buffer and runs the optimizer's own Keras `update_step` on it, with the
   gradient shard and the slot shards (the slots' storage is replica-local, so
   Keras's reads and assigns touch the shard). Learning-rate schedules, weight
   decay (with its exclusions), `loss_scale_factor` and `clipvalue` act as in
   Keras's `apply`; `optimizer.iterations` advances once per applied step.
   Under a `LossScaleOptimizer` every replica takes the same skip decision (the
   reduced gradients of every shard must be finite) and updates the scale
   identically.
3. **gather**: the updated parameter shards are all-gathered (one packed
   collective) and every replica writes the full parameters back; variable
   constraints then apply to the full value, as in Keras.

With `tensor` > 1 (`tfdist.tensor.TensorMesh`), each replica's part of a
weight is its tensor rank's (a slice of a split weight, all of a replicated
one), and every phase above runs over the replica's data group instead of all
replicas (`MeshShardLayout`): the state of a split weight is 1/(tensor x data)
per device, that of a replicated one 1/data.

This is exact for optimizers whose update is elementwise (each element of the
new variable and slots depends only on the same element of the gradient,
variable and slots, plus scalars): see `ELEMENTWISE` and `elementwise`.
Adafactor, which is not, has its own exact update on shards
(`tfdist.optim.adafactor`, in `SHARDED_UPDATES`).

The user's optimizer object stays `model.optimizer` ("the face": callbacks,
the learning rate and `iterations` read it); only its slots' storage moves
into shards (`shard_keras_variable`), so saving (`save_weights`, `save`,
`tf.train.Checkpoint`, `BackupAndRestore`) writes the full unsharded state,
exactly as an unsharded run, and loading reshards it.
"""

import contextlib
import threading

import keras
import tensorflow as tf

from tfdist.optim import adafactor
from tfdist.sharding.collectives import all_gather, reduce_scatter
from tfdist.sharding.layout import MeshShardLayout
from tfdist.sharding.slots import optimizer_slots
from tfdist.sharding.storage import (
    ShardedStorage, copy_devices, shard_keras_variable, storage_layout)

# Keras optimizers whose `update_step` is elementwise (the class itself, not
# subclasses, which may override it).
ELEMENTWISE = {
    keras.optimizers.SGD, keras.optimizers.Adam, keras.optimizers.AdamW,
    keras.optimizers.Adamax, keras.optimizers.RMSprop, keras.optimizers.Adagrad,
    keras.optimizers.Adadelta, keras.optimizers.Lion,
}
# Keras optimizers that are not elementwise but have an exact update on shards
# in tfdist: a module with `updates(optimizer, gradients, values, layouts,
# indices, learning_rate)` (returns the assignments to make) and
# `replicated_state(optimizer)` (small state every replica keeps whole).
SHARDED_UPDATES = {keras.optimizers.Adafactor: adafactor}
_declared = set()


def elementwise(cls):
    """Declares a custom Keras optimizer class safe to shard element by element.

    Its `update_step(gradient, variable, learning_rate)` must compute each
    element of the new variable and of its slots (variables it made with
    `add_variable_from_reference` / `add_optimizer_variables`) from the same
    element of the gradient, variable and slots and from scalars only (no
    norms, means or reshapes of whole variables), and keep no other state.

    Example:

    ```python
    @tfdist.optim.elementwise
    class SignSGD(keras.optimizers.Optimizer):
        def update_step(self, gradient, variable, learning_rate):
            self.assign_sub(variable, learning_rate * keras.ops.sign(gradient))
    ```
    """
    if not (isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)):
        raise TypeError(
            f"`elementwise` decorates a keras.optimizers.Optimizer subclass, got {cls!r}.")
    _declared.add(cls)
    return cls


def check_shardable(optimizer, zero: int, mode=None, elementwise_only=False):
    """Errors for an optimizer (or options) whose state cannot be sharded exactly.

    `mode` names the option that shards it in the messages (default `zero=...`).
    With `elementwise_only`, optimizers that need their own sharded update
    (`SHARDED_UPDATES`, such as Adafactor) are refused too.
    """
    mode = mode or f"`zero={zero}`"
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    cls = type(inner)
    known = ELEMENTWISE | set(_declared) | (set() if elementwise_only else set(SHARDED_UPDATES))
    if cls not in known:
        names = ", ".join(sorted(c.__name__ for c in ELEMENTWISE | (
            set() if elementwise_only else set(SHARDED_UPDATES))))
        raise ValueError(
            f"{mode} shards optimizer state element by element, which is "
            f"exact only for optimizers whose update is elementwise; tfdist does "
            f"not know {cls.__module__}.{cls.__qualname__} to be. Supported: "
            f"{names}. Declare your own elementwise optimizer with "
            f"`@tfdist.optim.elementwise`, or turn {mode} off.")
    unsupported = {
        "use_ema": inner.use_ema,
        "clipnorm": inner.clipnorm,
        "global_clipnorm": inner.global_clipnorm,
    }
    for name, value in unsupported.items():
        if value:
            raise NotImplementedError(
                f"`{name}={value!r}` on the optimizer is not supported with "
                f"{mode} in this version (it needs whole-variable state "
                f"or norms); turn {mode} off, or use `clipvalue` for clipping.")


class ZeroUpdate:
    """Reduce, sharded apply and gather of one model's gradients (replica context).

    Built once per model (before the first step; it moves the optimizer's slots
    into shards) and called by `TrainStep` in place of its reduce and apply
    phases.

    Args:
        model: a compiled, built `keras.Model` under a tfdist strategy.
        zero: the stage, 1 or 2.

    Example:

    ```python
    update = ZeroUpdate(model, zero=2)     # in TrainStep, once
    update(local_gradients)                # per step, in replica context
    ```
    """

    def __init__(self, model, zero: int):
        check_shardable(model.optimizer, zero)
        self.zero = zero
        self.model = model
        self.scaler = model.optimizer if isinstance(
            model.optimizer, keras.optimizers.LossScaleOptimizer) else None
        self.inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
        strategy = model.distribute_strategy
        # With tensor parallelism each replica updates its tensor rank's part
        # of every weight (a slice if the weight is split, else all of it),
        # sharded across the replicas of its data group.
        self.mesh = getattr(strategy, "tensor_mesh", None)
        tensor = self.mesh.tensor if self.mesh else 1
        self.num_shards = strategy.num_replicas_in_sync // tensor
        self.variables = list(self.inner._trainable_variables)
        # Where each replica's state lives, and its slicing of the local part.
        storage = [MeshShardLayout(v.shape, tensor, self.num_shards, storage_layout(v))
                   for v in self.variables]
        self.layouts = [layout.part for layout in storage]
        with strategy.scope():
            for slot, index in optimizer_slots(self.inner, self.variables, for_sharding=True,
                                               replicated=self._replicated()):
                shard_keras_variable(slot, storage[index], strategy)
            # The parameter shards each replica updates (working buffers).
            self.buffers = [
                ShardedStorage.create(strategy, layout, None,
                                      f"{v.path.replace('/', '_')}_shard", v.dtype,
                                      devices=copy_devices(v, strategy))
                for v, layout in zip(self.variables, storage)
            ]

    def _replicated(self):
        """State every replica keeps whole (not sharded)."""
        rule = SHARDED_UPDATES.get(type(self.inner))
        return rule.replicated_state(self.inner) if rule else []

    def __call__(self, grads):
        """Applies `grads` (this replica's, aligned with `model.trainable_weights`)."""
        index_of = self.inner._get_variable_index
        present = [(index_of(v), g) for v, g in
                   zip(self.model.trainable_weights, grads) if g is not None]
        if not present:
            raise ValueError("No gradients provided for any variable.")
        indices = [i for i, _ in present]
        grads = [tf.convert_to_tensor(g) for _, g in present]
        layouts = [self.layouts[i] for i in indices]
        context = tf.distribute.get_replica_context()
        mesh = self.mesh
        launcher = mesh.data_launcher() if mesh else None
        # This replica's shard index: its place in its data group.
        replica = context.replica_id_in_sync_group // (mesh.tensor if mesh else 1)
        with tf.name_scope("reduce"):
            if self.zero == 1:
                reduced = (mesh.reduce_gradients(grads) if mesh else
                           context.all_reduce(tf.distribute.ReduceOp.SUM, grads))
                shards = [layout.shard(g, replica) for layout, g in zip(layouts, reduced)]
            else:
                shards = _packed_reduce_scatter(grads, layouts, launcher)
                if mesh:  # see TensorMesh.reduce_gradients
                    shards = [g * tf.cast(mesh.tensor, g.dtype) for g in shards]
            # One decision on every replica (of every tensor rank): the
            # shards of all replicas cover every reduced gradient.
            finite = self.scaler and _all_finite(context, shards)
        with tf.name_scope("apply"):
            for i in indices:
                self.buffers[i].assign(self.layouts[i].shard(self.variables[i].value, replica))
            if self.scaler is not None:
                shards = [g / self.scaler.dynamic_scale for g in shards]
            update = self._update(shards, indices)
            if self.scaler is None:
                update()
                applied = 1
            else:
                tf.cond(finite, lambda: self._update_scaled(update),
                        self.scaler._stateful_handle_non_finite_grads)
                applied = tf.cast(finite, self.inner._iterations.dtype)
            # After the update (which reads it), outside the cond (a merge call).
            self.inner._iterations.assign_add(applied)
        with tf.name_scope("gather"):
            updated = [self.buffers[i].value() for i in indices]
            full = _packed_all_gather(updated, layouts, launcher)
            for i, value in zip(indices, full):
                variable = self.variables[i]
                if storage_layout(variable) is not None:
                    variable._value.assign(value)  # this replica's slice
                    continue  # (tensor parallelism keeps constrained weights whole)
                variable.assign(value)
                if variable.constraint is not None:
                    variable.assign(variable.constraint(variable))

    def _update_scaled(self, update):
        """The finite-gradient branch under a LossScaleOptimizer."""
        scaler = self.scaler
        update()

        def upscale():
            scaler.step_counter.assign(0)
            scaler.dynamic_scale.assign(scaler.dynamic_scale * 2.0)

        def increment():
            scaler.step_counter.assign_add(1)

        tf.cond(tf.equal(scaler.step_counter, scaler.dynamic_growth_steps - 1),
                upscale, increment)

    def _update(self, shards, indices):
        """Keras's `apply` (without the counter) on this replica's shards, as
        a function that makes the update (called in the step, or in its
        finite-gradient branch). What needs the other replicas (Adafactor's
        sums) is computed now, so no collective is inside a branch."""
        inner = self.inner
        if inner.loss_scale_factor is not None:
            shards = [g / inner.loss_scale_factor for g in shards]
        shards = inner._clip_gradients(shards)  # clipvalue: elementwise
        learning_rate = inner.learning_rate
        buffers = [self.buffers[i] for i in indices]
        rule = SHARDED_UPDATES.get(type(inner))
        if rule is not None:
            values = [self._decayed(i, b.value(), learning_rate) for i, b in zip(indices, buffers)]
            state, new_values = rule.updates(inner, shards, values,
                                             [self.layouts[i] for i in indices],
                                             indices, learning_rate)
            assignments = state + list(zip(buffers, new_values))
            return lambda: [inner.assign(variable, value) for variable, value in assignments]

        def elementwise():
            for i, buffer in zip(indices, buffers):
                buffer.assign(self._decayed(i, buffer.value(), learning_rate))
            with _indexed_as(inner, buffers, indices):
                for gradient, buffer in zip(shards, buffers):
                    inner.update_step(gradient, buffer, learning_rate)

        return elementwise

    def _decayed(self, index, value, learning_rate):
        """`value` (a shard of variable `index`) after Keras's weight decay."""
        inner = self.inner
        if inner.weight_decay is None or not inner._use_weight_decay(self.variables[index]):
            return value
        lr = tf.cast(learning_rate, value.dtype)
        wd = tf.cast(inner.weight_decay, value.dtype)
        return value - value * wd * lr


def _packed_reduce_scatter(grads, layouts, launcher=None):
    """Reduce-scatter of every gradient, one collective per dtype (over
    `launcher`'s group if given, else every replica)."""
    return _per_dtype(grads, layouts,
                      lambda rows: reduce_scatter(tf.concat(rows, 1), launcher),
                      lambda layout, g: layout.rows(g))


def _packed_all_gather(shards, layouts, launcher=None):
    """Every replica's shards (of `launcher`'s group if given), gathered into
    full values; one collective per dtype."""
    def gather(parts):
        return all_gather(tf.concat(parts, 0), launcher)

    gathered = _per_dtype(shards, layouts, gather, lambda layout, s: s, axis=1)
    return [layout.unshard(rows) for layout, rows in zip(layouts, gathered)]


def _per_dtype(values, layouts, collective, prepare, axis=0):
    """Runs `collective` once per dtype on the concatenated `prepare`d values
    and splits its result back (along `axis`) into per-value shard-size parts."""
    results = [None] * len(values)
    groups = {}
    for position, value in enumerate(values):
        groups.setdefault(value.dtype, []).append(position)
    for positions in groups.values():
        out = collective([prepare(layouts[p], values[p]) for p in positions])
        sizes = [layouts[p].shard_size for p in positions]
        for p, part in zip(positions, tf.split(out, sizes, axis=axis)):
            results[p] = part
    return results


def _all_finite(context, shards):
    """One decision for every replica: are all reduced gradient shards finite?"""
    bad = tf.add_n([tf.reduce_sum(tf.cast(~tf.math.is_finite(s), tf.float32))
                    for s in shards])
    return tf.equal(context.all_reduce(tf.distribute.ReduceOp.SUM, bad), 0.0)


_index_lock = threading.Lock()
_index_depth = {}


@contextlib.contextmanager
def _indexed_as(optimizer, buffers, indices):
    """Makes `optimizer` find each buffer's slots: those of variable `indices[k]`.

    Keras's `update_step` looks its slots up by the variable it updates. The
    replicas of one step trace this together (the keys are the same on all), so
    the entries are reference-counted.
    """
    keys = {optimizer._var_key(b): i for b, i in zip(buffers, indices)}
    table = optimizer._trainable_variables_indices
    with _index_lock:
        depth = _index_depth.get(id(optimizer), 0)
        if depth == 0:
            table.update(keys)
        _index_depth[id(optimizer)] = depth + 1
    try:
        yield
    finally:
        with _index_lock:
            _index_depth[id(optimizer)] -= 1
            if _index_depth[id(optimizer)] == 0:
                del _index_depth[id(optimizer)]
                for key in keys:
                    table.pop(key, None)
