"""`tfdist.ChiefStrategy` refuses what it cannot run before it connects (no servers)."""

import pytest
import tensorflow as tf

import tfdist
from tfdist.config import ParallelConfig


def _resolver(**jobs):
    """A chief's resolver of a cluster with `jobs` (name -> task count) on
    ports nothing listens on: every case here fails before connecting."""
    spec = {job: [f"127.0.0.1:{1 + i}" for i in range(count)] for job, count in jobs.items()}
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")


@pytest.mark.parametrize("fields", [{"tensor": 2}, {"data": 2}, {"data": 2, "pipeline": 2}])
def test_more_than_one_replica_is_refused(fields):
    with pytest.raises(NotImplementedError, match="a ChiefStrategy runs one") as error:
        tfdist.ChiefStrategy(cluster_resolver=_resolver(chief=1, worker=4), **fields)
    assert "tfdist.MultiWorkerStrategy" in str(error.value)


@pytest.mark.parametrize("jobs,missing", [({"chief": 1, "worker": 2, "ps": 1}, "1 ps"),
                                          ({"worker": 2}, "2 worker"),
                                          ({"chief": 1}, "1 chief")])
def test_a_cluster_without_chief_and_workers_or_with_ps_is_refused(jobs, missing):
    with pytest.raises(ValueError, match="needs a chief and at least one worker task and "
                                         f"no ps task, but the cluster has .*{missing}"):
        tfdist.ChiefStrategy(cluster_resolver=_resolver(**jobs), pipeline=2)


def test_config_rule_names_the_replicas():
    with pytest.raises(NotImplementedError, match=r"`data=3` x `tensor=1` is 3 replicas"):
        ParallelConfig(data=3).validate("ChiefStrategy")
    assert ParallelConfig(pipeline=4, microbatches=8).validate("ChiefStrategy").pipeline == 4
