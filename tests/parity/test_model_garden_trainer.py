"""The Model Garden's own trainer (`official.core`) with tfdist's step: a small
sentence-classification Task (a tiny BertEncoder over synthetic data) trained
by `tfdist.model_garden.Trainer` under a tfdist strategy, against
`official.core.base_trainer.Trainer` on one device with the same weights and
data order."""

import numpy as np
import orbit
import pytest
import tensorflow as tf
import tf_keras
from official.core import base_task, base_trainer
from official.core import config_definitions as cfg

import tfdist
from helpers import devices
from tfdist.input_options import without_autotuning
from tfdist.model_garden import Trainer
from tfdist.sharding.storage import ShardedStorage

pytestmark = pytest.mark.model_garden  # conftest.py: collected where it is installed

STEPS, BATCH, SEQUENCE = 10, 16, 16


class SentenceTask(base_task.Task):
    """Classifies synthetic token sequences into 3 classes."""

    def build_model(self):
        from official.nlp.modeling import models, networks

        encoder = networks.BertEncoder(
            vocab_size=100, hidden_size=32, num_layers=2, num_attention_heads=2,
            max_sequence_length=SEQUENCE, inner_dim=64, dropout_rate=0.0,
            attention_dropout_rate=0.0)
        return models.BertClassifier(encoder, num_classes=3, dropout_rate=0.0)

    def build_inputs(self, params, input_context=None):
        rng = np.random.default_rng(0)
        n = STEPS * BATCH
        x = {"input_word_ids": rng.integers(0, 100, (n, SEQUENCE)).astype("int32"),
             "input_mask": np.ones((n, SEQUENCE), "int32"),
             "input_type_ids": np.zeros((n, SEQUENCE), "int32")}
        labels = rng.integers(0, 3, n).astype("int32")
        # Without tf.data autotuning, as the other one-device references read
        # (helpers._batches): destroying an iterator with it waits for its
        # autotuning thread's sleep, which grows with the iterator's age.
        return without_autotuning(tf.data.Dataset.from_tensor_slices((x, labels))
                                  .batch(BATCH, drop_remainder=True))

    def build_losses(self, labels, model_outputs, aux_losses=None):
        loss = tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(
            labels, tf.cast(model_outputs, tf.float32), from_logits=True))
        return loss + tf.add_n(aux_losses) if aux_losses else loss

    def build_metrics(self, training=None):
        return [tf_keras.metrics.SparseCategoricalAccuracy("accuracy")]

    def process_metrics(self, metrics, labels, model_outputs, **kwargs):
        for metric in metrics:
            metric.update_state(labels, model_outputs)


def experiment():
    return cfg.ExperimentConfig(trainer=cfg.TrainerConfig(train_tf_while_loop=False))


def train(strategy, initial):
    """(per-step training losses, final weights, trainer) of `STEPS` orbit
    steps: tfdist's trainer under `strategy`, or official.core's own on one
    device (None)."""
    config = experiment()
    task = SentenceTask(config.task)
    dataset = task.build_inputs(None)
    with strategy.scope() if strategy else tf.distribute.get_strategy().scope():
        model = task.build_model()
        model(next(iter(dataset))[0])  # creates the weights
        if initial is not None:
            model.set_weights(initial)
        optimizer = tf_keras.optimizers.Adam(1e-2)
        kind = Trainer if strategy else base_trainer.Trainer
        trainer = kind(config, task, model, optimizer, train=True, evaluate=False,
                       train_dataset=strategy.experimental_distribute_dataset(dataset)
                       if strategy else dataset)
    losses = []
    orbit.Controller(trainer=trainer, strategy=strategy or tf.distribute.get_strategy(),
                     global_step=trainer.global_step, steps_per_loop=1,
                     train_actions=[lambda out: losses.append(float(out["training_loss"]))],
                     ).train(steps=STEPS)
    return losses, [w.numpy() for w in model.weights], trainer


@pytest.fixture(scope="module")
def initial():
    tf_keras.utils.set_random_seed(0)
    model = SentenceTask(experiment().task).build_model()
    model(next(iter(SentenceTask(experiment().task).build_inputs(None)))[0])
    return model.get_weights()


@pytest.fixture(scope="module")
def reference(initial):
    """The one-device run's losses and weights; not its trainer, whose
    dataset iterator would live as long as the module."""
    return train(None, initial)[:2]


# Data parallelism, microbatches and ZeRO 1/2 in two trainings (plain data
# parallelism and plain microbatches are the same steps without the sharding).
@pytest.mark.parametrize("config", [dict(data=2, zero=1, microbatches=2), dict(data=4, zero=2)],
                         ids=["data2-zero1-microbatches2", "data4-zero2"])
def test_official_core_trainer_matches_one_device(config, initial, reference):
    losses, weights, trainer = train(tfdist.Strategy(devices=devices(config["data"]), **config),
                                     initial)
    np.testing.assert_allclose(losses, reference[0], rtol=1e-4)
    for ours, theirs in zip(weights, reference[1]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    assert int(trainer.global_step.numpy()) == int(trainer.optimizer.iterations.numpy()) == STEPS
    assert trainer._step.compute.microbatches == config.get("microbatches", 1)  # tfdist's step
    sharded = [v for v in trainer.optimizer.variables if isinstance(v, ShardedStorage)]
    # Adam's two slots of every weight, in shards, when zero is on.
    assert len(sharded) == (2 * len(trainer.model.trainable_variables) if "zero" in config
                            else 0)


def test_official_core_trainer_refuses_a_legacy_optimizer_under_zero():
    strategy = tfdist.Strategy(data=2, zero=1, devices=devices(2))
    config = experiment()
    task = SentenceTask(config.task)
    with strategy.scope():
        model = task.build_model()
        with pytest.raises(NotImplementedError, match=r"`zero=1` takes tf_keras's v2.11\+ "
                                                      r"optimizers .* is a legacy one"):
            Trainer(config, task, model, tf_keras.optimizers.legacy.Adam(1e-2),
                    evaluate=False, train_dataset=strategy.experimental_distribute_dataset(
                        task.build_inputs(None)))


def test_official_core_trainer_of_its_own_is_refused_under_step_level_options():
    strategy = tfdist.Strategy(data=2, microbatches=2, devices=devices(2))
    config = experiment()
    task = SentenceTask(config.task)
    dataset = task.build_inputs(None)
    with strategy.scope():
        model = task.build_model()
        trainer = base_trainer.Trainer(
            config, task, model, tf_keras.optimizers.Adam(1e-2), evaluate=False,
            train_dataset=strategy.experimental_distribute_dataset(dataset))
    with pytest.raises(ValueError, match=r"official.core's Trainer runs its task's own training "
                                         r"step, .*without microbatches=2. Build "
                                         r"`tfdist.model_garden.Trainer` instead"):
        trainer.train(tf.constant(1))
    assert int(trainer.global_step.numpy()) == 0
