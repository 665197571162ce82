"""The predicted peak per device (`Strategy.describe(model, batch_size=...)`), no training."""

import dataclasses

import keras
import pytest

import tfdist
from tfdist.engine import modes
from tfdist.engine.modes import planned_peak
from tfdist.optim import zero3
from tfdist.sharding.peak import (
    ALL_REDUCE_COPIES,
    MICROBATCH_BYTES_PER_WEIGHT,
    PROGRAM_BYTES_PER_WEIGHT,
    REPLAY_BYTES_PER_FORWARD_OP,
    SHARDED_UPDATE_BYTES_PER_WEIGHT,
    STAGE_CALL_BYTES_PER_WEIGHT,
    TRACE_BYTES_PER_WEIGHT,
    UNIT_PROGRAM_BYTES,
    UNROLLED_MICROBATCH_BYTES,
    UNROLLED_MICROBATCH_BYTES_PER_WEIGHT,
    UNROLLED_MICROBATCH_DEVICE_BYTES_PER_WEIGHT,
    UNROLLED_REPLAY_BYTES_PER_FORWARD_OP,
    forward_ops,
    predict_peak,
    program_bytes,
    readable,
)

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
# Dense(64 -> 32) and Dense(32 -> 8): float32 kernels and biases.
FIRST, SECOND = 4 * (64 * 32 + 32), 4 * (32 * 8 + 8)
KERNEL = 4 * 64 * 32  # the largest weight


def _model(strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, "relu"),
                                  keras.layers.Dense(8)])
        model.compile(optimizer="adam", loss="mse")
        model.optimizer.build(model.trainable_variables)
    return model


def _activations(rows):
    return 4 * rows * (32 + 8)


def test_data_parallel_holds_everything_whole():
    strategy = tfdist.Strategy(devices=DEVICES)
    estimate = predict_peak(strategy.config, _model(strategy), batch_size=16)
    whole = FIRST + SECOND
    assert (estimate.parameters, estimate.gradients, estimate.optimizer_state,
            estimate.gathered) == (whole, 2 * whole, 2 * whole, 0)  # Adam: m and v
    assert estimate.activations == _activations(4)  # 16 rows over 4 replicas
    # freed by the backward as it makes the local gradients (more bytes)
    assert estimate.not_with_gradients == -_activations(4)
    assert estimate.total == whole * 5


@pytest.mark.parametrize("zero, bucket_bytes, microbatches, packed", [
    (0, 0, 1, FIRST + SECOND),  # every gradient in one packed buffer
    (0, 1024, 1, KERNEL),  # buckets of 1 KiB: one at a time, the largest gradient alone
    (1, 1024, 1, KERNEL),
    (0, 16384, 1, FIRST + SECOND),  # one bucket holds them all
    (0, 1024, 2, FIRST + SECOND),  # the microbatches' running sum, whole
])
def test_a_data_all_reduce_in_buckets_packs_one_bucket_at_a_time(
        zero, bucket_bytes, microbatches, packed):
    strategy = tfdist.Strategy(devices=DEVICES, zero=zero, bucket_bytes=bucket_bytes,
                               microbatches=microbatches)
    estimate = predict_peak(strategy.config, _model(strategy), batch_size=16)
    assert estimate.gradients == FIRST + SECOND + packed


@pytest.mark.parametrize("microbatches, copies", [(1, 1), (2, 2)])
def test_without_a_data_all_reduce_the_gradients_are_held_once_but_for_microbatches(
        microbatches, copies):
    # tensor=2 on 2 devices (data=1): no data all-reduce and its packed
    # buffer, only each device's own gradients; with microbatches their
    # running sum beside each microbatch's.
    strategy = tfdist.Strategy(devices=DEVICES[:2], tensor=2, microbatches=microbatches)
    estimate = predict_peak(strategy.config, _model(strategy), 16)
    assert estimate.gradients == copies * estimate.parameters


def test_the_strategys_prediction_adds_the_update_the_program_and_no_transport_in_one_process():
    strategy = tfdist.Strategy(devices=DEVICES)
    model = _model(strategy)
    estimate = strategy.predicted_peak(model, batch_size=16)
    # Adam's update of the largest weight: its two new moments
    assert estimate.update == 2 * KERNEL
    assert estimate.transport == 0
    # the program of a step computing the 4 weights (2 kernels, 2 biases),
    # its trace shared by the 4 devices of the process
    assert estimate.program == program_bytes(4, sharing=4)
    # logical CPU devices share the process's memory: 3 of the 4 have freed
    # their update's temporaries and local gradients when the one at its
    # peak meets them in the all-reduce (their activations they hold at once)
    freed = 2 * KERNEL + FIRST + SECOND
    assert estimate.not_at_once == -(3 * freed // 4)
    assert estimate.total == (predict_peak(strategy.config, model, 16).total + 2 * KERNEL
                              + estimate.program + estimate.not_at_once)
    assert planned_peak(strategy.config, model, 16).not_at_once == 0  # devices of their own


def _tied_lm(strategy, vocabulary=64, width=16):
    """Token ids -> a ReversibleEmbedding -> Dense -> its reverse: the logits."""
    with strategy.scope():
        ids = keras.Input((None,), dtype="int32")
        table = keras.layers.ReversibleEmbedding(vocabulary, width)
        hidden = keras.layers.Dense(width)(table(ids))
        model = keras.Model(ids, table(hidden, reverse=True))
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.optimizer.build(model.trainable_variables)
    return model


def test_a_tensor_group_holds_the_logits_it_gathers_from_vocabulary_shards_twice():
    # The gather's result stacked by rank, and the logits reordered from it
    # (the memory profile of keras-hub Qwen2 at tensor=8 shows both at the
    # peak); logits left sharded for the sharded loss are counted once.
    rows, length, vocabulary = 8, 5, 64
    gathered = tfdist.Strategy(devices=DEVICES[:2], tensor=2)
    sharded = tfdist.Strategy(devices=DEVICES[:2], tensor=2, vocab_parallel_classifier=True)
    twice = gathered.predicted_peak(_tied_lm(gathered), rows, length).activations
    once = sharded.predicted_peak(_tied_lm(sharded), rows, length).activations
    assert twice - once == 4 * rows * length * vocabulary


# zero=1: half its local gradients, packed for the all-reduce (measured);
# zero=2: none, its reduce-scatter reads them whole; zero=3: the largest
# unit's gradient and its piece
@pytest.mark.parametrize("zero, freed_gradients", [
    (1, (FIRST + SECOND) // 2), (2, 0), (3, 2 * FIRST)])
def test_devices_sharing_memory_do_not_hold_what_they_free_before_a_collective(
        zero, freed_gradients, monkeypatch):
    # (each weight gathered alone: zero=1's gather of its updated shards
    # holds less than its backward)
    monkeypatch.setattr(modes, "ALONE_BYTES", 1)
    strategy = tfdist.Strategy(devices=DEVICES, zero=zero)
    model = _model(strategy)
    shared = planned_peak(strategy.config, model, 16, shared_memory=True)
    own = planned_peak(strategy.config, model, 16)
    update = 2 * KERNEL // 4  # Adam's new moments of the largest weight's shard
    assert shared.update == own.update == update
    # (and half the activations each holds beyond its local gradients: zero=3's)
    held = shared.activations + shared.not_with_gradients
    assert (held > 0) if zero == 3 else (held == 0)
    assert shared.not_at_once == -(3 * (update + freed_gradients + held // 2) // 4)
    assert shared.total == own.total + shared.not_at_once
    # one device per process: nothing to share
    assert planned_peak(strategy.config, model, 16, processes=4, shared_memory=True
                        ).not_at_once == 0


def test_without_data_replicas_the_local_gradients_wait_for_the_update():
    strategy = tfdist.Strategy(devices=DEVICES, tensor=4)  # no data all-reduce packs them
    shared = planned_peak(strategy.config, _model(strategy), 16, shared_memory=True)
    assert shared.update > 0 and shared.activations > 0
    assert shared.not_at_once == -(3 * shared.update // 4)


def test_the_program_counts_the_weights_a_device_computes_and_who_shares_their_trace():
    one_process = tfdist.Strategy(devices=DEVICES)
    model = _model(one_process)
    shared = planned_peak(one_process.config, model, batch_size=16).program
    # 4 processes of one device each: nobody shares a device's trace
    alone = planned_peak(one_process.config, model, batch_size=16, processes=4).program
    assert alone == 4 * (PROGRAM_BYTES_PER_WEIGHT + TRACE_BYTES_PER_WEIGHT)
    assert shared == 4 * (PROGRAM_BYTES_PER_WEIGHT + TRACE_BYTES_PER_WEIGHT // 4) < alone
    # zero=1 and 2's sharded update of the 4 weights; zero=3's 2 units (a
    # Dense layer each) and the forward it replays, its trace shared by the 4
    replayed = forward_ops(model) * REPLAY_BYTES_PER_FORWARD_OP // 4
    for zero, extra in ((1, 4 * SHARDED_UPDATE_BYTES_PER_WEIGHT),
                        (2, 4 * SHARDED_UPDATE_BYTES_PER_WEIGHT),
                        (3, 2 * UNIT_PROGRAM_BYTES + replayed)):
        sharded = tfdist.Strategy(devices=DEVICES, zero=zero)
        assert (sharded.predicted_peak(_model(sharded), batch_size=16).program
                == shared + extra)
    # microbatches: more per weight for each past the first; zero=3's
    # program repeats its collectives, replays and backward for each, in the
    # trace the process's 4 devices share and, in part, on each device
    microbatches = tfdist.Strategy(devices=DEVICES, microbatches=4)
    estimate = microbatches.predicted_peak(_model(microbatches), batch_size=16)
    assert estimate.program == shared + 3 * 4 * MICROBATCH_BYTES_PER_WEIGHT
    microbatches = tfdist.Strategy(devices=DEVICES, microbatches=4, zero=3)
    estimate = microbatches.predicted_peak(_model(microbatches), batch_size=16)
    unrolled = UNROLLED_MICROBATCH_BYTES + 4 * UNROLLED_MICROBATCH_DEVICE_BYTES_PER_WEIGHT + (
        4 * UNROLLED_MICROBATCH_BYTES_PER_WEIGHT
        + forward_ops(model) * UNROLLED_REPLAY_BYTES_PER_FORWARD_OP) // 4
    assert estimate.program == shared + 2 * UNIT_PROGRAM_BYTES + replayed + 3 * unrolled
    assert (UNROLLED_MICROBATCH_BYTES_PER_WEIGHT + UNROLLED_MICROBATCH_DEVICE_BYTES_PER_WEIGHT
            > MICROBATCH_BYTES_PER_WEIGHT)
    # a pipeline stage: its own 2 weights, its trace shared by its 2 data
    # replicas, a call of its layers per microbatch
    stages = tfdist.Strategy(devices=DEVICES, pipeline=2, microbatches=2)
    estimate = stages.predicted_peak(_model(stages), batch_size=16)
    per_weight = (PROGRAM_BYTES_PER_WEIGHT + TRACE_BYTES_PER_WEIGHT // 2
                  + STAGE_CALL_BYTES_PER_WEIGHT)
    assert estimate.program == 2 * per_weight
    assert f"program {readable(estimate.program)}" in str(estimate)
    # with `remat` each stage replays its forward (the model's over 2
    # stages) for each microbatch's backward, in the trace its 2 replicas share
    stage_ops = forward_ops(model) // 2
    remat = tfdist.Strategy(devices=DEVICES, pipeline=2, microbatches=2, remat=True)
    estimate = remat.predicted_peak(_model(remat), batch_size=16)
    assert estimate.program == 2 * per_weight + (
        stage_ops * REPLAY_BYTES_PER_FORWARD_OP // 2
        + stage_ops * UNROLLED_REPLAY_BYTES_PER_FORWARD_OP // 2)
    # under zero=3 a stage is one unit, gathered whole (replayed by `remat`)
    stages = tfdist.Strategy(devices=DEVICES, pipeline=2, microbatches=2, zero=3, remat=True)
    estimate = stages.predicted_peak(_model(stages), batch_size=16)
    assert estimate.program == (
        2 * (PROGRAM_BYTES_PER_WEIGHT + TRACE_BYTES_PER_WEIGHT // 2) + UNROLLED_MICROBATCH_BYTES
        + 2 * UNROLLED_MICROBATCH_DEVICE_BYTES_PER_WEIGHT
        + (2 * UNROLLED_MICROBATCH_BYTES_PER_WEIGHT
           + stage_ops * UNROLLED_REPLAY_BYTES_PER_FORWARD_OP) // 2
        + UNIT_PROGRAM_BYTES + stage_ops * REPLAY_BYTES_PER_FORWARD_OP // 2)


def test_forward_ops_counts_a_functional_models_forward_in_training():
    def dense(*activations):
        return keras.Sequential([keras.Input((8,))]
                                + [keras.layers.Dense(4, a) for a in activations])

    assert 0 < forward_ops(dense(None)) < forward_ops(dense("relu")) < forward_ops(
        dense("relu", None))
    # dropout runs only in training: its ops are counted
    assert forward_ops(keras.Sequential([keras.Input((8,)), keras.layers.Dropout(0.5)])) > 1

    class Subclassed(keras.Model):
        def call(self, x):
            return x

    assert forward_ops(Subclassed()) == 0  # no graph before it runs


@pytest.mark.parametrize("zero, bucket_bytes, collective, copies", [
    # every gradient in one packed all-reduce: 4 copies of each ring message
    (0, 0, FIRST + SECOND, ALL_REDUCE_COPIES),
    (1, 0, FIRST + SECOND, ALL_REDUCE_COPIES),
    (0, 1024, KERNEL, ALL_REDUCE_COPIES),  # buckets of 1 KiB: the largest gradient alone
    (0, 16384, FIRST + SECOND, ALL_REDUCE_COPIES),  # one bucket holds them all
    # every weight under ALONE_BYTES: reduce-scattered (and gathered) packed,
    # a shard received from each of the 3 other replicas
    (2, 0, FIRST + SECOND, 3),
    # zero=3 gathers each unit (a Dense layer) on its own: the larger one's
    (3, 0, FIRST, 3),
])
def test_transport_copies_the_largest_data_collective_between_processes(
        zero, bucket_bytes, collective, copies):
    strategy = tfdist.Strategy(devices=DEVICES, zero=zero, bucket_bytes=bucket_bytes)
    model = _model(strategy)
    # The same config with its 4 replicas in 4 processes (as a multi-worker
    # job's, whose strategy counts its tasks): messages of a quarter of the
    # collective.
    estimate = planned_peak(strategy.config, model, batch_size=16, processes=4)
    assert estimate.transport == copies * -(-collective // 4)
    assert estimate.update == 2 * (KERNEL // 4 if zero else KERNEL)
    assert planned_peak(strategy.config, model, batch_size=16).transport == 0


def test_a_pipeline_replica_reduces_one_gradient_and_one_stage_at_a_time():
    # A replica's gradients are on its stages' devices, and tf.distribute's
    # batch reduce packs only one device's values: each gradient is
    # all-reduced on its own (tests/parity/test_pipeline.py), so the buffer
    # and the copies between processes are the largest gradient's.
    strategy = tfdist.Strategy(devices=DEVICES, data=2, pipeline=2, microbatches=2)
    model = _model(strategy)
    estimate = planned_peak(strategy.config, model, batch_size=16, processes=2)
    assert estimate.transport == ALL_REDUCE_COPIES * KERNEL // 2
    # A process's 2 stages share its memory and are not in step: one at a
    # time holds what it keeps beside its local gradients (the running sum
    # of the microbatches) and the copies, and half its activations.
    shared = planned_peak(strategy.config, model, batch_size=16, processes=2,
                          shared_memory=True)
    beside = shared.gradients - shared.parameters
    assert beside == shared.parameters > 0
    assert shared.not_with_gradients == 0 and shared.activations > 0
    assert shared.not_at_once == -(
        (shared.update + beside + shared.transport + shared.activations // 2) // 2)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_and_2_shard_the_slots(zero):
    strategy = tfdist.Strategy(devices=DEVICES, zero=zero)
    estimate = predict_peak(strategy.config, _model(strategy), batch_size=16)
    whole = FIRST + SECOND
    # (the parameter shard buffers are slices of the parameters until the update)
    assert estimate.optimizer_state == 2 * whole // 4
    assert estimate.parameters == whole
    # the local gradients and zero=1's packed all-reduce buffer, or zero=2's
    # all-to-all of them (received whole: under PIECE_BYTES) and reduced shards
    assert estimate.gradients == (2 * whole if zero == 1 else 2 * whole + whole // 4)


def test_zero_1_and_2_peak_at_the_gather_of_their_shards_when_it_holds_more(monkeypatch):
    strategy = tfdist.Strategy(devices=DEVICES, zero=2)
    model = _model(strategy)
    whole, shards = FIRST + SECOND, FIRST // 4 + SECOND // 4
    # Reduce-scattered whole, the backward holds more than the gather.
    backward = planned_peak(strategy.config, model, batch_size=16, processes=4)
    assert backward.gathered == 0 and backward.gradients == 2 * whole + whole // 4
    # In pieces of 256 bytes, less: the peak is the gather's, of both weights
    # packed (its result and the weights split from it), beside the written
    # shard buffers and the shards received from the 3 other processes.
    monkeypatch.setattr(zero3, "PIECE_BYTES", 256)
    gather = planned_peak(strategy.config, model, batch_size=16, processes=4)
    assert (gather.gradients, gather.activations, gather.update) == (0, 0, 0)
    assert gather.gathered == 2 * whole
    assert gather.optimizer_state == 2 * whole // 4 + shards
    assert gather.transport == 3 * shards
    assert gather.total > dataclasses.replace(backward, gradients=whole + 256 + whole // 4).total


def test_zero3_keeps_shards_and_gathers_the_two_largest_units():
    strategy = tfdist.Strategy(devices=DEVICES, zero=3)
    estimate = predict_peak(strategy.config, _model(strategy), batch_size=16)
    shard = (FIRST + SECOND) // 4
    assert estimate.parameters == shard
    assert estimate.optimizer_state == 2 * shard
    assert estimate.gathered == FIRST + SECOND
    # the largest unit's, its packed copy and its reduced shard (each unit's
    # update uses its shards as they come; with loss scaling, all shards wait)
    assert estimate.gradients == FIRST // 4 + 2 * FIRST
    # with microbatches every unit's reduced shard is a running sum until
    # the last microbatch's reduce-scatter
    strategy = tfdist.Strategy(devices=DEVICES, zero=3, microbatches=2)
    estimate = predict_peak(strategy.config, _model(strategy), batch_size=16)
    assert estimate.gradients == shard + 2 * FIRST


def test_describe_ends_with_the_prediction_given_a_batch_size():
    strategy = tfdist.Strategy(devices=DEVICES, tensor=2)
    model = _model(strategy)
    assert "predicted peak" not in strategy.describe(model)
    line = strategy.describe(model, batch_size=16).splitlines()[-1]
    assert line.startswith("predicted peak per device ")
    # The first Dense is split by columns, the second by rows: halves of both
    # kernels, the split first bias, the whole second bias.
    assert line == str(strategy.predicted_peak(model, batch_size=16))
    # The first Dense is split by columns, the second by rows: halves of both
    # kernels and of the first bias, the whole second bias.
    estimate = strategy.predicted_peak(model, batch_size=16)
    assert estimate.parameters == 4 * (64 * 16 + 16 + 16 * 8) + 4 * 8
