"""Benchmark: tensor parallelism's traffic against Megatron's theory, and its
step time against data parallelism on the same devices.

    python tools/bench_tensor.py [--rounds=10] [--out=results.jsonl]

The model: a Dense input projection, `--blocks` post-norm Transformer blocks
of plain Keras layers (MultiHeadAttention, a gelu MLP of 4 x width), average
pooling and a 10-class head; Adam. For each (data, tensor) mesh:

- **bytes crossing devices per step, measured**: one step of `fit` runs with
  TensorFlow's debugger dumping the shape of every output of every
  `Collective*` op the step executes (`tensor_debug_mode="SHAPE"`), on every
  device; each execution counts its output bytes times the traffic of the
  ring algorithm TensorFlow's CPU collectives use, per device of a group of
  p: all-reduce 2(p-1)/p, all-gather (p-1)/p of the output. The group size p
  of each op is read from its `group_size` input in the traced graph.
- **theory** (see docs/benchmarks.md for the formula): Megatron's 2 + 2
  all-reduces of the activations per block, the data-parallel all-reduce of
  each device's gradients, the batch exchange inside each tensor group.
- **step-time ratio** tensor / data parallel: the same model under
  `Strategy(data=N/t, tensor=t)` and `Strategy(data=N)` on the same N
  devices, one epoch each in alternation (order swapped every round); the
  median of per-round ratios.

Writes one JSON line per mesh (stdout, and `--out` if given), then a table.
"""

import os
import shutil
import statistics
import sys
import tempfile
import time

from absl import app, flags
from traced import train_function

from results import emit

flags.DEFINE_integer("rounds", 10, "Alternating timed epochs per model.")
flags.DEFINE_integer("steps", 8, "Steps per timed epoch.")
flags.DEFINE_integer("batch_size", 64, "Global batch size.")
flags.DEFINE_integer("seq", 32, "Sequence length.")
flags.DEFINE_integer("width", 128, "Model width (hidden size).")
flags.DEFINE_integer("heads", 8, "Attention heads.")
flags.DEFINE_integer("blocks", 2, "Transformer blocks.")
flags.DEFINE_list("meshes", ["1x2", "1x4", "2x2"], "data x tensor meshes to measure.")
flags.DEFINE_string("out", None, "Also append the JSON lines to this file.")
FLAGS = flags.FLAGS
CLASSES = 10
FLOAT = 4  # bytes of a float32 / int32


def build_model():
    import keras

    keras.utils.set_random_seed(0)
    width = FLAGS.width
    inputs = keras.Input((FLAGS.seq, width))
    x = keras.layers.Dense(width)(inputs)
    for _ in range(FLAGS.blocks):
        attended = keras.layers.MultiHeadAttention(
            FLAGS.heads, key_dim=width // FLAGS.heads)(x, x)
        x = keras.layers.LayerNormalization()(x + attended)
        hidden = keras.layers.Dense(4 * width, activation="gelu")(x)
        x = keras.layers.LayerNormalization()(x + keras.layers.Dense(width)(hidden))
    logits = keras.layers.Dense(CLASSES)(keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(inputs, logits)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def make_data(n):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, FLAGS.seq, FLAGS.width)).astype("float32")
    return x, rng.integers(0, CLASSES, size=n).astype("int32")


def group_sizes(model):
    """{collective op name: its group size}, from the traced train function."""
    sizes = {}
    for concrete in train_function(model)._list_all_concrete_functions():
        for function in concrete.graph.as_graph_def().library.function:
            nodes = {node.name: node for node in function.node_def}
            for node in function.node_def:
                if node.op.startswith("Collective"):
                    const = nodes[node.input[1].split(":")[0]]
                    sizes[node.name] = const.attr["value"].tensor.int_val[0]
    return sizes


def measured_bytes(model, x, y):
    """Bytes crossing devices in one step of `fit`, from the collectives it ran."""
    import tensorflow as tf
    from tensorflow.python.debug.lib import debug_events_reader

    dump = tempfile.mkdtemp()
    try:
        tf.debugging.experimental.enable_dump_debug_info(
            dump, tensor_debug_mode="SHAPE", op_regex="Collective.*")
        model.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, verbose=0)
        tf.debugging.experimental.disable_dump_debug_info()
        sizes = group_sizes(model)
        total, executions = 0.0, 0
        with debug_events_reader.DebugDataReader(dump) as reader:
            reader.update()
            for trace in reader.graph_execution_traces(digest=False):
                # SHAPE mode: (tensor id, dtype enum, rank, element count, shape...)
                _, dtype, _, elements = trace.debug_tensor_value[:4]
                nbytes = elements * tf.dtypes.as_dtype(int(dtype)).size
                p = sizes[trace.op_name]
                factor = 2 * (p - 1) / p if "Reduce" in trace.op_type else (p - 1) / p
                total += factor * nbytes
                executions += 1
        return total, executions
    finally:
        shutil.rmtree(dump, ignore_errors=True)


def theory_bytes(model, data, tensor):
    """Megatron's per-step traffic for this model (docs/benchmarks.md)."""
    from tfdist.sharding.storage import axis_layout

    split = sum(w.numpy().size for w in model.trainable_weights if axis_layout(w) is not None)
    replicated = sum(w.numpy().size for w in model.trainable_weights
                     if axis_layout(w) is None)
    group_rows = FLAGS.batch_size // data
    activation = group_rows * FLAGS.seq * FLAGS.width * FLOAT
    example = (FLAGS.seq * FLAGS.width + 1) * FLOAT  # x and its label
    megatron = data * FLAGS.blocks * 4 * 2 * (tensor - 1) * activation
    gradients = tensor * 2 * (data - 1) * (split // tensor + replicated) * FLOAT
    exchange = data * (tensor - 1) * group_rows * example
    return megatron + gradients + exchange, {"activations": megatron,
                                             "gradients": gradients, "batch": exchange}


def timed_epoch(model, x, y):
    start = time.perf_counter()
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, shuffle=False, verbose=0)
    return time.perf_counter() - start


def measure(data, tensor, x, y):
    import tfdist

    n = data * tensor
    names = [f"/cpu:{i}" for i in range(n)]
    one = slice(0, FLAGS.batch_size)
    strategies = {"tensor": tfdist.Strategy(data=data, tensor=tensor, devices=names),
                  "data": tfdist.Strategy(data=n, devices=names)}
    models, traffic = {}, {}
    for kind, strategy in strategies.items():
        with strategy.scope():  # one model to count (its step carries the dump ops)
            traffic[kind] = measured_bytes(build_model(), x[one], y[one])
            models[kind] = build_model()  # and one to time
        timed_epoch(models[kind], x, y)  # trace, partition, warm up
    theory, parts = theory_bytes(models["tensor"], data, tensor)
    times = {kind: [] for kind in models}
    for r in range(FLAGS.rounds):
        for kind in (("tensor", "data") if r % 2 == 0 else ("data", "tensor")):
            times[kind].append(timed_epoch(models[kind], x, y))
    ratios = [a / b for a, b in zip(times["tensor"], times["data"])]
    record = {"bench": "tensor", "data": data, "tensor": tensor, "devices": n,
              "bytes_measured": traffic["tensor"][0],
              "collective_executions": traffic["tensor"][1],
              "bytes_theory": theory, "theory_parts": parts,
              "bytes_ratio": traffic["tensor"][0] / theory,
              "data_parallel_bytes_measured": traffic["data"][0],
              "epoch_median_s": statistics.median(times["tensor"]),
              "data_parallel_epoch_median_s": statistics.median(times["data"]),
              "median_ratio_to_data_parallel": statistics.median(ratios),
              "rounds": FLAGS.rounds, "steps": FLAGS.steps, "batch_size": FLAGS.batch_size,
              "seq": FLAGS.seq, "width": FLAGS.width, "heads": FLAGS.heads,
              "blocks": FLAGS.blocks}
    emit(record, FLAGS.out)
    return record


def main(argv):
    del argv
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "keras_examples"))
    import digits  # first: it quiets TensorFlow's C++ logs before TensorFlow loads
    # isort: split
    import tfdist

    digits.quiet_logs()
    meshes = [tuple(int(v) for v in mesh.split("x")) for mesh in FLAGS.meshes]
    tfdist.use_virtual_devices(max(d * t for d, t in meshes))
    x, y = make_data(FLAGS.steps * FLAGS.batch_size)
    records = [measure(d, t, x, y) for d, t in meshes]
    print("\n| data x tensor | bytes / step, measured | theory | measured / theory "
          "| data-parallel bytes / step | median epoch (s) | ratio to data parallel |"
          "\n|---|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['data']} x {r['tensor']} | {r['bytes_measured']:,.0f} | "
              f"{r['bytes_theory']:,.0f} | {r['bytes_ratio']:.4f} | "
              f"{r['data_parallel_bytes_measured']:,.0f} | {r['epoch_median_s']:.3f} | "
              f"{r['median_ratio_to_data_parallel']:.3f} |")


if __name__ == "__main__":
    app.run(main)
