"""BatchNormalization's moving statistics: one update per step, equal on every replica.

Each microbatch's forward starts from the step's statistics and the step ends
with their row-weighted mean over every microbatch of every replica
(tfdist/engine/moving_statistics.py): the moving mean then equals one device's
with the whole batch, the moving variance data parallelism's. Under plain
`MirroredStrategy` each replica keeps its own copy (measured: the two copies of
a 2-replica run differ), and with microbatches they would move once per
microbatch.
"""

import keras
import numpy as np
import pytest

import tfdist
from helpers import FEATURES, assert_parity, data, devices, train, trained_reference


def make_bn_model(optimizer=None, synchronized=False):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(16),
        keras.layers.BatchNormalization(momentum=0.5, synchronized=synchronized),
        keras.layers.Activation("relu"),
        keras.layers.Dense(8, activation="relu"),  # a pair `tensor` splits
        keras.layers.Dense(4),
    ])
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def shifted_data(n=64):
    x, y = data(n)
    return x + np.arange(n)[:, None] * 0.05, y   # batch statistics differ by rows


def statistics(model):
    """{name: [value on each replica]} of the BatchNormalization statistics."""
    layer = model.layers[1]
    return {v.name: [np.asarray(c) for c in getattr(v.value, "values", [v.value])]
            for v in (layer.moving_mean, layer.moving_variance)}


def fit_statistics(strategy, **kwargs):
    x, y = shifted_data()
    _, _, model = train(strategy, make=make_bn_model, x=x, y=y, batch_size=32, **kwargs)
    return statistics(model)


@pytest.fixture(scope="module")
def one_device():
    return fit_statistics(None)


@pytest.fixture(scope="module")
def data2():
    return fit_statistics(tfdist.Strategy(data=2, devices=devices(2)))


@pytest.mark.parametrize("config", [
    dict(data=2),
    dict(data=2, microbatches=2),
    dict(data=1, microbatches=4),
    dict(data=2, pipeline=2, microbatches=2),
    dict(data=2, pipeline=2, microbatches=2, remat=True),
    dict(data=2, tensor=2, microbatches=2),
], ids=str)
def test_moving_mean_equals_one_device_and_replicas_agree(config, one_device):
    used = config["data"] * config.get("pipeline", 1) * config.get("tensor", 1)
    found = fit_statistics(tfdist.Strategy(devices=devices(used), **config))
    for name, copies in found.items():
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0], err_msg=name)
    mean = next(name for name in found if "mean" in name)
    np.testing.assert_allclose(found[mean][0], one_device[mean][0], rtol=1e-5, atol=1e-6)


def test_moving_variance_with_microbatches_equals_data_parallel(data2):
    # One device cut into 2 microbatches sees the rows 2 replicas see.
    found = fit_statistics(tfdist.Strategy(data=1, microbatches=2, devices=devices(1)))
    for name in found:
        np.testing.assert_allclose(found[name][0], data2[name][0], rtol=1e-5, atol=1e-6)


def test_synchronized_batch_norm_data4_trains_to_one_device():
    x, y = shifted_data()

    def make():
        return make_bn_model(keras.optimizers.SGD(0.1), synchronized=True)

    reference = trained_reference(make=make, x=x, y=y, batch_size=32, epochs=5)
    result = train(tfdist.Strategy(data=4, devices=devices(4)), make=make, x=x, y=y,
                   batch_size=32, epochs=5)
    assert_parity(result, reference, steps=10)


@pytest.mark.parametrize("config, named", [
    (dict(data=2, xla=True), "xla=True"),
    (dict(data=1, tensor=2, microbatches=2), "tensor=2 with microbatches"),
])
def test_synchronized_batch_norm_refused_inside_nested_functions(config, named):
    used = config["data"] * config.get("tensor", 1)
    strategy = tfdist.Strategy(devices=devices(used), **config)
    with strategy.scope():
        model = make_bn_model(synchronized=True)
    with pytest.raises(NotImplementedError, match=rf"synchronized=True.*{named}"):
        model.fit(*shifted_data(), batch_size=32, verbose=0)
