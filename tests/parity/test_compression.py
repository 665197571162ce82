"""`compression`: the gradient collective in bf16 / fp16, gathered as int8
blocks or as each replica's Top-K with error feedback, against the
uncompressed run."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from helpers import (
    CLASSES,
    FEATURES,
    data,
    devices,
    executed_op_counts,
    make_model,
    step_ops,
    traced_train_function,
    train,
)
from test_tensor_transformer import SEQ, VOCAB, lm_data, make_lm
from test_zero import _step_graph
from tfdist.checkpoint import ShardedCheckpoint
from tfdist.engine.compression import TopKCompression
from tfdist.engine.reduce import AllReduce
from tfdist.sharding.replica_state import state_of

CONFIGS = {"data": dict(data=4), "zero2": dict(data=4, zero=2),
           "tensor": dict(data=2, tensor=2)}
# Where the gathered compressions (int8, Top-K) apply: data, zero=1 x microbatches.
GATHERED = [dict(data=4), dict(data=4, zero=1, microbatches=2)]


def reduce_collectives(model):
    """Replica 0's collectives of the step's reduce part (the gradients and
    the metric states summed with them)."""
    return [op for op in step_ops(_step_graph(model), "CPU:0", scope="tfdist/reduce/")
            if op.type.startswith("Collective")]


def sent_bytes(collectives):
    """Bytes of the collectives' first inputs (what each device contributes)."""
    return sum(op.inputs[0].shape.num_elements() * op.inputs[0].dtype.size
               for op in collectives)


def wire_bytes(model):
    """Bytes replica 0 sends into the reduce part's collectives in one
    traced step."""
    return sent_bytes(reduce_collectives(model))


def replica_state_bytes(model):
    """Bytes of the step's replica state each replica holds (its rows)."""
    return sum(v.shape[1:].num_elements() * v.dtype.size
               for v in state_of(model).variables.values())


def _run(config, compression, **fields):
    x, y = data(256)
    strategy = tfdist.Strategy(devices=devices(4), compression=compression, **config, **fields)
    return train(strategy, x=x, y=y)


@pytest.fixture(scope="module")
def uncompressed():
    return {name: _run(config, "none") for name, config in CONFIGS.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("compression, dtype", [("bf16", "bfloat16"), ("fp16", "float16")])
def test_cast_compression_sends_half_the_bytes_and_trains_as_uncompressed(
        name, compression, dtype, uncompressed):
    losses, weights, model = _run(CONFIGS[name], compression)
    plain_losses, plain_weights, plain = uncompressed[name]
    # The gradient collective (the all-reduce, or ZeRO's reduce-scatter)
    # carries the cast gradients (ZeRO's bfloat16 ones packed in pairs into
    # float32, as its gathers need); the metric states stay float32.
    assert wire_bytes(model) <= 0.51 * wire_bytes(plain), (wire_bytes(model),
                                                          wire_bytes(plain))
    packed = name == "zero2" and dtype == "bfloat16"
    assert {op.inputs[0].dtype.name for op in reduce_collectives(model)} == (
        {"float32"} if packed else {dtype, "float32"})
    assert {op.inputs[0].dtype.name for op in reduce_collectives(plain)} == {"float32"}
    # Rounding each gradient to 8 (bf16) or 11 (fp16) bits of mantissa moves
    # the run only slightly: the same losses to 1% over the epoch.
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-2)
    for ours_w, theirs_w in zip(weights, plain_weights):
        np.testing.assert_allclose(ours_w, theirs_w, atol=2e-2)
    assert all(w.dtype == tf.float32 for w in model.trainable_weights)


def _lm(seed=0):
    model = make_lm(seed)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=model.loss)
    return model


def gathered_dtypes(model):
    """The dtypes of every all-gather the traced step runs (tf.distribute
    gathers a sparse gradient's slices inside functions of its own)."""
    (concrete,) = traced_train_function(model)._list_all_concrete_functions()
    graph_def = concrete.graph.as_graph_def()
    nodes = [n for f in graph_def.library.function for n in f.node_def] + list(graph_def.node)
    return {tf.as_dtype(n.attr["T"].type).name for n in nodes if n.op == "CollectiveGatherV2"}


def _lm_run(zero, compression, **fields):
    x, y = lm_data(64)
    strategy = tfdist.Strategy(data=4, zero=zero, compression=compression, devices=devices(4),
                               **fields)
    return train(strategy, make=_lm, x=x, y=y, batch_size=16)


@pytest.fixture(scope="module")
def uncompressed_lm():
    return {zero: _lm_run(zero, "none") for zero in (0, 2)}


@pytest.mark.parametrize("zero", [0, 2])
@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_sparse_embedding_gradients_are_gathered_compressed(zero, compression,
                                                           uncompressed_lm):
    # An Embedding's gradient is slices of rows, gathered (not summed):
    # float16 values as they are, bfloat16 ones packed two to a float32 (no
    # bfloat16 gather on CPU), under ZeRO too (it keeps each replica's rows).
    losses, weights, model = _lm_run(zero, compression)
    plain_losses, plain_weights, plain = uncompressed_lm[zero]
    if compression == "fp16":
        assert gathered_dtypes(model) - gathered_dtypes(plain) == {"float16"}
    else:
        assert executed_op_counts(model)["Bitcast"] >= 2 * 4  # packed, unpacked per replica
        assert gathered_dtypes(model) == gathered_dtypes(plain)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-2)
    for ours, theirs in zip(weights, plain_weights):
        np.testing.assert_allclose(ours, theirs, atol=1e-2)


@pytest.mark.parametrize("name", ["data", "tensor"])
def test_bucket_bytes_sends_the_gradients_in_buckets_of_at_most_that_size(name, uncompressed):
    losses, weights, model = _run(CONFIGS[name], "none", bucket_bytes=2048)
    plain_losses, plain_weights, plain = uncompressed[name]
    sent = [op.inputs[0].shape.num_elements() * 4 for op in reduce_collectives(model)]
    # The MLP's gradients, in order: 16 x 32 (2,048 B), 32, 32 x 32 (4,096 B),
    # 32, 32 x 4, 4, then the metric states: buckets of at most 2,048 B but
    # the 32 x 32 kernel's alone (under tensor=2 each rank's slices are
    # smaller, so fewer buckets); one collective each, where unbucketed
    # every gradient goes in one.
    assert len(reduce_collectives(plain)) == 1
    if name == "data":
        assert sent == [2048, 128, 4096, 128 + 512 + 16 + 16], sent  # (4 metric states)
    else:
        assert len(sent) > 1 and all(size <= 2048 for size in sent), sent
    # The same sums: the same training.
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    for ours, theirs in zip(weights, plain_weights):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("config", GATHERED, ids=["data", "zero1"])
def test_topk_sends_its_fraction_of_the_bytes_and_trains_close_to_uncompressed(
        config, uncompressed):
    losses, weights, model = _run(config, "topk:0.01")
    plain_losses, _, plain = uncompressed["data"]
    # Per replica: 1% of each gradient's elements (at least one) as float32
    # values and int32 indices, in two all-gathers; the metric states in an
    # all-reduce of their own.
    assert wire_bytes(model) <= 0.03 * wire_bytes(plain), (wire_bytes(model), wire_bytes(plain))
    assert {op.type for op in reduce_collectives(model)} == {"CollectiveGatherV2",
                                                             "CollectiveReduceV2"}
    # The step's residuals: each replica's own, on its device, not all zero.
    residuals = state_of(model).variables
    assert len(residuals) == len(model.trainable_weights)
    for variable, weight in zip(residuals.values(), model.trainable_weights):
        assert [tf.DeviceSpec.from_string(c.device).device_index
                for c in variable.values] == [0, 1, 2, 3]
        assert variable.shape == (4, *weight.shape)
    assert any(np.abs(v.numpy()).sum() > 0 for v in residuals.values())
    # describe's peak counts them (every weight's size, on each replica).
    predicted = model.distribute_strategy.predicted_peak(model, batch_size=32)
    assert predicted.replica_state == replica_state_bytes(model) == sum(
        4 * w.shape.num_elements() for w in model.trainable_weights)
    # 8 steps sending 1% of the gradient: the loss still falls, within 5% of
    # the uncompressed run's.
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses[-1], plain_losses[-1], rtol=5e-2)


@pytest.mark.parametrize("compression", ["topk:0.01", "powersgd:4"])
def test_compression_warmup_sums_uncompressed_then_compresses(compression, uncompressed):
    losses, _, model = _run(dict(data=4), compression, compression_warmup=4)
    plain_losses = uncompressed["data"][0]
    # Four steps summed whole: the uncompressed run's losses up to the
    # fifth step's (computed after four updates); then the compression, its
    # residuals filling, and the runs part.
    np.testing.assert_allclose(losses[:5], plain_losses[:5], rtol=1e-6)
    assert not np.allclose(losses[5:], plain_losses[5:], rtol=1e-6)
    assert any(np.abs(v.numpy()).sum() > 0 for name, v in state_of(model).variables.items()
               if "residual" in name)


@pytest.mark.parametrize("compression", ["topk:0.01", "powersgd:4"])
def test_compression_warmup_hands_adam_an_embeddings_slices_as_uncompressed(
        compression, uncompressed_lm):
    # Keras's Adam squares an Embedding's slices one by one: the warm-up's
    # whole sum keeps them slices, so the LM's steps are the uncompressed
    # ones (made dense, the second moment of a repeated token's row would
    # differ from the first step on).
    losses, weights, _ = _lm_run(0, compression, compression_warmup=1000)
    plain_losses, plain_weights, _ = uncompressed_lm[0]
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    for ours, theirs in zip(weights, plain_weights):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)


@pytest.mark.parametrize("config", GATHERED, ids=["data", "zero1"])
def test_int8_sends_a_quarter_of_the_bytes_and_trains_as_uncompressed(
        config, uncompressed):
    losses, weights, model = _run(config, "int8")
    plain_losses, plain_weights, plain = uncompressed["data"]
    # int8 values packed four to an int32, and a float32 scale per block of
    # 256: a quarter of the bytes and 1/64 more.
    assert wire_bytes(model) <= 0.27 * wire_bytes(plain), (wire_bytes(model), wire_bytes(plain))
    gathers = [op for op in reduce_collectives(model) if op.type == "CollectiveGatherV2"]
    assert sorted(op.inputs[0].dtype.name for op in gathers) == ["float32", "int32"]
    # Rounding each gradient to 255 levels of its block's largest magnitude
    # moves the run only slightly: the same losses to 1%.
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-2)
    for ours, theirs in zip(weights, plain_weights):
        np.testing.assert_allclose(ours, theirs, atol=2e-2)


def test_powersgd_sends_rank_r_factors_of_each_matrix_and_trains_as_uncompressed(uncompressed):
    losses, weights, model = _run(dict(data=4), "powersgd:4")
    plain_losses, _, plain = uncompressed["data"]
    # Each matrix gradient (n x m) crosses as P (n x 4) and Q (m x 4), each in
    # a packed all-reduce of its own; what would not shrink (the 32 x 4
    # classifier: 4 x 36 >= 128) and the vectors go as they are.
    factors = [(w.shape[0], w.shape.num_elements() // w.shape[0])
               for w in model.trainable_weights if len(w.shape) == 2]
    shrunk = [(n, m) for n, m in factors if 4 * (n + m) < n * m]
    assert shrunk == [(16, 32), (32, 32)]
    saved = sum(4 * (n * m - 4 * (n + m)) for n, m in shrunk)
    assert wire_bytes(model) == wire_bytes(plain) - saved
    assert len(reduce_collectives(model)) == 3  # P's, Q's, the rest
    # The residuals and the Q's: each replica's, saved like the weights.
    names = sorted(state_of(model).variables)
    assert names == ["powersgd_q/0", "powersgd_q/2", "powersgd_residual/0",
                     "powersgd_residual/2"]
    predicted = model.distribute_strategy.predicted_peak(model, batch_size=32)
    assert predicted.replica_state == replica_state_bytes(model) == sum(
        4 * (n * m + 4 * m) for n, m in shrunk)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-2)


def _wide_mlp():
    """An MLP whose shards are many int8 blocks (256 elements) long."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(256, activation="tanh"),
                              keras.layers.Dense(CLASSES)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _zero_run(zero, compression):
    x, y = data(256)
    strategy = tfdist.Strategy(data=4, zero=zero, compression=compression, devices=devices(4))
    return train(strategy, make=_wide_mlp, x=x, y=y)


@pytest.fixture(scope="module")
def uncompressed_zero():
    return {zero: _zero_run(zero, "none") for zero in (2, 3)}


def zero_wire_bytes(model):
    """Bytes replica 0 sends per step into ZeRO's reduce-scatters (their
    all-to-alls) and zero=3's gathers of each unit's parameters (not
    zero=2's gather of the updated weights)."""
    return sent_bytes(op for op in step_ops(_step_graph(model), "CPU:0")
                      if op.type in ("CollectiveAllToAllV2", "CollectiveGatherV2")
                      and ("tfdist/reduce/" in op.name or re.search(r"(^|/)unit\d+/", op.name)))


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("compression, ratio, rtol", [("bf16", 0.51, 1e-2),
                                                      ("fp16", 0.51, 1e-2),
                                                      ("int8", 0.27, 2e-2)])
def test_zero_reduce_scatters_and_gathers_compressed(zero, compression, ratio, rtol,
                                                     uncompressed_zero):
    # ZeRO's reduce-scatter sends each replica its rows cast, or as int8
    # blocks (qgZ), summed in float32 where they arrive; zero=3's units
    # gather their parameters so too (qwZ), the shards kept exact.
    losses, weights, model = _zero_run(zero, compression)
    plain_losses, plain_weights, plain = uncompressed_zero[zero]
    assert 0 < zero_wire_bytes(model) <= ratio * zero_wire_bytes(plain), (
        zero_wire_bytes(model), zero_wire_bytes(plain))
    np.testing.assert_allclose(losses, plain_losses, rtol=rtol)
    for ours, theirs in zip(weights, plain_weights):
        np.testing.assert_allclose(ours, theirs, atol=2e-2)
    assert all(w.dtype == tf.float32 for w in model.trainable_weights)


def test_zero3_under_mixed_float16_gathers_float16_weights_as_they_are():
    # bf16 narrows float32 gradients; the float16 weights zero=3 gathers for
    # compute are no wider, so they travel, and are read, as they are.
    x, y = data(256)
    runs = {c: train(tfdist.Strategy(devices=devices(4), data=4, zero=3, compression=c,
                                     precision="mixed_float16"), x=x, y=y)
            for c in ("none", "bf16")}
    gathered = {op.inputs[0].dtype.name for op in step_ops(_step_graph(runs["bf16"][2]))
                if op.type == "CollectiveGatherV2" and "/gather/" in op.name}
    assert gathered == {"float16"}, gathered
    np.testing.assert_allclose(runs["bf16"][0], runs["none"][0], rtol=1e-2)


def _pipeline_zero3_run(compression):
    x, y = data(256)
    strategy = tfdist.Strategy(devices=devices(4), data=2, pipeline=2, zero=3, remat=True,
                               microbatches=2, compression=compression)
    return train(strategy, x=x, y=y)


@pytest.fixture(scope="module")
def uncompressed_pipeline_zero3():
    return _pipeline_zero3_run("none")


def stage_bytes(model):
    """Bytes replica 0's pipeline stages send per step into their gathers
    and reduce-scatters."""
    return sent_bytes(op for op in _step_graph(model).get_operations()
                      if op.type in ("CollectiveAllToAllV2", "CollectiveGatherV2")
                      and op.name.startswith("tfdist/stage"))


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_pipeline_stages_gather_and_reduce_scatter_compressed_at_zero3(
        compression, uncompressed_pipeline_zero3):
    # data 2 x pipeline 2 at zero=3: each stage gathers its parameters and
    # reduce-scatters its gradients over its own data group, through the wire.
    losses, weights, model = _pipeline_zero3_run(compression)
    plain_losses, plain_weights, plain = uncompressed_pipeline_zero3
    assert 0 < stage_bytes(model) <= 0.51 * stage_bytes(plain), (stage_bytes(model),
                                                                  stage_bytes(plain))
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-2)
    for ours, theirs in zip(weights, plain_weights):
        np.testing.assert_allclose(ours, theirs, atol=2e-2)


def _fit_compressed(strategy, epochs, error_feedback=True, initial_epoch=0, restore=None,
                    optimizer=None):
    """The helpers' MLP (compiled with `optimizer()` if given) trained for
    `epochs` under `strategy` (without `error_feedback`, Top-K 1% dropping
    what it does not send); restored first from `restore` (a directory)."""
    x, y = data(640)
    with strategy.scope():
        model = make_model(optimizer=optimizer and optimizer())
    if restore is not None:
        ShardedCheckpoint(model, restore).restore()
    if not error_feedback:
        step = strategy.train_step(model)
        step.build((tf.TensorSpec((None, x.shape[1])), tf.TensorSpec((None,), tf.int32)))
        step.reduce = TopKCompression(AllReduce(), 0.01, strategy.replica_mesh,
                                      error_feedback=False)
        step.reduce.init(state_of(model), model.trainable_weights)
    history = model.fit(x, y, batch_size=32, epochs=epochs, initial_epoch=initial_epoch,
                        shuffle=False, verbose=0)
    return history.history["loss"], model


def test_topk_error_feedback_keeps_up_with_uncompressed_and_dropping_it_does_not():
    # Sending 1% of each gradient and dropping the rest trails the
    # uncompressed run far behind; keeping the rest as the residual of the
    # next step does not: 80 steps of SGD with momentum.
    def final_loss(compression, **kwargs):
        strategy = tfdist.Strategy(devices=devices(4), compression=compression)
        return _fit_compressed(strategy, 4, **kwargs)[0][-1]

    plain = final_loss("none")
    with_feedback = final_loss("topk:0.01")
    without = final_loss("none", error_feedback=False)  # the same Top-K, no residual
    assert without - plain > 2 * (with_feedback - plain), (plain, with_feedback, without)
    assert with_feedback < 1.5 * plain


@pytest.mark.parametrize("compression, optimizer", [
    ("topk:0.01", None), ("powersgd:2", None),
    ("none", lambda: tfdist.optim.OneBitAdam(1e-2, warmup_steps=5))],
    ids=["topk", "powersgd", "one_bit_adam"])
def test_residuals_survive_a_checkpoint_and_the_resumed_run_equals_the_whole_one(
        compression, optimizer, tmp_path):
    def strategy():
        return tfdist.Strategy(devices=devices(4), compression=compression)

    # Uninterrupted: 2 epochs, a checkpoint after the first.
    whole = strategy()
    _, model = _fit_compressed(whole, 1, optimizer=optimizer)
    saved = {k: v.numpy() for k, v in state_of(model).variables.items()}
    assert any(np.abs(v).sum() > 0 for v in saved.values())
    ShardedCheckpoint(model, tmp_path, asynchronous=False).save()
    x, y = data(640)
    model.fit(x, y, batch_size=32, epochs=2, initial_epoch=1, shuffle=False, verbose=0)
    # Resumed: a new model restores before its first step (as fit's backups
    # do), so the residuals are restored when the step makes them.
    resumed_losses, resumed = _fit_compressed(strategy(), 2, initial_epoch=1, restore=tmp_path,
                                              optimizer=optimizer)
    restored_at_start = resumed.optimizer.iterations.numpy()
    assert restored_at_start == 2 * 20  # (20 steps per epoch)
    for ours, theirs in zip(resumed.weights, model.weights):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-6, atol=1e-7)
    for name, variable in state_of(resumed).variables.items():
        np.testing.assert_allclose(variable.numpy(), state_of(model).variables[name].numpy(),
                                   rtol=1e-6, atol=1e-7)
    # Onto another number of replicas, the residuals are refused by name.
    other = tfdist.Strategy(devices=devices(2), compression=compression)
    with pytest.raises(ValueError, match=r"state/\w+/0 of 4 replicas .* this job "
                                         r"has 2: resume on 4 replicas"):
        _fit_compressed(other, 2, initial_epoch=1, restore=tmp_path, optimizer=optimizer)


def test_topk_takes_an_embeddings_slices_as_its_dense_gradient():
    # Top-K sends the largest elements of the table's gradient plus its
    # residual (the table's shape); the LM trains.
    losses, _, model = _lm_run(0, "topk:0.01")
    assert not gathered_dtypes(model) - {"float32", "int32"}
    assert losses[-1] < losses[0]


def test_powersgd_gathers_an_embeddings_slices_as_uncompressed(uncompressed_lm):
    # A rank-4 view of a table of which a step touches a few rows loses
    # most of them: PowerSGD leaves the slices to the uncompressed gather;
    # their residual stays zero.
    losses, _, model = _lm_run(0, "powersgd:4")
    plain_losses, _, plain = uncompressed_lm[0]
    assert gathered_dtypes(model) == gathered_dtypes(plain) == {"float32", "int32"}
    residuals = {name: v.numpy() for name, v in state_of(model).variables.items()
                 if "residual" in name}
    assert not residuals["powersgd_residual/0"].any()
    assert sum(np.abs(r).sum() for r in residuals.values()) > 0
    np.testing.assert_allclose(losses, plain_losses, rtol=5e-2)


def _wide_table_lm(rows=256, width=16):
    """Next-token prediction from a table of more rows than a step looks up."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((SEQ,), dtype="int32"),
                              keras.layers.Embedding(rows, width),
                              keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(VOCAB)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_int8_sends_an_embeddings_looked_up_rows_not_its_table():
    x, y = lm_data(64)
    runs = {c: train(tfdist.Strategy(data=4, compression=c, devices=devices(4)),
                     make=_wide_table_lm, x=x, y=y, batch_size=16) for c in ("none", "int8")}
    (losses, weights, model), (plain_losses, plain_weights, _) = runs["int8"], runs["none"]
    table = model.trainable_weights[0]
    rows = 16 // 4 * SEQ  # the replica's tokens
    # int8 levels four to an int32, then the rows' indices: the step's rows
    # of the table, quantised with the other gradients, not the whole table.
    levels = sum(w.shape.num_elements() for w in model.trainable_weights[1:]) + rows * 16
    int32 = [op.inputs[0].shape.as_list() for op in reduce_collectives(model)
             if op.inputs[0].dtype == tf.int32]
    assert int32 == [[1, -(-levels // 256) * 64], [1, rows]], (int32, table.shape)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-2)
    for ours, theirs in zip(weights, plain_weights):
        np.testing.assert_allclose(ours, theirs, atol=2e-2)
    # A table of fewer rows than a step looks up goes whole (the cheaper).
    losses, _, model = _lm_run(0, "int8")
    assert len([op for op in reduce_collectives(model) if op.inputs[0].dtype == tf.int32]) == 1
    assert losses[-1] < losses[0]


def test_compression_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match=r"`compression` must be one of \('none', 'bf16', "
                                         r"'fp16', 'int8', 'topk:<fraction>', 'powersgd:<rank>'\)"
                                         r" .*, got 'int4'"):
        tfdist.ParallelConfig(compression="int4")
    with pytest.raises(ValueError, match=r"`bucket_bytes` must be an int >= 0, got -1"):
        tfdist.ParallelConfig(bucket_bytes=-1)
    for bad in ("topk:1.5", "powersgd:0", "powersgd:two"):
        with pytest.raises(ValueError, match=rf"got '{bad}'"):
            tfdist.ParallelConfig(compression=bad)
    for option in (dict(zero=2), dict(tensor=2), dict(precision="mixed_float16")):
        name, value = next(iter(option.items()))
        with pytest.raises(NotImplementedError, match=rf"`compression='topk:0.01'` with "
                                                      rf"`{name}={value!r}` is not available"):
            tfdist.ParallelConfig(data=2, compression="topk:0.01", **option)
    with pytest.raises(NotImplementedError, match=r"`compression='int8'` with `tensor=2` is not "
                                                  r"available .* compresses each replica's whole"):
        tfdist.ParallelConfig(data=2, tensor=2, compression="int8")
    for zero in (2, 3):
        tfdist.ParallelConfig(data=2, zero=zero, compression="int8")  # accepted
    with pytest.raises(ValueError, match=r"`compression_warmup=10` delays Top-K or PowerSGD "
                                         r"compression, but `compression='bf16'`"):
        tfdist.ParallelConfig(data=2, compression="bf16", compression_warmup=10)
    tfdist.ParallelConfig(data=2, compression="int8", precision="mixed_float16")  # accepted
    with pytest.raises(ValueError, match=r"`compression='fp16'` is not available under "
                                         r"ParameterServerStrategy"):
        tfdist.ParallelConfig(compression="fp16").validate(strategy="ParameterServerStrategy")
