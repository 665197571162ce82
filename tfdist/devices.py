"""`use_virtual_devices`: split the host CPU into logical devices.

This lets every tfdist mode run, and be tested, on a laptop or a CI machine without
accelerators: a 4-way data-parallel run uses 4 logical CPU devices in one process.
"""

import tensorflow as tf


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
