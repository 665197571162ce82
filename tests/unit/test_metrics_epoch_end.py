"""tfdist.callbacks.Metrics writes at every epoch's end, so short runs get their scalars."""

import keras
import numpy as np
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

import tfdist


def test_default_metrics_write_throughput_at_epoch_end_of_a_short_fit(tmp_path):
    strategy = tfdist.Strategy(devices=["CPU:0", "CPU:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
    x, y = np.ones((32 * 16, 4), "float32"), np.ones((32 * 16, 2), "float32")
    model.fit(x, y, batch_size=16, epochs=2, verbose=0,  # 32 steps per epoch
              callbacks=[tfdist.callbacks.Metrics(tmp_path)])  # every_n_steps=100
    events = event_accumulator.EventAccumulator(
        str(tmp_path / "tfdist"), size_guidance={event_accumulator.TENSORS: 0})
    events.Reload()
    rates = [(e.step, float(tf.make_ndarray(e.tensor_proto)))
             for e in events.Tensors("tfdist/examples_per_second")]
    assert [step for step, _ in rates] == [32, 64]
    assert all(rate > 0 for _, rate in rates)
