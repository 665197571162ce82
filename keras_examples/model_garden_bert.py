"""A TensorFlow Model Garden BERT classifier trained by orbit under a tfdist strategy.

    python keras_examples/model_garden_bert.py --devices=4 --microbatches=2
    python keras_examples/model_garden_bert.py --devices=2 --precision=mixed_float16
    python keras_examples/model_garden_bert.py --devices=4 --zero=2

Reads each 8x8 digit as a sequence of 64 pixel intensities (tokens 0-16) and
classifies it with an unchanged tf-models-official `BertClassifier` over a
small `BertEncoder` (tf_keras, random weights). orbit's `Controller` runs a
`StandardTrainer` whose step is tfdist's (`strategy.train_step(model)`): the
model's own compiled loss, metrics and tf_keras optimizer, with the strategy's
microbatches (one gradient all-reduce per step), precision (loss scaling under
mixed_float16), XLA and ZeRO (the optimizer's slots split across the
replicas). Prints the loss and accuracy of every orbit loop and the bytes of
optimizer state each device holds.
"""

import digits  # first: it quiets TensorFlow's C++ logs before TensorFlow loads

# isort: split
import numpy as np
import orbit
import tensorflow as tf
import tf_keras
from absl import flags

import tfdist
from tfdist.callbacks.metrics import optimizer_state_bytes

flags.DEFINE_integer("devices", 4, "Logical CPU devices = data-parallel replicas.")
flags.DEFINE_integer("microbatches", 1, "Microbatches per per-replica batch.")
flags.DEFINE_enum("precision", "float32", ["float32", "mixed_float16", "mixed_bfloat16"],
                  "Compute precision (tf_keras dtype policy).")
flags.DEFINE_bool("xla", False, "Compile each replica's step with XLA.")
flags.DEFINE_enum("zero", "0", ["0", "1", "2"], "Shard the optimizer state (ZeRO stage).")
flags.DEFINE_integer("steps", 150, "Training steps.")
flags.DEFINE_integer("steps_per_loop", 50, "Steps per orbit loop (one tf.function call).")
flags.DEFINE_integer("batch_size", 64, "Global batch size.")
flags.DEFINE_integer("layers", 2, "Transformer layers of the encoder.")
FLAGS = flags.FLAGS

VOCABULARY = 32  # pixel intensities 0-16, padded


def build_classifier():
    """A small Model Garden BertClassifier, compiled with tf_keras's Adam."""
    from official.nlp.modeling import models, networks

    encoder = networks.BertEncoder(
        vocab_size=VOCABULARY, hidden_size=64, num_layers=FLAGS.layers,
        num_attention_heads=4, max_sequence_length=64, inner_dim=128,
        dropout_rate=0.0, attention_dropout_rate=0.0)
    model = models.BertClassifier(encoder, num_classes=10, dropout_rate=0.0)
    model.compile(optimizer=tf_keras.optimizers.Adam(3e-3),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[tf_keras.metrics.SparseCategoricalAccuracy("accuracy")])
    return model


def digit_sentences():
    """The digits as BERT inputs (64 pixel tokens each) and their labels."""
    pixels, labels = digits.load()
    tokens = np.rint(pixels.reshape(len(pixels), -1) * 16).astype("int32")
    x = {"input_word_ids": tokens, "input_mask": np.ones_like(tokens),
         "input_type_ids": np.zeros_like(tokens)}
    return tf.data.Dataset.from_tensor_slices((x, labels.astype("int32"))).shuffle(
        len(labels), seed=0).repeat().batch(FLAGS.batch_size, drop_remainder=True)


def main(argv):
    del argv
    digits.quiet_logs()
    tfdist.use_virtual_devices(FLAGS.devices)
    strategy = tfdist.Strategy(data=FLAGS.devices, microbatches=FLAGS.microbatches,
                               precision=FLAGS.precision, xla=FLAGS.xla,
                               zero=int(FLAGS.zero))
    print(f"tfdist.Strategy: {strategy.config.to_json()}")
    with strategy.scope():
        model = build_classifier()
    print(f"trainable weight bytes: {sum(w.numpy().nbytes for w in model.trainable_weights):,}")
    dataset = digit_sentences()
    logs = []
    controller = orbit.Controller(
        strategy=strategy, trainer=digits.orbit_trainer(strategy, model, dataset),
        global_step=model.optimizer.iterations, steps_per_loop=FLAGS.steps_per_loop,
        train_actions=[lambda output: logs.append({k: float(v) for k, v in output.items()})])
    controller.train(steps=FLAGS.steps)
    for i, log in enumerate(logs):
        print(f"steps {(i + 1) * FLAGS.steps_per_loop}: loss {log['loss']:.4f}  "
              f"accuracy {log['accuracy']:.3f}")
    print(f"optimizer: {type(model.optimizer).__name__}, steps applied: "
          f"{int(model.optimizer.iterations.numpy())}")
    print(f"optimizer state bytes per device: "
          f"{digits.per_device(optimizer_state_bytes(model.optimizer))}")


if __name__ == "__main__":
    digits.run(main)
