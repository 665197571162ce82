"""Models and training functions tfdist's step does not reach: never silently.

tf_keras (Keras 2) models, such as every TensorFlow Model Garden model, train
with their own step. Under an option only tfdist's step applies their `fit` is
refused before the first step (tfdist's step reaches them through
`strategy.train_step(model)` in a custom loop: test_tf_keras_step.py); with
data parallelism alone they train as under `MirroredStrategy`. A training
function of the user's own passed to `strategy.run` runs as written, and the
strategy says so once.
"""

import contextlib
import warnings

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tfdist
from helpers import data, devices, make_model

pytestmark = pytest.mark.model_garden  # conftest.py: collected where it is installed


def tf_keras_mlp():
    model = tf_keras.Sequential([tf_keras.layers.Dense(8, activation="relu"),
                                 tf_keras.layers.Dense(4)])
    model.compile(optimizer=tf_keras.optimizers.SGD(0.1),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("options, named", [
    (dict(microbatches=2), "microbatches=2"),
    (dict(zero=1), "zero=1"),
    (dict(xla=True), "xla=True"),
    (dict(precision="mixed_bfloat16"), "precision='mixed_bfloat16'"),
])
def test_tf_keras_fit_is_refused_under_step_level_options(options, named):
    strategy = tfdist.Strategy(data=2, devices=devices(2), **options)
    with strategy.scope():
        model = tf_keras_mlp()
    with pytest.raises(ValueError, match=rf"is a tf_keras \(Keras 2\) model: .*without {named}"
                                         r".*`strategy.train_step\(model\)`"):
        model.fit(*data(32), batch_size=16, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_tf_keras_fit_trains_data_parallel_like_one_device():
    # tf_keras's own step under data parallelism: the mean loss's gradients
    # summed over 2 replicas of even batches are one device's.
    x, y = data(64)
    results = []
    for strategy in (tfdist.Strategy(data=2, devices=devices(2)), None):
        with strategy.scope() if strategy else contextlib.nullcontext():
            tf_keras.utils.set_random_seed(0)
            model = tf_keras_mlp()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing to tell: nothing is skipped
            model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        results.append([w.numpy() for w in model.weights])
    for ours, theirs in zip(*results):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_model_garden_bert_classifier_fit_is_refused_under_zero():
    from official.nlp.modeling import models, networks

    strategy = tfdist.Strategy(data=2, zero=1, devices=devices(2))
    with strategy.scope():
        encoder = networks.BertEncoder(vocab_size=100, hidden_size=32, num_layers=2,
                                       num_attention_heads=2, max_sequence_length=16,
                                       inner_dim=64)
        model = models.BertClassifier(encoder, num_classes=2)
        model.compile(optimizer=tf_keras.optimizers.Adam(1e-3),
                      loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = {"input_word_ids": rng.integers(0, 100, (16, 16)),
         "input_mask": np.ones((16, 16), "int32"),
         "input_type_ids": np.zeros((16, 16), "int32")}
    with pytest.raises(ValueError,
                       match=r"'bert_classifier(_\d+)?' is a tf_keras .*without zero=1"):
        model.fit(x, rng.integers(0, 2, 16), batch_size=8, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_own_training_function_is_noticed_once_and_evaluation_not():
    strategy = tfdist.Strategy(data=2, microbatches=2, devices=devices(2))
    with strategy.scope():
        model = make_model()
    x = tf.constant(data(8)[0])

    def train_fn(batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(batch) ** 2)
        grads = tape.gradient(loss, model.trainable_weights)
        model.optimizer.apply_gradients(zip(grads, model.trainable_weights))
        return loss

    def evaluate_fn(batch):
        return tf.reduce_mean(model(batch))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            strategy.run(train_fn, args=(x,))
            strategy.run(evaluate_fn, args=(x,))
    messages = [str(w.message) for w in caught if "strategy.run" in str(w.message)]
    assert len(messages) == 1, messages
    assert "train_fn" in messages[0] and "microbatches=2" in messages[0]
    assert "strategy.train_step(model)" in messages[0]
