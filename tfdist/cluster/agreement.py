"""`check_tasks_agree`: every task of a synchronous job runs the same config and versions.

Tasks started with different `ParallelConfig`s (one with `zero=1`, another
with `zero=0`; a `precision` differing) either fail later with a collective
error that names nothing, or train on without a word. `MultiWorkerStrategy`
therefore gathers each task's requested config and its tfdist, TensorFlow and
Keras versions before any step, and every task refuses a difference, naming
the field, the tasks and both values.
"""

import json

import keras
import numpy as np
import tensorflow as tf

import tfdist
from tfdist.cluster.watchdog import process_watchdog

_MAX_BYTES = 16384  # what one task's description may take (a config is ~300)


def describe_task(task: str, config) -> dict:
    """What must agree across the tasks of a job: the requested config's
    fields and the versions of tfdist, TensorFlow and Keras (and the task's
    name, to say who differs).

    Example:

    >>> sorted(describe_task("worker:0", tfdist.ParallelConfig()))[:3]
    ['config', 'keras', 'task']
    """
    return {"task": task, "config": config.to_dict(), "tfdist": tfdist.__version__,
            "tensorflow": tf.__version__, "keras": keras.__version__}


def differences(descriptions: list[dict]) -> list[str]:
    """Every way the tasks' descriptions differ from the first one's, in words.

    Example:

    >>> a = describe_task("worker:0", tfdist.ParallelConfig(zero=1))
    >>> b = describe_task("worker:1", tfdist.ParallelConfig(zero=0))
    >>> differences([a, b])
    ['`zero` is 1 on worker:0 but 0 on worker:1']
    """
    first, found = descriptions[0], []
    for other in descriptions[1:]:
        for name in ("tfdist", "tensorflow", "keras"):
            if other[name] != first[name]:
                found.append(f"{name} is {first[name]} on {first['task']} but "
                             f"{other[name]} on {other['task']}")
        for field, value in first["config"].items():
            if other["config"].get(field) != value:
                found.append(f"`{field}` is {value!r} on {first['task']} but "
                             f"{other['config'].get(field)!r} on {other['task']}")
    return found


def gather_from_tasks(strategy, value: dict, timeout_seconds: float, what: str) -> list[dict]:
    """Every replica's `value` (a JSON-serialisable dict), gathered over the
    strategy's replicas in replica order: each task's, once per replica it has.

    Every task of the job must call it at the same point; bounded by
    `timeout_seconds` (`what` says what for, in the error).

    Example:

    ```python
    gather_from_tasks(strategy, {"task": "worker:0", "epoch": 3}, 300, "comparing backups")
    ```
    """
    encoded = json.dumps(value).encode()
    if len(encoded) > _MAX_BYTES:
        raise ValueError(f"`value` is {len(encoded)} bytes as JSON, over {_MAX_BYTES}: "
                         f"{encoded[:200]!r}...")
    row = np.zeros(_MAX_BYTES + 1, np.int32)  # the length, then the bytes
    row[0] = len(encoded)
    row[1:len(encoded) + 1] = np.frombuffer(encoded, np.uint8)
    rows = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(row[np.newaxis]))
    with process_watchdog().deadline(timeout_seconds, what,
                                     "every task must take part at the same point."):
        gathered = strategy.gather(rows, axis=0).numpy()
    return [json.loads(bytes(r[1:r[0] + 1].astype(np.uint8)).decode()) for r in gathered]


def check_tasks_agree(strategy, task: str, config, timeout_seconds: float):
    """Gathers every task's `describe_task` over `strategy`'s replicas and
    raises ValueError if any differs from this task's.

    Every task of the job must call it at the same point (the strategy's
    constructor does). Bounded by `timeout_seconds`.

    Example:

    ```python
    check_tasks_agree(strategy, "worker:0", config, 300)
    ```
    """
    own = describe_task(task, config)
    found = differences([own, *gather_from_tasks(
        strategy, own, timeout_seconds, "comparing the tasks' configs")])
    if found:
        raise ValueError(
            "The tasks of this job do not run the same configuration: "
            + "; ".join(dict.fromkeys(found))
            + ". Start every task with the same ParallelConfig (TFDIST_CONFIG, "
            "`tfdist launch` flags) and the same tfdist, TensorFlow and Keras.")
