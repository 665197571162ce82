"""TF_CONFIG: parsing, its refusals naming the field, and the clusters `tfdist launch` writes."""

import json

import pytest

from tfdist.cluster.tf_config import TFConfig, read_tf_config


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
