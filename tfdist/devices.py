"""This host's devices: `use_virtual_devices` splits the CPU into logical devices,
`check_devices` checks device names against the devices that exist.

This lets every tfdist mode run, and be tested, on a laptop or a CI machine without
accelerators: a 4-way data-parallel run uses 4 logical CPU devices in one process.
"""

import tensorflow as tf

from tfdist.logs import discover_devices_quietly


def use_virtual_devices(n: int) -> None:
    """Splits the host CPU into `n` logical devices.

    Must run before TensorFlow initialises its devices (before the first op,
    strategy or model); in pytest, call it once in `conftest.py`. Calling it
    again with the same `n` is harmless. It leaves TensorFlow uninitialised,
    so a `MultiWorkerStrategy` can still be created after it (each worker of
    a pipelined multi-worker job splits its CPU into one device per stage).

    Args:
        n: number of logical CPU devices, an int >= 1.

    Raises:
        ValueError: `n` is not an int >= 1.
        RuntimeError: TensorFlow already initialised its devices with another
            count (the configuration can no longer change in this process).

    Example:

    ```python
    import tfdist
    tfdist.use_virtual_devices(4)
    strategy = tfdist.Strategy(data=4)
    ```
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"`n` must be an int >= 1, got {n!r}.")
    discover_devices_quietly()
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
        )
    except RuntimeError as error:
        current = tf.config.list_logical_devices("CPU")
        if len(current) == n:
            return
        raise RuntimeError(
            f"use_virtual_devices({n}): TensorFlow already initialised its "
            f"devices with {len(current)} logical CPU device(s), and the count "
            f"cannot change in a running process. Call "
            f"tfdist.use_virtual_devices({n}) before any other TensorFlow work "
            f"(first thing in the script, or once in conftest.py)."
        ) from error


def check_devices(devices) -> list[str]:
    """`devices` as a list, each checked to name a logical device of this host.

    Names are TensorFlow device names (`"/device:GPU:0"`, `"GPU:0"`,
    `"/job:localhost/replica:0/task:0/device:CPU:1"`).

    Raises:
        ValueError: `devices` is not a non-empty list of names, or names a
            device this host does not have; the message lists those it has.

    Example:

    ```python
    check_devices(["/device:CPU:0", "/device:CPU:1"])   # with 2 logical CPUs
    check_devices(["/device:GPU:7"])   # ValueError: ... available: /device:CPU:0, ...
    ```
    """
    if isinstance(devices, str) or not devices:
        raise ValueError(
            f"`devices` must be a non-empty list of device names, got {devices!r}."
        )
    devices = list(devices)
    discover_devices_quietly()
    available = tf.config.list_logical_devices()
    have = {(d.device_type, _index(d.name)) for d in available}
    unknown = []
    for name in devices:
        try:
            spec = tf.DeviceSpec.from_string(name)
        except (ValueError, TypeError):
            spec = None
        if spec is None or (str(spec.device_type).upper(), spec.device_index) not in have:
            unknown.append(name)
    if unknown:
        listed = ", ".join(f"/device:{t}:{i}" for t, i in sorted(have))
        raise ValueError(
            f"`devices` names {unknown}, which this host does not have; available: "
            f"{listed}. (More CPU devices: `tfdist.use_virtual_devices(n)` first.)"
        )
    return devices


def _index(name):
    return tf.DeviceSpec.from_string(name).device_index
