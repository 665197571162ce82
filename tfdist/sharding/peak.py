"""The predicted peak memory of one device during a training step.

`predict_peak` adds what a device holds at the busiest point of a step under
a strategy's `ParallelConfig`, from the model's weights, its optimizer's
slots and the first batch's size; `Strategy.describe(model, batch_size=...)`
prints it. Per device, the worst one (the largest stage under `pipeline`):

- parameters: its shard (`zero=3`), its tensor rank's slice of split weights,
  its stage's weights; whole otherwise;
- gradients: the local gradient of what it holds plus, with a data
  all-reduce, the packed buffer it sends (one bucket at a time with
  `bucket_bytes`, the largest gradient at least), or with microbatches their running
  sum (whole gradients, or one unit's under `zero=3`, whose reduced
  shards it keeps; under `zero=2` a piece of its reduce-scatter and the
  reduced shards instead);
- optimizer state: every slot of its variable's shape, split as the weight
  is and, with `zero` >= 1, sharded over the data replicas;
- gathered: under `zero=3`, the two largest units' parameters (the current
  and the next one); under zero 1 and 2, when the gather of the updated
  parameter shards at the step's end holds more than the backward, that
  gather's instead (`gathering_peak`: the shard buffers, in the optimizer
  state, the gathered weights, their copies between processes);
- activations: what the backward reads of the forward of the device's rows
  of one microbatch, inside layers as between them (`activation_bytes`:
  the traced step's, its slices where tensor groups split the layer; under
  zero=3, which replays each unit's forward for its backward, the units'
  inputs and the largest unit's), and the model's outputs (under
  `pipeline`, the mean stage's, times the microbatches its schedule holds
  at once, `held_activations`; with `remat`, only those microbatches'
  stage inputs, plus one stage's outputs recomputed; with microbatches
  otherwise, `HELD_MICROBATCHES` microbatches', measured), unknown lengths
  taken as `sequence_length`;
- not with gradients: less the smaller of the activations and the local
  gradients (without zero=3's units and pipeline stages, which hold theirs
  beside the activations): the backward frees the one as it makes the
  other, so that a device holds the activations whole at its start and the
  local gradients whole at its end;
- replica state: what a mode keeps on each replica (a compression's
  residuals, `OneBitAdam`'s), with the payloads a gathered compression
  receives in the gradients: `tfdist.engine.modes.planned_peak` adds them;
- update: the optimizer update's temporaries, for the largest piece a device
  updates (its shard under `zero`, its slice under `tensor`): twice its size
  for an optimizer with slots (Adam's new moments), once without (SGD's
  scaled gradient) (`update_bytes`);
- transport: when the data replicas are in several processes, TensorFlow's
  gRPC copies of the largest data collective's messages (`transport_bytes`):
  a ring all-reduce of S bytes over N replicas sends messages of S / N,
  each held about `ALL_REDUCE_COPIES` times at once (serialised and parsed,
  by its sender and its receiver); a gather or reduce-scatter receives a
  shard from each of the N - 1 others, held once more.
  `tfdist.engine.modes.planned_peak` adds both, each mode saying what its
  largest piece and collective are;
- program: TensorFlow's own memory for the step's program beside its
  tensors (the traced graph, its functions and kernels, and what the
  allocators keep around them), which grows with the step's ops, about
  50-100 per trainable weight (forward, backward, update): per weight the
  device computes, `PROGRAM_BYTES_PER_WEIGHT`, `TRACE_BYTES_PER_WEIGHT`
  shared by the devices of a process that run the same weights, more for
  zero=1 and 2's update, and per weight and microbatch past the first,
  what the mode's program adds for it: `MICROBATCH_BYTES_PER_WEIGHT` where
  the microbatches share one function body, `STAGE_CALL_BYTES_PER_WEIGHT`
  for a pipeline stage's call of its layers. `REPLAY_BYTES_PER_FORWARD_OP`
  for each op of the forward a device replays for its backward (zero=3's
  units; a pipeline stage's with `remat`; `forward_ops`), shared by the
  process's devices, and `UNROLLED_REPLAY_BYTES_PER_FORWARD_OP` for each
  microbatch past the first. Under zero=3, `UNIT_PROGRAM_BYTES` for each
  unit, and for each microbatch past the first (its program repeats its
  gathers, replays and reduce-scatters for each) `UNROLLED_MICROBATCH_BYTES`
  and `UNROLLED_MICROBATCH_DEVICE_BYTES_PER_WEIGHT` on each device plus,
  shared, `UNROLLED_MICROBATCH_BYTES_PER_WEIGHT` (`program_bytes`);
  `tfdist.engine.modes.planned_peak` adds it;
- not at once: where the devices are logical devices of one processor
  sharing its memory (`tfdist.use_virtual_devices`), the process holds its
  devices' peaks less what they do not hold at the same moment: one device
  peaks while the others wait for it at a collective, without what it frees
  before meeting them (`not_at_once_bytes`). Then the prediction is the
  mean over the process's devices of its peak, and negative here.

What the process held before the model was built (TensorFlow and Keras
themselves) is outside the prediction: `tools/bench_memory.py` sets the
prediction against each worker's peak above that baseline.
"""

import dataclasses
import math

import tensorflow as tf

from tfdist._compat.keras_optimizer import trainable_variables_of
from tfdist.optim import zero3
from tfdist.pipeline import stages as pipeline_stages
from tfdist.sharding.activations import traced_activations
from tfdist.sharding.slots import optimizer_slots

# How many times at once TensorFlow's gRPC transport holds a ring
# all-reduce's message between processes (docs/benchmarks.md: an all-reduce
# of S bytes over 4 workers adds 1.0-1.1 x S to each one's resident peak,
# its messages being S / 4; an all-gather of N shards adds 0-1.1 shards over
# 2 workers, 1.2-3.4 over 4).
ALL_REDUCE_COPIES = 4
# A step's program beside its tensors, per trainable weight it computes: on
# each device that runs it (its graph's copy there, kernels), and once per
# process for the replicas that share its trace (docs/benchmarks.md: a
# process of one device training keras-hub GPT-2 of 2 and of 8 blocks,
# widths 256 and 768, holds 2.3-2.8 MiB more per weight beside its tensors
# at its peak under `--release_memory`'s allocator settings; one of 4
# devices, 1.3-1.7 MiB per weight and device).
PROGRAM_BYTES_PER_WEIGHT = 5 << 18  # 1.25 MiB, each device
TRACE_BYTES_PER_WEIGHT = 5 << 18  # 1.25 MiB, shared by a process's replicas
# More per weight: a pipeline stage's call of its layers for each microbatch
# past the first (4 stages of a 4-block GPT-2 in one process), and zero=1
# and 2's sharded update (0.45-0.66 MiB on 4 devices of that GPT-2).
STAGE_CALL_BYTES_PER_WEIGHT = 5 << 17  # 0.625 MiB
SHARDED_UPDATE_BYTES_PER_WEIGHT = 5 << 17  # 0.625 MiB
# Each microbatch past the first, per weight a device computes, where its
# microbatches share one function body (data parallelism, zero 1 and 2;
# 4 workers: keras-hub GPT-2 8 x 768 0-1 MiB, BERT 8 x 256 0.05, keras-io's
# convnet 0.2, an 8 x Dense(4096) MLP about 0). Under zero=3, whose program
# has each microbatch's gathers, forward replays, backwards and
# reduce-scatters of its own (`unit_program`) in the trace a process's
# devices share: a share of that trace per weight and per op of the
# replayed forward, and `UNROLLED_MICROBATCH_BYTES` on each device (each
# microbatch past the first adds, on 4 workers: 140-150 MiB to GPT-2 8 x 768
# (134 weights, 1,100 forward ops), BERT 8 x 512 and 8 x 256 (135, 936) and
# Llama 8 x 512 (77, 2,091), 69 to the convnet (47, 342); in one process of
# 4 devices, per device: 52 to GPT-2 4 x 128 (70, 572), 89-106 to GPT-2 8 x
# 512 and 86-108 to Llama 8 x 512, 94-98 to BERT 8 x 256, 48-50 to the
# convnet, with their tensors: of the 0.625 MiB per weight that one device
# per process holds, 0.25 is on each device, the rest shared).
MICROBATCH_BYTES_PER_WEIGHT = 1 << 17  # 0.125 MiB
UNROLLED_MICROBATCH_BYTES = 28 << 20  # each device
UNROLLED_MICROBATCH_DEVICE_BYTES_PER_WEIGHT = 1 << 18  # 0.25 MiB, each device
UNROLLED_MICROBATCH_BYTES_PER_WEIGHT = 3 << 17  # 0.375 MiB, shared
UNROLLED_REPLAY_BYTES_PER_FORWARD_OP = 30 << 10  # 30 KiB, shared
# Each of zero=3's units, on each device: its gather, replay and
# reduce-scatter (4 workers, beside data parallelism's program: keras-io's
# convnet 2.2 MiB per unit, keras-hub GPT-2 1.3, BERT 2.4; one process of 4
# devices, GPT-2: 2.1 per device).
UNIT_PROGRAM_BYTES = 2 << 20
# Each op of the forward pass zero=3 replays under the tape for its units'
# backward (`forward_ops`: their forward traced twice), once per process for
# the replicas that share its trace (4 workers of one device: Llama 8 x 512,
# twice GPT-2 8 x 768's forward ops with 57% of its weights, holds 80 MiB
# more beside its tensors under zero=3 than a per-weight program says, GPT-2
# 93 MiB less). A pipeline stage's replay with `remat` is counted the same
# (one process of 4 stages, GPT-2 4 x 128: `remat` added 8-34 MiB a device).
REPLAY_BYTES_PER_FORWARD_OP = 55 << 10  # 55 KiB
# The microbatches' activations a replica holds at once when it computes them
# one after another without pipeline stages or zero=3 (measured with
# TensorFlow's own count of its tensors, keras-hub GPT-2 4 x 256 on sequences
# of 1,024 tokens, one device, batch 16: one microbatch 3.87 GiB at their
# peak, 2 microbatches 4.03; docs/benchmarks.md).
HELD_MICROBATCHES = 2
# Parts a prediction prints only when they are not 0.
_OPTIONAL_PARTS = ("not_with_gradients", "replica_state", "update", "transport", "program",
                   "not_at_once")


@dataclasses.dataclass
class PeakEstimate:
    """Predicted bytes per device of each part of a step's peak.

    Example:

    ```python
    estimate = predict_peak(strategy.config, model, batch_size=64)
    estimate.total   # bytes
    print(estimate)  # predicted peak per device 1.21 GiB: parameters ...
    ```
    """

    parameters: int
    gradients: int
    optimizer_state: int
    gathered: int
    activations: int
    not_with_gradients: int = 0
    replica_state: int = 0
    update: int = 0
    transport: int = 0
    program: int = 0
    not_at_once: int = 0

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def __str__(self):
        parts = ", ".join(f"{field.name.replace('_', ' ')} {readable(getattr(self, field.name))}"
                          for field in dataclasses.fields(self)
                          if getattr(self, field.name) or field.name not in _OPTIONAL_PARTS)
        return f"predicted peak per device {readable(self.total)}: {parts}"


def readable(size: int) -> str:
    """`size` bytes in the largest binary unit it fills (B to GiB), so that
    a small model's prediction does not read as 0.00 GiB.

    Example:

    >>> readable(512), readable(13_908), readable(3 * 2**30), readable(-2**20)
    ('512 B', '13.58 KiB', '3.00 GiB', '-1.00 MiB')
    """
    if size < 0:
        return "-" + readable(-size)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size} B"


def predict_peak(config, model, batch_size: int, sequence_length=None,
                 split=None, stages=None) -> PeakEstimate:
    """The predicted peak of the busiest device when `model` trains under
    `config` (a resolved `ParallelConfig`: `data` filled in, as a strategy's
    `config` is) on global batches of `batch_size` rows.

    `split` maps the id of each weight tensor groups split to its
    `AxisLayout`, `stages` are the pipeline stages (`Strategy.describe`
    passes both); the optimizer's slots are counted when it is built (by
    `fit`, or `model.optimizer.build(model.trainable_variables)`).

    Example:

    ```python
    predict_peak(strategy.config, model, batch_size=16).total / 2**30   # GiB
    ```
    """
    split = split or {}
    slots = _slot_counts(model)
    weights = held_weights(model, stages, split)
    local = weight_bytes(weights, split)  # each weight's tensor slice (or all of it)
    state = sum(slots.get(id(v), 0) * weight_bytes([v], split) for v in weights)
    parameters, gathered, gradients, state = zero3.held_at_peak(
        config, model, local, state, stages, lambda unit: weight_bytes(unit, split),
        largest=max((weight_bytes([v], split) for v in weights), default=0))
    rows = microbatch_rows(config, batch_size)
    units = (zero3.plan_units(model, config.zero3_unit_params)
             if zero3.replays_forward(config, stages) else None)
    activations = activation_bytes(model, rows, sequence_length, split, units)
    if stages:  # the mean stage's, times the microbatches its device holds at once
        activations = pipeline_stages.held_activation_bytes(
            config, activations // len(stages),
            max(tensors_bytes(stage.inputs, rows, sequence_length) for stage in stages))
    elif config.computes_microbatches_whole:
        activations *= min(config.microbatches, HELD_MICROBATCHES)
    # The backward frees the activations as it makes the local gradients:
    # when these are whole, the activations are gone (zero=3's units and
    # pipeline stages hold theirs beside the activations).
    not_with_gradients = -min(activations, local) if config.computes_microbatches_whole else 0
    return PeakEstimate(parameters, gradients, state, gathered, activations, not_with_gradients)


def microbatch_rows(config, batch_size: int) -> int:
    """The rows of a global batch of `batch_size` one replica computes at
    once under `config`: its data group's share, split into microbatches.

    Example:

    ```python
    microbatch_rows(strategy.config, batch_size=64)   # 8 at data=4, microbatches=2
    ```
    """
    return math.ceil(batch_size / config.data / config.microbatches)


def update_bytes(piece: int, has_slots: bool) -> int:
    """The optimizer update's temporaries when the largest piece a device
    updates is `piece` bytes: twice it for an optimizer with slots, once
    without.

    Example:

    >>> update_bytes(4096, has_slots=True)
    8192
    """
    return (2 if has_slots else 1) * piece


def not_at_once_bytes(peak: PeakEstimate, devices: int, freed_gradients: int,
                      in_step: int = 1) -> int:
    """What `devices` logical devices of one processor, sharing its memory,
    do not hold at the same moment, per device and negative: the process's
    peak is `devices` x `peak` (the busiest device's) less what `devices` - 1
    of them have freed when they meet the one at its peak in a collective:
    the update's temporaries (each device runs its update on its own) and
    the `freed_gradients` bytes its mode frees before that collective
    (`tfdist.engine.modes.planned_peak`: the local gradients of data
    parallelism and zero=1 once packed in the all-reduce's buffer, zero=3's
    largest unit's gradient once reduce-scattered; zero=2's reduce-scatter
    meets with the whole local gradients; a replica's pipeline stages, not
    in step, what each keeps beside its local gradients for the reduce and
    its copies between processes, one stage at a time). Of the activations
    a device holds beyond its local gradients (`not_with_gradients`: its
    peak is then its backward's start), the others hold half: the devices
    run their forwards together, in the step's one program, each holding
    its own until its backward frees them, and they are spread over their
    forwards and backwards (docs/benchmarks.md: keras-hub GPT-2 4 x 256 of
    sequences of 256 and 1,024 tokens in one process of 4 devices held 0.57
    x its 4 devices' activations at its peak); but the `in_step` devices of
    its group, which run each layer together (a tensor group, meeting in
    its all-reduces), hold them whole.

    Example:

    >>> peak = PeakEstimate(parameters=800, gradients=1600, optimizer_state=1600,
    ...                     gathered=0, activations=1000, not_with_gradients=-800, update=100)
    >>> not_at_once_bytes(peak, devices=4, freed_gradients=800)
    -750
    >>> not_at_once_bytes(peak, devices=4, freed_gradients=800, in_step=2)
    -725
    """
    if devices < 2:
        return 0
    held_activations = peak.activations + peak.not_with_gradients
    return -((devices - 1) * (peak.update + freed_gradients)
             + (devices - in_step) * held_activations // 2) // devices


def gathering_peak(peak: PeakEstimate, buffers: int, packed: int, alone: int,
                   transport: int, devices: int = 1) -> PeakEstimate:
    """What a device holds at the end of zero=1 and 2's step, when its
    updated parameter shards are gathered (`tfdist.optim.zero`): beside the
    parameters and the state shards of `peak` (the step's peak before it,
    its gradients, activations and update temporaries freed), the
    `buffers` bytes of its parameter shard buffers (until the update writes
    them they are slices of the parameters themselves), twice the `packed`
    bytes of the weights gathered in one collective (its result and the
    weights split from it) and the `alone` bytes of the largest weight
    gathered alone, and the gather's `transport` between processes. Where
    `devices` logical devices share a processor's memory, they meet in the
    gather, each holding its result, and split it one after another: the
    mean per device holds one `devices`-th of the split weights.
    `tfdist.engine.modes.planned_peak` predicts the larger of the two.

    Example:

    >>> peak = PeakEstimate(parameters=800, gradients=1600, optimizer_state=400,
    ...                     gathered=0, activations=100, update=100)
    >>> gathering_peak(peak, buffers=200, packed=500, alone=100, transport=0).total
    2500
    >>> gathering_peak(peak, buffers=200, packed=500, alone=100, transport=0, devices=4).gathered
    725
    """
    return dataclasses.replace(peak, gradients=0, activations=0, not_with_gradients=0,
                               update=0, not_at_once=0,
                               optimizer_state=peak.optimizer_state + buffers,
                               gathered=packed + alone + packed // devices,
                               transport=transport)


def transport_bytes(whole: int, data: int, processes: int, all_reduce: bool) -> int:
    """TensorFlow's copies of a data collective's messages between
    `processes` (0 in one process), for a collective of `whole` bytes over
    `data` replicas: an all-reduce's messages (1 / `data` of it each) held
    `ALL_REDUCE_COPIES` times at once, or the shards a gather or
    reduce-scatter receives from the `data` - 1 others.

    Example:

    >>> transport_bytes(8192, data=4, processes=4, all_reduce=True)
    8192
    >>> transport_bytes(8192, data=4, processes=4, all_reduce=False)
    6144
    """
    if processes < 2 or data < 2:
        return 0
    return (ALL_REDUCE_COPIES if all_reduce else data - 1) * -(-whole // data)


def program_bytes(weights: int, sharing: int = 1, microbatches: int = 1,
                  per_microbatch: int = MICROBATCH_BYTES_PER_WEIGHT,
                  sharded_update: bool = False, units: int = 0,
                  replayed_ops: int = 0) -> int:
    """TensorFlow's memory for the program of a step that computes
    `weights` trainable weights on a device, beside its tensors: per weight,
    the device's own part, its share of the trace `sharing` devices of its
    process run (their replicas of the same weights), a `sharded_update`
    (zero=1 and 2's), and `per_microbatch` bytes for each of its
    `microbatches` past the first (what the mode's program repeats for one).
    The share of the trace of the `replayed_ops` of the forward it replays
    under the tape for its backward (`forward_ops`: zero=3's units; a
    pipeline stage's with `remat`), and for each microbatch past the first,
    unrolled in that trace, of `UNROLLED_REPLAY_BYTES_PER_FORWARD_OP`.
    Under zero=3 (its `units`, each `UNIT_PROGRAM_BYTES`), each microbatch
    past the first also has its share of
    `UNROLLED_MICROBATCH_BYTES_PER_WEIGHT`, and `UNROLLED_MICROBATCH_BYTES`
    and `UNROLLED_MICROBATCH_DEVICE_BYTES_PER_WEIGHT` of its own, in place
    of `per_microbatch`.

    Example:

    >>> program_bytes(100) / 2**20, program_bytes(100, sharing=4) / 2**20
    (250.0, 156.25)
    >>> program_bytes(100, microbatches=2, per_microbatch=5 << 18) / 2**20
    375.0
    >>> program_bytes(100, microbatches=2, units=10, replayed_ops=1024) / 2**20
    445.5
    >>> program_bytes(100, microbatches=2, replayed_ops=1024) / 2**20
    347.5
    """
    replay = replayed_ops * UNROLLED_REPLAY_BYTES_PER_FORWARD_OP  # each microbatch's, shared
    if units:
        repeated = (UNROLLED_MICROBATCH_BYTES
                    + weights * UNROLLED_MICROBATCH_DEVICE_BYTES_PER_WEIGHT
                    + (weights * UNROLLED_MICROBATCH_BYTES_PER_WEIGHT + replay) // sharing)
    else:
        repeated = weights * per_microbatch + replay // sharing
    return (weights * (PROGRAM_BYTES_PER_WEIGHT + TRACE_BYTES_PER_WEIGHT // sharing
                       + sharded_update * SHARDED_UPDATE_BYTES_PER_WEIGHT)
            + (microbatches - 1) * repeated
            + units * UNIT_PROGRAM_BYTES + replayed_ops * REPLAY_BYTES_PER_FORWARD_OP // sharing)


def forward_ops(model, sequence_length=None) -> int:
    """The ops of `model`'s forward pass in training, its weights given as
    values (`stateless_call`: the same count under any strategy's
    variables), traced for the model (`traced_activations`), unknown lengths
    `sequence_length`; 0 when it has no functional graph.

    Example:

    ```python
    forward_ops(keras_hub.models.GPT2Backbone.from_preset("gpt2_base_en"))
    ```
    """
    traced = traced_activations(model, sequence_length)
    return traced.forward_ops if traced else 0


def held_sizes(model, stages=None, split=None) -> list[int]:
    """The bytes of each trainable weight of the busiest device
    (`held_weights`), its tensor rank's slice where split.

    Example:

    ```python
    max(held_sizes(model, layout.stages, layout.split))   # the largest weight's bytes
    ```
    """
    return [weight_bytes([v], split or {})
            for v in {id(v): v for v in held_weights(model, stages, split)}.values()]


def has_slots(model) -> bool:
    """Whether `model`'s built optimizer keeps slots (Adam's moments; not
    plain SGD's).

    Example:

    ```python
    has_slots(model)   # True once an Adam optimizer is built
    ```
    """
    return any(_slot_counts(model).values())


def held_weights(model, stages=None, split=None):
    """The trainable weights of the busiest device: the stage holding the
    most bytes (`weight_bytes`) under `pipeline`, else all of `model`'s.

    Example:

    ```python
    weight_bytes(held_weights(model, layout.stages, layout.split), layout.split)
    ```
    """
    if not stages:
        return model.trainable_weights
    held = {id(v) for v in max(stages, key=lambda s: weight_bytes(
        [v for v in s.variables if v.trainable], split or {})).variables}
    return [v for v in model.trainable_weights if id(v) in held]


def weight_bytes(variables, split):
    """Bytes of `variables`, each its tensor rank's slice when `split` (by
    id, `AxisLayout`s) splits it.

    Example:

    ```python
    weight_bytes(model.trainable_weights, {}) / 2**20   # MiB
    ```
    """
    total = 0
    for v in {id(v): v for v in variables}.values():
        parts = split[id(v)].parts if id(v) in split else 1
        total += v.shape.num_elements() * tf.as_dtype(v.dtype).size // parts
    return total


def _slot_counts(model):
    """How many slots of its shape the built optimizer keeps per weight, by id."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not optimizer.built:
        return {}
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    variables = list(trainable_variables_of(inner))
    counts = {}
    for _, index in optimizer_slots(inner, variables, for_sharding=True):
        counts[id(variables[index])] = counts.get(id(variables[index]), 0) + 1
    return counts


def activation_bytes(model, rows, sequence_length=None, split=None, units=None):
    """What a replica of `rows` examples holds from its forward for its
    backward: the tensors the traced gradient reads (`traced_activations`;
    0 without a functional graph), each its tensor rank's slice where
    `split` (by id, `AxisLayout`s) splits the weights of the layer it is
    computed in, and the model's outputs, which the loss's gradient reads.
    With zero=3's `units` (`zero3.plan_units`), each replayed for its
    backward: their inputs, and of what they compute only the largest
    unit's.

    Example:

    ```python
    activation_bytes(model, rows=8, sequence_length=128) / 2**20   # MiB
    ```
    """
    traced = traced_activations(model, sequence_length)
    if traced is None:
        return 0
    groups, inputs = None, 0
    if units:
        groups = [[layer.path for layer in unit.layers if getattr(layer, "path", None)]
                  for unit in units]
        inputs = sum(tensors_bytes(unit.inputs, rows, sequence_length) for unit in units[1:])
    split_axes = {}
    for variable in model.weights:
        if id(variable) in (split or {}):
            layout = split[id(variable)]
            split_axes.setdefault(variable.path.rsplit("/", 1)[0], []).append(
                (layout.shape[layout.axis], layout.parts))
    return (traced.bytes(rows, split_axes, sequence_length, groups) + inputs
            + tensors_bytes(model.outputs, rows, sequence_length))


def tensors_bytes(tensors, rows, sequence_length):
    """Bytes of the symbolic `tensors` for `rows` examples, unknown lengths
    `sequence_length` (1 when None).

    Example:

    >>> tensors_bytes([keras.KerasTensor((None, None, 8))], rows=2, sequence_length=16)
    1024
    """
    total = 0
    for tensor in tf.nest.flatten(tensors):
        shape = getattr(tensor, "shape", None)
        if shape is None or len(shape) == 0:
            continue
        dims = [rows] + [d if d is not None else (sequence_length or 1) for d in shape[1:]]
        total += math.prod(dims) * tf.as_dtype(tensor.dtype).size
    return total
