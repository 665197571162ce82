"""tfdist's step for tf_keras (Keras 2) models in a custom loop: a Model Garden
`BertClassifier` trained by an orbit `StandardTrainer` running
`strategy.train_step(model)`, against tf_keras's own step on one device with
the same weights and data order."""

import contextlib
import inspect

import numpy as np
import orbit
import pytest
import tensorflow as tf
import tf_keras

import tfdist
from helpers import cached_reference, devices, recipe_text
from tfdist.input_options import without_autotuning
from tfdist.sharding.storage import ShardedStorage

pytestmark = pytest.mark.model_garden  # conftest.py: collected where it is installed

STEPS, BATCH, SEQUENCE = 10, 16, 16


def bert_classifier():
    from official.nlp.modeling import models, networks

    encoder = networks.BertEncoder(vocab_size=100, hidden_size=32, num_layers=2,
                                   num_attention_heads=2, max_sequence_length=SEQUENCE,
                                   inner_dim=64, dropout_rate=0.0, attention_dropout_rate=0.0)
    model = models.BertClassifier(encoder, num_classes=3, dropout_rate=0.0)
    model.compile(optimizer=tf_keras.optimizers.Adam(1e-2),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[tf_keras.metrics.SparseCategoricalAccuracy("accuracy")])
    return model


def dataset():
    rng = np.random.default_rng(0)
    n = STEPS * BATCH
    x = {"input_word_ids": rng.integers(0, 100, (n, SEQUENCE)).astype("int32"),
         "input_mask": np.ones((n, SEQUENCE), "int32"),
         "input_type_ids": (rng.random((n, SEQUENCE)) < 0.5).astype("int32")}
    return without_autotuning(tf.data.Dataset.from_tensor_slices(
        (x, rng.integers(0, 3, n))).batch(BATCH, drop_remainder=True))


@contextlib.contextmanager
def tf_keras_policy(name):
    previous = tf_keras.mixed_precision.global_policy()
    tf_keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        tf_keras.mixed_precision.set_global_policy(previous)


def resnet_classifier():
    """A small Model Garden vision classifier: ResNet-10 at a quarter of its
    width, synchronized BatchNormalization (statistics over the global batch)."""
    from official.vision.modeling import classification_model
    from official.vision.modeling.backbones import resnet

    spec = tf_keras.layers.InputSpec(shape=[None, 16, 16, 3])
    backbone = resnet.ResNet(model_id=10, input_specs=spec, depth_multiplier=0.25,
                             use_sync_bn=True)
    model = classification_model.ClassificationModel(backbone, num_classes=3,
                                                     input_specs=spec, dropout_rate=0.0)
    # At learning rate 0.05 this training is chaotic: two one-device runs that
    # differ only in TensorFlow's intra-op thread count (1 or 2: another order
    # of the convolutions' float sums) end 2.9e-2 apart in weights; at 0.01
    # they agree to 2.4e-7, and tfdist's data=2 to 1.8e-7.
    model.compile(optimizer=tf_keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def images():
    rng = np.random.default_rng(0)
    n = STEPS * BATCH
    return without_autotuning(tf.data.Dataset.from_tensor_slices(
        (rng.normal(size=(n, 16, 16, 3)).astype("float32"), rng.integers(0, 3, n))).batch(
        BATCH, drop_remainder=True))


def train(strategy, initial, precision="float32", make=bert_classifier, data=dataset):
    """(per-step losses, final weights) of `STEPS` orbit steps: tfdist's step
    under `strategy`, or tf_keras's own `train_step` on one device (None)."""
    with (strategy.scope() if strategy else tf_keras_policy(precision)):
        model = make()
    data = data()
    if not model.built:
        model(next(iter(data))[0])
    model.set_weights(initial)
    if strategy:
        step = strategy.train_step(model)
        step.build(data.element_spec)
        data = strategy.experimental_distribute_dataset(data)
    else:
        strategy = tf.distribute.get_strategy()
        step = model.train_step

    class Trainer(orbit.StandardTrainer):
        def train_loop_begin(self):
            model.reset_metrics()

        def train_step(self, iterator):
            strategy.run(step, args=(next(iterator),))

        def train_loop_end(self):
            return {k: tf.convert_to_tensor(v) for k, v in model.get_metrics_result().items()}

    losses = []
    orbit.Controller(strategy=strategy, trainer=Trainer(data, orbit.StandardTrainerOptions(
        use_tf_while_loop=False)), global_step=model.optimizer.iterations,
        steps_per_loop=1, train_actions=[lambda out: losses.append(float(out["loss"]))],
    ).train(steps=STEPS)
    return losses, [w.numpy() for w in model.weights], model


@pytest.fixture(scope="module")
def initial():
    tf_keras.utils.set_random_seed(0)
    return bert_classifier().get_weights()


@pytest.fixture(scope="module")
def reference(initial):
    """One device's (losses, weights) (no model), once per pytest run."""
    recipe = [inspect.getsource(train), recipe_text(bert_classifier), recipe_text(dataset)]
    return cached_reference([*recipe, f"{STEPS} {BATCH} {SEQUENCE}"], initial,
                            lambda: train(None, initial))


@pytest.fixture(scope="module")
def zero1(initial):
    """The classifier trained at data=2, zero=1: compared with one device, and
    checkpointed (the tests only read it)."""
    return train(tfdist.Strategy(data=2, zero=1, devices=devices(2)), initial)


# (Plain data parallelism and plain microbatches: the last case without its
# sharding.)
@pytest.mark.parametrize("config", [dict(data=2, xla=True), dict(data=2, zero=1),
                                    dict(data=4, zero=2, microbatches=2)],
                         ids=["data2-xla", "data2-zero1", "data4-zero2-microbatches2"])
def test_bert_classifier_matches_one_device(config, initial, reference, request):
    size = config["data"]
    if config == dict(data=2, zero=1):
        losses, weights, model = request.getfixturevalue("zero1")
    else:
        losses, weights, model = train(tfdist.Strategy(devices=devices(size), **config),
                                       initial)
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, reference[0], rtol=1e-4)
    for ours, theirs in zip(weights, reference[1]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    assert int(model.optimizer.iterations.numpy()) == STEPS
    if config.get("zero"):
        assert len(model.optimizer.variables) == 1 + 2 * len(model.trainable_variables)
        assert_one_shard_of_every_slot_per_device(model.optimizer, size)


def test_mixed_float16_matches_one_device_with_loss_scaling(initial):
    losses, weights, model = train(
        tfdist.Strategy(data=2, precision="mixed_float16", devices=devices(2)), initial)
    assert type(model.optimizer).__name__.startswith("LossScaleOptimizer")
    assert {layer.compute_dtype for layer in model.submodules
            if hasattr(layer, "compute_dtype")} >= {"float16"}
    reference = train(None, initial, precision="mixed_float16")
    np.testing.assert_allclose(losses, reference[0], rtol=2e-3)
    # float16 sums of 8 rows per replica round otherwise than of 16 on one
    # device, and Adam's normalised steps (1e-2 each) amplify that on weights
    # whose gradients are near zero (their sign flips with the rounding):
    # every weight within two steps of one device's, nearly all within one.
    for ours, theirs in zip(weights, reference[1]):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-2)
    off = np.concatenate([np.abs(a - b).ravel() for a, b in zip(weights, reference[1])])
    assert np.mean(off > 1e-2) < 1e-3, np.sort(off)[-10:]


@pytest.fixture(scope="module")
def resnet_reference():
    """(initial weights, one device's losses and weights) of the ResNet classifier."""
    tf_keras.utils.set_random_seed(0)
    model = resnet_classifier()
    model(next(iter(images()))[0])
    initial = model.get_weights()
    return initial, train(None, initial, make=resnet_classifier, data=images)


def test_model_garden_resnet_with_synchronized_batch_norm_matches_one_device(resnet_reference):
    initial, reference = resnet_reference
    losses, weights, _ = train(tfdist.Strategy(data=2, devices=devices(2)), initial,
                               make=resnet_classifier, data=images)
    np.testing.assert_allclose(losses, reference[0], rtol=1e-4)
    for ours, theirs in zip(weights, reference[1]):  # moving statistics included
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def assert_one_shard_of_every_slot_per_device(optimizer, replicas):
    slots = [v for v in optimizer.variables if v is not optimizer.iterations]
    for slot in slots:
        assert isinstance(slot, ShardedStorage)
        size = slot.shape.num_elements()
        shards = slot.values
        assert len({shard.device for shard in shards}) == replicas
        assert [shard.shape.num_elements() for shard in shards] == [-(-size // replicas)] * replicas
    held = sum(shard.shape.num_elements() for slot in slots for shard in slot.values)
    full = sum(slot.shape.num_elements() for slot in slots)
    assert full <= held < full + replicas * len(slots)  # 1/N per device, plus padding


def test_zero_checkpoints_hold_full_slots_and_reshard(zero1, tmp_path):
    _, _, model = zero1
    state = [v.numpy() for v in model.optimizer.variables]
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(tmp_path / "ckpt"))
    # Into one device (unsharded) and into 4 replicas of zero=2 (resharded).
    one = bert_classifier()
    one.optimizer.build(one.trainable_variables)
    strategy = tfdist.Strategy(data=4, zero=2, devices=devices(4))
    with strategy.scope():
        four = bert_classifier()
    four(next(iter(dataset()))[0])
    strategy.train_step(four).build(dataset().element_spec)
    for restored in (one, four):
        tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(
            path).assert_consumed()
        assert len(restored.optimizer.variables) == len(state)
        for theirs, ours in zip(state, restored.optimizer.variables):
            np.testing.assert_array_equal(ours.numpy(), theirs)
    assert isinstance(four.optimizer.variables[1], ShardedStorage)


def test_model_garden_resnet_under_zero_matches_one_device(resnet_reference):
    initial, reference = resnet_reference
    losses, weights, model = train(tfdist.Strategy(data=2, zero=1, devices=devices(2)),
                                   initial, make=resnet_classifier, data=images)
    np.testing.assert_allclose(losses, reference[0], rtol=1e-4)
    for ours, theirs in zip(weights, reference[1]):  # moving statistics included
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    assert_one_shard_of_every_slot_per_device(model.optimizer, 2)


@pytest.mark.parametrize("options, named", [(dict(tensor=2), "tensor=2"),
                                            (dict(pipeline=2), "pipeline=2"),
                                            (dict(zero=3), "zero=3")])
def test_keras3_only_modes_are_refused_for_tf_keras_models(options, named):
    size = 2 * options.get("tensor", 1) * options.get("pipeline", 1)
    strategy = tfdist.Strategy(data=2, devices=devices(size), **options)
    with strategy.scope():
        model = bert_classifier()
    with pytest.raises(NotImplementedError, match=rf"'bert_classifier(_\d+)?' is a tf_keras "
                                                  rf"\(Keras 2\) model: .*not {named}"):
        strategy.train_step(model)


@pytest.mark.parametrize("options, optimizer, error, message", [
    (dict(), lambda: tf_keras.optimizers.legacy.Adam(1e-2), NotImplementedError,
     r"`zero=1` takes tf_keras's v2.11\+ optimizers .*legacy.*'adam_experimental'"),
    (dict(), lambda: tf_keras.optimizers.Nadam(1e-2), ValueError,
     r"`zero=1` .*does not know .*Nadam to be. Supported tf_keras optimizers: SGD, Adam"),
    (dict(), lambda: tf_keras.optimizers.Adam(1e-2, clipnorm=1.0), NotImplementedError,
     r"`clipnorm=1.0` on the optimizer is not supported with `zero=1`"),
    (dict(precision="mixed_float16"), lambda: tf_keras.optimizers.Adam(1e-2),
     NotImplementedError, r"`zero=1` with a tf_keras LossScaleOptimizer"),
], ids=["legacy", "not-elementwise", "clipnorm", "loss-scaling"])
def test_zero_refuses_what_it_cannot_shard(options, optimizer, error, message):
    # The refusal is the optimizer's: any tf_keras model will do.
    strategy = tfdist.Strategy(data=2, zero=1, devices=devices(2), **options)
    with strategy.scope():
        model = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(3)])
        inner = optimizer()
        model.compile(optimizer=tf_keras.mixed_precision.LossScaleOptimizer(inner)
                      if options else inner,
                      loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(error, match=message):
        strategy.train_step(model)
