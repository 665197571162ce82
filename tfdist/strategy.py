"""The tfdist strategies: `tf.distribute` strategies that own the training step.

`Strategy` is a `tf.distribute.MirroredStrategy` (one process, several devices) and
`MultiWorkerStrategy` a `tf.distribute.MultiWorkerMirroredStrategy` (several
processes, from `TF_CONFIG`). Both take the `ParallelConfig` fields as keyword
arguments and behave as their parents everywhere except two places:

- `scope()` also sets the Keras dtype policy that `precision` asks for, so layers
  built inside it compute in that precision;
- `run()` recognises the bound `model.train_step` that Keras 3's `model.fit`
  passes it and runs tfdist's `TrainStep` for that model instead (see
  docs/architecture.md). Every other function runs unchanged.
"""

import contextlib
import functools
import inspect
import re
import sys
import warnings

import keras
import tensorflow as tf
from absl import logging

from tfdist import planning, usage_checks, weight_files
from tfdist._compat import tf_data
from tfdist._compat.keras_trainer import uses_keras_train_step
from tfdist._compat.tf_distribute import bound_task_registration, own_collective_keys
from tfdist._compat.tf_function import eagerly_outside_the_trace
from tfdist.cluster.agreement import check_tasks_agree
from tfdist.cluster.rendezvous import (
    SYNCHRONOUS_TASK_TYPES,
    check_timeout_seconds,
    wait_for_peers,
)
from tfdist.cluster.watchdog import watch_step_functions
from tfdist.config import ParallelConfig
from tfdist.devices import check_devices
from tfdist.engine import modes
from tfdist.engine.build import check_own_train_step
from tfdist.engine.microbatch import check_divides
from tfdist.engine.step import TrainStep
from tfdist.input_options import without_autotuning
from tfdist.logs import discover_devices_quietly
from tfdist.profiling import start_profiler_server
from tfdist.sharding.creation import sharded_creation, whole_where_not_kept
from tfdist.tensor.layout_map import check_layout_map
from tfdist.tensor.mesh import DataOnlyMesh


def requested_config(config, fields, strategy: str) -> ParallelConfig:
    """The `ParallelConfig` a strategy was asked for, from `config=` (a
    ParallelConfig or dict) or from keywords, else the job's (`$TFDIST_CONFIG`,
    which `tfdist launch` and TFJob manifests set from their flags; defaults
    without it), validated for `strategy` (its class name); not yet resolved
    for devices.

    Example:

    >>> requested_config(None, {"microbatches": 2}, "Strategy").resolve(4).data
    4
    """
    if config is not None and fields:
        raise ValueError(
            f"Pass either `config=` or ParallelConfig fields as keywords, not "
            f"both; got config and {sorted(fields)}."
        )
    if config is None and not fields:
        config = ParallelConfig.from_env()
    elif config is None:
        config = ParallelConfig.from_dict(fields)
    elif isinstance(config, dict):
        config = ParallelConfig.from_dict(config)
    elif not isinstance(config, ParallelConfig):
        raise TypeError(
            f"`config` must be a tfdist.ParallelConfig or a dict, got "
            f"{type(config).__name__}."
        )
    return config.validate(strategy)


def planned_config(plan, config, fields, devices) -> ParallelConfig:
    """The `ParallelConfig` of `plan`: what `tfdist.plan` returned (its
    `best`), or one of its `Plan`s, or "auto" (`auto_plan`'s best); logged
    (INFO) with why it was chosen.

    Example:

    ```python
    plans = tfdist.plan(build_model, devices=4, memory_per_device="2GiB", batch_size=64)
    planned_config(plans, None, {}, devices).zero
    ```
    """
    if plan == "auto":
        plan = auto_plan(devices, config, fields)
    elif config is not None or fields:
        raise ValueError(
            f"Pass either `plan=` or a config (`config=` or ParallelConfig fields as "
            f"keywords), not both; got plan and "
            f"{'config' if config is not None else sorted(fields)}. Fields to hold "
            f"fixed go to tfdist.plan(..., zero=3).")
    if hasattr(plan, "why_best"):  # `Plans`, ranked
        chosen, why = plan.best, plan.why_best()
    elif isinstance(getattr(plan, "config", None), ParallelConfig):  # one `Plan`
        chosen, why = plan, f"{plan.summary()}; given as the plan."
    else:
        raise TypeError(
            f"`plan` must be what tfdist.plan returns (or one of its plans), got "
            f"{type(plan).__name__}.")
    logging.info("tfdist: the plan chosen: %s", why)
    return chosen.config


# What `plan="auto"` cannot plan without (`tfdist.plan`'s arguments).
_PLANNING_NEEDS = ("model", "memory_per_device", "batch_size")


def auto_plan(devices, config, arguments):
    """The predicted plans (`tfdist.plan` without `measure`) for `devices`,
    from its other `arguments`: what `Strategy(plan="auto", ...)` follows.

    Example:

    ```python
    plans = auto_plan(["CPU:0", "CPU:1"], None, dict(
        model=build_model, memory_per_device="2GiB", batch_size=64, zero=1))
    plans.best.config.data
    ```
    """
    missing = [name for name in _PLANNING_NEEDS if arguments.get(name) is None]
    measure = arguments.pop("measure", 0)  # 0: predictions only, as "auto" plans
    if measure:
        raise ValueError(
            f"`plan=\"auto\"` predicts; `measure={measure}` trains plans, "
            f"each under a strategy of its own: pass what that returns, "
            f"tfdist.Strategy(plan=tfdist.plan(build_model, ..., measure=K)).")
    if config is not None or missing:
        raise ValueError(
            "`plan=\"auto\"` plans for the strategy's devices from tfdist.plan's "
            "other arguments as keywords: `model` (a function returning the compiled "
            "model), `memory_per_device` and `batch_size`; optionally "
            "`sequence_length` and ParallelConfig fields to hold (such as `zero=3`); "
            + ("not `config`." if config is not None else f"missing: {', '.join(missing)}."))
    logging.info("tfdist: planning for %d devices (plan=\"auto\")", len(devices))

    def trial(config, rows):  # what each replica adds to a step, timed as tfdist.plan does
        return planning.step_timer(Strategy(config, devices=devices[:config.devices_needed]),
                                   arguments["model"], rows, arguments.get("sequence_length"))

    built = isinstance(arguments["model"], keras.Model)
    return planning.predicted_plans(devices=len(devices), trial=None if built else trial,
                                    **arguments)


def default_devices() -> list[str]:
    """Every logical accelerator of this host, or every logical CPU if none.

    Example:

    >>> default_devices()[0]  # on a host without GPUs
    '/device:CPU:0'
    """
    discover_devices_quietly()
    gpus = tf.config.list_logical_devices("GPU")
    return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]


# Set on a value `run` returns whose replicas all hold the same result (a
# metric `TrainStep` computed from states summed over the global batch): its
# mean over the replicas is any replica's.
_SHARED_BY_REPLICAS = "_tfdist_shared_by_replicas"


class _StepOwner:
    """What both tfdist strategies add to their `tf.distribute` parent."""

    def _init_step_owner(self, config: ParallelConfig, layout_map=None):
        self._layout_map = check_layout_map(layout_map, config.tensor, config.zero)
        usage_checks.refuse_empty_input(_StepOwner)
        usage_checks.warn_of_unscoped_fit(self)
        weight_files.name_unreadable_files(_StepOwner)
        start_profiler_server()  # when $TFDIST_PROFILER_PORT asks for one
        self._config = config

    @property
    def config(self) -> ParallelConfig:
        """The strategy's validated `ParallelConfig`."""
        return self._config

    @property
    def layout_map(self):
        """The `keras.distribution.LayoutMap` the tensor plan follows, or None."""
        return self._layout_map

    @property
    def tensor_mesh(self):
        """The data x tensor `TensorMesh` of the replicas when `tensor` > 1, else None."""
        return getattr(self, "_tensor_mesh", None)

    @property
    def example_group(self):
        """The replicas holding the global batch's other examples, over which
        `tfdist.batch_statistics` sums (the replica mesh's data group), or
        None where each replica's statistics are the batch's.

        Example:

        >>> tfdist.Strategy(data=2, devices=["/cpu:0", "/cpu:1"]).example_group.data
        2
        """
        return modes.example_group(self.config, self.replica_mesh)

    @functools.cached_property
    def replica_mesh(self):
        """The data x tensor mesh of the replicas, whatever the config: the
        `TensorMesh` when `tensor` > 1, else a `DataOnlyMesh` (tensor groups
        of one replica). The step's parts take it.

        Example:

        >>> tfdist.Strategy(data=2, devices=["/cpu:0", "/cpu:1"]).replica_mesh.tensor
        1
        """
        return self.tensor_mesh or DataOnlyMesh(self, getattr(self, "pipeline_devices", None))

    def reduce(self, reduce_op, value, axis):
        """`tf.distribute.Strategy.reduce`, also for batches of unequal size.

        When a global batch does not split evenly over the replicas, their
        batches differ in rows, which an elementwise reduction (`axis=None`)
        cannot combine; Keras's `fit` makes one such reduction of its first
        batch (to build the model). A value whose replicas hold different
        numbers of rows is reduced over the rows they all have; one that has
        no sum (bool and string inputs, a `tf.RaggedTensor`) is the first
        replica's, cut to those rows alike. The mean of a metric tfdist's step
        already computed over the global batch (Keras asks for one every step)
        is any replica's: no collective.

        Example:

        ```python
        batch = next(iter(strategy.experimental_distribute_dataset(ds)))
        first_rows = strategy.reduce("MEAN", batch, axis=None)
        ```
        """
        if axis is None and _SHARED_BY_REPLICAS in getattr(value, "__dict__", ()) and \
                tf.distribute.ReduceOp(reduce_op) == tf.distribute.ReduceOp.MEAN:
            return self.experimental_local_results(value)[0]  # a metric the step synced
        if axis is None:
            value = self._common_rows(value)
        return super().reduce(reduce_op, value, axis)

    def _common_rows(self, value):
        """`value`'s per-replica values cut to the rows every replica has (one
        that has no sum: this process's first replica's), in one call of one
        function whatever the structure."""
        flat = tf.nest.flatten(value)
        # A variable's copies all have its shape (and traced as an argument of
        # the shared function, every variable would read as the first one).
        firsts = [self.experimental_local_results(v)[0]
                  if isinstance(v, tf.distribute.DistributedValues)
                  and not isinstance(v, tf.Variable) else None for v in flat]
        cut = [i for i, first in enumerate(firsts) if first is not None and first.shape.rank]
        if cut:
            if self._cut_function is None:  # traced once: no autograph, no retracing per call
                # A partial, not the bound method: TensorFlow counts traces per
                # function code, and every strategy's first trace would read
                # as a retrace of the one before ("triggered tf.function
                # retracing" from the fourth strategy in a process).
                self._cut_function = tf.function(
                    functools.partial(type(self)._cut_to_common_rows, self),
                    autograph=False, reduce_retracing=True)
            for i, v in zip(cut, self._cut_function(*[flat[i] for i in cut])):
                flat[i] = v
        for i, first in enumerate(firsts):
            if first is not None and (first.dtype in (tf.bool, tf.string)
                                      or isinstance(first, tf.RaggedTensor)):
                flat[i] = self.experimental_local_results(flat[i])[0]
        return tf.nest.pack_sequence_as(value, flat)

    _cut_function = None
    _replica_count_reads = 0

    @property
    def num_replicas_in_sync(self):
        """The replicas every step synchronises (`tf.distribute.Strategy`'s).
        Reads are counted: an own `train_step` that never reads it while it
        is traced did not scale its loss for distribution
        (`usage_checks.warn_of_unscaled_loss`)."""
        self._replica_count_reads += 1
        return super().num_replicas_in_sync

    def _cut_to_common_rows(self, *values):
        # Every replica's row count of each value (across processes too), then
        # each value's common rows.
        counts = self.gather(self.run(
            lambda *vs: tf.stack([tf.shape(v)[0] for v in vs])[tf.newaxis], args=values), axis=0)
        common = tf.reduce_min(counts, axis=0)  # (values,)
        return self.run(lambda *vs: [v[:common[j]] for j, v in enumerate(vs)], args=values)

    def describe(self, model: keras.Model, sequence_length: int | None = None,
                 batch_size: int | None = None) -> str:
        """How `model`'s layers are laid out under this strategy, one per line.

        With `pipeline` > 1: each stage's devices, parameters, estimated
        cost (FLOPs per example, the model's unknown input lengths set to
        `sequence_length` as the first batch sets them when training
        starts; 1 when None), its ratio to the mean stage's, and its
        layers. With `tensor` > 1: which layers are split (column /
        row-parallel Dense pairs, attention by heads, embeddings by
        vocabulary) and which stay replicated, and why. Both when both. With
        `zero=3`: the units whose parameters are gathered together (with
        `pipeline`, the stages), their bytes, and the bytes each device keeps
        (`tfdist.optim.zero3.describe`). With
        `pipeline` > 1 it ends with the schedule's grid: each stage's forward
        "F" and backward "B" of each microbatch per clock step, "." when idle
        (`tfdist.pipeline.schedule.grid`). With `batch_size` (the global
        batch), a last line predicts the busiest device's peak memory in a
        step and its parts (`tfdist.sharding.peak`; the optimizer's slots
        count once it is built).

        Example:

        ```python
        strategy = tfdist.Strategy(tensor=2)
        with strategy.scope():
            model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, "relu"),
                                      keras.layers.Dense(16), keras.layers.Dense(3)])
        print(strategy.describe(model))
        # dense    Dense  column      paired with dense_1 (64 -> 32 units per device)
        # dense_1  Dense  row         paired with dense
        # dense_2  Dense  replicated  no Dense consumes its output alone
        ```
        """
        return modes.describe(self, model, sequence_length, batch_size)

    def predicted_peak(self, model: keras.Model, batch_size: int,
                       sequence_length: int | None = None):
        """The busiest device's predicted peak memory in a training step of
        `model` on global batches of `batch_size` rows, by part (a
        `tfdist.sharding.peak.PeakEstimate`; its `total` in bytes). The
        optimizer's slots count once it is built.

        Example:

        ```python
        strategy.predicted_peak(model, batch_size=64).total / 2**30   # GiB
        ```
        """
        return modes.predicted_peak(self, model, batch_size, sequence_length)

    def scope(self):
        """The parent's scope, with the Keras dtype policy of `precision` set
        (and tf_keras's, when tf_keras is imported).

        Build and compile the model inside it: its layers then compute in
        `precision`, and under "mixed_float16" `compile` wraps the optimizer
        in a `LossScaleOptimizer`. With `zero`, `tensor` or `pipeline`,
        variables the step shards, splits or places are created as shards
        (`tfdist.sharding.creation`): no worker builds the whole model.
        """
        return _precision_scope(super().scope(), self._config.precision,
                                sharded_creation(self, self._config))

    def train_step(self, model: keras.Model) -> TrainStep:
        """tfdist's `TrainStep` for `model` (one per model, built on first use).

        `model.fit` uses it automatically. Custom loops call it in replica
        context: `strategy.run(strategy.train_step(model), args=(batch,))`.
        """
        # Kept on the model, not here: TensorFlow's gradient registry keeps
        # strategies alive for good (their replica contexts' all-reduce
        # gradients), and a strategy holding its models would keep them too.
        step = vars(model).get(_STEP_ATTRIBUTE)
        if step is None:
            step = TrainStep(model, self._config)
            object.__setattr__(model, _STEP_ATTRIBUTE, step)  # (not a tracked attribute)
        return step

    def run(self, fn, args=(), kwargs=None, options=None):
        """`tf.distribute.Strategy.run`, with Keras's train step replaced.

        When `fn` is the bound `train_step` of a Keras model that does not
        override it, tfdist's `TrainStep` runs instead. A model that overrides
        `train_step` runs its own step (plain data parallelism), which is
        refused if the config asks for something only tfdist's step does; so
        is the training function of a model that is not a Keras 3 model (a
        tf_keras model's `fit`). Another training function of the user's own
        runs as written, with a warning (once) when the config asks for
        step-level options (`tfdist.usage_checks.check_run_function`).
        """
        evaluated = _keras_step_owner(fn, ("test_step",))
        predicted = None if evaluated is not None else _keras_predict_model(fn)
        if (evaluated or predicted) is not None:
            # (before a first training step has placed them; outside the
            # trace's variable capture, so that it is traced once)
            with eagerly_outside_the_trace():
                whole_where_not_kept(evaluated or predicted)
            fn = modes.evaluating(fn, evaluated or predicted, self._config)
        # A tensor group evaluates and predicts one batch.
        if evaluated is not None:
            fn = self.replica_mesh.on_group_batch(fn)
        elif predicted is not None:
            fn = self.replica_mesh.on_group_batch(fn, own_rows=True)
        model = _keras_step_owner(fn, ("train_step",))
        own_step = None
        if model is not None:
            usage_checks.check_built_in_scope(model, self)
            if uses_keras_train_step(model):
                fn = self.train_step(model)
            else:
                check_own_train_step(model, self._config)
                own_step = model
        elif not isinstance(fn, TrainStep):
            self._notice_own_function(fn)
        if isinstance(fn, TrainStep):
            fn.prepare(args[0] if args else None)  # before the replicas trace it
        reads = self._replica_count_reads
        results = super().run(fn, args=args, kwargs=kwargs, options=options)
        if own_step is not None and self._replica_count_reads == reads:
            replicas = super().num_replicas_in_sync  # (not counted)
            if replicas > 1:
                usage_checks.warn_of_unscaled_loss(own_step, replicas)
        if isinstance(fn, TrainStep) and isinstance(results, dict):
            for name in fn.synced:  # equal on every replica: reduced without a collective
                if hasattr(results[name], "__dict__"):  # a graph tensor or `PerReplica`
                    vars(results[name])[_SHARED_BY_REPLICAS] = True
        return results

    def _notice_own_function(self, fn):
        """Refuses a foreign model's training function under step-level
        options; warns once of a training function of the user's own."""
        notice = usage_checks.check_run_function(fn, self._config)
        if notice is not None and not getattr(self, "_noticed_own_function", False):
            self._noticed_own_function = True
            warnings.warn(notice, stacklevel=3)

    def experimental_distribute_dataset(self, dataset, options=None):
        """The parent's, after checking a static batch size against the config,
        with tf.data autotuning off unless the dataset's options set it
        (`tfdist.input_options`: the autotuner can delay each epoch's start),
        and off in the datasets TensorFlow makes for each device
        (`tfdist._compat.tf_data`).

        `model.fit` distributes its data through this, so a batch size that
        `microbatches` cannot divide is reported before the first step.
        """
        usage_checks.check_not_empty(dataset)
        self._check_static_batch(dataset)
        tf_data.device_datasets_without_autotuning()
        return super().experimental_distribute_dataset(
            without_autotuning(dataset), options=options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """The parent's, with each dataset's tf.data autotuning off unless
        its options set it (`tfdist.input_options`).

        Example:

        ```python
        distributed = strategy.distribute_datasets_from_function(
            lambda context: tf.data.Dataset.range(64).batch(8))
        ```
        """
        tf_data.device_datasets_without_autotuning()
        return super().distribute_datasets_from_function(
            lambda context: without_autotuning(dataset_fn(context)), options=options)

    def _check_static_batch(self, dataset):
        leaves = [s for s in tf.nest.flatten(dataset.element_spec) if s.shape.rank]
        if leaves:
            global_batch = leaves[0].shape[0]
            # The microbatches split a tensor group's batch (its replicas' together).
            groups = self.num_replicas_in_sync // self._config.tensor
            if global_batch is not None and global_batch % groups == 0:
                check_divides(global_batch // groups, self._config.microbatches, groups)


_STEP_ATTRIBUTE = "_tfdist_train_step"


def _keras_step_owner(fn, names):
    """The Keras model whose bound method `fn` is, if its name is in `names`."""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, keras.Model) and getattr(fn, "__name__", "") in names:
        return owner
    return None


def _keras_predict_model(fn):
    """The model whose `predict` step `fn` is (a closure over the model named
    `one_step_on_data`, calling `predict_step`), else None."""
    fn = inspect.unwrap(fn)  # under autograph's do_not_convert
    if getattr(fn, "__name__", "") != "one_step_on_data":
        return None
    return next((cell.cell_contents for cell in fn.__closure__ or ()
                 if isinstance(cell.cell_contents, keras.Model)), None)


@contextlib.contextmanager
def _precision_scope(strategy_scope, precision, creation):
    """Keras's dtype policy set to `precision` inside `strategy_scope`; also
    tf_keras's when it is imported (a Model Garden model built inside); and
    the variable creator scope `creation`."""
    tf_keras = sys.modules.get("tf_keras")
    policies = [(keras.config.dtype_policy(), keras.config.set_dtype_policy)]
    if tf_keras is not None:
        policies.append((tf_keras.mixed_precision.global_policy(),
                         tf_keras.mixed_precision.set_global_policy))
    with strategy_scope, creation:
        for _, set_policy in policies:
            set_policy(precision)
        try:
            yield
        finally:
            for previous, set_policy in policies:
                set_policy(previous)


class Strategy(_StepOwner, tf.distribute.MirroredStrategy):
    """Synchronous training on the devices of one host, with tfdist's knobs.

    A `tf.distribute.MirroredStrategy` that takes the `ParallelConfig` fields as
    keywords (or `config=`). `data` defaults to the number of devices. Several
    tfdist strategies, of any sizes, can be created and used one after another
    in one process.

    Args:
        config: a `ParallelConfig` (or its dict); or give its fields as
            keywords; neither: `$TFDIST_CONFIG` (set by `tfdist launch` and
            TFJob manifests from their flags), else the defaults.
        devices: device names to use; default: every logical GPU of the host,
            or every logical CPU if there is none
            (see `tfdist.use_virtual_devices`).
        **fields: `data`, `pipeline`, `tensor`, `microbatches`, `zero`,
            `precision`, `xla`, `schedule`, `stage_boundaries`, `remat`,
            `vocab_parallel_classifier` (see `ParallelConfig`).
        layout_map: with `tensor` > 1, a `keras.distribution.LayoutMap` (as
            keras-hub's `get_layout_map` returns) the tensor plan follows;
            what it asks that tfdist cannot run is refused before training
            (`tfdist.tensor.layout_map`). Code, not a config field: each task
            of a job builds it in the script it runs.
        plan: instead of a config, what `tfdist.plan` returned for these
            devices: its best plan's config is used, and why it was chosen
            is logged (INFO); or one `Plan` of it; or "auto": planned here,
            for these devices, from `tfdist.plan`'s other arguments given as
            keywords (`model`, a function returning the compiled model;
            `memory_per_device`; `batch_size`; optionally `sequence_length`
            and fields to hold, such as `zero=3`).

    Example:

    ```python
    tfdist.use_virtual_devices(4)
    strategy = tfdist.Strategy(data=4, microbatches=2, precision="mixed_bfloat16")
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=64, epochs=2)

    # or the layout tfdist.plan chooses for the model, these devices and memory:
    strategy = tfdist.Strategy(plan="auto", model=build_model,
                               memory_per_device="2GiB", batch_size=64)
    with strategy.scope():
        model = build_model()
    ```
    """

    def __init__(self, config=None, *, devices=None, layout_map=None, plan=None, **fields):
        devices = default_devices() if devices is None else check_devices(devices)
        if plan is not None:
            config, fields = planned_config(plan, config, fields, devices), {}
            _check_planned_devices(config, devices)
        requested = requested_config(config, fields, "Strategy")
        try:
            config = requested.resolve(len(devices))
        except ValueError as error:
            raise ValueError(f"{error}{_devices_hint(requested, devices)}") from None
        self._init_step_owner(config, layout_map)
        own_collective_keys(self)
        p = config.pipeline
        # Data replica r runs stage s on devices[r * p + s]; the replicas'
        # own devices (where their batches arrive) are the stage-0 ones.
        self.pipeline_devices = [devices[r * p:(r + 1) * p] for r in range(len(devices) // p)]
        super().__init__(devices=[group[0] for group in self.pipeline_devices])
        self._tensor_mesh = modes.tensor_mesh(self, config, self.pipeline_devices)
        modes.start(self, config)


class MultiWorkerStrategy(_StepOwner, tf.distribute.MultiWorkerMirroredStrategy):
    """Synchronous training across processes (hosts), from `TF_CONFIG`.

    A `tf.distribute.MultiWorkerMirroredStrategy` with tfdist's knobs. Every
    task of the job runs the same script; create the strategy first thing in
    it. `data` defaults to the number of replicas in the cluster (workers x
    local devices) divided by `tensor` and, if given, must equal it. With
    `tensor` > 1, a tensor group is t consecutive replicas of the cluster (a
    task's replicas follow its id in the cluster), so on hosts with one
    replica each (CPU) a group spans t workers.

    Args:
        config: a `ParallelConfig` (or its dict); or give its fields as
            keywords; neither: `$TFDIST_CONFIG` (set by `tfdist launch` and
            TFJob manifests from their flags), else the defaults.
        cluster_resolver: optional; default reads `TF_CONFIG`.
        timeout_seconds: how long the start may wait for the other workers,
            and one call of the step function of `fit`, `evaluate` or
            `predict` may run, before failing with an error instead of
            hanging (`tfdist.cluster.watchdog`). A task that dies or freezes
            is reported sooner, by TensorFlow's heartbeats (about 10 s).
        layout_map: with `tensor` > 1, a `keras.distribution.LayoutMap` (as
            keras-hub's `get_layout_map` returns) the tensor plan follows;
            what it asks that tfdist cannot run is refused before training
            (`tfdist.tensor.layout_map`). Code, not a config field: each task
            of a job builds it in the script it runs.
        **fields: the `ParallelConfig` fields.

    Example:

    ```python
    # on every worker, with TF_CONFIG set (tfdist launch does it):
    strategy = tfdist.MultiWorkerStrategy(microbatches=2)
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="sgd", loss="mse")
    model.fit(dataset, epochs=2)
    ```
    """

    def __init__(self, config=None, *, cluster_resolver=None,
                 timeout_seconds: float = 300.0, layout_map=None, **fields):
        check_timeout_seconds(timeout_seconds)
        if "plan" in fields:
            raise ValueError(
                "MultiWorkerStrategy takes no `plan`: give every task the same one as "
                "a config (`tfdist plan ... --json > plan.json`, then `tfdist launch "
                "--config plan.json ...`). Tasks planning for themselves would each "
                "time their own host, and could disagree.")
        # fails before connecting:
        config = requested_config(config, fields, "MultiWorkerStrategy")
        check_layout_map(layout_map, config.tensor, config.zero)
        # TF's own wait has no deadline:
        task = wait_for_peers(timeout_seconds, cluster_resolver)
        own_collective_keys(self)
        if task is not None:  # a task dying after the wait above: bounded too
            bound_task_registration(task.cluster, task.task_type, timeout_seconds)
        # No per-collective timeout: TensorFlow spends a sleeping thread on
        # each one for the whole timeout. Lost peers are TensorFlow's
        # heartbeats' to find; the watchdog bounds each step.
        try:
            super().__init__(cluster_resolver=cluster_resolver)
        except tf.errors.DeadlineExceededError as error:
            if "Wait_for_all_tasks_to_register" not in str(error):
                raise
            raise _registration_timeout(error, task, timeout_seconds) from error
        if task is not None and task.task_type in SYNCHRONOUS_TASK_TYPES:
            check_tasks_agree(self, task.task, config, timeout_seconds)
        self._timeout_seconds = float(timeout_seconds)
        watch_step_functions(MultiWorkerStrategy)
        self.pipeline_devices = _stages_on_each_worker(
            self.extended.worker_devices, config.pipeline)
        config = config.resolve(self.num_replicas_in_sync * config.pipeline)
        self._init_step_owner(config, layout_map)
        self._tensor_mesh = modes.tensor_mesh(self, config)
        modes.start(self, config)

    @property
    def timeout_seconds(self) -> float:
        """How long one step function call may run (see the class's Args)."""
        return self._timeout_seconds

    def reduce(self, reduce_op, value, axis):
        """`tf.distribute.Strategy.reduce`, made to work for Keras 3's `fit`.

        Two calls Keras 3 makes fail on the plain `MultiWorkerMirroredStrategy`:
        reducing an `(x, y)` batch (nested values, which `tf.distribute`
        documents but this strategy does not reduce), and reducing scalar metric
        results with `axis=0`. Here each leaf is reduced on its own, and a
        scalar, having no axis, is reduced across replicas only.
        """
        if tf.nest.is_nested(value):
            return tf.nest.map_structure(
                lambda leaf: self.reduce(reduce_op, leaf, axis), value
            )
        if axis is not None and _rank(value) == 0:
            axis = None
        return super().reduce(reduce_op, value, axis)


def _registration_timeout(error, task, timeout_seconds):
    """A clear `TimeoutError` for TensorFlow's registration barrier timing
    out: the tasks that never registered (started, then died or hung)."""
    missing = re.findall(r"^/job:(\w+)/replica:\d+/task:(\d+)$", str(error), re.MULTILINE)
    names = ", ".join(sorted({f"{job}:{index}" for job, index in missing})) or "some task"
    return TimeoutError(
        f"{task.task} waited {timeout_seconds:g} s for every task to register with "
        f"TensorFlow, but {names} did not: it answered at the start, then died or "
        f"hung before joining (look at its log), or raise `timeout_seconds`.")


def _rank(value):
    """Rank of a tensor, or of each component of a distributed value."""
    if isinstance(value, tf.distribute.DistributedValues):
        value = value.values[0]
    return getattr(value, "shape", tf.TensorShape(None)).rank


def _check_planned_devices(config, devices):
    """A plan is for as many devices as the strategy has."""
    planned = config.devices_needed
    if planned != len(devices):
        raise ValueError(
            f"`plan` is for {planned} devices (data={config.data} x pipeline="
            f"{config.pipeline} x tensor={config.tensor}), but this Strategy has "
            f"{len(devices)}: plan for devices={len(devices)}, or name {planned} of "
            f"them: tfdist.Strategy(plan=..., devices={list(devices[:planned])!r}).")


def _devices_hint(config, devices) -> str:
    """How to run a mesh smaller than the host on some of its devices.

    Example:

    >>> print(_devices_hint(ParallelConfig(data=2), ["CPU:0", "CPU:1", "CPU:2"]))
     To use 2 of the 3 devices, name them: tfdist.Strategy(..., devices=['CPU:0', 'CPU:1']).
    """
    needed = config.devices_needed
    if needed is None or needed >= len(devices):
        return ""
    return (f" To use {needed} of the {len(devices)} devices, name them: "
            f"tfdist.Strategy(..., devices={list(devices[:needed])!r}).")


def _stages_on_each_worker(replica_devices, stages):
    """Each worker's replica device and the next `stages - 1` devices of its
    host: pipeline within a host, data across hosts."""
    if stages == 1:
        return [[device] for device in replica_devices]
    if len(replica_devices) != 1:
        raise NotImplementedError(
            f"`pipeline={stages}` with several replicas on one worker "
            f"({len(replica_devices)}: {list(replica_devices)}) is not available; "
            f"MultiWorkerStrategy pipelines workers that train on one device each.")
    spec = tf.DeviceSpec.from_string(replica_devices[0])
    local = tf.config.list_logical_devices(spec.device_type)
    if len(local) < stages:
        raise ValueError(
            f"`pipeline={stages}` needs {stages} {spec.device_type} devices on each "
            f"worker, but this one has {len(local)}: call "
            f"`tfdist.use_virtual_devices({stages})` (CPU) before creating the strategy.")
    return [[spec.replace(device_index=s).to_string() for s in range(stages)]]
