"""ParallelConfig validation and serialisation; bad strategy input."""

import json
import subprocess

import pytest

import tfdist
from helpers import TFDIST, devices


def test_json_and_dict_round_trip():
    config = tfdist.ParallelConfig(data=4, microbatches=2, precision="mixed_bfloat16",
                                   xla=True, schedule="1f1b")
    assert tfdist.ParallelConfig.from_json(config.to_json()) == config
    assert tfdist.ParallelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert tfdist.ParallelConfig.from_json(tfdist.ParallelConfig().to_json()).data is None


@pytest.mark.parametrize(
    "fields, error, pattern",
    [
        ({"data": 0}, ValueError, r"`data` must be an int >= 1, got 0"),
        ({"pipeline": -2}, ValueError, r"`pipeline` must be an int >= 1, got -2"),
        ({"tensor": 0}, ValueError, r"`tensor` must be an int >= 1"),
        ({"microbatches": 0}, ValueError, r"`microbatches` must be an int >= 1, got 0"),
        ({"zero": 3, "data": 2, "pipeline": 2}, ValueError,
         r"`zero=3` with `pipeline=2` needs `remat=True`: each stage's parameters are "
         r"gathered for its forward and again for its backward"),
        ({"zero": 3, "data": 2, "pipeline": 2, "remat": True, "zero3_unit_params": 10},
         ValueError, r"`zero3_unit_params=10` sizes units, but with `pipeline=2` zero=3 "
         r"gathers each stage's parameters as one unit"),
        ({"zero": 3, "data": 2, "tensor": 2, "pipeline": 2, "remat": True},
         NotImplementedError,
         r"`zero=3` with pipeline=2 and tensor=2 is not supported in this version: zero=3 "
         r"runs on data parallelism with pipeline stages or tensor groups"),
        ({"zero": 3, "data": 2, "tensor": 2, "xla": True}, NotImplementedError,
         r"`zero=3` with tensor=2 and xla=True is not supported"),
        ({"zero": 4}, ValueError, r"`zero` must be one of \(0, 1, 2, 3\).*got 4"),
        ({"zero": 2, "data": 2, "zero3_unit_params": 1000}, ValueError,
         r"`zero3_unit_params=1000` sizes the units `zero=3` gathers, but `zero=2`"),
        ({"zero": 3, "data": 2, "zero3_unit_params": -1}, ValueError,
         r"`zero3_unit_params` must be an int >= 0, got -1"),
        ({"zero": 3, "data": 2, "zero3_unit_params": 1.5}, TypeError,
         r"`zero3_unit_params` must be an int, got 1.5"),
        ({"zero": -1}, ValueError, r"`zero` must be one of"),
        ({"precision": "float16"}, ValueError,
         r"`precision` must be one of \('float32', 'mixed_float16', 'mixed_bfloat16'\), "
         r"got 'float16'"),
        ({"schedule": "zero-bubble"}, ValueError,
         r"`schedule` must be one of \('gpipe', '1f1b', 'zb1', 'interleaved', 'zbv'\), "
         r"got 'zero-bubble'"),
        ({"virtual_stages": 0}, ValueError, r"`virtual_stages` must be an int >= 1, got 0"),
        ({"virtual_stages": 2.0}, TypeError, r"`virtual_stages` must be an int, got 2.0"),
        ({"pipeline": 2, "microbatches": 2, "schedule": "interleaved"}, ValueError,
         r"`virtual_stages` must be >= 2 with schedule='interleaved', 2 with schedule='zbv' "
         r"\(two stages per device, in a V\) and 1 with the other schedules, got "
         r"virtual_stages=1 with schedule='interleaved'"),
        ({"pipeline": 2, "microbatches": 2, "schedule": "zbv", "virtual_stages": 3}, ValueError,
         r"2 with schedule='zbv' .*got virtual_stages=3 with schedule='zbv'"),
        ({"microbatches": 2, "schedule": "zbv", "virtual_stages": 2}, ValueError,
         r"schedule='zbv' places several stages on each pipeline device: it needs "
         r"pipeline >= 2"),
        ({"pipeline": 2, "virtual_stages": 2}, ValueError,
         r"got virtual_stages=2 with schedule='gpipe'"),
        ({"pipeline": 2, "microbatches": 3, "schedule": "interleaved", "virtual_stages": 2},
         ValueError, r"`microbatches` a multiple of `pipeline`, got pipeline=2, microbatches=3"),
        ({"microbatches": 2, "schedule": "interleaved", "virtual_stages": 2}, ValueError,
         r"it needs pipeline >= 2"),
        ({"pipeline": 2, "microbatches": 2, "schedule": "interleaved", "virtual_stages": 2,
          "stage_boundaries": ["a"]}, ValueError,
         r"`stage_boundaries` must name 3 layer\(s\) for 4 stages"),
        ({"data": 2.0}, TypeError, r"`data` must be an int, got 2.0 of type float"),
        ({"microbatches": "4"}, TypeError, r"`microbatches` must be an int, got '4'"),
        ({"data": True}, TypeError, r"`data` must be an int, got True"),
        ({"xla": "yes"}, TypeError, r"`xla` must be a bool, got 'yes'"),
    ],
)
def test_every_field_rejects_bad_values(fields, error, pattern):
    with pytest.raises(error, match=pattern):
        tfdist.ParallelConfig(**fields)
    with pytest.raises(error, match=pattern):
        tfdist.ParallelConfig.from_dict(fields)
    with pytest.raises(error, match=pattern):
        tfdist.Strategy(devices=devices(2), **fields)


def test_unknown_fields_are_an_error():
    with pytest.raises(ValueError, match=r"Unknown ParallelConfig field\(s\) \['microbatch'\]"):
        tfdist.ParallelConfig.from_dict({"microbatch": 2})
    with pytest.raises(ValueError, match=r"\['microbatch'\]; valid fields are"):
        tfdist.Strategy(microbatch=2)


def test_mesh_product_must_equal_device_count():
    with pytest.raises(ValueError,
                       match=r"data=4 x pipeline=1 x tensor=1 needs 4 devices, but there are 2"):
        tfdist.Strategy(data=4, devices=devices(2))
    with pytest.raises(ValueError, match=r"needs 4 devices, but there are 8: .*omit `data`"):
        tfdist.Strategy(data=4)  # the 8 logical devices of the test process
    with pytest.raises(ValueError, match=r"groups of 3 devices, which do not divide the 8"):
        tfdist.ParallelConfig(pipeline=3).resolve(8)
    assert tfdist.ParallelConfig(pipeline=2, tensor=2).resolve(8).data == 2


def test_data_defaults_to_every_device():
    assert tfdist.Strategy().config.data == 8
    assert tfdist.Strategy(devices=devices(2)).num_replicas_in_sync == 2


def test_config_and_keywords_are_exclusive():
    with pytest.raises(ValueError, match="either `config=` or"):
        tfdist.Strategy(config=tfdist.ParallelConfig(data=2), data=2, devices=devices(2))
    strategy = tfdist.Strategy(config={"data": 2, "microbatches": 2}, devices=devices(2))
    assert strategy.config.microbatches == 2


def test_modes_of_later_versions_say_so():
    with pytest.raises(NotImplementedError, match=r"`zero=3` with xla=True"):
        tfdist.Strategy(devices=devices(2), zero=3, xla=True)
    # Refused before connecting to any other task.
    with pytest.raises(NotImplementedError, match=r"`pipeline=2` with `tensor=2` runs "
                                                  r"on one host"):
        tfdist.MultiWorkerStrategy(pipeline=2, tensor=2)
    with pytest.raises(NotImplementedError, match=r"`zero=3` with `pipeline=2` runs on one "
                                                  r"host.*MultiWorkerStrategy takes zero <= 2"):
        tfdist.MultiWorkerStrategy(pipeline=2, zero=3, remat=True)


def test_bad_devices_argument():
    with pytest.raises(ValueError, match="`devices` must be a non-empty list"):
        tfdist.Strategy(devices="/cpu:0")


def test_use_virtual_devices_after_initialisation_names_both_counts():
    tfdist.use_virtual_devices(8)  # same count as conftest: fine
    message = r"use_virtual_devices\(3\).*already initialised its devices with 8"
    with pytest.raises(RuntimeError, match=message):
        tfdist.use_virtual_devices(3)
    with pytest.raises(ValueError, match="`n` must be an int >= 1"):
        tfdist.use_virtual_devices(0)


def test_cli_validates_and_prints_a_config(tmp_path):
    run = [*TFDIST, "config", "--data=4", "--microbatches=2"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120, check=True)
    expected = tfdist.ParallelConfig(data=4, microbatches=2)
    assert tfdist.ParallelConfig.from_json(out.stdout) == expected
    bad = subprocess.run(run[:4] + ["--precision=fp8"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0
    assert ("--precision=fp8: value should be one of <float32|mixed_float16|mixed_bfloat16>"
            in bad.stderr)
    bad = subprocess.run(run[:4] + ["--microbatches=0"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2
    assert "`microbatches` must be an int >= 1, got 0" in bad.stderr


def test_config_from_environment(monkeypatch):
    monkeypatch.delenv("TFDIST_CONFIG", raising=False)
    assert tfdist.ParallelConfig.from_env() == tfdist.ParallelConfig()
    monkeypatch.setenv("TFDIST_CONFIG", '{"data": 2, "microbatches": 4}')
    assert tfdist.ParallelConfig.from_env() == tfdist.ParallelConfig(data=2, microbatches=4)
    monkeypatch.setenv("TFDIST_CONFIG", "{data: 2")
    with pytest.raises(ValueError, match=r"\$TFDIST_CONFIG is not valid JSON"):
        tfdist.ParallelConfig.from_env()
    monkeypatch.setenv("TFDIST_CONFIG", '{"zero": 5}')
    with pytest.raises(ValueError, match="`zero` must be one of"):
        tfdist.ParallelConfig.from_env()


def test_a_strategy_made_without_a_config_takes_the_jobs(monkeypatch):
    # `tfdist launch --compression=bf16 -- python train.py` whose script says
    # `tfdist.MultiWorkerStrategy()`: the launcher's flags hold.
    from tfdist.strategy import requested_config

    monkeypatch.setenv("TFDIST_CONFIG", '{"microbatches": 2, "compression": "bf16"}')
    assert requested_config(None, {}, "MultiWorkerStrategy") == tfdist.ParallelConfig(
        microbatches=2, compression="bf16")
    # Given fields or a config, the script's own.
    assert requested_config(None, {"zero": 1}, "Strategy") == tfdist.ParallelConfig(zero=1)
    monkeypatch.delenv("TFDIST_CONFIG")
    assert requested_config(None, {}, "Strategy") == tfdist.ParallelConfig()


def test_zero_needs_data_replicas_to_shard_over():
    with pytest.raises(ValueError, match=r"`zero=1` shards optimizer state .* but `data=1`"):
        tfdist.ParallelConfig(data=1, zero=1)
    assert tfdist.ParallelConfig(zero=2).data is None  # decided when resolved


def test_resolve_fills_only_data_and_is_stable():
    config = tfdist.ParallelConfig(pipeline=2, microbatches=4, zero=1, schedule="1f1b")
    resolved = config.resolve(8)
    assert resolved == config.replace(data=4)
    assert resolved.resolve(8) == resolved
    with pytest.raises(ValueError, match=r"needs 8 devices, but there are 4"):
        resolved.resolve(4)


def test_replace_validates_and_configs_are_frozen():
    config = tfdist.ParallelConfig(data=2)
    with pytest.raises(ValueError, match=r"`microbatches` must be an int >= 1, got 0"):
        config.replace(microbatches=0)
    with pytest.raises(AttributeError):
        config.data = 4
    assert {config: "hashable"}[tfdist.ParallelConfig(data=2)] == "hashable"
