"""`tfdist.plan(..., measure=K)`: the first K plans that fit are trained here
and ranked by their measured step time."""

import keras
import numpy as np
import tensorflow as tf

import tfdist


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,))]
                             + [keras.layers.Dense(64, "relu") for _ in range(4)]
                             + [keras.layers.Dense(4)])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_measured_plans_come_first_ranked_by_their_measured_time():
    read = []

    def dataset(batch_size):
        read.append(batch_size)
        rng = np.random.default_rng(0)
        return tf.data.Dataset.from_tensors(
            (rng.standard_normal((batch_size, 32)).astype("float32"),
             rng.integers(0, 4, batch_size).astype("int32")))

    plans = tfdist.plan(build, devices=4, memory_per_device="1GiB", batch_size=16,
                        device_flops=1e10, measure=2, steps=4, dataset=dataset)
    measured = [p for p in plans if p.measured is not None]
    assert len(measured) == 2 and plans[:2] == measured
    assert measured[0].measured <= measured[1].measured
    assert all(p.measured > 0 and p.fits for p in measured)
    assert read == [16, 16]  # each measured plan read the dataset's batches
    assert "measured ms" in plans.table().splitlines()[0]
