"""The activations a step holds for its backward, read from its traced gradient."""

import keras
import tensorflow as tf

import tfdist
from tfdist.sharding.activations import traced_activations
from tfdist.sharding.layout import AxisLayout
from tfdist.sharding.peak import activation_bytes, predict_peak

INNER = 1024  # the inner layer's features


class InnerTanh(keras.layers.Layer):
    """One layer whose backward reads an activation computed inside it:
    tanh(x @ w), its features averaged to one number per row."""

    def build(self, shape):
        self.w = self.add_weight((shape[-1], INNER))

    def call(self, x):
        return keras.ops.mean(keras.ops.tanh(x @ self.w), axis=-1, keepdims=True)


def test_an_activation_inside_a_layer_is_counted():
    inputs = keras.Input((16,))
    model = keras.Model(inputs, InnerTanh()(inputs))
    # tanh's gradient reads its output (INNER floats a row); the matmul's
    # reads the batch (not an activation) and the weight; the loss's the
    # model's output (1 float a row). A count of the layers' outputs alone
    # is 4 bytes a row.
    for rows in (1, 3, 8):
        assert activation_bytes(model, rows) == rows * 4 * (INNER + 1)


def test_views_are_counted_once_and_linear_in_rows():
    inputs = keras.Input((None, 16))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    folded = keras.layers.Reshape((-1,))(hidden)  # a view of the relu's output
    model = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.Reshape((-1, 32))(folded)))
    traced = traced_activations(model, sequence_length=10)
    # relu's output read by its gradient and (through the views) by the
    # second Dense's: one buffer of 10 x 32 floats a row
    assert [(t.fixed, t.per_row) for t in traced.held] == [(0, 10 * 32 * 4)]
    assert traced_activations(model, sequence_length=10) is traced  # traced once
    assert activation_bytes(model, 5, sequence_length=10) == 5 * 4 * (10 * 32 + 10 * 4)


def test_a_tensor_rank_holds_its_slice_of_what_a_split_layer_computes():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(INNER, "relu"),
                              keras.layers.Dense(64, "relu"), keras.layers.Dense(8)])
    up, down = model.layers[0].kernel, model.layers[1].kernel
    whole = activation_bytes(model, 4)
    assert whole == 4 * 4 * (INNER + 64 + 8)
    # the first Dense's columns over 2 ranks: its relu output by features;
    # the second's rows (the same features): its output whole
    split = {id(up): AxisLayout(up.shape, axis=1, parts=2),
             id(down): AxisLayout(down.shape, axis=0, parts=2)}
    assert activation_bytes(model, 4, split=split) == 4 * 4 * (INNER // 2 + 64 + 8)


def test_a_model_without_a_graph_holds_no_counted_activations():
    class Subclassed(keras.Model):
        def call(self, x):
            return tf.tanh(x)

    assert traced_activations(Subclassed()) is None
    assert activation_bytes(Subclassed(), 4) == 0


def test_zero3_holds_its_units_inputs_and_one_units_activations():
    strategy = tfdist.Strategy(devices=[f"/device:CPU:{i}" for i in range(2)], zero=3)
    with strategy.scope():
        inputs = keras.Input((16,))
        x = InnerTanh()(keras.layers.Dense(16)(inputs))
        model = keras.Model(inputs, InnerTanh()(keras.layers.Dense(16)(x)))
        model.compile(optimizer="sgd", loss="mse")
    rows = 3  # of a batch of 6 over 2 replicas
    # each unit's forward is replayed for its backward: of what the units
    # compute, the largest's (the first InnerTanh's tanh, and its output,
    # which the next Dense's gradient reads); the inputs of the units but
    # the first (16, 1 and 16 floats), and the output for the loss
    assert predict_peak(strategy.config, model, 6).activations == rows * 4 * (
        INNER + 1 + 33 + 1)
    whole = tfdist.Strategy(devices=[f"/device:CPU:{i}" for i in range(2)])
    # without zero=3: both tanh, the Dense outputs and the first tanh's output, the output
    assert predict_peak(whole.config, model, 6).activations == rows * 4 * (2 * INNER + 33 + 1)


def test_microbatches_one_after_another_hold_two_microbatches_activations():
    devices = [f"/device:CPU:{i}" for i in range(2)]
    strategy = tfdist.Strategy(devices=devices, microbatches=4)
    with strategy.scope():
        inputs = keras.Input((16,))
        model = keras.Model(inputs, InnerTanh()(inputs))
        model.compile(optimizer="sgd", loss="mse")
    # 32 rows over 2 replicas in 4 microbatches of 4: two of them at once
    # (measured; docs/benchmarks.md), not one
    assert predict_peak(strategy.config, model, 32).activations == 2 * activation_bytes(model, 4)
