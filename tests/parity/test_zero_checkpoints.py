"""Sharded optimizer state saves whole and loads into any number of replicas."""

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from helpers import StepLosses, data, devices, make_model

CHUNK = 160  # examples per training segment: 5 steps of 32


def _schedule():
    return keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=4, decay_rate=0.8)


# Adam: slots only. Adafactor: also its replicated factored statistics.
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(_schedule(), weight_decay=1e-3),
    "adafactor": lambda: keras.optimizers.Adafactor(_schedule(), weight_decay=1e-3),
}


def _fresh(n, zero, optimizer):
    strategy = tfdist.Strategy(data=n, zero=zero if n > 1 else 0, devices=devices(n))
    with strategy.scope():
        model = make_model(optimizer=OPTIMIZERS[optimizer]())
    return strategy, model


def _state(model):
    return [v.numpy() for v in model.weights + model.optimizer.variables]


def _fit(model, segment):
    x, y = data()
    recorder = StepLosses()
    model.fit(x[segment * CHUNK:(segment + 1) * CHUNK], y[segment * CHUNK:(segment + 1) * CHUNK],
              batch_size=32, shuffle=False, verbose=0, callbacks=[recorder])
    return recorder.losses


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def reshard_chain(zero, optimizer, tmp_path):
    """Trains on 4 devices, then 2, 1 and 4 again, moving the whole state
    between them with tf.train.Checkpoint, save_weights and model.save."""
    x, y = data()
    losses = []
    # 4 devices.
    strategy, model = _fresh(4, zero, optimizer)
    losses += _fit(model, 0)
    saved = _state(model)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(tmp_path / "ckpt")
    # 4 -> 2: restored into an optimizer already sharded over 2 (built first).
    strategy, model = _fresh(2, zero, optimizer)
    strategy.train_step(model).build((x[:32], y[:32]))
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(path).assert_consumed()
    _assert_same(_state(model), saved)
    losses += _fit(model, 1)
    saved = _state(model)
    model.save_weights(tmp_path / "two.weights.h5")
    # 2 -> 1.
    strategy, model = _fresh(1, 0, optimizer)
    strategy.train_step(model).build((x[:32], y[:32]))
    model.load_weights(tmp_path / "two.weights.h5")
    _assert_same(_state(model), saved)
    losses += _fit(model, 2)
    saved = _state(model)
    model.save(tmp_path / "one.keras")
    # 1 -> 4: a whole model file, loaded into the sharded strategy.
    strategy = tfdist.Strategy(data=4, zero=zero, devices=devices(4))
    with strategy.scope():
        model = keras.models.load_model(tmp_path / "one.keras")
    _assert_same(_state(model), saved)
    losses += _fit(model, 3)
    return losses, _state(model), tmp_path


# zero=2 (zero=1 saves and loads through the same sharded storage); zero=3
# (the parameters sharded too) with Adam.
@pytest.mark.parametrize("zero, optimizer", [(2, "adam"), (2, "adafactor"), (3, "adam")])
def test_resharding_4_2_1_4_continues_exactly_as_unsharded(tmp_path, zero, optimizer):
    reference, ref_state, _ = reshard_chain(0, optimizer, tmp_path / "plain")
    losses, state, files = reshard_chain(zero, optimizer, tmp_path / f"zero{zero}")
    assert len(losses) == len(reference) == 20
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    for value, ref in zip(state, ref_state):
        np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-6)
    # What a sharded run saves has the layout of an unsharded run's file.
    with h5py.File(tmp_path / "plain" / "two.weights.h5") as plain, \
            h5py.File(files / "two.weights.h5") as sharded:
        assert _h5_shapes(plain) == _h5_shapes(sharded)


def _h5_shapes(group):
    shapes = {}
    group.visititems(lambda name, item: shapes.__setitem__(name, getattr(item, "shape", None)))
    return shapes


@pytest.mark.parametrize("zero", [1, 2])
def test_a_checkpoint_of_the_trained_optimizer_saves_and_restores(tmp_path, zero):
    # Training swaps the optimizer's variable table during each apply; the
    # table left behind must still be saveable (it was not: "modified outside
    # the wrapper"), with SGD's momentum and Adam's moments alike, optimizers
    # named by string as users often do.
    x, y = data(64)

    def model(optimizer, seed):
        keras.utils.set_random_seed(seed)
        built = keras.Sequential([keras.Input((16,)), keras.layers.Dense(3)])
        built.compile(optimizer=optimizer, loss="mse")
        return built

    targets = np.eye(3, dtype="float32")[y % 3]
    for optimizer in ("sgd", "adam"):
        strategy = tfdist.Strategy(data=2, zero=zero, devices=devices(2))
        with strategy.scope():
            trained = model(optimizer, seed=0)
        trained.fit(x, targets, batch_size=32, shuffle=False, verbose=0)
        saved = _state(trained)
        path = tf.train.Checkpoint(model=trained, optimizer=trained.optimizer).save(
            tmp_path / optimizer / "ckpt")
        with strategy.scope():
            restored = model(optimizer, seed=1)
        strategy.train_step(restored).build((x[:32], targets[:32]))
        tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(
            path).assert_consumed()
        _assert_same(_state(restored), saved)
