"""Which parts make a model's step, and every rule that depends on the model.

The rules on the config alone (which fields combine) are `ParallelConfig.validate`,
run by every entry point. The rules here need the compiled model too (its
optimizer, losses, dtype policy, whether it overrides `train_step`); they run
before the first step. `assemble` then picks the step's three parts (see
`tfdist.engine.step`) and readies the state they keep:

| config              | compute            | reduce               | update         |
|---------------------|--------------------|----------------------|----------------|
| (default)           | `LocalCompute`     | `AllReduce`          | `KerasApply`   |
| `tensor` > 1        | `LocalCompute`     | `DataGroupAllReduce` | `KerasApply`   |
| `pipeline` > 1      | `PipelinedCompute` | (as above)           | (as above)     |
| `zero` 1, 2         | (as above)         | `ShardedReduce`      | `ShardedUpdate`|
| `zero` 3            | `PipelinedCompute` | `AlreadyReduced`     | `ShardedUpdate`|
| `zero` 3, `pipeline`| `PipelinedCompute` | `ShardedReduce`      | `ShardedUpdate`|
| a tf_keras model    | `LocalCompute`     | `AllReduce`          | `TfKerasApply` |

(`zero=3`'s `PipelinedCompute` runs `GatheredUnits`, or with `pipeline` the
stages gathering their parameters: `tfdist.optim.zero3`;
a tf_keras model's microbatch loss is `TfKerasLoss`: `tfdist.engine.tf_keras`).
"""

import gc

import keras
import tensorflow as tf

from tfdist._compat.keras_functional import nested_sublayers
from tfdist.config import ParallelConfig
from tfdist.engine import tf_keras
from tfdist.engine.compute import LocalCompute, PipelinedCompute
from tfdist.engine.reduce import AllReduce, AlreadyReduced, DataGroupAllReduce, ShardedReduce
from tfdist.engine.tf_keras import check_tf_keras_model, is_tf_keras
from tfdist.engine.update import KerasApply
from tfdist.optim import zero3
from tfdist.optim.zero import ShardedUpdate, check_shardable
from tfdist.pipeline.compute import pipeline_compute
from tfdist.sharding.creation import whole_where_not_kept
from tfdist.tensor.plan import partition_model

# Fields whose value only tfdist's own step can honour, and their off value.
_STEP_LEVEL = (("microbatches", 1), ("xla", False), ("zero", 0), ("pipeline", 1),
               ("tensor", 1))


def check_model(model, config: ParallelConfig):
    """Errors that must stop `fit` before its first step, with what to do instead.

    Example:

    ```python
    check_model(model, strategy.config)   # ValueError: "The model has no optimizer..."
    ```
    """
    if is_tf_keras(model):
        check_tf_keras_model(model, config)
        return
    if not isinstance(model, keras.Model):
        raise NotImplementedError(
            f"tfdist's training step takes Keras 3 and tf_keras models, but "
            f"{getattr(model, 'name', model)!r} is a {keras_flavour(model)} model. "
            f"Build it with Keras 3, or train it with its own step under "
            f"`tfdist.Strategy(data=...)` alone (plain data parallelism).")
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError(
            "The model has no optimizer: call `model.compile(optimizer=...)` "
            "before `model.fit`."
        )
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if inner.gradient_accumulation_steps:
        raise ValueError(
            f"`gradient_accumulation_steps={inner.gradient_accumulation_steps}` "
            f"on the Keras optimizer does not work under tf.distribute (its "
            f"conditional apply contains the gradient all-reduce). Use the "
            f"strategy's `microbatches={inner.gradient_accumulation_steps}` "
            f"instead: it accumulates the same gradients inside one step and "
            f"reduces them once."
        )
    if not model.trainable_weights:
        raise ValueError("The model has no trainable weights: nothing to train.")
    check_synchronized_batch_norm(model, config)
    if config.zero:
        check_shardable(optimizer, config.zero)
    if config.zero == 3:
        zero3.check_model(model)
    if config.tensor > 1:  # split weights are updated shard by shard
        check_shardable(optimizer, config.zero, mode=f"`tensor={config.tensor}`",
                        elementwise_only=True)
    policy = model.dtype_policy.name
    if policy != config.precision:
        raise ValueError(
            f"The model was built with dtype policy {policy!r} but the "
            f"strategy has `precision={config.precision!r}`: build the model "
            f"inside `strategy.scope()`, which sets the policy."
        )
    if config.precision == "mixed_float16" and not isinstance(
        optimizer, keras.optimizers.LossScaleOptimizer
    ):
        raise ValueError(
            "`precision='mixed_float16'` needs loss scaling, but the model's "
            f"optimizer is a {type(optimizer).__name__}: compile with "
            "`auto_scale_loss=True` (the default) or wrap the optimizer in "
            "`keras.optimizers.LossScaleOptimizer`."
        )


def check_synchronized_batch_norm(model, config: ParallelConfig):
    """`BatchNormalization(synchronized=True)` all-reduces its batch statistics
    in the forward pass (`tf.distribute`'s replica context), which cannot run
    inside the nested functions tfdist makes for `xla=True` (one XLA
    computation) and for `tensor` with `microbatches` or `pipeline` (one
    function per microbatch or replica): refused there, before the first step.

    Example:

    ```python
    check_synchronized_batch_norm(model, ParallelConfig(data=2, xla=True))  # raises
    ```
    """
    nested = ["xla=True"] if config.xla else []
    if config.tensor > 1 and (config.microbatches > 1 or config.pipeline > 1):
        nested.append(f"tensor={config.tensor} with "
                      + ("microbatches" if config.pipeline == 1 else "pipeline"))
    if not nested:
        return
    for layer in nested_sublayers(model):
        if isinstance(layer, keras.layers.BatchNormalization) and layer.synchronized:
            raise NotImplementedError(
                f"{layer.name!r} is a BatchNormalization(synchronized=True), whose "
                f"cross-replica all-reduce of batch statistics cannot run inside the "
                f"function tfdist traces for {' and '.join(nested)}. Use "
                f"synchronized=False (each replica normalises with its own "
                f"statistics; tfdist still keeps the moving statistics equal on "
                f"every replica), or drop {' and '.join(nested)}.")


def step_level_options(config: ParallelConfig) -> list[str]:
    """The options of `config` that only tfdist's step applies, as `name=value`.

    Example:

    >>> step_level_options(ParallelConfig(data=2, microbatches=2, zero=1))
    ['microbatches=2', 'zero=1']
    """
    return [f"{name}={getattr(config, name)!r}" for name, off in _STEP_LEVEL
            if getattr(config, name) != off]


def keras_flavour(model) -> str:
    """"Keras 3", "tf_keras (Keras 2)", or the class of anything else.

    Example:

    >>> keras_flavour(keras.Sequential())
    'Keras 3'
    """
    if isinstance(model, keras.Model):
        return "Keras 3"
    if is_tf_keras(model):
        return "tf_keras (Keras 2)"
    return f"{type(model).__module__}.{type(model).__qualname__}"


def check_own_train_step(model, config: ParallelConfig):
    """A model that overrides `train_step` runs it as written (data parallel
    with Keras's own gradient handling): every option only tfdist's step
    honours is refused, then the rules of `check_model`.

    Example:

    ```python
    check_own_train_step(model, ParallelConfig(microbatches=2))   # ValueError
    ```
    """
    wanted = step_level_options(config)
    if wanted:
        raise ValueError(
            f"{type(model).__name__} overrides `train_step`, so tfdist runs "
            f"it as written (data parallel only) and cannot apply "
            f"{', '.join(wanted)}. Remove those options, or drop the "
            f"override and customise `compute_loss` instead."
        )
    check_model(model, config)


def assemble(model, config: ParallelConfig, sequence_length=None):
    """The (compute, reduce, update) parts of `model`'s step under `config`.

    `sequence_length`, when the first batch gives the lengths the model's
    inputs leave unknown, sizes the pipeline stages' cost estimates.

    Readies the state they keep, in this order: pipeline stages' variables
    moved to their stages' devices, layers split over tensor groups (where
    their stage put them), what neither took made whole where the scope
    created it as shards (`tfdist.sharding.creation`), the optimizer's state
    moved into ZeRO shards. Values are kept.

    Example:

    ```python
    compute, reduce, update = assemble(model, strategy.config)
    ```
    """
    if is_tf_keras(model):
        return tf_keras.parts(model, config)
    if config.shards_state:
        # The graphs traced so far (Keras's symbolic build, the tensor plan's
        # trace) are reference cycles holding the handles of the variables
        # about to move: collected first, each replaced storage is freed as
        # it is replaced instead of at the next cyclic collection.
        gc.collect()
    strategy = model.distribute_strategy
    mesh = strategy.replica_mesh
    # What is reduced whole: over the data group with tensor groups (each
    # rank's gradients times t), else by tf.distribute's all-reduce.
    whole = DataGroupAllReduce(mesh) if config.tensor > 1 else AllReduce()
    optimizer = model.optimizer
    if config.zero and not optimizer.built:
        raise RuntimeError(
            "The optimizer is not built: call `TrainStep.build(...)` "
            "(or `model.fit`, which builds it) before running the step.")
    k = config.microbatches
    if config.zero == 3 and config.pipeline > 1:  # stages placed, then sharded there
        pipeline = pipeline_compute(model, strategy, sequence_length)
        with tf.init_scope():
            whole_where_not_kept(model)
            update = ShardedUpdate(model, 3, mesh)
        zero3.gather_stage_parameters(pipeline, update.layouts, whole)
        return PipelinedCompute(model, k, pipeline, mesh), AlreadyReduced(whole), update
    if config.zero == 3:  # layers split, then sharded: the units gather them
        with tf.init_scope():
            if config.tensor > 1:
                partition_model(model, mesh)
            whole_where_not_kept(model)
            update = ShardedUpdate(model, 3, mesh)
        units = zero3.GatheredUnits(model, update.layouts, strategy.pipeline_devices, mesh,
                                    whole, config.zero3_unit_params)
        return PipelinedCompute(model, k, units, mesh), AlreadyReduced(whole), update
    if config.pipeline > 1:
        compute = PipelinedCompute(model, k, pipeline_compute(model, strategy, sequence_length),
                                   mesh)
    else:
        compute = LocalCompute(model, k, mesh, xla=config.xla)
    with tf.init_scope():
        if config.tensor > 1:
            partition_model(model, mesh)
            if config.pipeline > 1:
                compute.pipeline.split_copies()  # a tied embedding's, on the last stage
        whole_where_not_kept(model)
    if config.zero:
        with tf.init_scope():
            update = ShardedUpdate(model, config.zero, mesh)
        return compute, ShardedReduce(update.layouts, config.zero, mesh, whole), update
    if config.tensor > 1 and isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        # Keras's update checks the rank's own gradients: an overflow on one
        # rank is made everyone's, so that every rank skips the step.
        whole = DataGroupAllReduce(mesh, share_non_finite=True)
    return compute, whole, KerasApply(model)
