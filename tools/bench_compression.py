"""Benchmark: gradient compression's bytes on the wire and its convergence.

    python tools/bench_compression.py [--models=gpt2,convnet]
        [--compressions=none,bf16,fp16,int8,topk:0.01,powersgd:4] [--steps=400]
        [--out=results.jsonl] [--plot=docs/compression_loss.png]

For each model and `compression`, `tfdist.Strategy(data=4, compression=...)` on 4
logical CPU devices trains the same model from the same weights on the same
batches for `--steps` steps of `model.fit`, then reads from the traced step the
bytes replica 0 sends into the reduce part's collectives per step (the
gradients, a sparse gradient's gathered slices, the metric states) and takes
the mean training loss of the last 20 steps. One JSON line per run, with the ratios to the
uncompressed run of the same model and optimizer; then a markdown table.
PowerSGD runs with SGD 0.05 (momentum 0.9), as in its paper, and Top-K with
both SGD and Adam, beside an uncompressed SGD run; the others with Adam; and
`tfdist.optim.OneBitAdam` (`--one_bit_adam_warmup` steps, then its momenta as
signs) beside Adam. Top-K
and PowerSGD start after `--compression_warmup` steps; the bytes of these
three are those of a step after the warm-up.

Models, each seeing every batch once (the loss falls towards the data's own
floor, not to zero): keras-hub `GPT2Backbone` (a byte vocabulary of 256, 2
blocks, width 64, 4 heads, MLP 128, sequence 32) with a Dense token
classifier, predicting the next byte of English text (Python's own
documentation, `pydoc_data.topics`, in windows of 33 bytes taken in a
shuffled order), Adam 1e-3, batch 32; and keras-io's simple MNIST
convnet (Conv2D 32, pooling, Conv2D 64, pooling, Dense) on random 16x16
images labelled by the tercile of their mean plus noise, Adam 1e-3, batch 64.

    python tools/bench_compression.py --link_mbit=100 [--link_workers=2]
        [--link_steps=30] [--compressions=none,bf16,int8,topk:0.01,powersgd:4]

Instead: the step time of each compression where the network is the
bottleneck. `--link_workers` processes, each a host of `linked_hosts` (network
namespaces on one bridge, each link `--link_mbit` Mbit/s each way; needs root),
run `linked_worker.py` under `tfdist.MultiWorkerStrategy(compression=...)`
(an MLP of 6.3 MB of gradients, SGD with momentum). The link's rate is
measured first (a TCP stream between two hosts); then one JSON line per
compression, the chief's median step time and its speedup over "none"; then
"none" again on unlimited links (what the link costs it), and a markdown table.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags
from linked_hosts import linked_hosts, measure_mbit
from traced import step_graph

import tfdist
from results import emit
from tfdist.cluster.tf_config import TFConfig

MODELS = ("gpt2", "convnet")
flags.DEFINE_list("models", list(MODELS), f"Models: {', '.join(MODELS)}.")
flags.DEFINE_list("compressions", ["none", "bf16", "fp16", "int8", "topk:0.01", "powersgd:4"],
                  "Compressions to run (the first \"none\" is the reference).")
flags.DEFINE_integer("steps", 400, "Training steps per run.")
flags.DEFINE_integer("compression_warmup", 100,
                     "`compression_warmup` of the Top-K and PowerSGD runs.")
flags.DEFINE_integer("one_bit_adam_warmup", 100,
                     "Warm-up steps of a OneBitAdam run beside the Adam ones (0: none).")
flags.DEFINE_string("out", None, "Also append the JSON lines to this file.")
flags.DEFINE_string("plot", None, "Also plot every run's loss curve into this PNG file.")
flags.DEFINE_float("link_mbit", 0, "If > 0, instead: each compression's step time on workers "
                   "whose links carry this many Mbit/s each way.")
flags.DEFINE_integer("link_workers", 2, "Workers of the --link_mbit runs.",
                     lower_bound=2, upper_bound=4)
flags.DEFINE_integer("link_steps", 30, "Timed steps of a --link_mbit run (after 5 of warm-up).")
FLAGS = flags.FLAGS
DEVICES = 4
VOCAB, SEQ = 256, 32
# The name scopes of the compressions that follow a warm-up.
COMPRESSED_SCOPES = ("/topk/", "/powersgd/", "/one_bit/")


def make(name, optimizer_name="adam"):
    """(model, inputs, labels, batch size) of `name`, weights from seed 0,
    compiled with Adam 1e-3, ("sgd") SGD 0.05 with momentum 0.9, or
    ("one_bit_adam") `tfdist.optim.OneBitAdam` 1e-3; `--steps` batches of
    data, each seen once."""
    import keras

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    optimizer = {"adam": lambda: keras.optimizers.Adam(1e-3),
                 "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
                 "one_bit_adam": lambda: tfdist.optim.OneBitAdam(
                     1e-3, warmup_steps=FLAGS.one_bit_adam_warmup)}[optimizer_name]()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if name == "gpt2":
        import keras_hub

        body = keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=64,
            intermediate_dim=128, max_sequence_length=SEQ, dropout=0.0)
        model = keras.Model(body.input, keras.layers.Dense(VOCAB)(body.output))
        batch = 32
        x, labels = english_text(rng, FLAGS.steps * batch)
        inputs = {"token_ids": x, "padding_mask": np.ones_like(x)}
    else:
        model = keras.Sequential([
            keras.Input((16, 16, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(), keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(), keras.layers.Flatten(), keras.layers.Dense(3)])
        batch = 64
        inputs = rng.normal(size=(FLAGS.steps * batch, 16, 16, 3)).astype("float32")
        mean = inputs.mean(axis=(1, 2, 3)) + rng.normal(0, 0.01, size=len(inputs))
        labels = np.digitize(mean, np.quantile(mean, [1 / 3, 2 / 3]))
    model.compile(optimizer=optimizer, loss=loss)
    return model, inputs, labels, batch


def english_text(rng, sequences):
    """(bytes, next bytes), each (sequences, SEQ): `sequences` windows of
    SEQ + 1 bytes of Python's documentation (`pydoc_data.topics`, English
    prose and code, about 470 kB), in a shuffled order, none twice."""
    from pydoc_data.topics import topics

    text = np.frombuffer("\n".join(topics[k] for k in sorted(topics)).encode("utf-8"),
                         dtype=np.uint8).astype("int32")
    windows = text[:len(text) // (SEQ + 1) * (SEQ + 1)].reshape(-1, SEQ + 1)
    if sequences > len(windows):
        raise ValueError(f"--steps={FLAGS.steps}: {sequences} sequences wanted, the text "
                         f"has {len(windows)}")
    windows = windows[rng.permutation(len(windows))[:sequences]]
    return windows[:, :-1], windows[:, 1:]


def reduce_bytes(model):
    """Bytes replica 0 sends into the reduce part's collectives per step:
    those of the step and of the functions it calls (a trace the replicas
    share, whose ops run on the calling op's device), and in each `tf.cond`
    of the reduce part those of the branch taken once compression runs:
    after a warm-up (`compression_warmup`, OneBitAdam's), the branch that
    compresses."""
    graph = step_graph(model)
    functions = {name: f.graph for name, f in graph._functions.items()}

    def sent(g, scope="", caller=""):
        total = 0
        for op in g.get_operations():
            device = op.device or caller
            if scope not in op.name or not device.endswith("CPU:0"):
                continue
            if op.type.startswith("Collective"):
                total += op.inputs[0].shape.num_elements() * op.inputs[0].dtype.size
            elif op.type in ("If", "StatelessIf"):
                then, other = (functions[op.get_attr(b).name]
                               for b in ("then_branch", "else_branch"))
                compressing = any(s in o.name for o in other.get_operations()
                                  for s in COMPRESSED_SCOPES)
                total += sent(other if compressing else then, caller=device)
            elif op.type in ("PartitionedCall", "StatefulPartitionedCall"):
                total += sent(functions[op.get_attr("f").name], caller=device)
        return total

    return sent(graph, "tfdist/reduce/")


def run(name, compression, optimizer):
    import keras

    warmup = FLAGS.compression_warmup if compression.startswith(("topk", "powersgd")) else 0
    strategy = tfdist.Strategy(data=DEVICES, compression=compression,
                               compression_warmup=warmup)
    with strategy.scope():
        model, inputs, labels, batch = make(name, optimizer)
    losses = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda step, logs: losses.append(float(logs["loss"])))
    start = time.perf_counter()
    model.fit(inputs, labels, batch_size=batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[record])
    seconds = time.perf_counter() - start
    return dict(bench="compression", model=name, compression=compression, optimizer=optimizer,
                steps=len(losses), reduce_bytes_per_step=reduce_bytes(model),
                final_loss=float(np.mean(losses[-20:])),
                fit_seconds=round(seconds, 1)), losses


def plot(curves, path):
    """A PNG at `path`: per model, each run's training loss (mean of 20 steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({model for model, _ in curves}, key=list(MODELS).index)
    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for axis, model in zip(axes[0], models):
        for (name, run_name), losses in curves.items():
            if name == model:
                smooth = np.convolve(losses, np.ones(20) / 20, mode="valid")
                axis.plot(np.arange(len(smooth)) + 20, smooth, label=run_name, linewidth=1)
        axis.set(title=f"{model}, data=4", xlabel="step", ylabel="training loss (mean of 20)")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


LINK_WORKER = pathlib.Path(__file__).with_name("linked_worker.py")
LINK_PORT = 2222
LINK_TIMEOUT = 900  # seconds a --link_mbit run may take before its workers are killed


def linked_step_seconds(hosts, compression):
    """The chief's median step time of `linked_worker.py` on `hosts`, one
    worker in each namespace; every worker is killed if any fails or the run
    takes over `LINK_TIMEOUT`."""
    cluster = {"worker": [f"{address}:{LINK_PORT}" for _, address in hosts]}
    root = str(pathlib.Path(__file__).resolve().parents[1])
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory() as logs:
        workers = []
        try:
            for index, (namespace, _) in enumerate(hosts):
                with open(f"{logs}/{index}.out", "w") as out, \
                        open(f"{logs}/{index}.err", "w") as err:
                    workers.append(subprocess.Popen(
                        ["ip", "netns", "exec", namespace, sys.executable, str(LINK_WORKER),
                         f"--compression={compression}", f"--steps={FLAGS.link_steps}"],
                        env=dict(env, TF_CONFIG=TFConfig(cluster, "worker", index).to_json()),
                        stdout=out, stderr=err))
            deadline = time.monotonic() + LINK_TIMEOUT
            while any(w.poll() is None for w in workers):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{compression}: still running after {LINK_TIMEOUT} s:\n"
                                       + _tail(f"{logs}/0.err"))
                if any(w.returncode for w in workers):
                    break
                time.sleep(1)
            for index, worker in enumerate(workers):
                if worker.returncode:
                    raise RuntimeError(f"{compression}: worker {index} failed:\n"
                                       + _tail(f"{logs}/{index}.err"))
            return json.loads(pathlib.Path(f"{logs}/0.out").read_text().splitlines()[-1])
        finally:
            for worker in workers:
                worker.kill()
                worker.wait()


def _tail(path):
    return pathlib.Path(path).read_text()[-4000:]


def run_linked():
    """Each compression's step time on rate-limited links, then "none" on
    unlimited ones."""
    with linked_hosts(2, FLAGS.link_mbit) as ((receiver, address), (sender, _)):
        measured = measure_mbit(receiver, address, sender)
    rows, plain = [], None
    for compression, mbit in [(c, FLAGS.link_mbit) for c in FLAGS.compressions] + [
            ("none", None)]:
        with linked_hosts(FLAGS.link_workers, mbit) as hosts:
            result = linked_step_seconds(hosts, compression)
        row = dict(bench="compression_link", workers=FLAGS.link_workers, mbit=mbit,
                   compression=compression, step_seconds=round(result["step_seconds"], 4))
        if mbit and compression == "none":
            plain = row
        if plain is not None:
            row["speedup"] = round(plain["step_seconds"] / row["step_seconds"], 2)
        emit(row, FLAGS.out)
        rows.append(row)
    print(f"\n{FLAGS.link_workers} workers, links of {FLAGS.link_mbit:g} Mbit/s each way "
          f"(measured {measured:.1f}), median of {FLAGS.link_steps} steps\n"
          "| link Mbit/s | compression | step s | speedup over none |\n|---|---|---|---|")
    for r in rows:
        link = f"{r['mbit']:g}" if r["mbit"] else "unlimited"
        print(f"| {link} | {r['compression']} | {r['step_seconds']} | "
              f"{r.get('speedup', '-')} |")


def main(argv):
    del argv
    if FLAGS.link_mbit > 0:
        return run_linked()
    tfdist.use_virtual_devices(DEVICES)
    rows = []
    # PowerSGD with SGD, as its paper, and Top-K with SGD too (its error
    # feedback's bursts inflate Adam's second moment), beside an
    # uncompressed SGD run.
    runs = [(c, "adam") for c in FLAGS.compressions if not c.startswith("powersgd")]
    sgd = [(c, "sgd") for c in FLAGS.compressions if c.startswith(("powersgd", "topk"))]
    runs += [("none", "sgd")] + sgd if sgd else []
    if FLAGS.one_bit_adam_warmup:  # against the Adam runs' "none"
        runs.append(("none", "one_bit_adam"))
    curves = {}
    for name in FLAGS.models:
        plains = {}
        for compression, optimizer in runs:
            result, curves[name, f"{compression}, {optimizer}"] = run(name, compression,
                                                                     optimizer)
            if compression == "none" and optimizer != "one_bit_adam":
                plains[optimizer] = result
            plain = plains.get("adam" if optimizer == "one_bit_adam" else optimizer)
            if plain is not None:
                result["bytes_ratio"] = round(result["reduce_bytes_per_step"]
                                              / plain["reduce_bytes_per_step"], 4)
                result["loss_ratio"] = round(result["final_loss"] / plain["final_loss"], 4)
            emit(result, FLAGS.out)
            rows.append(result)
    print("\n| model | compression | optimizer | steps | bytes per step (reduce) | x none | "
          "final loss (last 20 steps) | x none | fit s |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['compression']} | {r['optimizer']} | {r['steps']} | "
              f"{r['reduce_bytes_per_step']:,} | {r.get('bytes_ratio', '-')} | "
              f"{r['final_loss']:.4f} | {r.get('loss_ratio', '-')} | {r['fit_seconds']} |")
    if FLAGS.plot:
        plot(curves, FLAGS.plot)


if __name__ == "__main__":
    app.run(main)
