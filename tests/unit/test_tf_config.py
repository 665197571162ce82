"""TF_CONFIG: parsing, its refusals naming the field, and the clusters `tfdist launch` writes."""

import json

import pytest

from tfdist.cluster.tf_config import TFConfig, local_tf_configs, read_tf_config


@pytest.mark.parametrize("value, message", [
    ({"cluster": {"Worker": ["h:1"]}, "task": {"type": "worker", "index": 0}},
     r"task type 'Worker'; valid types are"),
    ({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 1}},
     r"task\"\] is worker:1, but the cluster has 1 worker task"),
    ({"cluster": {"worker": ["h"]}, "task": {"type": "worker", "index": 0}},
     r"has address 'h'; addresses are \"host:port\""),
    ({"cluster": {"worker": []}, "task": {"type": "worker", "index": 0}},
     r"must be a non-empty list"),
    ({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker"}},
     r'TF_CONFIG\["task"\] must be'),
    ({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}, "x": 1},
     r"unknown key\(s\) \['x'\]"),
    ({"cluster": {"worker": ["h:1"]}, "task": {"type": "trainer", "index": 0}},
     r"\"type\"\] is 'trainer'"),
    ({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": -1}},
     r"index\"\] must be an int >= 0, got -1"),
    # one gRPC server per address: the second task failed to start while the
    # others waited
    ({"cluster": {"worker": ["h:1", "h:1"]}, "task": {"type": "worker", "index": 0}},
     r"several tasks one address \(worker:0 and worker:1 are all at h:1\)"),
    ({"cluster": {"chief": ["h:1"], "worker": ["h:2", "h:1"]},
      "task": {"type": "worker", "index": 0}},
     r"chief:0 and worker:1 are all at h:1\): each task serves"),
])
def test_bad_tf_config_names_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        TFConfig.from_dict(value)
    with pytest.raises(ValueError, match=message):
        read_tf_config({"TF_CONFIG": json.dumps(value)})


def test_tf_config_round_trip_and_absence():
    config = TFConfig({"chief": ["10.0.0.1:2222"], "worker": ["w-0.ns.svc:2222"]}, "chief", 0)
    assert TFConfig.from_json(config.to_json()) == config
    assert read_tf_config({}) is None
    with pytest.raises(ValueError, match="TF_CONFIG is not valid JSON"):
        read_tf_config({"TF_CONFIG": "{cluster"})


def test_evaluator_is_not_in_the_cluster_but_knows_it():
    configs = local_tf_configs(workers=2, evaluator=True)
    assert configs[-1].task == "evaluator:0"
    assert "evaluator" not in configs[-1].cluster
    assert all(c.cluster == configs[0].cluster for c in configs)


def test_local_cluster_lists_tasks_in_order_on_distinct_free_ports():
    configs = local_tf_configs(chief=True, workers=2, ps=1, evaluator=True, host="127.0.0.1")
    assert [c.task for c in configs] == ["chief:0", "worker:0", "worker:1", "ps:0",
                                         "evaluator:0"]
    cluster = configs[0].cluster
    assert list(cluster) == ["chief", "worker", "ps"]
    addresses = [a for task_addresses in cluster.values() for a in task_addresses]
    assert len(set(addresses)) == 4 and all(a.startswith("127.0.0.1:") for a in addresses)
    assert all(TFConfig.from_json(c.to_json()) == c for c in configs)


@pytest.mark.parametrize("counts, error, message", [
    ({"workers": 0}, ValueError, r"`workers` must be an int >= 1, got 0"),
    ({"ps": -1}, ValueError, r"`ps` must be an int >= 0, got -1"),
    ({"workers": 2.0}, TypeError, r"`workers` must be an int, got 2.0 of type float"),
    ({"chief": 1}, TypeError, r"`chief` must be a bool, got 1"),
    ({"evaluator": "yes"}, TypeError, r"`evaluator` must be a bool, got 'yes'"),
])
def test_bad_task_counts_name_the_argument(counts, error, message):
    with pytest.raises(error, match=message):
        local_tf_configs(**counts)


@pytest.mark.parametrize("value, message", [
    ([], r"TF_CONFIG must be a JSON object, got \[\]"),
    ({"cluster": {}, "task": {"type": "worker", "index": 0}},
     r'TF_CONFIG\["cluster"\] must map task types to address lists, got \{\}'),
    ({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0},
      "environment": 3}, r'TF_CONFIG\["environment"\] must be a string, got 3'),
    ({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": True}},
     r'index"\] must be an int >= 0, got True'),
])
def test_more_bad_tf_configs_name_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        TFConfig.from_dict(value)


def test_rpc_layer_is_accepted_and_an_evaluator_needs_no_cluster_entry():
    value = {"cluster": {"worker": ["h:1"]}, "task": {"type": "evaluator", "index": 0},
             "rpc_layer": "grpc"}
    config = TFConfig.from_dict(value)
    assert config.task == "evaluator:0" and config.environment == "cloud"
    assert read_tf_config({"TF_CONFIG": json.dumps(value), "OTHER": "x"}) == config
