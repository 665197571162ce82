"""Variables created as shards: a model-parallel mode never holds its whole state.

In the scope of a tfdist strategy, `sharded_creation` makes variables as
`ShardedStorage` element shards over the replicas (`MeshShardLayout`, the
layout `ShardedUpdate` gives them with neither `tensor` nor `pipeline`)
instead of one whole copy per replica:

- every trainable variable (a model's weights) with `zero=3`, `tensor` > 1
  or `pipeline` > 1;
- every optimizer slot of its variable's shape (Adam's `m` and `v`, which
  Keras builds colocated with their variable) of such a weight, and with any
  `zero` of any weight.

A variable's initial value is computed whole once, on the task's first
device, each local replica keeps its shard, and the whole value is dropped
before the next variable is made: the values equal a one-device build's
with the same seed, and the largest transient is one variable. Under
`MultiWorkerStrategy` the chief's value is everyone's, as `tf.distribute`
makes it for every variable, but sent in blocks of rows of which each task
keeps its shards' part (`ShardedStorage.agreed`): no task receives it whole.
A variable Keras initialises with zeros (every slot of Adam or of SGD's
momentum, most biases) is made as zero shards: no whole value, nothing
broadcast. Other variables (non-trainable ones, the optimizer's counter,
Adafactor's factors) are made as `tf.distribute` makes them.

With `zero` alone these shards are the step's own. With `tensor` or
`pipeline` they are a holding layout until the first step: splitting a
weight over its tensor group builds each new shard from blocks of rows
summed from the holding shards (`ShardedStorage.resharded`), never the whole
weight; moving a weight to its stage reads it whole, one variable at a time;
and `whole_where_not_kept` then makes whole (one copy per replica)
what neither took, as replicated weights are.

Example:

```python
strategy = tfdist.Strategy(zero=3)   # 4 devices
with strategy.scope():   # (the strategy's scope installs it)
    dense = keras.layers.Dense(4096)
    dense.build((None, 4096))
[c.shape for c in dense.kernel.value.values]   # four (4194304,) shards
```
"""

import contextlib
import weakref

import tensorflow as tf

from tfdist._compat.tf_distribute import initial_value
from tfdist._compat.tf_variables import keras_zeros, storage_of
from tfdist.pipeline.placement import move_variable
from tfdist.sharding.keys import optimizer_keys_follow
from tfdist.sharding.layout import MeshShardLayout
from tfdist.sharding.storage import ShardedStorage


def sharded_creation(strategy, config):
    """A variable creator scope making `config`'s sharded state as shards in
    `strategy` (enter it inside the strategy's scope), or a null context
    when `config` shards nothing (plain data parallelism).

    Example:

    ```python
    with strategy.scope(), sharded_creation(strategy, strategy.config):
        model = build_model()
    ```
    """
    if not config.shards_state:
        return contextlib.nullcontext()
    weights_too, every_slot = config.creates_weights_as_shards, config.shards_optimizer_state

    def create(next_creator, **kwargs):
        colocate_with = kwargs.get("colocate_with")
        slot_of = colocate_with if getattr(colocate_with, "trainable", False) and (
            every_slot or isinstance(colocate_with, ShardedStorage)) else None
        weight = weights_too and colocate_with is None and kwargs.get("trainable") is True
        if slot_of is None and not weight:
            return next_creator(**kwargs)
        with tf.init_scope():
            # Zeros are made shard by shard (`value` None): nothing to agree on.
            zeros = keras_zeros(kwargs.get("initial_value"))
            value = None if zeros else initial_value(strategy.extended, **kwargs)
            shape, dtype = zeros or (value.shape, value.dtype)
            if slot_of is not None and shape != _full_shape(slot_of):
                return next_creator(**kwargs if zeros else {**kwargs, "initial_value": value})
            # A slot of a sharded weight takes its weight's layout (a holding
            # one only if the weight's is); anything else gets a holding one.
            inherited = isinstance(slot_of, ShardedStorage)
            layout = (slot_of.layout if inherited else
                      MeshShardLayout(shape, 1, strategy.num_replicas_in_sync))
            devices = ([v.device for v in slot_of.values] if slot_of is not None
                       else _holding_devices(strategy, shape.num_elements() * dtype.size))
            name = kwargs.get("name") or "Variable"
            storage = (ShardedStorage.create(strategy, layout, None, name, dtype,
                                             trainable=weight, devices=devices) if zeros else
                       ShardedStorage.agreed(strategy, layout, value, name,
                                             trainable=weight, devices=devices))
            if not inherited or _created_as_shards(slot_of):
                setattr(storage, _CREATED, True)
            return storage

    return tf.variable_creator_scope(create)


def _holding_devices(strategy, size):
    """Where each local replica holds its shard of a new weight of `size`
    bytes: one of the replica's pipeline devices (its own without
    `pipeline`), the one holding the fewest bytes so far, so that the devices
    of a replica's stages (on other hosts under `tfdist.ChiefStrategy`) share
    the model until the first step places each weight on its stage."""
    groups = strategy.pipeline_devices
    held = _held_bytes.setdefault(strategy, [0] * len(groups[0]))
    position = held.index(min(held))
    held[position] += size
    return [group[position] for group in groups]


def _full_shape(variable):
    """A (possibly sharded) TensorFlow variable's full shape."""
    layout = getattr(variable, "layout", None)
    return layout.shape if layout is not None else variable.shape


# Bytes of new weights held on each pipeline device of a replica, by strategy.
_held_bytes = weakref.WeakKeyDictionary()

# Marks the storage `sharded_creation` made (a variable that keeps it is in
# the layout it was created with).
_CREATED = "_tfdist_created_as_shards"


def _created_as_shards(storage):
    """Whether `sharded_creation` made `storage`. Read from the instance's
    own attributes: a `tf.distribute` variable answers any other name by
    reading its value (for `ShardedStorage`, every shard gathered whole)."""
    return vars(storage).get(_CREATED, False)


def whole_where_not_kept(model, strategy=None):
    """Makes whole again (one copy per replica) each variable of `model` (a
    model, or a layer with `strategy`) and of its optimizer still in the
    layout `sharded_creation` gave it where the step does not keep that
    layout: with `tensor` or `pipeline`, everything their split and placement
    left (replicated weights and their slots);
    with `zero` alone, weights that are not trainable now (a layer frozen
    after it was built: only trainable weights are gathered unit by unit).

    Example:

    ```python
    model.layers[0].trainable = False
    whole_where_not_kept(model)   # under zero=3: the first layer's weights, mirrored
    ```
    """
    strategy = strategy or model.distribute_strategy
    config = strategy.config
    data_only = config.tensor == 1 and config.pipeline == 1
    trainable = {id(v) for v in model.trainable_weights}
    weights = {id(v) for v in model.weights}
    optimizer = getattr(model, "optimizer", None)
    state = list(optimizer.variables) if optimizer is not None and optimizer.built else []
    with optimizer_keys_follow(model):
        for variable in list(model.weights) + state:
            if not _created_as_shards(storage_of(variable)):
                continue  # whole, or placed since
            if data_only and (id(variable) in trainable or id(variable) not in weights):
                continue  # the step's own shards
            move_variable(variable, strategy.extended.worker_devices, strategy)
