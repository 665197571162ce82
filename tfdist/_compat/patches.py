"""Every change tfdist makes to Keras and TensorFlow code it does not own.

`PROCESS_WIDE` lists the class attributes (and one TensorFlow module
function) tfdist replaces for the whole process; each is installed (once)
with `install` and restored with `uninstall`, and nowhere else.
`OPTIONAL` lists the functions of libraries tfdist does not require
(keras-hub) that it replaces, installed alike once a model uses them.
`PER_OBJECT` lists the attributes tfdist changes on single objects (one
layer's `call`, one optimizer's gradient all-reduce, one variable's
storage, ...), with the function that changes them.
Each entry names the signature its target has in the pinned Keras 3.15 /
TensorFlow 2.20 (None for a data attribute): `tests/unit/test_compat.py`
checks that every target still exists with that signature.

Example:

```python
install(MODEL_SUMMARY, lambda original: original)   # replaces Model.summary
uninstall(MODEL_SUMMARY)                            # Keras's own again
```
"""

import dataclasses
import functools
import importlib
import inspect
import threading

import keras
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
from keras.src.optimizers.base_optimizer import BaseOptimizer
from tensorflow.python.distribute import parameter_server_strategy_v2


@dataclasses.dataclass(frozen=True)
class Patch:
    """One changed attribute of a Keras or TensorFlow class (or of its instances).

    Args:
        owner: the class whose attribute (or whose instances' attribute) changes.
        attribute: the attribute's name.
        signature: `str(inspect.signature(...))` of the attribute for the
            pinned Keras / TensorFlow, or None for a data attribute.
        changed_by: where tfdist makes the change, and why.

    Example:

    ```python
    Patch(keras.Model, "summary", "(self, line_length=None, ...)", "pipeline/summary.py")
    ```
    """

    owner: type
    attribute: str
    signature: str | None
    changed_by: str

    @property
    def target(self) -> str:
        """`module.Class.attribute` of the patched attribute."""
        return f"{self.owner.__module__}.{self.owner.__qualname__}.{self.attribute}"

    def current_signature(self) -> str | None:
        """The signature the target has now; None for a data attribute, which
        must be assigned (`self.<attribute> =`) in the owner's code. Raises
        AttributeError if the target is gone."""
        if self.signature is not None:
            return str(inspect.signature(getattr(self.owner, self.attribute)))
        assignment = f"self.{self.attribute} ="
        for cls in self.owner.__mro__[:-1]:  # not `object`
            if assignment in inspect.getsource(cls):
                return None
        raise AttributeError(f"{self.target} is no longer assigned by {self.owner.__name__}.")


@dataclasses.dataclass(frozen=True)
class ModulePatch:
    """One function of a module that tfdist replaces process-wide: of a
    library tfdist does not require, when a model uses it (imported then),
    or of TensorFlow.

    Args:
        module: the module's name.
        attribute: the function's name.
        signature: its `str(inspect.signature(...))` for the pinned version.
        changed_by: where tfdist makes the change, and why.

    Example:

    ```python
    ModulePatch("keras_hub.src.models.mixtral.mixtral_decoder",
                "compute_load_balancing_loss", "(router_logits, ...)", "...")
    ```
    """

    module: str
    attribute: str
    signature: str
    changed_by: str

    @property
    def owner(self):
        """The module (imported)."""
        return importlib.import_module(self.module)

    @property
    def target(self) -> str:
        """`module.attribute` of the patched function."""
        return f"{self.module}.{self.attribute}"

    def current_signature(self) -> str:
        """The signature the function has now."""
        return str(inspect.signature(getattr(self.owner, self.attribute)))


_TRAINER = ("tfdist/ps/keras_fit.py: fit under ParameterServerStrategy; "
            "tfdist/cluster/watchdog.py: a deadline on each step function call "
            "under MultiWorkerStrategy")

MODEL_SUMMARY = Patch(
    keras.Model, "summary",
    "(self, line_length=None, positions=None, print_fn=None, expand_nested=False, "
    "show_trainable=False, layer_range=None)",
    "tfdist/pipeline/summary.py: a pipelined model's summary ends with its stages")
TRAINER_FIT = Patch(
    TensorFlowTrainer, "fit",
    "(self, x=None, y=None, batch_size=None, epochs=1, verbose='auto', callbacks=None, "
    "validation_split=0.0, validation_data=None, shuffle=True, class_weight=None, "
    "sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None, "
    "validation_batch_size=None, validation_freq=1)",
    _TRAINER + "; tfdist/usage_checks.py: warn_of_unscoped_fit, a model of no "
    "strategy trained while a tfdist strategy exists")
TRAINER_MAKE_TRAIN_FUNCTION = Patch(
    TensorFlowTrainer, "make_train_function", "(self, force=False)", _TRAINER)
TRAINER_MAKE_TEST_FUNCTION = Patch(
    TensorFlowTrainer, "make_test_function", "(self, force=False)", _TRAINER)
TRAINER_MAKE_PREDICT_FUNCTION = Patch(
    TensorFlowTrainer, "make_predict_function", "(self, force=False)", _TRAINER)
TRAINER_METRICS_RESULT = Patch(
    TensorFlowTrainer, "_get_metrics_result_or_logs", "(self, logs)", _TRAINER)
_EMPTY_INPUT = ("tfdist/usage_checks.py: refuse_empty_input, input without examples "
                "named under tfdist's strategies")
TRAINER_SYMBOLIC_BUILD = Patch(
    TensorFlowTrainer, "_maybe_symbolic_build", "(self, iterator=None, data_batch=None)",
    _EMPTY_INPUT)
TRAINER_PREDICT = Patch(
    TensorFlowTrainer, "predict",
    "(self, x, batch_size=None, verbose='auto', steps=None, callbacks=None)", _EMPTY_INPUT)
MODEL_LOAD_WEIGHTS = Patch(
    keras.Model, "load_weights", "(self, filepath, skip_mismatch=False, **kwargs)",
    "tfdist/weight_files.py: name_unreadable_files, a truncated or corrupt weights file "
    "named under tfdist's strategies")

DEVICE_DATASET = ModulePatch(
    "tensorflow.python.data.ops.multi_device_iterator_ops", "_create_device_dataset",
    "(prototype_ds, incarnation_id, prefetch_buffer_size, experimental_slack)",
    "tfdist/_compat/tf_data.py: device_datasets_without_autotuning, a distributed "
    "iterator's per-device datasets without a tf.data autotuning thread")

PROCESS_WIDE = (
    MODEL_SUMMARY,
    TRAINER_FIT,
    TRAINER_MAKE_TRAIN_FUNCTION,
    TRAINER_MAKE_TEST_FUNCTION,
    TRAINER_MAKE_PREDICT_FUNCTION,
    TRAINER_METRICS_RESULT,
    TRAINER_SYMBOLIC_BUILD,
    TRAINER_PREDICT,
    MODEL_LOAD_WEIGHTS,
    DEVICE_DATASET,
)

# keras-hub's mixture-of-experts router loss, computed from the global batch's
# statistics (keras-hub 0.32).
OPTIONAL = tuple(
    ModulePatch(f"keras_hub.src.models.{name}.{name}_decoder", "compute_load_balancing_loss",
                "(router_logits, num_experts, top_k, attention_mask=None)",
                "tfdist/batch_statistics.py: use_global_router_losses, the load-balancing "
                "loss of the global batch under data parallelism")
    for name in ("mixtral", "qwen_moe", "qwen3_moe"))
_PS_EXTENDED = ("tfdist/_compat/tf_parameter_server.py: serve_keras_variables swaps the "
                "class of a ParameterServerStrategy's extended")
PER_OBJECT = (
    Patch(parameter_server_strategy_v2.ParameterServerStrategyV2Extended,
          "_create_variable", "(self, next_creator, **kwargs)", _PS_EXTENDED),
    Patch(parameter_server_strategy_v2.ParameterServerStrategyV2Extended,
          "_update", "(self, var, fn, args, kwargs, group)", _PS_EXTENDED),
    Patch(keras.layers.Layer, "call", "(self, *args, **kwargs)",
          "tfdist/_compat/keras_layers.py: use_call (tensor layouts) on one built layer"),
    Patch(keras.layers.Layer, "compute_output_spec", "(self, *args, **kwargs)",
          "tfdist/_compat/keras_functional.py: traced_call, on a custom layer's sublayers "
          "while its call is traced (removed afterwards)"),
    Patch(TFOptimizer, "_all_reduce_sum_gradients", "(self, grads_and_vars)",
          "tfdist/_compat/keras_optimizer.py: gradients_already_reduced, for one apply"),
    Patch(BaseOptimizer, "_var_key", "(self, variable)",
          "tfdist/_compat/keras_optimizer.py: slots_found_by and keys_follow_storage "
          "change `_trainable_variables_indices`, keyed by it"),
    Patch(keras.Variable, "assign_add", "(self, value)",
          "tfdist/ps/keras_fit.py: make_counters_atomic, on step and metric counters"),
    Patch(keras.Variable, "assign_sub", "(self, value)",
          "tfdist/ps/keras_fit.py: make_counters_atomic, on step and metric counters"),
    Patch(keras.Variable, "_value", None,
          "tfdist/_compat/tf_variables.py: set_storage moves or shards one variable"),
    Patch(parameter_server_strategy_v2.ParameterServerStrategyV2Extended,
          "_allow_run_without_coordinator", None,
          "tfdist/_compat/tf_parameter_server.py: running_without_coordinator"),
)

_lock = threading.Lock()
_originals = {}  # Patch -> (whether the owner defined it itself, its value)


def install(patch: Patch, wrap):
    """Replaces `patch`'s attribute by `wrap(original)`, once per process.

    A second call while installed does nothing. Raises ValueError for a patch
    not in `PROCESS_WIDE`.

    Example:

    ```python
    install(MODEL_SUMMARY, lambda summary: functools.wraps(summary)(
        lambda model, *args, **kwargs: summary(model, *args, **kwargs)))
    ```
    """
    if patch not in PROCESS_WIDE + OPTIONAL:
        raise ValueError(
            f"`patch` must be one of patches.PROCESS_WIDE or OPTIONAL, got {patch.target}.")
    with _lock:
        if patch in _originals:
            return
        original = getattr(patch.owner, patch.attribute)
        _originals[patch] = (patch.attribute in vars(patch.owner),
                             vars(patch.owner).get(patch.attribute))
        setattr(patch.owner, patch.attribute, wrap(original))


def install_for_strategy(patch: Patch, strategy_class: type, version):
    """Replaces the Keras trainer method of `patch`, for the models whose
    `distribute_strategy` is a `strategy_class` only, by
    `version(original, model, strategy, *args, **kwargs)`.

    Several strategy classes share one installed wrapper, which dispatches on
    the model's strategy; every other model runs Keras's own method.

    Example:

    ```python
    install_for_strategy(TRAINER_MAKE_TRAIN_FUNCTION, ParameterServerStrategy,
                         lambda original, model, strategy, force=False: ...)
    ```
    """
    with _lock:
        _strategy_versions.setdefault(patch, {})[strategy_class] = version
    install(patch, functools.partial(_dispatch_on_strategy, patch=patch))


_strategy_versions = {}  # Patch -> {strategy class: version}
_other_versions = {}  # Patch -> version for the models of no registered class


def install_for_other_models(patch: Patch, version):
    """Like `install_for_strategy`, for the models whose `distribute_strategy`
    is of none of the classes registered for `patch` (Keras's default
    strategy, another `tf.distribute` strategy): `version(original, model,
    strategy, *args, **kwargs)`. One such version per patch.

    Example:

    ```python
    install_for_other_models(TRAINER_FIT, lambda original, model, strategy, *a, **k:
                             original(model, *a, **k))
    ```
    """
    with _lock:
        _other_versions[patch] = version
    install(patch, functools.partial(_dispatch_on_strategy, patch=patch))


def _dispatch_on_strategy(original, patch):
    @functools.wraps(original)
    def method(model, *args, **kwargs):
        strategy = model.distribute_strategy
        for strategy_class, version in _strategy_versions.get(patch, {}).items():
            if isinstance(strategy, strategy_class):
                return version(original, model, strategy, *args, **kwargs)
        other = _other_versions.get(patch)
        if other is not None:
            return other(original, model, strategy, *args, **kwargs)
        return original(model, *args, **kwargs)

    return method


def wrap_made_function(original, model, force, attribute, wrapper_type, *args):
    """Runs Keras's `make_*_function` (`original`), then replaces the function
    it stored in `model.<attribute>` by `wrapper_type(function, *args)`, once
    (a function already wrapped is returned as it is).

    Example:

    ```python
    wrap_made_function(original, model, force, "test_function", _ChiefFunction, strategy)
    ```
    """
    original(model, force)
    function = getattr(model, attribute)
    if not isinstance(function, wrapper_type):
        function = wrapper_type(function, *args)
        setattr(model, attribute, function)
    return function


def uninstall(patch: Patch):
    """Restores the attribute `install` replaced (the very same object).

    Example:

    ```python
    uninstall(MODEL_SUMMARY)
    ```
    """
    with _lock:
        if patch not in _originals:
            return
        owned, original = _originals.pop(patch)
        _strategy_versions.pop(patch, None)
        _other_versions.pop(patch, None)
        if owned:
            setattr(patch.owner, patch.attribute, original)
        else:
            delattr(patch.owner, patch.attribute)


def installed(patch: Patch) -> bool:
    """Whether `patch` is installed in this process.

    Example:

    ```python
    installed(MODEL_SUMMARY)   # True once a pipelined strategy was made
    ```
    """
    return patch in _originals
