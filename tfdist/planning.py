"""The parallel layout for a model, devices and memory, predicted and ranked:
what `tfdist.plan` (`tfdist.plan_trials`, which can also train the first
plans) and `Strategy(plan="auto")` choose from.

`predicted_plans` enumerates every `ParallelConfig` the devices allow (data x
pipeline x tensor, zero, microbatches, pipeline schedule, remat), keeps those
that `ParallelConfig.validate` and the model's own rules
(`tfdist.engine.modes.check`) accept, and predicts for each the busiest
device's peak memory (the predictor `Strategy.describe` prints,
`tfdist.sharding.peak`) and the step's time (`tfdist.step_time`). Plans whose
peak exceeds `memory_per_device` less its `headroom` (the prediction's
error) are kept with that reason; the rest are ranked by predicted time.

Fields given as keyword arguments (`precision="mixed_bfloat16"`,
`compression="bf16"`, `zero=3`, ...) are held at that value: precision and
compression change what is computed, so the planner never picks them itself.

Example:

```python
plans = predicted_plans(model, devices=8, memory_per_device="16GiB", batch_size=64,
                        sequence_length=1024)
print(plans)                  # the ranked table, with the reasons
plans.best.config.to_json()   # for `tfdist launch --config` or `tfdist tfjob`
```
"""

import dataclasses
import functools
import itertools
import os
import re
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

from tfdist._compat.tf_distribute import MirroredStrategyOfItsOwnKeys
from tfdist.config import ParallelConfig
from tfdist.engine import modes
from tfdist.pipeline.cost import node_cost
from tfdist.pipeline.graph import LayerGraph
from tfdist.sharding.peak import PeakEstimate, readable
from tfdist.step_time import Hardware, StepTime, predict_step_time
from tfdist.tensor import plan as tensor_plan

# The fields `plan` chooses (the others keep their defaults unless given).
SEARCHED = ("data", "pipeline", "tensor", "zero", "microbatches", "schedule", "remat")
# Pipeline schedules tried: 1F1B (GPipe's time, fewer activations held) and
# zero bubble H1 (less bubble, GPipe's activations).
SCHEDULES = ("1f1b", "zb1")
_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
          "bit": 1 / 8, "Kbit": 1e3 / 8, "Mbit": 1e6 / 8, "Gbit": 1e9 / 8, "Tbit": 1e12 / 8}
# The share of `memory_per_device` a plan leaves free for the prediction's
# error: the measured peaks of the plan runs of six models were 0.79-1.15 x
# their prediction (docs/benchmarks.md), so a plan predicted within 85% of
# the limit stays within it.
HEADROOM = 0.15
# The trainings that time what a replica adds to a step: rounds of this many
# steps each (their median), after one that traces; one example per device,
# so that a step is short and little of it the compute the model predicts.
TRIAL_STEPS = 10
TRIAL_ROUNDS = 3
TRIAL_ROWS = 1
_QUANTITY = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*")


@dataclasses.dataclass
class Plan:
    """One configuration weighed by `plan`.

    Attributes:
        config: the resolved `ParallelConfig`.
        peak: the busiest device's predicted `PeakEstimate`.
        time: the predicted `StepTime`.
        fits: whether `peak.total` is within the memory per device less
            its headroom.
        reason: why it does not fit (empty when it does).
        measured: seconds per step measured by `measure` (None if not run).

    Example:

    ```python
    plan = plans.best
    plan.config.zero, plan.peak.total / 2**30, plan.time.total, plan.fits
    ```
    """

    config: ParallelConfig
    peak: PeakEstimate
    time: StepTime
    fits: bool
    reason: str = ""
    measured: float | None = None

    @property
    def seconds(self) -> float:
        """The measured seconds per step when measured, else the predicted."""
        return self.time.total if self.measured is None else self.measured

    def summary(self) -> str:
        """One line: the config, its peak and its step time.

        Example:

        ```python
        plans.best.summary()
        # 'data=2 tensor=2 zero=1: peak 1.1 GiB, 31.6 ms a step predicted'
        ```
        """
        seconds = f"{1e3 * self.time.total:.1f} ms a step predicted" + (
            "" if self.measured is None else f", {1e3 * self.measured:.1f} measured")
        return f"{describe_config(self.config)}: peak {readable(self.peak.total)}, {seconds}"


class Plans(list):
    """`Plan`s ranked best first: those that fit by (measured, else
    predicted) step time, then those that do not by peak memory.

    `str()` is the table `tfdist plan` prints; `refused` holds the
    configurations validation refused, with its message; `hardware` the
    `Hardware` the times were predicted for; a plan fits in
    `memory_per_device` less its `headroom` share (`usable`).

    Example:

    ```python
    plans.best.config          # the ParallelConfig to run
    print(plans)               # rank, config, peak, time, reason
    ```
    """

    def __init__(self, plans=(), refused=(), memory_per_device=0, hardware=None,
                 headroom=0.0):
        super().__init__(plans)
        self.refused = list(refused)
        self.memory_per_device = memory_per_device
        self.hardware = hardware
        self.headroom = headroom

    @property
    def usable(self) -> float:
        """The bytes a plan's predicted peak may reach: `memory_per_device`
        less its `headroom` share."""
        return self.memory_per_device * (1 - self.headroom)

    def _limit(self) -> str:
        """`memory_per_device`, and the share kept free if any."""
        return readable(int(self.memory_per_device)) + (
            f" ({self.headroom:.0%} of it kept free: {readable(int(self.usable))})"
            if self.headroom else "")

    def ranked(self) -> "Plans":
        """These plans best first: those that fit by their measured, else
        predicted, step time, then the others by peak.

        Example:

        ```python
        plans = plans.ranked()   # after setting some plans' `measured`
        ```
        """
        fitting = sorted((p for p in self if p.fits),
                         key=lambda p: (p.measured is None, p.seconds, p.peak.total))
        over = sorted((p for p in self if not p.fits), key=lambda p: p.peak.total)
        return Plans(fitting + over, self.refused, self.memory_per_device, self.hardware,
                     self.headroom)

    @property
    def best(self) -> Plan:
        """The first plan that fits; `ValueError` when none does."""
        for candidate in self:
            if candidate.fits:
                return candidate
        smallest = min(self, key=lambda p: p.peak.total, default=None)
        raise ValueError(
            f"No configuration fits in memory_per_device={self._limit()}: the "
            f"smallest predicted peak is "
            + (f"{readable(smallest.peak.total)} ({describe_config(smallest.config)})"
               if smallest else "none (every configuration was refused)")
            + ". Use more devices or more memory, a smaller batch_size, or hold "
              "precision='mixed_bfloat16'.")

    def why_best(self) -> str:
        """Why `best` was chosen, in one sentence: its summary, what it was
        ranked by and among how many, and the runner-up.

        Example:

        ```python
        print(plans.why_best())
        ```
        """
        best = self.best
        fitting = [p for p in self if p.fits]
        ranked_by = "measured" if best.measured is not None else "predicted"
        text = (f"{best.summary()}; the fastest ({ranked_by}) of {len(fitting)} "
                f"configurations that fit in {self._limit()} per device "
                f"({len(self)} weighed, {len(self.refused)} refused)")
        if len(fitting) > 1:
            text += f"; next: {fitting[1].summary()}"
        return text + "."

    def table(self, rows: int = 20) -> str:
        """The first `rows` plans as a table, and a count of the rest.

        Example:

        ```python
        print(plans.table(rows=5))
        ```
        """
        header = ["rank", "config", "peak", "step ms", "compute", "bubble", "comm",
                  "measured ms", "note"]
        lines = [header]
        for rank, p in enumerate(self[:rows], 1):
            lines.append([str(rank), describe_config(p.config), readable(p.peak.total),
                          f"{1e3 * p.time.total:.1f}", f"{1e3 * p.time.compute:.1f}",
                          f"{1e3 * p.time.bubble:.1f}", f"{1e3 * p.time.communication:.1f}",
                          "-" if p.measured is None else f"{1e3 * p.measured:.1f}",
                          p.reason or "fits"])
        widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
        text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
                for line in lines]
        fitting = sum(p.fits for p in self)
        text.append(f"{len(self)} configurations weighed, {fitting} fit in "
                    f"{self._limit()} per device"
                    + (f"; {len(self) - rows} more not shown" if len(self) > rows else "")
                    + (f"; {len(self.refused)} refused by validation" if self.refused else ""))
        if self.hardware:
            h = self.hardware
            text.append(
                f"predicted for {h.device_flops / 1e9:.1f} GFLOP/s per device, "
                f"{1e6 * h.call_overhead:.0f} us per layer call, "
                f"{1e6 * h.replica_overhead:.0f} us per replica, "
                f"{1e6 * h.latency(2):.0f} us per collective of 2 devices "
                f"(+{1e6 * h.member_latency:.0f} us per further device)"
                + (f", devices sharing {h.shared_cores} cores and their memory"
                   if h.shared_cores else ""))
        return "\n".join(text)

    def __str__(self):
        return self.table()


def describe_config(config: ParallelConfig) -> str:
    """The searched fields of `config` that are not at their default, and
    `data`, as `tfdist launch` flags would write them.

    Example:

    >>> describe_config(ParallelConfig(data=2, pipeline=2, microbatches=4, schedule="1f1b"))
    'data=2 pipeline=2 microbatches=4 schedule=1f1b'
    """
    return " ".join([f"data={config.data}"] + [
        f"{name}={getattr(config, name)}" for name in SEARCHED[1:]
        if getattr(config, name) != ParallelConfig.__dataclass_fields__[name].default])


def parse_quantity(value, name: str) -> float:
    """A size or rate given as a number (bytes) or a string with a unit,
    spelled exactly: B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB
    (of 1024), or bit, Kbit, Mbit, Gbit, Tbit (bits; per second for a
    bandwidth).

    Example:

    >>> parse_quantity("16GiB", "memory_per_device"), parse_quantity("10Gbit", "link_bandwidth")
    (17179869184.0, 1250000000.0)
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    match = _QUANTITY.fullmatch(value) if isinstance(value, str) else None
    if match is None or match[2] not in _UNITS or float(match[1]) <= 0:
        raise ValueError(
            f"`{name}` must be a positive number of bytes or a string such as '16GiB', "
            f"'512MB' or '10Gbit' (units {', '.join(u for u in _UNITS if u)}), "
            f"got {value!r}.")
    return float(match[1]) * _UNITS[match[2]]


def predicted_plans(model, devices: int, memory_per_device, batch_size: int,
                    sequence_length=None, hosts: int = 1, link_bandwidth="10Gbit",
                    device_bandwidth="100Gbit", device_flops=None, headroom=HEADROOM,
                    trial=None, **fixed) -> Plans:
    """`tfdist.plan` without `measure` (the arguments are its): every
    configuration of `devices` devices for `model`, predicted and ranked
    (`Plans`, best first). What `Strategy(plan="auto")` follows. `trial`:
    `measured_hardware`'s (when `device_flops` is None), its trainings held
    to the memory per device less the headroom.

    Example:

    ```python
    plans = predicted_plans(model, devices=4, memory_per_device="1GiB", batch_size=32)
    plans.best.config
    ```
    """
    _check_args(model, devices, batch_size, hosts, fixed)
    limit = parse_quantity(memory_per_device, "memory_per_device")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not (
            0 <= headroom < 1):
        raise ValueError(f"`headroom` must be a number in [0, 1) (the share of "
                         f"memory_per_device kept free), got {headroom!r}.")
    bandwidths = dict(device_bandwidth=parse_quantity(device_bandwidth, "device_bandwidth"),
                      link_bandwidth=parse_quantity(link_bandwidth, "link_bandwidth"),
                      devices_per_host=devices // hosts)
    flops = parse_quantity(device_flops, "device_flops") if device_flops is not None else None
    built = model() if callable(model) and not isinstance(model, keras.Model) else model
    if getattr(built, "optimizer", None) is None:
        raise ValueError(f"`model` must be compiled (`model.compile(optimizer=..., "
                         f"loss=...)`) so that its optimizer's state counts; "
                         f"{built.name!r} is not.")
    if not built.optimizer.built:
        built.optimizer.build(built.trainable_variables)
    if flops:
        hardware = Hardware(flops, **bandwidths)
    else:
        hardware = measured_hardware(built, devices // hosts, sequence_length,
                                     max(4, batch_size // devices), trial=trial,
                                     memory=limit * (1 - headroom),
                                     pass_rows=_pass_rows(batch_size), **bandwidths)
    plans = Plans(memory_per_device=limit, hardware=hardware, headroom=headroom)
    usable = plans.usable
    layouts = {}
    for config, error in candidates(built, devices, batch_size, hosts, fixed):
        if error:
            plans.refused.append((config, error))
            continue
        key = (config.pipeline, config.tensor, config.virtual_stages)
        if key not in layouts:
            layouts[key] = _layout_or_refusal(config, built, sequence_length)
        layout = layouts[key]
        if isinstance(layout, str):
            plans.refused.append((dataclasses.asdict(config), layout))
            continue
        peak = modes.planned_peak(config, built, batch_size, sequence_length, layout,
                                  processes=hosts, shared_memory=bool(hardware.shared_cores))
        step = predict_step_time(config, built, batch_size, hardware, sequence_length,
                                 layout)
        fits = peak.total <= usable
        reason = "" if fits else f"peak {readable(peak.total)} > {readable(int(usable))}"
        plans.append(Plan(config, peak, step, fits, reason))
    return plans.ranked()


def _layout_or_refusal(config, model, sequence_length):
    """`config`'s planned layout, or why the model cannot take it (stages it
    cannot cut, a tensor group that would split nothing)."""
    try:
        layout = modes.planned_layout(config, model, sequence_length)
        if layout.decisions:  # (a tensor group's)
            tensor_plan.check_something_splits(model, layout.decisions, config.tensor)
    except ValueError as error:
        return str(error)
    return layout


def _check_args(model, devices, batch_size, hosts, fixed):
    for name, value in (("devices", devices), ("batch_size", batch_size), ("hosts", hosts)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be an int >= 1, got {value!r}.")
    if devices % hosts:
        raise ValueError(f"`devices={devices}` must be a multiple of `hosts={hosts}` "
                         f"(each host has as many devices).")
    unknown = sorted(set(fixed) - set(ParallelConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"{', '.join(map(repr, unknown))}: not `ParallelConfig` fields "
                         f"(held fields are {', '.join(ParallelConfig.__dataclass_fields__)}).")
    if not isinstance(model, keras.Model) and not callable(model):
        raise ValueError(f"`model` must be a Keras model or a function returning one, "
                         f"got {type(model).__name__}.")


def candidates(model, devices, batch_size, hosts=1, fixed=None):
    """Every (config, None) the rules accept, and (config fields, error
    message) for each they refuse.

    Example:

    ```python
    accepted = [c for c, error in candidates(model, 4, 32) if error is None]
    ```
    """
    fixed = dict(fixed or {})
    strategy = "MultiWorkerStrategy" if hosts > 1 else "Strategy"
    per_host = devices // hosts
    for tensor, pipeline in itertools.product(_divisors(devices), repeat=2):
        if devices % (tensor * pipeline) or per_host % (tensor * pipeline):
            continue
        data = devices // (tensor * pipeline)
        rows = batch_size / data
        pipelined = pipeline > 1
        for zero, microbatches, schedule, remat in itertools.product(
                range(4), (pipeline, 2 * pipeline, 4 * pipeline) if pipelined else (1, 2, 4),
                SCHEDULES if pipelined else ("gpipe",), (False, True) if pipelined else (False,)):
            fields = dict(data=data, pipeline=pipeline, tensor=tensor, zero=zero,
                          microbatches=microbatches, schedule=schedule, remat=remat)
            if any(name in fixed and fixed[name] != fields[name] for name in SEARCHED):
                continue
            if rows != int(rows) or int(rows) % microbatches:
                continue  # (a batch the replicas or microbatches cannot split evenly)
            fields.update(fixed)
            try:
                config = ParallelConfig(**fields).validate(strategy=strategy)
                modes.check(model, config)
            except (ValueError, TypeError, NotImplementedError) as error:
                yield fields, str(error)
                continue
            yield config, None


def _pass_rows(batch_size):
    """Rows a pass over the layers may have: the powers of 2 from 2 up to
    `batch_size`, and `batch_size`."""
    return sorted({2**k for k in range(1, batch_size.bit_length()) if 2**k <= batch_size}
                  | {batch_size} - {1})


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def measured_hardware(model, devices: int, sequence_length=None, rows: int = 8,
                      trial=None, memory=None, pass_rows=(), **bandwidths) -> Hardware:
    """The `Hardware` of this process's devices, timed on `model`:

    - `step_overhead`: a function's call and the fetch of its result;
    - `device_flops` and `call_overhead`: the model's forward and backward
      on the first device, at `rows` and at 1 example, their difference
      per example set against the estimated FLOPs (3x the forward's,
      `tfdist.pipeline.cost`), what remains of the 1-example time beyond
      the call over the layer calls; `flops_at`: the same rate at each of
      `pass_rows`; the rates made non-decreasing in the rows (a rate
      below a smaller pass's is the host's noise: averaged with it);
    - `replica_overhead`: with `trial` (`(config, batch_size) -> timer`,
      `step_timer` of the model under a strategy of `config`), what each
      further replica adds to the model's training step beyond what the
      other fields predict: data parallelism over `devices` devices (as
      many as this process has), `TRIAL_ROWS` examples per device, against
      the fewest devices training the same examples in microbatches (the
      same passes over the layers) whose predicted peak is within `memory`
      bytes per device (`trial_configs`), timed in alternate rounds, the
      median of the rounds' differences. Without it, or when no two such
      configurations fit, a stand-in:
      what each further device adds to a `MirroredStrategy` step that takes
      its share of a batch and sums it, and (on shared cores, where the
      replicas' updates share them) a fresh copy of the model's optimizer
      applied to one-element stand-ins for its weights;
    - `collective_latency` and `member_latency`: chains of small
      all-reduces over 2 and over `devices` devices of this process, per
      all-reduce: the latency of 2 members, and what each further member
      adds (`Hardware`'s defaults, and no growth, where this process has
      fewer devices than a chain needs);
    - `send_latency`: a chain of small ops alternating between 2 devices
      of this process against the same chain on one, per op (None with one
      device: a 2-device collective's); these latencies are the devices',
      not the model's: timed at a process's first calibration, then kept;
    - `shared_cores`: this host's cores when the devices are logical CPU
      devices (no GPU); each replica's update then shares them, and their
      peaks their memory (`tfdist.sharding.peak.not_at_once_bytes`).

    Each time is the fastest of several runs: on a shared host other work
    only adds time, and the fastest varies least between calibrations.
    `bandwidths` are `Hardware`'s other fields.

    Example:

    ```python
    hardware = measured_hardware(model, 4, sequence_length=128, rows=16,
                                 device_bandwidth=1e10, link_bandwidth=1.25e9)
    ```
    """
    call = _fewest_seconds(_scalar_call())
    few = _forward_and_backward_seconds(model, 1, sequence_length)
    graph = LayerGraph(model)
    flops = 3 * sum(node_cost(node, sequence_length) for node in graph.nodes)

    sizes = [n for n in sorted(set(pass_rows) | {rows}) if n > 1]
    rates = dict(zip(sizes, _non_decreasing([flops * (n - 1) / max(
        _forward_and_backward_seconds(model, n, sequence_length) - few, 1e-9)
        for n in sizes])))
    cores = None if tf.config.list_logical_devices("GPU") else len(os.sched_getaffinity(0))
    two = _all_reduce_seconds(2)
    every = _all_reduce_seconds(devices) if devices > 2 else None
    hardware = Hardware(
        device_flops=rates[rows],
        flops_at=tuple((n, rates[n]) for n in sorted(set(pass_rows)) if n > 1),
        call_overhead=max(0.0, few - flops / rates[rows] - call) / (3 * len(graph.nodes)),
        step_overhead=call,
        collective_latency=Hardware.collective_latency if two is None else two,
        member_latency=(0.0 if two is None or every is None
                        else max(0.0, every - two) / (devices - 2)),
        send_latency=_send_seconds(), shared_cores=cores, **bandwidths)
    available = local_devices()
    configs = trial and trial_configs(model, min(devices, len(available)), sequence_length,
                                      memory)
    if configs:
        replica = _replica_seconds_of_steps(model, trial, configs, sequence_length, hardware)
    else:
        update = _update_seconds(model.optimizer, len(model.trainable_variables)) - call
        replica = (_replica_call_seconds(model, devices, rows, sequence_length)
                   + (max(0.0, update) / cores if cores else 0.0))
    return dataclasses.replace(hardware, replica_overhead=replica)


def local_devices():
    """This process's logical accelerators, or its logical CPUs if none: the
    devices its calibrations and trainings run on.

    >>> local_devices()[0].device_type  # on a host without GPUs
    'CPU'
    """
    return tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")


def _fewest_seconds(call, repeats=9):
    """Fewest seconds of `call()` over `repeats` runs after a first one."""
    call()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def _non_decreasing(values):
    """`values` made non-decreasing with the least squared change (pool
    adjacent violators): a pass over more rows runs at no lower a rate, so
    a rate measured below a smaller pass's (a timing the host slowed) is
    averaged with it.

    >>> _non_decreasing([64.0, 68.0, 71.0, 68.0, 65.0])
    [64.0, 68.0, 68.0, 68.0, 68.0]
    """
    pools = []  # [sum, count] of each run of values set equal
    for value in values:
        pools.append([value, 1])
        while len(pools) > 1 and pools[-2][0] * pools[-1][1] > pools[-1][0] * pools[-2][1]:
            total, count = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += count
    return [total / count for total, count in pools for _ in range(count)]


def _scalar_call():
    """A call of a function whose scalar result is fetched, nothing else."""
    one, add = tf.constant(1.0), tf.function(lambda x: x + 1.0)
    return lambda: add(one).numpy()


def _forward_and_backward_seconds(model, rows, sequence_length, repeats=9):
    """Fewest seconds of `model`'s forward and backward on `rows` examples."""
    inputs, _ = synthetic_batch(model, rows, sequence_length)
    weights = model.trainable_variables

    @tf.function
    def forward_and_backward(x):
        with tf.GradientTape() as tape:
            outputs = model(x, training=True)
            total = tf.add_n([tf.reduce_sum(tf.cast(y, tf.float32))
                              for y in tf.nest.flatten(outputs)])
        gradients = [getattr(g, "values", g)  # (an Embedding's: IndexedSlices)
                     for g in tape.gradient(total, weights) if g is not None]
        return tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in gradients])

    return _fewest_seconds(lambda: forward_and_backward(inputs).numpy(), repeats)


def _update_seconds(optimizer, weights, repeats=9):
    """Fewest seconds of a call applying a fresh copy of `optimizer` to
    `weights` one-element variables."""
    fresh = optimizer.__class__.from_config(optimizer.get_config())
    stand_ins = [tf.Variable(tf.zeros([1])) for _ in range(weights)]
    ones = [tf.ones([1]) for _ in stand_ins]

    @tf.function
    def update():
        fresh.apply_gradients(zip(ones, stand_ins))
        return stand_ins[0].read_value()

    return _fewest_seconds(lambda: update().numpy(), repeats)


def _replica_call_seconds(model, devices, rows, sequence_length, repeats=9):
    """Seconds each further device adds to a step of a `MirroredStrategy`
    over this process's first `devices` devices (as many as it has) that
    takes its share of a batch of `rows` examples per device and sums it
    (0.0 with one device: nothing to compare)."""
    available = local_devices()
    devices = min(devices, len(available))
    if devices < 2:
        return 0.0

    def step_seconds(count):
        strategy = MirroredStrategyOfItsOwnKeys([d.name for d in available[:count]])
        batch = tf.data.Dataset.from_tensors(synthetic_batch(model, rows * count,
                                                             sequence_length))
        iterator = iter(strategy.experimental_distribute_dataset(batch.repeat()))

        def replica(batch):
            return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32))
                             for t in tf.nest.flatten(batch)])

        @tf.function
        def step():
            return strategy.reduce("SUM", strategy.run(replica, (next(iterator),)), None)

        return _fewest_seconds(lambda: step().numpy(), repeats)

    return max(0.0, step_seconds(devices) - step_seconds(1)) / (devices - 1)


def _replica_seconds_of_steps(model, trial, configs, sequence_length, hardware):
    """What each further replica adds to the model's training step (timed
    by `trial`) from the first of `configs` (`trial_configs`) to the second,
    beyond what `hardware` predicts: the median of alternate rounds'
    differences."""
    batch = TRIAL_ROWS * configs[1].data
    timers = [trial(config, batch) for config in configs]
    for timer in timers:
        timer(TRIAL_STEPS)  # traces
    differences = []
    for _ in range(TRIAL_ROUNDS):  # alternately: the host's speed drifts between them
        fewer, every = (timer(TRIAL_STEPS) for timer in timers)
        differences.append(every - fewer)
    predicted = [predict_step_time(config, model, batch, hardware, sequence_length).total
                 for config in configs]
    unexplained = statistics.median(differences) - (predicted[1] - predicted[0])
    return max(0.0, unexplained) / (configs[1].data - configs[0].data)


def trial_configs(model, devices: int, sequence_length=None, memory=None):
    """The two configurations `measured_hardware` trains to time a
    replica's work, `TRIAL_ROWS` examples per device: data parallelism
    over `devices` devices, and over the fewest devices whose microbatches
    of the same rows (the same passes over the layers) fit in `memory`
    bytes per device (None: no limit); None when no two fit.

    Example:

    ```python
    [c.data for c in trial_configs(model, 4)]   # [1, 4]: one device's 4 microbatches
    ```
    """
    def fits(config):
        return memory is None or modes.planned_peak(
            config, model, TRIAL_ROWS * devices, sequence_length).total <= memory

    every = ParallelConfig(data=devices).resolve(devices)
    fewer = (ParallelConfig(data=d, microbatches=devices // d).resolve(d)
             for d in _divisors(devices)[:-1])
    first = next((config for config in fewer if fits(config)), None) if fits(every) else None
    return None if first is None else [first, every]


def step_timer(strategy, model_fn, batch_size: int, sequence_length=None, dataset=None):
    """A function `(steps) -> seconds`: trains `model_fn()`, built under
    `strategy`, `steps` more steps of `fit` and returns their median time
    (the first two of its first call, which trace, left out); `dataset`: a
    function `(batch_size) -> tf.data.Dataset` of (inputs, targets), None:
    `synthetic_batch`'s.

    Example:

    ```python
    timed = step_timer(tfdist.Strategy(data=2), build, batch_size=32)
    timed(10), timed(10)   # seconds per step, twice
    ```
    """
    with strategy.scope():
        model = model_fn()
    data = (dataset(batch_size) if dataset else tf.data.Dataset.from_tensors(
        synthetic_batch(model, batch_size, sequence_length))).repeat()
    traced = []

    def timed(steps):
        timer = _StepTimer()
        model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, shuffle=False,
                  callbacks=[timer])
        seconds = timer.seconds if traced else timer.seconds[2:] or timer.seconds
        traced.append(True)
        return statistics.median(seconds)

    return timed


class _StepTimer(keras.callbacks.Callback):
    """Seconds of each training step."""

    def __init__(self):
        super().__init__()
        self.seconds, self._start = [], 0.0

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


@functools.cache
def _send_seconds(chain=40, repeats=9):
    """Seconds a copy between two of this process's devices adds to each op
    of a chain of small ones (None with one device: not measured); measured
    once per process, as the devices' latencies do not depend on the model."""
    available = local_devices()
    if len(available) < 2:
        return None
    start = tf.ones([8])

    def chained(devices):
        @tf.function
        def run(x):
            for i in range(chain):
                with tf.device(devices[i % len(devices)].name):
                    x = tf.sin(x)
            return tf.reduce_sum(x)

        return _fewest_seconds(lambda: run(start).numpy(), repeats)

    return max(0.0, chained(available[:2]) - chained(available[:1])) / chain


@functools.cache
def _all_reduce_seconds(devices, chain=20, repeats=5):
    """Seconds per all-reduce of a chain of small ones over `devices` of
    this process's devices (None when it has fewer: not measured); measured
    once per process and member count."""
    available = local_devices()
    if devices < 2 or len(available) < devices:
        return None
    strategy = MirroredStrategyOfItsOwnKeys([device.name for device in available[:devices]])

    def chained(length):
        def replica():
            context = tf.distribute.get_replica_context()
            x = tf.ones([8])
            for _ in range(length):
                x = context.all_reduce("sum", x) * 0.5
            return x

        run = tf.function(lambda: strategy.run(replica))
        return _fewest_seconds(run, repeats)

    return max(0.0, chained(chain) - chained(1)) / (chain - 1)


def synthetic_batch(model, rows: int, sequence_length=None):
    """(inputs, targets) of `rows` examples shaped as `model`'s inputs and
    outputs, unknown lengths `sequence_length`: integer inputs ones (a valid
    token id, an open padding mask), integer targets zeros (a valid class),
    normal values for floats.

    Example:

    ```python
    x, y = synthetic_batch(model, 8, sequence_length=128)
    ```
    """
    def fill(tensor, integer=1):
        shape = [rows] + [d if d is not None else (sequence_length or 1)
                          for d in tensor.shape[1:]]
        if np.issubdtype(np.dtype(tensor.dtype), np.integer) or tensor.dtype == "bool":
            return np.full(shape, integer, tensor.dtype)
        return np.random.default_rng(0).standard_normal(shape).astype(tensor.dtype)

    def target(tensor):
        loss = getattr(model, "loss", None)
        name = getattr(loss, "name", loss) or ""
        if "sparse" in str(name).lower():
            shape = [rows] + [d if d is not None else (sequence_length or 1)
                              for d in tensor.shape[1:-1]]
            return np.zeros(shape, "int32")
        return fill(tensor, integer=0)

    sequential = isinstance(model, keras.Sequential)  # (no `input` before a call)
    return (tf.nest.map_structure(fill, model.inputs[0] if sequential else model.input),
            tf.nest.map_structure(target, model.outputs[0] if sequential else model.output))
