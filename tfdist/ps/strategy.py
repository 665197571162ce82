"""`ParameterServerStrategy`: asynchronous parameter-server training for Keras 3.

Keras 3's `model.fit` does not support `tf.distribute`'s parameter-server
strategy. This one makes it work: the chief schedules each training step on
whichever worker is free through a `ClusterCoordinator`; workers read the
variables from, and write their updates to, the parameter servers without
waiting for each other.

The same script runs on every task. Constructing the strategy on a worker or
ps task starts that task's `tf.distribute.Server` and serves until the job
is stopped (the function never returns there); on the chief it connects to
the cluster and returns, and the script goes on to build and fit the model.
"""

import warnings
import weakref

import tensorflow as tf

from tfdist._compat import tf_parameter_server
from tfdist._compat.tf_logging import quiet_server_logs
from tfdist.cluster.liveness import TaskMonitor
from tfdist.cluster.rendezvous import check_timeout_seconds, wait_for_peers
from tfdist.cluster.serve import describe_jobs, resolver_or_tf_config, serve, server_config
from tfdist.cluster.tf_config import free_ports
from tfdist.ps import keras_fit
from tfdist.strategy import _StepOwner, requested_config

# Smallest shard a variable is split into across ps tasks (TensorFlow's
# recommended partitioner, capped at one shard per ps task).
_MIN_SHARD_BYTES = 256 << 10
# A task found frozen while the chief is blocked inside TensorFlow on it
# (reading variables for validation, evaluate, predict or a save) ends the
# chief this long after, with the message: a restart is the only way on.
_EXIT_AFTER_SECONDS = 30.0

class ParameterServerStrategy(_StepOwner, tf.distribute.experimental.ParameterServerStrategy):
    """Asynchronous data-parallel training with parameter servers, for `model.fit`.

    Workers run training steps independently, each on its own copy of the
    input data, reading the current variables from the ps tasks and applying
    their updates there; the chief (this process) schedules the steps and runs
    the callbacks, validation, `evaluate` and `predict`.

    Every step is applied exactly once: after `fit`, `optimizer.iterations`
    equals the number of steps run (a step scheduled on a worker that dies is
    run again on another), and learning-rate schedules see that count.
    Metrics are exact at the end of each epoch (the chief waits for the
    epoch's steps before reading them); the per-step values callbacks get
    lag the newest step by at most a few steps per worker.

    A task that dies is reported by TensorFlow (a worker's steps are run on
    the others until it is back; a lost ps fails `fit`); one that freezes,
    alive but not answering, fails `fit` within about 10 s naming it
    (`task_monitor`).

    Args:
        config: a `ParallelConfig` (or its dict); or give its fields as keywords.
            `microbatches`, `precision` and `xla` apply to each worker's step;
            `data` defaults to, and must equal, the number of workers.
        cluster_resolver: default: read `TF_CONFIG` (`tfdist launch` and the
            Kubeflow training operator set it). The cluster needs a chief, at
            least one worker and at least one ps task.
        variable_partitioner: how variables are split across ps tasks:
            `"auto"` (default) splits variables larger than 256 KiB into up to
            one shard per ps task; `None` keeps every variable whole (placed
            round-robin); or a `tf.distribute.experimental.partitioners`
            object.
        timeout_seconds: how long the chief waits at the start for every
            worker and ps task to serve; one that has not by then is named in
            a `TimeoutError` (TensorFlow's own connection waits without end).
        **fields: the `ParallelConfig` fields.

    Example:

    ```python
    # the same script on every task, with TF_CONFIG set
    # (tfdist launch --chief --workers 2 --ps 1 -- python train.py):
    strategy = tfdist.ParameterServerStrategy()   # workers and ps serve here
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(dataset.repeat(), epochs=3, steps_per_epoch=100)
    assert int(model.optimizer.iterations) == 300
    ```
    """

    def __init__(self, config=None, *, cluster_resolver=None,
                 variable_partitioner="auto", timeout_seconds: float = 300.0, **fields):
        quiet_server_logs()
        config = requested_config(config, fields, "ParameterServerStrategy")
        resolver = resolver_or_tf_config(cluster_resolver)
        cluster = _check_cluster(resolver)
        if resolver.task_type in ("worker", "ps"):
            serve(resolver)  # does not return
        if resolver.task_type not in (None, "chief"):
            raise ValueError(
                f"This task is {resolver.task_type!r}: a ParameterServerStrategy "
                f"runs on the chief (and serves on worker and ps tasks). Run "
                f"validation on the chief with `fit(validation_data=...)`."
            )
        check_timeout_seconds(timeout_seconds)
        config = config.for_worker_tasks(len(cluster["worker"]))
        partitioner = _partitioner(variable_partitioner, len(cluster["ps"]))
        # Everything checked: now wait (bounded) for the tasks to serve.
        wait_for_peers(timeout_seconds, cluster_resolver,
                       peer_types=("chief", "worker", "ps"))
        super().__init__(resolver, variable_partitioner=partitioner)
        # Keras 3 optimizers update each variable whole, partitioned ones too.
        tf_parameter_server.serve_keras_variables(self)
        self._init_step_owner(config)
        self._coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(self)
        self._task_monitor = TaskMonitor(
            {f"{job}:{index}": address for job in ("worker", "ps")
             for index, address in enumerate(cluster[job])},
            exit_after=_EXIT_AFTER_SECONDS)
        self._per_worker_iterators = weakref.WeakKeyDictionary()
        self._dataset_functions = weakref.WeakKeyDictionary()
        keras_fit.install(ParameterServerStrategy)

    @property
    def num_workers(self) -> int:
        """Worker tasks in the cluster."""
        return tf_parameter_server.num_workers(self.extended)

    @property
    def num_ps(self) -> int:
        """Ps tasks in the cluster."""
        return tf_parameter_server.num_ps(self.extended)

    @property
    def task_monitor(self) -> TaskMonitor:
        """Probes the worker and ps tasks during `fit`: a task that freezes
        (alive, its port open, but not answering) fails `fit` within about
        10 s with a `TaskUnresponsiveError` naming it
        (`tfdist.cluster.liveness`)."""
        return self._task_monitor

    @property
    def coordinator(self):
        """The `ClusterCoordinator` that schedules this strategy's steps."""
        return self._coordinator

    def experimental_distribute_dataset(self, dataset, options=None):
        """Returns `dataset` itself, after checking its batch size.

        `model.fit` hands its data to the strategy through this method. Under
        this strategy the chief iterates the returned dataset itself for
        `evaluate` and `predict`, and `fit` gives each worker its own copy
        (see `per_worker_iterator`). Custom loops should use
        `strategy.coordinator.create_per_worker_dataset(dataset_fn)` instead.
        """
        self._check_static_batch(dataset)
        return dataset

    def dataset_from_function(self, dataset_fn):
        """The chief's dataset for `dataset_fn`; workers each call `dataset_fn`.

        `model.fit(dataset_fn, steps_per_epoch=...)` uses it: `dataset_fn`
        takes a `tf.distribute.InputContext` and returns a `tf.data.Dataset`;
        each worker builds its own dataset with it (reading, say, files only
        the workers can see), and the chief builds one for Keras's bookkeeping.

        Example:

        ```python
        def dataset_fn(context):
            return tf.data.TFRecordDataset(files).map(parse).batch(64).repeat()

        model.fit(dataset_fn, epochs=3, steps_per_epoch=100)
        ```
        """
        dataset = dataset_fn(tf.distribute.InputContext())
        self._dataset_functions[dataset] = dataset_fn
        return dataset

    def per_worker_iterator(self, dataset):
        """An iterator over `dataset`, repeated, on every worker (one per dataset).

        Each worker reads its own copy of the data, from the start, in its
        own shuffle order. Steps scheduled with it never run out of data:
        `steps_per_epoch` (or the size of `dataset`) decides how many run.
        """
        iterator = self._per_worker_iterators.get(dataset)
        if iterator is None:
            dataset_fn = self._dataset_functions.get(dataset)
            if dataset_fn is None:
                distributed = super().experimental_distribute_dataset(dataset.repeat())
            else:
                distributed = self.distribute_datasets_from_function(
                    lambda context: dataset_fn(context).repeat())
            with warnings.catch_warnings():  # TensorFlow's note on tf.data options in graphs
                warnings.filterwarnings("ignore", message="To make it possible to preserve")
                iterator = iter(self._coordinator.create_per_worker_dataset(distributed))
            self._per_worker_iterators[dataset] = iterator
        return iterator



def _check_cluster(resolver):
    cluster = resolver.cluster_spec().as_dict()
    missing = [t for t in ("ps", "worker") if not cluster.get(t)]
    if missing:
        raise ValueError(
            f"A ParameterServerStrategy needs at least one ps and one worker "
            f"task, but the cluster ({describe_jobs(cluster)}) has no "
            f"{' and no '.join(missing)} tasks. Start it with e.g. "
            f"`tfdist launch --chief --workers 2 --ps 1 -- python train.py`."
        )
    return cluster


def _partitioner(value, num_ps):
    if value == "auto":
        return tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=_MIN_SHARD_BYTES, max_shards=num_ps
        )
    if value is None or isinstance(value, tf.distribute.experimental.partitioners.Partitioner):
        return value
    raise TypeError(
        f"`variable_partitioner` must be 'auto', None or a "
        f"tf.distribute.experimental.partitioners.Partitioner, got {value!r}."
    )


def in_process_cluster(workers=2, ps=1):
    """Starts `workers` worker and `ps` ps servers in this process.

    Returns the cluster resolver for a chief in this process: pass it to
    `ParameterServerStrategy(cluster_resolver=...)`. For trying parameter-server
    training in one process (a notebook, a test); the servers live as long as
    the process. Ports are free ports on 127.0.0.1.

    Example:

    ```python
    resolver = tfdist.ps.in_process_cluster(workers=2, ps=1)
    strategy = tfdist.ParameterServerStrategy(cluster_resolver=resolver)
    ```
    """
    if workers < 1 or ps < 1:
        raise ValueError(
            f"An in-process cluster needs workers >= 1 and ps >= 1, got "
            f"workers={workers}, ps={ps}."
        )
    quiet_server_logs()
    ports = iter(free_ports(workers + ps + 1))
    cluster = {
        "chief": [f"127.0.0.1:{next(ports)}"],
        "worker": [f"127.0.0.1:{next(ports)}" for _ in range(workers)],
        "ps": [f"127.0.0.1:{next(ports)}" for _ in range(ps)],
    }
    spec = tf.train.ClusterSpec(cluster)
    for job in ("worker", "ps"):
        for index in range(len(cluster[job])):
            tf.distribute.Server(spec, job_name=job, task_index=index, protocol="grpc",
                                 config=server_config(workers), start=True)
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type="chief", task_id=0, rpc_layer="grpc"
    )
