"""Common mistakes under a tfdist strategy fail at once, saying what to do."""

import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist

X, Y = np.zeros((8, 4), "float32"), np.zeros((8, 2), "float32")


def build():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    return model


def test_unknown_device_is_refused_listing_the_available_ones():
    with pytest.raises(ValueError, match=r"`devices` names \['/device:GPU:7'\], which "
                                         r"this host does not have; available: "
                                         r"/device:CPU:0, /device:CPU:1, "):
        tfdist.Strategy(devices=["/device:GPU:7"])
    assert tfdist.Strategy(devices=["/device:CPU:0", "CPU:1"]).num_replicas_in_sync == 2


@pytest.mark.parametrize("data", [
    lambda: (tf.data.Dataset.from_tensor_slices((X[:0], Y[:0])).batch(4), None),
    lambda: (tf.data.Dataset.from_tensor_slices((X, Y)).batch(4).take(0), None),
])
def test_empty_dataset_says_it_is_empty(data):
    strategy = tfdist.Strategy(devices=["CPU:0", "CPU:1"])
    with strategy.scope():
        model = build()
    x, y = data()
    with pytest.raises(ValueError, match=r"The dataset is empty \(0 batches\)"):
        model.fit(x, y, verbose=0)


@pytest.mark.parametrize("call", ["fit", "evaluate", "predict"])
@pytest.mark.parametrize("data", [
    lambda: (X[:0], Y[:0]),  # arrays: Keras makes them a dataset of unknown size
    lambda: (tf.data.Dataset.from_tensor_slices((X, Y)).filter(lambda x, y: False).batch(4),
             None),
], ids=["arrays", "filtered_dataset"])
def test_input_without_examples_says_so_naming_it(call, data):
    strategy = tfdist.Strategy(devices=["CPU:0", "CPU:1"])
    with strategy.scope():
        model = build()
    x, y = data()
    inputs = (x,) if call == "predict" else (x, y)
    with pytest.raises(ValueError, match=r"^`x` has no examples: not one batch could be "
                                         r"read from it.*Give it at least one example"):
        getattr(model, call)(*inputs, verbose=0)


def test_validation_data_without_examples_is_named():
    strategy = tfdist.Strategy(devices=["CPU:0", "CPU:1"])
    with strategy.scope():
        model = build()
    with pytest.raises(ValueError, match=r"^`validation_data` has no examples"):
        model.fit(X, Y, validation_data=(X[:0], Y[:0]), verbose=0)


def test_model_built_outside_the_scope_says_to_build_it_inside():
    strategy = tfdist.Strategy(devices=["CPU:0", "CPU:1"])
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with strategy.scope():
        model.compile("sgd", "mse")
        with pytest.raises(ValueError, match=r"was built outside `strategy.scope\(\)`.*"
                                             r"Build \(create the layers and weights"):
            model.fit(X, Y, verbose=0)


def test_mesh_smaller_than_the_host_says_how_to_use_some_devices():
    # data=2 on the 8 logical devices of the test process.
    with pytest.raises(ValueError, match=r"needs 2 devices, but there are 8: .*To use 2 of "
                                         r"the 8 devices, name them: tfdist.Strategy\(\.\.\., "
                                         r"devices=\['/device:CPU:0', '/device:CPU:1'\]\)"):
        tfdist.Strategy(data=2, microbatches=2)
    named = tfdist.Strategy(data=2, microbatches=2, devices=["/device:CPU:0", "/device:CPU:1"])
    assert named.num_replicas_in_sync == 2


_UNSCOPED = r"Model '\w+' was built outside `strategy.scope\(\)`: `fit` trains it on one device"


def test_model_built_and_fitted_outside_every_scope_warns_once():
    strategy = tfdist.Strategy(devices=["CPU:0", "CPU:1"])
    model = build()  # outside strategy.scope(), as is the fit
    with pytest.warns(UserWarning, match=_UNSCOPED + r".*build \(create the layers and "
                                         r"weights of\) and compile it inside the scope"):
        model.fit(X, Y, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(X, Y, verbose=0)
    assert not [w for w in caught if "was built outside" in str(w.message)]
    assert strategy.num_replicas_in_sync == 2


def test_model_built_inside_the_scope_does_not_warn():
    strategy = tfdist.Strategy(devices=["CPU:0", "CPU:1"])
    with strategy.scope():
        model = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(X, Y, verbose=0)  # outside the scope: the model keeps its strategy
        with strategy.scope():
            model.fit(X, Y, verbose=0)
    assert not [w for w in caught if "was built outside" in str(w.message)]


def test_plain_keras_does_not_warn():
    # In a process of its own: no tfdist strategy was ever made there.
    code = """
import warnings
import keras, numpy as np, tensorflow as tf
import tfdist
x, y = np.zeros((8, 4), "float32"), np.zeros((8, 2), "float32")
def build():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    return model
warnings.simplefilter("always")
build().fit(x, y, verbose=0)                      # plain Keras
strategy = tfdist.Strategy(devices=["CPU:0"])
with tf.distribute.OneDeviceStrategy("CPU:0").scope():
    other = build()                                 # another tf.distribute strategy's
other.fit(x, y, verbose=0)
build().fit(x, y, verbose=0)                      # now it warns
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("was built outside `strategy.scope()`") == 1, done.stderr
    assert "'sequential_2'" in done.stderr, done.stderr
