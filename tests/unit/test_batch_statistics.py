"""Statistics of the global batch: `batch_mean` across replicas, forward and
backward, and tfdist's load-balancing loss against each keras-hub version
it replaces."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from helpers import devices
from tfdist.batch_statistics import batch_mean, load_balancing_loss


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
@pytest.mark.parametrize("config", [dict(data=2), dict(data=2, tensor=2)], ids=str)
def test_batch_mean_is_the_global_batchs_forward_and_backward(config, traced):
    strategy = tfdist.Strategy(devices=devices(config["data"] * config.get("tensor", 1)),
                               **config)
    rows = tf.constant(np.arange(12, dtype="float32").reshape(4, 3))

    def step():
        def replica():
            context = tf.distribute.get_replica_context()
            group = context.replica_id_in_sync_group // config.get("tensor", 1)
            x = rows[2 * group:2 * group + 2]  # a tensor group's ranks: the same rows
            with tf.GradientTape() as tape:
                tape.watch(x)
                # Each data group's share, as Keras scales a loss for distribution.
                loss = tf.reduce_sum(batch_mean(x) ** 2) / 2
            return batch_mean(x), tape.gradient(loss, x)
        return strategy.run(replica)

    # Traced, as in a training step; eager, one replica after another (a
    # collective op there would wait for a replica not started yet).
    means, grads = (tf.function(step) if traced else step)()
    whole = rows.numpy().mean(axis=0)
    for mean in strategy.experimental_local_results(means):
        np.testing.assert_allclose(mean, whole)
    # The groups' shares add up to sum(mean^2), whose gradient at each of
    # the 4 rows is 2 mean / 4: each replica gets its rows'.
    for grad in strategy.experimental_local_results(grads):
        np.testing.assert_allclose(grad, np.tile(2 * whole / 4, (2, 1)), rtol=1e-6)


@pytest.mark.parametrize("module, mask", [
    ("mixtral.mixtral_decoder", None), ("mixtral.mixtral_decoder", "padding"),
    ("qwen_moe.qwen_moe_decoder", "attention"), ("qwen3_moe.qwen3_moe_decoder", "attention")])
def test_load_balancing_loss_is_keras_hubs_on_one_device(module, mask):
    decoder = pytest.importorskip(f"keras_hub.src.models.{module}")
    rng = np.random.default_rng(0)
    logits = keras.ops.convert_to_tensor(rng.normal(size=(16, 4)).astype("float32"))
    padding = np.ones((2, 8), "int32")
    padding[1, 5:] = 0
    masks = {None: None, "padding": padding,
             "attention": np.tril(np.ones((8, 8), "int32"))[None] * padding[:, :, None]}
    mask = None if masks[mask] is None else keras.ops.convert_to_tensor(masks[mask])
    ours = float(load_balancing_loss(logits, 4, 2, mask))
    assert ours == pytest.approx(float(decoder.compute_load_balancing_loss(logits, 4, 2, mask)),
                                 rel=1e-6)
