"""`compression`: the gradient collective in bf16 / fp16, against the uncompressed run."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from helpers import data, devices, executed_op_counts, traced_train_function, train
from test_tensor_transformer import lm_data, make_lm
from test_zero import _step_graph

CONFIGS = {"data": dict(data=4), "zero2": dict(data=4, zero=2),
           "tensor": dict(data=2, tensor=2)}


def reduce_collectives(model):
    """Replica 0's collectives of the step's reduce part (the gradients and
    the metric states summed with them)."""
    return [op for op in _step_graph(model).get_operations()
            if op.type.startswith("Collective") and op.device.endswith("CPU:0")
            and "tfdist/reduce/" in op.name]


def wire_bytes(model):
    """Bytes replica 0 sends into the reduce part's collectives in one
    traced step: their first inputs (what each device contributes)."""
    return sum(op.inputs[0].shape.num_elements() * op.inputs[0].dtype.size
               for op in reduce_collectives(model))


def _run(config, compression):
    x, y = data(256)
    strategy = tfdist.Strategy(devices=devices(4), compression=compression, **config)
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
    # carries the cast gradients; the metric states stay float32.
    assert wire_bytes(model) <= 0.51 * wire_bytes(plain), (wire_bytes(model),
                                                          wire_bytes(plain))
    assert {op.inputs[0].dtype.name for op in reduce_collectives(model)} == {dtype, "float32"}
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


def _lm_run(zero, compression):
    x, y = lm_data(64)
    strategy = tfdist.Strategy(data=4, zero=zero, compression=compression, devices=devices(4))
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


def test_compression_is_refused_where_it_cannot_apply():
    with pytest.raises(NotImplementedError, match=r"`compression='bf16'` with `zero=3`"):
        tfdist.ParallelConfig(data=2, zero=3, compression="bf16")
    with pytest.raises(ValueError, match=r"`compression` must be one of \('none', 'bf16', "
                                         r"'fp16'\), got 'int4'"):
        tfdist.ParallelConfig(compression="int4")
    with pytest.raises(ValueError, match=r"`compression='fp16'` is not available under "
                                         r"ParameterServerStrategy"):
        tfdist.ParallelConfig(compression="fp16").validate(strategy="ParameterServerStrategy")
