"""Tensor parallelism on Transformer blocks built from Keras layers: parity of an
embedding + attention + MLP language model, Megatron's collective count, and
checkpoints that hold full tensors."""

import contextlib
import re

import keras
import numpy as np
import pytest

import tfdist
from helpers import assert_parity, devices, train, trained_reference
from test_engine import executed_op_counts
from tfdist.tensor.plan import sharded_classifier

SEQ, WIDTH, HEADS, FF, VOCAB = 8, 16, 4, 32, 24


def block(x):
    """A post-norm Transformer block of plain Keras layers."""
    attended = keras.layers.MultiHeadAttention(HEADS, key_dim=WIDTH // HEADS)(x, x)
    x = keras.layers.LayerNormalization()(x + attended)
    hidden = keras.layers.Dense(FF, activation="gelu")(x)
    return keras.layers.LayerNormalization()(x + keras.layers.Dense(WIDTH)(hidden))


def compile_lm(model):
    # SGD with momentum: Adam's first steps move each weight by about +-lr
    # whatever the gradient's size, so gradients that are ~0 up to rounding
    # (summed in another order here) would differ by 2 lr, not by rounding.
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def make_lm(seed=0):
    """Embedding, one block, a vocabulary classifier: next-token prediction."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((SEQ,), dtype="int32")
    x = block(keras.layers.Embedding(VOCAB, WIDTH)(tokens))
    return compile_lm(keras.Model(tokens, keras.layers.Dense(VOCAB)(x)))


def lm_data(n=320, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=(n, SEQ + 1)).astype("int32")
    tokens[:, 1::2] = (tokens[:, 0:-1:2] * 5 + 3) % VOCAB  # something to learn
    return tokens[:, :-1], tokens[:, 1:]


@pytest.fixture(scope="module")
def reference():
    x, y = lm_data()
    return trained_reference(make=make_lm, x=x, y=y, batch_size=16)


@pytest.mark.parametrize("data_size, tensor", [(1, 2), (1, 4), (2, 2)])
def test_transformer_lm_matches_one_device(reference, data_size, tensor):
    x, y = lm_data()
    strategy = tfdist.Strategy(data=data_size, tensor=tensor,
                               devices=devices(data_size * tensor))
    result = train(strategy, make=make_lm, x=x, y=y, batch_size=16)
    # Attention, the MLP and the embedding each sum partial results over the
    # tensor group, in another order than one device: 1e-4 holds.
    assert_parity(result, reference)
    layouts = {line.split()[1]: line.split()[2]
               for line in strategy.describe(result[2]).splitlines()
               if line.split()[1] != "Dense"}
    assert layouts == {"Embedding": "vocabulary", "MultiHeadAttention": "heads",
                       "LayerNormalization": "replicated"}
    dense = [line.split()[2] for line in strategy.describe(result[2]).splitlines()
             if line.split()[1] == "Dense"]
    assert dense == ["column", "row", "replicated"]


def make_two_blocks(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((SEQ, WIDTH))
    # A (replicated) input projection: the first block's input needs its
    # gradient, as after an embedding.
    x = keras.layers.Dense(WIDTH)(inputs)
    return compile_lm(keras.Model(inputs, keras.layers.Dense(VOCAB)(block(block(x)))))


@pytest.mark.parametrize("data_size, tensor", [(1, 4), (2, 2)])
def test_two_all_reduces_forward_and_two_backward_per_block(data_size, tensor):
    n = data_size * tensor
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, SEQ, WIDTH)).astype("float32")
    y = rng.integers(0, VOCAB, size=(32, SEQ)).astype("int32")
    strategy = tfdist.Strategy(data=data_size, tensor=tensor, devices=devices(n))
    _, _, model = train(strategy, make=make_two_blocks, x=x, y=y, batch_size=16)
    counts = executed_op_counts(model)
    blocks = 2
    # Megatron: per block, forward the attention output's and the MLP
    # output's all-reduce, backward those of their inputs' gradients. Plus
    # one packed all-reduce of the gradients and metric states across data
    # groups when data > 1, and the row count's over every replica.
    per_replica = blocks * (2 + 2) + (1 if data_size > 1 else 0) + 1
    assert counts["CollectiveReduceV2"] == n * per_replica
    # The tensor group exchanges its batch: x and y (float32 and int32: one
    # gather each). The trace counts the slices' rows (32 examples in
    # batches of 16), so no rank's row count is exchanged, nothing padded.
    assert counts["CollectiveGatherV2"] == n * 2


def test_checkpoints_hold_full_tensors_both_ways(tmp_path):
    x, y = lm_data(64)
    strategy = tfdist.Strategy(data=1, tensor=4, devices=devices(4))
    _, _, parallel = train(strategy, make=make_lm, x=x, y=y, batch_size=16)
    path = str(tmp_path / "lm.weights.h5")
    parallel.save_weights(path)
    plain = make_lm(seed=1)
    plain.optimizer.build(plain.trainable_variables)  # the file holds its state too
    plain.load_weights(path)
    for a, b in zip(plain.optimizer.variables, parallel.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    expected = parallel.predict(x, batch_size=16, verbose=0)
    np.testing.assert_allclose(plain.predict(x, batch_size=16, verbose=0), expected,
                               rtol=1e-5, atol=1e-6)
    for a, b in zip(plain.weights, parallel.weights):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # evaluate too: each tensor group evaluates its batch once.
    np.testing.assert_allclose(parallel.evaluate(x, y, batch_size=16, verbose=0),
                               plain.evaluate(x, y, batch_size=16, verbose=0), rtol=1e-5)
    # The reverse: unpartitioned weights into a fresh tensor-parallel model.
    with strategy.scope():
        again = make_lm(seed=2)
    again.fit(x[:16], y[:16], batch_size=16, verbose=0)  # partitions, then a step
    again.load_weights(path)
    np.testing.assert_allclose(again.predict(x, batch_size=16, verbose=0), expected,
                               rtol=1e-5, atol=1e-6)
    assert again.layers[1].embeddings.value.values[3].shape == (VOCAB // 4, WIDTH)


@pytest.mark.parametrize("data_size, tensor", [(1, 2), (1, 4), (2, 2)])
def test_vocab_parallel_classifier_matches_one_device(reference, data_size, tensor):
    x, y = lm_data()
    strategy = tfdist.Strategy(data=data_size, tensor=tensor, vocab_parallel_classifier=True,
                               devices=devices(data_size * tensor))
    result = train(strategy, make=make_lm, x=x, y=y, batch_size=16)
    assert_parity(result, reference)
    model = result[2]
    head = model.layers[-1]
    assert sharded_classifier(model)
    assert re.search(rf"{head.name}\s+Dense\s+classifier\s+{VOCAB} classes -> "
                     rf"{VOCAB // tensor} per device", strategy.describe(model))
    # Each device holds 1/t of the classifier; evaluate and predict see all classes.
    for weight in (head.kernel, head.bias):
        shards = weight.value.values
        assert all(s.shape[-1] == VOCAB // tensor for s in shards)
    plain = make_lm()
    plain.set_weights(model.get_weights())
    np.testing.assert_allclose(model.predict(x[:32], verbose=0), plain.predict(x[:32], verbose=0),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model.evaluate(x, y, verbose=0), plain.evaluate(x, y, verbose=0),
                               rtol=1e-5)


def test_vocab_parallel_classifier_metrics_and_refusals():
    def make(metrics=("accuracy",), loss=None, seed=0):
        keras.utils.set_random_seed(seed)
        tokens = keras.Input((SEQ,), dtype="int32")
        x = block(keras.layers.Embedding(VOCAB, WIDTH)(tokens))
        model = keras.Model(tokens, keras.layers.Dense(VOCAB)(x))
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), metrics=list(metrics),
                      loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x, y = lm_data()
    histories = []
    for strategy in (None, tfdist.Strategy(tensor=2, vocab_parallel_classifier=True,
                                           devices=devices(2))):
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = make()
        histories.append(model.fit(x, y, batch_size=16, epochs=2, shuffle=False,
                                   verbose=0).history)
    np.testing.assert_allclose(histories[1]["accuracy"], histories[0]["accuracy"], atol=1e-6)

    strategy = tfdist.Strategy(tensor=2, vocab_parallel_classifier=True, devices=devices(2))
    with strategy.scope():
        model = make()
    assert re.search(r"Dense\s+classifier\s+24 classes -> 12 per device",
                     strategy.describe(model))  # before any step
    with strategy.scope():
        model = make(loss="mse")
    assert re.search(r"Dense\s+replicated\s+a sharded softmax loss needs the model compiled",
                     strategy.describe(model))
    with pytest.raises(ValueError, match=r"`vocab_parallel_classifier=True` .* `tensor=1`"):
        tfdist.Strategy(vocab_parallel_classifier=True, devices=devices(2))
