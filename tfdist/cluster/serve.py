"""A worker or ps task's `tf.distribute.Server`, for strategies driven by the chief.

`tfdist.ParameterServerStrategy` and `tfdist.ChiefStrategy` run one client,
the chief; every other task only serves: constructing either strategy there
calls `serve`.
"""

import time

import tensorflow as tf
from absl import logging

from tfdist.cluster.liveness import probe
from tfdist.cluster.tf_config import read_tf_config
from tfdist.profiling import start_profiler_server


def resolver_or_tf_config(cluster_resolver=None):
    """`cluster_resolver`, or else one reading `TF_CONFIG` (validated first:
    a malformed one raises a `ValueError` naming the field).

    Example:

    ```python
    resolver = resolver_or_tf_config()   # TF_CONFIG's cluster and task
    ```
    """
    if cluster_resolver is not None:
        return cluster_resolver
    read_tf_config()
    return tf.distribute.cluster_resolver.TFConfigClusterResolver()


def describe_jobs(cluster) -> str:
    """A cluster's jobs (a `ClusterSpec.as_dict()`), for a message.

    Example:

    >>> describe_jobs({"worker": ["h:1", "h:2"], "chief": ["h:0"]})
    '1 chief, 2 worker'
    """
    return ", ".join(f"{len(v)} {k}" for k, v in sorted(cluster.items())) or "empty"


def server_config(num_workers):
    """Enough inter-op threads for every worker's concurrent requests.

    Example:

    >>> server_config(2).inter_op_parallelism_threads
    3
    """
    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = num_workers + 1
    return config


def serve(resolver, until_gone=None, timeout_seconds=300.0, interval=1.0):
    """Runs this task's server (`resolver.task_type`, `task_id`).

    Without `until_gone`, until the process is stopped (it does not return).
    With `until_gone` (a task's "host:port": the chief), it returns once
    that task, having answered, has stopped: its process ended, the job is
    done. A task that never answers within `timeout_seconds` raises a
    `TimeoutError` naming it.

    Example:

    ```python
    # on a worker task of a job whose chief runs the training:
    serve(tf.distribute.cluster_resolver.TFConfigClusterResolver())
    ```
    """
    start_profiler_server()
    cluster = resolver.cluster_spec()
    server = tf.distribute.Server(
        cluster,
        job_name=resolver.task_type,
        task_index=resolver.task_id,
        protocol=resolver.rpc_layer or "grpc",
        config=server_config(len(cluster.as_dict()["worker"])),
        start=True,
    )
    logging.info("%s:%d serving at %s", resolver.task_type, resolver.task_id, server.target)
    # (`server.join()` would hold Python's lock: the script's threads would stop.)
    while until_gone is None:
        time.sleep(3600)
    deadline = time.monotonic() + timeout_seconds
    answered = False
    while True:
        # Until it first answers, every 0.1 s: a chief that starts and ends
        # between two probes would be taken as never started.
        time.sleep(interval if answered else min(interval, 0.1))
        status = probe(until_gone, timeout=max(interval, 5.0))
        if status == "down" and answered:
            logging.info("%s:%d: %s has ended; stopping", resolver.task_type,
                         resolver.task_id, until_gone)
            return
        answered = answered or status == "ok"
        if not answered and time.monotonic() > deadline:
            raise TimeoutError(
                f"{resolver.task_type}:{resolver.task_id} served for {timeout_seconds:g} s "
                f"without the task at {until_gone} ever answering: is it running?")
