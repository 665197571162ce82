"""ParameterServerStrategy refuses bad clusters, configs and fit input before connecting."""

import json

import pytest
import tensorflow as tf

import tfdist
from tfdist.ps.keras_fit import check_fit_input


def resolver(**cluster):
    ports = iter(range(2000, 2100))
    spec = {k: [f"127.0.0.1:{next(ports)}" for _ in range(n)] for k, n in cluster.items()}
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(cluster_resolver=resolver(chief=1, worker=2)), ValueError, "no ps tasks"),
    (dict(cluster_resolver=resolver(chief=1, ps=1)), ValueError, "no worker tasks"),
    (dict(cluster_resolver=resolver(chief=1, worker=2, ps=1), zero=1), ValueError,
     "`zero=1` is not available under ParameterServerStrategy"),
    (dict(cluster_resolver=resolver(chief=1, worker=2, ps=1), data=4), ValueError,
     "`data=4` must equal the number of worker tasks, 2"),
    (dict(cluster_resolver=resolver(chief=1, worker=2, ps=1), variable_partitioner="even"),
     TypeError, "`variable_partitioner` must be"),
])
def test_bad_cluster_or_config_is_refused_before_connecting(kwargs, error, match):
    with pytest.raises(error, match=match):
        tfdist.ParameterServerStrategy(**kwargs)


def test_tf_config_without_ps_tasks_is_refused(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"chief": ["127.0.0.1:2000"], "worker": ["127.0.0.1:2001"]},
        "task": {"type": "chief", "index": 0}, "environment": "cloud"}))
    with pytest.raises(ValueError, match=r"cluster \(1 chief, 1 worker\) has no ps tasks"):
        tfdist.ParameterServerStrategy()


def test_evaluator_task_is_told_to_validate_on_the_chief():
    spec = tf.train.ClusterSpec({"chief": ["127.0.0.1:2000"], "worker": ["127.0.0.1:2001"],
                                 "ps": ["127.0.0.1:2002"]})
    evaluator = tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type="evaluator", task_id=0, rpc_layer="grpc")
    with pytest.raises(ValueError, match="validation on the chief"):
        tfdist.ParameterServerStrategy(cluster_resolver=evaluator)


def test_fit_input_checks():
    check_fit_input(tf.data.Dataset.range(8).batch(2), None)  # finite: fine
    check_fit_input(tf.data.Dataset.range(8).repeat(), 10)
    with pytest.raises(ValueError, match="size is unknown"):
        check_fit_input(tf.data.Dataset.range(8).filter(lambda t: t > 2), None)
    with pytest.raises(ValueError, match="steps_per_execution=4"):
        check_fit_input(tf.data.Dataset.range(8).repeat(), 10, steps_per_execution=4)
