"""Tensor parallelism with sharded optimizer state (`tensor` x `zero`): each
replica keeps its tensor rank's part of every weight's optimizer state, split
across its data group."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from helpers import assert_parity, data, devices, make_model, train, trained_reference
from test_tensor_transformer import lm_data, make_lm
from tfdist.callbacks.metrics import optimizer_state_bytes


def _adam():
    optimizer = keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=5, decay_rate=0.7),
        weight_decay=1e-3)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


def adam_mlp():
    """The helpers' MLP with a decaying, weight-decayed Adam."""
    return make_model(optimizer=_adam())


def _state(model):
    return [v.numpy() for v in model.weights + model.optimizer.variables]


_UNSHARDED = {}


def unsharded(microbatches):
    """data=2 x tensor=2 without zero, with `microbatches`: the reference for
    the same mesh (trained once per process)."""
    if microbatches not in _UNSHARDED:
        strategy = tfdist.Strategy(data=2, tensor=2, microbatches=microbatches,
                                   devices=devices(4))
        _UNSHARDED[microbatches] = train(strategy, make=adam_mlp)
    return _UNSHARDED[microbatches]


@pytest.mark.parametrize("zero, microbatches", [(1, 1), (2, 1), (2, 2)])
def test_tensor_and_zero_match_tensor_alone_and_one_device(zero, microbatches):
    strategy = tfdist.Strategy(data=2, tensor=2, zero=zero, microbatches=microbatches,
                               devices=devices(4))
    result = train(strategy, make=adam_mlp)
    # The same arithmetic as without zero (and the same microbatches) but for
    # where the update runs and (zero=2) the order of the gradient sum.
    assert_parity(result, unsharded(microbatches), rtol=1e-5)
    assert_parity(result, trained_reference(make=adam_mlp))
    _, _, model = result
    reference = unsharded(microbatches)[2]
    for a, b in zip(model.optimizer.variables, reference.optimizer.variables):
        assert a.shape == b.shape
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6)


def test_each_device_holds_its_rank_part_of_the_state_over_data():
    tensor, data_size = 2, 4
    strategy = tfdist.Strategy(data=data_size, tensor=tensor, zero=1,
                               devices=devices(tensor * data_size))
    with strategy.scope():
        model = make_model(optimizer=keras.optimizers.Adam(1e-2))
    model.fit(*data(64), batch_size=32, verbose=0)
    first, second, head = model.layers
    # Split weights' state: 1/(t d) each; replicated weights': 1/d each.
    split = [first.kernel, first.bias, second.kernel]
    replicated = [second.bias, head.kernel, head.bias]
    per_slot = (sum(-(-w.numpy().size // (tensor * data_size)) for w in split)
                + sum(-(-w.numpy().size // data_size) for w in replicated))
    counted = optimizer_state_bytes(model.optimizer)
    # Scalars (iterations, learning rate) stay whole on every device.
    scalars = sum(v.numpy().nbytes for v in model.optimizer.variables if len(v.shape) == 0)
    assert counted == {f"CPU:{i}": 2 * 4 * per_slot + scalars
                       for i in range(tensor * data_size)}
    # Replica r holds element shard r // t of rank r % t's slice.
    (m, v) = [s for s in model.optimizer.variables if s.shape == first.kernel.shape]
    full = m.numpy()
    for replica, component in enumerate(m.value.values):
        part = np.split(full, tensor, axis=-1)[replica % tensor].reshape(-1)
        size = part.size // data_size
        index = replica // tensor
        np.testing.assert_array_equal(component.numpy(), part[index * size:(index + 1) * size])


def test_transformer_lm_with_zero2_matches_one_device():
    x, y = lm_data()
    reference = trained_reference(make=make_lm, x=x, y=y, batch_size=16)
    strategy = tfdist.Strategy(data=2, tensor=2, zero=2, devices=devices(4))
    assert_parity(train(strategy, make=make_lm, x=x, y=y, batch_size=16), reference)


def test_state_saves_whole_and_loads_into_any_layout(tmp_path):
    x, y = data(128)
    strategy = tfdist.Strategy(data=2, tensor=2, zero=2, devices=devices(4))
    with strategy.scope():
        model = make_model(optimizer=_adam())
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    saved = _state(model)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(tmp_path / "ckpt")
    # Into one device, unpartitioned.
    plain = make_model(optimizer=_adam(), seed=1)
    plain.optimizer.build(plain.trainable_variables)
    tf.train.Checkpoint(model=plain, optimizer=plain.optimizer).restore(path).assert_consumed()
    for a, b in zip(_state(plain), saved):
        np.testing.assert_array_equal(a, b)
    # Into another mesh: data=1 x tensor=4 (zero off), state resharded.
    strategy = tfdist.Strategy(data=1, tensor=4, devices=devices(4))
    with strategy.scope():
        other = make_model(optimizer=_adam(), seed=2)
    strategy.train_step(other).build((x[:32], y[:32]))
    tf.train.Checkpoint(model=other, optimizer=other.optimizer).restore(path).assert_consumed()
    for a, b in zip(_state(other), saved):
        np.testing.assert_array_equal(a, b)
    # Both continue identically.
    for continued in (plain, other):
        continued.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    for a, b in zip(plain.weights, other.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6)
