"""The table of modes: what each mode a config turns on does to a model and its step.

Every mode of `ParallelConfig` is one `Mode` in `MODES`. A mode says:

- `on(config, optimizer)`: whether the config (or the model's optimizer:
  `OneBitAdam`) turns it on;
- `start(strategy, config)`: what it sets up on a new strategy (`pipeline`'s
  summary of its stages, its warning of a large bubble);
- `check(model, config, flavour)`: what it refuses in a compiled model, before
  the first step (`keras3_only(config)`: every tf_keras model);
- `place`, `split`, `shard` (on a `StepPlan`): what it does to the model when
  the step is prepared, and the compute, reduce and update parts it
  contributes. Every mode's `place` runs first (pipeline stages onto their
  devices), then every `split` (layers over tensor groups), then every
  `shard` (ZeRO's state): the order is the table's, whatever the config;
- `evaluating(fn, model)`: how Keras's test and predict steps run under it;
- `describe(layout)`: its lines of `Strategy.describe`;
- `peak_bytes(config, model)`: what it keeps on each replica and gathers at
  once beyond `tfdist.sharding.peak`'s parts (`planned_peak` adds them).

`assemble` (the step's parts), `check` (the rules on the model),
`evaluating` (`Strategy.run`) and `describe` (`Strategy.describe`) read this
list; the parts themselves take what they need when they are built and do
not ask which modes are on. The parts by config:

| config              | compute            | reduce               | update         |
|---------------------|--------------------|----------------------|----------------|
| (default)           | `LocalCompute`     | `AllReduce`          | `KerasApply`   |
| `tensor` > 1        | `LocalCompute`     | `DataGroupAllReduce` | `KerasApply`   |
| `pipeline` > 1      | `PipelinedCompute` | (as above)           | (as above)     |
| `zero` 1, 2         | (as above)         | `ShardedReduce`      | `ShardedUpdate`|
| `zero` 3            | `PipelinedCompute` | `AlreadyReduced`     | `ShardedUpdate`|
| a tf_keras model    | `LocalCompute`     | `AllReduce`          | `TfKerasApply` |
| `compression`       | (as above)         | `CastCompression` around the above | (as above) |

(`zero=3`'s `PipelinedCompute` runs `GatheredUnits`, or with `pipeline` the
stages gathering their parameters and reduce-scattering their gradients:
`tfdist.optim.zero3`; a tf_keras model's microbatch loss is `TfKerasLoss`
and its sharded update `TfKerasShardedUpdate`: its `Flavour`.)

A new mode is its field in `tfdist/config.py` (its rules in `validate`; the
command line's flag follows) and one `Mode` here.

Example:

>>> [mode.name for mode in active(ParallelConfig(data=2, zero=1, microbatches=2))]
['data', 'precision', 'microbatches', 'zero']
"""

import dataclasses
import gc
import warnings
from typing import Any

import keras
import tensorflow as tf

from tfdist._compat.keras_functional import nested_sublayers
from tfdist.config import ParallelConfig
from tfdist.engine.compression import (
    CAST_DTYPES,
    CastCompression,
    GatheredCompression,
    Int8Compression,
    PowerSGDCompression,
    TopKCompression,
    WarmUp,
    matrix_view,
)
from tfdist.engine.compute import LocalCompute, PipelinedCompute
from tfdist.engine.reduce import AllReduce, AlreadyReduced, DataGroupAllReduce, ShardedReduce
from tfdist.engine.tf_keras import (
    TfKerasApply,
    TfKerasLoss,
    check_microbatches,
    check_tf_keras_optimizer,
    check_tf_keras_policy,
    is_tf_keras,
)
from tfdist.engine.update import KerasApply
from tfdist.optim import zero3
from tfdist.optim.one_bit_adam import OneBitAdam, OneBitReduce
from tfdist.optim.tf_keras_zero import TfKerasShardedUpdate, check_tf_keras_shardable
from tfdist.optim.zero import ShardedUpdate, check_shardable
from tfdist.pipeline import schedule as pipeline_schedule
from tfdist.pipeline import stages as pipeline_stages
from tfdist.pipeline import summary as pipeline_summary
from tfdist.pipeline.compute import pipeline_compute
from tfdist.pipeline.cost import sequence_length_of
from tfdist.pipeline.graph import graph_of
from tfdist.sharding.collectives import ALONE_BYTES
from tfdist.sharding.creation import whole_where_not_kept
from tfdist.sharding.layout import AxisLayout
from tfdist.sharding.peak import (
    MICROBATCH_BYTES_PER_WEIGHT,
    STAGE_CALL_BYTES_PER_WEIGHT,
    forward_ops,
    gathering_peak,
    has_slots,
    held_sizes,
    microbatch_rows,
    not_at_once_bytes,
    predict_peak,
    program_bytes,
    tensors_bytes,
    transport_bytes,
    update_bytes,
    weight_bytes,
)
from tfdist.sharding.replica_state import StateBytes, state_of
from tfdist.sharding.wire import CastWire, Wire
from tfdist.tensor import plan as tensor_plan
from tfdist.tensor.mesh import TensorMesh


class Keras3:
    """A Keras 3 model's loss, update and rules, for the modes (`Flavour`).

    Example:

    ```python
    Keras3(model).apply()   # KerasApply(model)
    ```
    """

    def __init__(self, model, loss=None, optimizer=None):
        self.model = model
        self.loss = loss
        self.optimizer = optimizer or getattr(model, "optimizer", None)

    def check_policy(self, precision):
        policy = self.model.dtype_policy.name
        if policy != precision:
            raise ValueError(
                f"The model was built with dtype policy {policy!r} but the "
                f"strategy has `precision={precision!r}`: build the model "
                f"inside `strategy.scope()`, which sets the policy.")
        if precision == "mixed_float16" and not isinstance(
                self.optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "`precision='mixed_float16'` needs loss scaling, but the model's "
                f"optimizer is a {type(self.optimizer).__name__}: compile with "
                "`auto_scale_loss=True` (the default) or wrap the optimizer in "
                "`keras.optimizers.LossScaleOptimizer`.")

    def check_optimizer(self):
        """(A Keras 3 model's optimizer is checked with the model: `check_model`.)"""

    def check_microbatches(self, microbatches):
        """(Keras 3's losses are checked as the batch is split.)"""

    def check_shardable(self, zero):
        check_shardable(self.optimizer, zero)

    def sharded_update(self, zero, mesh):
        return ShardedUpdate(self.model, zero, mesh)

    def apply(self):
        return KerasApply(self.model)

    def make_whole(self):
        """What the scope created as shards and no mode kept, whole again."""
        whole_where_not_kept(self.model)


class TfKeras(Keras3):
    """A tf_keras model's: its loss (`TfKerasLoss`), optimizer and rules.

    Example:

    ```python
    TfKeras(model).apply()   # TfKerasApply(model)
    ```
    """

    def __init__(self, model, loss=None, optimizer=None):
        super().__init__(model, loss or TfKerasLoss(model, optimizer), optimizer)

    def check_optimizer(self):
        check_tf_keras_optimizer(self.model, self.optimizer)

    def check_policy(self, precision):
        check_tf_keras_policy(self.model, precision)

    def check_microbatches(self, microbatches):
        check_microbatches(self.model, microbatches)

    def check_shardable(self, zero):
        check_tf_keras_shardable(self.optimizer, zero)

    def sharded_update(self, zero, mesh):
        return TfKerasShardedUpdate(self.model, zero, mesh, self.optimizer)

    def apply(self):
        return TfKerasApply(self.model, self.optimizer)

    def make_whole(self):
        """(The scope creates no shards a tf_keras step leaves.)"""


def flavour_of(model, loss=None, optimizer=None) -> Keras3:
    """`model`'s flavour: `TfKeras` for a tf_keras model, else `Keras3`.

    Example:

    >>> type(flavour_of(keras.Sequential([keras.layers.Dense(1)]))).__name__
    'Keras3'
    """
    return (TfKeras if is_tf_keras(model) else Keras3)(model, loss, optimizer)


@dataclasses.dataclass
class StepPlan:
    """What the modes build a step from, and the parts contributed so far.

    Attributes:
        model: the compiled model.
        config: the strategy's `ParallelConfig`.
        mesh: the strategy's `replica_mesh`.
        flavour: the model's `Keras3` or `TfKeras`.
        sequence_length: the first batch's, for the pipeline stages' costs.
        first_batch: the first batch (or its symbolic tensors), when known.
        pipeline: the `PipelineCompute` once stages are placed.
        compute, reduce, update: the step's parts (None: the default's).
        whole: the reduce part of gradients reduced whole.
        wire: how ZeRO's reduce-scatters and zero=3's parameter gathers
            send values (`tfdist.sharding.wire`).

    Example:

    ```python
    plan = StepPlan(model, config, strategy.replica_mesh, Keras3(model))
    ```
    """

    model: Any
    config: ParallelConfig
    mesh: Any
    flavour: Keras3
    sequence_length: int | None = None
    first_batch: Any = None
    pipeline: Any = None
    compute: Any = None
    reduce: Any = None
    update: Any = None
    whole: Any = dataclasses.field(default_factory=AllReduce)
    wire: Wire = dataclasses.field(default_factory=Wire)

    @property
    def strategy(self):
        return self.model.distribute_strategy


@dataclasses.dataclass
class Layout:
    """A model's layout under a strategy, for `describe`: its pipeline
    stages (None without `pipeline`), tensor plan decisions, and the
    `AxisLayout` of each weight they split, by id (`strategy` None when
    planned from a config alone, `planned_layout`).

    Example:

    ```python
    layout = layout_of(strategy, model)
    ```
    """

    strategy: Any
    model: Any
    stages: list | None
    decisions: list
    split: dict


class Mode:
    """One mode of the table; the base does nothing (see the module's docs).

    Example:

    ```python
    class Compression(Mode):
        name = "compression"
        def on(self, config, optimizer=None): return config.compression != "none"
    ```
    """

    name = ""

    def on(self, config, optimizer=None) -> bool:
        """Whether `config` (or `optimizer`, the model's) turns it on."""
        return False

    def keras3_only(self, config) -> bool:
        """Whether a tf_keras model is refused under it (when on)."""
        return False

    def named(self, config) -> str:
        """The mode as its config writes it (for messages)."""
        return f"{self.name}={getattr(config, self.name)}"

    def start(self, strategy, config):
        """What it sets up on a new `strategy` of `config`."""

    def check(self, model, config, flavour):
        pass

    def place(self, plan):
        pass

    def split(self, plan):
        pass

    def shard(self, plan):
        pass

    def evaluating(self, fn, model, config):
        return fn

    def describe(self, layout) -> list[str]:
        return []

    def peak_bytes(self, config, model) -> tuple[int, int]:
        """(the state it keeps on each replica, the bytes its collectives
        gather at once on a device) beyond `tfdist.sharding.peak`'s parts."""
        return 0, 0


class Data(Mode):
    """Data parallelism: always on; its parts are the default ones, the
    all-reduce in buckets of `bucket_bytes`."""

    name = "data"

    def on(self, config, optimizer=None):
        return True

    def check(self, model, config, flavour):
        check_synchronized_batch_norm(model, config)

    def split(self, plan):
        plan.whole = AllReduce(plan.config.bucket_bytes)


class Precision(Mode):
    """`precision`: the model's dtype policy must be it (always checked)."""

    name = "precision"

    def on(self, config, optimizer=None):
        return True

    def check(self, model, config, flavour):
        flavour.check_policy(config.precision)


class Microbatches(Mode):
    """`microbatches`: the computes split each batch (they take the count)."""

    name = "microbatches"

    def on(self, config, optimizer=None):
        return config.microbatches > 1

    def check(self, model, config, flavour):
        flavour.check_microbatches(config.microbatches)


class Xla(Mode):
    """`xla`: the computes compile their forward and backward (they take the flag)."""

    name = "xla"

    def on(self, config, optimizer=None):
        return config.xla


class Pipeline(Mode):
    """`pipeline`: the stages placed on their devices; the microbatches flow
    through them in the schedule's order."""

    name = "pipeline"

    def on(self, config, optimizer=None):
        return config.pipeline > 1

    def keras3_only(self, config):
        return True

    def start(self, strategy, config):
        pipeline_summary.install()
        if config.microbatches < config.pipeline:  # the stages would mostly wait
            warnings.warn(
                f"`microbatches={config.microbatches}` < `pipeline={config.pipeline}`: "
                f"stages wait for each other most of the step (bubble "
                f"{(config.pipeline - 1) / (config.microbatches + config.pipeline - 1):.0%}"
                f" of it). Use microbatches >= {config.pipeline}, ideally several times "
                f"more.", stacklevel=4)

    def place(self, plan):
        length = plan.sequence_length
        if length is None and plan.first_batch is not None:
            x, _, _ = keras.utils.unpack_x_y_sample_weight(plan.first_batch)
            length = sequence_length_of(graph_of(plan.model).inputs, x)
        plan.pipeline = pipeline_compute(plan.model, plan.strategy, length)
        plan.compute = PipelinedCompute(plan.model, plan.config.microbatches, plan.pipeline,
                                        plan.mesh)

    def describe(self, layout):
        return [pipeline_stages.describe(layout.stages, pipeline_stages.stage_devices(
            layout.strategy.config, layout.strategy.pipeline_devices))]


class Schedule(Mode):
    """`schedule` (with `pipeline`): the order of the stages' work; described
    last, as a grid."""

    name = "schedule"

    def on(self, config, optimizer=None):
        return config.pipeline > 1

    def describe(self, layout):
        config = layout.strategy.config
        virtual = (f", {config.virtual_stages} stages per device"
                   if config.virtual_stages > 1 else "")
        return [f"schedule {config.schedule}, {config.microbatches} microbatches{virtual}:",
                pipeline_schedule.grid(pipeline_schedule.stage_orders(
                    config.schedule, config.pipeline, config.microbatches,
                    config.virtual_stages))]


class Tensor(Mode):
    """`tensor`: layers split over tensor groups; gradients reduced whole
    over the data group."""

    name = "tensor"

    def on(self, config, optimizer=None):
        return config.tensor > 1

    def keras3_only(self, config):
        return True

    def check(self, model, config, flavour):
        # split weights are updated shard by shard
        check_shardable(flavour.optimizer, config.zero, mode=f"`tensor={config.tensor}`",
                        elementwise_only=True)

    def split(self, plan):
        # Keras's update checks the rank's own gradients: with loss scaling,
        # an overflow on one rank is made everyone's, so that every rank
        # skips the step (ZeRO's update shares it itself).
        share = (not plan.config.zero and
                 isinstance(plan.flavour.optimizer, keras.optimizers.LossScaleOptimizer))
        plan.whole = DataGroupAllReduce(plan.mesh, share_non_finite=share,
                                        bucket_bytes=plan.config.bucket_bytes)
        tensor_plan.partition_model(plan.model, plan.mesh)
        if plan.pipeline is not None:
            plan.pipeline.split_copies()  # a tied embedding's, on the last stage

    def describe(self, layout):
        return [tensor_plan.describe(layout.decisions)]


class Zero(Mode):
    """`zero`: the optimizer's state (and at 3 the parameters) in shards."""

    name = "zero"

    def on(self, config, optimizer=None):
        return config.zero > 0

    def keras3_only(self, config):
        return config.zero == 3

    def check(self, model, config, flavour):
        flavour.check_shardable(config.zero)
        if config.zero == 3:
            zero3.check_model(model)

    def shard(self, plan):
        config, mesh = plan.config, plan.mesh
        with tf.init_scope():
            plan.update = plan.flavour.sharded_update(config.zero, mesh)
        layouts = plan.update.layouts
        if config.zero < 3:
            plan.reduce = ShardedReduce(layouts, config.zero, mesh, plan.whole, plan.wire)
            return
        if plan.pipeline is not None:  # the stages gather and reduce-scatter
            zero3.gather_stage_parameters(plan.pipeline, layouts, plan.whole, plan.wire)
        else:  # the units gather them
            units = zero3.GatheredUnits(plan.model, layouts, plan.strategy.pipeline_devices,
                                        mesh, plan.whole, config.zero3_unit_params,
                                        plan.wire)
            plan.compute = PipelinedCompute(plan.model, config.microbatches, units, mesh)
        plan.reduce = AlreadyReduced(plan.whole)

    def evaluating(self, fn, model, config):
        # evaluate and predict with the parameters gathered
        return zero3.with_gathered_parameters(fn, model) if config.zero == 3 else fn

    def describe(self, layout):
        config = layout.strategy.config
        if config.zero != 3:
            return []
        return [zero3.describe(layout.model,
                               layout.strategy.num_replicas_in_sync // config.tensor,
                               config.zero3_unit_params, layout.stages, layout.split)]


class Compression(Mode):
    """`compression`: the step's gradient collectives in a narrower dtype, or
    gathered as int8 blocks or each replica's Top-K, or PowerSGD's factors:
    wraps the whole reduce after `tensor` chose it, and gives the wire of
    ZeRO's reduce-scatters and zero=3's gathers, which `zero` builds after
    (the shard phase follows the split). The residuals of Top-K and
    PowerSGD are the step's `ReplicaState`, made here."""

    name = "compression"

    def on(self, config, optimizer=None):
        return config.compression != "none"

    def split(self, plan):
        # The whole reduce: the all-reduce, and the gather of sparse slices
        # ZeRO's reduce hands it (every gradient under zero=1).
        config = plan.config
        if config.compression in CAST_DTYPES:
            plan.whole = CastCompression(plan.whole, CAST_DTYPES[config.compression])
            plan.wire = CastWire(CAST_DTYPES[config.compression])
            return
        inner = plan.whole
        if config.compression_warmup:  # (compressing in a cond's branch: no merge call)
            inner = DataGroupAllReduce(plan.mesh, bucket_bytes=config.bucket_bytes)
        plan.whole = self.part(config, inner, plan.mesh)
        if isinstance(plan.whole, Int8Compression):
            plan.wire = plan.whole.wire
        plan.whole.init(state_of(plan.model), plan.model.trainable_weights)
        if config.compression_warmup:
            iterations, steps = plan.flavour.optimizer.iterations, config.compression_warmup
            plan.whole = WarmUp(plan.whole, lambda: iterations < steps, plan.mesh)

    def part(self, config, inner, mesh):
        """The gathered or low-rank reduce part of `config.compression`
        standing for `inner`, its state not made yet."""
        if config.topk_fraction is not None:
            return TopKCompression(inner, config.topk_fraction, mesh)
        if config.powersgd_rank is not None:
            return PowerSGDCompression(inner, config.powersgd_rank, mesh)
        return Int8Compression(inner, mesh)

    def peak_bytes(self, config, model):
        # Each replica's residuals (and PowerSGD's Q's) as the part's `init`
        # makes them; a gathered compression receives every replica's payload
        # (under zero 2/3, int8 rides the reduce-scatter, which receives a
        # shard's: left out).
        if config.compression in CAST_DTYPES:
            return 0, 0
        part, counted = self.part(config, None, None), StateBytes()
        part.init(counted, model.trainable_weights)
        gathered = 0
        if isinstance(part, GatheredCompression) and config.zero < 2:
            gathered = config.data * compression_ratio(config, model.trainable_weights) * \
                _floating_bytes(model.trainable_weights)
        return counted.bytes, int(gathered)


class OneBit(Mode):
    """A `tfdist.optim.OneBitAdam` optimizer turns it on: after its warm-up
    the replicas' momenta cross devices as signs, `OneBitReduce` standing in
    for the whole reduce; its residuals are the step's `ReplicaState`, made
    here."""

    name = "one_bit_adam"

    def on(self, config, optimizer=None):
        return isinstance(getattr(optimizer, "inner_optimizer", optimizer), OneBitAdam)

    def named(self, config):
        return "tfdist.optim.OneBitAdam"

    def check(self, model, config, flavour):
        if not isinstance(flavour.optimizer, OneBitAdam):  # a LossScaleOptimizer's
            raise NotImplementedError(
                "`tfdist.optim.OneBitAdam` under loss scaling (`precision="
                "'mixed_float16'`) is not available in this version: its momentum "
                "residuals would mix gradients of different scales. Use "
                "precision='mixed_bfloat16' or 'float32'.")
        off = [f"`{item}`" for item in config.changed("compression", "zero", "tensor",
                                                        "pipeline")]
        if off:
            raise NotImplementedError(
                f"`tfdist.optim.OneBitAdam` with {' and '.join(off)} is not available in "
                f"this version: it sends each replica's whole momentum as signs, which "
                f"needs plain data parallelism (with microbatches) and no other "
                f"compression. Drop {'that option' if len(off) == 1 else 'those options'}, "
                f"or use keras.optimizers.Adam.")

    def split(self, plan):
        optimizer, weights = plan.flavour.optimizer, plan.model.trainable_weights
        compressed = OneBitReduce(plan.whole, optimizer, plan.mesh)
        compressed.init(state_of(plan.model), weights)
        plan.whole = WarmUp(compressed, optimizer.warming_up, plan.mesh)

    def peak_bytes(self, config, model):
        # Its momentum residuals; after the warm-up every replica's signs
        # (a bit an element) and scales are gathered.
        counted = StateBytes()
        OneBitReduce(None, model.optimizer, None).init(counted, model.trainable_weights)
        return counted.bytes, config.data * _floating_bytes(model.trainable_weights) // 32


# The table, in the order modes are checked, prepared within a phase, and described.
# (`one_bit_adam` is checked before `zero`, which would ask for an
# elementwise optimizer: it refuses zero itself, and tensor and compression,
# whose parts it would replace.)
MODES = (Data(), Precision(), Microbatches(), Xla(), OneBit(), Pipeline(), Zero(), Tensor(),
         Compression(), Schedule())


def keeps_replica_state(model, config) -> bool:
    """Whether `model`'s step under `config` keeps state on each replica (its
    checkpoints must be `ShardedCheckpoint`s): a compression with residuals,
    or `OneBitAdam`'s.

    Example:

    >>> keeps_replica_state(keras.Sequential(), ParallelConfig(compression="topk:0.01"))
    True
    """
    return config.keeps_replica_state or isinstance(getattr(model, "optimizer", None),
                                                    OneBitAdam)


# Each compression's bytes on the wire against uncompressed, where it is a
# constant (docs/benchmarks.md, "Compression"); Top-K and PowerSGD are
# computed from their parameter.
_FIXED_RATIOS = {"none": 1.0, "bf16": 0.5, "fp16": 0.5, "int8": 0.26}


def compression_ratio(config: ParallelConfig, weights) -> float:
    """Bytes the data group's gradient collectives move under
    `config.compression`, against uncompressed, for `weights`' gradients.

    Top-K sends each fraction's values and int32 indices; PowerSGD each
    matrix, seen as the compression sees it (`matrix_view`), as two rank-r
    factors when they are smaller, the rest whole.

    Example:

    >>> compression_ratio(ParallelConfig(data=4, compression="bf16"), [])
    0.5
    """
    if config.compression in _FIXED_RATIOS:
        return _FIXED_RATIOS[config.compression]
    if config.topk_fraction is not None:
        return min(1.0, 2 * config.topk_fraction)
    rank, sent, whole = config.powersgd_rank, 0, 0
    for v in weights:
        shape = tf.TensorShape(v.shape)
        size = shape.num_elements()
        whole += size
        sent += min(size, rank * sum(matrix_view(shape))) if shape.rank >= 2 else size
    return sent / whole if whole else 1.0


def _floating_bytes(weights) -> int:
    return sum(v.shape.num_elements() * tf.as_dtype(v.dtype).size for v in weights
               if tf.as_dtype(v.dtype).is_floating)


def active(config, optimizer=None) -> list[Mode]:
    """The modes `config` (and `optimizer`, the model's) turn on, in the
    table's order.

    Example:

    >>> [mode.name for mode in active(ParallelConfig(tensor=2, xla=False))]
    ['data', 'precision', 'tensor']
    """
    return [mode for mode in MODES if mode.on(config, optimizer)]


def start(strategy, config: ParallelConfig):
    """Every active mode's set-up of a new tfdist `strategy` of `config`
    (`pipeline`'s summary of the stages).

    Example:

    ```python
    start(strategy, config)
    ```
    """
    for mode in active(config):
        mode.start(strategy, config)


def tensor_mesh(strategy, config: ParallelConfig, stage_devices=None):
    """The `TensorMesh` of `strategy`'s replicas (stage s of replica r on
    `stage_devices[r][s]`) when `config.tensor` > 1, else None.

    Example:

    ```python
    tensor_mesh(strategy, strategy.config).tensor   # 2 under tensor=2
    ```
    """
    return TensorMesh(strategy, config.tensor, stage_devices) if config.tensor > 1 else None


def example_group(config: ParallelConfig, mesh):
    """The replicas whose examples make up the global batch with each one's,
    for `tfdist.batch_statistics`: `mesh`'s data group, or None where each
    replica's statistics are the batch's already (one data replica) or stay
    each microbatch's (`pipeline`).

    Example:

    ```python
    example_group(strategy.config, strategy.replica_mesh).data_launcher()
    ```
    """
    return None if config.pipeline > 1 or mesh.data == 1 else mesh


def check(model, config: ParallelConfig, optimizer=None):
    """Every active mode's rules on the compiled `model` (a Keras 3 or
    tf_keras model; `optimizer`, else its compiled one), before the first
    step: what a tf_keras model cannot run first.

    Example:

    ```python
    check(model, strategy.config)   # ValueError: "...dtype policy..."
    ```
    """
    flavour = flavour_of(model, optimizer=optimizer)
    on = active(config, flavour.optimizer)
    if isinstance(flavour, TfKeras):
        refused = [mode.named(config) for mode in on if mode.keras3_only(config)]
        if refused:
            raise NotImplementedError(
                f"{getattr(model, 'name', model)!r} is a tf_keras (Keras 2) model: tfdist's "
                f"step gives it data parallelism, microbatches, precision, xla and zero 1/2, "
                f"but not {' or '.join(refused)} (Keras 3 models only). Remove "
                f"{'that option' if len(refused) == 1 else 'those options'}, or "
                f"build the model with Keras 3 (`import keras`).")
    flavour.check_optimizer()
    for mode in on:
        mode.check(model, config, flavour)


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


def assemble(model, config: ParallelConfig, sequence_length=None, loss=None, optimizer=None,
             first_batch=None):
    """The (compute, reduce, update) parts of `model`'s step under `config`.

    `sequence_length` (or else `first_batch`'s), the length the model's
    inputs leave unknown, sizes the pipeline stages' cost estimates. A
    tf_keras model's step uses `loss` (default `TfKerasLoss`) and
    `optimizer` (default its compiled one).

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
    if config.shards_state:
        # The graphs traced so far (Keras's symbolic build, the tensor plan's
        # trace) are reference cycles holding the handles of the variables
        # about to move: collected first, each replaced storage is freed as
        # it is replaced instead of at the next cyclic collection.
        gc.collect()
    flavour = flavour_of(model, loss, optimizer)
    plan = StepPlan(model, config, model.distribute_strategy.replica_mesh, flavour,
                    sequence_length, first_batch)
    if config.zero and not getattr(flavour.optimizer, "built", True):
        raise RuntimeError(
            "The optimizer is not built: call `TrainStep.build(...)` "
            "(or `model.fit`, which builds it) before running the step.")
    on = active(config, flavour.optimizer)
    for mode in on:
        mode.place(plan)
    with tf.init_scope():
        for mode in on:
            mode.split(plan)
        flavour.make_whole()
    for mode in on:
        mode.shard(plan)
    compute = plan.compute or LocalCompute(model, config.microbatches, plan.mesh,
                                           xla=config.xla, loss=flavour.loss)
    return compute, plan.reduce or plan.whole, plan.update or flavour.apply()


def evaluating(fn, model, config: ParallelConfig):
    """`fn`, Keras's test or predict step of `model`, as the active modes run it.

    Example:

    ```python
    fn = evaluating(model.test_step, model, strategy.config)
    ```
    """
    for mode in active(config, getattr(model, "optimizer", None)):
        fn = mode.evaluating(fn, model, config)
    return fn


def layout_of(strategy, model, sequence_length=None) -> Layout:
    """`model`'s `Layout` under `strategy`.

    Example:

    ```python
    layout_of(strategy, model).stages   # with pipeline: its Stages
    ```
    """
    return dataclasses.replace(
        planned_layout(strategy.config, model, sequence_length, strategy.layout_map),
        strategy=strategy)


def planned_layout(config: ParallelConfig, model, sequence_length=None,
                   layout_map=None) -> Layout:
    """`model`'s `Layout` under `config`, with no strategy made (its
    `strategy` None): what `tfdist.plan` weighs each config by.

    Example:

    ```python
    planned_layout(ParallelConfig(pipeline=2), model).stages
    ```
    """
    stages = pipeline_stages.plan_stages(
        model, config.model_stages, config.stage_boundaries,
        sequence_length) if config.pipeline > 1 else None
    decisions = tensor_plan.plan(model, config.tensor, config.vocab_parallel_classifier,
                                 layout_map) if config.tensor > 1 else []
    split = {id(v): AxisLayout(v.shape, axis, config.tensor) for d in decisions
             for v, axis in d.layout.weight_axes(d.layer)}
    return Layout(None, model, stages, decisions, split)


def describe(strategy, model, sequence_length=None, batch_size=None) -> str:
    """`Strategy.describe`: each active mode's lines (pipeline stages and
    schedule, ZeRO-3's units, the tensor plan); without any, the replicated
    plan; with `batch_size`, the predicted peak last.

    Example:

    ```python
    print(describe(strategy, model))
    ```
    """
    layout = layout_of(strategy, model, sequence_length)
    parts = [line for mode in active(strategy.config, getattr(model, "optimizer", None))
             for line in mode.describe(layout)]
    if not parts:
        parts.append(tensor_plan.describe(tensor_plan.plan(
            model, 1, strategy.config.vocab_parallel_classifier, strategy.layout_map)))
    if batch_size is not None:
        parts.append(str(predicted_peak(strategy, model, batch_size, sequence_length, layout)))
    return "\n".join(parts)


def predicted_peak(strategy, model, batch_size, sequence_length=None, layout=None):
    """`Strategy.predicted_peak` (`tfdist.sharding.peak.predict_peak`), for
    the processes the strategy's replicas run in.

    Example:

    ```python
    predicted_peak(strategy, model, 64).total
    ```
    """
    layout = layout or layout_of(strategy, model, sequence_length)
    return planned_peak(strategy.config, model, batch_size, sequence_length, layout,
                        processes=_processes(strategy),
                        shared_memory=all(tf.DeviceSpec.from_string(d).device_type == "CPU"
                                          for d in strategy.extended.worker_devices))


def _largest_data_collective(config, model, layout, sizes):
    """The bytes of the largest collective over the data replicas, for
    weights of `sizes` bytes: every gradient packed in one all-reduce (or a
    bucket of `bucket_bytes`, the largest gradient at least); under zero=2
    a reduce-scatter and gather of each weight of `ALONE_BYTES` or more
    alone, of the smaller ones packed; under zero=3 the same for each unit
    (or pipeline stage) it gathers on its own. Uncompressed."""
    if config.zero < 2:
        return config.all_reduce_pack(sum(sizes), max(sizes))
    groups = ([[weight_bytes([v], layout.split) for v in weights]
               for weights in zero3.each_unit_weights(config, model)]
              if config.zero == 3 and not layout.stages else [sizes])
    return max(max(_packed_and_alone(group)) for group in groups)


def _packed_and_alone(sizes):
    """(the bytes of the weights of `sizes` under `ALONE_BYTES`, which a
    gather or reduce-scatter packs in one collective; the largest of the
    others, each in a collective of its own, or 0)."""
    return (sum(size for size in sizes if size < ALONE_BYTES),
            max((size for size in sizes if size >= ALONE_BYTES), default=0))


def _replayed_forward_ops(config, model, sequence_length, stages):
    """The forward ops a device replays under the tape for its backward:
    zero=3's units replay the whole forward; with `remat` a pipeline
    device its stages' (the model's over `pipeline` devices); else none."""
    if zero3.replays_forward(config, stages):
        return forward_ops(model, sequence_length)
    if stages and config.remat:
        return forward_ops(model, sequence_length) // config.pipeline
    return 0


def _processes(strategy):
    """The chief and worker tasks of `strategy`'s cluster (1 without one)."""
    resolver = strategy.cluster_resolver
    if resolver is None:
        return 1
    jobs = resolver.cluster_spec().as_dict()
    return max(1, len(jobs.get("chief", [])) + len(jobs.get("worker", [])))


def planned_peak(config: ParallelConfig, model, batch_size, sequence_length=None,
                 layout=None, processes=1, shared_memory=False):
    """The busiest device's predicted `PeakEstimate` under `config` (resolved)
    with its replicas in `processes` processes: `tfdist.sharding.peak.predict_peak`
    of its layout, plus what the active modes keep on each replica (a
    compression's residuals, `OneBitAdam`'s) and gather at once, a tensor
    group's logits gathered from vocabulary shards a second time
    (`tensor.plan.gathers_logits`), the optimizer update's temporaries, the
    transport's copies and the step's program. With `shared_memory` (a
    process's devices are logical devices of one processor, sharing its
    memory), less what they do not hold at once (`not_at_once_bytes`): the
    mean of the process's peak per device.
    Under zero 1 and 2, the gather of the updated parameter shards at the
    step's end instead where it holds more (`gathering_peak`).

    Example:

    ```python
    planned_peak(ParallelConfig(data=4, compression="topk:0.01").resolve(4), model, 64)
    ```
    """
    layout = layout or planned_layout(config, model, sequence_length)
    peak = predict_peak(config, model, batch_size, sequence_length, layout.split,
                        layout.stages)
    if config.tensor > 1 and tensor_plan.gathers_logits(model, layout.decisions):
        # Each device holds its group's gathered logits twice at once: the
        # gather's result stacked by rank and the logits reordered from it
        # (`TensorMesh.gather_last`); the model's output counts one.
        peak.activations += tensors_bytes(model.outputs, microbatch_rows(config, batch_size),
                                          sequence_length)
    sizes = held_sizes(model, layout.stages, layout.split)
    devices = config.data * config.pipeline * config.tensor // processes
    peak.program = program_bytes(
        len(sizes), sharing=max(1, devices // config.pipeline),
        microbatches=config.microbatches,
        per_microbatch=(STAGE_CALL_BYTES_PER_WEIGHT if config.pipeline > 1
                        else MICROBATCH_BYTES_PER_WEIGHT),
        sharded_update=config.zero in (1, 2),
        units=zero3.program_units(config, model, layout.stages),
        replayed_ops=_replayed_forward_ops(config, model, sequence_length, layout.stages))
    if sizes:
        piece = -(-max(sizes) // config.data) if config.zero else max(sizes)
        peak.update = update_bytes(piece, has_slots(model))
        peak.transport = transport_bytes(_largest_data_collective(config, model, layout, sizes),
                                         config.data, processes, all_reduce=config.zero < 2)
    for mode in active(config, getattr(model, "optimizer", None)):
        state, gathered = mode.peak_bytes(config, model)
        peak.replica_state += state
        peak.gradients += gathered
    if shared_memory:
        peak.not_at_once = not_at_once_bytes(peak, devices,
                                             _freed_gradients(config, model, layout, peak),
                                             in_step=config.tensor)
    if config.zero in (1, 2) and sizes:
        gathering = _gathering(config, peak, sizes, processes,
                               devices if shared_memory else 1)
        return max(peak, gathering, key=lambda estimate: estimate.total)
    return peak


def _gathering(config, peak, sizes, processes, sharing):
    """What a device holds in zero 1 and 2's gather of its updated shards
    of weights of `sizes` bytes, `sharing` devices of its process sharing
    its memory (`gathering_peak`, `_packed_and_alone`)."""
    packed, alone = _packed_and_alone(sizes)
    return gathering_peak(peak, sum(-(-size // config.data) for size in sizes), packed, alone,
                          transport_bytes(max(packed, alone), config.data, processes,
                                          all_reduce=False), sharing)


def _freed_gradients(config, model, layout, peak):
    """The gradient bytes (and their copies) a device of a process no longer
    holds when another of its devices is at its peak (`not_at_once_bytes`)."""
    if config.reduces_stage_gradients_alone and config.zero < 3:
        # One stage at a time holds what it keeps beside its local gradients
        # for the reduce, and the copies between processes.
        return peak.gradients - peak.parameters + peak.transport
    if config.zero < 2 and config.data > 1:  # packed for the all-reduce, then freed
        # (zero=1's devices, measured, about half: GPT-2 8 x 512 93 MiB of
        # 128, an 8 x Dense(4096) MLP 280 of 512, Llama 8 x 512 less)
        return peak.parameters if config.zero == 0 else peak.parameters // 2
    return zero3.unit_gradient_bytes(config, model, layout.stages,
                                     lambda unit: weight_bytes(unit, layout.split))
