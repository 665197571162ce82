"""Shard layouts, tensor plans and tensor layouts, without training (seconds)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.sharding.creation import whole_where_not_kept
from tfdist.sharding.layout import AxisLayout, MeshShardLayout, ShardLayout
from tfdist.sharding.storage import axis_layout
from tfdist.tensor.layouts import Classifier, Column, Heads, Replicated, Row, Vocabulary
from tfdist.tensor.plan import describe, plan

DEVICES = [f"/device:CPU:{i}" for i in range(2)]


def _value(shape):
    return tf.reshape(tf.range(1, int(np.prod(shape)) + 1, dtype=tf.float32), shape)


def _round_trip(layout, value, replicas):
    shards = [layout.shard(value, r) for r in range(replicas)]
    for shard in shards:
        assert shard.shape.as_list() == list(layout.shard_shape)
    whole = layout.unshard(tf.stack(shards))
    assert whole.shape == layout.shape
    np.testing.assert_array_equal(whole.numpy(), value.numpy())
    return shards


# Round trips shard -> unshard.

@pytest.mark.parametrize("shape, num_shards, shard_size, padding", [
    ((3, 5), 4, 4, 1),
    ((2, 3, 4), 8, 3, 0),
    ((7,), 3, 3, 2),
    ((5,), 8, 1, 3),      # fewer elements than shards
    ((), 2, 1, 1),        # a scalar
    ((16, 16), 1, 256, 0),
])
def test_shard_layout_round_trip_and_padding(shape, num_shards, shard_size, padding):
    layout = ShardLayout(shape, num_shards)
    assert (layout.shard_size, layout.padding) == (shard_size, padding)
    shards = _round_trip(layout, _value(shape), num_shards)
    # The padding is zeros at the end of the last shards.
    flat = tf.concat(shards, 0).numpy()
    assert not flat[flat.size - padding:].any()
    # A scalar-tensor index gives the same shard.
    np.testing.assert_array_equal(layout.shard(_value(shape), tf.constant(num_shards - 1)),
                                  shards[-1])


@pytest.mark.parametrize("shape, axis, parts", [
    ((4, 6), 1, 2), ((4, 6), -1, 3), ((4, 6), 0, 4), ((8, 2, 3), -2, 2), ((6,), 0, 6)])
def test_axis_layout_round_trip(shape, axis, parts):
    layout = AxisLayout(shape, axis, parts)
    expected = list(shape)
    expected[axis] //= parts
    assert layout.shard_shape == expected
    # Replicas beyond one tensor group hold their rank's slice again.
    shards = _round_trip(layout, _value(shape), 2 * parts)
    for r in range(parts, 2 * parts):
        np.testing.assert_array_equal(shards[r], shards[r - parts])


def test_axis_layout_makes_only_the_slice_asked_for():
    # A slice along a later axis is a copy: making every rank's would make
    # the whole weight again (the first step splits each weight this way).
    value = tf.random.uniform((1024, 1024))
    tf.config.experimental.reset_memory_stats("CPU:0")
    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
    part = AxisLayout(value.shape, axis=1, parts=4).shard(value, 1)
    assert tf.config.experimental.get_memory_info("CPU:0")["peak"] - start == 1 << 20
    np.testing.assert_array_equal(part, value[:, 256:512])


def test_axis_layout_refuses_an_indivisible_dimension():
    with pytest.raises(ValueError, match=r"Dimension 1 of shape \(4, 6\) is 6, which 4 shards"):
        AxisLayout((4, 6), axis=1, parts=4)


@pytest.mark.parametrize("shape, tensor, data, axis", [
    ((4, 6), 2, 2, 1),      # split weight, each rank's part halved over its data group
    ((6, 5), 2, 3, 0),      # split weight, padded element shards
    ((5, 3), 2, 3, None),   # replicated weight: every rank's part is all of it
    ((3, 5), 1, 4, None),   # tensor=1: ShardLayout over the replicas
])
def test_mesh_shard_layout_round_trip(shape, tensor, data, axis):
    split = None if axis is None else AxisLayout(shape, axis, tensor)
    layout = MeshShardLayout(shape, tensor=tensor, data=data, split=split)
    shards = _round_trip(layout, _value(shape), tensor * data)
    if tensor == 1:
        plain = ShardLayout(shape, data)
        for r, shard in enumerate(shards):
            np.testing.assert_array_equal(shard, plain.shard(_value(shape), r))


_ROW_LAYOUTS = [
    (ShardLayout((6, 8), 3), 3),
    (ShardLayout((7,), 4), 4),  # padded, one element a row
    (AxisLayout((6, 8), 1, 2), 4),
    (AxisLayout((6, 8), 0, 3), 3),
    (AxisLayout((2, 6, 4), 1, 3), 3),
    (MeshShardLayout((6, 8), 2, 2, AxisLayout((6, 8), 1, 2)), 4),
    (MeshShardLayout((6, 8), 2, 3, AxisLayout((6, 8), 0, 2)), 6),  # padded
    (MeshShardLayout((6, 8), 2, 5), 10),  # replicated weight, padded
]


@pytest.mark.parametrize("layout, replicas", _ROW_LAYOUTS)
@pytest.mark.parametrize("rows_per_block", [1, 2, 4, 100])
def test_shards_are_built_from_blocks_of_rows_and_blocks_from_element_shards(
        layout, replicas, rows_per_block):
    # What resharding does: each block of rows summed from every element
    # shard's part (`shard_in_rows`), each new shard concatenated from its
    # pieces of the blocks (`rows_piece`), padded: the shard of the whole.
    value = _value(layout.shape)
    source = ShardLayout(layout.shape, 5)
    rows = layout.shape[0]
    pieces = {r: [] for r in range(replicas)}
    for start in range(0, rows, rows_per_block):
        count = min(rows_per_block, rows - start)
        block = tf.reshape(sum(source.shard_in_rows(source.shard(value, i), start, count, i)
                               for i in range(5)), [count, *layout.shape[1:]])
        np.testing.assert_array_equal(block, value[start:start + count])
        for r in range(replicas):
            pieces[r].append(layout.rows_piece(block, start, r))
    for r in range(replicas):
        expected = tf.reshape(layout.shard(value, r), [-1])
        built = tf.concat(pieces[r], 0)
        built = tf.pad(built, [[0, expected.shape[0] - built.shape[0]]])  # ShardLayout's padding
        np.testing.assert_array_equal(built, expected)


# plan() on built models, no strategy.

def _layouts(decisions):
    return [(d.layer.name, d.layout.name) for d in decisions]


def _dense_stack(*layers, features=8):
    return keras.Sequential([keras.Input((features,)), *layers])


def test_plan_pairs_dense_layers_and_describes_them():
    model = _dense_stack(keras.layers.Dense(16, "relu", name="up"),
                         keras.layers.Dense(8, name="down"),
                         keras.layers.Dense(4, name="out"))
    decisions = plan(model, 2)
    assert [type(d.layout) for d in decisions] == [Column, Row, Replicated]
    assert describe(decisions) == (
        "up    Dense  column      paired with down (16 -> 8 units per device)\n"
        "down  Dense  row         paired with up\n"
        "out   Dense  replicated  no Dense consumes its output alone")


def test_plan_keeps_indivisible_constrained_and_softmax_dense_replicated():
    indivisible = plan(_dense_stack(keras.layers.Dense(15, "relu"), keras.layers.Dense(4)), 2)
    assert indivisible[0].layout.name == "replicated"
    assert "units=15 is not divisible by tensor=2" in indivisible[0].reason
    constrained = plan(_dense_stack(
        keras.layers.Dense(16, kernel_constraint=keras.constraints.MaxNorm(1.0)),
        keras.layers.Dense(4)), 2)
    assert constrained[0].layout.name == "replicated"
    assert "has a constraint" in constrained[0].reason
    softmax = plan(_dense_stack(keras.layers.Dense(16, "softmax"), keras.layers.Dense(4)), 2)
    assert softmax[0].layout.name == "replicated"
    assert "activation 'softmax' is not elementwise" in softmax[0].reason


def _attention_model(num_heads):
    x = keras.Input((5, 8))
    y = keras.layers.MultiHeadAttention(num_heads, key_dim=4, name="attention")(x, x)
    return keras.Model(x, y)


def test_plan_splits_attention_by_heads_when_divisible():
    (decision,) = plan(_attention_model(4), 2)
    assert isinstance(decision.layout, Heads)
    assert decision.reason == "4 heads -> 2 per device"
    (decision,) = plan(_attention_model(3), 2)
    assert isinstance(decision.layout, Replicated)
    assert decision.reason == "num_heads=3 is not divisible by tensor=2"


def test_plan_splits_embedding_by_vocabulary_when_divisible():
    def model(vocabulary):
        return keras.Sequential([keras.Input((3,), dtype="int32"),
                                 keras.layers.Embedding(vocabulary, 4, name="embedding")])

    assert _layouts(plan(model(10), 2)) == [("embedding", "vocabulary")]
    (decision,) = plan(model(11), 2)
    assert isinstance(decision.layout, Replicated)
    assert "input_dim (vocabulary)=11 is not divisible by tensor=2" in decision.reason


def test_plan_splits_the_final_classifier_with_a_sparse_softmax_loss():
    model = _dense_stack(keras.layers.Dense(16, "relu"), keras.layers.Dense(8),
                         keras.layers.Dense(6, name="logits"))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert [type(d.layout) for d in plan(model, 2, classifier=True)] == [Column, Row, Classifier]
    model.compile(loss="mse")
    assert isinstance(plan(model, 2, classifier=True)[-1].layout, Replicated)


# Each layout applied to a built layer under Strategy(tensor=2).

@pytest.fixture(scope="module")
def mesh():
    return tfdist.Strategy(tensor=2, devices=DEVICES).tensor_mesh


def _weights(layer):
    return {w.path: w.numpy() for w in layer.weights}


def _assert_split(layer, before, axes):
    """Values read back whole and unchanged; components halved along `axes`
    (weight path suffix -> axis, None for a whole weight)."""
    after = _weights(layer)
    assert after.keys() == before.keys()
    for path, value in before.items():
        np.testing.assert_array_equal(after[path], value, err_msg=path)
    for weight in layer.weights:
        axis = next((a for suffix, a in axes.items() if weight.path.endswith(suffix)), None)
        expected = list(weight.shape)
        if axis is not None:
            expected[axis] //= 2
            assert axis_layout(weight).axis == axis % len(expected)
        else:
            assert axis_layout(weight) is None
        assert [c.shape.as_list() for c in weight.value.values] == [expected] * 2, weight.path


def _build(mesh, layer, input_shape, call_input):
    with mesh.strategy.scope():
        layer.build(input_shape)
    return _weights(layer), keras.ops.convert_to_numpy(layer(call_input))


def _apply(layout, layer, mesh):
    """What the first step does to a layer: its layout, then whole what it left."""
    layout.apply(layer, mesh)
    whole_where_not_kept(layer, mesh.strategy)


@pytest.mark.parametrize("layout, axes", [
    (Column(), {"kernel": 1, "bias": 0}),
    (Classifier(), {"kernel": 1, "bias": 0}),
    (Row(), {"kernel": 0}),
    (Replicated(), {}),
])
def test_dense_layouts_split_and_read_back_whole(mesh, layout, axes):
    layer = keras.layers.Dense(6, activation="tanh")
    x = np.linspace(-1, 1, 12, dtype="float32").reshape(3, 4)
    before, output = _build(mesh, layer, (None, 4), x)
    _apply(layout, layer, mesh)
    _assert_split(layer, before, axes)
    # Outside the mesh's replicas the layer computes with its whole weights.
    np.testing.assert_allclose(layer(x), output, rtol=1e-6)
    if not isinstance(layout, Replicated):
        assert layer._tfdist_layout is layout


def test_vocabulary_splits_an_embedding_and_reads_back_whole(mesh):
    layer = keras.layers.Embedding(10, 3)
    ids = np.array([[0, 4, 9]])
    before, output = _build(mesh, layer, (None, 3), ids)
    _apply(Vocabulary(), layer, mesh)
    _assert_split(layer, before, {"embeddings": 0})
    np.testing.assert_array_equal(layer(ids), output)


def test_heads_splits_attention_and_reads_back_whole(mesh):
    layer = keras.layers.MultiHeadAttention(num_heads=4, key_dim=3)
    x = np.linspace(-1, 1, 40, dtype="float32").reshape(1, 5, 8)
    with mesh.strategy.scope():
        output = keras.ops.convert_to_numpy(layer(x, x))  # builds it
    before = _weights(layer)
    _apply(Heads(), layer, mesh)
    # query/key/value: kernel (d, heads, size), bias (heads, size); output: (heads, size, d).
    _assert_split(layer, before, {"query/kernel": 1, "query/bias": 0, "key/kernel": 1,
                                  "key/bias": 0, "value/kernel": 1, "value/bias": 0,
                                  "attention_output/kernel": 0})
    np.testing.assert_allclose(layer(x, x), output, rtol=1e-5, atol=1e-6)


def test_gathered_int8_rows_are_decoded_and_summed_one_replica_at_a_time():
    # What 8 replicas sent (int8 levels and scales, as gathered), decoded and
    # summed: `summed_rows` holds about two decoded rows at its peak; the
    # same decode of every row at once holds all of them (the measure works).
    from tfdist.sharding.wire import Int8Wire, summed_rows

    replicas, width = 8, 2**20
    wire = Int8Wire()
    packed, scales = wire.encode(tf.random.stateless_normal([replicas, width], seed=[0, 1]))

    @tf.function
    def one_at_a_time():
        return summed_rows(replicas, lambda r: wire.decode([packed[r], scales[r]], width,
                                                           tf.float32))

    @tf.function
    def all_at_once():
        return tf.reduce_sum(wire.decode([packed, scales], width, tf.float32), 0)

    peaks = {}
    for decode in (one_at_a_time, all_at_once):
        expected = decode()
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        result = decode()
        peaks[decode] = (tf.config.experimental.get_memory_info("CPU:0")["peak"]
                         - before) / (4 * width)
        np.testing.assert_allclose(result, expected)
    np.testing.assert_allclose(one_at_a_time(), all_at_once(), rtol=1e-5, atol=1e-5)
    # (two decoded rows and the sum; the executor may slice the next
    # replica's int8 rows ahead, a quarter of a decoded row each: 3.25 seen)
    assert peaks[one_at_a_time] <= 4 < replicas <= peaks[all_at_once], peaks
