"""Pipeline stages whose layers are split over tensor groups: data x pipeline x
tensor on 8 devices, parity with one device, where every shard lives, and
composition with the class-split classifier and sharded optimizer state."""

import collections

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from helpers import assert_parity, devices, executed_op_counts, train, trained_reference
from test_pipeline import two_block_lm
from test_tensor_transformer import lm_data
from tfdist.sharding.storage import axis_layout


@pytest.fixture(scope="module")
def reference():
    x, y = lm_data()
    return trained_reference(make=two_block_lm, x=x, y=y, batch_size=16)


def _short(device):
    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type}:{spec.device_index}"


def _strategy(data_size=2, **fields):
    return tfdist.Strategy(data=data_size, pipeline=2, tensor=2, microbatches=2,
                           devices=devices(4 * data_size), **fields)


@pytest.fixture(scope="module")
def one_f_one_b():
    """The two-block LM trained on 8 devices (data 2 x pipeline 2 x tensor 2,
    1F1B): (strategy, (losses, weights, model)), shared by the checks below."""
    x, y = lm_data()
    strategy = _strategy(schedule="1f1b")
    return strategy, train(strategy, make=two_block_lm, x=x, y=y, batch_size=16)


def test_two_block_lm_on_8_devices_matches_one_device(reference, one_f_one_b):
    strategy, result = one_f_one_b
    # Sums over tensor groups and data groups in another order: 1e-4 holds.
    assert_parity(result, reference)
    lines = strategy.describe(result[2]).splitlines()
    assert lines[0].startswith("stage 0  [CPU:0, CPU:2, CPU:4, CPU:6]")
    assert lines[1].startswith("stage 1  [CPU:1, CPU:3, CPU:5, CPU:7]")
    assert [line.split()[2] for line in lines[2:] if line.split()[1] ==
            "MultiHeadAttention"] == ["heads", "heads"]


def test_each_shard_lives_on_its_stage_and_rank(one_f_one_b):
    strategy, (_, _, model) = one_f_one_b
    step = strategy.train_step(model)
    groups = strategy.pipeline_devices  # groups[replica][stage]
    per_device, expected = {}, {}
    for stage in step.compute.pipeline.stages:
        on_stage = [group[stage.index] for group in groups]
        for variable in stage.variables:
            components = variable.value.values
            assert [_short(c.device) for c in components] == [
                _short(d) for d in on_stage], variable.path
            split = axis_layout(variable)
            full = variable.numpy()
            for replica, component in enumerate(components):
                part = full if split is None else np.split(
                    full, 2, axis=split.axis)[replica % 2]
                np.testing.assert_array_equal(component.numpy(), part)
                where = _short(component.device)
                per_device[where] = per_device.get(where, 0) + component.numpy().nbytes
            # Bytes on each of the stage's devices: 1/t of a split weight.
            for device in map(_short, on_stage):
                expected[device] = expected.get(device, 0) + full.nbytes // (
                    1 if split is None else 2)
    assert per_device == expected and len(per_device) == 8


def test_each_stage_all_reduces_megatrons_count_on_its_own_devices(one_f_one_b):
    strategy, (_, _, model) = one_f_one_b
    counts = collections.Counter()  # (op, device index) of each op the step runs
    for (op, device), count in executed_op_counts(model, by_device=True).items():
        if op.startswith("Collective"):
            counts[op, _short(device)] += count
    microbatches = 2
    for replica in strategy.pipeline_devices:
        first, second = map(_short, replica)
        # Stage 0 (embedding, block 1) per microbatch: the embedding's "g" and
        # the block's 2 forward + 2 backward all-reduces; once per step, the
        # data group's packed all-reduce of the gradients (every stage's meet
        # on the replica's device) and metric states, and the batch's row
        # count's. Stage 1 (block 2, head): the block's 4.
        assert counts["CollectiveReduceV2", first] == microbatches * (1 + 4) + 1 + 1
        assert counts["CollectiveReduceV2", second] == microbatches * 4
        # On stage 0: the tensor group's batch exchange (x and y together; the
        # trace counts the slices' rows, so no rank's row count is exchanged),
        # and the data group's gather of the token embedding's sparse
        # gradient, which is gathered, not summed: its values and indices, as
        # they are (the exchanged batch's rows are known to the trace).
        assert counts["CollectiveGatherV2", first] == 1 + 2
        assert counts["CollectiveGatherV2", second] == 0
    assert sum(counts.values()) == 4 * (12 + 8 + 3)  # nothing anywhere else


def test_class_split_classifier_in_the_last_stage_matches_one_device(reference):
    x, y = lm_data()
    strategy = _strategy(data_size=1, schedule="1f1b", vocab_parallel_classifier=True)
    result = train(strategy, make=two_block_lm, x=x, y=y, batch_size=16)
    assert_parity(result, reference)
    head = result[2].layers[-1]
    assert [c.shape for c in head.kernel.value.values] == [(head.kernel.shape[0],
                                                            head.units // 2)] * 2


def test_remat_and_sharded_optimizer_state_match_one_device(reference):
    # GPipe with remat (each stage's replayed forward issues its tensor
    # all-reduces again) and zero=1 over each stage's data group.
    x, y = lm_data()
    strategy = _strategy(schedule="gpipe", remat=True, zero=1)
    result = train(strategy, make=two_block_lm, x=x, y=y, batch_size=16)
    assert_parity(result, reference)
    optimizer = result[2].optimizer
    for variable, slot in zip(optimizer._trainable_variables, optimizer.momentums):
        # Each replica's shard sits where that replica's copy of the weight is.
        assert [c.device for c in slot.value.values] == [
            c.device for c in variable.value.values], slot.path
