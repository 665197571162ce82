"""`ShardedUpdate`: the update part of a step with sharded optimizer state (ZeRO).

With `zero` >= 1 the optimizer state of every trainable variable is split
element by element across the N replicas (`ShardLayout`): replica r holds
shard r of every slot (Adam's `m` and `v`, SGD's momentum, ...) and nothing
else. One step, in replica context:

1. **reduce** (`tfdist.engine.reduce.ShardedReduce`): `zero=1` all-reduces the
   gradients (one packed collective) and each replica takes its shard of
   them; `zero=2` reduce-scatters them (one packed all-to-all and a local
   sum), so each replica only ever holds the reduced gradient of its own shard.
2. **apply** (`ShardedUpdate`, from here on): each replica copies its shard
   of every parameter into a shard buffer and runs the optimizer's own Keras
   `update_step` on it, with the
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

import keras
import tensorflow as tf

from tfdist import sparse_gradients
from tfdist._compat import keras_optimizer
from tfdist._compat.keras_optimizer import slots_found_by
from tfdist._compat.tf_distribute import summed_across_replicas
from tfdist._compat.tf_function import sharing_a_trace
from tfdist._compat.tf_variables import storage_of
from tfdist.optim import adafactor
from tfdist.sharding.collectives import non_finite_count, packed_all_gather
from tfdist.sharding.keys import optimizer_keys_follow
from tfdist.sharding.layout import MeshShardLayout
from tfdist.sharding.slots import optimizer_slots
from tfdist.sharding.storage import (
    ShardedStorage,
    copy_devices,
    shard_keras_variable,
    storage_layout,
)

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
    check_options(inner, mode)


def check_options(optimizer, mode):
    """Errors for optimizer options that need whole variables (EMA, norms).

    Example:

    ```python
    check_options(keras.optimizers.Adam(clipnorm=1.0), "`zero=1`")  # raises
    ```
    """
    unsupported = {
        "use_ema": optimizer.use_ema,
        "clipnorm": optimizer.clipnorm,
        "global_clipnorm": optimizer.global_clipnorm,
    }
    for name, value in unsupported.items():
        if value:
            raise NotImplementedError(
                f"`{name}={value!r}` on the optimizer is not supported with "
                f"{mode} in this version (it needs whole-variable state "
                f"or norms); turn {mode} off, or use `clipvalue` for clipping.")


def updates_in_backward(optimizer, zero: int) -> bool:
    """Whether `zero`'s units apply each weight's update as soon as its
    gradient shard is complete (`ShardedUpdate.apply`, in the step's
    backward): at zero=3, unless a skip on non-finite gradients (loss
    scaling) needs every gradient first, or the update sums across replicas
    (`SHARDED_UPDATES`). No optimizer yet: as its default would.

    Example:

    >>> updates_in_backward(keras.optimizers.Adam(), 3), updates_in_backward(None, 2)
    (True, False)
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return (zero == 3 and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
            and type(inner) not in SHARDED_UPDATES)


class ShardedUpdate:
    """Sharded apply and gather of one model's reduced gradient shards
    (replica context).

    Built once per model (before the first step; it moves the optimizer's slots
    into shards) and called by `TrainStep` as its update part, after a
    `ShardedReduce` over `layouts`.

    Args:
        model: a compiled, built `keras.Model` under a tfdist strategy.
        zero: the stage, 1, 2 or 3.
        mesh: the strategy's `replica_mesh`: with tensor groups each replica
            updates its tensor rank's part of every weight, sharded over its
            data group.
        optimizer: the optimizer that applies (default: the model's compiled
            one).

    Example:

    ```python
    mesh = strategy.replica_mesh
    update = ShardedUpdate(model, 2, mesh)                           # once
    reduce = ShardedReduce(update.layouts, 2, mesh, AllReduce())     # once
    update(reduce(local_gradients))   # per step, in replica context
    ```
    """

    def __init__(self, model, zero: int, mesh, optimizer=None):
        optimizer = optimizer or model.optimizer
        self._check(optimizer, zero)
        self.zero = zero
        self.model = model
        self.scaler = optimizer if isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer) else None
        self.inner = getattr(optimizer, "inner_optimizer", optimizer)
        self.in_backward = updates_in_backward(optimizer, zero)
        strategy = model.distribute_strategy
        # With tensor parallelism each replica updates its tensor rank's part
        # of every weight (a slice if the weight is split, else all of it),
        # sharded across the replicas of its data group.
        self.mesh = mesh
        self._update_step_of = {}  # optimizer index -> its buffer's shared update
        tensor = mesh.tensor
        self.num_shards = strategy.num_replicas_in_sync // tensor
        self.variables = self._optimizer_variables()
        # Where each replica's state lives, and its slicing of the local part.
        storage = [_state_layout(v, tensor, self.num_shards) for v in self.variables]
        # Layouts by optimizer index, and aligned with the model's weights.
        self._by_index = [layout.part for layout in storage]
        self.layouts = [self._by_index[self._index_of(v)] for v in model.trainable_weights]
        with strategy.scope():
            self._shard_slots(optimizer_slots(self.inner, self.variables, for_sharding=True,
                                              replicated=self._replicated()),
                              storage, strategy)
            if zero == 3:  # the parameters themselves, sharded: updated in place
                with optimizer_keys_follow(model):
                    self.buffers = [shard_keras_variable(v, layout, strategy)
                                    for v, layout in zip(self.variables, storage)]
            else:  # the parameter shards each replica updates (working buffers)
                self.buffers = [
                    ShardedStorage.create(strategy, layout, None, f"{_flat_name(v)}_shard",
                                          v.dtype, devices=copy_devices(v, strategy))
                    for v, layout in zip(self.variables, storage)
                ]

    # The optimizer's interface, Keras 3's here (a subclass gives tf_keras's).

    def _check(self, optimizer, zero):
        """Refuses an optimizer whose state cannot be sharded exactly."""
        check_shardable(optimizer, zero)

    def _optimizer_variables(self):
        """The variables the optimizer updates, in its own order."""
        return list(keras_optimizer.trainable_variables_of(self.inner))

    def _index_of(self, variable):
        """The position of a model variable in the optimizer's slot lists."""
        return keras_optimizer.variable_index(self.inner, variable)

    def _shard_slots(self, slots, storage, strategy):
        """Moves each (slot, variable index) of `slots` into shards laid out
        as `storage[index]` (values kept)."""
        for slot, index in slots:
            shard_keras_variable(slot, storage[index], strategy)

    def _learning_rate(self):
        return self.inner.learning_rate

    def _update_steps(self, shards, buffers, indices, learning_rate):
        """The optimizer's own `update_step` on each buffer (a shard of
        variable `indices[k]`), finding that variable's slots; each buffer's
        traced once for every replica (`ReplicaSharedFunction`), or inline
        when the caller's trace is already shared (ZeRO-3's units: a function
        per buffer there made the Llama tiny's first step about 0.3 s longer)."""
        learning_rate = tf.convert_to_tensor(learning_rate)
        inline = sharing_a_trace()
        with slots_found_by(self.inner, buffers, indices):
            for gradient, buffer, index in zip(shards, buffers, indices):
                if inline:
                    type(self.inner).update_step(self.inner, gradient, buffer, learning_rate)
                    continue
                if index not in self._update_step_of:
                    self._update_step_of[index] = keras_optimizer.shared_update_step(
                        self.inner, buffer)
                self._update_step_of[index](gradient, learning_rate)

    def _count_step(self, applied):
        """Advances the optimizer's counter by `applied` (0 or 1)."""
        keras_optimizer.iterations_variable(self.inner).assign_add(applied)

    def _replicated(self):
        """State every replica keeps whole (not sharded)."""
        rule = SHARDED_UPDATES.get(type(self.inner))
        return rule.replicated_state(self.inner) if rule else []

    def __call__(self, shards):
        """Applies this replica's gradient `shards` (aligned with
        `model.trainable_weights`, None where a weight has no gradient)."""
        present = [(self._index_of(v), g) for v, g in
                   zip(self.model.trainable_weights, shards) if g is not None]
        indices = [i for i, _ in present]
        shards = [g for _, g in present]
        layouts = [self._by_index[i] for i in indices]
        mesh = self.mesh
        launcher = mesh.data_launcher()
        replica = mesh.data_index()  # this replica's shard: its place in its data group
        with tf.name_scope("apply"):
            # One decision on every replica (of every tensor rank): the
            # shards of all replicas cover every reduced gradient.
            finite = self.scaler and tf.equal(summed_across_replicas(
                non_finite_count([sparse_gradients.values(g) for g in shards])), 0.0)
            if self.zero < 3:  # (zero=3's buffers are the parameters' shards)
                for i in indices:
                    self.buffers[i].assign(self._by_index[i].shard(
                        tf.convert_to_tensor(self.variables[i]), replica))
            if self.scaler is not None:
                scale = self.scaler.dynamic_scale
                shards = [sparse_gradients.map_values(g, lambda v: v / scale) for g in shards]
            update = self._update(shards, indices)
            if self.scaler is None:
                update()
                applied = 1
            else:
                tf.cond(finite, lambda: self._update_scaled(update),
                        keras_optimizer.skip_non_finite_step(self.scaler))
                applied = tf.cast(finite, keras_optimizer.iterations_variable(self.inner).dtype)
            # After the update (which reads it), outside the cond (a merge call).
            self._count_step(applied)
        if self.zero < 3:
            self._gather(indices, layouts, launcher)

    def apply(self, weights, shards):
        """Applies the update of `weights` (model variables) from this
        replica's complete reduced gradient `shards` now, inside the step's
        backward (`in_backward`: ZeRO-3's units, `tfdist.pipeline.program`'s
        `UPDATE`), so each shard is released as soon as it is used; the
        step's call then gets None for them. `optimizer.iterations` still
        advances once, at the step's end.

        Example (in replica context, ZeRO-3's executor):

        ```python
        update.apply(unit_weights, unit_gradient_shards)
        ```
        """
        present = [(self._index_of(v), g) for v, g in zip(weights, shards) if g is not None]
        if present:
            with tf.name_scope("apply"):
                self._update([g for _, g in present], [i for i, _ in present])()

    def _gather(self, indices, layouts, launcher):
        """Every replica writes the updated parameters, gathered from the
        shards, back into its copy."""
        with tf.name_scope("gather"):
            updated = [self.buffers[i].value() for i in indices]
            full = packed_all_gather(updated, layouts, launcher)
            for i, value in zip(indices, full):
                variable = self.variables[i]
                if storage_layout(variable) is not None:
                    storage_of(variable).assign(value)  # this replica's slice
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
        if getattr(inner, "loss_scale_factor", None) is not None:
            shards = [sparse_gradients.map_values(g, lambda v: v / inner.loss_scale_factor)
                      for g in shards]
        shards = keras_optimizer.clip_gradients(inner, shards)  # clipvalue: elementwise
        learning_rate = self._learning_rate()
        buffers = [self.buffers[i] for i in indices]
        rule = SHARDED_UPDATES.get(type(inner))
        if rule is not None:
            values = [self._decayed(i, b.value(), learning_rate) for i, b in zip(indices, buffers)]
            state, new_values = rule.updates(inner, shards, values,
                                             [self._by_index[i] for i in indices],
                                             indices, learning_rate)
            assignments = state + list(zip(buffers, new_values))
            return lambda: [inner.assign(variable, value) for variable, value in assignments]

        def elementwise():
            for i, buffer in zip(indices, buffers):
                if self._decays(i):  # (no write of a shard to itself: a copy per step)
                    buffer.assign(self._decayed(i, buffer.value(), learning_rate))
            self._update_steps(shards, buffers, indices, learning_rate)

        return elementwise

    def _decays(self, index) -> bool:
        """Whether Keras's weight decay applies to variable `index`."""
        inner = self.inner
        return (inner.weight_decay is not None
                and keras_optimizer.uses_weight_decay(inner, self.variables[index]))

    def _decayed(self, index, value, learning_rate):
        """`value` (a shard of variable `index`) after Keras's weight decay."""
        if not self._decays(index):
            return value
        inner = self.inner
        lr = tf.cast(learning_rate, value.dtype)
        wd = tf.cast(inner.weight_decay, value.dtype)
        return value - value * wd * lr




def _state_layout(variable, tensor, data):
    """The `MeshShardLayout` of a variable's optimizer state: its own when it
    was created as shards (`tfdist.sharding.creation`)."""
    layout = storage_layout(variable)
    if isinstance(layout, MeshShardLayout):
        return layout
    return MeshShardLayout(variable.shape, tensor, data, layout)


def _flat_name(variable):
    """A variable's path (Keras 3) or name (tf_keras), as one name."""
    name = getattr(variable, "path", None) or variable.name.split(":")[0]
    return name.replace("/", "_")
