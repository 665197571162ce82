"""`ChiefStrategy`: one process, the chief, trains on every worker's devices.

`tfdist.MultiWorkerStrategy` runs the script on every task, each driving its
own devices, so a pipeline's stages stay within a task. Here only the chief
runs the script: it connects to the cluster
(`tf.config.experimental_connect_to_cluster`) and drives the workers'
devices as a `tfdist.Strategy` drives its host's, so a model's pipeline
stages live on different hosts and each worker holds only its stages'
weights and optimizer state. TensorFlow moves the activations and gradients
between the stages' hosts over gRPC. The same script runs on every task:
constructing the strategy on a worker task serves there until the chief ends,
then ends the worker's process (exit code 0).
"""

import sys

import tensorflow as tf

from tfdist._compat.tf_logging import quiet_server_logs
from tfdist.cluster.liveness import TaskMonitor
from tfdist.cluster.rendezvous import check_timeout_seconds, wait_for_peers
from tfdist.cluster.serve import describe_jobs, resolver_or_tf_config, serve
from tfdist.strategy import Strategy, requested_config


class ChiefStrategy(Strategy):
    """Synchronous training on the devices of every worker task, driven by the chief.

    A `tfdist.Strategy` whose devices are the cluster's worker devices (task
    0's first, in task order), with one data replica: `pipeline` equals the
    workers' devices, and `microbatches`, `schedule`, `virtual_stages`,
    `remat`, `precision` and `xla` work as in one process. With one device
    per worker, worker k holds stage k: a model whose training state does
    not fit one worker trains on several. `data` and `tensor` above 1 are
    refused (TensorFlow places no `MirroredStrategy` replicas on several
    workers' devices in eager mode): for them, `tfdist.MultiWorkerStrategy`.

    Args:
        config: a `ParallelConfig` (or its dict); or give its fields as
            keywords; neither: `$TFDIST_CONFIG` (set by `tfdist launch`),
            else the defaults.
        cluster_resolver: default: read `TF_CONFIG` (`tfdist launch --chief
            --workers N` and the Kubeflow training operator set it). The
            cluster needs a chief and at least one worker task, and no ps.
        timeout_seconds: how long the chief waits at the start for every
            worker to serve, and a worker for the chief to answer (a
            `TimeoutError` names those that do not). A worker that freezes
            during training (alive, not answering) ends the chief within
            about 30 s with an error naming it; one that dies fails the call
            waiting on it.
        layout_map: as `tfdist.Strategy`'s.
        **fields: the `ParallelConfig` fields.

    Example:

    ```python
    # the same script on every task, with TF_CONFIG set
    # (tfdist launch --chief --workers 4 -- python train.py):
    strategy = tfdist.ChiefStrategy(pipeline=4, microbatches=8)   # workers serve here
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(dataset, epochs=3)   # stage k of the model on worker k
    ```
    """

    def __init__(self, config=None, *, cluster_resolver=None,
                 timeout_seconds: float = 300.0, layout_map=None, **fields):
        quiet_server_logs()
        config = requested_config(config, fields, "ChiefStrategy")
        resolver = resolver_or_tf_config(cluster_resolver)
        cluster = _check_cluster(resolver)
        check_timeout_seconds(timeout_seconds)
        if resolver.task_type == "worker":  # serves until the chief ends, then ends
            serve(resolver, until_gone=cluster["chief"][0], timeout_seconds=timeout_seconds)
            sys.exit(0)
        if resolver.task_type not in (None, "chief"):
            raise ValueError(
                f"This task is {resolver.task_type!r}: a ChiefStrategy runs on the "
                f"chief and serves on worker tasks.")
        wait_for_peers(timeout_seconds, cluster_resolver, peer_types=("chief", "worker"))
        tf.config.experimental_connect_to_cluster(
            resolver, job_name="chief", task_index=0, make_master_device_default=False)
        self._timeout_seconds = float(timeout_seconds)
        devices = worker_devices(len(cluster["worker"]))
        try:
            config.resolve(len(devices)).validate("ChiefStrategy")
        except ValueError as error:
            raise ValueError(f"{error} (the workers have {len(devices)} devices)") from None
        super().__init__(config, devices=devices, layout_map=layout_map)
        # A worker that freezes would block the chief inside TensorFlow for good:
        # probed for the strategy's life, it ends the chief naming it, at once
        # (nothing of the chief's own checks the monitor meanwhile).
        self._task_monitor = TaskMonitor(
            {f"worker:{index}": address for index, address in enumerate(cluster["worker"])},
            exit_after=0.0)
        self._task_monitor.__enter__()

    @property
    def timeout_seconds(self) -> float:
        """How long the start waits for the other tasks (see the class's Args)."""
        return self._timeout_seconds


def worker_devices(workers: int) -> list[str]:
    """The logical devices of the connected cluster's worker tasks, task 0's
    first (GPUs if a worker has any, else its CPUs).

    Example:

    ```python
    worker_devices(2)   # ['/job:worker/replica:0/task:0/device:CPU:0',
                        #  '/job:worker/replica:0/task:1/device:CPU:0']
    ```
    """
    devices = []
    for task in range(workers):
        prefix = f"/job:worker/replica:0/task:{task}/"
        own = [d.name for d in tf.config.list_logical_devices() if d.name.startswith(prefix)]
        gpus = [name for name in own if ":GPU:" in name]
        devices += gpus or [name for name in own if ":CPU:" in name]
    return devices


def _check_cluster(resolver):
    cluster = resolver.cluster_spec().as_dict()
    if not cluster.get("chief") or not cluster.get("worker") or cluster.get("ps"):
        raise ValueError(
            f"A ChiefStrategy needs a chief and at least one worker task and no "
            f"ps task, but the cluster has {describe_jobs(cluster)}. Start it with e.g. "
            f"`tfdist launch --chief --workers 4 -- python train.py`.")
    return cluster
