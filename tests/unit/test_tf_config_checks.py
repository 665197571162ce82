"""Strategies check TF_CONFIG before connecting: no silent one-replica runs."""

import pytest

import tfdist
from tfdist.cluster.rendezvous import wait_for_peers

TASK = '"task": {"type": "worker", "index": 0}'


@pytest.mark.parametrize("value, message", [
    ("{" + TASK + "}", r'TF_CONFIG\["cluster"\] must map task types to address lists, '
                       r"got None"),
    ('{"cluster": {"worker": ["127.0.0.1:1"]}', "TF_CONFIG is not valid JSON"),
])
@pytest.mark.parametrize("strategy", [tfdist.MultiWorkerStrategy,
                                      tfdist.ParameterServerStrategy])
def test_strategies_refuse_a_bad_tf_config(monkeypatch, strategy, value, message):
    monkeypatch.setenv("TF_CONFIG", value)
    with pytest.raises(ValueError, match=message):
        strategy()


def test_a_task_alone_has_no_peer_to_wait_for():
    assert wait_for_peers(1, environ={}) is None
    config = wait_for_peers(1, environ={"TF_CONFIG": '{"cluster": {"worker": '
                                                     '["127.0.0.1:1"]}, ' + TASK + '}'})
    assert config.task == "worker:0"
