"""Benchmark: `tfdist.plan`'s predictions against every valid plan measured.

    python tools/bench_plan.py [--models=mlp,convnet,gpt2,llama,bert] [--devices=4]
        [--width=128] [--batch_size=32] [--steps=12] [--repeats=2] [--out=results.jsonl]

For each model (small configurations of a wide MLP, a keras-io convnet, and
keras-hub GPT-2, Llama and BERT backbones of `--width` with a token
classifier; Adam), on
`--devices` logical CPU devices of this process: `tfdist.plan` with a memory
per device whose usable part lies `--memory_fraction` of the way from the
smallest plan's predicted peak to data parallelism's (so that data
parallelism and some other plans do not fit); every plan that fits
(or the first `--max_plans` of them, in predicted order) is trained `--steps`
steps and timed (`tfdist.plan_trials.measured_step_seconds`). One JSON line per
plan as it is timed (predicted peak and time, measured time), then one per
model: the
rank the prediction gave the plan measured fastest, the measured time of
the plan the prediction chose (`plans` ranked without measuring) against the
fastest's (also with both timed `--repeats` times more, their best times;
and what `measure=3` / `measure=5` would pick from the times above), the
rank correlation of predicted and measured times, and the `Hardware` the
plans were predicted for (its numbers).

    python tools/bench_plan.py --measured=results.jsonl

predicts again and reuses the measured times of an earlier run.
"""

import dataclasses
import json
import os
import statistics
import sys

from absl import app, flags

from results import emit

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mlp", "convnet", "gpt2", "llama"], "Models to plan (also: "
                  "bert).")
flags.DEFINE_integer("width", 128, "The language models' hidden width (4 heads, an MLP of "
                     "4 x the width).")
flags.DEFINE_integer("devices", 4, "Logical CPU devices.")
flags.DEFINE_integer("batch_size", 32, "Global batch.")
flags.DEFINE_integer("sequence_length", 64, "Tokens per example of the language models.")
flags.DEFINE_integer("steps", 12, "Steps each plan trains (the first two not timed).")
flags.DEFINE_float("memory_fraction", 0.7, "Memory per device: the usable part (less "
                   "the planner's headroom) this fraction of the way from the smallest "
                   "plan's predicted peak to data parallelism's.")
flags.DEFINE_string("out", None, "Also append the JSON lines to this file.")
flags.DEFINE_integer("max_plans", 0, "Time only the first this many plans that fit, in "
                     "predicted order (0: every one).")
flags.DEFINE_integer("repeats", 2, "Times the chosen and the fastest plan are timed again "
                     "(alternately), for their best times.")
flags.DEFINE_string("measured", None, "JSON lines of an earlier run: its measured times "
                    "are reused (the predictions are made again), nothing is trained.")

VOCAB, BLOCKS = 512, 4
LANGUAGE_MODELS = ("gpt2", "llama", "bert")


def make_model(name):
    """The compiled model `name` (seeded: every plan builds the same)."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    sparse = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if name == "mlp":
        model = keras.Sequential([keras.Input((512,))]
                                 + [keras.layers.Dense(1024, "relu") for _ in range(6)]
                                 + [keras.layers.Dense(10)])
    elif name == "convnet":  # keras-io's MNIST convnet
        model = keras.Sequential([
            keras.Input((28, 28, 1)), keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(2), keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(2), keras.layers.Flatten(), keras.layers.Dropout(0.5),
            keras.layers.Dense(10)])
    else:
        shape = dict(vocabulary_size=VOCAB, num_layers=BLOCKS, hidden_dim=FLAGS.width,
                     intermediate_dim=4 * FLAGS.width, dropout=0.0)
        if name == "llama":
            body = keras_hub.models.LlamaBackbone(num_query_heads=4, num_key_value_heads=2,
                                                  **shape)
        else:
            backbone = {"gpt2": keras_hub.models.GPT2Backbone,
                        "bert": keras_hub.models.BertBackbone}[name]
            body = backbone(num_heads=4, max_sequence_length=FLAGS.sequence_length, **shape)
        tokens = body.output["sequence_output"] if name == "bert" else body.output
        model = keras.Model(body.input, keras.layers.Dense(VOCAB)(tokens))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=sparse)
    return model


def bench_model(name):
    import tfdist
    from tfdist.plan_trials import measured_step_seconds
    from tfdist.planning import HEADROOM, describe_config

    sequence = FLAGS.sequence_length if name in LANGUAGE_MODELS else None
    model = make_model(name)
    model.optimizer.build(model.trainable_variables)
    data = tfdist.ParallelConfig(data=FLAGS.devices).resolve(FLAGS.devices)
    # every plan's predicted peak, planned with room for all: the smallest and data parallelism's
    peaks = {describe_config(p.config): p.peak.total for p in tfdist.plan(
        model, FLAGS.devices, "1TiB", FLAGS.batch_size, sequence, device_flops=1e12)}
    smallest = min(peaks.values())
    usable = smallest + FLAGS.memory_fraction * (peaks[describe_config(data)] - smallest)
    limit = int(usable / (1 - HEADROOM))
    predicted = tfdist.plan(lambda: make_model(name), FLAGS.devices, limit, FLAGS.batch_size,
                            sequence)
    fitting = sum(p.fits for p in predicted)
    earlier = earlier_measurements(FLAGS.measured, name) if FLAGS.measured else {}
    if FLAGS.measured and not earlier:
        sys.exit(f"--measured={FLAGS.measured} has no measured plan of {name!r}: "
                 f"pass --models with the models it has.")
    measured = 0
    for rank, p in enumerate(predicted, 1):
        if FLAGS.measured:
            p.measured = earlier.get(describe_config(p.config))
        elif p.fits and measured < (FLAGS.max_plans or fitting):
            p.measured = measured_step_seconds(p.config, lambda: make_model(name),
                                               FLAGS.batch_size, sequence, FLAGS.steps)
            measured += 1
        emit({"bench": "plan", **model_fields(name), "config": describe_config(p.config),
              "predicted_rank": rank, "fits": p.fits,
              "predicted_peak_bytes": p.peak.total,
              "predicted_step_ms": round(1e3 * p.time.total, 2),
              "measured_step_ms": None if p.measured is None else round(1e3 * p.measured, 2)},
             FLAGS.out)
    timed = [p for p in predicted if p.measured is not None]
    fastest = min(timed, key=lambda p: p.measured)
    chosen = predicted.best
    # What `tfdist.plan(..., measure=K)` picks: the fastest measured of the
    # first K fitting plans (their times above, not measured again).
    with_measure = {
        f"measure_{k}_over_fastest": round(min(p.measured for p in timed[:k]) / fastest.measured, 3)
        for k in (3, 5) if len(timed) >= k}
    # The chosen and the fastest timed again, alternately, `--repeats` times:
    # each one's best time (a single median of a few steps moves by 10-25%).
    again = {}
    if FLAGS.repeats and not FLAGS.measured:
        timed_again = {id(p): p for p in (chosen, fastest)}  # one, if they are the same
        best = {key: [p.measured] for key, p in timed_again.items()}
        for _ in range(FLAGS.repeats):
            for key, p in timed_again.items():
                best[key].append(measured_step_seconds(
                    p.config, lambda: make_model(name), FLAGS.batch_size, sequence, FLAGS.steps))
        again = {"chosen_best_ms": round(1e3 * min(best[id(chosen)]), 2),
                 "fastest_best_ms": round(1e3 * min(best[id(fastest)]), 2),
                 "chosen_over_fastest_best": round(min(best[id(chosen)])
                                                   / min(best[id(fastest)]), 3)}
    emit({"bench": "plan_summary", **model_fields(name), "devices": FLAGS.devices,
          "memory_per_device_bytes": limit, "plans_fitting": fitting,
          "plans_refused": len(predicted.refused),
          "chosen": describe_config(chosen.config),
          "chosen_measured_ms": round(1e3 * chosen.measured, 2),
          "fastest": describe_config(fastest.config),
          "fastest_measured_ms": round(1e3 * fastest.measured, 2),
          "chosen_over_fastest": round(chosen.measured / fastest.measured, 3),
          "predicted_rank_of_fastest": predicted.index(fastest) + 1,
          "rank_correlation": round(rank_correlation(
              [p.time.total for p in timed], [p.measured for p in timed]), 3)
          if len(timed) > 1 else None,  # (one plan timed: nothing to correlate)
          "median_measured_ms": round(1e3 * statistics.median(p.measured for p in timed), 2),
          **with_measure, **again,
          "hardware": {key: value for key, value in dataclasses.asdict(predicted.hardware).items()
                       if isinstance(value, (int, float, tuple))}},
         FLAGS.out)


def model_fields(name):
    """What names the model in the JSON lines: its name, and a language model's width."""
    return {"model": name, **({"width": FLAGS.width} if name in LANGUAGE_MODELS else {})}


def earlier_measurements(path, name):
    """{config: measured seconds} of model `name` (of `--width`) in an earlier
    run's JSON lines."""
    measured, fields = {}, model_fields(name)
    with open(path) as f:
        for line in f:
            record = {"width": 128, **json.loads(line)}  # (no width before: 128)
            if (record.get("bench") == "plan" and record["measured_step_ms"] is not None
                    and all(record[key] == value for key, value in fields.items())):
                measured[record["config"]] = record["measured_step_ms"] / 1e3
    return measured


def rank_correlation(a, b):
    """Spearman's rank correlation of two lists (no ties expected)."""
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0] * len(values)
        for rank, index in enumerate(order):
            result[index] = rank
        return result

    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main(argv):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tfdist

    tfdist.use_virtual_devices(FLAGS.devices)
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    for name in FLAGS.models:
        bench_model(name)


if __name__ == "__main__":
    app.run(main)
