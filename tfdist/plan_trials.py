"""`tfdist.plan`: the plans `tfdist.planning` predicts, and with `measure=K`
the first K that fit trained here for a few steps and ranked by their
measured time.

Example:

```python
plans = tfdist.plan(build_model, devices=4, memory_per_device="1GiB",
                    batch_size=32, measure=3)
[p.measured for p in plans[:3]]   # seconds per step, measured
```
"""

import keras

from tfdist.config import ParallelConfig
from tfdist.planning import (
    HEADROOM,
    Plans,
    describe_config,
    local_devices,
    predicted_plans,
    step_timer,
)
from tfdist.strategy import Strategy


def plan(model, devices: int, memory_per_device, batch_size: int, sequence_length=None,
         hosts: int = 1, link_bandwidth="10Gbit", device_bandwidth="100Gbit",
         device_flops=None, headroom=HEADROOM, measure: int = 0, steps: int = 10,
         dataset=None, **fixed) -> Plans:
    """Every configuration of `devices` devices for `model`, predicted and
    ranked (`Plans`, best first).

    Args:
        model: a built, compiled Keras 3 model, or a function of no
            arguments returning one (needed by `measure`, which builds the
            model again under each plan's strategy). Its optimizer is built
            if it is not, so that its slots count.
        devices: the devices to spread over (data x pipeline x tensor).
        memory_per_device: bytes each device may hold, or a string such as
            "16GiB".
        batch_size: the global batch.
        sequence_length: the length of the model's unknown input
            dimensions in the first batch (1 when None).
        hosts: hosts the devices are spread over, equally; tensor groups
            and pipeline stages stay within one (a process per host: the
            peak counts the transport's copies of data collectives between
            them).
        link_bandwidth: between hosts, bytes per second or "10Gbit".
        device_bandwidth: between the devices of a host.
        device_flops: FLOP/s of one device (the hardware then as given:
            no call overhead, the default collective latency); None: this
            process's devices measured on the model (`measured_hardware`;
            with `model` a function, two short trainings measure what each
            replica adds to a step: data parallelism over the devices
            against fewer devices' microbatches of the same examples).
        headroom: the share of `memory_per_device` kept free for the
            prediction's error: a plan fits when its predicted peak is
            within the rest (0.15: the predictions measured 0.83-1.16 x on
            the benchmarked models, docs/benchmarks.md).
        measure: train the first `measure` plans that fit here, `steps`
            steps each, and rank them by their measured time (needs
            `devices` devices in this process: `tfdist.use_virtual_devices`).
        dataset: with `measure`, a function `(batch_size) -> tf.data.Dataset`
            of (inputs, targets); None: `synthetic_batch`'s.
        **fixed: `ParallelConfig` fields held at these values (such as
            `precision="mixed_bfloat16"`, `compression="bf16"`, `zero=3`).

    Raises `ValueError` naming the argument for a bad value, before any
    planning.

    Example:

    ```python
    plans = tfdist.plan(model, devices=4, memory_per_device="1GiB", batch_size=32)
    print(plans.best.config.to_json())
    ```
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"`steps` must be an int >= 1, got {steps!r}.")
    if isinstance(measure, bool) or not isinstance(measure, int) or measure < 0:
        raise ValueError(f"`measure` must be an int >= 0 (plans to train), got {measure!r}.")
    if measure and isinstance(model, keras.Model):
        raise ValueError(f"`measure={measure}` builds the model again under each plan's "
                         f"strategy: pass `model` as a function returning the compiled "
                         f"model, not the model.")
    def trial(config, rows):
        return step_timer(strategy_of(config), model, rows, sequence_length, dataset)

    plans = predicted_plans(model, devices, memory_per_device, batch_size, sequence_length,
                            hosts, link_bandwidth, device_bandwidth, device_flops, headroom,
                            trial=None if isinstance(model, keras.Model) else trial, **fixed)
    if measure:
        _measure(plans, model, batch_size, sequence_length, steps, dataset, measure)
        plans = plans.ranked()
    return plans


def _measure(plans, model_fn, batch_size, sequence_length, steps, dataset, count):
    """Trains the first `count` fitting plans; sets each one's `measured`."""
    for candidate in [p for p in plans if p.fits][:count]:
        candidate.measured = measured_step_seconds(candidate.config, model_fn, batch_size,
                                                   sequence_length, steps, dataset)


def measured_step_seconds(config: ParallelConfig, model_fn, batch_size: int,
                          sequence_length=None, steps: int = 10, dataset=None) -> float:
    """Median seconds of a training step of `model_fn()` under `config` on
    this process's first devices, over `steps` steps of `fit` (the first two,
    which trace, left out); `dataset` as `plan`'s.

    Example:

    ```python
    measured_step_seconds(plans.best.config, build, batch_size=32)
    ```
    """
    return step_timer(strategy_of(config), model_fn, batch_size, sequence_length,
                      dataset)(steps)


def strategy_of(config: ParallelConfig) -> Strategy:
    """A `Strategy` of `config` on this process's first devices; `ValueError`
    when it has fewer than `config` needs.

    Example:

    ```python
    strategy_of(ParallelConfig(data=2, pipeline=2).resolve(4)).config.pipeline
    ```
    """
    devices = config.devices_needed
    available = local_devices()
    if len(available) < devices:
        raise ValueError(
            f"Measuring {describe_config(config)} trains on {devices} devices, but this "
            f"process has {len(available)}: call tfdist.use_virtual_devices({devices}) "
            f"before TensorFlow starts, or measure=0.")
    return Strategy(config, devices=[device.name for device in available[:devices]])
