"""The rules on a compiled model that hold whatever the modes, before its first step.

The rules on the config alone (which fields combine) are `ParallelConfig.validate`,
run by every entry point. The rules here need the compiled model too (its
optimizer, whether it is a Keras 3 model, whether it overrides `train_step`);
each mode's own rules, and the choice of the step's parts, are the table of
modes' (`tfdist.engine.modes`).
"""

import keras

from tfdist.config import ParallelConfig
from tfdist.engine import modes
from tfdist.engine.tf_keras import is_tf_keras

# Fields whose value only tfdist's own step can honour, and their off value.
_STEP_LEVEL = (("microbatches", 1), ("xla", False), ("zero", 0), ("pipeline", 1),
               ("tensor", 1), ("compression", "none"), ("bucket_bytes", 0))


def check_model(model, config: ParallelConfig):
    """Errors that must stop `fit` before its first step, with what to do instead.

    Example:

    ```python
    check_model(model, strategy.config)   # ValueError: "The model has no optimizer..."
    ```
    """
    if is_tf_keras(model):
        modes.check(model, config)
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
    modes.check(model, config)


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
