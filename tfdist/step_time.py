"""The predicted time of one training step under a `ParallelConfig`.

`predict_step_time` plays a step out on a `Hardware` description, from the
same estimates the pipeline's balance uses (`tfdist.pipeline.cost`, FLOPs
per example of each layer call) and the layout `describe` prints:

- compute: the busiest device's forward (1x) and backward (2x; remat adds a
  forward, as ZeRO-3 does for each unit but the last) over its rows, at
  `device_flops` (or the rate measured nearest a pass's rows,
  `Hardware.flops_at`); a layer tensor groups split costs
  1/tensor of its FLOPs per device (in the share of its weights they
  split); each layer call's overhead; the step's own call
  (`Hardware.step_overhead`) and each replica's work besides its layers
  (`Hardware.replica_overhead`).
- bubble: with `pipeline`, the schedule played out: each device runs its
  actions in order (`tfdist.pipeline.schedule.stage_orders`), each starting
  once its device is free and the actions it needs have ended, each taking
  its stage's time; the bubble is what the last end adds to the busiest
  device's own work.
- communication: ring collectives, each moving (n - 1) / n of its bytes per
  device (twice for an all-reduce), plus a latency each that grows with
  its members (`Hardware.latency`; a send's `Hardware.send_latency`):
  the data group's gradients (compressed as `compression` says), ZeRO's
  parameter gathers (zero 1/2 after the update, zero=3 twice per step), the
  tensor groups' activation all-reduces (two per split block: Megatron's
  "g" forward, "f" backward), the pipeline's sends between stages. Tensor
  groups and pipeline stages stay within a host (`device_bandwidth`); the
  data group crosses hosts when there are several (`link_bandwidth`).

What it leaves out: overlap of communication with compute (it adds them),
XLA's fusion, what a pipeline's stages cost beyond their layers and sends
when there are several replicas (docs/benchmarks.md), and memory bandwidth.
`tfdist.plan(..., measure=K)` times the top plans for real.

Example:

```python
hardware = Hardware(device_flops=2e11, device_bandwidth=2e10, link_bandwidth=1.25e9)
predict_step_time(ParallelConfig(data=4).resolve(4), model, 64, hardware).total
```
"""

import dataclasses
import math

import keras
import tensorflow as tf

from tfdist._compat.keras_functional import direct_sublayers
from tfdist.config import ParallelConfig
from tfdist.engine.modes import compression_ratio, planned_layout
from tfdist.optim import zero3
from tfdist.pipeline import schedule as pipeline_schedule
from tfdist.pipeline.cost import node_cost
from tfdist.pipeline.graph import LayerGraph
from tfdist.pipeline.stages import operation_weights
from tfdist.sharding.peak import held_weights, tensors_bytes, weight_bytes

# Layouts whose layer ends a split block with an all-reduce of its output.
_BLOCK_ENDS = ("Row", "Heads", "Vocabulary")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What a step's time is predicted from.

    Args:
        device_flops: floating-point operations per second of one device.
        flops_at: ((rows, FLOP/s), ...): the rate measured with that many
            rows a pass over the layers (small passes run slower); a pass
            runs at the rate of the nearest (`rate`); none: `device_flops`.
        device_bandwidth: bytes per second between two devices of a host.
        link_bandwidth: bytes per second between two hosts.
        devices_per_host: devices of each host (None: all on one).
        collective_latency: seconds a collective of 2 devices costs besides
            its bytes.
        member_latency: seconds each further member adds to a collective's
            latency (a ring's steps grow with its members).
        send_latency: seconds a pipeline's send between two devices of a
            host costs besides its bytes (None: a 2-device collective's).
        call_overhead: seconds each layer call's forward costs besides its
            FLOPs (its backward twice that): the runtime's per-op work.
        step_overhead: seconds a step costs once, whatever its layout:
            its function's call and the fetch of its results.
        replica_overhead: seconds each copy of the model's layer calls on a
            host (a data replica or tensor rank) adds to a step besides them
            and the collectives: its share of the batch, its part in the
            step's call, its optimizer update, as this host runs them.
        shared_cores: when a host's devices are logical devices of one
            processor (`tfdist.use_virtual_devices`), its cores: each
            device's FLOPs then run at `device_flops` one device at a time
            (the processor's whole rate), their call overheads on this many
            cores at once, and an idle device (the pipeline's bubble) lends
            its cores to the others; they share its memory too (a plan's
            predicted peak is then the mean of a host's peak over its
            devices). None: devices of their own.

    Example:

    >>> Hardware(device_flops=1e12, device_bandwidth=1e11, link_bandwidth=1.25e9).hosts_of(8)
    1
    """

    device_flops: float
    device_bandwidth: float
    link_bandwidth: float
    devices_per_host: int | None = None
    collective_latency: float = 5e-5
    member_latency: float = 0.0
    send_latency: float | None = None
    call_overhead: float = 0.0
    flops_at: tuple = ()
    step_overhead: float = 0.0
    replica_overhead: float = 0.0
    shared_cores: int | None = None

    def rate(self, rows: float) -> float:
        """FLOP/s of a pass over `rows` rows: `flops_at`'s nearest (by
        ratio), else `device_flops`.

        >>> Hardware(1e12, 1e11, 1e9, flops_at=((4, 1e11), (32, 4e11))).rate(8)
        100000000000.0
        """
        if not self.flops_at:
            return self.device_flops
        return min(self.flops_at, key=lambda measured: abs(math.log(measured[0] / rows)))[1]

    def hosts_of(self, devices: int) -> int:
        """How many hosts `devices` devices span (1 when `devices_per_host` is None)."""
        return max(1, math.ceil(devices / (self.devices_per_host or devices)))

    def latency(self, members: int) -> float:
        """Seconds a collective over `members` devices costs besides its bytes.

        >>> Hardware(1e12, 1e11, 1e9, collective_latency=1e-4, member_latency=5e-5).latency(8)
        0.0004
        """
        return self.collective_latency + self.member_latency * max(0, members - 2)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step, by part.

    Example:

    >>> StepTime(compute=0.10, bubble=0.02, communication=0.03).total
    0.15
    """

    compute: float
    bubble: float
    communication: float

    @property
    def total(self) -> float:
        return round(self.compute + self.bubble + self.communication, 12)


def predict_step_time(config: ParallelConfig, model, batch_size: int, hardware: Hardware,
                      sequence_length=None, layout=None) -> StepTime:
    """The predicted `StepTime` of `model` training on global batches of
    `batch_size` rows under the resolved `config`, on `hardware`.

    `layout` is `tfdist.engine.modes.planned_layout(config, model, ...)`
    (made here when None).

    Example:

    ```python
    predict_step_time(ParallelConfig(data=2, pipeline=2, microbatches=4).resolve(4),
                      model, 64, hardware, sequence_length=128).bubble
    ```
    """
    layout = layout or planned_layout(config, model, sequence_length)
    graph = LayerGraph(model)
    rows = batch_size / config.data
    costs = {id(node): node_cost(node, sequence_length) * _split_share(node, layout, config)
             for node in graph.nodes}
    compute, bubble = _compute_time(config, layout.stages or [graph], costs,
                                    rows / config.microbatches, hardware,
                                    zero3.replayed_nodes(config, model, graph.nodes,
                                                         layout.stages))
    weights = held_weights(model, layout.stages, layout.split)
    communication = (_data_group_time(config, model, weights, layout, hardware)
                     + _tensor_group_time(config, graph, layout, rows, sequence_length,
                                          hardware)
                     + _pipeline_send_time(config, layout.stages, rows, sequence_length,
                                           hardware))
    return StepTime(compute, bubble, communication)


def _split_share(node, layout, config):
    """The share of `node`'s compute each tensor rank does: 1/tensor of
    what its split weights' share of its weights is."""
    if not layout.split:
        return 1.0
    weights = {id(v): v for v in operation_weights(node.operation)}
    total = sum(v.shape.num_elements() for v in weights.values())
    split = sum(v.shape.num_elements() for key, v in weights.items() if key in layout.split)
    if not total:
        return 1.0
    return 1.0 - split / total + split / total / config.tensor


def _compute_time(config, stages, costs, micro, hardware, replayed=frozenset()):
    """(compute, bubble) of the step's actions: each stage's (a whole model
    without `pipeline`) forward and backward of every microbatch of `micro`
    rows, in the schedule's order; a backward runs the forward of the nodes
    in `replayed` again."""
    def work(nodes):  # (seconds of their FLOPs, of their calls' overheads) in a forward
        nodes = list(nodes)
        return (micro * sum(costs[id(node)] for node in nodes) / hardware.rate(micro),
                len(nodes) * hardware.call_overhead)

    flops, overheads = zip(*(work(stage.nodes) for stage in stages))
    replays = [work(node for node in stage.nodes if id(node) in replayed) for stage in stages]
    orders = pipeline_schedule.stage_orders(config.schedule, len(stages) // (
        config.virtual_stages), config.microbatches, config.virtual_stages)
    split = any(a.kind == pipeline_schedule.WEIGHTS for order in orders for a in order)

    def times(action):
        """The action's multiple of its stage's forward."""
        if action.kind in (pipeline_schedule.FORWARD, pipeline_schedule.WEIGHTS):
            return 1.0
        return (1.0 if split else 2.0) + float(config.remat)  # remat: the forward again

    devices = min(hardware.devices_per_host or math.inf, config.devices_needed)
    copies = devices / config.pipeline  # the replicas and tensor ranks on the host

    def replay(action):
        """The action's seconds of replayed forwards: (FLOPs, overheads)."""
        return replays[action.stage] if action.kind == pipeline_schedule.BACKWARD else (0.0, 0.0)

    if hardware.shared_cores:  # every device's work on one processor, no bubble
        flop_seconds = sum(times(a) * flops[a.stage] + replay(a)[0]
                           for order in orders for a in order)
        overhead_seconds = sum(times(a) * overheads[a.stage] + replay(a)[1]
                               for order in orders for a in order)
        return (copies * (flop_seconds + overhead_seconds / hardware.shared_cores
                          + hardware.replica_overhead) + hardware.step_overhead), 0.0

    def seconds(action):
        return times(action) * (flops[action.stage] + overheads[action.stage]) + sum(
            replay(action))

    busiest = max(sum(seconds(a) for a in order) for order in orders)
    fixed = hardware.step_overhead + copies * hardware.replica_overhead
    return busiest + fixed, max(0.0, _played_out(orders, seconds, len(stages)) - busiest)


def _played_out(orders, seconds, stages):
    """When the last action ends: each device runs its order, an action
    starting once its device is free and what it needs has ended."""
    ended, free, position = {}, [0.0] * len(orders), [0] * len(orders)
    remaining = sum(len(order) for order in orders)
    while remaining:
        before = remaining
        for device, order in enumerate(orders):
            while position[device] < len(order):
                action = order[position[device]]
                needed = pipeline_schedule.needs(action, stages)
                if any(n not in ended for n in needed):
                    break
                start = max([free[device]] + [ended[n] for n in needed])
                ended[action] = free[device] = start + seconds(action)
                position[device] += 1
                remaining -= 1
        if remaining == before:
            raise ValueError("the schedule's orders deadlock")  # (stage_orders never do)
    return max(free)


def _ring(bytes_, members, bandwidth, reduce=False):
    """Seconds of a ring all-gather / reduce-scatter (or all-reduce) of `bytes_`."""
    if members <= 1:
        return 0.0
    share = (members - 1) / members * (2 if reduce else 1)
    return share * bytes_ / bandwidth


def _data_group_time(config, model, weights, layout, hardware):
    data = config.data
    if data <= 1:
        return 0.0
    devices = config.devices_needed
    bandwidth = (hardware.link_bandwidth if hardware.hosts_of(devices) > 1
                 else hardware.device_bandwidth)
    parameters = weight_bytes(weights, layout.split)
    gradients = parameters * compression_ratio(config, weights)
    sent, summed, collectives = zero3.data_group_traffic(config, model, layout.stages,
                                                          gradients, parameters)
    return (_ring(sent, data, bandwidth, reduce=summed)
            + collectives * hardware.latency(data))


def _tensor_group_time(config, graph, layout, rows, sequence_length, hardware):
    """Two all-reduces (forward, backward) of each split block's output."""
    if not layout.decisions:  # nothing split
        return 0.0
    enclosing = _enclosing_nodes(graph)
    per_example, blocks = 0, 0
    for decision in layout.decisions:
        if type(decision.layout).__name__ not in _BLOCK_ENDS:
            continue
        node = enclosing.get(id(decision.layer))
        if node is None:
            continue
        per_example += tensors_bytes(tf.nest.flatten(node.outputs)[0], 1, sequence_length)
        blocks += 1
    reduced = _ring(2 * rows * per_example, config.tensor, hardware.device_bandwidth,
                    reduce=True)
    return reduced + 2 * blocks * config.microbatches * hardware.latency(config.tensor)


def _enclosing_nodes(graph):
    """{id(layer): the graph node calling it or a layer it is nested in}."""
    enclosing = {}
    for node in graph.nodes:
        pending = [node.operation]
        while pending:
            layer = pending.pop()
            enclosing.setdefault(id(layer), node)
            if isinstance(layer, keras.layers.Layer):  # not an op such as `x[:, 0]`
                pending.extend(direct_sublayers(layer))
    return enclosing


def _pipeline_send_time(config, stages, rows, sequence_length, hardware):
    """Each microbatch's activations forward and gradients back, at every
    boundary, the largest boundary's."""
    if not stages:
        return 0.0
    micro = rows / config.microbatches
    largest = max((tensors_bytes(stage.inputs, 1, sequence_length) for stage in stages[1:]),
                  default=0)
    sends = 2 * config.microbatches
    latency = hardware.latency(2) if hardware.send_latency is None else hardware.send_latency
    return sends * (micro * largest / hardware.device_bandwidth + latency)
