"""Models shaped like the keras-io examples, unchanged, in tfdist's modes.

The MNIST convnet, the text-classification Transformer (its own
`TokenAndPositionEmbedding` and `TransformerBlock` layers), the Conv1D +
BatchNormalization timeseries classifier and the subclassed model with its
own `train_step` ("customizing what happens in fit"), at tiny sizes: 12
steps' losses and the final weights against one device (fp32, rtol 1e-4),
with Adam and SGD. Dropout layers are kept but at rate 0: each replica draws
its own dropout masks, so no multi-device run can match one device's.
BatchNormalization normalises over each replica's (or microbatch's) rows, as
under plain `MirroredStrategy`: its reference is one device with the same
normalisation groups (`microbatches`), or plain one device where tfdist
keeps them (a tensor group computes on its whole batch).
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from helpers import assert_parity, devices, strategy_on_its_devices, train, trained_reference

STEPS, BATCH = 12, 16
OPTIMIZERS = {"adam": lambda: keras.optimizers.Adam(1e-2),
              "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9)}


def convnet(optimizer):
    """keras-io "Simple MNIST convnet", on 8 x 8 images."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(16, 2, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.0),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(optimizer=OPTIMIZERS[optimizer](), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


class TokenAndPositionEmbedding(keras.layers.Layer):
    """keras-io "Text classification with Transformer"'s embedding layer."""

    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        positions = keras.ops.arange(0, keras.ops.shape(x)[-1], 1)
        return self.token_emb(x) + self.pos_emb(positions)


class TransformerBlock(keras.layers.Layer):
    """keras-io "Text classification with Transformer"'s block."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.0, **kwargs):
        super().__init__(**kwargs)
        self.att = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([keras.layers.Dense(ff_dim, activation="relu"),
                                     keras.layers.Dense(embed_dim)])
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = keras.layers.Dropout(rate)
        self.dropout2 = keras.layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.dropout1(self.att(inputs, inputs))
        out1 = self.layernorm1(inputs + attn_output)
        return self.layernorm2(out1 + self.dropout2(self.ffn(out1)))


MAXLEN, VOCAB = 8, 32


def text_transformer(optimizer):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((MAXLEN,), dtype="int32")
    x = TokenAndPositionEmbedding(MAXLEN, VOCAB, 16)(inputs)
    x = TransformerBlock(16, 2, 16)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dropout(0.0)(x)
    x = keras.layers.Dense(20, activation="relu")(x)
    x = keras.layers.Dropout(0.0)(x)
    outputs = keras.layers.Dense(2, activation="softmax")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=OPTIMIZERS[optimizer](), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def conv1d_batch_norm(optimizer):
    """keras-io "Timeseries classification from scratch"'s fully convolutional net."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 1))
    x = inputs
    for _ in range(2):
        x = keras.layers.Conv1D(8, 3, padding="same")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(x))
    model.compile(optimizer=OPTIMIZERS[optimizer](), loss="sparse_categorical_crossentropy",
                  metrics=["sparse_categorical_accuracy"])
    return model


class CustomModel(keras.Model):
    """keras-io "Customizing what happens in fit()": its own `train_step`."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def subclassed(optimizer):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    model = CustomModel(inputs, keras.layers.Dense(4)(hidden))
    model.compile(optimizer=OPTIMIZERS[optimizer](),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def model_data(name, n=STEPS * BATCH, seed=0):
    rng = np.random.default_rng(seed)
    if name == "convnet":
        x = rng.normal(size=(n, 8, 8, 1)).astype("float32")
        return x, (x[:, :4, :4, 0].sum((1, 2)) > 0).astype("int32") * 3 + (x[:, 0, 0, 0] > 0)
    if name == "text_transformer":
        x = rng.integers(0, VOCAB, size=(n, MAXLEN)).astype("int32")
        return x, (x[:, 0] < VOCAB // 2).astype("int32")
    if name == "conv1d_batch_norm":
        x = (rng.normal(size=(n, 16, 1)) + np.arange(n)[:, None, None] * 0.05).astype("float32")
        return x, (x[:, :8, 0].mean(1) > x[:, 8:, 0].mean(1)).astype("int32")
    x = rng.normal(size=(n, 16)).astype("float32")
    return x, x[:, :4].argmax(-1).astype("int32")


MAKERS = {"convnet": convnet, "text_transformer": text_transformer,
          "conv1d_batch_norm": conv1d_batch_norm, "subclassed": subclassed}


_MADE = {}


def maker(name, optimizer):
    """The recipe of `name` with `optimizer`, one function per pair (so that
    `trained_reference` trains each reference once)."""
    key = (name, optimizer)
    if key not in _MADE:
        def make():  # a function, not a lambda: its reference is kept on disk too
            return MAKERS[name](optimizer)
        _MADE[key] = make
    return _MADE[key]

# Every mode of the real-model suite; each model in each, Adam and SGD
# alternating. With Adam and the batch split, the text Transformer's position
# embedding (an Embedding of arange(8)) gets one gradient slice per position
# from one device, and one per position per replica or microbatch unless they
# are summed (`sparse_gradients.sum_fixed_lookups`); Keras's sparse Adam
# squares each.
MODES = [dict(data=4), dict(data=2, zero=1), dict(data=2, zero=2),
         dict(data=2, microbatches=2),
         dict(pipeline=2, microbatches=2, schedule="gpipe"),
         dict(pipeline=2, microbatches=2, schedule="1f1b"),
         dict(tensor=2), dict(data=2, tensor=2, zero=1),
         dict(pipeline=2, tensor=2, microbatches=2)]
# The batch-norm model with SGD only: its convolutions' biases, each followed
# by a BatchNormalization that subtracts the mean, get gradients that are
# zero up to rounding, and Adam's update of such a gradient is about its
# learning rate whichever sign the rounding gave it (measured: 2e-3 off one
# device in those biases at data=4, with the losses within 2e-7).
# The convolutional models have nothing `tensor` splits: refused (below).
CASES = [(name, "sgd" if name == "conv1d_batch_norm" else ("sgd", "adam")[(m + i) % 2], mode)
         for m, name in enumerate(("convnet", "text_transformer", "conv1d_batch_norm"))
         for i, mode in enumerate(MODES)
         if name == "text_transformer" or "tensor" not in mode]


_GROUPED = {}


def grouped_reference(optimizer, groups):
    """The batch-norm model on one device normalising over the rows of each
    of `groups` parts of a batch (`microbatches=groups`), as `groups` replicas
    or microbatches do; plain one device for one group (a tensor group
    computes on its whole batch)."""
    x, y = model_data("conv1d_batch_norm")
    make = maker("conv1d_batch_norm", optimizer)
    if groups == 1:
        return trained_reference(make=make, x=x, y=y, batch_size=BATCH)
    if (optimizer, groups) not in _GROUPED:
        _GROUPED[optimizer, groups] = train(
            tfdist.Strategy(microbatches=groups, devices=devices(1)), make=make, x=x, y=y,
            batch_size=BATCH)
    return _GROUPED[optimizer, groups]


def case_id(case):
    name, optimizer, config = case
    return "-".join([name, optimizer, *(f"{k}{v}" for k, v in config.items())])


@pytest.mark.parametrize("name, optimizer, config", CASES, ids=map(case_id, CASES))
def test_matches_one_device(name, optimizer, config):
    x, y = model_data(name)
    make = maker(name, optimizer)
    if name == "conv1d_batch_norm":
        reference = grouped_reference(optimizer, config.get("data", 1)
                                      * config.get("microbatches", 1))
    else:
        reference = trained_reference(make=make, x=x, y=y, batch_size=BATCH)
    result = train(strategy_on_its_devices(**config), make=make, x=x, y=y, batch_size=BATCH)
    # The attention's key bias has no true gradient (softmax ignores a shift
    # shared by all keys): Adam turns its rounding noise into updates, so it
    # stays below 1e-6 and differs by reduction order (measured 1.02e-6 at
    # data=4); every other weight differs by about 1e-7, far inside rtol.
    atol = 5e-6 if name == "text_transformer" and optimizer == "adam" else 1e-6
    assert_parity(result, reference, steps=STEPS, atol=atol)


@pytest.mark.parametrize("name", ["convnet", "conv1d_batch_norm"])
def test_tensor_is_refused_where_nothing_splits(name):
    """Convolutions and a softmax classifier have no tensor-parallel layout:
    `tensor` is refused before the first step, naming each layer and why."""
    x, y = model_data(name)
    strategy = tfdist.Strategy(tensor=2, devices=devices(2))
    with pytest.raises(ValueError, match=r"tensor=2 splits no layer of model .*"
                       r"\(Conv[12]D\): Conv[12]D has no tensor-parallel layout.*Use data "
                       r"parallelism") as refused:
        with strategy.scope():
            model = maker(name, "sgd")()
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert "(Dense)" in str(refused.value)
    assert not model.optimizer.iterations.numpy()


@pytest.mark.parametrize("optimizer, size", [("adam", 4), ("sgd", 2)])
def test_own_train_step_trains_like_one_device(optimizer, size):
    """tfdist runs the model's own `train_step` in each replica (data
    parallelism; step-level modes are refused for it). Its `compute_loss` is
    divided by the replicas (Keras's scaling for distribution) and the
    keras-io step reports it as is: the logged loss is 1/N of one device's."""
    x, y = model_data("subclassed")
    make = maker("subclassed", optimizer)
    reference = trained_reference(make=make, x=x, y=y, batch_size=BATCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, weights, _ = train(tfdist.Strategy(data=size, devices=devices(size)),
                                   make=make, x=x, y=y, batch_size=BATCH)
    assert_parity(([loss * size for loss in losses], weights, None), reference, steps=STEPS)
    assert not [w for w in caught if "not scaled for distribution" in str(w.message)]


class VAE(keras.Model):
    """keras-io "Variational AutoEncoder"'s own `train_step`: reconstruction
    and KL losses from `keras.ops` (no `Loss` object), on 16 features, the
    sampling's noise at scale 0 (each replica would draw its own). With
    `scaled`, the loss is divided by the replicas, as a distributed step must."""

    def __init__(self, scaled, **kwargs):
        super().__init__(**kwargs)
        self.scaled = scaled
        self.encoder = keras.Sequential([keras.layers.Dense(8, activation="relu"),
                                         keras.layers.Dense(4)])
        self.decoder = keras.Sequential([keras.layers.Dense(8, activation="relu"),
                                         keras.layers.Dense(16, activation="sigmoid")])

    def call(self, x):
        z_mean, _ = keras.ops.split(self.encoder(x), 2, axis=-1)
        return self.decoder(z_mean)

    def train_step(self, data):
        x, _ = data
        with tf.GradientTape() as tape:
            z_mean, z_log_var = keras.ops.split(self.encoder(x), 2, axis=-1)
            reconstruction = self.decoder(z_mean + 0.0 * keras.ops.exp(0.5 * z_log_var))
            reconstruction_loss = keras.ops.mean(keras.ops.sum(
                keras.losses.binary_crossentropy(x[..., None], reconstruction[..., None]),
                axis=1))
            kl = -0.5 * (1 + z_log_var - keras.ops.square(z_mean) - keras.ops.exp(z_log_var))
            loss = reconstruction_loss + keras.ops.mean(keras.ops.sum(kl, axis=1))
            if self.scaled:
                loss = loss / self.distribute_strategy.num_replicas_in_sync
        gradients = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_weights))
        return {"loss": loss}


def vae(scaled):
    def make():
        keras.utils.set_random_seed(0)
        model = VAE(scaled)
        model.build((None, 16))
        model.compile(optimizer=keras.optimizers.SGD(0.05))
        return model
    return make


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
def test_own_train_step_with_an_unscaled_loss_is_told(scaled):
    """A loss that never reads the replica count is summed over replicas: N x
    one device's gradient, which tfdist says before training; the same step
    dividing by the replicas matches one device and is not told."""
    x = np.random.default_rng(0).uniform(size=(STEPS * BATCH, 16)).astype("float32")
    y = np.zeros(len(x), "float32")
    make = vae(scaled)
    reference = train(make=make, x=x, y=y, batch_size=BATCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, weights, _ = train(tfdist.Strategy(data=2, devices=devices(2)), make=make,
                                   x=x, y=y, batch_size=BATCH)
    told = [str(w.message) for w in caught if "not scaled for distribution" in str(w.message)]
    if scaled:
        assert not told
        assert_parity(([loss * 2 for loss in losses], weights, None), reference, steps=STEPS)
    else:
        assert len(told) == 1 and told[0].startswith(
            "VAE overrides `train_step`, and its step never read the number of replicas (2)")
        assert "2x one device's gradient" in told[0]
        with pytest.raises(AssertionError):  # what it warns of
            assert_parity((losses, weights, None), reference, steps=STEPS)
