"""`tfdist.optim.OneBitAdam`: Adam during its warm-up, then frozen variance;
under data parallelism its momenta cross devices as signs after the warm-up."""

import keras
import numpy as np
import pytest

import tfdist
from helpers import data, devices, make_model
from test_zero import _step_graph
from tfdist.optim import OneBitAdam

WARMUP = 20  # of 80 steps: 4 epochs of 20 batches of 32


def _fit(strategy, optimizer, epochs=4):
    """The helpers' MLP compiled with `optimizer()` in `strategy`'s scope, fitted."""
    x, y = data(640)
    with strategy.scope():
        model = make_model(optimizer=optimizer())
    history = model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    return history.history["loss"], model


@pytest.fixture(scope="module")
def one_device():
    """One device, warm-up of 20 steps: Adam, then the variance frozen."""
    return _fit(tfdist.Strategy(devices=devices(1)), lambda: OneBitAdam(1e-2, warmup_steps=WARMUP))


def test_it_is_adam_during_the_warmup_and_freezes_the_variance_after(one_device):
    adam_losses, adam = _fit(tfdist.Strategy(devices=devices(1)),
                             lambda: keras.optimizers.Adam(1e-2), epochs=1)
    losses, model = one_device
    # The first epoch (the 20 warm-up steps) is Adam's, step for step ...
    np.testing.assert_allclose(losses[:1], adam_losses, rtol=1e-6)
    # ... after which the variance no longer moves: a model trained one more
    # epoch keeps the same velocities.
    x, y = data(640)
    before = [v.numpy() for v in model.optimizer.velocities]
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    for old, new in zip(before, model.optimizer.velocities):
        np.testing.assert_array_equal(old, new.numpy())


def _one_bit_gathers(model):
    """Replica 0's all-gathers in the step's compressed branch (a function of
    the cond): their inputs (what it sends)."""
    functions = _step_graph(model)._functions
    (branch,) = [f.graph for name, f in functions.items()
                 if "cond_false" in name and "replica_" not in name]
    return [op.inputs[0] for op in branch.get_operations() if op.type == "CollectiveGatherV2"]


def test_replicas_send_their_momenta_as_signs_after_the_warmup_and_keep_up(one_device):
    losses, model = _fit(tfdist.Strategy(devices=devices(4)),
                         lambda: OneBitAdam(1e-2, warmup_steps=WARMUP))
    reference_losses, _ = one_device
    # The warm-up is exact data parallelism: one device's first epoch.
    np.testing.assert_allclose(losses[:1], reference_losses[:1], rtol=1e-5)
    # Then each replica's momentum crosses as one bit per element (int32
    # words) and one float32 scale per weight, and the loss keeps up with one
    # device's (which averages the exact momenta) to 2%.
    sent = {t.dtype.name: t.shape.num_elements() for t in _one_bit_gathers(model)}
    parameters = sum(w.shape.num_elements() for w in model.trainable_weights)
    assert sent == {"int32": -(-parameters // 32), "float32": len(model.trainable_weights)}
    # 1/32 of the gradient's bytes, and a scale per weight
    assert 4 * sum(sent.values()) <= (1 / 32 + 0.01) * 4 * parameters
    np.testing.assert_allclose(losses[-1], reference_losses[-1], rtol=2e-2)
    residuals = tfdist.sharding.replica_state.state_of(model).variables
    assert len(residuals) == len(model.trainable_weights)
    # describe's peak counts them (a momentum's size, on each replica).
    predicted = model.distribute_strategy.predicted_peak(model, batch_size=32)
    assert predicted.replica_state == sum(v.shape[1:].num_elements() * v.dtype.size
                                          for v in residuals.values()) == 4 * parameters


@pytest.mark.parametrize("config, message", [
    (dict(zero=1), r"`tfdist.optim.OneBitAdam` with `zero=1` is not available"),
    (dict(compression="bf16"), r"with `compression='bf16'` is not available"),
    (dict(precision="mixed_float16"), r"under loss scaling .* is not available"),
])
def test_what_it_cannot_combine_with_is_refused_before_the_first_step(config, message):
    strategy = tfdist.Strategy(devices=devices(2), **config)
    x, y = data(64)
    with strategy.scope():
        model = make_model(optimizer=OneBitAdam(1e-2))
    with pytest.raises(NotImplementedError, match=message):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)


def test_an_element_without_gradients_in_the_warmup_takes_a_bounded_step_after():
    # Element 1 has no gradient during the warm-up (a dead ReLU unit's
    # weight): its frozen variance is 0, and a later gradient would divide by
    # epsilon alone (a step of ~1e3 x the learning rate; the convnet of
    # tools/bench_compression.py turned NaN). The variance floor bounds it.
    optimizer = OneBitAdam(1e-3, warmup_steps=3)
    variable = keras.Variable([0.0, 0.0])
    optimizer.build([variable])
    for _ in range(3):
        optimizer.apply([np.array([1.0, 0.0], "float32")], [variable])
    before = variable.numpy()
    optimizer.apply([np.array([1.0, 1.0], "float32")], [variable])
    step = np.abs(variable.numpy() - before)
    assert np.isfinite(step).all() and step[1] < 10 * 1e-3, step
    assert optimizer.velocities[0].numpy()[1] == 0.0  # frozen as it was


def test_warmup_steps_must_be_a_positive_int():
    with pytest.raises(ValueError, match=r"`warmup_steps` must be an int >= 1, got 0"):
        OneBitAdam(warmup_steps=0)
