"""The tensor mesh's group arithmetic: which replicas form a tensor group, a data
group, which rank each holds; checked with one collective per group, no training."""

import types

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from helpers import devices
from tfdist.engine.reduce import DataGroupAllReduce
from tfdist.tensor.mesh import cluster_devices


def per_replica(strategy, fn):
    """`fn(mesh, replica)` run on every replica (in a tf.function), as numpy
    per replica; `mesh` is the strategy's `replica_mesh`."""
    mesh = strategy.replica_mesh

    @tf.function
    def step():
        def on_replica():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            return fn(mesh, tf.cast(replica, tf.float32))

        return strategy.run(on_replica)

    values = strategy.experimental_local_results(step())
    return np.stack([np.asarray(v) for v in values])


def test_data2_tensor2_shape_and_ranks():
    strategy = tfdist.Strategy(data=2, tensor=2, devices=devices(4))
    mesh = strategy.tensor_mesh
    assert (mesh.data, mesh.tensor, mesh.num_replicas) == (2, 2, 4)
    ranks = per_replica(strategy, lambda mesh, replica: tf.constant(mesh.rank()))
    assert ranks.tolist() == [0, 1, 0, 1]
    assert mesh.rank() is None  # outside the replicas: layers use full weights


def test_tensor_groups_are_consecutive_replicas():
    strategy = tfdist.Strategy(data=2, tensor=2, devices=devices(4))
    summed = per_replica(strategy, lambda mesh, replica: mesh.reduce(replica[None]))
    assert summed[:, 0].tolist() == [0 + 1, 0 + 1, 2 + 3, 2 + 3]
    gathered = per_replica(strategy, lambda mesh, replica: mesh.gather_last(replica[None, None]))
    assert gathered[:, 0].tolist() == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_data_groups_are_the_same_rank_of_every_tensor_group():
    strategy = tfdist.Strategy(data=2, tensor=2, devices=devices(4))
    # DataGroupAllReduce sums over the data group {r, r + t} and multiplies by t.
    reduced = per_replica(strategy,
                          lambda mesh, replica: DataGroupAllReduce(mesh)([replica[None], None])[0])
    assert reduced[:, 0].tolist() == [(0 + 2) * 2, (1 + 3) * 2, (0 + 2) * 2, (1 + 3) * 2]


@pytest.mark.parametrize("data_size, tensor", [(1, 4), (4, 2)])
def test_every_mesh_shape_numbers_its_ranks_within_each_group(data_size, tensor):
    n = data_size * tensor
    strategy = tfdist.Strategy(data=data_size, tensor=tensor, devices=devices(n))
    ranks = per_replica(strategy, lambda mesh, replica: tf.constant(mesh.rank()))
    assert ranks.tolist() == [r % tensor for r in range(n)]
    summed = per_replica(strategy, lambda mesh, replica: mesh.reduce(replica[None]))
    groups = [list(range(g, g + tensor)) for g in range(0, n, tensor)]
    assert summed[:, 0].tolist() == [sum(groups[r // tensor]) for r in range(n)]


def test_pipeline_stages_take_consecutive_devices_per_replica():
    strategy = tfdist.Strategy(data=2, pipeline=2, tensor=2, microbatches=2,
                               devices=devices(8))
    names = devices(8)
    assert strategy.pipeline_devices == [names[0:2], names[2:4], names[4:6], names[6:8]]
    # The replicas' own devices (stage 0) are the mesh, in replica order.
    own = [device.split("device:")[-1] for device in cluster_devices(strategy.extended)]
    assert own == ["CPU:0", "CPU:2", "CPU:4", "CPU:6"]
    assert strategy.tensor_mesh.num_replicas == 4


def test_cluster_devices_of_one_process_are_its_own():
    strategy = tfdist.Strategy(data=4, devices=devices(4))
    assert cluster_devices(strategy.extended) == list(strategy.extended.worker_devices)


def test_cluster_devices_follow_the_task_ids_chief_first():
    local = ["/job:worker/replica:0/task:1/device:CPU:0",
             "/job:worker/replica:0/task:1/device:CPU:1"]
    spec = tf.train.ClusterSpec({"worker": ["w0:1", "w1:1"], "chief": ["c:1"]})
    # The two attributes cluster_devices reads of a MultiWorkerStrategy's extended.
    extended = types.SimpleNamespace(worker_devices=local, _cluster_spec=spec)
    assert cluster_devices(extended) == [
        f"/job:{job}/replica:0/task:{task}/device:CPU:{index}"
        for job, task in [("chief", 0), ("worker", 0), ("worker", 1)] for index in (0, 1)]


def test_without_tensor_groups_the_replica_mesh_is_data_only():
    strategy = tfdist.Strategy(data=2, pipeline=2, microbatches=2, devices=devices(4))
    mesh = strategy.replica_mesh
    assert strategy.tensor_mesh is None and mesh is strategy.replica_mesh
    assert (mesh.data, mesh.tensor, mesh.num_replicas) == (2, 1, 2)
    assert mesh.rank() is None  # outside the replicas
    # Tensor-group operators are the identity; ranks are all 0.
    ranks = per_replica(strategy, lambda mesh, replica: tf.constant(mesh.rank()))
    assert ranks.tolist() == [0, 0]
    same = per_replica(strategy, lambda mesh, replica: mesh.gather_last(mesh.reduce(
        mesh.copy(replica[None, None]))))
    assert same[:, 0, 0].tolist() == [0, 1]

    # The data group is every replica; under `stage(1)` its collectives run
    # among the replicas' stage-1 devices (CPU:1 and CPU:3), on those devices.
    def summed_on(stage):
        def fn(mesh, replica):
            with mesh.stage(stage):
                launcher = mesh.data_launcher()
                with tf.device(strategy.pipeline_devices[mesh.replica()][stage]):
                    total = launcher.all_reduce(replica[None] + 1)
            return tf.stack([total[0], tf.constant(float(total.device.endswith(
                f"CPU:{2 * mesh.replica() + stage}")))])
        return per_replica(strategy, fn)

    for stage in (0, 1):
        assert summed_on(stage).tolist() == [[3.0, 1.0], [3.0, 1.0]], stage
