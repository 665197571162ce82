"""Tensor parallelism on MLPs: parity, placement, memory, refusals."""

import collections
import warnings

import keras
import numpy as np
import pytest

import tfdist
from helpers import (
    CLASSES,
    FEATURES,
    assert_parity,
    data,
    devices,
    make_model,
    train,
    trained_reference,
)

MESHES = [(1, 2), (1, 4), (2, 2)]  # (data, tensor)


@pytest.fixture(scope="module")
def reference():
    return trained_reference()


@pytest.mark.parametrize("data_size, tensor", MESHES)
def test_unchanged_mlp_matches_one_device(reference, data_size, tensor):
    strategy = tfdist.Strategy(data=data_size, tensor=tensor,
                               devices=devices(data_size * tensor))
    result = train(strategy)
    # Each tensor group sums its matmuls' partial products in another order
    # than one device does (and data groups add their gradients): 1e-4 holds.
    assert_parity(result, reference)
    layouts = [line.split()[2] for line in strategy.describe(result[2]).splitlines()]
    assert layouts == ["column", "row", "replicated"]


def make_explicit(optimizer=None, seed=0):
    """The helpers' MLP written with the explicit layers (same initialisers)."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        tfdist.layers.ColumnParallelDense(32, activation="relu"),
        tfdist.layers.RowParallelDense(32, activation="tanh"),
        tfdist.layers.ColumnParallelDense(CLASSES, gather_output=True),
    ])
    model.compile(optimizer=optimizer or keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_explicit_layers_match_the_plain_model_on_one_device():
    reference = train(make=make_explicit)  # no strategy: plain Dense behaviour
    strategy = tfdist.Strategy(data=2, tensor=2, devices=devices(4))
    result = train(strategy, make=make_explicit)
    assert_parity(result, reference)
    # The gathered classifier is split too: 4 classes -> 2 per device.
    assert [c.shape for c in result[2].layers[2].kernel.value.values] == [(32, 2)] * 4


def component_bytes(model):
    """{device: bytes of every model-weight component placed on it}."""
    per_device = collections.Counter()
    for weight in model.weights:
        for component in weight.value.values:
            per_device[component.device] += component.numpy().nbytes
    return per_device


def make_wide(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(64),
                              keras.layers.Dense(CLASSES)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("data_size, tensor", MESHES)
def test_each_device_holds_its_shards_and_a_1_over_t_share(data_size, tensor):
    n = data_size * tensor
    strategy = tfdist.Strategy(data=data_size, tensor=tensor, devices=devices(n))
    with strategy.scope():
        model = make_wide()
    model.fit(*data(64), batch_size=32, verbose=0)
    first, second, head = model.layers
    for weight in (first.kernel, first.bias, second.kernel):
        components = weight.value.values
        assert [c.device for c in components] == list(strategy.extended.worker_devices)
        full = weight.numpy()
        axis = 0 if weight is second.kernel else -1
        for replica, component in enumerate(components):
            np.testing.assert_array_equal(
                component.numpy(), np.split(full, tensor, axis=axis)[replica % tensor])
    split = 4 * (16 * 256 + 256 + 256 * 64)
    replicated = 4 * (64 + 64 * CLASSES + CLASSES)
    assert component_bytes(model) == {
        device: split // tensor + replicated for device in strategy.extended.worker_devices}
    # The optimizer's slots of a split weight are split the same way.
    slots = [v for v in model.optimizer.variables if v.shape == first.kernel.shape]
    assert len(slots) == 2
    for slot in slots:
        assert [c.shape for c in slot.value.values] == [(16, 256 // tensor)] * n


def test_replicated_weights_stay_identical_on_every_device():
    strategy = tfdist.Strategy(data=2, tensor=2, devices=devices(4))
    _, _, model = train(strategy, make=make_wide)
    head = model.layers[2]
    for weight in (head.kernel, head.bias, model.layers[1].bias):
        values = [c.numpy() for c in weight.value.values]
        for value in values[1:]:
            np.testing.assert_array_equal(value, values[0])


def test_explicit_layer_with_indivisible_units_names_layer_and_dimension():
    strategy = tfdist.Strategy(tensor=4, devices=devices(4))
    with strategy.scope():
        layer = tfdist.layers.ColumnParallelDense(30, name="up")
        with pytest.raises(ValueError, match=r"Layer 'up' \(ColumnParallelDense\): "
                                             r"units=30 is not divisible by tensor=4"):
            layer.build((None, 8))
        embedding = tfdist.layers.ParallelEmbedding(10, 4, name="tokens")
        with pytest.raises(ValueError, match=r"'tokens'.*input_dim=10 is not divisible"):
            embedding.build((None, 3))


def test_constrained_weights_stay_whole():
    # A constraint (MaxNorm over each column's inputs, here) acts on the whole
    # weight: such layers stay replicated (the pair before them splits), and
    # explicit layers refuse one.
    def make(optimizer=None):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((FEATURES,)),
            keras.layers.Dense(32, activation="relu", name="first"),
            keras.layers.Dense(32, name="second"),
            keras.layers.Dense(32, activation="relu", name="up"),
            keras.layers.Dense(32, kernel_constraint=keras.constraints.MaxNorm(0.5),
                               name="down"),
            keras.layers.Dense(CLASSES, name="out")])
        model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    strategy = tfdist.Strategy(tensor=2, devices=devices(2))
    result = train(strategy, make=make)
    lines = strategy.describe(result[2]).splitlines()
    assert [line.split()[2] for line in lines] == ["column", "row"] + ["replicated"] * 3
    assert "its pair down: weight 'sequential" in lines[2]
    assert "has a constraint, which acts on the whole weight" in lines[3]
    assert_parity(result, train(make=make))
    with strategy.scope():
        layer = tfdist.layers.RowParallelDense(8, kernel_constraint="non_neg", name="row")
        with pytest.raises(ValueError, match=r"Layer 'row' \(RowParallelDense\): weight "
                                             r"'.*kernel' has a constraint \(NonNeg\)"):
            layer.build((None, 8))


def test_unchanged_model_with_indivisible_units_stays_replicated_and_says_why():
    strategy = tfdist.Strategy(tensor=4, devices=devices(4))
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)),
                                  keras.layers.Dense(30, activation="relu", name="up"),
                                  keras.layers.Dense(8, activation="softmax", name="down"),
                                  keras.layers.Dense(4, name="out")])
    lines = strategy.describe(model).splitlines()
    assert [line.split()[2] for line in lines] == ["replicated"] * 3
    assert "units=30 is not divisible by tensor=4" in lines[0]
    assert "activation 'softmax' is not elementwise" in lines[1]
    assert "no Dense consumes its output alone" in lines[2]


def make_dropout_mlp(optimizer=None, seed=0, rate=0.0):
    """The most common MLP: Dense -> Dropout -> Dense, twice, with an
    Activation layer in the second pair."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(32, activation="relu", name="up"),
        keras.layers.Dropout(rate, name="drop"),
        keras.layers.Dense(16, name="down"),
        keras.layers.Dense(16, name="up2"), keras.layers.Activation("gelu"),
        keras.layers.Dropout(rate), keras.layers.Dense(CLASSES, name="down2")])
    model.compile(optimizer=optimizer or keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_elementwise_layers_between_a_pair_act_on_each_devices_slice():
    strategy = tfdist.Strategy(data=2, tensor=2, devices=devices(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(strategy, make=make_dropout_mlp)
    assert not [w for w in caught if "whole on every device" in str(w.message)]
    assert_parity(result, train(make=make_dropout_mlp))
    lines = strategy.describe(result[2]).splitlines()
    assert [line.split()[:3] for line in lines] == [
        ["up", "Dense", "column"], ["down", "Dense", "row"],
        ["up2", "Dense", "column"], ["down2", "Dense", "row"]]
    assert "paired with down through drop (32 -> 16 units per device)" in lines[0]
    # Half of each pair's kernel per device (the biases of the row halves whole).
    model = result[2]
    sizes = tfdist.callbacks.metrics.variable_bytes(model.trainable_weights)
    whole = sum(int(np.prod(w.shape)) * 4 for w in model.trainable_weights)
    assert max(sizes.values()) <= 0.55 * whole, sizes
    with strategy.scope():  # with dropout on, it trains (masks differ from one device's)
        model = make_dropout_mlp(rate=0.3)
    history = model.fit(*data(256), batch_size=32, epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]


def make_time_distributed(optimizer=None, seed=0):
    """A per-timestep MLP: TimeDistributed(Dense) -> Dropout -> TimeDistributed(Dense)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5, FEATURES))
    x = keras.layers.TimeDistributed(keras.layers.Dense(16, activation="relu"),
                                     name="step_up")(inputs)
    x = keras.layers.Dropout(0.0, name="drop")(x)
    x = keras.layers.TimeDistributed(keras.layers.Dense(8), name="step_down")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES, name="out")(x))
    model.compile(optimizer=optimizer or keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_time_distributed_dense_pairs_split_like_dense_pairs():
    x = np.random.default_rng(0).normal(size=(640, 5, FEATURES)).astype("float32")
    y = np.random.default_rng(1).integers(0, CLASSES, 640)
    strategy = tfdist.Strategy(data=2, tensor=2, devices=devices(4))
    result = train(strategy, make=make_time_distributed, x=x, y=y)
    assert_parity(result, train(make=make_time_distributed, x=x, y=y))
    lines = strategy.describe(result[2]).splitlines()
    assert [line.split()[:3] for line in lines] == [
        ["step_up", "Dense", "column"], ["step_down", "Dense", "row"],
        ["out", "Dense", "replicated"]]
    kernel = result[2].get_layer("step_up").layer.kernel
    assert [tuple(v.shape) for v in kernel.value.values] == [(FEATURES, 8)] * 4


def test_layers_left_whole_are_named_once_before_training():
    strategy = tfdist.Strategy(tensor=2, devices=devices(2))
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, name="conv"),
            keras.layers.Flatten(), keras.layers.Dense(16, "relu", name="up"),
            keras.layers.Dense(CLASSES, name="down"), keras.layers.Dense(CLASSES, name="out")])
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(64, 8, 8, 1)).astype("float32")
    y = np.random.default_rng(1).integers(0, CLASSES, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    told = [str(w.message) for w in caught if "whole on every device" in str(w.message)]
    assert len(told) == 1, told
    whole = sum(int(np.prod(w.shape)) for w in model.get_layer("conv").weights + model.get_layer(
        "out").weights) / sum(int(np.prod(w.shape)) for w in model.weights)
    assert told[0].startswith(f"tensor=2 leaves 2 layers with matrices whole on every device "
                              f"({whole:.0%} of the parameters stay whole): "
                              f"conv (Conv2D): Conv2D has no tensor-parallel layout; "
                              f"out (Dense): no Dense consumes its output alone."), told


def test_xla_with_tensor_parallelism_says_why_it_is_not_available():
    with pytest.raises(NotImplementedError, match=r"`tensor=2` with `xla=True` is not "
                       r"available.*cannot compile collectives with XLA on CPU"):
        tfdist.Strategy(tensor=2, xla=True, devices=devices(4))


def test_optimizer_that_is_not_elementwise_is_refused_before_a_step():
    strategy = tfdist.Strategy(tensor=2, devices=devices(2))
    with strategy.scope():
        model = make_model(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=1.0))
    with pytest.raises(NotImplementedError, match=r"`global_clipnorm=1.0`.*`tensor=2`"):
        model.fit(*data(64), batch_size=32, verbose=0)
    assert model.optimizer.iterations.numpy() == 0


def test_adafactor_is_refused_with_tensor_parallelism():
    # Its updates use whole-variable RMS and row/column means: exact on
    # ZeRO's shards (tfdist has a sharded update for that), not on tensor
    # shards, where Keras's own update would see one slice.
    strategy = tfdist.Strategy(tensor=2, devices=devices(2))
    with strategy.scope():
        model = make_model(optimizer=keras.optimizers.Adafactor())
    with pytest.raises(ValueError, match=r"`tensor=2` shards optimizer state.*Adafactor"):
        model.fit(*data(64), batch_size=32, verbose=0)
    assert model.optimizer.iterations.numpy() == 0
