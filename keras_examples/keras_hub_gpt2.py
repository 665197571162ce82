"""A keras-hub GPT-2 causal language model split across devices.

    python keras_examples/keras_hub_gpt2.py --devices=4 --tensor=2
    python keras_examples/keras_hub_gpt2.py --devices=8 --tensor=2 --pipeline=2 \
        --microbatches=2
    python keras_examples/keras_hub_gpt2.py --devices=4 --tensor=2 --zero=3

Reads each 8x8 digit as a sequence of 64 pixel intensities (tokens 0-16) and
trains an unchanged `keras_hub.models.GPT2CausalLM` (a small configuration,
random weights) to predict each next pixel, with `model.fit` under
`tfdist.Strategy(tensor=..., pipeline=...)`; the remaining devices are data
parallel. Its Transformer blocks are split by heads and column -> row MLPs,
its token embedding by vocabulary, and the tied output projection (the same
table, `reverse=True`) gives each device its rows' logits. With `--pipeline`
the blocks are cut into stages too: the first stage holds the table, the last
computes with a copy. With `--zero=3` each device keeps 1/data of its tensor
rank's slices, gathered block by block. Prints the layout, each epoch's loss, and the bytes of
weights and of optimizer state each device holds.
"""

import digits  # first: it quiets TensorFlow's C++ logs before TensorFlow loads

# isort: split
import keras
import keras_hub
import numpy as np
from absl import flags

import tfdist

flags.DEFINE_integer("devices", 4, "Logical CPU devices (data x pipeline x tensor).")
flags.DEFINE_integer("tensor", 2, "Devices per tensor group (splits of each weight).")
flags.DEFINE_integer("pipeline", 1, "Pipeline stages.")
flags.DEFINE_integer("microbatches", 1, "Microbatches per replica batch.")
flags.DEFINE_integer("zero", 0, "ZeRO stage (0, 1, 2 over each data group; 3: parameters "
                     "sharded too, with --pipeline=1: the tied embedding is read by the "
                     "first and the last stage).")
flags.DEFINE_integer("layers", 2, "Transformer blocks.")
flags.DEFINE_integer("width", 64, "Hidden size (4 heads).")
flags.DEFINE_integer("epochs", 3, "Epochs.")
flags.DEFINE_integer("examples", None, "Digits to train on (default: all 1,797).")
flags.DEFINE_integer("batch_size", 64, "Global batch size.")
FLAGS = flags.FLAGS

VOCABULARY = 32  # pixel intensities 0-16, padded to a size tensor groups divide


def pixel_sequences():
    """(x, y): each digit's 64 pixels as tokens 0-16; y is x shifted by one."""
    pixels, _ = digits.load(FLAGS.examples)
    tokens = np.rint(pixels * 16).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones_like(tokens[:, :-1])}
    return x, tokens[:, 1:]


def build_lm():
    """A small GPT-2 causal LM, compiled with Adam (dropout off)."""
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY, num_layers=FLAGS.layers, num_heads=4,
        hidden_dim=FLAGS.width, intermediate_dim=4 * FLAGS.width, max_sequence_length=64,
        dropout=0.0)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=[])
    return model


def main(argv):
    del argv
    digits.quiet_logs()
    tfdist.use_virtual_devices(FLAGS.devices)
    strategy = tfdist.Strategy(tensor=FLAGS.tensor, pipeline=FLAGS.pipeline,
                               microbatches=FLAGS.microbatches, zero=FLAGS.zero)
    print(f"tfdist.Strategy: {strategy.config.to_json()}")
    with strategy.scope():
        model = build_lm()
    x, y = pixel_sequences()
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, verbose=0,
              callbacks=[digits.EpochReport()])
    print(strategy.describe(model))
    digits.print_weight_bytes(model)
    digits.print_unsplit_and_state_bytes(model)


if __name__ == "__main__":
    digits.run(main)
