"""Checks of how a strategy is used, failing early with a message saying what to do.

TensorFlow reports these mistakes late and obscurely (an `AssertionError` or
"Mixing different tf.distribute.Strategy objects" from inside the optimizer, a
bare `StopIteration` from the input pipeline); the strategies call these
checks where they first see the model and the data.
"""

import inspect
import warnings
import weakref

import keras
import tensorflow as tf

from tfdist._compat import patches
from tfdist._compat.keras_trainer import epoch_input, is_validation_iterator, predicted_no_batch
from tfdist._compat.tf_variables import distribute_strategy_of
from tfdist.engine.build import keras_flavour, step_level_options

# Names a training function calls: a model's train step, or a tape and an optimizer.
_TRAINING_CALLS = frozenset({"train_step", "gradient", "apply_gradients", "minimize"})
# What leaves an input without examples.
_EMPTY_CAUSES = ("an empty array, a file pattern matching no file, `take(0)`, a "
                 "`filter` that keeps nothing, or a batch size larger than the data "
                 "with `drop_remainder=True`")


def check_built_in_scope(model, strategy):
    """Raises if none of `model`'s trainable variables belongs to `strategy`.

    That is the mark of a model built (its layers' weights created) outside
    `strategy.scope()` and then trained under it.

    Example:

    ```python
    with strategy.scope():
        model = build_model()          # weights created here: passes
    check_built_in_scope(model, strategy)
    ```
    """
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return  # its variables are placed on the ps tasks, not all wrapped
    variables = [getattr(v, "value", v) for v in model.trainable_variables]
    if variables and not any(distribute_strategy_of(v) is strategy
                             for v in variables):
        raise ValueError(
            f"Model {model.name!r} was built outside `strategy.scope()`, so its "
            f"weights are not distributed by this {type(strategy).__name__}. Build "
            f"(create the layers and weights of) and compile the model inside the "
            f"scope:\n\n    with strategy.scope():\n        model = build_model()\n"
            f"        model.compile(...)\n    model.fit(...)")


_live_strategies = weakref.WeakSet()  # the tfdist strategies of this process
_warned_models = weakref.WeakSet()
_warned_unscaled = weakref.WeakSet()  # models told their loss is not scaled


def warn_of_unscoped_fit(strategy):
    """Makes `fit` of a Keras model built outside every strategy's scope warn
    (once per model) while `strategy`, or another tfdist strategy, exists.

    Such a model has no strategy: Keras trains it on one device, as if tfdist
    were not there. Models built in a strategy's scope, and every model of a
    process without a tfdist strategy, are not concerned.

    Example:

    ```python
    strategy = tfdist.Strategy()          # calls warn_of_unscoped_fit(strategy)
    model = build_model()                 # outside strategy.scope()
    model.compile(...)
    model.fit(x, y)   # UserWarning: ... trains on one device ...
    ```
    """
    _live_strategies.add(strategy)
    patches.install_for_other_models(patches.TRAINER_FIT, _fit_of_other_model)


def _fit_of_other_model(original, model, strategy, *args, **kwargs):
    # `strategy` is the model's own, else the one of the scope `fit` is called
    # in: Keras's default strategy means neither.
    if (len(_live_strategies) and not tf.distribute.has_strategy()
            and strategy is tf.distribute.get_strategy() and model not in _warned_models):
        _warned_models.add(model)
        kinds = sorted({type(s).__name__ for s in _live_strategies})
        warnings.warn(
            f"Model {model.name!r} was built outside `strategy.scope()`: `fit` "
            f"trains it on one device, as plain Keras, although a tfdist "
            f"{' / '.join(kinds)} exists in this process. To train it with the "
            f"strategy, build (create the layers and weights of) and compile it "
            f"inside the scope:\n\n    with strategy.scope():\n        model = "
            f"build_model()\n        model.compile(...)\n    model.fit(...)",
            UserWarning, stacklevel=3)
    return original(model, *args, **kwargs)


def warn_of_unscaled_loss(model, replicas: int):
    """Warns (once per model) that `model`'s own `train_step`, traced under
    `replicas` > 1 replicas, never read the replica count: its loss was not
    scaled for distribution, so for a loss that is a mean over the batch the
    optimizer's sum of the replicas' gradients is `replicas` times one
    device's (a loss summed over the batch needs no scaling: the warning
    says which is which).

    Every way to scale a loss for distribution reads the strategy's
    `num_replicas_in_sync` (Keras's `Loss` objects and `compute_loss`,
    `tf.nn.compute_average_loss`, `tf.nn.scale_regularization_loss`, a
    division written by hand); tfdist's strategies count those reads while
    the step is traced.

    Example:

    ```python
    model.fit(...)   # UserWarning: VAE.train_step ... 2x one device's gradient ...
    ```
    """
    if model in _warned_unscaled:
        return
    _warned_unscaled.add(model)
    warnings.warn(
        f"{type(model).__name__} overrides `train_step`, and its step never read "
        f"the number of replicas ({replicas}) while it was traced: its loss was not "
        f"scaled for distribution. The optimizer sums the {replicas} replicas' "
        f"gradients, so a loss that is a mean over the batch (not a sum) trains with "
        f"{replicas}x one device's gradient (a learning rate {replicas}x as large). "
        f"Compute it with `self.compute_loss(...)` or a `keras.losses.Loss` object "
        f"(both divide by the replicas), or divide it by "
        f"`self.distribute_strategy.num_replicas_in_sync` (or use "
        f"`tf.nn.compute_average_loss`).", UserWarning, stacklevel=3)


def check_not_empty(dataset: tf.data.Dataset):
    """Raises if `dataset` is known to have no elements (cardinality 0).

    A dataset whose size TensorFlow cannot know before reading it (after a
    `filter`, say) is not checked.

    Example:

    >>> check_not_empty(tf.data.Dataset.range(0))
    Traceback (most recent call last):
    ...
    ValueError: The dataset is empty (0 batches)...
    """
    if int(dataset.cardinality()) == 0:
        raise ValueError(
            f"The dataset is empty (0 batches): there is nothing to train or "
            f"evaluate on. Check the data given to `fit`/`evaluate`/`predict` "
            f"({_EMPTY_CAUSES}).")


def refuse_empty_input(strategy_class):
    """Makes `fit`, `evaluate` and `predict` of the models whose strategy is a
    `strategy_class` raise a ValueError naming an input that has no examples.

    Keras reads the first batch of `fit`'s and `evaluate`'s input before their
    first step, to build the model, and ends in a bare `StopIteration` when
    there is none; `predict` ends in an `UnboundLocalError`. Under these
    strategies the model is built from the batch's spec instead: Keras's read
    makes a distributed iterator and drops it at once, and TensorFlow can
    crash dropping one while its thread still fills the devices' buffers
    (docs/development.md). The input is refused when its number of batches
    is known to be 0 (arrays) or, when it is not known (a `filter`ed
    dataset), when one batch cannot be read with a plain iterator; a known
    0-batch `tf.data` input is refused earlier, by `check_not_empty`. `fit`'s
    `validation_data` is checked, and refused, after the first epoch, when
    Keras first evaluates.

    Example:

    ```python
    refuse_empty_input(tfdist.Strategy)   # every tfdist strategy does it
    model.fit(np.zeros((0, 16)), np.zeros((0,)))
    # ValueError: `x` has no examples: not one batch could be read from it...
    ```
    """
    patches.install_for_strategy(patches.TRAINER_SYMBOLIC_BUILD, strategy_class,
                                 _build_from_spec)
    patches.install_for_strategy(patches.TRAINER_PREDICT, strategy_class, _predict)


def _build_from_spec(original, model, strategy, iterator=None, data_batch=None):
    argument = "validation_data" if is_validation_iterator(model, iterator) else "x"
    dataset, batches = epoch_input(iterator) if data_batch is None else (None, None)
    if dataset is not None:
        # Built from the batch's spec, not from a batch read through a
        # distributed iterator and dropped at once: TensorFlow can crash
        # dropping one while its thread still fills the devices' buffers.
        if batches == 0 or (batches is None and not any(True for _ in dataset.take(1))):
            raise _no_examples(argument)
        return original(model, data_batch=dataset.element_spec)
    try:
        return original(model, iterator=iterator, data_batch=data_batch)
    except StopIteration:  # from reading the first batch, the only read
        raise _no_examples(argument) from None


def _predict(original, model, strategy, *args, **kwargs):
    try:
        return original(model, *args, **kwargs)
    except UnboundLocalError as error:
        if predicted_no_batch(error):
            raise _no_examples("x") from error
        raise


def _no_examples(argument):
    return ValueError(
        f"`{argument}` has no examples: not one batch could be read from it, so "
        f"there is nothing to train, evaluate or predict on. Give it at least one "
        f"example (look for {_EMPTY_CAUSES}).")


def check_run_function(fn, config) -> str | None:
    """What to tell the user about a function passed to `strategy.run` that is
    not tfdist's step nor a Keras 3 model's own step.

    Such a function runs as written: the options only tfdist's step applies
    (`microbatches`, `zero`, `xla`, `pipeline`, `tensor`) do not reach it.
    For the training function of a model that is not a Keras 3 model (the one
    tf_keras's `fit` runs) this raises, before the first step. For another
    function that trains (it calls `train_step`, `gradient`,
    `apply_gradients` or `minimize`) it returns a notice to show once; for
    anything else (evaluation, metrics) None.

    Example:

    ```python
    notice = check_run_function(my_train_fn, ParallelConfig(data=2, zero=1))
    ```
    """
    wanted = step_level_options(config)
    function = inspect.unwrap(getattr(fn, "python_function", fn))
    code = getattr(function, "__code__", None)
    if code is None or not _TRAINING_CALLS & _names(code):
        return None
    model = _foreign_model_in(function)
    if model is not None:
        wanted += config.changed("precision")
        if wanted and _is_model_garden_trainer(model):
            raise ValueError(
                f"official.core's {type(model).__name__} runs its task's own training "
                f"step, as plain data parallelism, without {', '.join(wanted)}. Build "
                f"`tfdist.model_garden.Trainer` instead (the same arguments): it runs "
                f"tfdist's step with the task's losses and metrics.")
        if wanted:
            raise ValueError(
                f"{getattr(model, 'name', model)!r} is a {keras_flavour(model)} model: its "
                f"own training step would run as plain data parallelism, without "
                f"{', '.join(wanted)}. tfdist applies them to Keras 3 models (`import "
                f"keras`) and, in a custom loop such as orbit's, to tf_keras models "
                f"through `strategy.train_step(model)`; or keep this model's own step "
                f"with `tfdist.Strategy(data=...)` alone.")
        return None
    if not wanted:
        return None
    name = getattr(function, "__qualname__", repr(fn))
    return (
        f"`strategy.run({name})` runs that training function as written: "
        f"{', '.join(wanted)} apply only to tfdist's own step. In a custom loop "
        f"run `strategy.train_step(model)` instead (it applies them; see "
        f"`TrainStep`). Evaluation and metric functions are not affected.")


def _names(code) -> set:
    """The names `code` and the functions defined in it use (autograph moves
    a converted function's branches into nested functions)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names(const)
    return names


def _is_model_garden_trainer(value) -> bool:
    """Whether `value` is an `official.core` trainer (its `train_step` runs
    its task's)."""
    return type(value).__module__.startswith("official.core") and hasattr(value, "task")


def _foreign_model_in(function):
    """A model that is not a Keras 3 model among `function`'s free variables."""
    for cell in function.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not yet filled
            continue
        if callable(getattr(type(value), "train_step", None)) and not isinstance(
                value, keras.Model):
            return value
    return None
