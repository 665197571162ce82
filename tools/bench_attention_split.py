"""Benchmark: attention split by heads against attention split by hidden features.

    python tools/bench_attention_split.py [--rounds=8] [--out=results.jsonl]

The model: an unchanged keras-hub `LlamaBackbone` (`--blocks` blocks, width
`--width`, `--heads` query heads, half as many key/value heads) with a token
classifier on top; Adam. On `--tensor` devices, one epoch each in alternation
(order rotated every round) of:

- **heads**: `Strategy(tensor=t)`, tfdist's own plan: every attention split
  by heads (Megatron: the attention itself split too, 1 all-reduce forward).
- **hidden**: `Strategy(tensor=t, layout_map=LlamaBackbone.get_layout_map)`,
  keras-hub's own map: query/key/value split by their input features, the
  attention computed whole on every device (4 all-reduces forward).
- **data**: `Strategy(data=t)` on the same devices, for scale.

Each kind's median epoch time and the medians of the per-round ratios
hidden / heads and heads / data. One JSON line, then a table.
"""

import os
import statistics
import sys
import time

from absl import app, flags

from results import emit

flags.DEFINE_integer("rounds", 8, "Alternating timed epochs per kind.")
flags.DEFINE_integer("steps", 8, "Steps per timed epoch.")
flags.DEFINE_integer("batch_size", 32, "Global batch size.")
flags.DEFINE_integer("seq", 64, "Sequence length.")
flags.DEFINE_integer("width", 256, "Model width (hidden size).")
flags.DEFINE_integer("heads", 8, "Query heads (key/value heads: half).")
flags.DEFINE_integer("blocks", 2, "Transformer blocks.")
flags.DEFINE_integer("tensor", 2, "Devices of the tensor group.")
flags.DEFINE_string("out", None, "Also append the JSON line to this file.")
FLAGS = flags.FLAGS
VOCAB = 512


def build_model():
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=FLAGS.blocks, num_query_heads=FLAGS.heads,
        num_key_value_heads=FLAGS.heads // 2, hidden_dim=FLAGS.width,
        intermediate_dim=4 * FLAGS.width, dropout=0.0)
    inputs = {name: keras.Input((FLAGS.seq,), dtype="int32", name=name)
              for name in ("token_ids", "padding_mask")}
    logits = keras.layers.Dense(VOCAB)(backbone(inputs))
    model = keras.Model(inputs, logits)
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def make_data(n):
    import numpy as np

    tokens = np.random.default_rng(0).integers(0, VOCAB, (n, FLAGS.seq + 1)).astype("int32")
    return ({"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, FLAGS.seq), "int32")},
            tokens[:, 1:])


def timed_epoch(model, x, y):
    start = time.perf_counter()
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, shuffle=False, verbose=0)
    return time.perf_counter() - start


def main(argv):
    del argv
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "keras_examples"))
    import digits  # first: it quiets TensorFlow's C++ logs before TensorFlow loads
    # isort: split
    import keras
    import keras_hub

    import tfdist

    digits.quiet_logs()
    t = FLAGS.tensor
    tfdist.use_virtual_devices(t)
    names = [f"/cpu:{i}" for i in range(t)]
    mesh = keras.distribution.DeviceMesh((1, t), ("batch", "model"), names)
    strategies = {
        "heads": tfdist.Strategy(tensor=t, devices=names),
        "hidden": tfdist.Strategy(tensor=t, devices=names,
                                  layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh)),
        "data": tfdist.Strategy(data=t, devices=names)}
    x, y = make_data(FLAGS.steps * FLAGS.batch_size)
    models = {}
    for kind, strategy in strategies.items():
        with strategy.scope():
            models[kind] = build_model()
        timed_epoch(models[kind], x, y)  # trace, partition, warm up
    kinds = list(models)
    times = {kind: [] for kind in kinds}
    for r in range(FLAGS.rounds):
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            times[kind].append(timed_epoch(models[kind], x, y))

    def ratio(a, b):
        return statistics.median(p / q for p, q in zip(times[a], times[b]))

    record = {"bench": "attention_split", "tensor": t,
              **{f"{kind}_epoch_median_s": statistics.median(times[kind]) for kind in kinds},
              "hidden_over_heads": ratio("hidden", "heads"),
              "heads_over_data": ratio("heads", "data"),
              "rounds": FLAGS.rounds, "steps": FLAGS.steps, "batch_size": FLAGS.batch_size,
              "seq": FLAGS.seq, "width": FLAGS.width, "heads": FLAGS.heads,
              "blocks": FLAGS.blocks}
    emit(record, FLAGS.out)
    print("\n| tensor | by heads (s / epoch) | by hidden features | data parallel "
          "| hidden / heads | heads / data |\n|---|---|---|---|---|---|")
    print(f"| {t} | {record['heads_epoch_median_s']:.3f} | {record['hidden_epoch_median_s']:.3f} "
          f"| {record['data_epoch_median_s']:.3f} | {record['hidden_over_heads']:.3f} "
          f"| {record['heads_over_data']:.3f} |")


if __name__ == "__main__":
    app.run(main)
